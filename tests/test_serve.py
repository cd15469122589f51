"""The Ray Serve application on a real local Ray: HTTP API, both colocation modes."""

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
import torch
import yaml
from ray import serve

from deployments.app import bind_app, build_app
from deployments.lint import lint_serve_config
from specdec.tracing.reader import load_traces
from specdec.demo.eagle import EagleTrainConfig, init_eagle_head
from specdec.models.eagle import save_eagle_head
from specdec.loading import load_model, load_tokenizer

PORT = 8123
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "tiny"
MODES = ["in_process", "actors"]
LAYOUTS = [*MODES, "in_unit"]  # in_unit: in_process, the unit's replica serving HTTP itself
IN_UNIT_FLAGS = {"default_mode": "ngram"}  # its user_config: the unit's flags reach it
PROMPTS = ["The cat sees", "My friend builds the old", "Def f1(x): return x +"]
KEYS = ["key-one", "key-two"]


@pytest.fixture(scope="module")
def server(llama_pair, tmp_path_factory):
    # Workers inherit the driver's environment: traces go to this module's own directory.
    home = tmp_path_factory.mktemp("specdec_home")
    env = pytest.MonkeyPatch()  # module-scoped: undone at teardown
    env.setenv("SPECDEC_HOME", str(home))
    eagle = tmp_path_factory.mktemp("eagle_head")  # untrained: exactness never depends on the drafts
    target = load_model(str(llama_pair["target"]))
    save_eagle_head(init_eagle_head(target, torch.arange(target.config.vocab_size), EagleTrainConfig()), eagle)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:  # a failed setup must not leave this Ray running for the modules after it
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        apps = []
        for mode in MODES:
            args = {
                "models": {
                    "target": str(llama_pair["target"]),
                    "draft": str(llama_pair["draft"]),
                    "dtype": "float32",
                    "served_model_name": MODEL,
                    "early_exit_layer": 2,  # a raw exit after 2 of the target's 4 layers
                    "eagle_head": str(eagle),  # drafts in the TargetWorker in actors mode
                },
                "colocation": mode,
                "resources": {"target_cpus": 0.5, "draft_cpus": 0.25},
                "draft_timeout_s": 3.0,
            }
            apps.append(serve.RunTarget(build_app(args), mode, f"/{mode}"))
        secured = {"models": {"target": str(llama_pair["target"]), "dtype": "float32", "served_model_name": MODEL},
                   "colocation": "in_process", "api_keys": KEYS, "stream_interval": 4}
        apps.append(serve.RunTarget(build_app(secured), "secured", "/secured"))
        in_unit = {**args, "colocation": "in_process", "ingress": "in_unit"}
        apps.append(serve.RunTarget(bind_app(in_unit, user_config=IN_UNIT_FLAGS), "in_unit", "/in_unit"))
        serve.run_many(apps)  # started side by side
        yield {**llama_pair, "traces": home / "traces"}
    finally:
        serve.shutdown()
        ray.shutdown()
        env.undo()


@pytest.fixture(scope="module")
def greedy(server):
    """``greedy(prompt, n)``: plain greedy decoding of the target by transformers, in process,
    ``n`` tokens (no EOS): an independent reference for what the server returns."""
    tok = load_tokenizer(str(server["target"]))
    model = load_model(str(server["target"]))

    def run(prompt: str, n: int) -> list[int]:
        ids = tok(prompt)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
        assert len(out) == n
        return out

    return run


@pytest.fixture(scope="module")
def reference(greedy):
    """Plain greedy decoding of the target, in process: what every mode must return."""
    return {prompt: greedy(prompt, 32) for prompt in PROMPTS}


def completion(colocation, **body):
    body = {"model": MODEL, "max_tokens": 32, "temperature": 0, "return_token_ids": True, **body}
    return httpx.post(f"{BASE}/{colocation}/v1/completions", json=body, timeout=120)


