"""Measurements on the demo pair quoted in the issues' closing notes (run on an idle machine).

    python scripts/measure_demo.py generate      # issue 2: off / draft / ngram on 5 held-out prompts
    python scripts/measure_demo.py bad-draft     # issue 4: writes a randomly initialised demo draft
    python scripts/measure_demo.py confidence    # the confidence stop on and off, side by side
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
    {"generate": generate_table, "bad-draft": bad_draft, "confidence": confidence}[sys.argv[1]]()
