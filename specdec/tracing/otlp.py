"""Spans in OTLP/JSON, the OpenTelemetry protocol's JSON encoding, and back.

Why: a span file written this way can be replayed into any OpenTelemetry collector (its
``otlpjsonfile`` receiver reads one ``ExportTraceServiceRequest`` per line) or loaded by other
tools, instead of being readable only by ``specdec traces``.

Each line is one request holding one span: ``{"resourceSpans": [{"resource": ..., "scopeSpans":
[{"scope": ..., "spans": [span]}]}]}``. One span a line keeps the file writer's rotation (between
lines) and the reader's tolerance of a torn last line (one span lost, not a batch), at the cost of
repeating the resource on every line. The encoding is OTLP/JSON's, not protobuf's own JSON
mapping: trace and span ids in lowercase hex, 64-bit integers (times, ``intValue``) as decimal
strings, enums (kind, status code) as integers, lowerCamelCase field names, defaults left out.

Written by hand, not with ``opentelemetry-exporter-otlp-proto-common``'s encoder and protobuf's
``MessageToDict``: that pair costs about three times as much per span (on the router's export
thread) and writes ids in base64, which would need rewriting anyway. ``tests/test_tracing.py``
checks every line against the protobuf schema and against that encoder's output.

``span_dicts`` reads a request back, whichever way its ids are written (hex, or base64 as
protobuf's mapping writes them), into the flat records ``specdec.tracing.reader`` uses.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind

# OTLP's enum numbers (opentelemetry/proto/trace/v1/trace.proto)
KINDS = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4, SpanKind.CONSUMER: 5}
KIND_NAMES = {number: kind.name for kind, number in KINDS.items()}
STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags: the parent's is_remote is known / is true


# --- writing ---------------------------------------------------------------------------


def any_value(value: Any) -> dict:
    """An attribute value as an OTLP ``AnyValue``."""
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        if math.isfinite(value):
            return {"doubleValue": value}
        return {"doubleValue": "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": key_values(value)}}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def key_values(attributes: Mapping[str, Any] | None) -> list[dict]:
    return [{"key": str(k), "value": any_value(v)} for k, v in (attributes or {}).items()]


def _flags(parent: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _put(out: dict, key: str, value: Any) -> None:
    """``out[key] = value`` unless value is a default (OTLP/JSON leaves those out)."""
    if value:
        out[key] = value


def encode_span(span: ReadableSpan) -> dict:
    """One OTLP/JSON ``Span``."""
    ctx, parent = span.context, span.parent
    out: dict[str, Any] = {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}"}
    _put(out, "traceState", ",".join(f"{k}={v}" for k, v in (ctx.trace_state or {}).items()))
    if parent is not None:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    out.update(name=span.name, kind=KINDS[span.kind])
    out.update(startTimeUnixNano=str(span.start_time or 0), endTimeUnixNano=str(span.end_time or 0))
    _put(out, "attributes", key_values(span.attributes))
    _put(out, "droppedAttributesCount", span.dropped_attributes)
    events = []
    for e in span.events:
        event = {"timeUnixNano": str(e.timestamp), "name": e.name}
        _put(event, "attributes", key_values(e.attributes))
        _put(event, "droppedAttributesCount", e.dropped_attributes)
        events.append(event)
    _put(out, "events", events)
    _put(out, "droppedEventsCount", span.dropped_events)
    links = []
    for link in span.links:
        encoded = {"traceId": f"{link.context.trace_id:032x}", "spanId": f"{link.context.span_id:016x}"}
        _put(encoded, "attributes", key_values(link.attributes))
        _put(encoded, "droppedAttributesCount", link.dropped_attributes)
        links.append({**encoded, "flags": _flags(link.context)})
    _put(out, "links", links)
    _put(out, "droppedLinksCount", span.dropped_links)
    status: dict[str, Any] = {}
    _put(status, "message", span.status.description)
    _put(status, "code", span.status.status_code.value)
    out.update(status=status, flags=_flags(parent))
    return out


class LineEncoder:
    """Spans to OTLP/JSON lines, one span a line (see the module docstring). The resource and
    scope part of a line is encoded once per (resource, scope) and reused."""

    def __init__(self) -> None:
        # by identity (a Resource hashes by serialising itself); the objects are kept, so an
        # id is not reused while its entry lives
        self._heads: dict[tuple[int, int], tuple[Any, Any, str]] = {}

    def _head(self, span: ReadableSpan) -> str:
        resource, scope = span.resource, span.instrumentation_scope
        key = (id(resource), id(scope))
        cached = self._heads.get(key)
        if cached is None or cached[0] is not resource or cached[1] is not scope:
            resource_json: dict[str, Any] = {}
            _put(resource_json, "attributes", key_values(resource.attributes if resource else None))
            scope_json: dict[str, Any] = {}
            if scope is not None:
                _put(scope_json, "name", scope.name)
                _put(scope_json, "version", scope.version)
                _put(scope_json, "attributes", key_values(scope.attributes))
            resource_part = _dumps(resource_json)
            if resource is not None and resource.schema_url:
                resource_part += f',"schemaUrl":{_dumps(resource.schema_url)}'
            scope_part = _dumps(scope_json)
            if scope is not None and scope.schema_url:
                scope_part += f',"schemaUrl":{_dumps(scope.schema_url)}'
            head = f'{{"resourceSpans":[{{"resource":{resource_part},"scopeSpans":[{{"scope":{scope_part},"spans":['
            if len(self._heads) > 64:  # resources come and go only in tests; stay bounded
                self._heads.clear()
            cached = self._heads[key] = (resource, scope, head)
        return cached[2]

    def line(self, span: ReadableSpan) -> str:
        """One span as a whole ``ExportTraceServiceRequest``, newline included."""
        return f"{self._head(span)}{_dumps(encode_span(span))}]}}]}}]}}\n"


# --- reading ---------------------------------------------------------------------------


def _value(v: Mapping[str, Any]) -> Any:
    """A Python value from an OTLP/JSON ``AnyValue``."""
    if not v:
        return None
    (kind, x), *_ = v.items()
    if kind == "stringValue" or kind == "boolValue":
        return x
    if kind == "intValue":
        return int(x)
    if kind == "doubleValue":
        return float(x)  # also "NaN", "Infinity", "-Infinity"
    if kind == "arrayValue":
        return [_value(e) for e in (x or {}).get("values", [])]
    if kind == "kvlistValue":
        return attributes((x or {}).get("values"))
    return x  # bytesValue: left in base64


def attributes(kvs: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value") or {}) for kv in kvs or ()}


def _id(text: str | None, size: int) -> str | None:
    """A hex id from OTLP/JSON's hex or protobuf JSON's base64 (``size`` bytes); None if empty."""
    if not text:
        return None
    if len(text) == 2 * size:
        return text.lower()
    return base64.b64decode(text).hex()


def _enum(value: Any, names: Mapping[int, str], prefix: str, default: str) -> str:
    """An enum given as its number (OTLP/JSON) or its proto name (``SPAN_KIND_SERVER``)."""
    if isinstance(value, int):
        return names.get(value, default)
    if isinstance(value, str) and value.startswith(prefix):
        return value[len(prefix):]
    return default


def span_dicts(request: Mapping[str, Any]) -> Iterator[dict]:
    """The spans of one OTLP/JSON ``ExportTraceServiceRequest`` as flat records: ``trace_id``,
    ``span_id``, ``parent_id``, ``name``, ``kind``, ``start_ns``, ``end_ns``, ``status``,
    ``service``, ``resource``, ``attributes``, ``events``, ``links``."""
    for resource_spans in request["resourceSpans"]:
        resource = attributes((resource_spans.get("resource") or {}).get("attributes"))
        for scope_spans in resource_spans.get("scopeSpans") or ():
            for s in scope_spans.get("spans") or ():
                status = s.get("status") or {}
                yield {
                    "trace_id": _id(s["traceId"], 16), "span_id": _id(s["spanId"], 8),
                    "parent_id": _id(s.get("parentSpanId"), 8), "name": s["name"],
                    "kind": _enum(s.get("kind", 0), KIND_NAMES, "SPAN_KIND_", "UNSPECIFIED"),
                    "start_ns": int(s["startTimeUnixNano"]), "end_ns": int(s["endTimeUnixNano"]),
                    "status": _enum(status.get("code", 0), STATUS_NAMES, "STATUS_CODE_", "UNSET"),
                    "service": resource.get("service.name"), "resource": resource,
                    "attributes": attributes(s.get("attributes")),
                    "events": [
                        {"name": e.get("name"), "time_ns": int(e.get("timeUnixNano", 0)),
                         "attributes": attributes(e.get("attributes"))}
                        for e in s.get("events") or ()
                    ],
                    "links": [
                        {"trace_id": _id(k["traceId"], 16), "span_id": _id(k["spanId"], 8),
                         "attributes": attributes(k.get("attributes"))}
                        for k in s.get("links") or ()
                    ],
                }
