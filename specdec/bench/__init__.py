"""``specdec bench``: our loop against plain decoding and transformers' peers, same pair, same prompts.

Modules, one concept each:

- ``overhead``   the engine's own cost per step (``--overhead``), a near-zero-compute model
- ``prefix``     the paged KV cache (``--prefix``): TTFT with a shared system prompt, requests held at once
- ``structured`` what structured output costs per mode (``--structured``): free, any-text grammar, JSON schema
- ``quality``    ``specdec quality``: every mode's greedy answers on a shipped suite against plain decoding
- ``ideal``      the ideal-speedup math (pure; worked example in its docstring)
- ``workloads``  the seeded prompt sets: chat, code, grounded, sampling
- ``configs``    what runs: our modes and k, transformers' plain / assisted / prompt lookup, HTTP
- ``costs``      c (draft step / target step) and v(k) timed directly on the models
- ``inproc``     one timed run through our engine or ``model.generate``
- ``sse``        SSE parsing and TTFT / TPOT of a stream (pure); ``client`` the httpx side
- ``report``     rows, targets, the terminal table; ``plots`` optional PNGs; ``run`` the driver
- ``progress``   the phases of bench, sweep and quality on stderr: what runs, done / total, ETA

Run ``specdec bench --quick --tiny`` for a smoke run, ``specdec bench`` for the full one on
the demo pair, ``--url http://127.0.0.1:8000`` to add a running server.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def _overhead(args: argparse.Namespace) -> int:
    from specdec.bench import overhead
    from specdec.bench.progress import Progress

    with Progress("bench", force=args.progress).phase("overhead", len(args.rows)) as phase:
        results = overhead.run(list(args.rows), steps=args.steps, threads=args.threads, numerics=args.numerics,
                               repeats=args.repeats or 3, phase=phase)
    print(f"engine vs a dense forward, near-zero-compute model, numerics {args.numerics}")
    print(overhead.table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"overhead": results, "shape": overhead.SHAPE}, indent=2))
    return 0


def _models(args: argparse.Namespace) -> dict:
    """The pair a focused bench mode runs on (the tiny pair with ``--tiny``), on ``--threads`` threads."""
    from specdec import compute
    from specdec.bench.run import tiny_pair
    from specdec.bench.sweep import models_from_args

    if args.threads:
        compute.set_threads(args.threads)
    if args.tiny and not args.target:
        paths = tiny_pair()
        return {"target": str(paths["target"]), "draft": str(paths["draft"]), "dtype": args.dtype}
    return models_from_args(args)


def _prefix(args: argparse.Namespace) -> int:
    from specdec.bench import prefix
    from specdec.bench.progress import Progress

    models = _models(args)
    with Progress("bench", force=args.progress).phase("prefix", 3) as phase:
        result = prefix.run(models, system_tokens=args.system_tokens, kv_budget=args.kv_budget,
                            capacity_requests=args.capacity_requests, phase=phase)
    print(prefix.table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _structured(args: argparse.Namespace) -> int:
    from specdec.bench import structured
    from specdec.bench.progress import Progress

    models = _models(args)
    modes = [m for m in args.structured_modes.split(",") if m]
    prompts, max_tokens = args.prompts or 4, args.max_tokens or 96
    repeats = args.repeats or 2
    with Progress("bench", force=args.progress).phase("structured", len(modes) * 3 * prompts * repeats) as phase:
        result = structured.run(models, modes, prompts=prompts, max_tokens=max_tokens, repeats=repeats, phase=phase)
    print(structured.table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def run_from_args(args: argparse.Namespace) -> int:
    """The ``bench`` subcommand: run, print the table, write JSON and plots."""
    from specdec.bench.options import BenchOptions
    from specdec.bench.progress import Progress
    from specdec.bench.run import render, run_bench

    if args.overhead:
        return _overhead(args)
    if args.prefix:
        return _prefix(args)
    if args.structured:
        return _structured(args)
    opts = BenchOptions.from_args(args)
    report = run_bench(opts, Progress("bench", force=args.progress))
    print(render(report))
    if opts.out:
        out = Path(opts.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {out}", file=sys.stderr)
    if not opts.no_plots and (opts.plots or opts.out):
        from specdec.bench.plots import write_plots

        directory = Path(opts.plots) if opts.plots else Path(opts.out).parent
        stem = Path(opts.out).stem if opts.out else "bench"
        for path in write_plots(report, directory, stem):
            print(f"wrote {path}", file=sys.stderr)
    return 0
