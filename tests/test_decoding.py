"""The decoding loop end to end on tiny GPT-2 and Llama pairs (fp32: exactness)."""


import pytest
import torch

from specdec.config import ModelConfig, SpeculationConfig
from specdec.decoding import DecodeRequest, LocalTarget, decode
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.runner import ModelRunner
from specdec.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.bench.tiny import synthetic_corpus
from three_tokens import three_token_pvalue

PROMPTS = synthetic_corpus(n_sentences=20, seed=99)  # 20 prompts the models never trained on
PROMPTS = [" ".join(p.split()[:4]) for p in PROMPTS]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, llama_pair, gpt2_pair):
    paths = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return {
        "tokenizer": load_tokenizer(str(paths["target"])),
        "target": load_model(str(paths["target"])),
        "draft": load_model(str(paths["draft"])),
        "paths": paths,
    }


def run(pair, mode, prompt_ids, max_tokens, k=4, params=SamplingParams(), eos=frozenset()):
    drafter = {
        "off": None,
        "draft": ModelDrafter(ModelRunner(pair["draft"])),
        "ngram": NgramDrafter(1, 3),
    }[mode]
    request = DecodeRequest(prompt_ids, max_tokens, params=params, eos_token_ids=eos)
    steps = list(decode(LocalTarget(ModelRunner(pair["target"])), drafter, request, k=k))
    return [t for s in steps for t in s.tokens], steps


def test_greedy_equals_transformers_generate(pair):
    tok, model = pair["tokenizer"], pair["target"]
    accepted = {"draft": 0, "ngram": 0}
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ref = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
        for mode, k in [("off", 1), ("draft", 1), ("draft", 3), ("draft", 6), ("ngram", 2), ("ngram", 5)]:
            out, steps = run(pair, mode, ids, 24, k=k)
            assert out == ref, (prompt, mode, k)
            if mode != "off":
                accepted[mode] += sum(s.stats.accepted for s in steps)
    # The comparison is only meaningful if drafts were actually accepted along the way.
    assert accepted["draft"] > 50 and accepted["ngram"] > 50, accepted


def test_max_tokens_is_never_exceeded(pair):
    ids = pair["tokenizer"](PROMPTS[0])["input_ids"]
    for max_tokens in (1, 2, 3, 7):
        out, steps = run(pair, "draft", ids, max_tokens, k=8)
        assert len(out) == max_tokens
        assert steps[-1].finish_reason == "length"
        assert all(s.stats.k <= max_tokens - 1 for s in steps)


def test_eos_stops_and_is_the_last_token(pair):
    ids = pair["tokenizer"](PROMPTS[1])["input_ids"]
    out, _ = run(pair, "off", ids, 30)
    eos = out[5]  # pretend the 6th greedy token is EOS
    for mode in ("off", "draft", "ngram"):
        got, steps = run(pair, mode, ids, 30, k=4, eos=frozenset({eos}))
        assert got == out[: out.index(eos) + 1] and steps[-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(pair):
    ids = pair["tokenizer"](PROMPTS[2])["input_ids"]
    params = SamplingParams(temperature=1.0, seed=11)
    a, _ = run(pair, "draft", ids, 30, params=params)
    b, _ = run(pair, "draft", ids, 30, params=params)
    c, _ = run(pair, "draft", ids, 30, params=SamplingParams(temperature=1.0, seed=12))
    assert a == b and a != c


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=3, seed=1), SamplingParams(1.0, top_p=0.6, seed=2)])
def test_tokens_outside_top_k_top_p_never_appear(pair, params):
    ids = pair["tokenizer"](PROMPTS[3])["input_ids"]
    for mode in ("draft", "ngram"):
        out, _ = run(pair, mode, ids, 40, params=params)
        with torch.inference_mode():
            logits = pair["target"](input_ids=torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
        allowed = logits_to_probs(logits.double(), params) > 0
        assert allowed[torch.arange(len(out)), torch.tensor(out)].all(), mode


def test_sampled_speculation_has_the_target_distribution(pair):
    """Chi-square over the first 3 tokens (top_k=3: 27 cells) at significance 1e-3."""
    ids = pair["tokenizer"](PROMPTS[4])["input_ids"]
    target = LocalTarget(ModelRunner(pair["target"]))
    drafter = ModelDrafter(ModelRunner(pair["draft"]))
    pvalue, drafted = three_token_pvalue(pair["target"], ids, target, drafter, n=3000, k=3)
    assert drafted >= 3000 and pvalue > 1e-3


def test_engine_text_stop_and_statistics(pair):
    paths = pair["paths"]
    engine = Engine.load(
        ModelConfig(target=str(paths["target"]), draft=str(paths["draft"]), dtype="float32"),
        SpeculationConfig(mode="draft", num_speculative_tokens=3),
    )
    ids = engine.encode(prompt=PROMPTS[5])
    full = engine.generate(ids, max_tokens=40, mode="off")
    stop = full.text[10:13]
    res = engine.generate(ids, max_tokens=40, stop=[stop])
    assert res.finish_reason == "stop" and res.text == full.text[: full.text.index(stop)]
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    spec = engine.generate(ids, max_tokens=40).speculation
    assert spec.mode == "draft" and spec.drafted_tokens > 0
    assert spec.acceptance_rate == spec.accepted_tokens / spec.drafted_tokens
    chat = engine.encode(messages=[{"role": "user", "content": "hi"}])
    assert engine.tokenizer.decode(chat).endswith("assistant:")


def test_a_draft_with_another_vocabulary_is_refused(llama_pair, gpt2_pair, tmp_path):
    from specdec.bench.tiny import build_tokenizer

    other = tmp_path / "other"
    model = load_model(str(gpt2_pair["draft"]))
    model.save_pretrained(other)
    build_tokenizer(["completely different words here"] * 50, vocab_size=280).save_pretrained(other)
    with pytest.raises(ValueError, match="tokenizers differ"):
        Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(other), dtype="float32"))