def sse_events(text: str) -> list:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("colocation", LAYOUTS)
@pytest.mark.parametrize("mode", ["off", "draft", "ngram", "early_exit", "eagle"])
def test_greedy_over_http_equals_plain_decoding(server, reference, colocation, mode):
    for prompt in PROMPTS:
        r = completion(colocation, prompt=prompt, speculation={"mode": mode, "num_speculative_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == reference[prompt]
        assert r.headers["x-specdec-mode"] == mode and body["id"].endswith(r.headers["x-request-id"])
        spec = body["speculation"]
        assert spec["mode"] == mode and body["usage"]["completion_tokens"] == 32
        if mode != "off":
            assert spec["drafted_tokens"] > 0
            assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["drafted_tokens"])
        # Streaming gives the same tokens; the finish chunk carries speculation, then (asked for)
        # a usage chunk without choices, as OpenAI's.
        r = completion(colocation, prompt=prompt, stream=True, speculation={"mode": mode},
                       stream_options={"include_usage": True})
        chunks = sse_events(r.text)
        assert [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]] == reference[prompt]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["speculation"]["mode"] == mode
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 32


@pytest.mark.parametrize("colocation", LAYOUTS)
def test_concurrent_streams_complete_correctly(server, reference, colocation):
    async def one(client, prompt, mode):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True,
                "return_token_ids": True, "speculation": {"mode": mode}}
        r = await client.post(f"{BASE}/{colocation}/v1/completions", json=body)
        return prompt, [t for c in sse_events(r.text) for t in c["choices"][0]["token_ids"]]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [one(client, PROMPTS[i % 3], ["draft", "ngram", "off", "draft"][i]) for i in range(4)]
            return await asyncio.gather(*jobs)

    for prompt, tokens in asyncio.run(main()):
        assert tokens == reference[prompt]


