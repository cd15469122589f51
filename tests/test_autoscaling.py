"""Speculation-aware autoscaling: the decision function, Ray's adapter over real
``AutoscalingContext`` objects, the unit's stats, and a burst on a local Ray that makes Serve
add a unit (and remove it when the burst is over)."""

import asyncio
import copy
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import ray
import yaml
from ray import serve
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy
from ray.serve.schema import ServeDeploySchema

from deployments.autoscaling import (
    POLICY_PATH,
    PolicyParams,
    SpeculationAwarePolicy,
    StatsRecorder,
    UnitSample,
    UnitTotals,
    decide,
    unit_capacity,
)
from deployments.lint import lint_config
from deployments.operate import separate_ingress
from deployments.router import SpecRouter
from specdec.stats import RoundStats

ROOT = Path(__file__).resolve().parents[1]
P = PolicyParams(target_tokens_per_s=20, target_ongoing_requests=4, max_requests_per_unit=16)


def run(current, demand, units, params=P, lo=1, hi=8, remembered=None):
    return decide(current=current, demand=demand, units=units, params=params,
                  min_replicas=lo, max_replicas=hi, remembered_capacity=remembered)


# --- the decision function --------------------------------------------------------------


def test_capacity_is_requests_at_the_target_rate():
    assert unit_capacity(UnitSample(4, 160.0), P) == 8  # busy: 160 tok/s shared, 20 each
    # Idle half the window with one request at 100 tok/s: 100 / 20, not (50 / 20).
    assert unit_capacity(UnitSample(0.5, 50.0), P) == 5
    assert unit_capacity(UnitSample(4, 10.0), P) == 1  # slower than the target: one per unit
    assert unit_capacity(UnitSample(4, 4000.0), P) == 16  # never above max_requests_per_unit
    assert unit_capacity(UnitSample(0.1, 50.0), P) is None  # too idle to trust
    assert unit_capacity(UnitSample(4, None), P) is None  # no rate reported


def test_scales_up_under_backlog():
    d = run(1, 20, [UnitSample(4, 80.0)])  # C = 4, 20 requests waiting or running -> 5 units
    assert (d.replicas, d.capacity, d.source) == (5, 4, "measured")


def test_speculation_changes_the_units_needed_for_the_same_demand():
    # Same 12 requests; the fleet's drafts are accepted (160 tok/s per unit) or not (70).
    good = run(2, 12, [UnitSample(6, 160.0, 400.0, 320.0)] * 2)
    bad = run(2, 12, [UnitSample(6, 70.0, 400.0, 120.0)] * 2)
    assert good.acceptance == pytest.approx(0.8) and bad.acceptance == pytest.approx(0.3)
    # Ray's default policy (target 4 requests per replica) sees only the request count:
    # 3 units for both, too many for the first fleet and too few for the second.
    assert good.replicas == 2 and bad.replicas == 4


def test_scales_down_when_idle_to_min_and_respects_max():
    assert run(4, 0, [UnitSample(0, 0.0)] * 4).replicas == 1
    assert run(4, 0, [UnitSample(0, 0.0)] * 4, lo=2).replicas == 2
    assert run(1, 1000, [UnitSample(16, 20.0)], hi=3).replicas == 3
    assert run(0, 0, []).replicas == 1  # nothing running yet: the minimum


def test_capacity_falls_back_to_memory_then_to_the_default():
    assert run(1, 10, [UnitSample(0, None)]).capacity == 4  # target_ongoing_requests
    d = run(1, 10, [UnitSample(0.0, 0.0)], remembered=10.0)
    assert (d.capacity, d.source, d.replicas) == (10.0, "remembered", 1)


def test_no_oscillation_around_a_boundary():
    # Demand wobbles +-5% around 2 units' worth (C = 4): one scale-up, then it holds.
    history, current = [], 2
    for tick in range(40):
        demand = 8 * (1.05 if tick % 2 else 0.95)
        current = run(current, demand, [UnitSample(demand / current, 80.0)] * current).replicas
        history.append(current)
    assert history[-1] == 3 and sum(a != b for a, b in zip(history, history[1:])) <= 1, history


def test_closed_loop_settles_for_every_load():
    # Units that decode 100 tok/s, shared by their requests (target 20 -> C = 5). For every
    # constant demand the count moves monotonically (no overshoot and back) and settles:
    # at ceil(demand / 5) from below, within the dead band up to ceil(demand / 3.75) from above.
    for demand in range(41):
        want = max(1, math.ceil(demand / 5))
        for start in (1, 8):
            current, seen = start, [start]
            for _ in range(5):
                ongoing = min(demand / current, 16)
                units = [UnitSample(ongoing, 100.0 * min(ongoing, 1.0))] * current
                current = run(current, demand, units).replicas
                seen.append(current)
            assert seen == sorted(seen, reverse=start == 8) and seen[-1] == seen[-2], (demand, seen)
            assert want <= seen[-1] <= max(want, math.ceil(demand / 3.75)), (demand, seen)
            if start == 1:
                assert seen[-1] == want, (demand, seen)


