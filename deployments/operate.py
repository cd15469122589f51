"""Operating the server under load, as ``specdec ops`` runs it: rolling upgrades, faults and a
soak, each on its own local cluster (``deployments.cluster``), each printing a table.

- ``upgrade``: streams running while ``serve deploy`` applies a flag change (``user_config``,
  live), a speculation change and a model change (both replace the replicas); every response
  must complete or be refused cleanly, never a 5xx or a lost request, and each response's
  ``system_fingerprint`` says which configuration answered it: a greedy answer is checked
  against the reference of the configuration its fingerprint names.
- ``faults``: streams running, then the target worker, the draft worker, the router replica
  and the Ingress replica are killed in turn (SIGKILL); per kill, how many requests completed
  token-identical, how many got a clean error object, none lost, and how long until the unit
  served again.
- ``soak``: a mixed workload (cancellations and bad requests included) for a set duration;
  memory and open files of every process of the unit, trace bytes and metric series after
  warm-up and at the end, each against a stated bound.

Configs are ``serve_config.yaml``-shaped dicts; ``tiny_config`` makes one of the tiny test
models (fp32: token-identical checks), in the layout with an Ingress deployment unless told
otherwise (``separate_ingress``: the faults kill its replica too).
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from deployments import load, processes
from deployments.cluster import LocalCluster
from deployments.config import INGRESS_MAX_ONGOING, INGRESS_MAX_QUEUED, UNIT_MAX_QUEUED

APP = "specdec"
MODEL = "tiny"


def tiny_config(pair: dict, *, port: int, colocation: str = "in_process", base: Path | None = None,
                ingress: str = "separate") -> dict:
    """``base`` (the repo's serve_config.yaml by default) serving a tiny ``pair`` in fp32 on
    127.0.0.1:``port`` as model ``tiny``; ``ingress``: "separate" (``separate_ingress``) or
    "as configured" (``base``'s own layout: serve_config.yaml's is ``in_unit``)."""
    if ingress not in ("separate", "as configured"):
        raise ValueError(f"ingress: 'separate' or 'as configured', not {ingress!r}")
    base = base or Path(__file__).resolve().parents[1] / "serve_config.yaml"
    config = yaml.safe_load(base.read_text())
    if ingress == "separate":
        config = separate_ingress(config)
    config["http_options"].update(host="127.0.0.1", port=port)
    args = config["applications"][0]["args"]
    models = args["models"]
    for key in ("eagle_head", "medusa_heads", "early_exit_adapter"):
        models.pop(key, None)
    models.update(target=str(pair["target"]), draft=str(pair["draft"]), dtype="float32", draft_dtype="float32",
                  served_model_name=MODEL)
    args["colocation"] = colocation
    args["resources"] = {"target_cpus": 0.5, "draft_cpus": 0.25, "router_cpus": 0.1}
    args.pop("torch_threads", None)
    args["draft_timeout_s"] = 3.0
    return config


def separate_ingress(config: dict) -> dict:
    """``config`` with an Ingress deployment before its unit (``ingress: separate``, the layout
    of several models and of cluster/) instead of the unit serving HTTP itself (serve_config.yaml's
    ``in_unit``). The unit keeps its flags and health checks and now admits its own
    ``max_concurrent_requests`` (the builder's) with ``UNIT_MAX_QUEUED`` waiting per caller; the
    Ingress admits and queues what the builder gives it, refusing past that as the unit did."""
    config = copy.deepcopy(config)
    app = _app(config)
    if app["args"].get("ingress", "separate") == "separate":
        return config
    app["args"]["ingress"] = "separate"
    router = _router(config)
    refusal = router.get("backpressure_config", {"status_code": 503, "retry_after_s": 2})
    router.pop("max_ongoing_requests", None)
    router.update(max_queued_requests=UNIT_MAX_QUEUED, backpressure_config={**refusal, "retry_after_s": 5})
    ingress = {"name": "Ingress", "num_replicas": 1, "max_ongoing_requests": INGRESS_MAX_ONGOING,
               "health_check_period_s": router.get("health_check_period_s", 2),
               "max_queued_requests": INGRESS_MAX_QUEUED, "backpressure_config": refusal}
    app["deployments"] = [router, ingress]
    return config


def _app(config: dict) -> dict:
    return config["applications"][0]


def _router(config: dict) -> dict:
    return next(d for d in _app(config)["deployments"] if d["name"] == "SpecRouter")


def expected_fingerprint(config: dict) -> str:
    """The ``system_fingerprint`` the unit deployed from ``config`` answers with."""
    from deployments.config import UnitArgs, resolve_models, unit_fingerprint
    from specdec.policy import PolicyConfig

    args = {k: v for k, v in _app(config)["args"].items() if k not in ("ingress_cpus", "api_keys", "units", "limits", "ingress")}
    unit = UnitArgs.model_validate(args)
    return unit_fingerprint(resolve_models(unit.models), unit.speculation,
                            PolicyConfig.model_validate(_router(config).get("user_config") or {}))


def base_url(config: dict) -> str:
    return f"http://127.0.0.1:{config['http_options']['port']}"


def _is_greedy(case: load.Case) -> bool:
    return case.body.get("temperature", 1.0) == 0


# --- upgrade ------------------------------------------------------------------------------------


def upgrade_steps(config: dict, next_models: dict) -> list[tuple[str, dict]]:
    """The three changes, each on top of the last: a live flag, the speculation, the models."""
    flag = copy.deepcopy(config)
    user_config = _router(flag).setdefault("user_config", {})
    user_config["k_max"] = max(1, int(user_config.get("k_max", 8)) // 2)
    spec = copy.deepcopy(flag)
    speculation = _app(spec)["args"].setdefault("speculation", {})
    speculation["num_speculative_tokens"] = int(speculation.get("num_speculative_tokens", 4)) - 1
    model = copy.deepcopy(spec)
    _app(model)["args"]["models"].update(next_models)
    return [("flag (user_config k_max)", flag), ("speculation (k)", spec), ("model (target and draft)", model)]


@dataclass
class UpgradeRow:
    step: str
    fingerprint: str
    deploy_s: float  # serve deploy until every new request carries the new fingerprint
    requests: int  # started while this configuration was being applied or serving
    exact: int  # greedy answers equal to the reference of the configuration that answered
    unchecked: int  # sampled answers of a configuration without a reference (k changed)
    refused: int
    server_errors: int  # any 5xx, error object or not: the target is 0
    lost: int
    differs: int
    by_previous: int  # answered by the configuration before (streams that spanned the swap)


async def _wait_fingerprint(url: str, case: load.Case, fingerprint: str, timeout: float) -> float:
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=120) as client:
        while time.perf_counter() - t0 < timeout:
            reply = await load.send(client, url, case)
            if reply.kind == "completed" and reply.fingerprint == fingerprint:
                return time.perf_counter() - t0
            await asyncio.sleep(0.5)
    raise TimeoutError(f"no response with fingerprint {fingerprint} after {timeout} s")


async def run_upgrade(cluster: LocalCluster, config: dict, next_models: dict, *, streams: int = 16,
                      settle_s: float = 5.0, say=print) -> tuple[list[UpgradeRow], load.LoadReport]:
    """Deploy ``config``, then apply ``upgrade_steps`` one by one under ``streams`` clients."""
    url, cases = base_url(config), load.mixed_cases(MODEL)
    steps = [("initial", config), *upgrade_steps(config, next_models)]
    prints = [expected_fingerprint(c) for _, c in steps]
    assert len(set(prints)) == len(prints), prints
    cluster.deploy(config)
    cluster.wait_running(APP)
    refs = {prints[0]: await load.references_for(url, cases)}
    say(f"initial configuration RUNNING; {streams} streams start")
    stop, report = asyncio.Event(), load.LoadReport()
    task = asyncio.create_task(load.run_load(url, cases, streams=streams, stop=stop, report=report))
    t0 = report.t0
    windows, deploy_times = [0.0], [0.0]
    await asyncio.sleep(settle_s)
    probe = next(c for c in cases if _is_greedy(c) and not c.stream)
    for (step, cfg), fingerprint in zip(steps[1:], prints[1:]):
        windows.append(time.perf_counter() - t0)
        started = time.perf_counter()
        await asyncio.to_thread(cluster.deploy, cfg)
        await _wait_fingerprint(url, probe, fingerprint, 300)
        deploy_times.append(time.perf_counter() - started)
        say(f"{step}: new fingerprint answering after {deploy_times[-1]:.1f} s")
        await asyncio.sleep(settle_s)
    stop.set()
    await task
    await asyncio.to_thread(cluster.wait_running, APP)
    refs[prints[-1]] = await load.references_for(url, cases)
    windows.append(float("inf"))
    return [_upgrade_row(step, i, prints, windows, deploy_times[i], refs, cases, report)
            for i, (step, _) in enumerate(steps)], report


def _upgrade_row(step: str, i: int, prints: list, windows: list, deploy_s: float, refs: dict, cases: list,
                 report: load.LoadReport) -> UpgradeRow:
    """Step ``i``'s row: the requests started in its window, each judged by the reference of
    the configuration its fingerprint names (greedy text is the first configuration's until
    the models change)."""
    by_name = {c.name: c for c in cases}
    greedy_refs = {name: tokens for name, tokens in refs[prints[0]].items() if _is_greedy(by_name[name])}
    counts = dict(exact=0, unchecked=0, refused=0, server_errors=0, lost=0, differs=0)
    chosen = [o for o in report.outcomes if windows[i] <= o.started < windows[i + 1]]
    for o in chosen:
        if o.status >= 500:
            counts["server_errors"] += 1
        elif o.kind in ("lost", "refused"):
            counts[o.kind] += 1
        elif o.kind != "completed":
            counts["lost"] += 1
        elif o.fingerprint not in prints:
            counts["differs"] += 1
            o.kind, o.detail = "differs", f"unknown fingerprint {o.fingerprint}"
        else:
            ref = refs.get(o.fingerprint, {}).get(o.case)
            if ref is None and o.fingerprint != prints[-1]:
                ref = greedy_refs.get(o.case)
            if ref is None:
                counts["unchecked"] += 1
            elif ref == o.tokens:
                counts["exact"] += 1
            else:
                counts["differs"] += 1
                got = o.tokens or []
                at = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                o.kind, o.detail = "differs", (f"differs from the reference of {o.fingerprint} from token {at}: "
                                               f"{got[at:at + 4]} against {ref[at:at + 4]}")
    previous = sum(1 for o in chosen if i and o.fingerprint == prints[i - 1])
    return UpgradeRow(step, prints[i], round(deploy_s, 1), len(chosen), **counts, by_previous=previous)


# --- faults -------------------------------------------------------------------------------------

KILLS = ("target", "draft", "router", "ingress")


def kills_for(config: dict) -> tuple[str, ...]:
    """The processes ``config``'s unit has to kill, in ``KILLS`` order: workers only with
    ``colocation: actors``, an Ingress replica only where there is an Ingress deployment (with
    ``ingress: in_unit`` the router replica answers HTTP itself)."""
    args = _app(config)["args"]
    return tuple(k for k in KILLS
                 if (k not in ("target", "draft") or args.get("colocation") == "actors")
                 and (k != "ingress" or args.get("ingress", "separate") == "separate"))


@dataclass
class FaultRow:
    killed: str
    requests: int  # started in the window around the kill
    exact: int
    rerolled: int  # seeded sampled requests whose drafts failed (load.classify)
    clean_errors: int  # an OpenAI error object: 503, or a stream's error chunk and [DONE]
    lost: int
    differs: int
    restored_s: float | None  # kill until a request sent after it completed


async def run_faults(cluster: LocalCluster, config: dict, *, streams: int = 16, kills=KILLS, before_s: float = 5.0,
                     after_s: float = 5.0, restore_timeout_s: float = 120.0, say=print) -> tuple[list[FaultRow], list]:
    """``config`` (colocation: actors) deployed; per kill a fresh load window: ``before_s`` of
    load, the kill, load until the unit serves again plus ``after_s``."""
    url = base_url(config)
    cases = load.mixed_cases(MODEL)
    cluster.deploy(config)
    cluster.wait_running(APP)
    refs = await load.references_for(url, cases)
    rows, outcomes = [], []
    for role in kills:
        stop, report = asyncio.Event(), load.LoadReport()
        task = asyncio.create_task(load.run_load(url, cases, streams=streams, stop=stop, references=refs,
                                                 report=report))
        await asyncio.sleep(before_s)
        killed_at = time.perf_counter() - report.t0
        pid = await asyncio.to_thread(processes.kill, role, APP, wait_s=60.0)
        say(f"killed the {role} ({pid}) under {streams} streams")
        restored = None
        while restored is None and time.perf_counter() - report.t0 - killed_at < restore_timeout_s:
            await asyncio.sleep(0.25)
            served = [o.ended for o in report.outcomes if o.started > killed_at and o.kind in ("exact", "rerolled")]
            restored = min(served) - killed_at if served else None
        await asyncio.sleep(after_s)
        stop.set()
        await task
        counts = report.counts()
        rows.append(FaultRow(role, sum(counts.values()), counts["exact"], counts["rerolled"], counts["error"],
                             counts["lost"], counts["differs"], None if restored is None else round(restored, 1)))
        outcomes.append((role, report))
        say(f"  {rows[-1]}")
        await asyncio.to_thread(cluster.wait_running, APP)  # healthy again before the next kill
    return rows, outcomes


# --- soak ---------------------------------------------------------------------------------------


@dataclass
class Sample:
    at_s: float
    rss: dict  # role -> bytes (summed over the role's processes)
    open_files: dict  # role -> descriptors
    trace_bytes: int
    metric_series: int


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def sample(cluster: LocalCluster, at_s: float) -> Sample:
    rss, fds = {}, {}
    for proc in processes.find(APP):
        used = processes.usage(proc.pid)
        if used is not None:
            rss[proc.role] = rss.get(proc.role, 0) + used.rss_bytes
            fds[proc.role] = fds.get(proc.role, 0) + used.open_files
    return Sample(round(at_s, 1), rss, fds, _dir_bytes(cluster.home / "specdec" / "traces"), cluster.metric_series())


@dataclass
class SoakBounds:
    rss_growth: float = 0.10  # each process's RSS at the end within 10% of its post-warm-up value
    fd_growth: int = 32  # open descriptors may grow by a few sockets, not by one per request
    # SPECDEC_TRACE_MAX_TOTAL_BYTES plus the file each writing process may have open meanwhile
    trace_cap_bytes: int = (1 << 30) + (64 << 20)
    series_growth: float = 0.10  # metric label sets: bounded, not one per request


@dataclass
class SoakResult:
    duration_s: float
    warmup_s: float
    counts: dict
    samples: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def judge(warm: Sample, end: Sample, bounds: SoakBounds) -> list[str]:
    """Every bound the end sample breaks against the post-warm-up one."""
    problems = []
    for role, before in warm.rss.items():
        after = end.rss.get(role)
        if after is None:
            problems.append(f"{role}: the process is gone")
        elif after > before * (1 + bounds.rss_growth):
            problems.append(f"{role}: RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
                            f"(> +{bounds.rss_growth:.0%})")
    for role, before in warm.open_files.items():
        if end.open_files.get(role, 0) > before + bounds.fd_growth:
            problems.append(f"{role}: open files {before} -> {end.open_files[role]}")
    if end.trace_bytes > bounds.trace_cap_bytes:
        problems.append(f"trace files {end.trace_bytes} bytes > cap {bounds.trace_cap_bytes}")
    if end.metric_series > warm.metric_series * (1 + bounds.series_growth):
        problems.append(f"metric series {warm.metric_series} -> {end.metric_series}")
    return problems


async def run_soak(cluster: LocalCluster, config: dict, *, duration_s: float, warmup_s: float, streams: int = 8,
                   bounds: SoakBounds = SoakBounds(), every_s: float = 10.0, say=print) -> SoakResult:
    url = base_url(config)
    cases = load.mixed_cases(MODEL, cancellations=True, bad_requests=True)
    cluster.deploy(config)
    cluster.wait_running(APP)
    stop, report = asyncio.Event(), load.LoadReport()
    task = asyncio.create_task(load.run_load(url, cases, streams=streams, stop=stop, report=report))
    result = SoakResult(duration_s, warmup_s, {})
    t0 = time.perf_counter()
    result.samples.append(sample(cluster, 0.0))
    warm = None
    while (now := time.perf_counter() - t0) < duration_s:
        await asyncio.sleep(min(every_s, max(0.0, duration_s - now)))
        now = time.perf_counter() - t0
        if warm is None and now >= warmup_s:
            warm = sample(cluster, now)
            result.samples.append(warm)
            say(f"warm-up over at {now:.0f} s: {_describe(warm)}")
        elif now < duration_s:
            say(f"{now:.0f} s: {dict(report.counts())}")
    stop.set()
    await task
    end = sample(cluster, time.perf_counter() - t0)
    result.samples.append(end)
    result.counts = dict(report.counts())
    result.problems = judge(warm or result.samples[0], end, bounds)
    result.problems += [f"{o.case}: {o.kind} {o.status} {o.detail}" for o in report.failures()][:20]
    return result


def _describe(s: Sample) -> str:
    rss = ", ".join(f"{role} {b / 2**20:.0f} MiB" for role, b in sorted(s.rss.items()))
    return f"RSS {rss}; traces {s.trace_bytes / 2**20:.1f} MiB; {s.metric_series} metric series"


# --- the command --------------------------------------------------------------------------------


def table(rows: list) -> str:
    """Dataclass rows as a Markdown table."""
    import dataclasses

    if not rows:
        return "(no rows)"
    names = [f.name for f in dataclasses.fields(rows[0])]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for row in rows:
        lines.append("| " + " | ".join("-" if v is None else str(v) for v in dataclasses.astuple(row)) + " |")
    return "\n".join(lines)


def soak_table(result: SoakResult) -> str:
    warm, end = (result.samples[1] if len(result.samples) > 2 else result.samples[0]), result.samples[-1]
    lines = ["| what | start | after warm-up | end | growth after warm-up |", "|---|---|---|---|---|"]
    first = result.samples[0]
    for role in sorted(end.rss):
        a, b, c = first.rss.get(role, 0), warm.rss.get(role, 0), end.rss[role]
        lines.append(f"| RSS {role} (MiB) | {a / 2**20:.1f} | {b / 2**20:.1f} | {c / 2**20:.1f} | "
                     f"{(c - b) / b:+.1%} |" if b else f"| RSS {role} (MiB) | - | - | {c / 2**20:.1f} | - |")
    for role in sorted(end.open_files):
        lines.append(f"| open files {role} | {first.open_files.get(role, '-')} | {warm.open_files.get(role, '-')} | "
                     f"{end.open_files[role]} | {end.open_files[role] - warm.open_files.get(role, 0):+d} |")
    lines.append(f"| trace bytes (MiB) | {first.trace_bytes / 2**20:.1f} | {warm.trace_bytes / 2**20:.1f} | "
                 f"{end.trace_bytes / 2**20:.1f} | - |")
    lines.append(f"| metric series | {first.metric_series} | {warm.metric_series} | {end.metric_series} | "
                 f"{end.metric_series - warm.metric_series:+d} |")
    return "\n".join(lines)


def _build_config(args, workdir: Path, colocation: str) -> tuple[dict, dict]:
    """The config to run and, for the upgrade's model step, the models to change to."""
    from specdec.bench.tiny import build_tiny_pair

    if args.config:
        config = yaml.safe_load(Path(args.config).read_text())
        config["http_options"].update(host="127.0.0.1", port=args.port)
        _app(config)["args"]["colocation"] = colocation
        nxt = {k: v for k, v in (("target", args.next_target), ("draft", args.next_draft)) if v}
        return config, nxt
    pair = build_tiny_pair(workdir / "tiny_llama", "llama")
    nxt = {}
    if args.what == "upgrade":
        other = build_tiny_pair(workdir / "tiny_gpt2", "gpt2")
        nxt = {"target": str(other["target"]), "draft": str(other["draft"])}
    layout = "separate" if getattr(args, "ingress", "separate") == "separate" else "as configured"
    return tiny_config(pair, port=args.port, colocation=colocation, ingress=layout), nxt


def main(args) -> int:
    """``specdec ops upgrade|faults|soak``: see the module docstring."""
    import dataclasses
    import json
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="specdec-ops-"))
    colocation = args.colocation or ("in_process" if args.what == "upgrade" else "actors")
    config, nxt = _build_config(args, workdir, colocation)
    extra = {}
    if args.what == "soak":
        extra = {"SPECDEC_TRACE_MAX_TOTAL_BYTES": str(args.trace_cap_mb << 20),
                 "SPECDEC_TRACE_MAX_FILE_BYTES": str(max(1, args.trace_cap_mb // 8) << 20)}
    say = lambda line: print(line, flush=True)  # noqa: E731
    say(f"specdec ops {args.what}: a local cluster in {workdir} (127.0.0.1, dashboard :{args.dashboard_port})")
    failed = False
    with LocalCluster(workdir, dashboard_port=args.dashboard_port, gcs_port=args.gcs_port,
                      metrics_port=args.metrics_port, env_extra=extra) as cluster:
        if args.what == "upgrade":
            if not nxt:
                raise SystemExit("specdec ops upgrade --config needs --next-target (and --next-draft)")
            rows, report = asyncio.run(run_upgrade(cluster, config, nxt, streams=args.streams, say=say))
            print(table(rows))
            failed = any(r.server_errors or r.lost or r.differs for r in rows)
            out = [dataclasses.asdict(r) for r in rows]
        elif args.what == "faults":
            rows, _ = asyncio.run(run_faults(cluster, config, streams=args.streams, kills=kills_for(config), say=say))
            print(table(rows))
            failed = any(r.lost or r.differs or r.restored_s is None or r.restored_s > args.restore_bound_s
                         for r in rows)
            out = [dataclasses.asdict(r) for r in rows]
        else:
            writers = 3 if colocation == "actors" else 1  # router, target, draft
            bounds = SoakBounds(trace_cap_bytes=(args.trace_cap_mb + writers * max(1, args.trace_cap_mb // 8)) << 20)
            result = asyncio.run(run_soak(cluster, config, duration_s=args.duration, warmup_s=args.warmup,
                                          streams=args.streams, bounds=bounds, say=say))
            print(f"{result.duration_s:.0f} s, {args.streams} streams: {result.counts}")
            print(soak_table(result))
            for problem in result.problems:
                print(f"FAIL: {problem}")
            failed = bool(result.problems)
            out = dataclasses.asdict(result)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if failed else 0