@pytest.mark.parametrize("colocation", LAYOUTS)
def test_openai_client_works_unchanged(server, colocation):
    client = openai.OpenAI(base_url=f"{BASE}/{colocation}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="The cat sees", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="The cat sees", max_tokens=8, temperature=0, stream=True)
    )
    assert text == r.choices[0].text
    messages = [{"role": "user", "content": "Say something about the cat."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    )
    assert streamed == chat.choices[0].message.content


def test_max_tokens_defaults_like_openai(server):
    body = {"model": MODEL, "prompt": "The cat sees", "temperature": 0}
    r = httpx.post(f"{BASE}/in_process/v1/completions", json=body, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 16  # a completion defaults to 16 tokens


def test_stop_strings_and_seeded_sampling(server):
    full = completion("in_process", prompt="The cat sees", max_tokens=24).json()["choices"][0]["text"]
    stop = full[8:11]
    r = completion("in_process", prompt="The cat sees", max_tokens=24, stop=[stop]).json()
    assert r["choices"][0]["text"] == full[: full.index(stop)] and r["choices"][0]["finish_reason"] == "stop"
    sampled = [
        completion(colocation, prompt="The cat", temperature=1.0, seed=5, speculation={"mode": "draft"}).json()
        for colocation in MODES
    ]
    assert sampled[0]["choices"][0]["token_ids"] == sampled[1]["choices"][0]["token_ids"]


# Bad requests, one by one: the golden set in tests/test_exposure.py.


def test_neutral_values_mean_absent_and_text_parts_are_text(server):
    neutral = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "tools": [], "best_of": 1,
               "response_format": None, "logprobs": False}
    plain = completion("in_process", prompt="The cat", max_tokens=6).json()
    r = completion("in_process", prompt="The cat", max_tokens=6, **neutral)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    chat = lambda content: httpx.post(f"{BASE}/in_process/v1/chat/completions", timeout=60, json={  # noqa: E731
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0})
    as_text, as_parts = chat("hello there"), chat([{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}])
    assert as_parts.status_code == 200 and as_parts.json()["choices"] == as_text.json()["choices"]
    image = chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    assert image.status_code == 400 and image.json()["error"]["param"].startswith("messages")
    # A vanishing temperature is greedy, never a 5xx; a lone surrogate as model name is a 404.
    r = completion("in_process", prompt="The cat", max_tokens=6, temperature=1e-300)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    r = httpx.post(f"{BASE}/in_process/v1/completions", content=b'{"model": "\\ud800", "prompt": "x"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_malformed_bodies_and_chat_errors(server):
    r = httpx.post(f"{BASE}/in_process/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{BASE}/in_process/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{BASE}/in_process/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "pirate", "content": "arr"}]})
    assert r.status_code == 400
    # The server is still healthy afterwards.
    assert httpx.get(f"{BASE}/in_process/health").json() == {"status": "ok"}


def test_serve_config_is_clean_and_the_lint_catches_silent_keys(tmp_path):
    root = Path(__file__).resolve().parents[1]
    assert lint_serve_config(root / "serve_config.yaml") == []
    config = yaml.safe_load((root / "serve_config.yaml").read_text())
    config["applications"][0]["deployments"][0]["num_replicaz"] = 2
    config["applications"][0]["args"]["speculation"]["mdoe"] = "draft"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    problems = lint_serve_config(bad)
    assert any("num_replicaz" in p for p in problems) and any("mdoe" in p for p in problems)


def test_draft_worker_killed_mid_stream_the_stream_completes_unchanged(server, greedy):
    router = serve.get_deployment_handle("SpecRouter", app_name="actors")
    draft_name = router.info.remote().result()["worker_names"]["draft"]
    prompt = PROMPTS[0]
    expected = greedy(prompt, 300)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "temperature": 0, "stream": True,
            "return_token_ids": True, "speculation": {"mode": "draft", "num_speculative_tokens": 3}}
    tokens, killed = [], False
    with httpx.stream("POST", f"{BASE}/actors/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            tokens += chunk["choices"][0].get("token_ids", [])
            if not killed and len(tokens) >= 20:
                named = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
                ray.kill(ray.get_actor(draft_name, namespace=named[draft_name]), no_restart=False)
                killed = True
            last = chunk
    assert killed and tokens == expected
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["speculation"]["draft_failures"] >= 1  # it really ran on without its draft
    # Ray restarted the draft worker: later requests speculate again.
    for _ in range(50):
        r = completion("actors", prompt=prompt, speculation={"mode": "draft", "num_speculative_tokens": 3}).json()
        if r["speculation"]["accepted_tokens"] > 0:
            break
    assert r["speculation"]["accepted_tokens"] > 0


def _whole(trace) -> bool:
    """The request span has its totals and every round its verify span (workers export late)."""
    verified = all("verify" in {c.name for c in trace.children(r)} for r in trace.decode_rounds)
    return bool(trace.attr("gen_ai.usage.output_tokens")) and verified


def wait_for_traces(directory, trace_ids, timeout_s=30):
    """Spans leave each process through a batch processor: poll until all traces are whole."""
    deadline = time.time() + timeout_s
    while True:
        found = {t.trace_id: t for t in load_traces(directory) if t.trace_id in trace_ids}
        if len(found) == len(trace_ids) and all(_whole(t) for t in found.values()):
            return found
        assert time.time() < deadline, f"traces not written: {set(trace_ids) - set(found)}"
        time.sleep(0.5)


@pytest.mark.parametrize("colocation", MODES)
def test_every_request_leaves_a_trace_that_matches_its_response(server, colocation, capsys):
    responses = {}
    for prompt, mode in zip(PROMPTS, ["draft", "ngram", "off"]):
        r = completion(colocation, prompt=prompt, speculation={"mode": mode, "num_speculative_tokens": 3})
        trace_id = r.headers["traceparent"].split("-")[1]
        responses[trace_id] = r.json()["speculation"]
    traces = wait_for_traces(server["traces"], set(responses))
    for trace_id, spec in responses.items():
        trace = traces[trace_id]
        assert len(trace.decode_rounds) == spec["rounds"]
        assert trace.accepted == spec["accepted_tokens"] and trace.drafted == spec["drafted_tokens"]
        assert trace.attr("gen_ai.request.model") == MODEL
        # Worker spans (in process: spans from the round's timings) hang under the rounds;
        # prompt lookup drafts in the router itself, so only the draft model has a draft span.
        for rnd in trace.decode_rounds:
            names = {c.name for c in trace.children(rnd)}
            assert "verify" in names
            if rnd.attributes["specdec.mode"] == "draft" and rnd.attributes["specdec.drafted"]:
                assert "draft" in names
    # The CLI reads the same files back.
    from specdec.cli import main

    assert main(["traces", "list", "--dir", str(server["traces"]), "--limit", "50"]) == 0
    listed = capsys.readouterr().out
    assert all(tid[:12] in listed for tid in responses)
    tid, spec = next(iter(responses.items()))
    assert main(["traces", "show", tid, "--dir", str(server["traces"])]) == 0
    shown = capsys.readouterr().out
    assert f"{spec['rounds']}" in shown


def test_incoming_traceparent_becomes_the_parent(server):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(
        f"{BASE}/in_process/v1/completions",
        json={"model": MODEL, "prompt": "The cat", "max_tokens": 8, "temperature": 0},
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["traceparent"].split("-")[1] == trace_id
    trace = wait_for_traces(server["traces"], {trace_id})[trace_id]
    assert trace.request.parent_id == parent


# --- batching through HTTP ------------------------------------------------------------------


BATCH_PROMPTS = ["The cat sees", "My friend builds the old", "Def f1(x): return x +", "A dog likes",
                 "The river finds a song", "Our teacher paints the moon", "The robot hears", "A bird follows"]


@pytest.fixture(scope="module")
def solo(server):
    """Each batch prompt's greedy tokens, sent alone through the in-process unit."""
    out = {}
    for prompt in BATCH_PROMPTS:
        r = completion("in_process", prompt=prompt, max_tokens=24, speculation={"mode": "off"})
        out[prompt] = r.json()["choices"][0]["token_ids"]
    return out


@pytest.mark.parametrize("colocation", LAYOUTS)
def test_eight_concurrent_streams_each_get_their_solo_tokens(server, solo, colocation):
    """Eight streams at once (modes mixed) share the unit's steps; each is token-identical (fp32)
    to its solo run, and the unit ran fewer steps than the streams' rounds added up."""
    router = serve.get_deployment_handle("SpecRouter", app_name=colocation)
    modes = ["off", "draft", "ngram", "early_exit", "auto", "draft", "ngram", "off"]

    async def one(client, prompt, mode):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True,
                "return_token_ids": True, "speculation": {"mode": mode}}
        tokens, rounds = [], 0
        async with client.stream("POST", f"{BASE}/{colocation}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[len("data: "):])
                    tokens += chunk["choices"][0].get("token_ids", [])
                    rounds = chunk.get("speculation", {}).get("rounds", rounds)
        return tokens, rounds

    async def all_of_them():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in zip(BATCH_PROMPTS, modes)))

    steps_before = router.info.remote().result()["usage"]["steps"]
    results = asyncio.run(all_of_them())
    steps = router.info.remote().result()["usage"]["steps"] - steps_before
    for prompt, (tokens, _) in zip(BATCH_PROMPTS, results):
        assert tokens == solo[prompt], prompt
    assert steps < sum(rounds for _, rounds in results)  # rows really shared steps


@pytest.mark.parametrize("layout", ["in_process", "in_unit"])
def test_a_disconnected_client_frees_its_slot(server, layout):
    router = serve.get_deployment_handle("SpecRouter", app_name=layout)
    body = {"model": MODEL, "prompt": "The cat sees", "max_tokens": 400, "temperature": 0, "stream": True,
            "speculation": {"mode": "off"}}
    with httpx.stream("POST", f"{BASE}/{layout}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                assert router.info.remote().result()["usage"]["running"] == 1
                break  # the client goes away mid-stream
    deadline = time.time() + 10
    while (usage := router.info.remote().result()["usage"])["running"]:
        assert time.time() < deadline, usage
        time.sleep(0.05)
    assert usage["free_tokens"] == usage["capacity_tokens"] and usage["waiting"] == 0
    assert router.info.remote().result().get("admitted", 0) == 0  # in_unit: its admission place freed


def test_in_unit_is_one_deployment_that_takes_the_units_flags_and_frees_refused_requests(server):
    """ingress: in_unit: the application is the unit's deployment alone; its user_config reaches
    the unit (a request naming no mode gets the flags' default mode); a refused request (400)
    and a finished one leave nothing admitted."""
    deployments = serve.status().applications["in_unit"].deployments
    assert set(deployments) == {"SpecRouter"}
    r = completion("in_unit", prompt="The cat sees", max_tokens=4)
    assert r.status_code == 200 and r.headers["x-specdec-mode"] == IN_UNIT_FLAGS["default_mode"]
    bad = completion("in_unit", prompt="The cat sees", speculation={"mode": "nonsense"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculation.mode", bad.text
    info = serve.get_deployment_handle("SpecRouter", app_name="in_unit").info.remote().result()
    assert info["ingress"] == "in_unit" and info["admitted"] == 0 and info["colocation"] == "in_process"
    assert info["policy"]["default_mode"] == IN_UNIT_FLAGS["default_mode"]


def test_two_requests_with_one_x_request_id_are_isolated(server, solo):
    """A client's x-request-id is never a cache key: two concurrent requests sending the same
    one each get their own solo output."""
    prompts = BATCH_PROMPTS[:2]

    async def one(client, prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True,
                "speculation": {"mode": "draft", "num_speculative_tokens": 3}}
        r = await client.post(f"{BASE}/in_process/v1/completions", json=body, headers={"x-request-id": "same-id"})
        return r.json()["choices"][0]["token_ids"]

    async def both():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    for prompt, tokens in zip(prompts, asyncio.run(both())):
        assert tokens == solo[prompt]


def test_target_worker_killed_mid_stream_the_stream_resumes_token_identical(server, solo, greedy):
    """The target worker dies mid-stream: Ray restarts it, the step is sent again with every
    row's ids, the new worker re-prefills, and the stream completes as if nothing happened."""
    router = serve.get_deployment_handle("SpecRouter", app_name="actors")
    target_name = router.info.remote().result()["worker_names"]["target"]
    prompt = BATCH_PROMPTS[1]
    expected = greedy(prompt, 200)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True, "speculation": {"mode": "draft", "num_speculative_tokens": 3}}
    tokens, killed_at, resumed_after = [], None, None
    with httpx.stream("POST", f"{BASE}/actors/v1/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            new = chunk["choices"][0].get("token_ids", [])
            if killed_at is not None and resumed_after is None and new:
                resumed_after = time.perf_counter() - killed_at
            tokens += new
            if killed_at is None and len(tokens) >= 20:
                named = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
                ray.kill(ray.get_actor(target_name, namespace=named[target_name]), no_restart=False)
                killed_at = time.perf_counter()
            last = chunk
    assert killed_at is not None and resumed_after is not None
    assert tokens == expected[: len(tokens)] and len(tokens) == 200
    assert last["choices"][0]["finish_reason"] == "length"
    # the restarted worker's pool is the size the unit decided at its first start
    restarted = ray.get_actor(target_name, namespace=named[target_name])
    assert ray.get(restarted.info.remote())["capacity_tokens"] == router.info.remote().result()["usage"]["capacity_tokens"]
    print(f"target worker killed: the stream resumed after {resumed_after:.2f} s")


def test_draft_worker_stopped_mid_stream_the_stream_completes(server, solo):
    """SIGSTOP the draft worker (hung, not dead): past draft_timeout_s the step runs plainly,
    the worker is replaced, and the stream completes token-identical."""
    import signal

    router = serve.get_deployment_handle("SpecRouter", app_name="actors")
    draft_name = router.info.remote().result()["worker_names"]["draft"]
    named = {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
    draft = ray.get_actor(draft_name, namespace=named[draft_name])
    pid = ray.get(draft.pid.remote())
    prompt = BATCH_PROMPTS[2]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True, "speculation": {"mode": "draft", "num_speculative_tokens": 3}}
    tokens, stopped = [], False
    try:
        with httpx.stream("POST", f"{BASE}/actors/v1/completions", json=body, timeout=180) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                tokens += chunk["choices"][0].get("token_ids", [])
                if not stopped and tokens:
                    os.kill(pid, signal.SIGSTOP)
                    stopped = True
                last = chunk
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # replaced: the hung process was killed
    assert stopped and tokens == solo[prompt]
    assert last["speculation"]["draft_failures"] >= 1


@pytest.mark.parametrize("route", ["models", "completions", "chat", "completions-bad-body"])
def test_api_keys_guard_every_v1_route(server, route):
    """No key, a wrong key: 401 with an OpenAI error object; either right key: served.
    /health needs none (as vLLM's --api-key)."""
    url = f"{BASE}/secured/v1/" + {"models": "models", "chat": "chat/completions"}.get(route, "completions")
    body = {
        "models": None,
        "completions": {"model": MODEL, "prompt": "The cat", "max_tokens": 4},
        "chat": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        "completions-bad-body": {"model": MODEL, "prompt": 42},
    }[route]

    def call(headers):
        if body is None:
            return httpx.get(url, headers=headers, timeout=60)
        return httpx.post(url, json=body, headers=headers, timeout=60)

    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "key-one"}, {"authorization": "Basic key-one"}):
        r = call(headers)
        assert r.status_code == 401, (headers, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    for key in KEYS:
        r = call({"authorization": f"Bearer {key}"})
        assert r.status_code == (400 if route == "completions-bad-body" else 200), r.text
    assert httpx.get(f"{BASE}/secured/health", timeout=60).status_code == 200


def test_a_unit_streams_in_chunks_of_its_stream_interval(server, reference):
    """The secured unit's stream_interval is 4: a streamed answer's first token comes alone, then
    chunks of at least 4 tokens but the last; the tokens are plain decoding's. Unstreamed, the
    same answer."""
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    for prompt in PROMPTS[:2]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0, "return_token_ids": True}
        r = httpx.post(f"{BASE}/secured/v1/completions", json={**body, "stream": True}, headers=headers, timeout=120)
        sizes = [len(c["choices"][0]["token_ids"]) for c in sse_events(r.text) if c["choices"][0]["token_ids"]]
        tokens = [t for c in sse_events(r.text) for t in c["choices"][0]["token_ids"]]
        assert tokens == reference[prompt]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 1 + 31 // 4 + 1, sizes
        r = httpx.post(f"{BASE}/secured/v1/completions", json=body, headers=headers, timeout=120)
        assert r.json()["choices"][0]["token_ids"] == reference[prompt]


def test_the_openai_client_sends_its_key(server):
    client = openai.OpenAI(base_url=f"{BASE}/secured/v1", api_key=KEYS[1])
    assert client.completions.create(model=MODEL, prompt="The cat", max_tokens=4).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{BASE}/secured/v1", api_key="nope").models.list()


# --- the OpenAI options tools expect: logprobs, echo, n / best_of, penalties, savings ------------


@pytest.fixture(scope="module")
def scorer(server):
    """``scorer(ids)``: the target's log-softmax after each prefix of ``ids`` (one plain forward)."""
    model = load_model(str(server["target"]))

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)

    return run


@pytest.mark.parametrize("colocation", MODES)
def test_openai_client_logprobs_and_echo_are_the_targets(server, scorer, colocation):
    """Through the official client, speculation on: each token's log-probability and the top 3
    equal a plain forward's log-softmax (greedy: T = 1); echo gives the prompt's too."""
    client = openai.OpenAI(base_url=f"{BASE}/{colocation}/v1", api_key="unused")
    tok = load_tokenizer(str(server["target"]))
    spec = {"speculation": {"mode": "draft", "num_speculative_tokens": 3}, "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3,
                                  echo=True, extra_body=spec)
    choice, ids = r.choices[0], tok(PROMPTS[1])["input_ids"]
    out = choice.model_extra["token_ids"]
    assert choice.text.startswith(PROMPTS[1]) and len(out) == 8
    ref = scorer(ids + out)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 8 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j, token in enumerate((ids + out)[1:], start=1):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1, token]), abs=1e-4), j
        top = ref[j - 1].topk(3)
        assert list(lp.top_logprobs[j].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert lp.text_offset[len(ids)] == len(PROMPTS[1]) or lp.tokens[len(ids) - 1] == ""
    for mode in ("ngram", "early_exit", "eagle"):  # every drafter: the target's numbers, whatever drafted
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=1,
                                      extra_body={"speculation": {"mode": mode}, "return_token_ids": True})
        asked, answer = tok(PROMPTS[0])["input_ids"], r.choices[0].model_extra["token_ids"]
        ref = scorer(asked + answer)[len(asked) - 1:-1]
        got = r.choices[0].logprobs.token_logprobs
        assert got == pytest.approx([float(ref[j, t]) for j, t in enumerate(answer)], abs=1e-4), mode
    # the prompt as token ids, as lm-evaluation-harness sends it: the same numbers
    r = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert r.choices[0].text.startswith(tok.decode(ids)) and r.choices[0].logprobs.token_logprobs[1:len(ids)] == \
        pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-4)
    # chat, streamed and not: the same entries
    messages = [{"role": "user", "content": "Say something about the cat."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body=spec)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
                                     for c in content)
    assert all(c.token == c.top_logprobs[0].token and c.logprob == c.top_logprobs[0].logprob for c in content)
    streamed = [e for c in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                         logprobs=True, top_logprobs=2, stream=True, extra_body=spec)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_n_choices_share_the_prefill_and_are_seeded_reproducibly(server):
    client = openai.OpenAI(base_url=f"{BASE}/in_process/v1", api_key="unused")
    router = serve.get_deployment_handle("SpecRouter", app_name="in_process")
    long_prompt = " ".join(["the cat sees the dog and my friend builds the old house"] * 12)  # 385 tokens
    before = router.info.remote().result()["usage"]["prefix_hit_tokens"]
    body = dict(model=MODEL, prompt=long_prompt, max_tokens=12, temperature=1.0, seed=7, n=4,
                extra_body={"speculation": {"mode": "draft"}, "return_token_ids": True})
    a, b = client.completions.create(**body), client.completions.create(**body)
    hits = router.info.remote().result()["usage"]["prefix_hit_tokens"] - before
    ids = lambda r: [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]  # noqa: E731
    assert [c.index for c in a.choices] == [0, 1, 2, 3] and ids(a) == ids(b)  # reproducible
    assert len({tuple(t) for t in ids(a)}) > 1  # independent choices differ
    one = client.completions.create(**{**body, "n": 1})
    assert ids(one) == ids(a)[:1]  # choice 0 keeps the request's seed
    assert a.usage.completion_tokens == 48
    # the first request's siblings took its prompt's blocks; the second found all four cached
    assert hits >= 7 * 256, hits
    # best_of: the choice with the highest log-probability among best_of samples
    scored = client.completions.create(**{**body, "logprobs": 0})
    sums = [sum(c.logprobs.token_logprobs) for c in sorted(scored.choices, key=lambda c: c.index)]
    best = client.completions.create(**{**body, "n": 1, "best_of": 4})
    assert ids(best) == [ids(scored)[sums.index(max(sums))]] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 48  # the three samples not returned were generated too