def test_bad_policy_kwargs_fail_at_construction():
    with pytest.raises(TypeError):
        SpeculationAwarePolicy(target_tps=10)
    with pytest.raises(ValueError):
        SpeculationAwarePolicy(downscale_headroom=1.5)
    with pytest.raises(ValueError):
        SpeculationAwarePolicy(target_ongoing_requests=32, max_requests_per_unit=16)


# --- Ray's adapter, over real AutoscalingContext objects ---------------------------------


def context(current, total, per_replica, *, state=None, lo=1, hi=4, config=None):
    dep = DeploymentID(name="SpecRouter", app_name="specdec")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(current)]
    metrics = {}
    for replica, values in zip(replicas, per_replica):
        for name, value in values.items():
            metrics.setdefault(name, {})[replica] = value
    return AutoscalingContext(
        deployment_id=dep, deployment_name="SpecRouter", app_name="specdec",
        current_num_replicas=current, target_num_replicas=current, running_replicas=replicas,
        total_num_requests=total, total_queued_requests=max(0, total - 4 * current),
        aggregated_metrics=lambda: metrics, raw_metrics={},
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=dict(state or {}), last_scale_up_time=None, last_scale_down_time=None,
        current_time=time.time(), config=config or AutoscalingConfig(min_replicas=lo, max_replicas=hi),
    )


def test_adapter_reads_the_context_and_keeps_state():
    policy = SpeculationAwarePolicy(target_tokens_per_s=20, target_ongoing_requests=2, max_requests_per_unit=8)
    busy = {"ongoing": 8.0, "tokens_per_s": 80.0, "drafted_per_s": 100.0, "accepted_per_s": 60.0}
    replicas, state = policy(context(2, 24, [busy, busy]))
    assert replicas == 4 and state["specdec_capacity"] == 4 and state["specdec_acceptance"] == pytest.approx(0.6)
    # Idle units report no usable rate: the remembered capacity sizes the next burst.
    idle = {"ongoing": 0.0, "tokens_per_s": 0.0}
    replicas, state = policy(context(4, 8, [idle] * 4, state=state))  # load 2: ceil(2 / 0.75)
    assert replicas == 3 and state["specdec_capacity"] == 4
    # A unit with no report yet (just started) is left out, not counted as zero.
    replicas, _ = policy(context(2, 8, [busy]))
    assert replicas == 2


def test_ray_builds_and_wraps_the_policy_from_its_import_path():
    """What the controller does: deserialise, instantiate once with kwargs, wrap with delays."""
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0,
        policy=AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs={"target_tokens_per_s": 20}),
    )
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    busy = {"ongoing": 4.0, "tokens_per_s": 40.0}  # C = 2
    replicas, state = policy(context(1, 6, [busy], config=config))
    assert replicas == 3 and state["specdec_replicas"] == 3
    replicas, _ = policy(context(3, 0, [{"ongoing": 0.0, "tokens_per_s": 0.0}] * 3, state=state, config=config))
    assert replicas == 1


# --- the unit's stats ---------------------------------------------------------------------


def round_stats(emitted, drafted, accepted):
    return RoundStats(index=1, mode="draft", k=drafted, drafted=drafted, accepted=accepted,
                      emitted=emitted, draft_s=0.0, verify_s=0.0)


def test_stats_recorder_reports_rates_between_calls():
    clock = iter([10.0, 12.0, 13.0]).__next__
    totals, recorder = UnitTotals(), StatsRecorder(clock)
    assert recorder.record(3, totals) == {"ongoing": 3.0}  # no interval yet
    for _ in range(4):
        totals.observe(round_stats(emitted=5, drafted=4, accepted=4))
    totals.observe(round_stats(emitted=1, drafted=4, accepted=0))
    stats = recorder.record(2, totals)
    assert stats == {"ongoing": 2.0, "tokens_per_s": 10.5, "drafted_per_s": 10.0, "accepted_per_s": 8.0}
    assert recorder.record(0, totals) == {"ongoing": 0.0, "tokens_per_s": 0.0, "drafted_per_s": 0.0, "accepted_per_s": 0.0}
    assert StatsRecorder().record(1, None) == {"ongoing": 1.0}


def test_router_reports_its_load():
    """SpecRouter.record_autoscaling_stats without Ray: the load its engine sees."""
    router = object.__new__(SpecRouter.func_or_class)
    router.engine = SimpleNamespace(active=3)
    router.totals, router._autoscaling_stats = UnitTotals(), StatsRecorder()
    stats = router.record_autoscaling_stats()
    assert stats["ongoing"] == 3.0 and all(isinstance(v, float) for v in stats.values())


# --- a burst on a local Ray ------------------------------------------------------------------

PORT = 8125


