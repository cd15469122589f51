"""The ``specdec`` subcommands and the local server the Serve layer adds to the library's CLI
(registered through entry points: ``specdec.plugins``). This module imports no Ray: every
``specdec`` invocation loads it; the commands import what they need when they run."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(subparsers: argparse._SubParsersAction) -> None:
    check = subparsers.add_parser(
        "check-config", help="lint Serve configs, RayService manifests, cluster launcher YAML"
    )
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(func=check_config)

    ops = subparsers.add_parser(
        "ops", help="operate a local cluster under load: rolling upgrades, faults, a soak (127.0.0.1 only)",
        description="Each runs its own local cluster (ray start --head --block, token auth), deploys with "
                    "serve deploy, prints a table and exits 1 when a target is missed. Without --config: the "
                    "tiny test models in float32.")
    ops.add_argument("what", choices=["upgrade", "faults", "soak"])
    ops.add_argument("--config", help="a serve config to run instead of the tiny models")
    ops.add_argument("--next-target", help="upgrade: the target the model step changes to")
    ops.add_argument("--next-draft", help="upgrade: the draft the model step changes to")
    ops.add_argument("--colocation", choices=["in_process", "actors"],
                     help="default: in_process for upgrade, actors (workers to kill and measure) otherwise")
    ops.add_argument("--ingress", choices=["separate", "in_unit"], default="separate",
                     help="without --config: the tiny unit behind an Ingress deployment (a cluster's layout; "
                          "faults kill its replica too) or serving HTTP itself (serve_config.yaml's)")
    ops.add_argument("--streams", type=int, default=16)
    ops.add_argument("--duration", type=float, default=600.0, help="soak: seconds (default 10 minutes)")
    ops.add_argument("--warmup", type=float, default=120.0, help="soak: seconds before the bounds' baseline")
    ops.add_argument("--trace-cap-mb", type=int, default=256, help="soak: SPECDEC_TRACE_MAX_TOTAL_BYTES")
    ops.add_argument("--restore-bound-s", type=float, default=30.0, help="faults: the unit serves again within")
    ops.add_argument("--port", type=int, default=8150)
    ops.add_argument("--dashboard-port", type=int, default=8277)
    ops.add_argument("--gcs-port", type=int, default=6391)
    ops.add_argument("--metrics-port", type=int, default=8278)
    ops.add_argument("--json", help="write the rows as JSON")
    ops.set_defaults(func=operate)


def check_config(args: argparse.Namespace) -> int:
    from deployments.lint import lint_file

    bad = 0
    for path in args.files:
        problems = lint_file(path)
        bad += bool(problems)
        for problem in problems:
            print(f"{path}: {problem}")
    return 1 if bad else 0


def operate(args: argparse.Namespace) -> int:
    from deployments.operate import main

    return main(args)


def serve_locally(models: dict, *, port: int, name: str, max_num_seqs: int = 16,
                  colocation: str = "in_process", num_cpus: int = 4, **unit) -> Callable[[], None]:
    """Start ``models`` as a Serve application on 127.0.0.1:``port`` (a local Ray); returns
    the function that stops it. The benchmarks' server (``specdec sweep --http``)."""
    import ray
    import torch
    from ray import serve

    from deployments.app import bind_app

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"models": {**models, "served_model_name": name}, "colocation": colocation,
            "torch_threads": torch.get_num_threads(), "max_num_seqs": max_num_seqs,
            "max_concurrent_requests": max(16, max_num_seqs), **unit}
    serve.run(bind_app(args), name=name, route_prefix="/")

    def stop() -> None:
        serve.shutdown()
        ray.shutdown()
    return stop
