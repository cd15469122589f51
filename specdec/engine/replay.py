"""The quality guard: production's check that speculation did not change what users got.

A fraction of finished greedy requests that speculated is replayed with speculation off, on
spare capacity only (``StepLoop`` admits a replay only while no live request is running or
waiting, and drops running replays the moment one arrives, to start them again later). A
greedy replay must give the same tokens; a mismatch is counted, logged with the request's
tag (its trace id), and past ``trip`` mismatches the guard trips: the unit switches
speculation off by itself (the live kill switch) and says so.

A sampled request's text is a draw, so it is checked in distribution instead: on spare
capacity the target scores the emitted tokens (one plain forward over prompt + answer, in the
unit's process) and each token ``x_t`` becomes its randomized probability integral transform
under the request's own processed distribution ``p_t`` (temperature, top-k, top-p, min_tokens):
``u_t = P_t(X < x_t) + v_t * p_t(x_t)``, ``v_t`` uniform. When every token is a draw from
``p_t`` (exact speculation), the ``u_t`` are independent and uniform on (0, 1); a verifier that
lets the drafter's distribution through makes them pile up. Each window of ``PIT_WINDOW``
values is a chi-square test of uniformity over ``PIT_BINS`` bins at significance 1e-4; a
failed window counts as a mismatch.

    >>> g = QualityGuard()
    >>> [g.wants(0.25) for _ in range(8)]
    [False, False, False, True, False, False, False, True]
    >>> g.record(True), g.record(False, trip=2), g.record(False, trip=2), g.counts()
    (False, False, True, {'replayed': 3, 'mismatches': 2, 'tripped': True})
"""

from __future__ import annotations

import math
import threading

import torch

PIT_BINS, PIT_WINDOW = 10, 200
CHI2_CRITICAL = 33.72  # chi-square, 9 degrees of freedom, significance 1e-4 (scipy.stats.chi2.ppf(1 - 1e-4, 9))


def randomized_pit(p: torch.Tensor, tokens: list[int], v: torch.Tensor) -> list[float]:
    """u_t = P_t(X < x_t) + v_t * p_t(x_t), tokens ordered by id.

    p: [n, vocab] each position's distribution; tokens: [n] what was emitted; v: [n] uniforms.

        >>> p = torch.tensor([[0.5, 0.25, 0.25]])
        >>> randomized_pit(p, [1], torch.tensor([0.5]))
        [0.625]
    """
    assert p.dim() == 2 and p.shape[0] == len(tokens) == v.shape[0], (p.shape, len(tokens), v.shape)
    x = torch.tensor(tokens)[:, None]
    below = p.cumsum(-1).gather(-1, x)[:, 0] - p.gather(-1, x)[:, 0]
    return (below + v * p.gather(-1, x)[:, 0]).clamp(0, 1).tolist()


def uniform_window_fails(us: list[float]) -> bool:
    """Whether ``us`` fail the chi-square test of uniformity (``PIT_BINS`` bins, significance 1e-4)."""
    counts = [0] * PIT_BINS
    for u in us:
        counts[min(PIT_BINS - 1, int(u * PIT_BINS))] += 1
    expected = len(us) / PIT_BINS
    return sum((c - expected) ** 2 / expected for c in counts) > CHI2_CRITICAL


class QualityGuard:
    """Which finished requests to replay (every ``1 / fraction``-th eligible one, deterministic)
    and what the replays found."""

    def __init__(self) -> None:
        self.eligible = self.replayed = self.mismatches = 0
        self.tripped = False
        self._pit: list[float] = []  # sampled requests' transforms, not yet a whole window
        self._lock = threading.Lock()

    def sampled(self, us: list[float]) -> list[bool]:
        """A scored sampled request's transforms; per window they complete: did it pass?"""
        with self._lock:
            self._pit.extend(us)
            windows = []
            while len(self._pit) >= PIT_WINDOW:
                window, self._pit = self._pit[:PIT_WINDOW], self._pit[PIT_WINDOW:]
                windows.append(not uniform_window_fails(window))
        return windows

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
