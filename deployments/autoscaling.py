"""Speculation-aware autoscaling of SpecRouter units: a Ray Serve custom autoscaling policy.

Ray's default policy keeps ``target_ongoing_requests`` requests per replica. A speculative
unit's capacity is not a fixed number of requests: it is how many requests it can decode at
the per-request output rate we promise, and speculation changes that rate by the speedup it
buys (1.5-3x with a well-matched draft, ~1x when acceptance collapses and the router falls
back to plain decoding). A unit decodes one sequence per target pass (its target worker is
a plain Ray actor: one pass at a time; in process, the loop threads share the same cores),
so its output rate is shared by the requests it holds. This policy therefore measures each
unit's output tokens/s and sizes the fleet as

    capacity C  = requests one unit can hold at ``target_tokens_per_s`` each
    units       = demand / C,   demand = requests running + queued (Ray's own count)

Metrics each unit reports (``SpecRouter.record_autoscaling_stats`` -> ``StatsRecorder``),
averaged by Serve over ``look_back_period_s``:

- ``ongoing``: requests decoding in the unit now.
- ``tokens_per_s``: output tokens the unit produced per second since its previous report.
- ``drafted_per_s`` / ``accepted_per_s``: draft tokens proposed / accepted per second;
  the unit's acceptance rate is ``accepted_per_s / drafted_per_s``.

A unit's capacity, from its per-request rate ``r = tokens_per_s / ongoing``:

    C = r * max(ongoing, 1) / target_tokens_per_s

(``tokens_per_s / target`` when the unit was busy; ``r / target`` when it held less than one
request on average, so idle time in the window does not read as slowness), clamped to
``[1, max_requests_per_unit]``: a request never gets more than a whole unit, and a unit
never holds more than ``max_ongoing_requests``. Acceptance enters through the rate (a unit
whose drafts stop being accepted produces fewer tokens per second, so its capacity falls and
the fleet grows before queues build up); it is not a second term, which would count it
twice. It is kept in the policy state and logged with every change of decision.

Worked example: target 20 tok/s per request. A unit holding 4 requests makes 160 tok/s
(speculating, acceptance 0.8): r = 40, C = 160 / 20 = 8 requests. Demand 12 -> 1.5 units ->
2. Acceptance drops to 0.3, the router falls back to plain, the unit makes 70 tok/s: C = 3.5,
demand 12 -> 3.4 -> 4 units, where the default policy (target 4 requests per replica) would
have stayed at 3 and let every request run at 17.5 tok/s.

Hysteresis (no oscillation): scale up to ``ceil(load)`` as soon as ``load = demand / C``
exceeds the current count; scale down only to ``ceil(load / downscale_headroom)``, a count
that would run at most ``downscale_headroom`` full. Between the two the count holds, so a
constant load never flips it. Ray adds ``upscale_delay_s`` / ``downscale_delay_s`` and the
min/max bounds on top.

The module imports no Ray and no torch: Ray imports (and cloudpickles) the policy wherever
the config is parsed, so it must be cheap and self-contained.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("ray.serve")

POLICY_PATH = "deployments.autoscaling:SpeculationAwarePolicy"


@dataclass(frozen=True)
class UnitSample:
    """One unit's reported metrics, averaged over Serve's look-back window."""

    ongoing: float
    tokens_per_s: float | None = None  # None: the unit reports no rate (not measured yet)
    drafted_per_s: float | None = None
    accepted_per_s: float | None = None


@dataclass(frozen=True)
class PolicyParams:
    """The policy's knobs: ``policy_kwargs`` in ``autoscaling_config.policy``."""

    # The output rate each request should get. Pick it from the latency you promise:
    # 20 tok/s reads faster than people do; lower packs more requests per GPU.
    target_tokens_per_s: float = 20.0
    # Capacity (requests per unit) before any unit has measured its rate.
    target_ongoing_requests: float = 4.0
    # The most a unit can hold: the SpecRouter's max_ongoing_requests.
    max_requests_per_unit: float = 16.0
    # Scale down only to a count that runs at most this full (0.5-0.9): the dead band.
    downscale_headroom: float = 0.75
    # A unit's rate is trusted once it held at least this many requests on average.
    min_busy: float = 0.2

    def __post_init__(self) -> None:
        if self.target_tokens_per_s <= 0:
            raise ValueError("target_tokens_per_s must be > 0")
        if not 1 <= self.target_ongoing_requests <= self.max_requests_per_unit:
            raise ValueError("need 1 <= target_ongoing_requests <= max_requests_per_unit")
        if not 0 < self.downscale_headroom <= 1:
            raise ValueError("downscale_headroom must be in (0, 1]")
        if self.min_busy <= 0:
            raise ValueError("min_busy must be > 0")


@dataclass(frozen=True)
class Decision:
    replicas: int
    load: float  # demand in units' worth of work
    capacity: float  # requests one unit holds at the target rate
    source: str  # "measured", "remembered" or "default": where the capacity came from
    acceptance: float | None  # fleet draft acceptance over the window (None: no drafting)
    reports: int  # units whose metrics the decision saw


def unit_capacity(unit: UnitSample, params: PolicyParams) -> float | None:
    """Requests this unit can hold at ``target_tokens_per_s`` each; None if not measured."""
    if unit.tokens_per_s is None or unit.ongoing < params.min_busy:
        return None
    per_request = unit.tokens_per_s / unit.ongoing
    capacity = per_request * max(unit.ongoing, 1.0) / params.target_tokens_per_s
    return min(max(capacity, 1.0), params.max_requests_per_unit)


