"""One OpenTelemetry trace per request: the spans, their attributes, and where they go.

    chat <model> the request, in the router, SERVER; named ``{gen_ai.operation.name}
                 {gen_ai.request.model}`` as the GenAI conventions say (``text_completion tiny``);
                 error.type when it fails. A child of the caller's W3C ``traceparent`` if any
                 (or, when incoming context is not trusted, a new root linked to it)
      prefill    round 0, the prompt (k = 0)
        verify
      round      one per round: specdec.mode, k, drafted, accepted, bonus, emitted, draft_ms,
                 verify_ms; events specdec.fallback / probe / resume / mode_switch
        draft    (k > 0)
        verify
      round ...

Every span is built in the router from the rounds' ``RoundStats``, after the request: the
router ``record``s each round's stats as it streams, and when the request's block ends each
round becomes a span starting at ``started_at`` and lasting ``draft_s + verify_s``, with
``draft`` / ``verify`` children from those timings and the policy's decisions of the round
(``RoundStats.events``) as span events at its start. The workers make no spans. The request
span is never made current (the block may be an async generator), so nothing here depends
on the caller's context.

GenAI semantic-convention names where one exists (``gen_ai.request.model``,
``gen_ai.usage.output_tokens``, ...), ``specdec.*`` otherwise. Spans go through a
``BatchSpanProcessor`` to a JSON-lines file per process (``specdec.tracing.format``), and to OTLP
too when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (http/protobuf; grpc with
``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` if that exporter is installed). The files rotate and are
pruned (``SPECDEC_TRACE_MAX_FILE_BYTES``, ``SPECDEC_TRACE_MAX_FILES``,
``SPECDEC_TRACE_MAX_TOTAL_BYTES``, or ``configure_tracing``'s keywords; see ``specdec.tracing.format``).
Each line is OTLP/JSON, so a collector can replay the files.

The standard environment variables apply: ``OTEL_SERVICE_NAME`` overrides the service name the
code gives, ``OTEL_RESOURCE_ATTRIBUTES`` adds to the resource, and ``OTEL_TRACES_SAMPLER`` (with
``OTEL_TRACES_SAMPLER_ARG``), when set, replaces the sampler ``sample_ratio`` would build.

Trust. By default a request continues its caller's trace and keeps the caller's sampling
decision: a ``traceparent`` with the sampled flag is traced whatever ``sample_ratio`` says.
Where callers are untrusted (a public endpoint), anyone could make every request traced and
fill the disk. ``configure_tracing(..., trust_incoming=False)`` makes each request span a new
root trace, sampled by our own ratio, with a span *link* to the caller's span context so the
two traces can still be joined. ``request_span(..., trust_incoming=)`` decides for one request
(say, trusting authenticated callers only); ``SPECDEC_TRACE_TRUST_INCOMING=0`` distrusts every
request whatever the code says.

Integration:

    telemetry.configure_tracing("specdec-router")   # once per process; SPECDEC_TRACING=0 disables

    # ingress: pass the caller's context on (a plain dict crosses the Ray hop)
    req["trace_context"] = telemetry.carrier_from_headers(request.headers)

    # router, one request:
    attrs = telemetry.request_attributes(model=..., operation="chat", max_tokens=..., ...)
    with telemetry.request_span(carrier=req.get("trace_context"), attributes=attrs) as trace:
        async for event in engine.astream(...):   # or a sync loop
            trace.record(event.stats)
        trace.finish(mode=..., finish_reason=..., input_tokens=..., output_tokens=...)
    # the round spans are built, and the request span ended, as the block exits
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from specdec.stats import RoundStats, SpeculationSummary
from specdec.tracing.format import (  # noqa: F401  (the attribute schema is part of this API)
    ERROR_TYPE, EVENT_FALLBACK, EVENT_MODE_SWITCH, EVENT_PROBE, EVENT_RESUME, POLICY_EVENTS, JsonLinesSpanExporter,
    Retention, default_trace_dir, request_attributes, request_span_name, round_attributes,
)

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER_NAME = "specdec"


class _State:
    def __init__(self, provider: TracerProvider, trust_incoming: bool):
        self.provider, self.trust_incoming = provider, trust_incoming
        # the operator's SPECDEC_TRACE_TRUST_INCOMING=0 holds whatever the code asks for
        self.distrust_forced = _env_off("SPECDEC_TRACE_TRUST_INCOMING")
        self.tracer = provider.get_tracer(_TRACER_NAME)


_STATE: _State | None = None
_CONFIGURED = False  # configure_tracing ran in this process (possibly deciding "disabled")
_LOCK = threading.Lock()


def configure_tracing(
    service_name: str,
    *,
    directory: str | Path | None = None,
    sample_ratio: float = 1.0,
    enabled: bool = True,
    exporters: Sequence[SpanExporter] = (),
    trust_incoming: bool = True,
    max_file_bytes: int | None = None,
    max_files: int | None = None,
    max_total_bytes: int | None = None,
) -> TracerProvider | None:
    """Set up this process's tracer once; later calls return the first call's provider.

    Spans go to ``directory`` (default ``$SPECDEC_HOME/traces``) as OTLP/JSON lines, to OTLP
    when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, and to any extra ``exporters``. Sampling is
    ``ParentBased(TraceIdRatioBased(sample_ratio))`` (a request keeps its caller's decision)
    unless ``OTEL_TRACES_SAMPLER`` names a sampler: the operator's standard knob wins over the
    code's default. ``OTEL_SERVICE_NAME`` overrides ``service_name``; ``OTEL_RESOURCE_ATTRIBUTES``
    joins the resource. ``trust_incoming=False`` (or ``SPECDEC_TRACE_TRUST_INCOMING=0``) stops a
    caller's ``traceparent`` from deciding: see ``request_span``. ``max_file_bytes`` /
    ``max_files`` / ``max_total_bytes`` bound the span files (None: ``SPECDEC_TRACE_*`` from the
    environment, else ``Retention``'s defaults). Returns None when disabled (``enabled=False``
    or ``SPECDEC_TRACING=0``); every other function here then does nothing.
    """
    global _STATE, _CONFIGURED
    with _LOCK:
        if _CONFIGURED:
            return _STATE.provider if _STATE else None
        if not enabled or _env_off("SPECDEC_TRACING"):
            _CONFIGURED = True
            return None
        retention = Retention.resolve(  # raises on bad explicit limits, before anything is set up
            max_file_bytes=max_file_bytes, max_files=max_files, max_total_bytes=max_total_bytes
        )
        _CONFIGURED = True
        service_name = os.environ.get("OTEL_SERVICE_NAME", "").strip() or service_name
        provider = TracerProvider(
            sampler=_sampler(sample_ratio),
            # Resource.create merges OTEL_RESOURCE_ATTRIBUTES (ours win on service.name)
            resource=Resource.create({"service.name": service_name}),
            shutdown_on_exit=False,  # our own atexit hook flushes (and survives shutdown())
        )
        path = Path(directory) if directory is not None else default_trace_dir()
        provider.add_span_processor(
            BatchSpanProcessor(JsonLinesSpanExporter(path, service_name, retention), schedule_delay_millis=1000)
        )
        if otlp := _otlp_exporter():
            provider.add_span_processor(BatchSpanProcessor(otlp))
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        _STATE = _State(provider, trust_incoming)
        return provider


# the samplers OTEL_TRACES_SAMPLER may name that the SDK builds (the spec's list, less the
# Jaeger-remote and X-Ray ones it has no code for)
_ENV_SAMPLERS = frozenset({
    "always_on", "always_off", "traceidratio",
    "parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio",
})


def _sampler(sample_ratio: float) -> Sampler | None:
    """Our ``ParentBased(TraceIdRatioBased(sample_ratio))``, or None when ``OTEL_TRACES_SAMPLER``
    names a sampler: the ``TracerProvider`` then builds it from the environment (with
    ``OTEL_TRACES_SAMPLER_ARG``). A name the SDK does not know would make it fall back to
    always-on; we keep our ratio instead, and say so."""
    name = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if name in _ENV_SAMPLERS:
        log.info("trace sampling from OTEL_TRACES_SAMPLER=%s (not trace_sample_ratio)", name)
        return None
    if name:
        log.error("ignoring OTEL_TRACES_SAMPLER=%r: not one of %s; sampling at ratio %s",
                  name, ", ".join(sorted(_ENV_SAMPLERS)), sample_ratio)
    return ParentBased(TraceIdRatioBased(sample_ratio))


def _env_off(name: str) -> bool:
    """Whether environment variable ``name`` says no (0 / false / off / no); unset is yes."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def _otlp_exporter() -> SpanExporter | None:
    """The OTLP exporter the environment asks for, or None (not asked, or not installed).

    A missing exporter package never stops a process from starting: the JSON-lines files
    still get every span, and one log line names what to install.
    """
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol.strip() == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        except ImportError:
            log.error(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the OTLP gRPC exporter: pip install "
                "'specdec[otlp-grpc]'; exporting traces over http/protobuf instead"
            )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.error(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OTLP exporter is not installed "
            "(pip install opentelemetry-exporter-otlp-proto-http); traces go to JSON lines only"
        )
        return None
    return OTLPSpanExporter()  # reads the endpoint (and /v1/traces path) from the environment


def flush(timeout_s: float = 10.0) -> bool:
    """Export every finished span now (tests, and before a process exits on purpose)."""
    return _STATE.provider.force_flush(int(timeout_s * 1000)) if _STATE else True


def shutdown() -> None:
    """Flush and close the exporters, and forget the configuration (a later
    ``configure_tracing`` starts afresh)."""
    global _STATE, _CONFIGURED
    with _LOCK:
        state, _STATE, _CONFIGURED = _STATE, None, False
    if state is not None:
        state.provider.shutdown()


atexit.register(shutdown)


# --- context across process hops -------------------------------------------------------


def inject(span_or_context: trace.Span | context_api.Context | None = None) -> dict[str, str]:
    """A W3C carrier (``traceparent``, maybe ``tracestate``) for the current span, or the
    given one; ``{}`` when there is nothing to propagate."""
    if isinstance(span_or_context, trace.Span):
        span_or_context = trace.set_span_in_context(span_or_context)
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=span_or_context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> context_api.Context:
    """The context a carrier describes (an empty context for None or a malformed header)."""
    return _PROPAGATOR.extract(carrier or {}, context=context_api.Context())


def carrier_from_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The trace-context headers of an HTTP request, as a plain dict for a Ray call."""
    return {k: headers[k] for k in ("traceparent", "tracestate") if headers.get(k)}


def _tracer() -> trace.Tracer:
    return _STATE.tracer if _STATE else trace.NoOpTracer()


# --- the router: one request, its rounds ------------------------------------------------


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTrace:
    """The request span of one request and the rounds recorded under it. ``record`` only
    keeps a round's stats; the ``prefill`` / ``round`` spans are built when the request's
    block ends, before the request span ends."""

    def __init__(self, span: trace.Span):
        self.span = span
        self.stats: list[RoundStats] = []
        self._recorded_ns: list[int] = []  # when each round was recorded: its end, if it has no started_at

    def record(self, stats: RoundStats) -> None:
        """One finished round."""
        self.stats.append(stats)
        self._recorded_ns.append(time.time_ns())

    def finish(
        self,
        *,
        finish_reason: str | None,
        input_tokens: int,
        output_tokens: int | None = None,
        mode: str | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """The request's final statistics, on the request span (call inside the block)."""
        if not self.span.is_recording():
            return
        rounds = self.stats
        summary = SpeculationSummary.from_rounds(mode or "", rounds)
        if output_tokens is None:
            output_tokens = sum(r.emitted for r in rounds)
        attrs: dict[str, Any] = {
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": [finish_reason or "unknown"],
            "specdec.rounds": summary.rounds,
            "specdec.drafted": summary.drafted_tokens,
            "specdec.accepted": summary.accepted_tokens,
            "specdec.acceptance_rate": summary.acceptance_rate,
            "specdec.mean_accepted_length": summary.mean_accepted_length,
            "specdec.draft_ms": summary.draft_s * 1e3,
            "specdec.verify_ms": summary.verify_s * 1e3,
            # savings in billing terms: the target's passes (one per round, the prefill's
            # included) against plain decoding's (one per output token)
            "specdec.target_passes": summary.rounds + 1 if rounds else 0,
            "specdec.plain_passes": output_tokens,
        }
        if mode:
            attrs["specdec.mode"] = mode
        if cached_tokens is not None:  # prompt tokens whose KV the prefix cache held
            attrs["specdec.prompt_cached_tokens"] = cached_tokens
        start = getattr(self.span, "start_time", None)
        if rounds and rounds[0].started_at and start:
            first = rounds[0]
            first_end = _ns(first.started_at) + _ns(first.draft_s) + _ns(first.verify_s)
            attrs["specdec.ttft_ms"] = (first_end - start) / 1e6
        self.span.set_attributes(attrs)

    def _emit_rounds(self) -> None:
        """A span per recorded round, with its draft / verify phases and policy events."""
        if not (self.span.is_recording() and _STATE is not None):
            return
        tracer, parent = _STATE.tracer, trace.set_span_in_context(self.span)
        for stats, recorded in zip(self.stats, self._recorded_ns):
            draft, duration = _ns(stats.draft_s), _ns(stats.draft_s) + _ns(stats.verify_s)
            # started_at is 0 in a RoundStats made without it: the round ended when recorded
            start = _ns(stats.started_at) if stats.started_at else recorded - duration
            name = "prefill" if stats.index == 0 or stats.mode == "prefill" else "round"
            span = tracer.start_span(name, parent, attributes=round_attributes(stats), start_time=start)
            for what in stats.events:  # "fallback", "probe:draft", ...
                kind, _, mode = what.partition(":")
                span.add_event(POLICY_EVENTS.get(kind, f"specdec.{kind}"),
                               {"specdec.mode": mode} if mode else {}, timestamp=start)
            phases = trace.set_span_in_context(span)
            if stats.k:
                tracer.start_span("draft", phases, start_time=start).end(start + draft)
            tracer.start_span("verify", phases, start_time=start + draft).end(start + duration)
            span.end(start + duration)


@contextmanager
def request_span(
    name: str | None = None,
    *,
    carrier: Mapping[str, str] | None = None,
    attributes: Mapping[str, Any] | None = None,
    trust_incoming: bool | None = None,
) -> Iterator[RequestTrace]:
    """The request's span for the block (started, not made current: the block may be an
    async generator), ended with its rounds' spans as the block exits. Its name is the GenAI
    conventions' ``{gen_ai.operation.name} {gen_ai.request.model}`` from ``attributes`` unless
    ``name`` is given. An exception marks it failed, with ``error.type`` its class name. With
    a trusted ``carrier`` (``trust_incoming``; None: as ``configure_tracing`` said;
    ``SPECDEC_TRACE_TRUST_INCOMING=0`` overrides both) the span is a child of its
    ``traceparent`` and keeps its sampling decision; otherwise it starts a new trace sampled
    by our own sampler, linked to the caller's span."""
    attributes = dict(attributes or {})
    parent, links = _request_parent(carrier, trust_incoming)
    span = _tracer().start_span(
        name or request_span_name(attributes), context=parent, kind=SpanKind.SERVER, attributes=attributes,
        links=links,
    )
    request = RequestTrace(span)
    try:
        yield request
    except Exception as exc:  # not BaseException: a cancelled or closed request did not fail
        if span.is_recording():
            span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        request._emit_rounds()
        span.end()


def _request_parent(
    carrier: Mapping[str, str] | None, trust_incoming: bool | None
) -> tuple[context_api.Context, list[trace.Link]]:
    """The request span's parent context and links. An untrusted caller's context becomes a
    link, not the parent: OpenTelemetry's way across a trust boundary, so that the caller's
    sampled flag cannot force tracing (the root sampler decides) yet the traces still join."""
    parent = extract(carrier)
    if _trusts(trust_incoming):
        return parent, []
    caller = trace.get_current_span(parent).get_span_context()
    return context_api.Context(), [trace.Link(caller)] if caller.is_valid else []


def _trusts(trust_incoming: bool | None) -> bool:
    """Whether to keep the caller's context: the operator's veto, then this request's say,
    then the configuration's."""
    if _STATE is None:  # not tracing: nothing will be recorded either way
        return trust_incoming is not False
    if _STATE.distrust_forced:
        return False
    return _STATE.trust_incoming if trust_incoming is None else trust_incoming
