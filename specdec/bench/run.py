"""``specdec bench``: every configuration on the same pair and prompts, in one process.

Order of work:

1. load the pair once (``Engine.load``); transformers' runs use the very same model objects;
2. build the seeded prompt sets and the configuration list;
3. time ``c`` and ``v(k)`` directly on the models (``costs``);
4. warm every configuration up once (a configuration that fails here is skipped, with why);
5. for each repeat, for each prompt, run every configuration, rotating the order per
   prompt, so machine noise (another job, thermal drift) hits all configurations alike;
6. optionally sweep concurrency over HTTP;
7. reduce to rows (``report``), check the targets, print, write JSON and plots.

Steps 1, 3, 4, 5 and 6 are the phases of the progress line (``progress``: on stderr, on a
terminal or with ``--progress``).

Every run ignores EOS and produces exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from specdec import compute
from specdec.bench.configs import HF_LOOKUP_DEFAULT_TOKENS, BenchConfig, build_configs
from specdec.bench.costs import WARMUP_REPS, StepProbe, measure_costs
from specdec.bench.inproc import RunResult, peak_rss_mb, run_hf, run_ours
from specdec.bench.options import BenchOptions
from specdec.bench.progress import QUIET, SILENT, Phase, Progress
from specdec.bench.report import (
    format_concurrency,
    format_table,
    format_targets,
    summarize,
    targets,
)
from specdec.bench.workloads import Prompt, build_prompts, stdlib_code_files
from specdec.loading import dtype_name
from specdec.paths import specdec_home

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: transformers rows renamed, speedup_vs_hf_plain, transformers_settings
WARMUP_TOKENS = 8


def tiny_pair(arch: str = "llama") -> dict[str, Path]:
    """The tiny pair under ``$SPECDEC_HOME/tiny/{arch}``: built in a temp dir, renamed into place."""
    from specdec.bench.tiny import build_tiny_pair

    root = specdec_home() / "tiny" / arch
    paths = {"target": root / "target", "draft": root / "draft"}
    if all((p / "config.json").is_file() and (p / "model.safetensors").is_file() for p in paths.values()):
        return paths
    tmp = root.parent / f".{arch}.build-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_pair(tmp, arch)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return paths


def resolve_models(opts: BenchOptions) -> tuple[str, str | None, dict]:
    """Target, draft, and the target-side drafters' settings (the demo's EAGLE and Medusa heads
    and exit adapter, if built; a raw exit on tiny)."""
    if opts.target:
        return opts.target, opts.draft, {}
    if opts.tiny:
        paths = tiny_pair()
        return str(paths["target"]), opts.draft or str(paths["draft"]), {"early_exit_layer": 2}
    from specdec.demo import build_demo_models, demo_exit_adapter, demo_paths

    build_demo_models()  # returns at once when cached
    paths, adapter = demo_paths(), demo_exit_adapter()
    local = {"eagle_head": str(paths["eagle"]), "medusa_heads": str(paths["medusa"])}
    local |= {"early_exit_adapter": str(adapter)} if adapter else {}
    return str(paths["target"]), opts.draft or str(paths["draft"]), local


class Bench:
    """The loaded pair and the ways of running one (configuration, prompt)."""

    def __init__(self, opts: BenchOptions):
        from specdec.config import ModelConfig
        from specdec.engine import Engine

        self.opts = opts
        self.target_path, self.draft_path, local = resolve_models(opts)
        models = ModelConfig(target=self.target_path, draft=self.draft_path, dtype=opts.dtype,
                             draft_dtype=opts.draft_dtype, **local)
        self.numerics = models.numerics  # the target's, in the loop (its step is timed in them)
        # No prefix cache: every run prefills its prompt, as transformers' runs do (with one, each
        # prompt's later configurations took its blocks from the first one's run).
        self.engine = Engine.load(models, prefix_caching=False)
        self.engine.warm_up()  # as a served unit does: no configuration pays for building the kernels
        self.engine.eos_token_ids = frozenset()  # every run makes exactly max_tokens tokens
        self.tokenizer = self.engine.tokenizer
        self.target_model = self.engine.target_model
        self.draft_model = self.engine.draft_model
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.client = None
        if opts.url:
            from specdec.bench.client import CompletionClient

            self.client = CompletionClient(opts.url, model=opts.model_name, extra_body=opts.http_extra)

    def unavailable(self, cfg: BenchConfig) -> str | None:
        if cfg.runner == "ours":
            try:
                self.engine.resolve_mode(cfg.mode)
            except ValueError as exc:
                return str(exc)
        if cfg.runner == "hf" and cfg.needs_draft_model and self.draft_model is None:
            return "no draft model"
        return None

    def run(self, cfg: BenchConfig, prompt: Prompt, max_tokens: int, repeat: int) -> RunResult:
        if cfg.runner == "ours":
            return run_ours(self.engine, cfg, prompt, max_tokens, repeat)
        if cfg.runner == "hf":
            return compute.run(run_hf, self.target_model, self.draft_model, cfg, prompt, max_tokens, repeat,
                               self.pad_token_id)  # on the thread our engine steps on: same cores, same OpenMP team
        from specdec.bench.client import run_http

        return run_http(self.client, cfg, prompt, max_tokens, repeat)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def _cost_context(prompts: list[Prompt]) -> list[int]:
    """The median-length prompt: costs are measured at a context the runs actually see."""
    lengths = sorted(prompts, key=lambda p: len(p.ids))
    return lengths[len(lengths) // 2].ids


def _decode_contexts(prompts: list[Prompt], max_tokens: int) -> dict[str, int]:
    """Each workload's typical decode context: its median prompt and half an answer (a step
    attends to its whole context, so a run's mean step is the one halfway through it)."""
    return {w: _median_prompt([p for p in prompts if p.workload == w]) + max_tokens // 2
            for w in dict.fromkeys(p.workload for p in prompts)}


