"""Prometheus metrics of a unit, through ``ray.serve.metrics`` (Ray's metrics endpoint).

The numbers come from ``specdec`` data (each round's ``RoundStats``, the loop's ``RoundEvent``, the
request's outcome and the policy's summary); this module only exports them. Names, types,
labels and PromQL as Prometheus shows them (``ray_`` prefix, ``_total`` on counters) are in
``docs/metrics.md``; ``cluster/grafana_dashboard.json`` charts them and ``tests/test_metrics.py``
scrapes a live unit to keep the three in step.

Labels: every series has ``model_name`` (the served name), so units of different models can
share a Prometheus. ``mode`` means two things, on purpose:

- on the speculation series (drafted, accepted, accepted length, per position) it is the
  drafter that ran the round (``draft``, ``ngram``, ``early_exit``), so an ``auto`` request's
  rounds land on the curve of the drafter it used: the curves never pool drafters;
- on the request series it is the mode the request ran in (``auto`` stays ``auto``, ``off``).

Only counters and histogram counts are exact: Ray rebuilds a worker's histogram from its
bucket counts at bucket midpoints, so a ``_sum`` is approximate. Means therefore divide
counters (mean accepted length = 1 + accepted / speculative rounds), not ``_sum / _count``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ray.serve import metrics

if TYPE_CHECKING:  # annotations only
    from specdec.engine.events import RoundEvent
    from specdec.stats import RoundStats

_LATENCY = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]
_E2E = [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300]
_QUEUE = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60]
_LENGTHS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32]
_RATES = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]

MODE = ("model_name", "mode")


class UnitMetrics:
    """One unit's metrics; ``model_name`` is set on every series as a default tag."""

    def __init__(self, model_name: str) -> None:
        self._all: list = []
        c, h = self._counter, self._histogram
        # speculation, by the drafter that ran the round
        self.drafted = c("specdec_drafted_tokens", "Draft tokens proposed.")
        self.accepted = c("specdec_accepted_tokens", "Draft tokens the target accepted.")
        self.length = h("specdec_accepted_length", "Tokens per speculative round (accepted + 1).", _LENGTHS)
        self.pos_drafted = c("specdec_position_drafted", "Drafts at position i (0-based).", ("position",))
        self.pos_accepted = c("specdec_position_accepted", "Accepted drafts at position i.", ("position",))
        # requests, by the mode they ran in
        self.fallbacks = c("specdec_fallbacks", "Policy switches to plain decoding.")
        self.probes = c("specdec_probes", "Probe rounds while in plain decoding.")
        self.requests = c("specdec_requests", "Requests finished, by finish reason.", ("finish_reason",))
        self.prompt_tokens = c("specdec_prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = c("specdec_prompt_cached_tokens",
                               "Prompt tokens whose KV came from the prefix cache (not prefilled again).")
        self.tokens = c("specdec_output_tokens", "Output tokens.")
        # what speculation saved, in billing terms: plain decoding takes one target pass per
        # output token, so output_tokens - target_passes passes were saved
        self.passes = c("specdec_target_passes", "Target forward passes that emitted tokens (one per round, "
                        "the prefill's included).")
        self.e2e = h("specdec_e2e_request_latency_seconds", "Request latency in the unit.", _E2E)
        self.queue = h("specdec_request_queue_time_seconds", "Submit to admission into the step loop.", _QUEUE)
        self.ttft = h("specdec_ttft_seconds", "Time to first token, in the unit.", _LATENCY)
        self.tpot = h("specdec_tpot_seconds", "Mean time per output token after the first.", _LATENCY)
        self.tps = h("specdec_output_tokens_per_second", "Output tokens/s of one request.", _RATES)
        # the quality guard (specdec.engine.replay), by the mode of the request replayed
        self.replays = c("specdec_quality_replays", "Finished requests replayed with speculation off, "
                         "by whether the tokens matched.", ("match",))
        self.active = metrics.Gauge("specdec_active_requests", "Requests decoding now.", tag_keys=MODE)
        self._all.append(self.active)
        for metric in self._all:
            metric.set_default_tags({"model_name": model_name})
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()  # requests start and end in many threads at once

    def _counter(self, name: str, doc: str, extra: tuple = ()) -> metrics.Counter:
        self._all.append(metrics.Counter(name, doc, tag_keys=MODE + extra))
        return self._all[-1]

    def _histogram(self, name: str, doc: str, boundaries: list) -> metrics.Histogram:
        self._all.append(metrics.Histogram(name, doc, boundaries=boundaries, tag_keys=MODE))
        return self._all[-1]

    def set_active(self, mode: str, delta: int) -> None:
        with self._lock:
            self._active[mode] = self._active.get(mode, 0) + delta
            self.active.set(self._active[mode], tags={"mode": mode})

    def active_requests(self) -> dict[str, int]:
        with self._lock:
            return dict(self._active)

    def event(self, event: RoundEvent, mode: str) -> None:
        """One event of a request running in ``mode``: its round, and on the first its queue time."""
        if event.queued_s is not None:
            self.queue.observe(event.queued_s, tags={"mode": mode})
        if event.cached_tokens:
            self.cached_tokens.inc(event.cached_tokens, tags={"mode": mode})
        self.round(event.stats)

    def round(self, r: RoundStats) -> None:
        if not r.drafted:
            return
        tags = {"mode": r.mode}
        self.drafted.inc(r.drafted, tags=tags)
        if r.accepted:
            self.accepted.inc(r.accepted, tags=tags)
        self.length.observe(r.accepted + 1, tags=tags)
        for i in range(r.drafted):
            at = {"mode": r.mode, "position": str(i)}
            self.pos_drafted.inc(1, tags=at)
            if i < r.accepted:
                self.pos_accepted.inc(1, tags=at)

    def request(self, mode: str, *, prompt_tokens: int, tokens: int, finish: str, ttft_s: float,
                total_s: float, controller: dict, passes: int = 0) -> None:
        """A finished request (``finish``: stop, length, cancelled or error). Latencies of a
        request that produced nothing are not observed: there was no first token."""
        tags = {"mode": mode}
        self.requests.inc(1, tags={"mode": mode, "finish_reason": finish})
        self.prompt_tokens.inc(prompt_tokens, tags=tags)
        if controller.get("fallbacks"):  # the speculation controller's summary
            self.fallbacks.inc(controller["fallbacks"], tags=tags)
        if controller.get("probes"):
            self.probes.inc(controller["probes"], tags=tags)
        if not tokens:
            return
        self.tokens.inc(tokens, tags=tags)
        if passes:
            self.passes.inc(passes, tags=tags)
        self.e2e.observe(total_s, tags=tags)
        self.ttft.observe(ttft_s, tags=tags)
        if tokens > 1:
            self.tpot.observe((total_s - ttft_s) / (tokens - 1), tags=tags)
        if total_s > 0:
            self.tps.observe(tokens / total_s, tags=tags)