def fleet_acceptance(units: list[UnitSample]) -> float | None:
    drafted = sum(u.drafted_per_s or 0.0 for u in units)
    accepted = sum(u.accepted_per_s or 0.0 for u in units)
    return accepted / drafted if drafted > 0 else None


def decide(
    *,
    current: int,
    demand: float,
    units: list[UnitSample],
    params: PolicyParams,
    min_replicas: int,
    max_replicas: int,
    remembered_capacity: float | None = None,
) -> Decision:
    """The number of units for ``demand`` (requests running + queued), within the bounds.

    >>> p = PolicyParams(target_tokens_per_s=20, max_requests_per_unit=16)
    >>> decide(current=1, demand=12, units=[UnitSample(4, 160.0)], params=p,
    ...        min_replicas=1, max_replicas=8).replicas   # C = 8, load 1.5
    2
    """
    measured = [c for c in (unit_capacity(u, params) for u in units) if c is not None]
    if measured:
        capacity, source = sum(measured) / len(measured), "measured"
    elif remembered_capacity is not None:
        capacity, source = remembered_capacity, "remembered"
    else:
        capacity, source = params.target_ongoing_requests, "default"
    load = max(demand, 0.0) / capacity
    up = math.ceil(load - 1e-9)
    if up > current:
        replicas = up
    else:  # hold, or shrink to a count that would run at most `downscale_headroom` full
        replicas = min(current, math.ceil(load / params.downscale_headroom - 1e-9))
    replicas = min(max(replicas, min_replicas), max_replicas)
    return Decision(replicas, load, capacity, source, fleet_acceptance(units), len(units))


class SpeculationAwarePolicy:
    """The Ray adapter: ``autoscaling_config.policy.policy_function`` names this class.

    Ray 2.60 instantiates a class policy once with ``policy_kwargs`` and calls it with an
    ``AutoscalingContext`` every control-loop tick; it applies the upscale/downscale delays,
    scaling factors and min/max around the returned count.
    """

    def __init__(self, **kwargs):
        self.params = PolicyParams(**kwargs)  # unknown or bad kwargs fail here, at deploy

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}

        def metric(name: str, replica) -> float | None:
            value = metrics.get(name, {}).get(replica)
            return None if value is None or math.isnan(value) else float(value)

        units = []
        for replica in ctx.running_replicas:
            ongoing = metric("ongoing", replica)
            if ongoing is not None:
                units.append(
                    UnitSample(
                        ongoing,
                        metric("tokens_per_s", replica),
                        metric("drafted_per_s", replica),
                        metric("accepted_per_s", replica),
                    )
                )
        state = dict(ctx.policy_state or {})
        decision = decide(
            current=ctx.current_num_replicas,
            demand=ctx.total_num_requests,
            units=units,
            params=self.params,
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
            remembered_capacity=state.get("specdec_capacity"),
        )
        if decision.replicas != state.get("specdec_replicas"):
            log.info(
                "autoscaling %s: %d -> %d units: demand %.1f requests, %d unit reports, "
                "capacity %.2f requests/unit (%s), acceptance %s",
                ctx.deployment_name, ctx.current_num_replicas, decision.replicas,
                decision.load * decision.capacity, decision.reports, decision.capacity, decision.source,
                "n/a" if decision.acceptance is None else f"{decision.acceptance:.2f}",
            )
        state["specdec_replicas"] = decision.replicas
        if decision.source == "measured":
            state["specdec_capacity"] = decision.capacity
        if decision.acceptance is not None:
            state["specdec_acceptance"] = decision.acceptance
        return decision.replicas, state


class UnitTotals:
    """Running totals of a unit's rounds, fed by the decoding loop (``observe`` per round).

    ``tokens``: output tokens (``RoundStats.emitted``); ``drafted`` / ``accepted``: draft
    tokens proposed / kept. Loop threads call ``observe`` concurrently, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens = self.drafted = self.accepted = 0

    def observe(self, r) -> None:
        with self._lock:
            self.tokens += r.emitted
            self.drafted += r.drafted
            self.accepted += r.accepted

    def snapshot(self) -> tuple[int, int, int]:
        with self._lock:
            return self.tokens, self.drafted, self.accepted


class StatsRecorder:
    """Turns a unit's state into the metrics ``record_autoscaling_stats`` returns to Serve.

    Rates are over the interval since the previous call (Serve calls it every
    ``min(metrics_interval_s, look_back_period_s / 5)``); the first call, which has no
    interval yet, reports only ``ongoing``. Without totals (the loop does not feed any),
    only ``ongoing`` is reported, and the policy falls back to requests per unit.
    """

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._last: tuple[float, tuple[int, int, int]] | None = None

    def record(self, ongoing: int, totals: UnitTotals | None) -> dict[str, float]:
        stats = {"ongoing": float(ongoing)}
        if totals is None:
            return stats
        now, snap = self._clock(), totals.snapshot()
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            tokens, drafted, accepted = (a - b for a, b in zip(snap, self._last[1]))
            stats.update(tokens_per_s=tokens / dt, drafted_per_s=drafted / dt, accepted_per_s=accepted / dt)
        self._last = (now, snap)
        return stats
