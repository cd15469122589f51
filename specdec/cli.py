"""The ``specdec`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import get_args

from specdec.config import MODES, DType
from specdec.plugins import register_commands
from specdec.sampling import SamplingParams


def _demo_models() -> tuple[str, str, str | None, str, str]:
    """The demo target, draft, early-exit adapter (if built), EAGLE head and Medusa heads (made
    on first use, then cached)."""
    from specdec.demo import build_demo_models, demo_exit_adapter, demo_paths

    build_demo_models()  # returns at once when the cache is complete
    paths = demo_paths()
    adapter = demo_exit_adapter()
    return (str(paths["target"]), str(paths["draft"]), str(adapter) if adapter else None, str(paths["eagle"]),
            str(paths["medusa"]))


def _model_config(args: argparse.Namespace):
    """The models ``specdec generate`` names; those it does not name are the demo's."""
    from specdec.config import ModelConfig

    given = (args.draft, args.early_exit_adapter, args.eagle_head, args.medusa_heads)
    demo = _demo_models() if args.target is None else (args.target, None, None, None, None)
    draft, adapter, eagle, medusa = (a or b for a, b in zip(given, demo[1:]))
    return ModelConfig(target=demo[0], draft=draft, dtype=args.dtype, draft_dtype=args.draft_dtype,
                       early_exit_adapter=adapter, early_exit_layer=args.early_exit_layer, eagle_head=eagle,
                       medusa_heads=medusa)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.config import SpeculationConfig
    from specdec.engine import Engine

    engine = Engine.load(
        _model_config(args),
        SpeculationConfig(
            mode=args.mode,
            num_speculative_tokens=args.k or 4,
            early_exit_threshold=args.early_exit_threshold,
        ),
    )
    if args.chat:
        prompt_ids = engine.encode(messages=[{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = engine.encode(prompt=args.prompt)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    result = engine.generate(
        prompt_ids, max_tokens=args.max_tokens, params=params, stop=args.stop, mode=args.mode, k=args.k
    )
    spec = result.speculation
    if args.json:
        out = {
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "speculation": spec.to_dict(),
            "ttft_s": result.ttft_s,
            "total_s": result.total_s,
            "tokens_per_s": result.tokens_per_s,
            "policy": result.policy_summary,
            "rounds": [vars(r) for r in result.rounds],
        }
        print(json.dumps(out, indent=2))
        return 0
    print(result.text)
    print(
        f"\n[{spec.mode}] {len(result.token_ids)} tokens in {result.total_s:.2f}s "
        f"({result.tokens_per_s:.1f} tok/s, TTFT {result.ttft_s * 1000:.0f} ms), "
        f"finish={result.finish_reason}; rounds={spec.rounds} drafted={spec.drafted_tokens} "
        f"accepted={spec.accepted_tokens} acceptance={spec.acceptance_rate:.2f} "
        f"mean_accepted_length={spec.mean_accepted_length:.2f}",
        file=sys.stderr,
    )
    return 0


def cmd_demo_models(args: argparse.Namespace) -> int:
    from specdec.demo import build_demo_models

    path = build_demo_models(force=args.force or args.train, train=args.train, seed=args.seed,
                             early_exit=args.early_exit)
    print(path)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from specdec.bench.sweep import run_from_args

    return run_from_args(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from specdec.bench import run_from_args

    return run_from_args(args)


def cmd_quality(args: argparse.Namespace) -> int:
    from specdec.bench.quality import run_from_args

    return run_from_args(args)


def cmd_traces(args: argparse.Namespace) -> int:
    from specdec.tracing.cli import run_from_args

    return run_from_args(args)


def _add_tools(sub) -> None:
    """The measuring and reading subcommands: each module adds its own arguments."""
    from specdec.bench.options import add_arguments as bench_arguments
    from specdec.bench.quality import add_arguments as quality_arguments
    from specdec.bench.sweep import add_arguments as sweep_arguments
    from specdec.tracing.cli import add_arguments as traces_arguments

    for name, add, func, text in (
        ("bench", bench_arguments, cmd_bench, "benchmark speculation against plain decoding and transformers"),
        ("sweep", sweep_arguments, cmd_sweep, "off vs auto at 1-16 concurrent streams: tokens/s, TPOT, TTFT"),
        ("quality", quality_arguments, cmd_quality,
         "the pre-rollout check: every mode's greedy answers against plain decoding"),
        ("traces", traces_arguments, cmd_traces, "read request traces back: list, show, summary"),
    ):
        parser = sub.add_parser(name, help=text)
        add(parser)
        parser.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in process")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--target", help="target model path or id (default: the demo target)")
    gen.add_argument("--draft", help="draft model path or id (default: the demo draft)")
    gen.add_argument("--mode", default="auto", choices=MODES)
    gen.add_argument("--k", type=int, default=None, help="fixed draft tokens per round (default: adaptive)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--dtype", default="auto", choices=get_args(DType),
                     help="auto: bfloat16 where this machine has native bf16, else float16-weights (x86) or float32")
    gen.add_argument("--draft-dtype", default="auto", choices=get_args(DType))
    gen.add_argument("--early-exit-adapter", help="trained exit adapter (default: the demo's, if built)")
    gen.add_argument("--eagle-head", help="EAGLE head directory (default: the demo's)")
    gen.add_argument("--medusa-heads", help="Medusa heads directory (default: the demo's)")
    gen.add_argument("--early-exit-layer", type=int, help="exit after this layer (raw exit, no adapter)")
    gen.add_argument("--early-exit-threshold", type=float, default=0.0,
                     help="stop a round's drafting below this exit confidence")
    gen.add_argument("--json", action="store_true", help="print text, token ids and statistics")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo-models", help="the demo target, draft and EAGLE head (cached)")
    demo.add_argument("--force", action="store_true", help="rebuild even if cached")
    demo.add_argument("--train", action="store_true",
                      help="train the draft and the EAGLE head from scratch instead of using the shipped "
                      "weights (about an hour on 2 cores; deterministic)")
    demo.add_argument("--early-exit", action="store_true",
                      help="also add the early-exit adapter (the shipped one; built when none ships)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo_models)

    _add_tools(sub)
    register_commands(sub)  # check-config, from the Serve layer
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
