"""How often greedy speculation in bf16 differs from plain greedy decoding, and where.

In bf16 a (k+1)-token verify pass and single-token steps round differently, so greedy
speculative output can leave plain greedy output where the target's top two logits nearly
tie. This measures the fraction of identical outputs and, for each divergence, the top-2
logit gap of the plain run at the first differing position.

    python -m specdec.bench.divergence --prompts 16 --max-tokens 64 --mode draft
"""

from __future__ import annotations

import argparse
import json

import torch

from specdec.engine import Engine

NEAR_TIE = 0.25  # logits: two bf16 ulps at the magnitudes (16-32) an LM head produces


def top2_gap(engine: Engine, ids: list[int]) -> float:
    """The gap between the target's two best logits for the token after ``ids``."""
    # A plain forward of the engine's own target model over the full ids (no cache).
    model = engine.target_model
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def greedy_divergence(
    engine: Engine, prompts: list[list[int]], *, mode: str, max_tokens: int, k: int | None = None
) -> dict:
    identical, divergences = 0, []
    for n, ids in enumerate(prompts):
        plain = engine.generate(ids, max_tokens=max_tokens, mode="off").token_ids
        spec = engine.generate(ids, max_tokens=max_tokens, mode=mode, k=k).token_ids
        if plain == spec:
            identical += 1
            continue
        i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
        gap = top2_gap(engine, ids + plain[:i])
        divergences.append({"prompt": n, "position": i, "top2_gap": round(gap, 4)})
    return {
        "mode": mode,
        "prompts": len(prompts),
        "identical": identical,
        "identical_fraction": identical / len(prompts) if prompts else 0.0,
        "near_tie_threshold": NEAR_TIE,
        "divergences": divergences,
        "all_divergences_at_near_ties": all(d["top2_gap"] <= NEAR_TIE for d in divergences),
    }


def main(argv: list[str] | None = None) -> int:
    from specdec.bench.workloads import build_prompts  # the bench's held-out prompts
    from specdec.config import ModelConfig, SpeculationConfig
    from specdec.demo import demo_paths

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="draft")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    paths = demo_paths()
    engine = Engine.load(
        ModelConfig(target=str(paths["target"]), draft=str(paths["draft"]), dtype=args.dtype, draft_dtype="bfloat16"),
        SpeculationConfig(),
    )
    per = -(-args.prompts // 3)
    made = build_prompts(engine.tokenizer, ("chat", "code", "grounded"), per)
    prompts = [p.ids for p in made][: args.prompts]
    print(json.dumps(greedy_divergence(engine, prompts, mode=args.mode, max_tokens=args.max_tokens, k=args.k), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
