"""Reading the span files (``specdec.tracing.format``) back into traces, one per request.

The spans of one request are grouped here by trace id, from however many files they are in (the
router writes them all now; older traces have draft / verify spans in the workers' files). A
line a killed process left half-written is skipped. Each line is read as what it is: an
OTLP/JSON request (``resourceSpans``: what the writer writes now, and what a collector's file
exporter writes, any number of spans a line) or a flat record (files from before OTLP/JSON).

The reader takes every ``spans-*.jsonl`` file, each process's rotated files oldest first and
its current file last, so a request whose spans straddle a rotation still reads back whole.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from specdec.tracing.format import ROUND_NAMES, SPAN_FILE, is_request_span
from specdec.tracing.otlp import span_dicts

log = logging.getLogger(__name__)


def span_file_order(path: Path) -> tuple:
    """Sort key: by process, its rotated files oldest first, its current file last."""
    m = SPAN_FILE.fullmatch(path.name)
    if m is None:
        return (path.name, float("inf"))
    return (m.group("stem"), int(m.group("n")) if m.group("n") else float("inf"))


def span_files(directory: str | Path) -> list[Path]:
    """Every span file in ``directory``, current and rotated, in ``span_file_order``."""
    return sorted(Path(directory).glob("spans-*.jsonl"), key=span_file_order)


@dataclass
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: list = field(default_factory=list)
    service: str | None = None
    status: str = "UNSET"
    links: list = field(default_factory=list)
    kind: str | None = None  # SERVER, INTERNAL, ...
    resource: dict = field(default_factory=dict)  # the resource's attributes (OTLP/JSON lines only)

    @classmethod
    def from_dict(cls, d: dict) -> SpanRecord:
        return cls(
            trace_id=d["trace_id"], span_id=d["span_id"], parent_id=d.get("parent_id"), name=d["name"],
            start_ns=int(d["start_ns"]), end_ns=int(d["end_ns"]), attributes=d.get("attributes") or {},
            events=d.get("events") or [], service=d.get("service"), status=d.get("status", "UNSET"),
            links=d.get("links") or [], kind=d.get("kind"), resource=d.get("resource") or {},
        )

    @classmethod
    def from_line(cls, line: str) -> list[SpanRecord]:
        """The spans of one line: an OTLP/JSON request, or one flat record (older files)."""
        d = json.loads(line)
        return [cls.from_dict(s) for s in span_dicts(d)] if "resourceSpans" in d else [cls.from_dict(d)]

    @property
    def is_request(self) -> bool:
        return is_request_span(self.name, self.kind, self.attributes)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def read_spans(directory: str | Path, *, since_ns: int | None = None) -> list[SpanRecord]:
    """Every complete span line in ``directory``'s span files, rotated ones included, in
    ``span_file_order`` (ending at or after ``since_ns``)."""
    spans = []
    for path in span_files(directory):
        try:
            spans += _read_span_file(path, since_ns)
        except FileNotFoundError:
            log.debug("span file %s went (rotated or pruned) while reading", path)
    return spans


def _read_span_file(path: Path, since_ns: int | None) -> list[SpanRecord]:
    if since_ns is not None and path.stat().st_mtime_ns < since_ns:
        return []  # nothing in a file last written before the window
    spans = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                records = SpanRecord.from_line(line)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn last line (or foreign junk): skip it
            spans += [s for s in records if since_ns is None or s.end_ns >= since_ns]
    return spans


class Trace:
    """The spans of one request (its request span, rounds and their draft / verify spans) and
    the request's numbers: from the request span's final attributes, else from the rounds."""

    def __init__(self, trace_id: str, spans: list[SpanRecord]):
        self.trace_id, self.spans = trace_id, sorted(spans, key=lambda s: s.start_ns)
        self._children: dict[str, list[SpanRecord]] = {}
        for s in self.spans:
            self._children.setdefault(s.parent_id, []).append(s)
        ids = {s.span_id for s in self.spans}
        requests = [s for s in self.spans if s.is_request]  # outermost first: the caller's span is elsewhere
        self.request = ([s for s in requests if s.parent_id not in ids] or requests or [None])[0]
        self.rounds = [s for s in self.spans if s.name in ROUND_NAMES]  # prefill first
        self.decode_rounds = [s for s in self.rounds if s.name == "round"]
        self.start_ns, self.end_ns = self.spans[0].start_ns, max(s.end_ns for s in self.spans)
        total = lambda key: sum(r.attributes.get(key, 0) for r in self.decode_rounds)  # noqa: E731
        self.drafted, self.accepted, n = total("specdec.drafted"), total("specdec.accepted"), len(self.decode_rounds)
        self.acceptance = self.accepted / self.drafted if self.drafted else None  # None: nothing drafted
        self.mean_accepted_length = (self.accepted + n) / n if n else None
        modes = Counter(r.attributes.get("specdec.mode") for r in self.decode_rounds)
        self.mode = self.attr("specdec.mode") or (modes.most_common(1)[0][0] if modes else "-")
        self.latency_ms = self.request.duration_ms if self.request else (self.end_ns - self.start_ns) / 1e6
        self.input_tokens = self.attr("gen_ai.usage.input_tokens")
        emitted = sum(r.attributes.get("specdec.emitted", 0) for r in self.rounds)
        self.output_tokens = self.attr("gen_ai.usage.output_tokens", emitted)
        self.finish_reason = ",".join(self.attr("gen_ai.response.finish_reasons") or ["-"])
        self.ttft_ms = self.attr("specdec.ttft_ms")
        if self.ttft_ms is None and self.request and self.rounds:
            self.ttft_ms = (self.rounds[0].end_ns - self.request.start_ns) / 1e6
        self.tokens_per_s = self.output_tokens / (self.latency_ms / 1e3) if self.latency_ms else 0.0

    def children(self, span: SpanRecord) -> list[SpanRecord]:
        return self._children.get(span.span_id, [])

    def attr(self, key: str, default=None):
        return self.request.attributes.get(key, default) if self.request else default


def load_traces(directory: str | Path, *, since_s: float | None = None) -> list[Trace]:
    """Traces with a request span, oldest first (``since_s``: only the last so many seconds)."""
    since_ns = time.time_ns() - int(since_s * 1e9) if since_s is not None else None
    by_trace: dict[str, list[SpanRecord]] = {}
    for span in read_spans(directory, since_ns=since_ns):
        by_trace.setdefault(span.trace_id, []).append(span)
    traces = [Trace(tid, spans) for tid, spans in by_trace.items()]
    traces = [t for t in traces if t.request is not None]
    return sorted(traces, key=lambda t: t.start_ns)


def find_trace(traces: list[Trace], prefix: str) -> Trace:
    prefix = prefix.lower()
    matches = [t for t in traces if t.trace_id.startswith(prefix)]
    if not matches:
        raise ValueError(f"no trace starts with {prefix!r}")
    if len(matches) > 1:
        raise ValueError(f"{prefix!r} is ambiguous: " + ", ".join(t.trace_id[:12] for t in matches[:5]))
    return matches[0]