def test_penalties_and_bias_over_http_equal_plain_decoding_with_them(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "presence_penalty": 0.8, "frequency_penalty": 0.5,
            "repetition_penalty": 1.3, "logit_bias": {"17": 3.0}}
    plain = completion("in_process", **body, speculation={"mode": "off"}).json()["choices"][0]["token_ids"]
    assert plain != completion("in_process", prompt=PROMPTS[0], max_tokens=24).json()["choices"][0]["token_ids"]
    for colocation in MODES:
        for mode in ("draft", "ngram", "eagle"):
            r = completion(colocation, **body, speculation={"mode": mode, "num_speculative_tokens": 3})
            assert r.json()["choices"][0]["token_ids"] == plain, (colocation, mode)


def test_usage_says_what_speculation_saved_and_the_trace_names_the_tenant(server):
    r = completion("in_process", prompt=PROMPTS[2], max_tokens=32, user="tenant-a",
                   speculation={"mode": "ngram", "num_speculative_tokens": 4})
    body = r.json()
    usage, spec = body["usage"], body["speculation"]
    saved = usage["speculation"]
    assert saved["target_passes"] == spec["rounds"] + 1 and saved["plain_passes"] == usage["completion_tokens"] == 32
    assert saved["passes_saved"] == 32 - saved["target_passes"] and saved["accepted_tokens"] == spec["accepted_tokens"]
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == spec["accepted_tokens"] > 0
    assert details["rejected_prediction_tokens"] == spec["drafted_tokens"] - spec["accepted_tokens"]
    trace_id = r.headers["traceparent"].split("-")[1]
    trace = wait_for_traces(server["traces"], {trace_id})[trace_id]
    assert trace.attr("enduser.id") == "tenant-a"
    assert trace.attr("specdec.target_passes") == saved["target_passes"] and trace.attr("specdec.plain_passes") == 32
    from specdec.tracing.cli import format_savings  # `specdec traces summary`: by tenant and model

    row = next(line for line in format_savings([trace]) if "tenant-a" in line).split()
    assert row[2:6] == ["1", "32", str(saved["target_passes"]), str(saved["passes_saved"])], row


