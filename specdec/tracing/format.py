"""The trace format: span and attribute names, and the span files the writer appends to.

``specdec.telemetry`` names spans and attributes with the schema below and writes the spans
through ``JsonLinesSpanExporter``; ``specdec.tracing.reader`` reads them back.

Every traced process (``specdec.telemetry``) appends one span per line to
``$SPECDEC_HOME/traces/spans-<service>-<pid>.jsonl`` (``SPECDEC_HOME`` defaults to
``~/.cache/specdec``). Each line is an OTLP/JSON ``ExportTraceServiceRequest`` holding one span
(``specdec.tracing.otlp``), so the files replay into an OpenTelemetry collector (its
``otlpjsonfile`` receiver) as they are. The router writes all the spans of a request (older
traces have draft / verify spans in the workers' files too). Files written before OTLP/JSON (one
flat record a line: ``trace_id``, ``span_id``, ``parent_id``, ``name``, ``start_ns``, ...) still
read back: the reader tells the two apart line by line.

The request span is named as the GenAI semantic conventions say, ``{gen_ai.operation.name}
{gen_ai.request.model}`` (``chat SmolLM2-135M-Instruct``); older files named it ``request``.
``is_request_span`` finds it either way.

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
"""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from specdec.paths import specdec_home
from specdec.tracing.otlp import LineEncoder

if TYPE_CHECKING:
    from specdec.stats import RoundStats

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

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/)
OPERATION = "gen_ai.operation.name"  # "chat" or "text_completion"
MODEL = "gen_ai.request.model"
PROVIDER = "gen_ai.provider.name"
PROVIDER_NAME = "specdec"  # what serves the model: us (semconv's well-known values are vendors)
ERROR_TYPE = "error.type"  # on a failed request: the exception's class name
OLD_REQUEST_NAME = "request"  # the request span's name before the GenAI span name (and its fallback)

# request_attributes' keywords and the GenAI / specdec attribute each becomes
_REQUEST_KEYS = {
    "operation": OPERATION,
    "model": MODEL,
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
    """The request span's opening attributes from ``_REQUEST_KEYS``' keywords (None left out),
    and ``gen_ai.provider.name``."""
    unknown = set(fields) - set(_REQUEST_KEYS)
    if unknown:
        raise TypeError(f"unknown request attributes: {sorted(unknown)}")
    fields["operation"] = operation
    return {PROVIDER: PROVIDER_NAME, **{_REQUEST_KEYS[k]: v for k, v in fields.items() if v is not None}}


def request_span_name(attributes: Mapping[str, Any]) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}``, as the GenAI conventions name an
    inference span (the operation alone without a model; ``request`` without an operation)."""
    operation, model = attributes.get(OPERATION), attributes.get(MODEL)
    if not operation:
        return OLD_REQUEST_NAME
    return f"{operation} {model}" if model else str(operation)


def is_request_span(name: str, kind: str | None, attributes: Mapping[str, Any]) -> bool:
    """Whether a span read back is a request span: a SERVER span with a GenAI operation (its
    name varies with the model), or one named ``request`` (files written before the rename)."""
    return name == OLD_REQUEST_NAME or (kind == "SERVER" and OPERATION in attributes)


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
    if getattr(stats, "match", 0):  # prompt lookup: the length of the suffix it matched
        attrs["specdec.lookup_match"] = stats.match
    return attrs


ROUND_NAMES = ("prefill", "round")


def default_trace_dir() -> Path:
    return specdec_home() / "traces"


def span_file_name(service: str, pid: int) -> str:
    return f"spans-{re.sub(r'[^A-Za-z0-9_.-]', '_', service)}-{pid}.jsonl"


# spans-<service>-<pid>.jsonl (the current file) or spans-<service>-<pid>.<n>.jsonl (rotated);
# the stem is everything up to the pid, which is what ties a rotated file to its process
# (the writer finds its own rotated files by it, the reader orders the files by it).
SPAN_FILE = re.compile(r"(?P<stem>spans-.+-\d+)(?:\.(?P<n>\d+))?\.jsonl")
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


class JsonLinesSpanExporter(SpanExporter):
    """One span per line, appended to ``spans-<service>-<pid>.jsonl`` in ``directory``,
    rotated and pruned as ``retention`` says (see the module docstring).

    One file per process, so processes never interleave partial lines; a batch is one write
    (from the ``BatchSpanProcessor``'s thread, off the request path) unless a rotation falls
    inside it, and then the batch is split between two files (between two lines, never inside one).
    """

    def __init__(self, directory: str | Path, service_name: str, retention: Retention | None = None):
        self.directory = Path(directory)
        self.service_name = service_name
        self.retention = retention or Retention.resolve()
        self._lock = threading.Lock()
        self._file = None
        self._pid = -1
        self._size = 0  # bytes in the current file
        self._encoder = LineEncoder()

    @property
    def path(self) -> Path:
        return self.directory / span_file_name(self.service_name, os.getpid())

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [self._encoder.line(s).encode("utf-8") for s in spans]
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
            m = SPAN_FILE.fullmatch(path.name)
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
