"""Logits processors (penalties, logit_bias, min_p) and log-probabilities under speculation, on
the tiny Llama pair in fp32 through the batched step loop.

The processors change the target's distribution ``p`` at every scored position, each position
with its own history (the drafts before it), so verification stays exact for the processed
``p``; the reference here is a plain forward with the processors written out again."""

import collections

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from specdec.bench.tiny import synthetic_corpus
from specdec.config import ModelConfig, SpeculationConfig
from specdec.engine import Engine
from specdec.loading import load_model
from specdec.sampling import SamplingParams
from three_tokens import batched_result

PROMPTS = [" ".join(p.split()[:4]) for p in synthetic_corpus(n_sentences=8, seed=7)]
MODES = [("off", None), ("draft", 3), ("ngram", 3), ("draft_tree", 3)]
PENALIZED = SamplingParams(repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.4,
                           logit_bias=((17, 2.5), (83, -4.0)))


@pytest.fixture(scope="module")
def pair(llama_pair):
    engine = Engine.load(
        ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]), dtype="float32"),
        SpeculationConfig(mode="draft", num_speculative_tokens=3, ngram_min=1, ngram_max=3),
        kv_cache_tokens=4096,
    )
    yield {"engine": engine, "target": load_model(str(llama_pair["target"]))}
    engine.loop.close()


def processed(logits: torch.Tensor, seq: list[int], prompt_len: int, params: SamplingParams) -> torch.Tensor:
    """The processors as the OpenAI API and vLLM define them, written out token by token."""
    out = logits.double().clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    r = params.repetition_penalty
    for token in set(seq):
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token, n in collections.Counter(seq[prompt_len:]).items():
        out[token] -= params.frequency_penalty * n + params.presence_penalty
    return out


def plain_greedy(model, ids: list[int], n: int, params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding by whole forwards, no cache: the tokens and each position's processed logits."""
    seq, steps = list(ids), []
    with torch.inference_mode():
        for _ in range(n):
            logits = processed(model(input_ids=torch.tensor([seq])).logits[0, -1], seq, len(ids), params)
            steps.append(logits)
            seq.append(int(logits.argmax()))
    return seq[len(ids):], steps


def test_penalized_greedy_equals_plain_decoding_under_the_same_processors(pair):
    engine, model = pair["engine"], pair["target"]
    changed = accepted = 0
    for prompt in PROMPTS[:4]:
        ids = engine.encode(prompt=prompt)
        ref, _ = plain_greedy(model, ids, 20, PENALIZED)
        changed += ref != plain_greedy(model, ids, 20, SamplingParams())[0]
        for mode, k in MODES:
            res = engine.generate(ids, max_tokens=20, mode=mode, k=k, params=PENALIZED, ignore_eos=True)
            assert res.token_ids == ref, (prompt, mode)
            accepted += res.speculation.accepted_tokens
    assert changed >= 3 and accepted > 20, (changed, accepted)  # the processors mattered; drafts were kept


def test_the_repetition_penalty_is_transformers_own():
    logits = torch.randn(1, 50)
    seq = torch.tensor([[3, 7, 7, 40]])
    ours = processed(logits[0], seq[0].tolist(), 2, SamplingParams(repetition_penalty=1.7))
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(seq, logits.clone())[0]
    assert torch.allclose(ours.float(), theirs)


def test_logprobs_are_the_targets_log_softmax_at_every_emitted_position(pair):
    """Each token's log-probability and the top 4 at its position, in every mode, greedy (T = 1)
    and sampled (after temperature, before top-k), against one plain forward over the output."""
    engine, model = pair["engine"], pair["target"]
    ids = engine.encode(prompt=PROMPTS[5])
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=20, seed=3),
                   SamplingParams(temperature=1.3, seed=4, presence_penalty=0.5)):
        for mode, k in MODES:
            res = engine.generate(ids, max_tokens=16, mode=mode, k=k, params=params, ignore_eos=True, logprobs=4)
            out = res.token_ids
            assert len(res.logprobs) == len(out) == 16
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids + out])).logits[0, len(ids) - 1: -1].double()
            temperature = params.temperature or 1.0
            for j, (token, (lp, top)) in enumerate(zip(out, res.logprobs)):
                ref = (processed(logits[j], ids + out[:j], len(ids), params) / temperature).log_softmax(-1)
                assert lp == pytest.approx(float(ref[token]), abs=1e-4), (mode, params, j)
                assert [t for t, _ in top] == ref.topk(4).indices.tolist(), (mode, j)
                assert [v for _, v in top] == pytest.approx(ref.topk(4).values.tolist(), abs=1e-4)
                if params.greedy:
                    assert top[0][0] == token
    none = engine.generate(ids, max_tokens=4, mode="draft", k=3, ignore_eos=True)
    assert none.logprobs is None
    zero = engine.generate(ids, max_tokens=4, mode="draft", k=3, ignore_eos=True, logprobs=0)
    assert [top for _, top in zero.logprobs] == [()] * 4
    with pytest.raises(ValueError, match="logprobs"):
        engine.request(ids, max_tokens=4, logprobs=21)