def autoscaling_config(pair) -> dict:
    """serve_config.yaml (with an Ingress deployment) with the tiny pair, two units' worth of CPUs
    and our policy."""
    config = separate_ingress(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    config["http_options"]["port"] = PORT
    app = config["applications"][0]
    app["args"].update(
        models={"target": str(pair["target"]), "draft": str(pair["draft"]), "dtype": "float32",
                "served_model_name": "tiny"},
        colocation="in_process", resources={"target_cpus": 0.2}, max_concurrent_requests=4,
    )
    router = next(d for d in app["deployments"] if d["name"] == "SpecRouter")
    router.pop("num_replicas")
    router["max_ongoing_requests"] = 4
    router["autoscaling_config"] = {
        "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 3,
        "metrics_interval_s": 0.5, "look_back_period_s": 2,
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": {
            # A tiny unit gives one request ~1000 tok/s: more than one request at a time
            # (the burst, not the single warm-up client) needs a second unit.
            "target_tokens_per_s": 1000, "target_ongoing_requests": 1, "max_requests_per_unit": 4}},
    }
    return config


def backpressure_app(app: dict) -> dict:
    """A second app: one unit that takes one request and queues one, then answers 429."""
    app = copy.deepcopy(app)
    app.update(name="bp", route_prefix="/bp")
    app["args"]["max_concurrent_requests"] = 1
    router = next(d for d in app["deployments"] if d["name"] == "SpecRouter")
    del router["autoscaling_config"]
    router.update(num_replicas=1, max_ongoing_requests=1, max_queued_requests=1,
                  backpressure_config={"status_code": 429, "retry_after_s": 3})
    return app


@pytest.fixture(scope="module")
def autoscaled(llama_pair):
    config = autoscaling_config(llama_pair)
    config["applications"].append(backpressure_app(config["applications"][0]))
    assert lint_config(config) == []
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:  # a failed setup must not leave this Ray running for the modules after it
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.context._get_global_client().deploy_apps(ServeDeploySchema.model_validate(config), _blocking=True)
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def running_units() -> int:
    app = serve.status().applications.get("specdec")
    return app.deployments["SpecRouter"].replica_states.get("RUNNING", 0) if app else 0


def policy_decisions() -> list[str]:
    """The lines our policy logged in the Serve controller's log, in this Ray session."""
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    lines = [line for f in sorted(logs.glob("controller_*.log")) for line in f.read_text().splitlines()]
    return [line.split(" -- ", 1)[-1] for line in lines if "autoscaling SpecRouter:" in line]


def test_a_burst_adds_a_unit_and_every_request_succeeds(autoscaled):
    start = time.monotonic()
    timeline: list[tuple[float, int]] = []
    stop_polling = threading.Event()

    def poll():
        while not stop_polling.is_set():
            n = running_units()
            if not timeline or timeline[-1][1] != n:
                timeline.append((round(time.monotonic() - start, 1), n))
            time.sleep(0.25)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    results = []

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            done = asyncio.Event()

            async def worker(i):
                if i:  # one client first: the unit measures its rate, then the burst
                    await asyncio.sleep(3)
                while not done.is_set():
                    body = {"model": "tiny", "prompt": ["The cat sees", "My friend builds"][i % 2],
                            "max_tokens": 64, "temperature": 0, "speculation": {"mode": "draft"}}
                    r = await client.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body)
                    results.append((r.status_code, r.json() if r.status_code == 200 else r.text))

            async def until_scaled():
                scaled_at = None
                while time.monotonic() - start < 60:
                    await asyncio.sleep(0.25)
                    if scaled_at is None and timeline and timeline[-1][1] == 2:
                        scaled_at = time.monotonic()
                    if scaled_at is not None and time.monotonic() - scaled_at > 3:
                        break  # the second unit has served for a while
                done.set()

            await asyncio.gather(until_scaled(), *(worker(i) for i in range(8)))

    asyncio.run(burst())
    burst_s = time.monotonic() - start
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and running_units() != 1:
        time.sleep(0.25)
    time.sleep(0.5)
    stop_polling.set()
    poller.join()
    decisions = policy_decisions()
    print(f"\nSpecRouter RUNNING units over time (s, units): {timeline}; burst {burst_s:.1f} s, "
          f"{len(results)} requests")
    print("policy decisions (Serve controller log):\n  " + "\n  ".join(decisions))

    assert max(n for _, n in timeline) == 2, timeline
    assert timeline[-1][1] == 1, timeline  # scaled back down once idle
    assert len(results) >= 8
    for status, body in results:
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert body["usage"]["completion_tokens"] >= 1 and body["speculation"]["mode"] == "draft"
    # Our policy, fed by the units' own reports, made both moves (not Ray's default policy).
    up = [d for d in decisions if "1 -> 2 units" in d]
    down = [d for d in decisions if "2 -> 1 units" in d]
    assert up and down, decisions
    assert int(up[0].split(" unit reports")[0].rsplit(" ", 1)[-1]) >= 1, up[0]


def test_backpressure_answers_429_with_retry_after(autoscaled):
    """SpecRouter's queue limit surfaces through our ingress as Serve's 429 + Retry-After."""

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i):
                body = {"model": "tiny", "prompt": "The cat sees", "max_tokens": 64, "temperature": 0,
                        "stream": i % 2 == 1}
                return await client.post(f"http://127.0.0.1:{PORT}/bp/v1/completions", json=body)

            return await asyncio.gather(*(one(i) for i in range(6)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "3" and "backpressure" in r.text
            assert r.json()["error"]["code"] == "overloaded"  # an OpenAI error object
