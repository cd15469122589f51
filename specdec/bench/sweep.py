"""Concurrency sweep: aggregate output tokens/s, time per output token and TTFT under load.

``c`` concurrent streams each send ``requests`` greedy requests back to back, all at once, to
one unit: in process (threads over one ``Engine``: its step loop batches them) or through
HTTP (``--url``, a running server). For each mode (``off``, ``auto`` by default) and each
level it prints aggregate output tokens/s, p50 / p95 time per output token (after the first)
and p50 / p95 time to first token, side by side, and optionally plots them.

    python -m specdec.bench.sweep --concurrency 1,2,4,8,16 --max-tokens 64 --plot sweep.png
    python -m specdec.bench.sweep --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass

WORKLOAD_PROMPTS = {
    "chat": ["Name three rivers and say where each one flows.", "Explain what a hash table is.",
             "Give me two tips for learning to cook.", "What is the capital of France, and why is it famous?"],
    "code": ["def fibonacci(n):", "def quicksort(xs):", "class Stack:\n    def __init__(self):",
             "def read_csv(path):"],
}


@dataclass
class Sample:
    tokens: int
    ttft_s: float
    total_s: float

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / max(1, self.tokens - 1)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else 0.0


def run_level(send, concurrency: int, requests: int, prompts: list[str]) -> dict:
    """``concurrency`` streams x ``requests`` each; ``send(prompt) -> Sample``."""
    samples: list[Sample] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        for r in range(requests):
            s = send(prompts[(i + r * concurrency) % len(prompts)])
            with lock:
                samples.append(s)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    tokens = sum(s.tokens for s in samples)
    return {
        "concurrency": concurrency, "requests": len(samples), "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "tpot_ms_p50": 1e3 * _pct([s.tpot_s for s in samples], 0.5),
        "tpot_ms_p95": 1e3 * _pct([s.tpot_s for s in samples], 0.95),
        "ttft_ms_p50": 1e3 * _pct([s.ttft_s for s in samples], 0.5),
        "ttft_ms_p95": 1e3 * _pct([s.ttft_s for s in samples], 0.95),
    }


def in_process_sender(engine, mode: str, max_tokens: int, chat: bool):
    def send(prompt: str) -> Sample:
        ids = engine.encode(messages=[{"role": "user", "content": prompt}]) if chat else engine.encode(prompt=prompt)
        res = engine.generate(ids, max_tokens=max_tokens, mode=mode, ignore_eos=True)
        return Sample(len(res.token_ids), res.ttft_s, res.total_s)
    return send


def http_sender(url: str, model: str, mode: str, max_tokens: int, chat: bool):
    import httpx

    client = httpx.Client(base_url=url, timeout=600)

    def send(prompt: str) -> Sample:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "speculation": {"mode": mode}}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        with client.stream("POST", path, json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if ttft is None and chunk["choices"] and chunk["choices"][0].get("finish_reason") is None:
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        total = time.perf_counter() - t0
        return Sample(tokens, ttft if ttft is not None else total, total)
    return send


def sweep(make_sender, modes: list[str], levels: list[int], requests: int, prompts: list[str]) -> list[dict]:
    rows = []
    for level in levels:
        for mode in modes:  # interleaved per level: drifts in machine load hit both modes alike
            row = {"mode": mode, **run_level(make_sender(mode), level, requests, prompts)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict], where: str) -> str:
    lines = [f"| {where} | c | tok/s | vs off | TPOT p50 / p95 ms | TTFT p50 / p95 ms |", "|---|---|---|---|---|---|"]
    off = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        ratio = r["tokens_per_s"] / off[r["concurrency"]] if off.get(r["concurrency"]) else float("nan")
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {ratio:.2f} | "
                     f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p95']:.1f} | {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p95']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        axes[0].plot([r["concurrency"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=mode)
        axes[1].plot([r["concurrency"] for r in mine], [r["tpot_ms_p50"] for r in mine], marker="o", label=mode)
    axes[0].set(xlabel="concurrent streams", ylabel="aggregate output tokens/s", xscale="log", xticks=[1, 2, 4, 8, 16])
    axes[1].set(xlabel="concurrent streams", ylabel="TPOT p50 (ms)", xscale="log", xticks=[1, 2, 4, 8, 16])
    for ax in axes:
        ax.legend()
        ax.set_xticklabels([str(x) for x in [1, 2, 4, 8, 16]])
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server; without it, the demo pair in process")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name (with --url)")
    p.add_argument("--target"), p.add_argument("--draft")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="off,auto")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--requests", type=int, default=2, help="requests per stream")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", choices=sorted(WORKLOAD_PROMPTS), default="code")
    p.add_argument("--threads", type=int, help="torch threads (in process)")
    p.add_argument("--out", help="write the rows as JSON")
    p.add_argument("--plot", help="write a PNG of tokens/s and TPOT against concurrency")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    modes = args.modes.split(",")
    prompts = WORKLOAD_PROMPTS[args.workload]
    chat = args.workload == "chat"
    if args.url:
        rows = sweep(lambda m: http_sender(args.url, args.model, m, args.max_tokens, chat), modes, levels,
                     args.requests, prompts)
        where = "HTTP"
    else:
        import torch

        from specdec.config import ModelConfig
        from specdec.demo import demo_exit_adapter, demo_paths
        from specdec.engine import Engine

        if args.threads:
            torch.set_num_threads(args.threads)
        paths = demo_paths()
        exit_adapter = None if args.target else demo_exit_adapter()
        engine = Engine.load(ModelConfig(
            target=args.target or str(paths["target"]), draft=args.draft or str(paths["draft"]), dtype=args.dtype,
            draft_dtype="bfloat16", early_exit_adapter=str(exit_adapter) if exit_adapter else None,
        ), max_num_seqs=max(levels))
        rows = sweep(lambda m: in_process_sender(engine, m, args.max_tokens, chat), modes, levels, args.requests, prompts)
        where = "in process"
    print(table(rows, where))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"where": where, "args": vars(args), "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
