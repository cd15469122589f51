"""Cost curves of one batched step, for the step loop's cost model on a real device.

Builds random-weight Llama-family models of real shapes (nothing is downloaded), puts each on
the batched runner's token pool, and times one flat step against the tokens in the batch:
``B`` rows of ``k + 1`` tokens each at a fixed context. Prints a table, the linear fit
``T = a + b * tokens`` the step loop uses (``specdec.engine.schedule.StepCosts``), and the draft
step against rows. Then the whole step loop (``specdec.bench.overhead``: plain requests through
``Engine`` at rows 1, 8, 32, 64, host time of each stage, against one dense forward of the same
rows), peak memory, and the engine's logits against a dense forward (chains and a token tree).
With ``--tests``, runs the library's batched-engine tests. Needs torch and transformers only
(run from a checkout; nothing is installed or downloaded).

    python scripts/gpu_costs.py                      # 7B-class target, 0.5B-class draft, CUDA
    python scripts/gpu_costs.py --shapes tiny --device cpu   # a smoke run anywhere

Sized to fit well inside 10 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, without an install

from specdec import compute  # noqa: E402
from specdec.batch.blocks import BLOCK, blocks_for, run_of  # noqa: E402
from specdec.batch.runner import BatchRow, BatchRunner  # noqa: E402

SHAPES = {
    # Qwen2.5-7B-class target and 0.5B-class draft (what cluster/serve_config.gpu.yaml serves)
    "real": {
        "target": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064),
        "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=152064),
    },
    "tiny": {
        "target": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=320),
        "draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320),
    },
}


def build(shape: dict, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    cfg = LlamaConfig(max_position_embeddings=4096, **shape)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(model, device: str, rows: int, q: int, context: int, reps: int) -> float:
    """Median seconds of one step: ``rows`` sequences at ``context`` tokens, each feeding ``q``."""
    span = context + q + 1
    per_row = blocks_for(span)
    runner = BatchRunner(model, capacity_tokens=rows * per_row * BLOCK)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (context + q,), generator=gen).tolist() for _ in range(rows)]
    prefill = [BatchRow(f"r{i}", seqs[i][:context], 1, run_of(1 + i * per_row, span)) for i in range(rows)]
    runner.forward(prefill)
    step = [BatchRow(f"r{i}", seqs[i], q, run_of(1 + i * per_row, span)) for i in range(rows)]
    times = []
    for _ in range(reps + 2):
        _sync(device)
        t0 = time.perf_counter()
        runner.forward(step)  # reconciles back to `context` each time, then feeds q tokens
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return my - b * mx, b


def equality(model, device: str) -> dict:
    """Max |engine - dense| over the logits of a step of plain rows, a 3-draft chain and a tree."""
    from specdec.trees import path_to

    runner = BatchRunner(model, capacity_tokens=4 * 256)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (37, 52, 45)]
    at = [run_of(1 + 16 * i, 256) for i in range(3)]
    runner.forward([BatchRow(str(i), s[:-1], 0, at[i]) for i, s in enumerate(ids)])
    tree, parents = [5, 6, 7, 8], (-1, -1, 0, 1)
    out = runner.forward([BatchRow("0", ids[0], 1, at[0]), BatchRow("1", ids[1] + [1, 2, 3], 4, at[1]),
                          BatchRow("2", ids[2] + tree, 5, at[2], parents)])

    def dense(seq):
        with torch.inference_mode():
            return model(input_ids=torch.tensor([seq], device=device)).logits[0, -1].float().cpu()

    worst = max((out[0][0] - dense(ids[0])).abs().max().item(),
                *((out[1][j] - dense(ids[1] + [1, 2, 3][:j])).abs().max().item() for j in range(4)),
                *((out[2][1 + n] - dense(ids[2] + [tree[j] for j in path_to(parents, n)])).abs().max().item()
                  for n in range(len(tree))))
    return {"max_abs_diff": worst}


def loop_overhead(model, device: str, rows_grid: list[int], steps: int = 16) -> list[dict]:
    """The step loop's time per step against a dense forward (``specdec.bench.overhead``)."""
    from specdec.bench import overhead

    engine = overhead.engine_for(model, overhead.tokenizer(), max_num_seqs=max(rows_grid),
                                 kv_cache_tokens=max(rows_grid) * (overhead.PROMPT_TOKENS + steps + 16) + 64)
    engine.generate(list(range(1, 9)), max_tokens=4, mode="off")
    results = []
    for rows in rows_grid:
        step, split = overhead.engine_step_s(engine, rows, steps)
        dense = compute.run(overhead.dense_step_s, model, rows, overhead.PROMPT_TOKENS + steps // 2, reps=8)
        results.append({"rows": rows, "engine_ms": 1e3 * step, "dense_ms": 1e3 * dense, "ratio": step / dense,
                        **{f"{k}_ms": 1e3 * v for k, v in split.items()}})
    engine.loop.close()
    print(overhead.table(results), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="real")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--q", default="1,2,4,6,8", help="tokens per row (k + 1)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--loop-rows", default="1,8,32,64", help="rows of the step-loop measurement ('' to skip)")
    p.add_argument("--tests", action="store_true", help="then run the batched-engine tests")
    p.add_argument("--out", help="write the measurements as JSON")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows_grid = [int(x) for x in args.rows.split(",")]
    q_grid = [int(x) for x in args.q.split(",")]
    report: dict = {"device": args.device, "dtype": args.dtype, "context": args.context, "shapes": args.shapes}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    for role in ("target", "draft"):
        model = compute.run(build, SHAPES[args.shapes][role], dtype, args.device)
        grid = q_grid if role == "target" else [1]  # a draft step feeds one token per row
        points = []
        print(f"\n{role}: rows x tokens-per-row -> ms per step")
        for rows in rows_grid:
            line = []
            for q in grid:
                s = compute.run(time_steps, model, args.device, rows, q, args.context, args.reps)
                points.append((rows * q, s))
                line.append(f"{rows}x{q}: {1e3 * s:7.2f}")
            print("  " + "  ".join(line), flush=True)
        a, b = fit(points)
        print(f"  fit: T = {1e3 * a:.2f} ms + {1e3 * b:.3f} ms per token")
        report[role] = {"points": points, "a_s": a, "b_s": b}
        if role == "target":
            report["equality"] = compute.run(equality, model, args.device)
            print("  engine vs dense forward:", report["equality"], flush=True)
            if args.loop_rows:
                print("\nthe step loop (plain rows, target shape):")
                report["loop"] = loop_overhead(model, args.device, [int(x) for x in args.loop_rows.split(",")])
            if args.device.startswith("cuda"):
                report["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
                print(f"  peak GPU memory: {report['peak_memory_gb']:.1f} GB")
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    t1 = report["target"]["a_s"] + report["target"]["b_s"]
    d1 = report["draft"]["a_s"] + report["draft"]["b_s"]
    report["priors"] = {"step_s": t1, "verify_slope": report["target"]["b_s"] / t1, "c_draft": d1 / t1}
    print("\npriors for the cost model:", json.dumps(report["priors"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.tests:
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/test_batch.py", "tests/test_runner.py",
                                "tests/test_trees.py"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