def test_min_p_drops_what_it_should_and_not_the_argmax(pair):
    engine, model = pair["engine"], pair["target"]
    ids = engine.encode(prompt=PROMPTS[6])
    greedy = engine.generate(ids, max_tokens=12, mode="off", ignore_eos=True).token_ids
    assert engine.generate(ids, max_tokens=12, mode="draft", k=3, ignore_eos=True,
                           params=SamplingParams(min_p=0.9)).token_ids == greedy
    params = SamplingParams(temperature=1.0, min_p=0.3, seed=5)
    for mode, k in MODES:
        out = engine.generate(ids, max_tokens=30, mode=mode, k=k, params=params, ignore_eos=True).token_ids
        with torch.inference_mode():
            probs = model(input_ids=torch.tensor([ids + out])).logits[0, len(ids) - 1: -1].double().softmax(-1)
        chosen = probs[torch.arange(len(out)), torch.tensor(out)]
        assert (chosen >= 0.3 * probs.max(-1).values - 1e-9).all(), mode


def test_penalized_sampling_has_the_penalized_distribution(pair, monkeypatch):
    """Chi-square over the first 3 tokens (top_k=3 after min_p, penalties and a bias: 27 cells)
    at significance 1e-3, 2000 seeded samples of the draft mode at k = 2, batched 16 at a time,
    against the exact processed distribution. Negative control: verification that leaves the
    processors out (the drafts still follow them) fails the same test."""
    import specdec.batch.verify as batch_verify

    engine, model = pair["engine"], pair["target"]
    ids = engine.encode(prompt=PROMPTS[4])
    with torch.inference_mode():
        third = int(model(input_ids=torch.tensor([ids])).logits[0, -1].topk(3).indices[2])
    params = SamplingParams(temperature=1.0, top_k=3, min_p=0.05, repetition_penalty=2.0, presence_penalty=2.0,
                            logit_bias=((third, 1.0),))
    honest = batched_result(engine, ids, 2000, "draft", k=2, params=params)
    assert honest["drafted"] >= 2000 and honest["impossible"] == 0 and honest["p"] > 1e-3, honest
    monkeypatch.setattr(batch_verify, "penalize", lambda logits, *args: logits.float())
    control = batched_result(engine, ids, 500, "draft", k=2, params=params)
    print(f"penalized chi-square: p = {honest['p']:.3g}; processors left out of verification: {control}")
    assert control["impossible"] > 0 or control["p"] < 1e-3, control


def test_choices_seeded_from_one_seed_are_independent(pair, monkeypatch):
    """``n`` choices: choice i of a request seeded s samples with ``choice_seed(s, i)``. Over 400
    seeded requests of 2 choices (the first token, top_k=3, T = 1), choice 1's token is
    distributed as the target's p (goodness of fit) and independent of choice 0's (a 3x3
    contingency table), at significance 1e-3. Negative control: every choice keeps the
    request's seed, and the contingency test fails."""
    from scipy.stats import chi2_contingency, chisquare

    import specdec.engine.plan as plan

    engine, model = pair["engine"], pair["target"]
    ids = engine.encode(prompt=PROMPTS[1])
    with torch.inference_mode():
        p = model(input_ids=torch.tensor([ids])).logits[0, -1].double().softmax(-1)
    top = p.topk(3).indices.tolist()
    exact = (p[top] / p[top].sum()).tolist()

    def pairs(seed_of) -> list[tuple[int, int]]:
        out = []
        for base in range(0, 400, 8):
            handles = [[engine.loop.submit(engine.request(ids, max_tokens=1, ignore_eos=True, params=SamplingParams(
                1.0, top_k=3, seed=seed_of(s, i)))) for i in range(2)] for s in range(base, base + 8)]
            out += [tuple(top.index(next(iter(h)).token_ids[0]) for h in two) for two in handles]
        return out

    def table(obs):
        counts = [[0] * 3 for _ in range(3)]
        for a, b in obs:
            counts[a][b] += 1
        return counts

    honest = pairs(plan.choice_seed)
    fit = chisquare([sum(1 for _, b in honest if b == r) for r in range(3)], [e * 400 for e in exact]).pvalue
    independent = chi2_contingency(table(honest)).pvalue
    shared = chi2_contingency(table(pairs(lambda s, i: s))).pvalue
    print(f"choices: fit p = {fit:.3g}, independence p = {independent:.3g}; one seed for both: p = {shared:.3g}")
    assert fit > 1e-3 and independent > 1e-3 and shared < 1e-3
