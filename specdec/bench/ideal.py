"""The speedup speculative decoding can reach at best, from acceptance and measured costs.

Notation (Leviathan et al. 2023, section 3.5):

- ``a``: the probability that a draft token is accepted, assumed the same at every position
  (measured: accepted / drafted);
- ``k``: draft tokens per round;
- ``c``: cost ratio, one draft step over one target step (single-token forwards with KV cache);
- ``v(k)``: verify cost, one ``(k + 1)``-token target forward over a 1-token forward
  (``v(0) = 1``: a round with no drafts is a plain step).

A round emits the accepted drafts plus one recovered or bonus token. With i.i.d. acceptance
the number of tokens per round has mean ``E = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)``
and the round costs ``k c + v(k)`` target steps, so against plain decoding (one token per
target step)::

    ideal = E / (k c + v(k))

Worked example: a = 0.6, k = 4, c = 0.1, v(4) = 1.1::

    E     = (1 - 0.6**5) / (1 - 0.6) = 0.92224 / 0.4 = 2.3056
    cost  = 4 * 0.1 + 1.1           = 1.5
    ideal = 2.3056 / 1.5            = 1.5371

    >>> round(ideal_speedup(0.6, 4, 0.1, 1.1), 4)
    1.5371

Limits: ``a = 0`` gives ``1 / (k c + v)`` (every round pays for k drafts and emits one token);
``a -> 1`` gives ``(k + 1) / (k c + v)``; ``k = 0`` gives ``1 / v(0) = 1``.

Measured speedup / ideal is the loop's *efficiency*: what per-step overhead (Python, cache
bookkeeping, sampling) leaves of what the costs and acceptance allow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from specdec.policy import expected_speedup, expected_tokens


def ideal_speedup(a: float, k: int, c: float, v: float) -> float:
    """``E[tokens/round] / (k c + v(k))``: the speedup over plain decoding at fixed ``k``
    (the policy's ``expected_speedup`` with a verify cost ``v`` for this ``k``)."""
    return expected_speedup(a, k, c, lambda _: v)


def ideal_speedup_rounds(
    rounds: Iterable[tuple[float, int, float]], v: Callable[[int], float] | Mapping[int, float]
) -> float:
    """The ideal speedup of a run whose rounds differ: ``(a, k, c)`` per round.

    Adaptive k, a policy that switches drafter or falls back to plain steps (``k = 0``), an
    n-gram drafter that finds no match, and the end of a request all make rounds differ;
    the run's ideal is then the expected tokens of all its rounds over their expected cost::

        sum_r E(a_r, k_r) / sum_r (k_r c_r + v(k_r))

    with ``a_r`` and ``c_r`` those of the drafter that drafted round ``r``. For identical
    rounds it is ``ideal_speedup(a, k, c, v(k))``. No rounds: 1.0.
    """
    verify = v if callable(v) else v.__getitem__
    tokens = cost = 0.0
    for a, k, c in rounds:
        tokens += expected_tokens(a, k)
        cost += k * c + (1.0 if k == 0 else verify(k))  # k draft steps and one verify pass
    return tokens / cost if cost else 1.0


def ideal_speedup_measured(
    rounds: Iterable[tuple[int, int, float]], v: Callable[[int], float] | Mapping[int, float]
) -> float:
    """The ideal speedup of a run from the tokens its rounds really produced: ``(tokens, k, c)``
    per round (``tokens`` = accepted drafts + 1)::

        sum_r tokens_r / sum_r (k_r c_r + v(k_r))

    Unlike ``ideal_speedup_rounds`` it assumes nothing about how acceptance falls along a
    round: prompt lookup on a grounded prompt accepts whole runs or nothing, which the i.i.d.
    formula underestimates badly (efficiencies of 1.5-1.8 that measure nothing). What is
    left between this ideal and the measured speedup is the loop's own overhead.

        >>> ideal_speedup_measured([(5, 4, 0.0), (1, 4, 0.0), (1, 0, 0.0)], {4: 1.1})
        2.1875
    """
    verify = v if callable(v) else v.__getitem__
    tokens = cost = 0.0
    for n, k, c in rounds:
        tokens += n
        cost += k * c + (1.0 if k == 0 else verify(k))  # k draft steps and one verify pass
    return tokens / cost if cost else 1.0


def per_position_acceptance(rounds: Iterable[tuple[int, int]]) -> list[float]:
    """Acceptance at each draft position from per-round ``(drafted, accepted)`` pairs.

    Position ``i`` (0-based) was drafted in the rounds with ``drafted > i`` and accepted in
    those with ``accepted > i`` (acceptance stops at the first rejection). Returns one rate
    per position up to the longest round; ``[]`` when nothing was drafted.

        >>> per_position_acceptance([(2, 2), (2, 0), (3, 1)])
        [0.6666666666666666, 0.3333333333333333, 0.0]
    """
    drafted: list[int] = []
    accepted: list[int] = []
    for d, acc in rounds:
        if not 0 <= acc <= d:
            raise ValueError(f"a round cannot accept {acc} of {d} drafts")
        for i in range(d):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += 1
            accepted[i] += int(acc > i)
    return [acc / d for acc, d in zip(accepted, drafted)]


def interpolate_verify_cost(measured: Mapping[int, float]) -> Callable[[int], float]:
    """``v(k)`` for any ``k >= 0`` from measurements at some ``k``: exact where measured,
    linear between neighbours, extrapolated from the last two beyond them (``v(0) = 1``)."""
    points = sorted({0: 1.0, **{int(k): float(val) for k, val in measured.items()}}.items())

    def v(k: int) -> float:
        if k <= 0:
            return 1.0
        for (k0, v0), (k1, v1) in zip(points, points[1:]):
            if k0 <= k <= k1:
                return v0 + (v1 - v0) * (k - k0) / (k1 - k0)
        (k0, v0), (k1, v1) = points[-2:] if len(points) > 1 else ((0, 1.0), (1, 1.0))
        return max(v1, v1 + (v1 - v0) * (k - k1) / (k1 - k0))

    return v
