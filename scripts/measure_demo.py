"""Measurements on the demo pair quoted in the issues' closing notes (run on an idle machine).

    python scripts/measure_demo.py generate      # issue 2: off / draft / ngram on 5 held-out prompts
    python scripts/measure_demo.py bad-draft     # issue 4: writes a randomly initialised demo draft
    python scripts/measure_demo.py confidence    # the confidence stop on and off, side by side
    python scripts/measure_demo.py load          # off / auto / auto without the guard under load,
                                                 # and where a step's time goes
    python scripts/measure_demo.py trees         # mean accepted length of chains and tree shapes
    python scripts/measure_demo.py packed        # plain decoding with packed and stock linear layers
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from specdec.sampling import SamplingParams


def generate_table(max_tokens: int = 128) -> None:
    from specdec.bench.workloads import build_prompts
    from specdec.config import ModelConfig, SpeculationConfig
    from specdec.demo import demo_exit_adapter, demo_paths
    from specdec.engine import Engine

    paths = demo_paths()
    engine = Engine.load(
        ModelConfig(target=str(paths["target"]), draft=str(paths["draft"]), dtype="bfloat16",
                    draft_dtype="bfloat16", early_exit_adapter=str(demo_exit_adapter())),
        SpeculationConfig(),
    )
    prompts = list(build_prompts(engine.tokenizer, ("chat", "code", "grounded"), 2))[:5]
    runs = [("off", None), ("draft", None), ("draft", 4), ("ngram", None), ("ngram", 4),
            ("early_exit", 2), ("auto", None)]
    engine.generate(prompts[0].ids, max_tokens=8, mode="off")  # warm-up
    print(f"{'mode':<11} {'k':>5} {'tok/s':>7} {'vs off':>7} {'accept':>7} {'len':>5}  per prompt tok/s")
    base = None
    for mode, k in runs:
        tps, drafted, accepted, rounds = [], 0, 0, 0
        for p in prompts:
            r = engine.generate(p.ids, max_tokens=max_tokens, mode=mode, k=k)
            tps.append(len(r.token_ids) / r.total_s)
            drafted += r.speculation.drafted_tokens
            accepted += r.speculation.accepted_tokens
            rounds += r.speculation.rounds
        med = statistics.median(tps)
        base = base or med
        acc = accepted / drafted if drafted else 0.0
        mal = (accepted + rounds) / rounds if rounds else 0.0
        print(f"{mode:<11} {str(k or 'adapt'):>5} {med:7.2f} {med / base:7.2f} {acc:7.2f} {mal:5.2f}  "
              + " ".join(f"{x:.1f}" for x in tps))
    print("prompts:", [p.key for p in prompts])


def confidence(max_tokens: int = 96, per_workload: int = 4) -> None:
    """Adaptive draft / eagle / auto on the demo pair with the confidence stop on and off,
    interleaved prompt by prompt: tok/s, acceptance, tokens per target pass, drafts per round."""
    from specdec.bench.workloads import build_prompts
    from specdec.config import ModelConfig, SpeculationConfig
    from specdec.demo import demo_paths
    from specdec.engine import Engine
    from specdec.policy import PolicyConfig

    paths = demo_paths()
    engine = Engine.load(ModelConfig(target=str(paths["target"]), draft=str(paths["draft"]),
                                     eagle_head=str(paths["eagle"])), SpeculationConfig())
    print("dtype:", engine.target_model.dtype)
    for workload in ("chat", "code", "sampling"):
        prompts = build_prompts(engine.tokenizer, [workload], per_workload)
        engine.generate(prompts[0].ids, max_tokens=8, mode="off")  # warm-up
        for mode in ("off", "draft", "eagle", "auto"):
            row = {}
            for stop in (True, False):
                row[stop] = {"s": 0.0, "n": 0, "drafted": 0, "accepted": 0, "rounds": 0}
            for p in prompts:
                params = SamplingParams(temperature=p.temperature, seed=p.seed)
                for stop in ((True, False) if mode != "off" else (True,)):
                    engine.policy_config = PolicyConfig(confidence_stop=stop)
                    r = engine.generate(p.ids, max_tokens=max_tokens, mode=mode, params=params, ignore_eos=True)
                    t = row[stop]
                    t["s"] += r.total_s
                    t["n"] += len(r.token_ids)
                    t["drafted"] += r.speculation.drafted_tokens
                    t["accepted"] += r.speculation.accepted_tokens
                    t["rounds"] += r.speculation.rounds
            for stop, t in row.items():
                if not t["n"]:
                    continue
                acc = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
                mal = (t["accepted"] + t["rounds"]) / t["rounds"] if t["rounds"] else 0.0
                print(f"{workload:<9} {mode:<6} stop={'on ' if stop else 'off'} {t['n'] / t['s']:6.1f} tok/s "
                      f"accept {acc:.2f} len {mal:.2f} drafts/round {t['drafted'] / max(1, t['rounds']):.2f}")
    engine.policy_config = PolicyConfig()


def _demo_engine(**models):
    from specdec.config import ModelConfig, SpeculationConfig
    from specdec.demo import demo_paths
    from specdec.engine import Engine

    paths = demo_paths()
    return Engine.load(ModelConfig(target=str(paths["target"]), draft=str(paths["draft"]),
                                   eagle_head=str(paths["eagle"]), medusa_heads=str(paths["medusa"]), **models),
                       SpeculationConfig(), kv_cache_tokens=32768)


def load(levels=(4, 16), requests: int = 2, max_tokens: int = 64) -> None:
    """Closed-loop streams over one engine, side by side per level: off, auto, and auto with the
    goodput guard disabled; then, per configuration, the mean step split into planning (and the
    loop's own drafting), drafting elsewhere, the target's pass and the rest (host work)."""
    import threading
    import time

    from specdec.bench.sweep import WORKLOAD_PROMPTS

    engine = _demo_engine()
    prompts = [engine.encode(messages=[{"role": "user", "content": q}]) for q in WORKLOAD_PROMPTS["chat"]]
    prompts += [engine.encode(prompt=q) for q in WORKLOAD_PROMPTS["code"]]
    engine.generate(prompts[0], max_tokens=8, mode="off")  # warm-up
    guard = engine.loop.guard
    print(f"dtype {engine.target_model.dtype}; {len(prompts)} prompts (chat and code), {max_tokens} tokens, "
          f"{requests} requests per stream")
    for level in levels:
        for name, mode, guarded in (("off", "off", True), ("auto", "auto", True), ("auto-noguard", "auto", False)):
            engine.loop.guard = guard if guarded else type("Open", (), {"allow": lambda self, rows, observed=True: True,
                                                                        "observe": lambda self, *a, **k: None})()  # noqa: E501
            engine.loop.timings.clear()
            tokens = [0]
            lock = threading.Lock()

            def stream(i):
                for r in range(requests):
                    out = engine.generate(prompts[(i + r * level) % len(prompts)], max_tokens=max_tokens, mode=mode,
                                          ignore_eos=True)
                    with lock:
                        tokens[0] += len(out.token_ids)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=stream, args=(i,)) for i in range(level)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            wall = time.perf_counter() - t0
            steps = [t for t in engine.loop.timings if t.decoding]
            spec = [t for t in steps if t.speculated]
            mean = lambda xs: statistics.mean(xs) * 1e3 if xs else 0.0  # noqa: E731
            print(f"c={level:<3} {name:<13} {tokens[0] / wall:7.1f} tok/s  steps {len(engine.loop.timings):4d} "
                  f"(speculating {len(spec)}/{len(steps)})  mean ms: step {mean([t.total_s for t in steps]):6.1f} "
                  f"plan {mean([t.plan_s for t in steps]):5.1f} draft {mean([t.draft_s for t in steps]):5.1f} "
                  f"pass {mean([t.verify_s for t in steps]):6.1f} "
                  f"host {mean([t.total_s - t.verify_s - t.draft_s for t in steps]):5.1f}  "
                  f"tokens/step {statistics.mean([t.tokens for t in steps]) if steps else 0:.2f}", flush=True)
        engine.loop.guard = guard
    print("guard (tokens/s speculating, plain) by bucket:", guard.state())


def packed(max_tokens: int = 64, repeats: int = 2) -> None:
    """Plain decoding of the demo target with its linear layers packed (as served) and on
    ``F.linear`` (two engines in one process, alternating): one stream and 8 at once, greedy
    (the tokens must be the same: bf16 packed products equal F.linear's here)."""
    import threading
    import time

    import specdec.loading
    from specdec.bench.sweep import WORKLOAD_PROMPTS

    real = specdec.loading.pack_linears
    engines = {}
    for name in ("stock", "packed"):
        specdec.loading.pack_linears = real if name == "packed" else (lambda model: 0)
        try:
            engines[name] = _demo_engine()
        finally:
            specdec.loading.pack_linears = real
    questions = (WORKLOAD_PROMPTS["chat"] * 8)[:8]
    prompts = [engines["packed"].encode(messages=[{"role": "user", "content": q}]) for q in questions]
    rates: dict = {}
    answers: dict = {}
    for engine in engines.values():
        engine.generate(prompts[0], max_tokens=8, mode="off")  # warm-up
    for _ in range(repeats):
        for name, engine in engines.items():
            for streams in (1, 8):
                outs = [None] * streams

                def run(j, engine=engine, outs=outs):
                    outs[j] = engine.generate(prompts[j], max_tokens=max_tokens, mode="off", ignore_eos=True)

                threads = [threading.Thread(target=run, args=(j,)) for j in range(streams)]
                t0 = time.perf_counter()
                [t.start() for t in threads]
                [t.join() for t in threads]
                rates.setdefault((name, streams), []).append(streams * max_tokens / (time.perf_counter() - t0))
                answers.setdefault(name, [o.token_ids for o in outs])
    print(f"dtype {engines['packed'].target_model.dtype}, {max_tokens} tokens, plain decoding, tok/s per repeat")
    for (name, streams), values in rates.items():
        print(f"{name:<7} {streams} stream(s): " + " ".join(f"{v:6.1f}" for v in values))
    print("same tokens packed and stock:", answers["packed"] == answers["stock"])


def trees(max_tokens: int = 64, per_workload: int = 4) -> None:
    """Mean accepted length (bonus token included) of the chains and of tree shapes, greedy."""
    from specdec.bench.workloads import build_prompts
    from specdec.policy import PolicyConfig

    engine = _demo_engine(dtype="float32")
    for workload in ("chat", "code"):
        prompts = build_prompts(engine.tokenizer, [workload], per_workload)
        for mode, nodes, width, k in (("eagle", 0, 0, 4), ("eagle_tree", 16, 4, 4), ("eagle_tree", 32, 6, 5),
                                      ("eagle_tree", 48, 8, 6), ("draft", 0, 0, 4), ("draft_tree", 16, 4, 4),
                                      ("draft_tree", 32, 6, 5), ("medusa", 0, 0, 4), ("medusa_tree", 16, 4, 4),
                                      ("medusa_tree", 32, 6, 4)):
            engine.policy_config = PolicyConfig(tree_nodes=max(1, nodes))
            for drafter in (engine.loop.target.drafters["eagle"], engine.loop.draft.drafter):
                drafter.tree_width = max(1, width)
            engine.loop.target.drafters["medusa"].width = max(1, width)
            acc = rounds = 0
            for p in prompts:
                r = engine.generate(p.ids, max_tokens=max_tokens, mode=mode, k=k, ignore_eos=True)
                acc, rounds = acc + r.speculation.accepted_tokens, rounds + r.speculation.rounds
            print(f"{workload:<5} {mode:<11} nodes {nodes:3d} width {width} depth {k}: "
                  f"mean accepted length {1 + acc / max(1, rounds):.2f}", flush=True)
    engine.policy_config = PolicyConfig()


def bad_draft(out: str = "/tmp/bad_draft") -> None:
    from specdec.demo import demo_paths
    from specdec.models.draft import load_draft, save_draft

    model = load_draft(demo_paths()["draft"])
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" not in name and p.dim() > 1:
                p.normal_(0, 0.02)
    save_draft(model, Path(out))
    import shutil

    for f in Path(demo_paths()["draft"]).iterdir():
        if f.name.startswith("tokenizer") or f.suffix in (".jinja",) or f.name == "special_tokens_map.json":
            shutil.copy(f, Path(out) / f.name)
    print(out)


if __name__ == "__main__":
    {"generate": generate_table, "bad-draft": bad_draft, "confidence": confidence, "load": load,
     "trees": trees, "packed": packed}[sys.argv[1]]()
