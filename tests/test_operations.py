"""Operating the server as an operator does (``specdec ops``, docs/operations.md): a cluster
started with ``ray start --head`` under Ray 2.60's token authentication, configs applied with
the real ``serve deploy`` and read with ``serve status``; then, under 16 streams, a rolling
upgrade (flag, speculation, model), faults (target worker, draft worker, router replica,
Ingress replica killed in turn) and a 60 s soak. The tiny models run in float32, so every
greedy answer and every seeded sampled one is checked token for token against a reference."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import yaml

from deployments import load, operate
from deployments.cluster import LocalCluster

PORT = 8127
TRACE_CAP_MB, TRACE_FILE_MB = 24, 4  # small, so that the soak's traces reach the cap and are pruned


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    traces = {"SPECDEC_TRACE_MAX_TOTAL_BYTES": f"{TRACE_CAP_MB}M", "SPECDEC_TRACE_MAX_FILE_BYTES": f"{TRACE_FILE_MB}M"}
    with LocalCluster(tmp_path_factory.mktemp("ops"), env_extra=traces) as running:
        yield running


def test_serve_deploy_and_status_as_the_readme_says(cluster, llama_pair):
    """Without RAY_AUTH_MODE=token the CLI is refused (the negative control); with it, `serve
    deploy` brings the app up and `serve status` reports it RUNNING and HEALTHY."""
    refused = cluster.run("serve", "status", "-a", cluster.address,
                          env={k: v for k, v in cluster.env.items() if k != "RAY_AUTH_MODE"})
    assert refused.returncode != 0 and "token" in (refused.stdout + refused.stderr).lower()
    config = operate.tiny_config(llama_pair, port=PORT, ingress="as configured")  # the unit serves HTTP itself
    path = cluster.deploy(config)
    assert yaml.safe_load(path.read_text())["applications"][0]["import_path"] == "deployments.app:build_app"
    state = cluster.wait_running()
    assert {d: s["status"] for d, s in state["deployments"].items()} == {"SpecRouter": "HEALTHY"}
    r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=60,
                   json={"model": operate.MODEL, "prompt": "The cat sees", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert r.json()["system_fingerprint"] == operate.expected_fingerprint(config)


def test_a_rolling_upgrade_under_16_streams_loses_nothing(cluster, llama_pair, gpt2_pair):
    """A flag change (live), a speculation change and a model change, each by `serve deploy`
    while 16 streams run (greedy and seeded, streaming or not, chat and completions): no 5xx,
    nothing lost, and every greedy answer is the reference of the configuration its
    system_fingerprint names (after the model change the text changes: the fingerprint says so)."""
    config = operate.tiny_config(llama_pair, port=PORT, ingress="as configured")  # the unit serves HTTP itself
    nxt = {"target": str(gpt2_pair["target"]), "draft": str(gpt2_pair["draft"])}
    rows, report = asyncio.run(operate.run_upgrade(cluster, config, nxt, streams=16, settle_s=3.0))
    print(operate.table(rows))
    for o in report.outcomes:
        if o.kind == "differs":  # what a failure needs to be understood
            print(f"{o.case} started at {o.started:.1f} s: {o.detail}")
    assert [r.step.split()[0] for r in rows] == ["initial", "flag", "speculation", "model"]
    for row in rows:
        assert row.server_errors == row.lost == row.differs == 0, row
        assert row.exact > 0, row
    # each configuration answered, and only the configurations deployed
    assert set(report.fingerprints()) == {r.fingerprint for r in rows}
    assert rows[-1].fingerprint.split("-")[3] != rows[0].fingerprint.split("-")[3]  # the models' hash moved


def test_faults_under_16_streams_every_request_is_exact_or_a_clean_error(cluster, llama_pair):
    """Kill the target worker, the draft worker, the router replica and the Ingress replica in
    turn, 16 streams running: every request completes token-identical (a seeded sampled one
    waits out the draft worker's restart rather than reroll) or gets an OpenAI error object;
    none is lost; the unit serves again within 30 s of each kill."""
    config = operate.tiny_config(llama_pair, port=PORT, colocation="actors")
    rows, reports = asyncio.run(operate.run_faults(cluster, config, streams=16, before_s=2.0, after_s=1.0))
    print(operate.table(rows))
    assert [r.killed for r in rows] == list(operate.KILLS)
    for row in rows:
        assert row.lost == row.differs == row.rerolled == 0, row
        assert row.exact > 0 and row.restored_s is not None and row.restored_s <= 30, row
    by_role = dict(reports)
    assert rows[0].clean_errors == 0  # a target worker's death is resumed, not failed
    for role in ("router", "ingress"):  # requests in the dead replica: 503 or a stream's error chunk
        errors = [o for o in by_role[role].outcomes if o.kind == "error"]
        assert errors and all(o.code == "unit_failed" for o in errors), role
        assert all(o.retry_after == "1" for o in errors if o.status == 503), role
        assert {o.status for o in errors} <= {200, 503}, role


def test_a_soak_keeps_memory_files_traces_and_series_bounded(cluster, llama_pair):
    """60 s of the mixed load with cancellations and bad requests (on the unit the faults test
    left, workers in actors: deployed once for both): every process's RSS within 10%
    of its post-warm-up value, open files and metric series flat, trace files within their cap."""
    config = operate.tiny_config(llama_pair, port=PORT, colocation="actors")  # the faults' unit: workers too
    # the directory's cap, plus the file each writing process (router, target, draft) may have open
    bounds = operate.SoakBounds(trace_cap_bytes=(TRACE_CAP_MB + 3 * TRACE_FILE_MB) << 20)
    result = asyncio.run(operate.run_soak(cluster, config, duration_s=60, warmup_s=20, streams=8, bounds=bounds))
    print(operate.soak_table(result))
    assert result.problems == []
    assert result.counts["completed"] > 100 and result.counts["cancelled"] > 0 and result.counts["refused"] > 0
    assert "lost" not in result.counts and "differs" not in result.counts
    end = result.samples[-1]
    assert {"router", "target", "draft", "ingress", "proxy", "controller"} <= set(end.rss) and end.metric_series > 0
    assert end.trace_bytes > TRACE_CAP_MB << 19  # the traces did grow to the cap's order: the bound was tested


# --- pieces, without a cluster ------------------------------------------------------------------


def test_classify_tells_a_changed_answer_from_a_rerolled_sample():
    greedy = load.Case("g", "/v1/completions", {"temperature": 0})
    sampled = load.Case("s", "/v1/completions", {"temperature": 0.8, "seed": 1})
    bad = load.Case("b", "/v1/completions", {}, bad=True)
    refs = {"g": [1, 2], "s": [3, 4]}
    done = lambda tokens, failures=0: load.Reply("completed", 200, tokens, "fp", "",  # noqa: E731
                                                 {"draft_failures": failures})
    assert load.classify(greedy, done([1, 2]), refs) == "exact"
    assert load.classify(greedy, done([1, 3], 2), refs) == "differs"  # greedy never rerolls
    assert load.classify(sampled, done([3, 5]), refs) == "differs"
    assert load.classify(sampled, done([3, 5], 1), refs) == "rerolled"
    assert load.classify(bad, load.Reply("refused", 400), refs) == "refused"
    assert load.classify(bad, done([1]), refs) == "lost"  # a bad request served is a failure


def test_the_faults_kill_what_the_layout_has(llama_pair):
    # Behind an Ingress deployment (a cluster's layout) its replica is killed too; in
    # serve_config.yaml's own layout the router replica answers HTTP and there is no Ingress.
    behind = operate.tiny_config(llama_pair, port=PORT, colocation="actors")
    assert operate.kills_for(behind) == ("target", "draft", "router", "ingress")
    shipped = operate.tiny_config(llama_pair, port=PORT, colocation="actors", ingress="as configured")
    assert operate.kills_for(shipped) == ("target", "draft", "router")
    assert operate.kills_for(operate.tiny_config(llama_pair, port=PORT, ingress="as configured")) == ("router",)
    with pytest.raises(ValueError, match="'separate' or 'as configured'"):
        operate.tiny_config(llama_pair, port=PORT, ingress="in_unit")


def test_the_unit_fingerprint_names_flags_speculation_and_models(llama_pair, gpt2_pair):
    config = operate.tiny_config(llama_pair, port=PORT)
    steps = operate.upgrade_steps(config, {"target": str(gpt2_pair["target"]), "draft": str(gpt2_pair["draft"])})
    prints = [operate.expected_fingerprint(c) for c in [config, *(c for _, c in steps)]]
    assert len(set(prints)) == 4
    assert prints[0] == operate.expected_fingerprint(json.loads(json.dumps(config)))  # a function of the config


async def _asgi(app, request_body: bytes = b"{}", receive_after=None) -> tuple[list[dict], Exception | None]:
    """Call an ASGI ``app`` once; the messages it sent, and what it raised."""
    sent, calls = [], 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": request_body, "more_body": False}
        if receive_after is not None:
            raise receive_after
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    try:
        await app(scope, receive, send)
    except BaseException as exc:  # noqa: BLE001 - the test looks at what escaped
        return sent, exc
    return sent, None


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _start(sent: list[dict]) -> dict:
    return next(m for m in sent if m["type"] == "http.response.start")


@pytest.mark.parametrize("failure", ["raises", "returns"])
def test_a_request_the_proxy_lost_gets_a_503_error_object(failure):
    from deployments.proxy import OpenAIErrors

    async def lost(scope, receive, send):  # the Ingress replica died before the response began
        if failure == "raises":
            raise RuntimeError("replica died")

    sent, escaped = asyncio.run(_asgi(OpenAIErrors(lost)))
    assert escaped is None
    start = _start(sent)
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(_body(sent))["error"]["code"] == "unit_failed"
    bare, _ = asyncio.run(_asgi(lost))  # the negative control: nothing at all is sent
    assert bare == []


def test_a_cut_stream_ends_with_an_error_object_and_done():
    from deployments.proxy import OpenAIErrors

    async def cut(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})

    sent, _ = asyncio.run(_asgi(OpenAIErrors(cut)))
    lines = [line[6:] for line in _body(sent).decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["type"] == "server_error"
    assert sent[-1]["more_body"] is False


def test_the_proxys_plain_text_refusals_become_error_objects_and_answers_pass_untouched():
    from deployments.proxy import OpenAIErrors

    def answering(status: int, content_type: bytes, body: bytes, extra=()):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", content_type), *extra]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        return app

    dropped = answering(503, b"text/plain; charset=utf-8", b"Request dropped due to backpressure",
                        [(b"retry-after", b"2")])
    sent, _ = asyncio.run(_asgi(OpenAIErrors(dropped)))
    assert _start(sent)["status"] == 503 and (b"retry-after", b"2") in _start(sent)["headers"]
    error = json.loads(_body(sent))["error"]
    assert error["message"] == "Request dropped due to backpressure" and error["code"] == "overloaded"
    for status, body in ((200, b'{"choices": []}'), (400, b'{"error": {"message": "no"}}')):
        sent, _ = asyncio.run(_asgi(OpenAIErrors(answering(status, b"application/json", body))))
        assert _start(sent)["status"] == status and _body(sent) == body


def test_a_client_that_hangs_up_on_a_stream_is_a_disconnect_not_an_error():
    """Serve's receive raises TaskCancelledError when the proxy cancels a request whose client
    left; Starlette's streaming response listens on receive and, without Disconnects, the error
    escapes as the ExceptionGroup an operator saw in the log (the negative control)."""
    from ray.exceptions import TaskCancelledError
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from deployments.ingress import Disconnects

    async def chunks():
        for i in range(1000):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0.01)

    async def endpoint(request):
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def passthrough(request, call_next):  # a BaseHTTPMiddleware, as an operator may add
        return await call_next(request)

    def app(*outer):
        return Starlette(routes=[Route("/v1/completions", endpoint, methods=["POST"])],
                         middleware=[*outer, Middleware(BaseHTTPMiddleware, dispatch=passthrough)])

    _, escaped = asyncio.run(_asgi(app(), receive_after=TaskCancelledError()))
    assert escaped is not None and "TaskCancelledError" in repr(escaped)
    sent, escaped = asyncio.run(_asgi(app(Middleware(Disconnects)), receive_after=TaskCancelledError()))
    assert escaped is None and _start(sent)["status"] == 200
