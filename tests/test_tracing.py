"""Tracing: the span tree one request's ``RoundStats`` make, context across the Ray hop, the
JSON-lines files and ``specdec traces``, the HTML timeline, and OTLP to a real receiver on
127.0.0.1.

A request is fed as the router feeds it: scripted ``RoundStats`` (timings, modes, the policy's
``events``) recorded into ``request_span`` one by one, then ``finish``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specdec import telemetry
from specdec.cli import main as cli_main
from specdec.stats import RoundStats
from specdec.tracing.format import JsonLinesSpanExporter, Retention, round_attributes
from specdec.tracing.otlp import span_dicts
from specdec.tracing.reader import SpanRecord, find_trace, load_traces, span_files
from specdec.tracing.view import render_html

ACCEPT = [3, 4, 1, 0, 2, 4, 4, 1, 2, 3]  # accepted drafts of the speculative rounds, in order
MAX_TOKENS = 30
# the policy's decisions, on the round they were taken for: a fallback to plain steps at
# rounds 3-4, then a probe at round 5
EVENTS = {3: ("fallback",), 5: ("probe:draft",)}
PLAIN = {3, 4}
DRAFT_S, VERIFY_S = 0.0005, 0.001


def scripted_rounds(max_tokens: int = MAX_TOKENS, *, k: int = 4, events=EVENTS, plain=PLAIN, modes=None):
    """The RoundStats of one request as the step loop makes them, each when its round is
    over (the round's time really passes, so the rounds lie inside the request span):
    prefill, then rounds of ``k`` drafts accepting ``ACCEPT`` in turn, plain at ``plain``,
    with the policy's ``events``, until ``max_tokens`` are out. ``modes``: round -> drafter."""
    produced, index, speculative = 0, 0, 0
    while produced < max_tokens:
        started = time.time()
        if index == 0:
            mode, kk, drafted, accepted, draft_s = "prefill", 0, 0, 0, 0.0
        else:
            mode = "off" if index in plain else (modes or {}).get(index, "draft")
            kk = 0 if index in plain else min(k, max_tokens - produced - 1)
            accepted = min(ACCEPT[speculative % len(ACCEPT)], kk) if kk else 0
            speculative += bool(kk)
            drafted, draft_s = kk, DRAFT_S if kk else 0.0
        emitted = min(accepted + 1, max_tokens - produced)
        time.sleep(draft_s + VERIFY_S)
        produced += emitted
        yield RoundStats(index, mode, kk, drafted, accepted, emitted, draft_s, VERIFY_S, started_at=started,
                         events=tuple(events.get(index, ())))
        index += 1


def run_request(carrier=None, max_tokens: int = MAX_TOKENS, name=None, **script):
    """One traced request, as the router runs it; returns its RoundStats."""
    attrs = telemetry.request_attributes(model="tiny", max_tokens=max_tokens, temperature=0.0, request_id="cmpl-1")
    stats = []
    with telemetry.request_span(name, carrier=carrier, attributes=attrs) as trace:
        for st in scripted_rounds(max_tokens, **script):
            trace.record(st)
            stats.append(st)
        trace.finish(finish_reason="length", input_tokens=3, mode="draft")
    return stats


TRACE_ENV = ("SPECDEC_TRACE_MAX_FILE_BYTES", "SPECDEC_TRACE_MAX_FILES", "SPECDEC_TRACE_MAX_TOTAL_BYTES",
             "SPECDEC_TRACE_TRUST_INCOMING", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER",
             "OTEL_TRACES_SAMPLER_ARG")


@pytest.fixture(autouse=True)
def _no_trace_settings_from_outside(monkeypatch):
    """Retention, trust, sampling and the resource come from the tests, not from the shell."""
    for var in TRACE_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def tracing(tmp_path, monkeypatch):
    """Tracing to a fresh directory and an in-memory exporter; reset afterwards."""
    for var in ("SPECDEC_TRACING", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    telemetry.shutdown()
    memory = InMemorySpanExporter()
    telemetry.configure_tracing("test-router", directory=tmp_path, exporters=[memory])
    yield memory
    telemetry.shutdown()


@pytest.fixture
def configure(tmp_path, monkeypatch):
    """``configure(**configure_tracing keywords)``: tracing to ``tmp_path`` and an in-memory
    exporter (returned), configured as the test says; reset afterwards."""
    for var in ("SPECDEC_TRACING", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    telemetry.shutdown()

    def configure(**kwargs):
        memory = InMemorySpanExporter()
        assert telemetry.configure_tracing("test-router", directory=tmp_path, exporters=[memory], **kwargs)
        return memory

    yield configure
    telemetry.shutdown()


def finished(memory):
    telemetry.flush()
    return memory.get_finished_spans()


def requests(spans) -> list:
    """The request spans (SERVER: the only kind we make there) among finished spans."""
    return [s for s in spans if s.kind == SpanKind.SERVER]


def round_spans(spans) -> list:
    return sorted((s for s in spans if s.name in ("prefill", "round")), key=lambda s: s.start_time)


def children(spans, parent) -> dict:
    """``parent``'s children by name (asserting the names are unique)."""
    kids = [c for c in spans if c.parent is not None and c.parent.span_id == parent.context.span_id]
    by_name = {c.name: c for c in kids}
    assert len(by_name) == len(kids)
    return by_name


def test_span_tree_timings_and_events(tracing):
    stats = run_request()
    spans = finished(tracing)
    (request,) = requests(spans)
    assert request.parent is None and request.name == "text_completion tiny"  # GenAI: "{operation} {model}"
    assert request.attributes["gen_ai.provider.name"] == "specdec" and "error.type" not in request.attributes
    assert request.status.status_code.name == "UNSET"
    assert {s.context.trace_id for s in spans} == {request.context.trace_id}
    rounds = round_spans(spans)
    assert [s.name for s in rounds] == ["prefill"] + ["round"] * (len(stats) - 1)
    assert len(spans) == 1 + len(rounds) + len(stats) + sum(1 for st in stats if st.k)  # nothing else
    for span, st in zip(rounds, stats):
        assert span.parent.span_id == request.context.span_id
        assert span.start_time == int(st.started_at * 1e9)
        assert span.end_time - span.start_time == int(st.draft_s * 1e9) + int(st.verify_s * 1e9)
        assert request.start_time <= span.start_time and span.end_time <= request.end_time
        assert span.attributes["specdec.k"] == st.k and span.attributes["specdec.accepted"] == st.accepted
        assert span.attributes["specdec.mode"] == st.mode and span.attributes["specdec.bonus"] == st.bonus
        assert span.attributes["specdec.round"] == st.index and span.attributes["specdec.emitted"] == st.emitted
        # draft (when drafting) then verify, from the round's timings
        phases = children(spans, span)
        verify = phases["verify"]
        assert verify.end_time == span.end_time and verify.start_time == span.start_time + int(st.draft_s * 1e9)
        if st.k:
            assert set(phases) == {"draft", "verify"}
            assert phases["draft"].start_time == span.start_time and phases["draft"].end_time == verify.start_time
        else:
            assert set(phases) == {"verify"}
        assert all(not children(spans, p) for p in phases.values())
    # the policy's events land on the round they were taken for, at its start
    events = {
        r.attributes["specdec.round"]: [(e.name, dict(e.attributes)) for e in r.events] for r in rounds if r.events
    }
    assert events == {
        3: [(telemetry.EVENT_FALLBACK, {})],
        5: [(telemetry.EVENT_PROBE, {"specdec.mode": "draft"})],
    }
    assert all(e.timestamp == r.start_time for r in rounds for e in r.events)
    assert rounds[3].attributes["specdec.mode"] == "off" and rounds[5].attributes["specdec.mode"] == "draft"
    assert not request.events
    # the request's final statistics
    decode_rounds = stats[1:]
    a = request.attributes
    assert a["gen_ai.request.model"] == "tiny" and a["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert a["gen_ai.usage.input_tokens"] == 3 and a["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["specdec.rounds"] == len(decode_rounds)
    assert a["specdec.accepted"] == sum(s.accepted for s in decode_rounds)
    assert a["specdec.drafted"] == sum(s.drafted for s in decode_rounds)
    assert a["specdec.ttft_ms"] == pytest.approx((rounds[0].end_time - request.start_time) / 1e6)


def test_a_lookup_round_span_names_the_length_of_the_suffix_it_matched():
    """Prompt lookup's rounds carry ``specdec.lookup_match`` (what the policy judged them by);
    a round of another drafter, or one that matched nothing, carries none."""
    lookup = RoundStats(3, "ngram", 8, 8, 5, 6, 0.0, 0.01, match=4)
    assert round_attributes(lookup)["specdec.lookup_match"] == 4
    assert "specdec.lookup_match" not in round_attributes(RoundStats(3, "eagle", 4, 4, 1, 2, 0.002, 0.01))
    assert "specdec.lookup_match" not in round_attributes(RoundStats(3, "ngram", 0, 0, 0, 1, 0.0, 0.01))


def test_every_policy_event_kind_with_its_mode(tracing):
    """fallback, probe, resume and switch each become their event, several on one round in
    order, ``specdec.mode`` only where a mode is named; an unknown kind keeps its name."""
    events = {2: ("fallback",), 4: ("probe:draft",), 5: ("resume:draft", "switch:ngram"), 6: ("retune",)}
    run_request(max_tokens=20, events=events, plain={2, 3}, modes={5: "ngram", 6: "ngram"})
    rounds = {s.attributes["specdec.round"]: s for s in round_spans(finished(tracing))}
    got = {i: [(e.name, dict(e.attributes)) for e in r.events] for i, r in rounds.items() if r.events}
    assert got == {
        2: [(telemetry.EVENT_FALLBACK, {})],
        4: [(telemetry.EVENT_PROBE, {"specdec.mode": "draft"})],
        5: [(telemetry.EVENT_RESUME, {"specdec.mode": "draft"}),
            (telemetry.EVENT_MODE_SWITCH, {"specdec.mode": "ngram"})],
        6: [("specdec.retune", {})],
    }
    assert telemetry.POLICY_EVENTS == {"fallback": telemetry.EVENT_FALLBACK, "probe": telemetry.EVENT_PROBE,
                                       "resume": telemetry.EVENT_RESUME, "switch": telemetry.EVENT_MODE_SWITCH}
    assert rounds[2].attributes["specdec.k"] == 0 and rounds[4].attributes["specdec.k"] > 0
    assert rounds[5].attributes["specdec.mode"] == "ngram"


def test_a_failing_request_and_rounds_without_a_start_time(tracing):
    """A block that raises: an ERROR request span with error.type and the exception event, and
    the rounds recorded before still become spans (not failed: nothing failed in them). A
    RoundStats without ``started_at`` is placed by the clock: it ended when recorded."""
    stats = []
    with pytest.raises(RuntimeError, match="the step loop died"):
        with telemetry.request_span() as trace:
            for st in scripted_rounds():
                if st.index == 3:
                    raise RuntimeError("the step loop died")
                if st.index == 2:
                    st.started_at = 0.0
                    recorded = time.time_ns()
                trace.record(st)
                stats.append(st)
    spans = finished(tracing)
    (request,) = requests(spans)
    assert request.status.status_code.name == "ERROR" and request.attributes["error.type"] == "RuntimeError"
    assert request.status.description == "RuntimeError: the step loop died"
    (exception,) = request.events
    assert exception.name == "exception" and exception.attributes["exception.type"] == "RuntimeError"
    assert request.name == "request"  # no GenAI operation named: the generic name
    rounds = round_spans(spans)
    assert len(rounds) == len(stats) == 3
    assert all(s.status.status_code.name == "UNSET" for s in spans if s is not request)
    clocked = rounds[2]
    assert clocked.attributes["specdec.round"] == 2
    assert clocked.end_time - clocked.start_time == int(DRAFT_S * 1e9) + int(VERIFY_S * 1e9)
    assert rounds[1].end_time <= clocked.start_time and recorded <= clocked.end_time <= request.end_time
    assert set(children(spans, clocked)) == {"draft", "verify"}


def test_the_request_span_is_never_current(tracing):
    """The router's block is an async generator: no context is attached across its yields.
    Two such streams consumed in turn on one event loop, the first ended last, each get their
    own tree, and the consumer's current span stays as it was at every step."""

    async def stream(n: int):  # as the router streams a request
        with telemetry.request_span(attributes=telemetry.request_attributes(model=f"m{n}")) as trace:
            for st in scripted_rounds(4 + n):
                trace.record(st)
                await asyncio.sleep(0)
                yield st
            trace.finish(finish_reason="stop", input_tokens=1)

    def current_valid() -> bool:
        return trace_api.get_current_span().get_span_context().is_valid

    async def main():
        first, second = stream(0), stream(1)
        await anext(first)
        assert not current_valid()
        async for _ in second:
            assert not current_valid()
        async for _ in first:
            assert not current_valid()

    asyncio.run(main())
    spans = finished(tracing)
    by_id = {s.context.span_id: s for s in spans}
    reqs = {s.name: s for s in requests(spans)}
    assert set(reqs) == {"text_completion m0", "text_completion m1"}
    assert reqs["text_completion m1"].end_time < reqs["text_completion m0"].end_time
    for name, emitted in (("text_completion m0", 4), ("text_completion m1", 5)):
        mine = [s for s in round_spans(spans) if s.parent.span_id == reqs[name].context.span_id]
        assert sum(s.attributes["specdec.emitted"] for s in mine) == emitted
        assert all(s.context.trace_id == reqs[name].context.trace_id for s in mine)
    for phase in (s for s in spans if s.name in ("draft", "verify")):
        assert by_id[phase.parent.span_id].name in ("prefill", "round")


def test_incoming_traceparent_is_the_parent(tracing):
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    run_request({"traceparent": f"00-{trace_id}-{span_id}-01"})
    spans = finished(tracing)
    (request,) = requests(spans)
    assert f"{request.context.trace_id:032x}" == trace_id
    assert request.parent.is_remote and f"{request.parent.span_id:016x}" == span_id
    assert all(f"{s.context.trace_id:032x}" == trace_id for s in spans)
    assert not request.links  # trusted (the default): the caller is the parent, not a link
    carrier = telemetry.inject(trace_api.NonRecordingSpan(request.context))  # what the router hands back
    assert carrier["traceparent"] == f"00-{trace_id}-{request.context.span_id:016x}-01"


def test_an_unsampled_caller_records_nothing(tracing):
    stats = run_request({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"})
    assert sum(s.emitted for s in stats) == MAX_TOKENS
    assert finished(tracing) == ()


def test_sample_ratio_zero_and_disabled(tmp_path, monkeypatch):
    telemetry.shutdown()
    memory = InMemorySpanExporter()
    telemetry.configure_tracing("r", directory=tmp_path, sample_ratio=0.0, exporters=[memory])
    try:
        run_request()
        assert finished(memory) == ()
    finally:
        telemetry.shutdown()
    monkeypatch.setenv("SPECDEC_TRACING", "0")
    off = tmp_path / "off"
    assert telemetry.configure_tracing("r", directory=off) is None
    stats = run_request()  # a disabled tracer still runs the request, and writes nothing
    assert sum(s.emitted for s in stats) == MAX_TOKENS
    telemetry.shutdown()
    assert not off.exists()


CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
SAMPLED_CALLER = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}


def test_an_untrusted_caller_cannot_force_tracing(configure):
    """Not trusting incoming context, a caller's sampled flag does not outvote ratio 0: no
    request span, and no round span either (they follow the request's decision)."""
    memory = configure(sample_ratio=0.0, trust_incoming=False)
    run_request(SAMPLED_CALLER)
    assert finished(memory) == ()


def test_an_untrusted_caller_gets_a_new_trace_linked_to_its_own(configure, tmp_path):
    memory = configure(sample_ratio=1.0, trust_incoming=False)
    stats = run_request(SAMPLED_CALLER)
    spans = finished(memory)
    (request,) = requests(spans)
    assert request.parent is None and f"{request.context.trace_id:032x}" != CALLER_TRACE
    (link,) = request.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == (CALLER_TRACE, CALLER_SPAN)
    # our own trace is whole: rounds under the request, draft / verify under the rounds
    assert {s.context.trace_id for s in spans} == {request.context.trace_id}
    by_id = {s.context.span_id: s for s in spans}
    assert len([s for s in spans if s.name == "verify"]) == len(stats)
    for phase in (s for s in spans if s.name in ("draft", "verify")):
        assert by_id[phase.parent.span_id].name in ("prefill", "round")
    # and the link reaches the span files
    (trace,) = load_traces(tmp_path)
    assert trace.trace_id == f"{request.context.trace_id:032x}"
    assert [(k["trace_id"], k["span_id"]) for k in trace.request.links] == [(CALLER_TRACE, CALLER_SPAN)]


def test_trust_per_request_and_the_operators_veto(configure, monkeypatch):
    """``request_span``'s own ``trust_incoming`` wins over the configuration, and
    SPECDEC_TRACE_TRUST_INCOMING=0 over both; no carrier, no link."""

    def three_requests():
        with telemetry.request_span(carrier=SAMPLED_CALLER):
            pass
        with telemetry.request_span(carrier=SAMPLED_CALLER, trust_incoming=True):
            pass
        with telemetry.request_span():
            pass
        spans = sorted(finished(memory), key=lambda s: s.start_time)
        memory.clear()
        return [(f"{s.context.trace_id:032x}" == CALLER_TRACE, len(s.links)) for s in spans]

    memory = configure(sample_ratio=1.0, trust_incoming=False)
    assert three_requests() == [(False, 1), (True, 0), (False, 0)]
    telemetry.shutdown()
    monkeypatch.setenv("SPECDEC_TRACE_TRUST_INCOMING", "0")
    memory = configure(sample_ratio=1.0)  # trusting, says the code
    assert three_requests() == [(False, 1), (False, 1), (False, 0)]


def write_spans(exporter, count: int, *, pad: int = 200) -> None:
    """``count`` spans of one trace through ``exporter``, one export each; same-sized lines."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("root"):
        for _ in range(count):
            tracer.start_span("s", attributes={"pad": "x" * pad}).end()


def lines_of(paths) -> list[dict]:
    """Every line of ``paths`` as a flat span record; each must be one whole OTLP/JSON span."""
    out = []
    for path in paths:
        text = path.read_text()
        assert text.endswith("\n")
        for line in text.splitlines():
            (span,) = span_dicts(json.loads(line))
            out.append(span)
    return out


def test_span_files_rotate_under_the_size_and_count_caps(tmp_path):
    exporter = JsonLinesSpanExporter(tmp_path, "svc", Retention(max_file_bytes=2048, max_files=3, max_total_bytes=0))
    write_spans(exporter, 60)  # about 30 files' worth
    exporter.shutdown()
    files = span_files(tmp_path)
    current = exporter.path
    assert files[-1] == current and len(files) == 4  # three rotated, oldest first, then the current
    numbers = [int(p.name.split(".")[-2]) for p in files[:-1]]
    assert numbers == sorted(numbers) and numbers[0] > 1  # the oldest were deleted
    assert all(p.stat().st_size <= 2048 for p in files)
    spans = lines_of(files)
    assert len({s["trace_id"] for s in spans}) == 1 and len(spans) < 60  # the last ones, whole


def test_no_rotated_files_kept_and_an_oversized_span_kept_whole(tmp_path):
    """``max_files=0`` keeps only the current file; a span longer than a whole file is not
    cut or dropped: it gets a file to itself."""
    none_kept = JsonLinesSpanExporter(tmp_path / "a", "svc", Retention(max_file_bytes=1024, max_files=0))
    write_spans(none_kept, 10)
    assert span_files(tmp_path / "a") == [none_kept.path] and none_kept.path.stat().st_size <= 1024
    none_kept.shutdown()
    one_kept = JsonLinesSpanExporter(tmp_path / "b", "svc", Retention(max_file_bytes=1024, max_files=1))
    write_spans(one_kept, 1, pad=3000)  # the big span, then its (small) root
    one_kept.shutdown()
    rotated, current = span_files(tmp_path / "b")
    (big,) = lines_of([rotated])
    assert big["attributes"]["pad"] == "x" * 3000
    assert [s["name"] for s in lines_of([current])] == ["root"]


def test_a_trace_straddling_rotations_reads_back_whole(configure, tmp_path, monkeypatch):
    """Limits from the environment; one request's spans (one batch) split over several files
    between lines; ``load_traces`` puts them together again."""
    monkeypatch.setenv("SPECDEC_TRACE_MAX_FILE_BYTES", "4K")
    monkeypatch.setenv("SPECDEC_TRACE_MAX_FILES", "50")
    memory = configure()
    stats = run_request()
    in_memory = finished(memory)
    files = span_files(tmp_path)
    assert len(files) > 2 and all(p.stat().st_size <= 4096 for p in files)
    assert len(lines_of(files)) == len(in_memory)
    (trace,) = load_traces(tmp_path)
    assert len(trace.spans) == len(in_memory) and len(trace.rounds) == len(stats)
    assert trace.accepted == sum(s.accepted for s in stats[1:])


def test_the_directory_cap_deletes_the_oldest_files_of_any_process(tmp_path):
    now = time.time()
    foreign = {}
    for i, name in enumerate(["spans-old-11.1.jsonl", "spans-old-11.jsonl", "spans-other-12.jsonl"]):
        path = tmp_path / name
        path.write_text('{"junk": 1}\n' * 100)  # 1200 bytes each, older first
        os.utime(path, (now - 300 + i * 60, now - 300 + i * 60))
        foreign[name] = path
    exporter = JsonLinesSpanExporter(tmp_path, "svc", Retention(max_file_bytes=2600, max_files=8, max_total_bytes=6000))
    write_spans(exporter, 7, pad=0)  # 8 lines of ~760 bytes, 3 a file: two rotations, the cap enforced at each
    exporter.shutdown()
    gone = [name for name, path in foreign.items() if not path.exists()]
    assert 0 < len(gone) < len(foreign) and gone == list(foreign)[: len(gone)]  # oldest first, only as needed
    assert exporter.path.exists()
    assert sum(p.stat().st_size for p in tmp_path.glob("spans-*.jsonl")) <= 6000 + 2600


def test_a_span_file_deleted_under_the_writer_is_started_again(tmp_path):
    exporter = JsonLinesSpanExporter(tmp_path, "svc", Retention(max_total_bytes=0))
    write_spans(exporter, 2)
    exporter.path.unlink()
    write_spans(exporter, 3)
    exporter.shutdown()
    assert len(lines_of([exporter.path])) == 3 + 1  # the second root included


def test_retention_limits_from_arguments_then_environment(monkeypatch, caplog):
    monkeypatch.setenv("SPECDEC_TRACE_MAX_FILE_BYTES", "1K")
    monkeypatch.setenv("SPECDEC_TRACE_MAX_FILES", "2")
    monkeypatch.setenv("SPECDEC_TRACE_MAX_TOTAL_BYTES", "lots")
    with caplog.at_level(logging.ERROR, logger="specdec.tracing.format"):
        limits = Retention.resolve(max_files=5)
    assert limits == Retention(max_file_bytes=1024, max_files=5, max_total_bytes=Retention().max_total_bytes)
    assert "SPECDEC_TRACE_MAX_TOTAL_BYTES" in caplog.text
    with pytest.raises(ValueError):
        Retention.resolve(max_file_bytes=0)


def test_configure_is_idempotent(tracing, tmp_path):
    first = telemetry.configure_tracing("again", directory=tmp_path / "other")
    assert first is telemetry.configure_tracing("yet-again")
    assert not (tmp_path / "other").exists()


def cli(capsys, *argv) -> str:
    assert cli_main(["traces", *argv]) == 0
    return capsys.readouterr().out


def test_json_lines_read_back_by_the_cli(tracing, tmp_path, capsys):
    stats = [run_request() for _ in range(3)][-1]
    telemetry.flush()
    (path,) = tmp_path.glob("spans-test-router-*.jsonl")
    # one trace in two processes' files (as the workers' spans were, in older traces); a killed
    # process leaves a torn line
    lines = path.read_text().splitlines()
    phases = [line for line in lines if SpanRecord.from_line(line)[0].name in ("draft", "verify")]
    path.write_text("".join(line + "\n" for line in lines if line not in phases) + lines[0][:40])
    (tmp_path / "spans-test-target-1.jsonl").write_text("".join(line + "\n" for line in phases))

    traces = load_traces(tmp_path)
    assert len(traces) == 3
    trace = traces[-1]
    decode_rounds = stats[1:]
    accepted = sum(s.accepted for s in decode_rounds)
    assert trace.accepted == accepted and len(trace.decode_rounds) == len(decode_rounds)

    listing = cli(capsys, "list", "--dir", str(tmp_path), "--limit", "2")
    rows = listing.splitlines()[1:]
    assert len(rows) == 2 and rows[0].startswith(trace.trace_id)  # newest first
    fields = rows[0].split()
    assert fields[3:6] == ["draft", "3", str(MAX_TOKENS)] and fields[6] == str(len(decode_rounds))
    assert fields[7] == f"{accepted / sum(s.drafted for s in decode_rounds):.2f}"

    shown = cli(capsys, "show", trace.trace_id[:8], "--dir", str(tmp_path), "--all")
    round_lines = [line for line in shown.splitlines() if re.match(r"round +\d+ ", line)]
    assert len(round_lines) == len(decode_rounds)
    for line, st in zip(round_lines, decode_rounds):
        if st.k:
            assert f" {st.accepted}/{st.k}" in line
        bar = line[line.index("|") + 1 : line.rindex("|")]
        assert bar.strip() and ("#" in bar)
    assert shown.count("└ verify") == len(stats) and shown.count("└ draft") == sum(1 for s in stats if s.k)
    assert "\n    ! specdec.fallback\n" in shown and "\n    ! specdec.probe specdec.mode=draft\n" in shown
    # bars are proportional to time: the request's bar spans the whole width
    request_bar = next(line for line in shown.splitlines() if line.startswith("request"))
    assert request_bar.count("-") == 60

    summary = cli(capsys, "summary", "--dir", str(tmp_path), "--since", "1h")
    assert summary.startswith("3 requests")
    acceptance = next(line for line in summary.splitlines() if line.startswith("acceptance"))
    assert acceptance.split()[1:3] == ["3", f"{trace.acceptance:.2f}"]
    histogram = [line.split()[0] for line in summary.splitlines() if line.rstrip().endswith("%")]
    assert histogram == [str(a) for a in range(max(s.accepted for s in decode_rounds) + 1)]

    assert cli_main(["traces", "show", "ffff", "--dir", str(tmp_path)]) == 2  # no such trace


def test_html_page_is_self_contained_and_draws_every_round(tracing, tmp_path, capsys):
    stats = run_request()
    telemetry.flush()
    (trace,) = load_traces(tmp_path)
    out = tmp_path / "trace.html"
    cli(capsys, "show", trace.trace_id[:10], "--dir", str(tmp_path), "--html", str(out))
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<style>" in page
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""\b(src|href)\s*=|@import|url\(""", page)
    assert "<script" not in page
    assert len(re.findall(r'<g class="round"', page)) == len(stats)  # prefill + every round
    assert len(re.findall(r'<g class="acc-bar"', page)) == len(stats) - 1
    for st in stats[1:]:
        assert f"specdec.round = {st.index}\n" in page  # hover titles carry the attributes
    assert page == render_html(find_trace(load_traces(tmp_path), trace.trace_id))


def _collect(request, received: list) -> None:
    """Append (service.name, span) for every span of an ExportTraceServiceRequest."""
    for resource_spans in request.resource_spans:
        service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                received.append((service, span))


class OTLPReceiver(BaseHTTPRequestHandler):
    """A real OTLP/HTTP trace receiver: decodes ExportTraceServiceRequest protobuf bodies."""

    received: list = []
    paths: list = []

    def do_POST(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        _collect(request, self.received)
        self.paths.append((self.path, self.headers["Content-Type"]))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


class _HttpReceiver:
    protocol_paths = ("/v1/traces", "application/x-protobuf")

    def __init__(self):
        self.server = HTTPServer(("127.0.0.1", 0), OTLPReceiver)
        OTLPReceiver.received, OTLPReceiver.paths = [], []
        self.received, self.paths = OTLPReceiver.received, OTLPReceiver.paths
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self):
        self.server.shutdown()


class _GrpcReceiver:
    """A real OTLP/gRPC trace receiver (the collector's TraceService) on 127.0.0.1."""

    protocol_paths = ("grpc", "TraceService/Export")

    def __init__(self):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.received, self.paths = [], []
        outer = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                _collect(request, outer.received)
                outer.paths.append(outer.protocol_paths)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self):
        self.server.stop(0)


def _otlp_env(monkeypatch, endpoint: str, protocol: str | None) -> None:
    monkeypatch.delenv("SPECDEC_TRACING", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    if protocol is None:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)


def _traced_run(directory) -> list:
    """Configure tracing from the environment, run one traced request, flush; its RoundStats."""
    telemetry.shutdown()
    try:
        telemetry.configure_tracing("otlp-router", directory=directory)  # reads the endpoint now
        stats = run_request()
        assert telemetry.flush()
    finally:
        telemetry.shutdown()
    return stats


@pytest.mark.parametrize("protocol", [None, "http/protobuf", "grpc"])
def test_otlp_export_to_a_real_receiver(tmp_path, monkeypatch, protocol):
    receiver = _GrpcReceiver() if protocol == "grpc" else _HttpReceiver()
    _otlp_env(monkeypatch, receiver.endpoint, protocol)
    try:
        stats = _traced_run(tmp_path)
    finally:
        receiver.stop()
    assert receiver.paths and all(p == receiver.protocol_paths for p in receiver.paths)
    spans = [span for _, span in receiver.received]
    assert {service for service, _ in receiver.received} == {"otlp-router"}
    by_id = {s.span_id: s for s in spans}
    (request,) = [s for s in spans if s.kind == 2]  # SPAN_KIND_SERVER
    rounds = sorted((s for s in spans if s.name in ("prefill", "round")), key=lambda s: s.start_time_unix_nano)
    assert len(rounds) == len(stats) and all(r.parent_span_id == request.span_id for r in rounds)
    attrs = lambda s: {a.key: a.value for a in s.attributes}  # noqa: E731
    assert [attrs(r)["specdec.accepted"].int_value for r in rounds] == [s.accepted for s in stats]
    assert [r.start_time_unix_nano for r in rounds] == [int(s.started_at * 1e9) for s in stats]
    for phase in (s for s in spans if s.name in ("draft", "verify")):
        assert by_id[phase.parent_span_id].name in ("prefill", "round")
    assert attrs(request)["gen_ai.usage.output_tokens"].int_value == MAX_TOKENS
    # the JSON-lines file is written as well
    assert len(load_traces(tmp_path)) == 1


def test_grpc_without_its_exporter_names_the_extra_and_falls_back_to_http(tmp_path, monkeypatch, caplog):
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc without the grpc extra: one error naming the extra, and
    the spans still reach the collector over http/protobuf."""
    receiver = _HttpReceiver()
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    _otlp_env(monkeypatch, receiver.endpoint, "grpc")
    try:
        with caplog.at_level(logging.ERROR, logger="specdec.telemetry"):
            _traced_run(tmp_path)
    finally:
        receiver.stop()
    assert "specdec[otlp-grpc]" in caplog.text
    assert receiver.paths and all(p == receiver.protocol_paths for p in receiver.paths)
    assert len(load_traces(tmp_path)) == 1


def test_a_missing_otlp_exporter_keeps_the_json_lines_and_says_so(tmp_path, monkeypatch, caplog):
    """No OTLP exporter at all: the process still starts, every span still reaches the
    JSON-lines file, and one error line says what to install."""
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    _otlp_env(monkeypatch, "http://127.0.0.1:9", None)
    with caplog.at_level(logging.ERROR, logger="specdec.telemetry"):
        stats = _traced_run(tmp_path)
    assert "opentelemetry-exporter-otlp-proto-http" in caplog.text
    (trace,) = load_traces(tmp_path)
    assert sum(1 for s in trace.spans if s.name in ("prefill", "round")) == len(stats)


# --- the conventions: GenAI span names, the OTEL_* environment, OTLP/JSON files ---------


def test_the_request_span_is_named_and_marked_as_the_genai_conventions_say(tracing):
    """``{gen_ai.operation.name} {gen_ai.request.model}``, ``gen_ai.provider.name``, and on
    failure ``error.type`` (the exception's class) besides the ERROR status."""
    attrs = telemetry.request_attributes(operation="chat", model="SmolLM2-135M-Instruct", max_tokens=4)
    with pytest.raises(TimeoutError):
        with telemetry.request_span(attributes=attrs):
            raise TimeoutError("the unit did not answer")
    with telemetry.request_span(attributes=telemetry.request_attributes(operation="chat")):
        pass  # no model named: the operation alone
    with telemetry.request_span("custom", attributes=attrs):
        pass
    failed, no_model, custom = sorted(requests(finished(tracing)), key=lambda s: s.start_time)
    assert failed.name == "chat SmolLM2-135M-Instruct"
    assert failed.attributes["gen_ai.provider.name"] == "specdec"
    assert failed.attributes["error.type"] == "TimeoutError" and failed.status.status_code.name == "ERROR"
    assert no_model.name == "chat" and "error.type" not in no_model.attributes
    assert custom.name == "custom"


def test_service_name_and_resource_attributes_from_the_environment(configure, tmp_path, monkeypatch):
    """OTEL_SERVICE_NAME beats the code's name; OTEL_RESOURCE_ATTRIBUTES joins the resource;
    both reach the span files (the resource is on every OTLP/JSON line)."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-gateway")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=staging,service.namespace=llm")
    memory = configure()
    run_request()
    spans = finished(memory)
    resource = spans[0].resource.attributes
    assert resource["service.name"] == "llm-gateway"
    assert resource["deployment.environment.name"] == "staging" and resource["service.namespace"] == "llm"
    (trace,) = load_traces(tmp_path)
    assert {s.service for s in trace.spans} == {"llm-gateway"}
    assert trace.request.resource["deployment.environment.name"] == "staging"
    assert [p.name.split("-")[1:3] for p in span_files(tmp_path)] == [["llm", "gateway"]]


@pytest.mark.parametrize(
    ("sampler", "arg", "traced"),
    [
        ("always_off", None, False),  # beats sample_ratio=1.0
        ("traceidratio", "0", False),
        ("parentbased_always_on", None, True),
        ("no_such_sampler", None, True),  # logged and ignored: our ratio (1.0) holds
    ],
)
def test_otel_traces_sampler_decides_when_set(configure, monkeypatch, caplog, sampler, arg, traced):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is None:
        monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    else:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    with caplog.at_level(logging.ERROR, logger="specdec.telemetry"):
        memory = configure(sample_ratio=1.0)
    run_request()
    assert bool(finished(memory)) == traced
    assert ("no_such_sampler" in caplog.text) == (sampler == "no_such_sampler")


def test_an_env_sampler_keeps_the_trust_rules(configure, monkeypatch):
    """With OTEL_TRACES_SAMPLER=parentbased_always_off a trusted caller's sampled flag still
    decides (the parent-based sampler follows it); an untrusted caller's does not."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_off")
    memory = configure(trust_incoming=True)
    run_request(SAMPLED_CALLER)
    assert {f"{s.context.trace_id:032x}" for s in finished(memory)} == {CALLER_TRACE}
    telemetry.shutdown()
    memory = configure(trust_incoming=False)
    run_request(SAMPLED_CALLER)
    assert finished(memory) == ()
    run_request()  # and our own requests: the env sampler's root decision (off)
    assert finished(memory) == ()


def _reference_otlp_json(span) -> dict:
    """What opentelemetry-exporter-otlp-proto-common's encoder and protobuf's JSON mapping make
    of ``span``, with ids turned from base64 into OTLP/JSON's hex."""
    import base64

    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    out = json_format.MessageToDict(encode_spans([span]), use_integers_for_enums=True)
    for rs in out["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                for item in [sp, *sp.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in item:
                            item[key] = base64.b64decode(item[key]).hex()
    return out


def test_span_files_are_otlp_json_a_collector_can_replay(configure, tmp_path, monkeypatch):
    """Every line parses as an ``ExportTraceServiceRequest`` (the protobuf schema rejects
    unknown fields), equals what the OTLP encoder makes of the span, and reads back whole."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.namespace=llm")
    memory = configure(trust_incoming=False)
    stats = run_request(SAMPLED_CALLER)  # a link, events, arrays, doubles, ints, bools
    with pytest.raises(RuntimeError):
        with telemetry.request_span(attributes=telemetry.request_attributes(model="tiny")):
            raise RuntimeError("boom")  # status ERROR with a message, an exception event
    spans = {s.context.span_id: s for s in finished(memory)}
    lines = [line for path in span_files(tmp_path) for line in path.read_text().splitlines()]
    assert len(lines) == len(spans)
    for line in lines:
        request = json_format.Parse(line, ExportTraceServiceRequest())
        (rs,) = request.resource_spans
        (ss,) = rs.scope_spans
        assert len(ss.spans) == 1 and ss.scope.name == "specdec"
        decoded = json.loads(line)
        span = decoded["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        assert re.fullmatch(r"[0-9a-f]{32}", span["traceId"]) and re.fullmatch(r"[0-9a-f]{16}", span["spanId"])
        assert isinstance(span["startTimeUnixNano"], str)
        assert decoded == _reference_otlp_json(spans[int(span["spanId"], 16)])
    traces = load_traces(tmp_path)
    assert len(traces) == 2
    whole, failed = traces
    assert len(whole.rounds) == len(stats) and whole.accepted == sum(s.accepted for s in stats[1:])
    assert whole.request.kind == "SERVER" and whole.request.name == "text_completion tiny"
    assert [(k["trace_id"], k["span_id"]) for k in whole.request.links] == [(CALLER_TRACE, CALLER_SPAN)]
    assert whole.finish_reason == "length" and whole.request.attributes["gen_ai.request.temperature"] == 0.0
    assert failed.request.status == "ERROR" and failed.request.attributes["error.type"] == "RuntimeError"
    assert failed.request.events[0]["name"] == "exception"
    # what other tools write reads too: every span on one line, in protobuf's own JSON mapping
    # (ids in base64, enums by name), as from json_format.MessageToJson
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    batch = tmp_path / "batch"
    batch.mkdir()
    (batch / "spans-collector-1.jsonl").write_text(json_format.MessageToJson(encode_spans(list(spans.values())),
                                                                            indent=None) + "\n")
    again = load_traces(batch)
    assert [t.trace_id for t in again] == [t.trace_id for t in traces]
    assert [len(t.spans) for t in again] == [len(t.spans) for t in traces]
    assert again[0].request.kind == "SERVER" and again[1].request.status == "ERROR"
    assert again[0].accepted == whole.accepted and again[0].request.links == whole.request.links


def _old_record(span) -> dict:
    """A span as the files held it before OTLP/JSON (the old ``span_to_dict``, verbatim)."""
    ctx, parent = span.context, span.parent
    record = {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name, "kind": span.kind.name, "start_ns": span.start_time, "end_ns": span.end_time,
        "status": span.status.status_code.name, "service": span.resource.attributes.get("service.name"),
        "pid": os.getpid(), "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events],
    }
    if span.links:
        record["links"] = [
            {"trace_id": f"{k.context.trace_id:032x}", "span_id": f"{k.context.span_id:016x}",
             "attributes": dict(k.attributes or {})}
            for k in span.links
        ]
    return record


def test_span_files_from_before_the_rename_and_otlp_json_still_read(configure, tmp_path, capsys):
    """An old file (flat records, the request span named ``request``) next to a new one:
    ``specdec traces`` lists, shows and sums up both."""
    memory = configure()
    old_stats = run_request(name="request", max_tokens=12, events={}, plain=set())
    old_spans = finished(memory)
    memory.clear()
    old_lines = [json.dumps(_old_record(s)) for s in old_spans]
    (tmp_path / "spans-specdec-router-7.1.jsonl").write_text("\n".join(old_lines) + "\n")
    for path in span_files(tmp_path):
        if path.name != "spans-specdec-router-7.1.jsonl":
            path.unlink()  # the same spans in the new encoding: keep only the old copy
    new_stats = run_request()
    telemetry.flush()
    old, new = load_traces(tmp_path)
    assert old.request.name == "request" and new.request.name == "text_completion tiny"
    assert len(old.rounds) == len(old_stats) and len(new.rounds) == len(new_stats)
    assert old.accepted == sum(s.accepted for s in old_stats[1:]) and old.output_tokens == 12
    listing = cli(capsys, "list", "--dir", str(tmp_path))
    assert [row.split()[0] for row in listing.splitlines()[1:]] == [new.trace_id, old.trace_id]
    shown = cli(capsys, "show", old.trace_id[:10], "--dir", str(tmp_path), "--all")
    assert shown.count("└ verify") == len(old_stats)
    assert cli(capsys, "summary", "--dir", str(tmp_path)).startswith("2 requests")
