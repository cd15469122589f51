"""Measured costs of the pair: the draft/target step ratio ``c`` and the verify cost ``v(k)``.

Timed directly on the models (through ``ModelRunner``, the same forward and KV cache the
loop uses, outside the loop): after prefilling a real prompt, a 1-token forward with the
cache is one *step*; a ``(k + 1)``-token forward is a verify pass, reported relative to a
step. Every pass is cropped back to the prompt, so all see the same context length, and
the kinds are interleaved so machine noise hits them alike; medians over ``reps``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from specdec.runner import ModelRunner


@dataclass
class Costs:
    context_tokens: int
    target_step_s: float
    draft_step_s: float | None  # None without a draft model
    verify_s: dict[int, float] = field(default_factory=dict)  # k -> (k + 1)-token forward time

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
            "v": {str(k): val for k, val in self.v.items()},
        }


def _timed_pass(runner: ModelRunner, context: list[int], extra: list[int]) -> float:
    """Time one forward of ``extra`` on top of a cached ``context``, then crop back."""
    t0 = time.perf_counter()
    runner.forward("cost", context + extra, len(extra))
    elapsed = time.perf_counter() - t0
    runner.rollback("cost", len(context))
    return elapsed


def measure_costs(
    target_model, draft_model, context: list[int], ks: list[int], *, reps: int = 20, warmup: int = 3
) -> Costs:
    """Median step and verify times over ``reps`` interleaved repetitions."""
    if len(context) < 2:
        raise ValueError("cost measurement needs a context of at least 2 tokens")
    ks = sorted({k for k in ks if k >= 1})
    target = ModelRunner(target_model)
    draft = ModelRunner(draft_model) if draft_model is not None else None
    extra = (context * (max(ks, default=1) // len(context) + 2))[: max(ks, default=0) + 1]
    target.forward("cost", context, 1)  # prefill
    if draft is not None:
        draft.forward("cost", context, 1)
    times: dict[str, list[float]] = {"target": [], "draft": [], **{f"v{k}": [] for k in ks}}
    try:
        for rep in range(warmup + reps):
            sample = {"target": _timed_pass(target, context, extra[:1])}
            if draft is not None:
                sample["draft"] = _timed_pass(draft, context, extra[:1])
            for k in ks:
                sample[f"v{k}"] = _timed_pass(target, context, extra[: k + 1])
            if rep >= warmup:
                for key, t in sample.items():
                    times[key].append(t)
    finally:
        target.release("cost")
        if draft is not None:
            draft.release("cost")
    target_step = statistics.median(times["target"])
    return Costs(
        context_tokens=len(context),
        target_step_s=target_step,
        draft_step_s=statistics.median(times["draft"]) if draft is not None else None,
        verify_s={k: statistics.median(times[f"v{k}"]) for k in ks},
    )
