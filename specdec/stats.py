"""Per-request speculation statistics: data first, exported elsewhere.

Definitions (over the rounds after prefill):
- ``drafted_tokens``: draft tokens proposed; ``accepted_tokens``: of those, kept.
- ``acceptance_rate`` = accepted / drafted (0 when nothing was drafted).
- ``mean_accepted_length``: tokens one target pass produced, on average: accepted + 1 per
  round (the recovered or bonus token included); 1.0 for plain decoding.
- ``draft_failures``: rounds whose drafter failed (a dead draft worker): they ran plainly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass
class RoundStats:
    """What one round of one request did. ``accepted`` counts drafts kept; ``emitted`` adds the
    recovered or bonus token and is cut by EOS / max_tokens."""

    index: int
    mode: str  # "prefill" (round 0), "off" (a plain step), or the drafter's name
    k: int
    drafted: int
    accepted: int
    emitted: int
    draft_s: float
    verify_s: float
    started_at: float = 0.0  # wall clock (time.time()) when the step began, for traces
    draft_error: str | None = None  # the drafter failed this round; it ran as a plain step
    events: tuple[str, ...] = ()  # the policy's decisions taken before this round ("probe:draft", ...)
    confidence: tuple[float, ...] = ()  # the drafter's probability of each draft token (none: prompt lookup)
    full: bool | None = None  # its drafts ran out unrejected (a tree: the path reached a leaf); None: unknown
    match: int = 0  # prompt lookup's rounds, run or scored in the shadow: the length of the suffix it matched

    @property
    def bonus(self) -> bool:
        return self.drafted > 0 and self.accepted == self.drafted


@dataclass(frozen=True)
class SpeculationSummary:
    mode: str
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    draft_s: float
    verify_s: float
    draft_failures: int = 0  # rounds whose drafter failed and that ran as plain steps

    @classmethod
    def from_rounds(cls, mode: str, rounds: list[RoundStats]) -> "SpeculationSummary":
        """``mode`` is the mode asked for; ``auto`` is reported as the drafter it used most."""
        decode_rounds = [r for r in rounds if r.mode != "prefill"]
        if mode == "auto":
            used = Counter(r.mode for r in decode_rounds if r.mode != "off")
            mode = used.most_common(1)[0][0] if used else "off"
        drafted = sum(r.drafted for r in decode_rounds)
        accepted = sum(r.accepted for r in decode_rounds)
        n = len(decode_rounds)
        return cls(
            mode=mode,
            rounds=n,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            mean_accepted_length=(accepted + n) / n if n else 0.0,
            draft_s=sum(r.draft_s for r in rounds),
            verify_s=sum(r.verify_s for r in rounds),
            draft_failures=sum(1 for r in rounds if r.draft_error),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between closest ranks; None and NaN are skipped,
    and no values give None.

        >>> percentile([4.0, 1.0, 3.0, 2.0], 50)
        2.5
    """
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
