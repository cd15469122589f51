"""A unit's metrics as Prometheus scrapes them from Ray's metrics agent.

One in-process unit on a local Ray with the metrics agent on a known port; requests in two
named modes (draft, ngram) and in ``auto`` with an operator config that makes its policy
fall back and probe. Then the endpoint is scraped and checked against what keeps operators
honest: every metric and label the Grafana dashboard queries (read out of its PromQL), every
name ``docs/metrics.md`` documents, and totals equal to what the responses reported.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from deployments.app import bind_app
from specdec.config import ModelConfig
from specdec.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "cluster" / "grafana_dashboard.json"
DOC = ROOT / "docs" / "metrics.md"
MODEL = "tiny"
PROMPTS = ["The cat sees", "My friend builds the old", "Def f1(x): return x +"]
# An operator config under which an adaptive request always falls back and probes every token.
FALLBACK_POLICY = {"margin_off": 10.0, "margin_on": 20.0, "probe_interval": 1, "replay_fraction": 1.0}
SCRAPE_TIMEOUT_S = 45  # Ray exports every metrics_report_interval_ms, then the agent serves it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list[dict]]:
    """Sample name (as Prometheus stores it) -> the label sets of its series, with values."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, list[dict]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append({**sample.labels, "__value__": sample.value})
    return out


def total(samples: dict, name: str, **match) -> float:
    return sum(s["__value__"] for s in samples.get(name, []) if all(s.get(k) == v for k, v in match.items()))


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and query variables."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def required_labels(expr: str) -> dict[str, set[str]]:
    """Metric -> the labels ``expr`` needs it to have: its matchers, ``by (...)`` labels and
    ``label_values(metric, label)``. The dashboard's rule: the metrics of one expression share
    the labels it groups by (``le`` is asked of ``_bucket`` series only)."""
    metrics = set(re.findall(r"\bray_[a-z0-9_]+\b", expr))
    grouped = {label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for label in group.split(",")}
    grouped |= set(re.findall(r"label_values\(\s*[a-z0-9_]+\s*,\s*([a-z_]+)\s*\)", expr))
    need = {}
    for metric in metrics:
        matchers = re.findall(rf"\b{metric}\{{([^}}]*)\}}", expr)
        own = {m.split("=")[0].strip(" !~") for group in matchers for m in group.split(",") if m.strip()}
        labels = own | grouped
        need[metric] = labels if metric.endswith("_bucket") else labels - {"le"}
    return need


def documented(doc: str) -> set[str]:
    """The metric names in the first column of docs/metrics.md's tables."""
    return set(re.findall(r"^\|\s*`(ray_[a-z0-9_]+)`", doc, flags=re.M))


def test_the_dashboard_check_sees_a_missing_metric_and_label():
    """The negative control of the dashboard check."""
    need = required_labels('sum by (le, mode) (rate(ray_x_bucket{model_name=~"$m"}[5m])) / sum(ray_y)')
    assert need == {"ray_x_bucket": {"le", "mode", "model_name"}, "ray_y": {"mode"}}
    samples = {"ray_x_bucket": [{"le": "1", "mode": "draft", "model_name": "m"}]}
    assert _missing(samples, need) == ["ray_y (absent)"]
    assert _missing({**samples, "ray_y": [{"model_name": "m"}]}, need) == ["ray_y has no label mode"]


def test_queue_time_is_the_wait_for_admission(llama_pair):
    """The loop stamps a request's first event with submit-to-admission (the data behind
    ``ray_specdec_request_queue_time_seconds``): with one seat, the second request waits
    at least until the first one's last round has begun."""
    engine = Engine.load(ModelConfig(target=str(llama_pair["target"]), dtype="float32"), max_num_seqs=1)
    ids = engine.encode(prompt=PROMPTS[0])
    first = engine.loop.submit(engine.request(ids, max_tokens=24, mode="off", ignore_eos=True))
    submitted = time.time()
    second = engine.loop.submit(engine.request(ids, max_tokens=4, mode="off", ignore_eos=True))
    a, b = list(first), list(second)
    assert all(e.queued_s is None for e in a[1:] + b[1:])
    assert 0 <= a[0].queued_s < b[0].queued_s
    assert b[0].queued_s >= a[-1].stats.started_at - submitted


def _missing(samples: dict, need: dict[str, set[str]]) -> list[str]:
    missing = []
    for metric, labels in sorted(need.items()):
        if metric not in samples:
            missing.append(f"{metric} (absent)")
            continue
        have = set().union(*(set(s) for s in samples[metric]))
        missing += [f"{metric} has no label {label}" for label in sorted(labels - have)]
    return missing


@pytest.fixture(scope="module")
def unit(llama_pair, tmp_path_factory):
    env = pytest.MonkeyPatch()  # module-scoped: undone at teardown
    env.setenv("SPECDEC_HOME", str(tmp_path_factory.mktemp("specdec_home")))  # traces go here
    metrics_port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:  # a failed setup must not leave this Ray running for the modules after it
        http_port = _start_serve()
        args = {"models": {"target": str(llama_pair["target"]), "draft": str(llama_pair["draft"]),
                           "dtype": "float32", "served_model_name": MODEL},
                "colocation": "in_process"}
        serve.run(bind_app(args, user_config=FALLBACK_POLICY), name="metrics", route_prefix="/")
        yield {"metrics_port": metrics_port, "base": f"http://127.0.0.1:{http_port}"}
    finally:
        serve.shutdown()
        ray.shutdown()
        env.undo()


