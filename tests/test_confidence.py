"""Confidence-aware drafting: a chain stops where the drafter is unsure, the stop is adapted per
request from which drafts were kept, and the output stays exact (greedy token for token,
sampled in distribution)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.config import ModelConfig, SpeculationConfig
from specdec.drafters.base import Chains, DraftRow
from specdec.engine import Engine
from specdec.engine.schedule import StepCosts
from specdec.policy import PolicyConfig, SpeculationPolicy
from specdec.sampling import SamplingParams
from specdec.stats import RoundStats
from three_tokens import batched_result


def _logits(probs: list[float], vocab: int = 8) -> torch.Tensor:
    """Logits whose softmax gives token 0 probability p (the rest spread evenly)."""
    rows = []
    for p in probs:
        rest = (1 - p) / (vocab - 1)
        rows.append(torch.log(torch.tensor([p] + [rest] * (vocab - 1))))
    return torch.stack(rows)


def test_a_chain_stops_once_the_product_of_its_confidences_falls_below_the_rows_stop():
    rows = [DraftRow("a", [1], 5, SamplingParams(), 0, stop_below=0.0),
            DraftRow("b", [1], 5, SamplingParams(), 0, stop_below=0.5),
            DraftRow("c", [1], 5, SamplingParams(), 0, stop_below=0.2)]
    chains = Chains(rows)
    steps = [0.9, 0.7, 0.6, 0.9, 0.9]  # products: 0.9, 0.63, 0.378, 0.340, 0.306
    lengths = []
    for p in steps:
        live = chains.live()
        if not live:
            break
        chains.extend(_logits([p] * len(live)), live)
        lengths.append(len(live))
    drafted = chains.drafted().proposals
    assert [len(d) for d in drafted] == [5, 3, 5]  # b: 0.378 < 0.5 after the third token
    assert drafted[1].tokens == [0, 0, 0]  # the token that crossed the line is still proposed
    assert drafted[0].confidence == pytest.approx(tuple(steps))
    assert lengths == [3, 3, 3, 2, 2]  # b left the batch after three passes
    assert math.prod(drafted[2].confidence) == pytest.approx(0.9 * 0.7 * 0.6 * 0.9 * 0.9)


def test_a_sampled_rows_confidence_is_q_of_its_token():
    rows = [DraftRow("s", [1], 2, SamplingParams(temperature=1.0), seed=3, stop_below=0.0)]
    chains = Chains(rows)
    for _ in range(2):
        chains.extend(_logits([0.5]), chains.live())
    (p,) = chains.drafted().proposals
    assert p.probs is not None and len(p.confidence) == 2
    for token, q, c in zip(p.tokens, p.probs, p.confidence):
        assert c == pytest.approx(float(q[token]))


def _policy(cfg: PolicyConfig = PolicyConfig(), **kw) -> SpeculationPolicy:
    costs = StepCosts()
    costs.observe_verify(1, 0.01)
    return SpeculationPolicy(modes=["draft"], costs=costs, config=lambda: cfg, **kw)


def test_the_stop_follows_costs_and_calibration_and_is_off_for_an_explicit_k():
    assert _policy(adaptive=False, k_request=4).stop_below("draft") == 0.0
    assert _policy(PolicyConfig(confidence_stop=False)).stop_below("draft") == 0.0
    policy = _policy()
    base = policy.stop_below("draft")
    assert 0.0 < base < 1.0
    # an overconfident drafter (predicted to keep ~2.6 drafts a round, keeps 0) gets a higher stop
    rounds = [RoundStats(0, "prefill", 0, 0, 0, 1, 0.0, 0.01)]
    for i in range(1, 8):
        rounds.append(RoundStats(i, "draft", 4, 4, 0, 1, 0.001, 0.01, confidence=(0.9, 0.9, 0.9, 0.9)))
    policy.observe(rounds)
    assert policy.stop_below("draft") > base
    # an underconfident one (predicted to keep ~0.2, keeps all 4) gets a lower one
    shy = _policy()
    shy.observe([rounds[0]] + [RoundStats(i, "draft", 4, 4, 4, 5, 0.001, 0.01, confidence=(0.2, 0.9, 0.9, 0.9))
                               for i in range(1, 8)])
    assert shy.stop_below("draft") < base


@pytest.fixture(scope="module")
def engine(llama_pair):
    return Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]),
                                   dtype="float32"), SpeculationConfig(), kv_cache_tokens=4096)


def test_greedy_output_with_confidence_stops_equals_plain_decoding(engine, monkeypatch):
    """auto and an adaptive draft request stop chains by confidence; the tokens stay plain
    decoding's. The stop is pinned high, and the costs low, so that chains are long enough to
    stop (whatever this machine's timings)."""
    monkeypatch.setattr(SpeculationPolicy, "stop_below", lambda self, mode: 0.6)
    monkeypatch.setattr(engine.costs, "c", lambda mode: 0.05)
    monkeypatch.setattr(engine.costs, "v", lambda k: 1 + 0.02 * k)
    stopped = accepted = 0
    for prompt in ["The cat sees the", "My friend builds a", "The robot finds the old house. The robot"]:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=32, mode="off", ignore_eos=True)
        for mode in ("draft", "auto"):
            spec = engine.generate(ids, max_tokens=32, mode=mode, ignore_eos=True)
            assert spec.token_ids == plain.token_ids, (prompt, mode)
            drafting = [r for r in spec.rounds if r.drafted and r.mode == "draft"]
            stopped += sum(1 for r in drafting if r.drafted < r.k)
            accepted += sum(r.accepted for r in spec.rounds)
            assert all(len(r.confidence) == r.drafted for r in drafting)
    assert stopped > 0 and accepted > 10, (stopped, accepted)


def test_sampled_output_of_confidence_stopped_chains_has_the_target_distribution(engine, monkeypatch):
    """Chi-square over the first 4 sampled tokens (top_k=3: 81 cells) at significance 1e-3, 3000
    seeded samples batched 16 at a time. After the prefill's token a round may draft a chain of
    2, which the confidence stop (pinned at 0.35) cuts to 1 where the draft is unsure, so
    proposals of both lengths mix. Negative control: a verifier that accepts every draft fails
    the same test."""
    import specdec.batch.verify as batch_verify

    monkeypatch.setattr(SpeculationPolicy, "stop_below", lambda self, mode: 0.35)
    ids = engine.encode(prompt="The robot finds the old house. The robot")
    n, lengths = 3000, {}
    real = SpeculationPolicy.observe

    def count(self, rounds):  # the chain lengths the first draft rounds proposed
        if len(rounds) == 2 and rounds[1].k == 2:
            lengths[rounds[1].drafted] = lengths.get(rounds[1].drafted, 0) + 1
        return real(self, rounds)

    monkeypatch.setattr(SpeculationPolicy, "observe", count)
    honest = batched_result(engine, ids, n, "draft", k=2, length=4)
    assert honest["drafted"] >= n and honest["impossible"] == 0 and honest["p"] > 1e-3, honest
    assert lengths.get(1, 0) > 100 and lengths.get(2, 0) > 100, lengths  # both lengths, many times
    monkeypatch.setattr(batch_verify, "acceptance_probs", lambda x, q, p: torch.ones(len(x)))
    control = batched_result(engine, ids, n, "draft", k=2, length=4)
    assert control["impossible"] > 0 or control["p"] < 1e-3, control
