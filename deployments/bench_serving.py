"""Serving overhead: one greedy request through HTTP on a local Serve vs in process.

For each colocation mode it starts the application on a local Ray, sends greedy
``max_tokens`` requests (``off`` and ``draft``, interleaved, repeated) and compares their
tokens/s with the same requests through ``Engine.generate`` in this process. With
``--tracing both`` it also compares the served tokens/s with tracing on and off.

    python -m deployments.bench_serving --max-tokens 128 --repeats 3

It measures the Serve layer, so it lives with it (the library never imports ``deployments``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _http_run(base: str, model: str, prompt: str, mode: str, max_tokens: int) -> dict:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "speculation": {"mode": mode}, "return_token_ids": True}
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    return {"tokens": out["usage"]["completion_tokens"], "s": elapsed, "spec": out["speculation"],
            "token_ids": out["choices"][0]["token_ids"], "traceparent": r.headers.get("traceparent")}


def measure(args) -> dict:
    import ray
    from ray import serve

    from deployments.app import bind_app
    from specdec.config import ModelConfig, SpeculationConfig
    from specdec.demo import demo_paths
    from specdec.engine import Engine

    paths = demo_paths()
    target, draft = args.target or str(paths["target"]), args.draft or str(paths["draft"])
    models = {"target": target, "draft": draft, "dtype": args.dtype, "draft_dtype": args.draft_dtype,
              "served_model_name": "bench"}
    engine = Engine.load(ModelConfig(**models), SpeculationConfig())
    prompt = args.prompt
    ids = engine.encode(prompt=prompt)
    results: dict = {"max_tokens": args.max_tokens, "prompt": prompt, "rows": []}
    modes = args.modes.split(",")

    def in_process(mode):
        res = engine.generate(ids, max_tokens=args.max_tokens, mode=mode)
        return {"tokens": len(res.token_ids), "s": res.total_s, "token_ids": res.token_ids}

    tracing_settings = {"on": ["1"], "off": ["0"], "both": ["1", "0"]}[args.tracing]
    for colocation in args.colocation.split(","):
        for tracing in tracing_settings:
            os.environ["SPECDEC_TRACING"] = tracing  # inherited by the Ray workers
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
            serve.start(http_options={"host": "127.0.0.1", "port": args.port})
            unit = {"models": models, "colocation": colocation, "torch_threads": torch.get_num_threads(),
                    "resources": {"router_cpus": 0.1, "target_cpus": 1.0, "draft_cpus": 0.5}}
            serve.run(bind_app(unit), name="bench", route_prefix="/")
            base = f"http://127.0.0.1:{args.port}"
            for mode in modes:  # warm-up
                _http_run(base, "bench", prompt, mode, 8)
                in_process(mode)
            samples = {(m, where): [] for m in modes for where in ("http", "inproc")}
            for _ in range(args.repeats):
                for mode in modes:
                    h = _http_run(base, "bench", prompt, mode, args.max_tokens)
                    samples[(mode, "http")].append(h)
                    samples[(mode, "inproc")].append(in_process(mode))
            for mode in modes:
                http_tps = statistics.median(s["tokens"] / s["s"] for s in samples[(mode, "http")])
                ip_tps = statistics.median(s["tokens"] / s["s"] for s in samples[(mode, "inproc")])
                same = samples[(mode, "http")][0]["token_ids"] == samples[(mode, "inproc")][0]["token_ids"]
                results["rows"].append({
                    "colocation": colocation, "tracing": tracing == "1", "mode": mode,
                    "http_tok_s": round(http_tps, 2), "inproc_tok_s": round(ip_tps, 2),
                    "ratio": round(http_tps / ip_tps, 3), "same_tokens": same,
                    "acceptance": samples[(mode, "http")][-1]["spec"]["acceptance_rate"],
                    "traceparent": samples[(mode, "http")][-1]["traceparent"],
                })
            serve.shutdown()
            ray.shutdown()
    os.environ.pop("SPECDEC_TRACING", None)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--draft-dtype", default="bfloat16")
    p.add_argument("--prompt", default="def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="off,draft")
    p.add_argument("--colocation", default="in_process,actors")
    p.add_argument("--tracing", choices=["on", "off", "both"], default="on")
    p.add_argument("--port", type=int, default=8190)
    p.add_argument("--out")
    args = p.parse_args(argv)
    results = measure(args)
    print(f"{'colocation':<11} {'tracing':<7} {'mode':<6} {'HTTP tok/s':>10} {'in-proc':>8} {'ratio':>6} same accept")
    for r in results["rows"]:
        print(f"{r['colocation']:<11} {str(r['tracing']):<7} {r['mode']:<6} {r['http_tok_s']:>10} "
              f"{r['inproc_tok_s']:>8} {r['ratio']:>6} {str(r['same_tokens']):<4} {r['acceptance']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