def _median_prompt(prompts: list[Prompt]) -> int:
    lengths = sorted(len(p.ids) for p in prompts)
    return lengths[len(lengths) // 2]


def run_bench(opts: BenchOptions, progress: Progress = QUIET) -> dict:
    """Run the benchmark; return the report (what ``--out`` writes)."""
    import transformers

    started = time.perf_counter()
    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    if opts.threads:
        compute.set_threads(opts.threads)
    transformers.logging.set_verbosity_error()  # assisted generation warns on every call
    try:
        with progress.phase("load", 1) as phase:
            phase.now(opts.target or ("the tiny pair" if opts.tiny else "the demo pair"))
            bench = Bench(opts)
            phase.advance()
        try:
            return _run(bench, opts, started, progress)
        finally:
            bench.close()
    finally:
        compute.set_threads(threads)
        transformers.logging.set_verbosity(verbosity)


def _run(bench: Bench, opts: BenchOptions, started: float, progress: Progress) -> dict:
    prompts = _prompts(bench, opts)
    active, skipped = _configurations(bench, opts)
    with progress.phase("costs", WARMUP_REPS + opts.cost_reps) as phase:
        costs = _costs(bench, opts, prompts, phase)
    with progress.phase("warm-up", len(active)) as phase:
        _warm_up(bench, opts, prompts[0], active, skipped, phase)
    probe = _probe(bench, opts, prompts, active)
    try:
        with progress.phase("runs", opts.repeats * len(prompts) * len(active)) as phase:
            results = _measure(bench, opts, prompts, active, skipped, phase, after=_beside(probe, costs, opts, prompts))
    finally:
        if probe is not None:
            compute.run(probe.release)
    active = [c for c in active if c.name in results]
    concurrency = None
    if bench.client is not None:
        with progress.phase("HTTP concurrency", sum(opts.concurrency) * opts.requests_per_stream) as phase:
            concurrency = _concurrency(bench, opts, prompts, phase)
    rows = _rows(opts, prompts, active, results, costs)
    return _report(bench, opts, started, prompts, costs, rows, skipped, concurrency)


def _prompts(bench: Bench, opts: BenchOptions) -> list[Prompt]:
    """The workloads' prompts, cut to leave room for max_tokens in the model's context."""
    max_len = bench.engine.max_length
    max_prompt = opts.max_prompt_tokens
    if max_len:
        max_prompt = min(max_prompt, max_len - opts.max_tokens - 1)
        if max_prompt < 16:
            raise ValueError(f"--max-tokens {opts.max_tokens} leaves no room for a prompt in {max_len} positions")
    prompts = build_prompts(bench.tokenizer, opts.workloads, opts.prompts, max_prompt_tokens=max_prompt, seed=opts.seed)
    if not prompts:
        raise ValueError("no prompt fits: raise --max-prompt-tokens or lower --max-tokens")
    return prompts


def _configurations(bench: Bench, opts: BenchOptions) -> tuple[list[BenchConfig], list[dict]]:
    """The configurations this bench can run, and those it skips (with why)."""
    skipped: list[dict] = []
    active: list[BenchConfig] = []
    for cfg in build_configs(opts.ks, quick=opts.quick, http=bool(opts.url), only=opts.only):
        reason = bench.unavailable(cfg)
        (skipped.append({"name": cfg.name, "reason": reason}) if reason else active.append(cfg))
    return active, skipped


def _costs(bench: Bench, opts: BenchOptions, prompts: list[Prompt], phase: Phase = SILENT):
    """c and v(k) at every k the runs use: --ks, the policy's largest k, transformers' lookup
    default, a tree mode's nodes."""
    context = _cost_context(prompts)
    log.info("measuring c and v(k) on a %d-token context", len(context))
    policy = getattr(bench.engine, "policy_config", None)
    k_max, nodes = getattr(policy, "k_max", 8), getattr(policy, "tree_nodes", 16)
    cost_ks = sorted(set(range(1, max(opts.ks) + 1)) | {k_max, HF_LOOKUP_DEFAULT_TOKENS, nodes})
    contexts = _decode_contexts(prompts, opts.max_tokens)
    phase.now(f"c and v(k) for k in {cost_ks}, {len(context)}-token context; steps at {sorted(set(contexts.values()))}")
    return compute.run(measure_costs, bench.target_model, bench.draft_model, context, cost_ks,
                       reps=opts.cost_reps, on_rep=phase.advance, invariant=bench.numerics == "batch_invariant",
                       step_contexts=tuple(contexts.values()))


BESIDE_REPS = 5  # plain steps timed after each plain run, at its workload's decode context


def _probe(bench: Bench, opts: BenchOptions, prompts: list[Prompt], active: list[BenchConfig]) -> StepProbe | None:
    """Where the plain step is timed beside our plain runs (None without such runs)."""
    if not any(c.runner == "ours" and c.mode == "off" for c in active):
        return None
    contexts = _decode_contexts(prompts, opts.max_tokens)
    return compute.run(StepProbe, bench.target_model, _cost_context(prompts), contexts.values(),
                       invariant=bench.numerics == "batch_invariant")


def _beside(probe: StepProbe | None, costs, opts: BenchOptions, prompts: list[Prompt]):
    """After each of our plain runs: ``BESIDE_REPS`` plain steps at its workload's decode
    context, into ``costs.beside`` (the plain TPOT target's step)."""
    contexts = _decode_contexts(prompts, opts.max_tokens)

    def after(cfg: BenchConfig, prompt: Prompt) -> None:
        if probe is None or cfg.runner != "ours" or cfg.mode != "off":
            return
        n = contexts[prompt.workload]
        costs.beside.setdefault(n, []).extend(compute.run(lambda: [probe.step(n) for _ in range(BESIDE_REPS)]))
    return after


def _warm_up(bench: Bench, opts: BenchOptions, prompt: Prompt, active: list[BenchConfig], skipped: list[dict],
             phase: Phase = SILENT):
    """First calls pay one-off costs; a configuration that cannot run at all goes."""
    for cfg in list(active):
        phase.now(cfg.name)
        try:
            bench.run(cfg, prompt, min(WARMUP_TOKENS, opts.max_tokens), repeat=-1)
        except Exception as exc:
            log.warning("skipping %s: %s: %s", cfg.name, type(exc).__name__, exc)
            skipped.append({"name": cfg.name, "reason": f"{type(exc).__name__}: {exc}"})
            active.remove(cfg)
        phase.advance()


def _measure(bench: Bench, opts: BenchOptions, prompts: list[Prompt], active: list[BenchConfig],
             skipped: list[dict], phase: Phase = SILENT,
             after: Callable[[BenchConfig, Prompt], None] = lambda cfg, prompt: None) -> dict[str, list[RunResult]]:
    """Every configuration on every prompt, ``repeats`` times, in a rotating order; ``after``
    is called after each run that succeeded."""
    results: dict[str, list[RunResult]] = defaultdict(list)
    for repeat in range(opts.repeats):
        for p_index, prompt in enumerate(prompts):
            shift = (repeat * len(prompts) + p_index) % max(len(active), 1)
            for cfg in active[shift:] + active[:shift]:
                if any(s["name"] == cfg.name for s in skipped):
                    phase.drop()  # dropped after a failed run: its other runs will not happen
                    continue
                phase.now(f"{cfg.name}, {prompt.workload}, repeat {repeat + 1}/{opts.repeats}")
                try:
                    results[cfg.name].append(bench.run(cfg, prompt, opts.max_tokens, repeat))
                except Exception as exc:
                    log.warning("dropping %s after a failed run: %s: %s", cfg.name, type(exc).__name__, exc)
                    skipped.append({"name": cfg.name, "reason": f"{type(exc).__name__}: {exc}"})
                    results.pop(cfg.name, None)
                else:
                    after(cfg, prompt)
                phase.advance()
    return results


def _concurrency(bench: Bench, opts: BenchOptions, prompts: list[Prompt], phase: Phase = SILENT) -> dict:
    """The HTTP concurrency sweep against the running server."""
    from specdec.bench.client import concurrency_sweep

    # auto picks k itself (as the http-auto configuration asks); a fixed mode runs at the middle k.
    k = None if opts.http_mode == "auto" else sorted(opts.ks)[len(opts.ks) // 2]
    return {
        "mode": opts.http_mode, "k": k,
        "levels": concurrency_sweep(
            bench.client.url, bench.client.model, prompts, list(opts.concurrency),
            requests_per_stream=opts.requests_per_stream, max_tokens=opts.max_tokens,
            mode=opts.http_mode, k=k, extra_body=opts.http_extra, phase=phase,
        ),
    }


def _rows(opts: BenchOptions, prompts: list[Prompt], active: list[BenchConfig],
          results: dict[str, list[RunResult]], costs) -> list[dict]:
    """One summary row per configuration and workload, against that workload's plain decoding."""
    references = {r.prompt: r.output_ids for r in results.get("off", []) if r.repeat == 0}
    greedy = {p.key for p in prompts if p.temperature == 0}
    rows = []
    for workload in opts.workloads:
        off_runs = [r for r in results.get("off", []) if r.workload == workload]
        if not off_runs:
            continue
        hf_plain_runs = [r for r in results.get("hf-plain", []) if r.workload == workload]
        for cfg in active:
            runs = [r for r in results[cfg.name] if r.workload == workload]
            if runs:
                rows.append(summarize(cfg, workload, runs, costs=costs, baseline=off_runs,
                                      references=references, greedy_prompts=greedy, hf_plain=hf_plain_runs))
    return rows


def _report(bench: Bench, opts: BenchOptions, started: float, prompts: list[Prompt], costs, rows: list[dict],
            skipped: list[dict], concurrency: dict | None) -> dict:
    policy = getattr(bench.engine, "policy_config", None)
    contexts = _decode_contexts(prompts, opts.max_tokens)
    return {
        "schema": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": time.perf_counter() - started,
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()},
        "models": {"target": bench.target_path, "draft": bench.draft_path, "dtype": opts.dtype,
                   "dtype_used": dtype_name(bench.engine.target_model),
                   "draft_dtype": opts.draft_dtype, "drafters": sorted(bench.engine.drafters),
                   "prefix_hit_tokens": bench.engine.loop.usage()["prefix_hit_tokens"],  # 0: every run prefilled its prompt
                   "policy": policy.model_dump() if hasattr(policy, "model_dump") else None},
        "machine": {"cpus": os.cpu_count(), "torch_threads": compute.run(torch.get_num_threads),
                    "torch": torch.__version__, "transformers": _version("transformers"),
                    "python": platform.python_version(), "platform": platform.platform()},
        "costs": costs.to_dict(),
        "workloads": {w: _workload_info([p for p in prompts if p.workload == w]) for w in opts.workloads},
        "code_files_held_out": stdlib_code_files(opts.seed)[1],
        "configurations": rows,
        "skipped": skipped,
        "http": {"url": opts.url, "model": bench.client.model if bench.client else None,
                 "concurrency": concurrency} if opts.url else None,
        "decode_contexts": contexts,
        "targets": targets(rows, costs, contexts),
        "peak_rss_mb": peak_rss_mb(),
    }


def _steps_line(report: dict) -> str:
    """The plain step at each workload's decode context (what its TPOT is compared with)."""
    steps, contexts = report["costs"].get("steps", {}), report.get("decode_contexts", {})
    beside = report["costs"].get("steps_beside", {})
    at = [f"{w} {n}: {steps[str(n)] * 1e3:.2f} ms" + (f" ({beside[str(n)] * 1e3:.2f} beside its plain runs)"
                                                      if str(n) in beside else "")
          for w, n in contexts.items() if str(n) in steps]
    return "\nplain step at each workload's decode context (tokens): " + ", ".join(at) if at else ""


def _workload_info(prompts: list[Prompt]) -> dict:
    return {"prompts": len(prompts), "temperature": prompts[0].temperature if prompts else None,
            "mean_prompt_tokens": statistics.mean(len(p.ids) for p in prompts) if prompts else None,
            "median_prompt_tokens": _median_prompt(prompts) if prompts else None}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _dtype(models: dict) -> str:
    used = models.get("dtype_used", models["dtype"])
    return f"dtype auto: {used}" if models["dtype"] == "auto" else used


def render(report: dict) -> str:
    """The terminal view of a report."""
    parts = [
        f"specdec bench: target {report['models']['target']} ({_dtype(report['models'])}), "
        f"draft {report['models']['draft']} ({report['models']['draft_dtype']}); "
        f"drafters: {', '.join(report['models']['drafters'])}",
        "costs: target step {:.2f} ms ({} numerics), c = {}, v(k) = {} (context {} tokens)".format(
            report["costs"]["target_step_s"] * 1000, report["costs"].get("numerics", "fast"),
            "-" if report["costs"]["c"] is None else f"{report['costs']['c']:.3f}",
            ", ".join(f"{k}:{v:.2f}" for k, v in report["costs"]["v"].items() if k != "0"),
            report["costs"]["context_tokens"],
        ) + _steps_line(report),
        "",
        format_table(report["configurations"]),
    ]
    if report["http"] and report["http"]["concurrency"]:
        parts += [format_concurrency(report["http"]["concurrency"]["levels"]), ""]
    parts.append(format_targets(report["targets"]))
    for s in report["skipped"]:
        parts.append(f"skipped {s['name']}: {s['reason']}")
    parts.append(f"elapsed {report['elapsed_s']:.0f} s, peak RSS {report['peak_rss_mb']:.0f} MB")
    return "\n".join(parts)
