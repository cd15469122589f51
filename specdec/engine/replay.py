"""The quality guard: production's check that speculation did not change what users got.

A fraction of finished greedy requests that speculated is replayed with speculation off, on
spare capacity only (``StepLoop`` admits a replay only while no live request is running or
waiting, and drops running replays the moment one arrives, to start them again later). A
greedy replay must give the same tokens; a mismatch is counted, logged with the request's
tag (its trace id), and past ``trip`` mismatches the guard trips: the unit switches
speculation off by itself (the live kill switch) and says so.

Sampled requests are not replayed: their text is a draw, and a comparison in distribution
needs many draws of the same prompt; the chi-square tests of ``tests/`` cover that offline.

    >>> g = QualityGuard()
    >>> [g.wants(0.25) for _ in range(8)]
    [False, False, False, True, False, False, False, True]
    >>> g.record(True), g.record(False, trip=2), g.record(False, trip=2), g.counts()
    (False, False, True, {'replayed': 3, 'mismatches': 2, 'tripped': True})
"""

from __future__ import annotations

import math
import threading


class QualityGuard:
    """Which finished requests to replay (every ``1 / fraction``-th eligible one, deterministic)
    and what the replays found."""

    def __init__(self) -> None:
        self.eligible = self.replayed = self.mismatches = 0
        self.tripped = False
        self._lock = threading.Lock()

    def wants(self, fraction: float) -> bool:
        """One more eligible request finished: replay it?"""
        with self._lock:
            self.eligible += 1
            n = self.eligible
        return math.floor(n * fraction + 1e-9) > math.floor((n - 1) * fraction + 1e-9)

    def record(self, match: bool, *, trip: int = 3) -> bool:
        """A replay's outcome; True the first time mismatches reach ``trip``."""
        with self._lock:
            self.replayed += 1
            self.mismatches += not match
            if self.tripped or self.mismatches < trip:
                return False
            self.tripped = True
            return True

    def counts(self) -> dict:
        with self._lock:
            return {"replayed": self.replayed, "mismatches": self.mismatches, "tripped": self.tripped}