def test_structured_output_through_the_openai_client(server):
    """``beta.chat.completions.parse`` with a pydantic model (a strict JSON schema), speculating,
    in both colocation modes: the answer parses, and equals plain constrained decoding's."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)
        ok: bool

    messages = [{"role": "user", "content": "Who is the cat?"}]
    answers = {}
    for colocation in MODES:
        client = openai.OpenAI(base_url=f"{BASE}/{colocation}/v1", api_key="unused")
        for mode in ("off", "draft", "eagle"):
            r = client.beta.chat.completions.parse(model=MODEL, messages=messages, response_format=Person, temperature=0,
                                                   max_tokens=80, extra_body={"speculation": {"mode": mode}})
            assert isinstance(r.choices[0].message.parsed, Person) and r.choices[0].finish_reason == "stop"
            answers[colocation, mode] = r.choices[0].message.content
    assert len(set(answers.values())) == 1, answers
    client = openai.OpenAI(base_url=f"{BASE}/in_process/v1", api_key="unused")
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=3,
                                       extra_body={"guided_choice": ["cat", "dog", "tree"],
                                                   "speculation": {"mode": "draft"}})
    assert choice.choices[0].text in ("cat", "dog", "tree")
    bad = httpx.post(f"{BASE}/in_process/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": {"type": 5}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
