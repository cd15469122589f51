"""The trace format -- span and attribute names, the span files -- and reading it back.

``specdec.telemetry`` names spans and attributes with the schema below and writes the spans
through ``JsonLinesSpanExporter``; ``specdec traces`` reads them back.

Every traced process (``specdec.telemetry``) appends one span per line to
``$SPECDEC_HOME/traces/spans-<service>-<pid>.jsonl`` (``SPECDEC_HOME`` defaults to
``~/.cache/specdec``). Each line holds ``trace_id``, ``span_id``, ``parent_id`` (W3C hex),
``name``, ``start_ns`` / ``end_ns`` (epoch ns), ``attributes`` and ``events``. The spans of one
request come from several processes (router, workers) and are grouped here by trace id. A
line a killed process left half-written is skipped. A span that links to another trace (the
caller's, when ``telemetry`` does not trust incoming sampling) also has ``links``: a list of
``{trace_id, span_id, attributes}``.

Retention. When a process's file would grow past ``max_file_bytes`` it is renamed to
``spans-<service>-<pid>.<n>.jsonl`` (``n`` counting up: the highest is the newest) and a fresh
file begins; rotation happens between lines, so no span is split. Each process keeps its
``max_files`` newest rotated files. Across the whole directory, after each rotation and when a
process opens its file, the oldest files of any process (by last write) are deleted until all
span files together fit in ``max_total_bytes`` (between those moments the files being written
grow: allow up to ``max_file_bytes`` more per live process). A writer whose file was deleted
under it starts a new one. The limits come from ``configure_tracing(max_file_bytes=, max_files=,
max_total_bytes=)``, else from the environment, else the defaults:

    SPECDEC_TRACE_MAX_FILE_BYTES    64M   one file, before it rotates (K / M / G suffixes)
    SPECDEC_TRACE_MAX_FILES         8     rotated files kept per process (0: none)
    SPECDEC_TRACE_MAX_TOTAL_BYTES   1G    all span files in the directory (0: no such cap)

The reader takes every ``spans-*.jsonl`` file, each process's rotated files oldest first and
its current file last, so a request whose spans straddle a rotation still reads back whole.

    specdec traces list [--limit 20] [--since 1h]      recent requests
    specdec traces show TRACE_ID [--all] [--html F]    a waterfall of prefill and rounds
    specdec traces summary [--since 1h]                acceptance and latency distributions
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from specdec.decoding import RoundStats

log = logging.getLogger(__name__)

# --- the trace schema: span and attribute names, shared by the writer and the reader ----

# Events of the speculation policy's decisions; they land on the round being decided.
EVENT_FALLBACK = "specdec.fallback"  # speculation stopped paying: plain decoding from here
EVENT_PROBE = "specdec.probe"  # one speculative round during a fallback (specdec.mode: with what)
EVENT_RESUME = "specdec.resume"  # the probe paid: speculating again (specdec.mode)
EVENT_MODE_SWITCH = "specdec.mode_switch"  # auto mode changed drafter (specdec.mode: the new one)
# ``SpeculationPolicy.events`` kinds ("fallback", "probe:<mode>", ...) and their events
POLICY_EVENTS = {
    "fallback": EVENT_FALLBACK, "probe": EVENT_PROBE, "resume": EVENT_RESUME, "switch": EVENT_MODE_SWITCH
}

# request_attributes' keywords and the GenAI / specdec attribute each becomes
_REQUEST_KEYS = {
    "operation": "gen_ai.operation.name",  # "chat" or "text_completion"
    "model": "gen_ai.request.model",
    "request_id": "gen_ai.response.id",
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "seed": "gen_ai.request.seed",
    "stream": "gen_ai.request.stream",
    "mode": "specdec.mode",  # the speculation mode the request asked for / resolved to
    "k": "specdec.k",
}


def request_attributes(*, operation: str = "text_completion", **fields: Any) -> dict[str, Any]:
    """The request span's opening attributes from ``_REQUEST_KEYS``' keywords (None left out)."""
    unknown = set(fields) - set(_REQUEST_KEYS)
    if unknown:
        raise TypeError(f"unknown request attributes: {sorted(unknown)}")
    fields["operation"] = operation
    return {_REQUEST_KEYS[k]: v for k, v in fields.items() if v is not None}


def round_attributes(stats: RoundStats) -> dict[str, Any]:
    attrs = {
        "specdec.round": stats.index,
        "specdec.mode": stats.mode,
        "specdec.k": stats.k,
        "specdec.drafted": stats.drafted,
        "specdec.accepted": stats.accepted,
        "specdec.bonus": stats.bonus,
        "specdec.emitted": stats.emitted,
        "specdec.draft_ms": stats.draft_s * 1e3,
        "specdec.verify_ms": stats.verify_s * 1e3,
    }
    if getattr(stats, "draft_error", None):  # the drafter failed: the round ran plainly
        attrs["specdec.draft_error"] = stats.draft_error
    return attrs


ROUND_NAMES = ("prefill", "round")


def specdec_home() -> Path:
    return Path(os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec")


def default_trace_dir() -> Path:
    return specdec_home() / "traces"


def span_file_name(service: str, pid: int) -> str:
    return f"spans-{re.sub(r'[^A-Za-z0-9_.-]', '_', service)}-{pid}.jsonl"


# spans-<service>-<pid>.jsonl (the current file) or spans-<service>-<pid>.<n>.jsonl (rotated);
# the stem is everything up to the pid, which is what ties a rotated file to its process.
_SPAN_FILE = re.compile(r"(?P<stem>spans-.+-\d+)(?:\.(?P<n>\d+))?\.jsonl")
_SIZE = re.compile(r"\s*(\d+)\s*([kmg]?)i?b?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``1048576``, ``512K``, ``64M``, ``1G`` (binary multiples)."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"bad size {text!r}: use e.g. 65536, 512K, 64M, 1G")
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]


@dataclass(frozen=True)
class Retention:
    """How much of the span files to keep: a server traces for weeks, and the files must not
    fill its disk. ``max_total_bytes=0`` lifts the directory-wide cap."""

    max_file_bytes: int = 64 * 2**20
    max_files: int = 8
    max_total_bytes: int = 2**30

    def __post_init__(self):
        if self.max_file_bytes <= 0 or self.max_files < 0 or self.max_total_bytes < 0:
            raise ValueError(f"bad trace retention {self}: file bytes > 0, files and total bytes >= 0")

    @classmethod
    def resolve(
        cls, *, max_file_bytes: int | None = None, max_files: int | None = None, max_total_bytes: int | None = None
    ) -> Retention:
        """The given limits; for those left None, the ``SPECDEC_TRACE_*`` variables, else the
        defaults. A malformed variable is logged and ignored: it must not stop a server."""
        given = {"max_file_bytes": max_file_bytes, "max_files": max_files, "max_total_bytes": max_total_bytes}
        limits = {}
        for key, value in given.items():
            var = f"SPECDEC_TRACE_{key.upper()}"
            if value is None and os.environ.get(var, "").strip():
                try:
                    value = parse_size(os.environ[var])
                except ValueError:
                    log.error("ignoring %s=%r: not a size; using the default", var, os.environ[var])
            if value is not None:
                limits[key] = value
        return cls(**limits)


def span_file_order(path: Path) -> tuple:
    """Sort key: by process, its rotated files oldest first, its current file last."""
    m = _SPAN_FILE.fullmatch(path.name)
    if m is None:
        return (path.name, float("inf"))
    return (m.group("stem"), int(m.group("n")) if m.group("n") else float("inf"))


def span_files(directory: str | Path) -> list[Path]:
    """Every span file in ``directory``, current and rotated, in ``span_file_order``."""
    return sorted(Path(directory).glob("spans-*.jsonl"), key=span_file_order)


class JsonLinesSpanExporter(SpanExporter):
    """One span per line, appended to ``spans-<service>-<pid>.jsonl`` in ``directory``,
    rotated and pruned as ``retention`` says (see the module docstring).

    One file per process, so processes never interleave partial lines; a batch is one write
    (from the ``BatchSpanProcessor``'s thread, off the request path) unless a rotation falls
    inside it, and then the batch is split between two lines.
    """

    def __init__(self, directory: str | Path, service_name: str, retention: Retention | None = None):
        self.directory = Path(directory)
        self.service_name = service_name
        self.retention = retention or Retention.resolve()
        self._lock = threading.Lock()
        self._file = None
        self._pid = -1
        self._size = 0  # bytes in the current file

    @property
    def path(self) -> Path:
        return self.directory / span_file_name(self.service_name, os.getpid())

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [(json.dumps(span_to_dict(s)) + "\n").encode("utf-8") for s in spans]
        try:
            with self._lock:
                if self._pid != os.getpid() or not self._still_ours():
                    self._open()  # first export, a forked child, or our file was deleted or moved
                self._write(lines)
        except OSError:
            log.exception("could not write spans to %s", self.directory)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _still_ours(self) -> bool:
        """Whether ``path`` is still the file we hold open (a directory-wide cap in another
        process may have deleted it); refreshes ``_size`` from the file itself."""
        if self._file is None:
            return False
        try:
            held, named = os.fstat(self._file.fileno()), os.stat(self.path)
        except FileNotFoundError:
            return False
        self._size = held.st_size
        return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)

    def _open(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115  (held open across exports)
        self._pid = os.getpid()
        self._size = os.fstat(self._file.fileno()).st_size
        self._enforce_total()

    def _write(self, lines: list[bytes]) -> None:
        """Append ``lines``, rotating between two lines whenever the next would take the file
        past ``max_file_bytes``. A line longer than that on its own gets a file to itself."""
        pending: list[bytes] = []
        pending_bytes = 0
        for line in lines:
            filled = self._size + pending_bytes
            if filled and filled + len(line) > self.retention.max_file_bytes:
                self._append(pending)
                pending, pending_bytes = [], 0
                self._rotate()
            pending.append(line)
            pending_bytes += len(line)
        self._append(pending)

    def _append(self, lines: list[bytes]) -> None:
        if lines:
            data = b"".join(lines)
            self._file.write(data)
            self._file.flush()
            self._size += len(data)

    def _rotated(self) -> dict[int, Path]:
        """This process's rotated files by number."""
        stem = self.path.name[: -len(".jsonl")]
        found = {}
        for path in self.directory.glob(f"{glob.escape(stem)}.*.jsonl"):
            m = _SPAN_FILE.fullmatch(path.name)
            if m and m.group("stem") == stem and m.group("n"):
                found[int(m.group("n"))] = path
        return found

    def _rotate(self) -> None:
        """The current file becomes the newest rotated one; the oldest beyond ``max_files`` go."""
        self._file.close()
        self._file = None
        rotated = self._rotated()
        n = max(rotated, default=0) + 1
        rotated[n] = self.path.with_name(f"{self.path.name[: -len('.jsonl')]}.{n}.jsonl")
        try:
            os.replace(self.path, rotated[n])
        except FileNotFoundError:  # another process's directory cap deleted it: nothing to keep
            del rotated[n]
        for old in sorted(rotated)[: max(0, len(rotated) - self.retention.max_files)]:
            rotated[old].unlink(missing_ok=True)
        self._open()

    def _enforce_total(self) -> None:
        """Delete the oldest span files of any process (by last write; never our current
        one) until the directory's span files fit in ``max_total_bytes``."""
        cap = self.retention.max_total_bytes
        if not cap:
            return
        files = []
        for path in self.directory.glob("spans-*.jsonl"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # rotated or deleted by another process meanwhile
            files.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in files)
        if total <= cap:
            return
        freed, deleted = 0, 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total - freed <= cap:
                break
            if path == self.path:
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError:
                log.warning("could not delete old span file %s", path, exc_info=True)
                continue
            freed, deleted = freed + size, deleted + 1
        log.info("deleted %d old span files (%d bytes): %s is capped at %d bytes", deleted, freed, self.directory, cap)

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file, self._pid = None, -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(span: ReadableSpan) -> dict:
    """The JSON-lines record of a finished span (ids in W3C hex, times in epoch ns)."""
    ctx, parent = span.context, span.parent
    record = {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "service": span.resource.attributes.get("service.name"),
        "pid": os.getpid(),
        "attributes": dict(span.attributes or {}),  # tuples encode as JSON arrays
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
    }
    if span.links:
        record["links"] = [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ]
    return record


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

    @classmethod
    def from_dict(cls, d: dict) -> "SpanRecord":
        return cls(
            trace_id=d["trace_id"], span_id=d["span_id"], parent_id=d.get("parent_id"), name=d["name"],
            start_ns=int(d["start_ns"]), end_ns=int(d["end_ns"]), attributes=d.get("attributes") or {},
            events=d.get("events") or [], service=d.get("service"), status=d.get("status", "UNSET"),
            links=d.get("links") or [],
        )

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
                span = SpanRecord.from_dict(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line (or foreign junk): skip it
            if since_ns is None or span.end_ns >= since_ns:
                spans.append(span)
    return spans


class Trace:
    """The spans of one request (its ``request`` span, rounds and worker spans) and the
    request's numbers: from the request span's final attributes, else from the rounds."""

    def __init__(self, trace_id: str, spans: list[SpanRecord]):
        self.trace_id, self.spans = trace_id, sorted(spans, key=lambda s: s.start_ns)
        self._children: dict[str, list[SpanRecord]] = {}
        for s in self.spans:
            self._children.setdefault(s.parent_id, []).append(s)
        ids = {s.span_id for s in self.spans}
        roots = [s for s in self.spans if s.parent_id not in ids]  # the caller's span is elsewhere
        self.request = ([s for s in roots if s.name == "request"] or roots or [None])[0]
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
    traces = [t for t in traces if t.request is not None and t.request.name == "request"]
    return sorted(traces, key=lambda t: t.start_ns)


def find_trace(traces: list[Trace], prefix: str) -> Trace:
    prefix = prefix.lower()
    matches = [t for t in traces if t.trace_id.startswith(prefix)]
    if not matches:
        raise ValueError(f"no trace starts with {prefix!r}")
    if len(matches) > 1:
        raise ValueError(f"{prefix!r} is ambiguous: " + ", ".join(t.trace_id[:12] for t in matches[:5]))
    return matches[0]


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``1h``, ``2d`` (a bare number is seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ValueError(f"bad duration {text!r}: use e.g. 90s, 30m, 1h, 2d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def local_time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# --- list ------------------------------------------------------------------------------


def format_list(traces: list[Trace], limit: int) -> str:
    header = (
        f"{'trace id':<32}  {'time':<19}  {'mode':<6} {'in':>5} {'out':>5} {'rounds':>6} {'accept':>6} "
        f"{'latency ms':>10}  finish"
    )
    lines = [header]
    for t in reversed(traces[-limit:] if limit > 0 else traces):
        lines.append(
            f"{t.trace_id:<32}  {local_time(t.start_ns):<19}  {t.mode:<6} {t.input_tokens or '-':>5} "
            f"{t.output_tokens:>5} "
            f"{len(t.decode_rounds):>6} {fmt(t.acceptance):>6} {t.latency_ms:>10.1f}  {t.finish_reason}"
        )
    return "\n".join(lines)


# --- summary ---------------------------------------------------------------------------


def format_summary(traces: list[Trace], window: str) -> str:
    if not traces:
        return f"no requests in {window}"
    first, last = local_time(traces[0].start_ns), local_time(traces[-1].start_ns)
    lines = [f"{len(traces)} requests in {window} ({first} .. {last})"]
    modes = Counter(t.mode for t in traces)
    lines.append("modes: " + ", ".join(f"{m} {n}" for m, n in modes.most_common()))
    spec = [t for t in traces if t.acceptance is not None]
    rounds = [r for t in traces for r in t.decode_rounds]
    rows = [
        ("latency ms", [t.latency_ms for t in traces]),
        ("TTFT ms", [x for t in traces if (x := t.ttft_ms) is not None]),
        ("tokens/s", [t.tokens_per_s for t in traces]),
        ("acceptance", [t.acceptance for t in spec]),
        ("mean accepted length", [x for t in spec if (x := t.mean_accepted_length) is not None]),
        ("round draft ms", [r.attributes.get("specdec.draft_ms", 0.0) for r in rounds]),
        ("round verify ms", [r.attributes.get("specdec.verify_ms", 0.0) for r in rounds]),
    ]
    lines += ["", f"{'':<22}{'n':>6}{'p50':>10}{'p95':>10}{'mean':>10}{'max':>10}"]
    for name, xs in rows:
        if xs:
            lines.append(
                f"{name:<22}{len(xs):>6}{percentile(xs, 50):>10.2f}{percentile(xs, 95):>10.2f}"
                f"{sum(xs) / len(xs):>10.2f}{max(xs):>10.2f}"
            )
    drafted = [r for r in rounds if r.attributes.get("specdec.drafted", 0)]
    if drafted:
        counts = Counter(r.attributes.get("specdec.accepted", 0) for r in drafted)
        lines += ["", f"accepted drafts per speculative round ({len(drafted)} rounds):"]
        for a in range(max(counts) + 1):
            share = counts[a] / len(drafted)
            lines.append(f"  {a:>3}  {'#' * round(share * 40):<40} {share * 100:5.1f}%")
    return "\n".join(lines)


# --- the CLI ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="traces_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", type=Path, default=None, help="span files (default: $SPECDEC_HOME/traces)")
    ls = sub.add_parser("list", parents=[common], help="recent requests, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--since", default=None, help="only the last 30m, 1h, 2d, ...")
    show = sub.add_parser("show", parents=[common], help="a waterfall of one request's rounds")
    show.add_argument("trace_id", help="a trace id or a unique prefix of one")
    show.add_argument("--all", action="store_true", help="also the worker spans (draft / verify)")
    show.add_argument("--width", type=int, default=60)
    show.add_argument("--html", type=Path, default=None, help="write a self-contained timeline page here")
    summary = sub.add_parser("summary", parents=[common], help="acceptance and latency distributions")
    summary.add_argument("--since", default="1h", help="time window: 30m, 1h, 2d, ... (default 1h)")


def run_from_args(args: argparse.Namespace) -> int:
    directory = args.dir or default_trace_dir()
    if args.traces_command == "list":
        since = parse_duration(args.since) if args.since else None
        traces = load_traces(directory, since_s=since)
        print(format_list(traces, args.limit) if traces else f"no traces in {directory}")
    elif args.traces_command == "show":
        trace = find_trace(load_traces(directory), args.trace_id)
        if args.html:
            from specdec.traces_html import render_html

            args.html.write_text(render_html(trace), encoding="utf-8")
            print(f"wrote {args.html}")
        else:
            from specdec.traces_html import format_waterfall

            print(format_waterfall(trace, width=max(20, args.width), show_all=args.all))
    elif args.traces_command == "summary":
        traces = load_traces(directory, since_s=parse_duration(args.since))
        print(format_summary(traces, f"the last {args.since}"))
    sys.stdout.flush()
    return 0
