"""With Ray Serve's own tracing on, our request span nests under Serve's span."""

import time

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private.constants import DEFAULT_TRACING_EXPORTER_IMPORT_PATH

from deployments.app import bind_app
from specdec.tracing.reader import load_traces

PORT = 8126


@pytest.fixture(scope="module")
def served(llama_pair, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    env = {  # read by Serve's proxies and replicas (Ray 2.60), inherited by Ray's workers
        "RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH": DEFAULT_TRACING_EXPORTER_IMPORT_PATH,
        "RAY_SERVE_TRACING_SAMPLING_RATIO": "1",
        "SPECDEC_HOME": str(home),
    }
    patch = pytest.MonkeyPatch()  # module-scoped: undone at teardown
    for k, v in env.items():
        patch.setenv(k, v)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:  # a failed setup must not leave this Ray running for the modules after it
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        args = {"models": {"target": str(llama_pair["target"]), "dtype": "float32", "served_model_name": "tiny"},
                "colocation": "in_process", "resources": {"target_cpus": 0.25}}
        serve.run(bind_app(args), name="traced", route_prefix="/")
        yield home / "traces"
    finally:
        serve.shutdown()
        ray.shutdown()
        patch.undo()


def test_request_span_is_a_child_of_serves_span(served):
    r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions",
                   json={"model": "tiny", "prompt": "The cat", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    trace_id = r.headers["traceparent"].split("-")[1]
    deadline = time.time() + 30
    while not (found := [t for t in load_traces(served) if t.trace_id == trace_id]):
        assert time.time() < deadline, "trace not written"
        time.sleep(0.5)
    # No traceparent was sent: a parent can only be Serve's own (ingress replica) span.
    request = found[0].request
    assert request.parent_id is not None
    # named and marked by the GenAI conventions, read back from OTLP/JSON lines
    assert request.name == "text_completion tiny" and request.kind == "SERVER"
    assert request.attributes["gen_ai.provider.name"] == "specdec"
    assert request.resource["service.name"] == "specdec-router"
