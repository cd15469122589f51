"""Structured output under speculation, on the tiny Llama pair in fp32 through the step loop:
the grammar masks the target's p at every scored position, so greedy output is plain
constrained decoding's (transformers' generate with xgrammar's own logits processor, the
reference) and sampled output has the constrained distribution."""

import json
from collections import Counter

import pytest
import torch
import xgrammar.contrib.hf as xgr_hf
from scipy.stats import chisquare

from specdec import grammar
from specdec.config import ModelConfig, SpeculationConfig
from specdec.engine import Engine
from specdec.grammar import GrammarSpec
from specdec.loading import load_model
from specdec.sampling import SamplingParams

MODES = [("off", None), ("draft", 3), ("ngram", 3), ("draft_tree", 3)]
# Bounded, so that even a tiny model's answer ends: after the object only EOS is allowed.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                         "maximum": 120}, "ok": {"type": "boolean"}}}
PERSON = GrammarSpec("json_schema", json.dumps(SCHEMA))
PROMPTS = ["the cat sees", "my friend builds the old", "def f1(x): return x +", "the robot finds"]


@pytest.fixture(scope="module")
def pair(llama_pair):
    engine = Engine.load(
        ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]), dtype="float32"),
        SpeculationConfig(mode="draft", num_speculative_tokens=3, ngram_min=1, ngram_max=3),
        kv_cache_tokens=8192,
    )
    yield {"engine": engine, "target": load_model(str(llama_pair["target"]))}
    engine.loop.close()


def valid(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == {"name", "age", "ok"} and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and type(obj["age"]) is int and 0 <= obj["age"] <= 120 and type(obj["ok"]) is bool)


def test_greedy_structured_output_equals_plain_constrained_decoding(pair):
    engine, model = pair["engine"], pair["target"]
    eos = sorted(engine.eos_token_ids)
    compiled = grammar.tracker().grammars.compile(PERSON)
    accepted = 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt=prompt)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=80, eos_token_id=eos,
                                 pad_token_id=0, logits_processor=[xgr_hf.LogitsProcessor(compiled)])[0, len(ids):]
        ref = ref.tolist()
        for mode, k in MODES:
            res = engine.generate(ids, max_tokens=80, mode=mode, k=k, grammar=PERSON)
            assert res.token_ids == ref, (prompt, mode)
            assert res.finish_reason == "stop" and valid(res.text), res.text
            accepted += res.speculation.accepted_tokens
    assert accepted > 40, accepted  # drafts stayed inside the grammar and were kept


def test_fifty_requests_all_parse_and_validate_greedy_and_sampled_batched(pair):
    engine = pair["engine"]
    handles = []
    for i in range(50):
        params = SamplingParams() if i % 2 else SamplingParams(temperature=1.0, seed=i)
        mode, k = MODES[i % 4]
        req = engine.request(engine.encode(prompt=PROMPTS[i % 4]), max_tokens=80, params=params, mode=mode, k=k,
                             grammar=PERSON)
        handles.append(engine.loop.submit(req))
    texts = ["".join(e.text for e in h) for h in handles]
    bad = [t for t in texts if not valid(t)]
    assert not bad, bad[:3]
    engine.generate(engine.encode(prompt="x"), max_tokens=2)  # the next step tells both sides what ended
    assert len(grammar.tracker()) == 0  # finished requests' matchers were released


def test_a_grammar_that_cannot_compile_is_a_value_error(pair):
    engine = pair["engine"]
    with pytest.raises(ValueError, match="could not be compiled"):
        engine.request(engine.encode(prompt="x"), max_tokens=4, grammar=GrammarSpec("regex", "(unclosed"))


def _exact(model, ids: list[int], g, eos: set[int]) -> dict[tuple[int, ...], float]:
    """Every token sequence the grammar allows, with its probability under the constrained p (T = 1)."""
    out = {}

    def walk(seq: list[int], prob: float) -> None:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids + seq])).logits[0, -1].double()
        allowed = g.grammars.after(g.grammars.matcher(CHOICES, []), seq, logits.shape[-1])
        p = logits.masked_fill(~allowed, -torch.inf).softmax(-1)
        for token in allowed.nonzero()[:, 0].tolist():
            if token in eos:
                out[tuple(seq + [token])] = prob * float(p[token])
            else:
                walk(seq + [token], prob * float(p[token]))

    walk([], 1.0)
    return out


CHOICES = GrammarSpec("choice", json.dumps(["cat", "dog", "tree", "the old house"]))


def test_sampled_structured_output_has_the_constrained_distribution(pair, monkeypatch):
    """Chi-square over every token sequence a choice grammar allows (its exact probability under
    the constrained p, enumerated), 1,500 seeded samples of the draft mode at k = 3 batched 16 at
    a time, significance 1e-3. Negative control: verification that leaves the grammar out (the
    drafts stay masked) fails: its answers leave the grammar."""
    import specdec.batch.verify as batch_verify

    engine, model = pair["engine"], pair["target"]
    ids = engine.encode(prompt=PROMPTS[1])
    exact = _exact(model, ids, grammar.tracker(), set(engine.eos_token_ids))
    longest = max(map(len, exact))  # room for every allowed sequence (a spelled-out one takes 14 tokens)

    def sample(n: int) -> Counter:
        counts: Counter = Counter()
        for base in range(0, n, 16):
            handles = [engine.loop.submit(engine.request(ids, max_tokens=longest, mode="draft", k=3, grammar=CHOICES,
                                                         params=SamplingParams(temperature=1.0, seed=s)))
                       for s in range(base, min(n, base + 16))]
            for h in handles:
                seq = tuple(t for e in h for t in e.token_ids)
                counts[seq if seq in exact else "outside"] += 1
        return counts

    n = 1500
    counts = sample(n)
    keys = sorted(exact, key=lambda s: -exact[s])
    big = [s for s in keys if exact[s] * n >= 5]
    obs = [counts[s] for s in big] + [n - sum(counts[s] for s in big)]
    exp = [exact[s] * n for s in big] + [n - sum(exact[s] * n for s in big)]
    p_value = chisquare(obs, exp).pvalue
    monkeypatch.setattr(batch_verify, "_constrain", lambda rows, logits, starts: logits)
    control = sample(300)
    print(f"choice grammar: {len(exact)} sequences, chi-square p = {p_value:.3g}; without the grammar in "
          f"verification {control['outside']} of 300 answers left it")
    assert counts["outside"] == 0 and p_value > 1e-3
    assert control["outside"] > 30


def test_logprobs_under_a_grammar_are_finite_and_only_what_it_allows(pair):
    engine = pair["engine"]
    ids = engine.encode(prompt=PROMPTS[0])
    res = engine.generate(ids, max_tokens=12, mode="draft", k=3, grammar=CHOICES, logprobs=20)
    assert res.finish_reason == "stop" and res.text in ("cat", "dog", "tree", "the old house")
    g = grammar.tracker().grammars
    for j, (lp, top) in enumerate(res.logprobs):
        allowed = g.after(g.matcher(CHOICES, []), res.token_ids[:j], 512)
        assert lp > float("-inf") and top and all(v > float("-inf") and bool(allowed[t]) for t, v in top)