def _start_serve(tries: int = 3) -> int:
    """Serve on a free port, picked once Ray's own processes hold theirs: a port free a moment
    ago can be taken by one of them before the proxy binds it (CI saw 'Failed to bind')."""
    for attempt in range(tries):
        port = _free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception:
            serve.shutdown()
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def scraped(unit):
    """Send the requests, then scrape until the unit's counters show all of them."""
    bodies = []
    for prompt in PROMPTS:
        for spec in ({"mode": "draft", "num_speculative_tokens": 3}, {"mode": "ngram", "num_speculative_tokens": 3},
                     {"mode": "auto"}):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "speculation": spec}
            r = httpx.post(f"{unit['base']}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            bodies.append(r.json())
    # A prompt of over 256 tokens twice: the second finds the first's blocks in the prefix cache
    # (a multiple of the batch-invariant prefill chunk).
    long = " ".join(PROMPTS * 10)  # ~360 tokens
    for _ in range(2):
        r = httpx.post(f"{unit['base']}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": long, "max_tokens": 24, "temperature": 0,
                             "speculation": {"mode": "off"}})
        assert r.status_code == 200, r.text
        bodies.append(r.json())
    deadline, samples = time.monotonic() + SCRAPE_TIMEOUT_S, {}
    while time.monotonic() < deadline:
        samples = scrape(unit["metrics_port"])
        if total(samples, "ray_specdec_requests_total") == len(bodies) and "ray_specdec_active_requests" in samples \
                and "ray_specdec_quality_replays_total" in samples:
            break
        time.sleep(1)
    return samples, bodies


def test_every_metric_the_dashboard_queries_is_scraped_with_its_labels(scraped):
    samples, _ = scraped
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and any(v["type"] == "datasource" for v in dashboard["templating"]["list"])
    need: dict[str, set[str]] = {}
    for expr in dashboard_queries(dashboard):
        for metric, labels in required_labels(expr).items():
            need.setdefault(metric, set()).update(labels)
    assert len(need) >= 15, sorted(need)
    assert _missing(samples, need) == [], sorted(n for n in samples if "specdec" in n)


def test_every_documented_name_is_scraped(scraped):
    samples, _ = scraped
    names = documented(DOC.read_text())
    assert len(names) >= 15
    assert sorted(names - set(samples)) == []
    exported = {n for n in samples if n.startswith("ray_specdec_")}
    base = {re.sub(r"_(bucket|count|sum)$", "", n) for n in exported}
    assert sorted(b for b in base if b not in names and f"{b}_bucket" not in names) == []


def test_speculation_series_are_per_mode_and_add_up_to_the_responses(scraped):
    samples, bodies = scraped
    spec = [b["speculation"] for b in bodies]
    assert total(samples, "ray_specdec_requests_total", finish_reason="length", model_name=MODEL) == len(bodies)
    for name, key in [("ray_specdec_drafted_tokens_total", "drafted_tokens"),
                      ("ray_specdec_accepted_tokens_total", "accepted_tokens"),
                      ("ray_specdec_fallbacks_total", "fallbacks"), ("ray_specdec_probes_total", "probes")]:
        assert total(samples, name) == sum(s.get(key, 0) for s in spec), name
    assert total(samples, "ray_specdec_fallbacks_total", mode="auto") > 0
    assert total(samples, "ray_specdec_output_tokens_total") == sum(b["usage"]["completion_tokens"] for b in bodies)
    passes = [b["usage"]["speculation"] for b in bodies]  # savings in billing terms, per response
    assert total(samples, "ray_specdec_target_passes_total") == sum(p["target_passes"] for p in passes)
    assert all(p["passes_saved"] == p["plain_passes"] - p["target_passes"] >= 0 for p in passes)
    assert sum(p["passes_saved"] for p in passes) == sum(s["accepted_tokens"] for s in spec) > 0
    assert total(samples, "ray_specdec_prompt_tokens_total") == sum(b["usage"]["prompt_tokens"] for b in bodies)
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
    assert cached[-2:] == [0, 256] and sum(cached) == 256  # the long prompt, the second time
    assert total(samples, "ray_specdec_prompt_cached_tokens_total") == 256
    for mode in ("draft", "ngram"):  # the per-position curves are the drafter's own, never pooled
        drafted = total(samples, "ray_specdec_drafted_tokens_total", mode=mode)
        assert drafted > 0, mode
        assert total(samples, "ray_specdec_position_drafted_total", mode=mode) == drafted
        assert total(samples, "ray_specdec_position_accepted_total", mode=mode) == total(
            samples, "ray_specdec_accepted_tokens_total", mode=mode)
        assert total(samples, "ray_specdec_position_drafted_total", mode=mode, position="0") > 0
    assert total(samples, "ray_specdec_accepted_length_count", mode="draft") > 0  # speculative rounds
    assert total(samples, "ray_specdec_request_queue_time_seconds_count") == len(bodies)
    assert total(samples, "ray_specdec_e2e_request_latency_seconds_count", mode="auto") == len(PROMPTS)


def test_a_correct_unit_replays_requests_and_finds_no_mismatch(scraped):
    """replay_fraction 1: greedy requests that speculated are replayed plainly on spare capacity."""
    samples, _ = scraped
    assert total(samples, "ray_specdec_quality_replays_total", match="true") >= 1
    assert total(samples, "ray_specdec_quality_replays_total", match="false") == 0
