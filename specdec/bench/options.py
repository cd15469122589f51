"""``specdec bench`` options: the command-line arguments, the presets, one validated object.

Presets (any explicit flag overrides its preset value):

- ``--quick``: 1 prompt per workload, 2 repeats, 40 tokens, k = 4, fewer peers (9
  configurations): meant to finish in under 3 minutes on 2 cores with the demo pair;
- default (full): 2 prompts per workload, 2 repeats, 64 tokens, k in 2, 4, 6 (20
  configurations, 320 runs): meant to finish in under 20 minutes.

Both budgets are estimates from the demo pair's measured step time (45 ms per bf16 target
token), not measurements; ``--url`` adds the HTTP configurations and the concurrency sweep.

Models: ``--target``/``--draft`` (paths or ids), else ``--tiny`` (a tiny Llama pair built in
seconds and cached under ``$SPECDEC_HOME/tiny``; what CI uses), else the demo pair.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import get_args

from specdec.bench.progress import add_progress_argument
from specdec.bench.workloads import WORKLOADS
from specdec.config import DType

PRESETS = {
    "quick": {"prompts": 1, "repeats": 2, "max_tokens": 40, "ks": (4,), "cost_reps": 15,
              "requests_per_stream": 1},
    "full": {"prompts": 2, "repeats": 2, "max_tokens": 64, "ks": (2, 4, 6), "cost_reps": 25,
             "requests_per_stream": 2},
}
DTYPES = list(get_args(DType))  # auto: specdec.hardware.resolve_dtype


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _workloads(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; choose from {','.join(WORKLOADS)}")
    return names


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's arguments (preset-controlled ones default to None)."""
    m = p.add_argument_group("models")
    m.add_argument("--target", help="target model path or id (default: the demo target)")
    m.add_argument("--draft", help="draft model path or id (default: the demo or tiny draft)")
    m.add_argument("--tiny", action="store_true", help="use the tiny Llama pair (built and cached)")
    m.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="target dtype (auto: bfloat16 where this machine has native bf16, "
                        "else float16-weights on x86, else float32)")
    m.add_argument("--draft-dtype", default="float32", choices=DTYPES)
    m.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 with --tiny)")
    r = p.add_argument_group("what to run")
    r.add_argument("--quick", action="store_true", help="the short preset (under 3 minutes)")
    r.add_argument("--overhead", action="store_true",
                   help="only the engine's own cost per step (specdec.bench.overhead): rows 1, 8, 32, 64")
    r.add_argument("--rows", type=_ints, default=(1, 8, 32, 64), help="with --overhead: rows per step")
    r.add_argument("--steps", type=int, default=24, help="with --overhead: decode steps per level")
    r.add_argument("--numerics", default="fast", choices=["fast", "batch_invariant"],
                   help="with --overhead: the target's numerics")
    r.add_argument("--prefix", action="store_true",
                   help="only the paged KV cache (specdec.bench.prefix): TTFT with a shared system prompt, "
                        "requests a fixed KV budget holds at once")
    r.add_argument("--system-tokens", type=int, default=2000, help="with --prefix: the shared system prompt")
    r.add_argument("--kv-budget", type=int, default=8192, help="with --prefix: the capacity run's KV tokens")
    r.add_argument("--capacity-requests", type=int, default=64, help="with --prefix: requests of the capacity run")
    r.add_argument("--structured", action="store_true",
                   help="what structured output costs per mode: free text, a grammar that allows any text, a JSON "
                        "schema (--prompts, --max-tokens, --structured-modes)")
    r.add_argument("--structured-modes", default="off,draft,eagle,ngram,auto",
                   help="with --structured: the modes, comma-separated")
    r.add_argument("--workloads", type=_workloads, default=list(WORKLOADS),
                   help=f"comma-separated subset of {','.join(WORKLOADS)}")
    r.add_argument("--prompts", type=int, help="prompts per workload")
    r.add_argument("--repeats", type=int,
                   help="repeats of every (prompt, configuration); with --overhead: engine / dense turns (3)")
    r.add_argument("--max-tokens", type=int, help="output tokens per run (EOS is ignored)")
    r.add_argument("--max-prompt-tokens", type=int, default=256)
    r.add_argument("--ks", type=_ints, help="fixed draft lengths, e.g. 2,4,6")
    r.add_argument("--only", action="append", metavar="GLOB",
                   help="run only configurations matching GLOB (repeatable; 'off' always runs)")
    r.add_argument("--cost-reps", type=int, help="repetitions of the c / v(k) timing")
    r.add_argument("--seed", type=int, default=0, help="seed of the prompt sets and of sampling")
    h = p.add_argument_group("HTTP (a running server)")
    h.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    h.add_argument("--model-name", help="the model name to send (default: the first of /v1/models)")
    h.add_argument("--concurrency", type=_ints, default=(1, 2, 4, 8), help="levels of the sweep")
    h.add_argument("--requests-per-stream", type=int, help="requests each concurrent stream sends")
    h.add_argument("--http-mode", default="auto", help="speculation mode of the concurrency sweep")
    h.add_argument("--http-extra", type=_json_object, default={},
                   help='extra JSON fields for every request body, e.g. \'{"ignore_eos": true}\'')
    o = p.add_argument_group("output")
    o.add_argument("--out", help="write the results as JSON here")
    o.add_argument("--plots", help="directory for PNG plots (default: next to --out)")
    o.add_argument("--no-plots", action="store_true")
    add_progress_argument(o)


@dataclass
class BenchOptions:
    target: str | None = None
    draft: str | None = None
    tiny: bool = False
    dtype: str = "auto"
    draft_dtype: str = "float32"
    threads: int | None = None
    quick: bool = False
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    prompts: int = PRESETS["full"]["prompts"]
    repeats: int = PRESETS["full"]["repeats"]
    max_tokens: int = PRESETS["full"]["max_tokens"]
    max_prompt_tokens: int = 256
    ks: tuple[int, ...] = PRESETS["full"]["ks"]
    only: list[str] | None = None
    cost_reps: int = PRESETS["full"]["cost_reps"]
    seed: int = 0
    url: str | None = None
    model_name: str | None = None
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    requests_per_stream: int = PRESETS["full"]["requests_per_stream"]
    http_mode: str = "auto"
    http_extra: dict = field(default_factory=dict)
    out: str | None = None
    plots: str | None = None
    no_plots: bool = False

    def __post_init__(self) -> None:
        for name in ("prompts", "repeats", "max_tokens", "max_prompt_tokens", "cost_reps", "requests_per_stream"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < 2:
            raise ValueError("max_tokens must be >= 2 (TPOT needs two tokens)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BenchOptions":
        preset = PRESETS["quick" if args.quick else "full"]
        values = {name: getattr(args, name) for name in cls.__dataclass_fields__ if hasattr(args, name)}
        for name, default in preset.items():
            if values.get(name) is None:
                values[name] = default
        if values.get("tiny") and not values.get("target") and values.get("threads") is None:
            values["threads"] = 1  # tiny models run fastest on one thread (and leave a core free)
        return cls(**values)
