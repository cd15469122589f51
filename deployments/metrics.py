"""Prometheus metrics of a unit, through ``ray.serve.metrics`` (Ray's metrics endpoint).

The numbers themselves come from ``specdec`` data (``RoundStats``, ``SpeculationSummary``,
the policy's summary); this module only exports them. Definitions:

- ``specdec_drafted_tokens`` / ``specdec_accepted_tokens``: draft tokens proposed / kept;
  acceptance rate = rate(accepted) / rate(drafted).
- ``specdec_accepted_length``: tokens a speculative round produced (accepted + 1).
- ``specdec_position_drafted`` / ``specdec_position_accepted``: per draft position i (0-based);
  per-position acceptance = accepted / drafted at i.
- ``specdec_fallbacks`` / ``specdec_probes``: policy switches to plain decoding / probe rounds.
- ``specdec_active_requests{mode}``: requests decoding now, by the mode they run in.
- ``specdec_ttft_seconds``, ``specdec_tpot_seconds`` (mean time per output token after the
  first), ``specdec_output_tokens_per_second`` (per request), ``specdec_output_tokens``.
"""

from __future__ import annotations

import threading

from ray.serve import metrics

from specdec.decoding import RoundStats

_LATENCY = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]
_LENGTHS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32]
_RATES = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


class UnitMetrics:
    def __init__(self) -> None:
        mode = ("mode",)
        self.drafted = metrics.Counter("specdec_drafted_tokens", "Draft tokens proposed.", tag_keys=mode)
        self.accepted = metrics.Counter("specdec_accepted_tokens", "Draft tokens accepted.", tag_keys=mode)
        self.length = metrics.Histogram(
            "specdec_accepted_length", "Tokens per speculative round (bonus included).",
            boundaries=_LENGTHS, tag_keys=mode,
        )
        pos = ("position",)
        self.pos_drafted = metrics.Counter("specdec_position_drafted", "Drafts at position i.", tag_keys=pos)
        self.pos_accepted = metrics.Counter("specdec_position_accepted", "Accepted at position i.", tag_keys=pos)
        self.fallbacks = metrics.Counter("specdec_fallbacks", "Switches to plain decoding.")
        self.probes = metrics.Counter("specdec_probes", "Probe rounds while in plain mode.")
        self.active = metrics.Gauge("specdec_active_requests", "Requests decoding now.", tag_keys=mode)
        self.ttft = metrics.Histogram("specdec_ttft_seconds", "Time to first token.", boundaries=_LATENCY)
        self.tpot = metrics.Histogram("specdec_tpot_seconds", "Time per output token.", boundaries=_LATENCY)
        self.tps = metrics.Histogram(
            "specdec_output_tokens_per_second", "Output tokens/s per request.", boundaries=_RATES
        )
        self.tokens = metrics.Counter("specdec_output_tokens", "Output tokens.")
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()  # requests start and end in many threads at once

    def set_active(self, mode: str, delta: int) -> None:
        with self._lock:
            self._active[mode] = self._active.get(mode, 0) + delta
            self.active.set(self._active[mode], tags={"mode": mode})

    def active_requests(self) -> dict[str, int]:
        with self._lock:
            return dict(self._active)

    def round(self, r: RoundStats) -> None:
        if not r.drafted:
            return
        tags = {"mode": r.mode}
        self.drafted.inc(r.drafted, tags=tags)
        if r.accepted:
            self.accepted.inc(r.accepted, tags=tags)
        self.length.observe(r.accepted + 1, tags=tags)
        for i in range(r.drafted):
            self.pos_drafted.inc(1, tags={"position": str(i)})
            if i < r.accepted:
                self.pos_accepted.inc(1, tags={"position": str(i)})

    def request(self, *, tokens: int, ttft_s: float, total_s: float, controller: dict) -> None:
        self.tokens.inc(tokens)
        self.ttft.observe(ttft_s)
        if tokens > 1:
            self.tpot.observe((total_s - ttft_s) / (tokens - 1))
        if total_s > 0:
            self.tps.observe(tokens / total_s)
        if controller.get("fallbacks"):  # the speculation controller's summary
            self.fallbacks.inc(controller["fallbacks"])
        if controller.get("probes"):
            self.probes.inc(controller["probes"])
