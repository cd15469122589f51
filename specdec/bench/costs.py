"""Measured costs of the pair: the draft/target step ratio ``c`` and the verify cost ``v(k)``.

Timed directly on the models (through ``BatchRunner``, the same forward, token pool and
attention the step loop uses, outside the loop, one row per pass): after prefilling a real
prompt, a 1-token forward with the cache is one *step*; a ``(k + 1)``-token forward is a
verify pass, reported relative to a step. Every pass is rolled back to the prompt, so all see
the same context length, and the kinds are interleaved so machine noise hits them alike;
medians over ``reps``. A plain step is also timed at other context lengths (``step_contexts``:
the bench's workloads decode over longer contexts than the median prompt, and a step's
attention grows with its context), each on a pool of its own, in the same repetitions; and the
bench times those steps again right beside its plain runs (``StepProbe``, ``Costs.beside``).
The target is timed in the numerics the step loop runs it in
(``invariant``): batch-invariant numerics pad a step's products and group its queries
(``specdec.batch.numerics``, ``specdec.batch.attention``), which costs a lone bf16 step of the
demo target about a fifth more on a 2-core AMD EPYC with AVX-512 BF16 (49-50 ms against 37-45
ms for the fast numerics, one run), so a step timed in the other numerics is not the loop's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.batch.blocks import run_of
from specdec.batch.runner import BatchRow, BatchRunner


@dataclass
class Costs:
    context_tokens: int
    target_step_s: float
    draft_step_s: float | None  # None without a draft model
    verify_s: dict[int, float] = field(default_factory=dict)  # k -> (k + 1)-token forward time
    numerics: str = "fast"  # the target's: "batch_invariant" or "fast"
    steps: dict[int, float] = field(default_factory=dict)  # context tokens -> a 1-token step there
    # context tokens -> 1-token steps timed right beside the plain runs at that context (``StepProbe``)
    beside: dict[int, list[float]] = field(default_factory=dict)

    def step_at(self, context: int | None) -> tuple[int, float]:
        """(context, step seconds): the median of the steps timed beside the plain runs at
        ``context``, else the step timed there with the costs, else the one at ``context_tokens``."""
        if context is not None and self.beside.get(context):
            return context, statistics.median(self.beside[context])
        if context is not None and context in self.steps:
            return context, self.steps[context]
        return self.context_tokens, self.target_step_s

    @property
    def c(self) -> float | None:
        """Draft step / target step."""
        return self.draft_step_s / self.target_step_s if self.draft_step_s is not None else None

    @property
    def v(self) -> dict[int, float]:
        """``v(k)`` = (k + 1)-token forward / 1-token forward; ``v(0) = 1``."""
        return {0: 1.0, **{k: t / self.target_step_s for k, t in sorted(self.verify_s.items())}}

    def to_dict(self) -> dict:
        return {
            "context_tokens": self.context_tokens,
            "target_step_s": self.target_step_s,
            "draft_step_s": self.draft_step_s,
            "c": self.c,
            "numerics": self.numerics,
            "v": {str(k): val for k, val in self.v.items()},
            "steps": {str(n): t for n, t in sorted(self.steps.items())},
            "steps_beside": {str(n): statistics.median(ts) for n, ts in sorted(self.beside.items()) if ts},
        }


KEY = "cost"
WARMUP_REPS = 3  # untimed repetitions before the timed ones


def _timed_pass(runner: BatchRunner, context: list[int], extra: list[int]) -> float:
    """Time one forward of ``extra`` on top of a cached ``context``, then roll back."""
    row = BatchRow(KEY, context + extra, len(extra), run_of(1, runner.capacity))
    t0 = time.perf_counter()
    runner.forward([row])
    elapsed = time.perf_counter() - t0
    runner.truncate(KEY, len(context))
    return elapsed


class StepProbe:
    """A plain 1-token target step, timed at any of ``lengths`` context tokens whenever asked
    (``step``): a pool of its own per length, prefilled once with ``context``'s tokens repeated
    (a step's cost depends on how many tokens it attends to, not which), rolled back after each
    pass. The bench times it right beside each plain run, so that plain decoding's time per
    token is compared with a step of the same minutes: this machine's speed drifts by 10-20%
    within an hour, more than the engine adds to a step."""

    def __init__(self, target_model, context: list[int], lengths, *, invariant: bool = False):
        self.runners: dict[int, tuple[BatchRunner, list[int]]] = {}
        for n in sorted({n for n in lengths if n >= 2}):
            ids = (context * (n // len(context) + 2))[: n + 1]
            runner = BatchRunner(target_model, capacity_tokens=n + 1, invariant=invariant)
            runner.forward([BatchRow(KEY, ids[:n], 1, run_of(1, n + 1))])
            self.runners[n] = runner, ids

    def step(self, n: int) -> float:
        """One timed step at ``n`` context tokens (seconds)."""
        runner, ids = self.runners[n]
        return _timed_pass(runner, ids[:n], ids[n:])

    def release(self) -> None:
        for runner, _ in self.runners.values():
            runner.release(KEY)


def measure_costs(
    target_model, draft_model, context: list[int], ks: list[int], *, reps: int = 20, warmup: int = WARMUP_REPS,
    on_rep: Callable[[], None] = lambda: None, invariant: bool = False, step_contexts: tuple[int, ...] = (),
) -> Costs:
    """Median step and verify times over ``reps`` interleaved repetitions; ``on_rep`` is called
    after each of the ``warmup + reps`` repetitions. ``invariant``: time the target in
    batch-invariant numerics (as a step loop so configured runs it). ``step_contexts``: context
    lengths at which a plain step is timed too (``Costs.steps``; ``context``'s tokens repeated:
    a step's cost depends on how many tokens it attends to, not which)."""
    if len(context) < 2:
        raise ValueError("cost measurement needs a context of at least 2 tokens")
    ks = sorted({k for k in ks if k >= 1})
    extra = (context * (max(ks, default=1) // len(context) + 2))[: max(ks, default=0) + 1]
    # A pool of its own per model, just large enough for the one sequence timed here.
    size = len(context) + len(extra)
    target = BatchRunner(target_model, capacity_tokens=size, invariant=invariant)
    draft = BatchRunner(draft_model, capacity_tokens=size) if draft_model is not None else None
    for runner in (target, draft):  # prefill
        if runner is not None:
            runner.forward([BatchRow(KEY, context, 1, run_of(1, size))])
    longer = StepProbe(target_model, context, [n for n in step_contexts if n != len(context)], invariant=invariant)
    times: dict[str, list[float]] = {"target": [], "draft": [], **{f"v{k}": [] for k in ks},
                                     **{f"at{n}": [] for n in longer.runners}}
    try:
        for rep in range(warmup + reps):
            sample = {"target": _timed_pass(target, context, extra[:1])}
            if draft is not None:
                sample["draft"] = _timed_pass(draft, context, extra[:1])
            for k in ks:
                sample[f"v{k}"] = _timed_pass(target, context, extra[: k + 1])
            for n in longer.runners:
                sample[f"at{n}"] = longer.step(n)
            if rep >= warmup:
                for key, t in sample.items():
                    times[key].append(t)
            on_rep()
    finally:
        target.release(KEY)
        if draft is not None:
            draft.release(KEY)
        longer.release()
    target_step = statistics.median(times["target"])
    return Costs(
        context_tokens=len(context),
        target_step_s=target_step,
        draft_step_s=statistics.median(times["draft"]) if draft is not None else None,
        verify_s={k: statistics.median(times[f"v{k}"]) for k in ks},
        numerics="batch_invariant" if invariant else "fast",
        steps={len(context): target_step, **{n: statistics.median(times[f"at{n}"]) for n in longer.runners}},
    )
