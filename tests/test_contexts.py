"""The actors hop carries each row's new tokens: O(new tokens) bytes per row per step."""

import pickle

import pytest

from deployments.contexts import MissingContext, Receiver, Sender
from specdec.drafters.base import DraftRow
from specdec.engine.plan import Row, StepPlan
from specdec.batch.blocks import run_of
from specdec.sampling import SamplingParams


def plan(lengths: list[int], step: int) -> StepPlan:
    return StepPlan([Row(f"r{i}", list(range(n + step)), run_of(1 + 256 * i, 4096), k=4, mode="draft",
                         params=SamplingParams(temperature=0.7, seed=i), target_seed=7 * step, draft_seed=9 * step)
                     for i, n in enumerate(lengths)])


def wire_bytes(sender: Sender, p: StepPlan) -> int:
    rows, bases = sender.cut(p.rows)
    sender.sent(p.rows)
    return len(pickle.dumps((StepPlan(rows), bases)))


def test_a_decode_step_sends_the_same_bytes_for_short_and_long_contexts():
    sizes = {}
    for n in (100, 3000):
        sender = Sender()
        first = wire_bytes(sender, plan([n] * 8, 0))
        sizes[n] = (first, [wire_bytes(sender, plan([n] * 8, s)) for s in range(1, 4)])
    (first_short, short), (first_long, long) = sizes[100], sizes[3000]
    assert first_long > first_short + 8 * 2000  # the first call carries the contexts whole
    # afterwards only each row's new token travels (larger numbers pickle a few bytes longer)
    assert all(0 <= b - a <= 4 * 8 for a, b in zip(short, long))
    assert max(long) < first_short
    whole = len(pickle.dumps((plan([3000] * 8, 1), {})))
    assert max(long) * 20 < whole


def test_the_worker_rebuilds_every_context_and_a_restarted_one_asks_for_them_whole():
    sender, worker = Sender(), Receiver()
    rows = [DraftRow("a", [1, 2, 3], 4, SamplingParams(), 0), DraftRow("b", [5], 4, SamplingParams(), 0)]
    wire, bases = sender.cut(rows)
    assert worker.restore(wire, bases) == rows
    sender.sent(rows)
    grown = [DraftRow("a", [1, 2, 3, 4], 4, SamplingParams(), 0), DraftRow("b", [5, 6, 7], 4, SamplingParams(), 0)]
    wire, bases = sender.cut(grown)
    assert [r.context for r in wire] == [[4], [6, 7]] and bases == {"a": (3, 0), "b": (1, 0)}
    assert worker.restore(wire, bases) == grown
    with pytest.raises(MissingContext):
        Receiver().restore(wire, bases)  # a restarted worker holds nothing
    sender.forget()
    wire, bases = sender.cut(grown)
    assert Receiver().restore(wire, bases) == grown
    # a released sequence is sent whole if its key ever comes back
    sender.sent(grown)
    wire, bases = sender.cut(grown[:1], release=["a"])
    assert bases == {"a": (0, 0)}
