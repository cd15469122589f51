"""Speculative decoding end to end through the engine's batched step loop, on tiny GPT-2 and
Llama pairs (fp32: exactness). Each request here runs alone unless said otherwise;
``test_batch`` covers requests sharing steps."""


import pytest
import torch

from specdec.config import ModelConfig, SpeculationConfig
from specdec.engine import Engine
from specdec.loading import load_model
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.bench.tiny import synthetic_corpus
from three_tokens import batched_test_and_control

PROMPTS = synthetic_corpus(n_sentences=20, seed=99)  # 20 prompts the models never trained on
PROMPTS = [" ".join(p.split()[:4]) for p in PROMPTS]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, llama_pair, gpt2_pair):
    """One engine per architecture (draft mode by default, k = 3, prompt lookup over 1-3 grams)
    and the target model loaded on its own, untouched by the engine, as the reference."""
    paths = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    engine = Engine.load(
        ModelConfig(target=str(paths["target"]), draft=str(paths["draft"]), dtype="float32"),
        SpeculationConfig(mode="draft", num_speculative_tokens=3, ngram_min=1, ngram_max=3),
        kv_cache_tokens=4096,
    )
    yield {"engine": engine, "target": load_model(str(paths["target"])), "paths": paths}
    engine.loop.close()


def run(pair, mode, prompt_ids, max_tokens, k=4, params=SamplingParams(), ignore_eos=True):
    """One request alone through the step loop; EOS is ignored unless asked (the engine's
    ``eos_token_ids`` decide then)."""
    return pair["engine"].generate(prompt_ids, max_tokens=max_tokens, mode=mode, k=k if mode != "off" else None,
                                   params=params, ignore_eos=ignore_eos)


def decode_rounds(completion):
    return [r for r in completion.rounds if r.mode != "prefill"]


def test_greedy_equals_transformers_generate(pair):
    engine, model = pair["engine"], pair["target"]
    accepted = {"draft": 0, "ngram": 0}
    for prompt in PROMPTS:
        ids = engine.encode(prompt=prompt)
        ref = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
        assert len(ref) == 24
        for mode, k in [("off", 1), ("draft", 1), ("draft", 3), ("draft", 6), ("ngram", 2), ("ngram", 5)]:
            res = run(pair, mode, ids, 24, k=k)
            assert res.token_ids == ref, (prompt, mode, k)
            rounds = decode_rounds(res)
            if mode == "off":
                assert all(r.mode == "off" and r.drafted == 0 for r in rounds)
                continue
            # A named mode with an explicit k: every round drafts with that mode and exactly
            # that k (fewer only near max_tokens); it never falls back to plain steps.
            left = 24 - res.rounds[0].emitted
            for r in rounds:
                kk = min(k, left - 1)  # the last token alone: a plain step
                assert (r.mode, r.k) == ((mode, kk) if kk else ("off", 0)), (prompt, mode, k, r)
                assert r.drafted <= r.k and r.accepted <= r.drafted
                left -= r.emitted
            if mode == "draft":
                assert all(r.drafted == r.k for r in rounds)  # the draft model always drafts k
            accepted[mode] += sum(r.accepted for r in rounds)
    # The comparison is only meaningful if drafts were actually accepted along the way.
    assert accepted["draft"] > 50 and accepted["ngram"] > 50, accepted


def test_max_tokens_is_never_exceeded(pair):
    ids = pair["engine"].encode(prompt=PROMPTS[0])
    for max_tokens in (1, 2, 3, 7):
        res = run(pair, "draft", ids, max_tokens, k=8)
        assert len(res.token_ids) == max_tokens
        assert res.finish_reason == "length"
        assert all(r.k <= max_tokens - 1 for r in res.rounds)
        if max_tokens > 2:
            assert max(r.drafted for r in res.rounds) > 0  # it did speculate, within the budget


def test_eos_stops_and_is_the_last_token(pair):
    engine = pair["engine"]
    ids = engine.encode(prompt=PROMPTS[1])
    out = run(pair, "off", ids, 30).token_ids
    eos = out[5]  # pretend the 6th greedy token is EOS
    saved, engine.eos_token_ids = engine.eos_token_ids, frozenset({eos})
    try:
        for mode in ("off", "draft", "ngram"):
            res = run(pair, mode, ids, 30, k=4, ignore_eos=False)
            assert res.token_ids == out[: out.index(eos) + 1] and res.finish_reason == "stop", mode
    finally:
        engine.eos_token_ids = saved


def test_seeded_sampling_is_reproducible(pair):
    ids = pair["engine"].encode(prompt=PROMPTS[2])
    params = SamplingParams(temperature=1.0, seed=11)
    a = run(pair, "draft", ids, 30, params=params)
    b = run(pair, "draft", ids, 30, params=params)
    c = run(pair, "draft", ids, 30, params=SamplingParams(temperature=1.0, seed=12))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert a.speculation.drafted_tokens > 0


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=3, seed=1), SamplingParams(1.0, top_p=0.6, seed=2)])
def test_tokens_outside_top_k_top_p_never_appear(pair, params):
    ids = pair["engine"].encode(prompt=PROMPTS[3])
    for mode in ("draft", "ngram"):
        out = run(pair, mode, ids, 40, params=params).token_ids
        assert len(out) == 40
        with torch.inference_mode():
            logits = pair["target"](input_ids=torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
        allowed = logits_to_probs(logits.double(), params) > 0
        assert allowed[torch.arange(len(out)), torch.tensor(out)].all(), mode


def test_sampled_speculation_has_the_target_distribution(pair, monkeypatch):
    """Chi-square over the first 3 tokens (top_k=3: 27 cells) at significance 1e-3, 3000 seeded
    samples of the draft mode at k = 3, batched 16 at a time. Negative control: a verifier that
    accepts every draft (its output is the draft model's distribution) fails the same test."""
    engine = pair["engine"]
    ids = engine.encode(prompt=PROMPTS[4])
    n = 3000
    honest, control = batched_test_and_control(engine, ids, n, "draft", monkeypatch, k=3)
    assert honest["drafted"] >= n and honest["impossible"] == 0 and honest["p"] > 1e-3, honest
    assert control["impossible"] > 0 or control["p"] < 1e-3, control


def test_engine_text_stop_and_statistics(pair):
    engine = pair["engine"]
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
