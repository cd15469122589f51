"""The quality guard in production: replays on spare capacity, mismatches counted, the kill switch."""

import threading
import time

import pytest

from specdec.batch import verify as batch_verify
from specdec.config import ModelConfig
from specdec.engine import Engine
from specdec.engine.loop import StepLoop
from specdec.policy import PolicyConfig
from specdec.verify import Verdict

PROMPTS = ["The cat", "A dog sees", "My friend likes the", "Our teacher paints"]


@pytest.fixture
def engine(llama_pair):
    e = Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]), dtype="float32"),
                    max_num_seqs=4)
    e.policy_config = PolicyConfig(replay_fraction=1.0, replay_trip=2)
    yield e
    e.loop.close()


def _wait_replays(engine, n, timeout=60.0):
    deadline = time.monotonic() + timeout
    while engine.loop.quality.counts()["replayed"] < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.loop.quality.counts()


def _speculate(engine, prompt, k=4):
    return engine.generate(engine.encode(prompt=prompt), max_tokens=16, mode="draft", k=k)


def test_a_correct_unit_replays_and_finds_nothing(engine):
    outs = [_speculate(engine, p) for p in PROMPTS]
    assert all(o.speculation.drafted_tokens > 0 for o in outs)
    counts = _wait_replays(engine, len(PROMPTS))
    assert counts == {"replayed": 4, "mismatches": 0, "tripped": False}
    engine.generate(engine.encode(prompt="The cat"), max_tokens=8, mode="off")  # plain: never replayed
    assert _wait_replays(engine, 5, timeout=1.0)["replayed"] == 4
    assert not engine.policy_config.kill_switch


def test_a_verifier_that_accepts_every_draft_trips_the_kill_switch(engine, monkeypatch):
    def accept_all(row, target):  # the planted fault
        return Verdict(tokens=[*row.drafts, target[len(row.drafts)]], num_accepted=len(row.drafts),
                       num_drafted=len(row.drafts))

    monkeypatch.setattr(batch_verify, "_match", accept_all)
    seen = []
    engine.loop.on_replay = lambda match, req: seen.append(match)
    for p in PROMPTS:
        _speculate(engine, p)
    counts = _wait_replays(engine, len(PROMPTS))
    assert counts["mismatches"] >= 2 and counts["tripped"] and seen.count(False) == counts["mismatches"]
    assert engine.policy_config.kill_switch  # switched off by itself
    after = _speculate(engine, PROMPTS[0])
    assert after.speculation.drafted_tokens == 0  # every request now decodes plainly


def test_replays_never_share_a_step_with_live_requests(engine, monkeypatch):
    """Replays run only while no live request is in the unit, and give way the moment one comes."""
    mixed, steps = [], []
    real = StepLoop._step

    def spy(self, lives):
        replays = sum(lv.expected is not None for lv in lives)
        steps.append(replays)
        if 0 < replays < len(lives):
            mixed.append(len(lives))
        return real(self, lives)

    monkeypatch.setattr(StepLoop, "_step", spy)
    for p in PROMPTS:
        _speculate(engine, p)
    # live requests arrive while the replays run
    threads = [threading.Thread(target=_speculate, args=(engine, p)) for p in PROMPTS[:2]]
    time.sleep(0.01)
    [t.start() for t in threads]
    [t.join() for t in threads]
    counts = _wait_replays(engine, 6)
    assert counts["replayed"] == 6 and counts["mismatches"] == 0
    assert any(steps) and mixed == []


def test_randomized_pit_is_uniform_for_draws_from_p_and_not_for_draws_from_q():
    """The sampled check's statistic on its own: draws from p pass, draws from another q fail."""
    import torch

    from specdec.engine.replay import PIT_WINDOW, randomized_pit, uniform_window_fails

    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(PIT_WINDOW, 50, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(PIT_WINDOW, 50, generator=gen) * 2, -1)
    v = torch.rand(PIT_WINDOW, generator=gen)
    from_p = torch.multinomial(p, 1, generator=gen)[:, 0].tolist()
    from_q = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
    assert not uniform_window_fails(randomized_pit(p, from_p, v))
    assert uniform_window_fails(randomized_pit(p, from_q, v))


def _sampled(engine, n_requests=48):
    """Seeded sampled requests, 24 tokens each: 48 give five windows of 200 tokens. (With 24, a
    verifier that keeps every draft failed a window in 5 of 6 seed sets on the tiny pair: the
    check's significance is 1e-4, so a control needs the windows; with 48, in 8 of 8.)"""
    from specdec.sampling import SamplingParams

    for i in range(n_requests):
        engine.generate(engine.encode(prompt=PROMPTS[i % len(PROMPTS)]), max_tokens=24, mode="draft", k=4,
                        params=SamplingParams(temperature=1.0, seed=i))


def _wait_sampled(engine, timeout=60.0):
    deadline = time.monotonic() + timeout
    while (engine.loop._scores or engine.loop.quality.counts()["replayed"] < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.loop.quality.counts()


def test_sampled_answers_of_a_correct_unit_pass_the_distribution_check(engine):
    _sampled(engine)
    counts = _wait_sampled(engine)
    assert counts["replayed"] >= 2 and counts["mismatches"] == 0  # 48 x 24 tokens: five windows of 200


def test_a_verifier_that_skips_rejection_fails_the_distribution_check(engine, monkeypatch):
    import torch

    monkeypatch.setattr(batch_verify, "acceptance_probs", lambda x, q, p: torch.ones(len(x)))  # every draft kept
    _sampled(engine)
    counts = _wait_sampled(engine)
    assert counts["replayed"] >= 2 and counts["mismatches"] >= 1
