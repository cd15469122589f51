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


def check_config(args: argparse.Namespace) -> int:
    from deployments.lint import lint_file

    bad = 0
    for path in args.files:
        problems = lint_file(path)
        bad += bool(problems)
        for problem in problems:
            print(f"{path}: {problem}")
    return 1 if bad else 0


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
