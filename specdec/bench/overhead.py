"""The engine's own cost per step: the step loop against one dense forward of the same rows.

A model with almost no compute (the demo target's depth and vocabulary, hidden size 64,
random weights, fp32) makes every millisecond that is not the model visible: ``B`` plain
requests decode together through ``Engine`` (planning, the ragged pass, verification,
commit, detokenization, events), and each step's time is set against one dense Hugging Face
forward of ``B`` rows x 1 token over a cache of the same length (SDPA, no engine). The ratio
is what the engine adds; on a GPU, where the model is fast, it is most of the step.

    specdec bench --overhead                 # rows 1, 8, 32, 64, the fast numerics
    specdec bench --overhead --rows 1,8 --steps 32 --numerics batch_invariant --repeats 5

Each figure is the median over the decode steps in which all ``B`` rows ran, then over
``--repeats`` (3) turns of engine and dense forward, timed alternately.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from specdec import compute
from specdec.bench.progress import SILENT, Phase

# The demo target's depth, heads and vocabulary, with almost no width.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048)
PROMPT_TOKENS = 64


def tokenizer():
    """The demo tokenizer where it is cached (real detokenization cost), else a tiny one."""
    from specdec.demo import demo_paths

    tok_dir = demo_paths()["tokenizer"]
    if Path(tok_dir).exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tok_dir)
    from specdec.bench.tiny import build_tokenizer, synthetic_corpus

    return build_tokenizer(synthetic_corpus(500))


def build_model(shape: dict = SHAPE, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A random-weight Llama of ``shape`` (the near-zero-compute one by default), its linear
    layers packed as ``load_model`` serves a model (the dense forward runs them too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.packed import pack_linears

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape, eos_token_id=0, bos_token_id=0)).to(dtype)
    model.eval()
    pack_linears(model)
    return model


def engine_for(model, tok, *, max_num_seqs: int, kv_cache_tokens: int, step_tokens: int = 512,
               numerics: str = "fast"):
    """An engine over a model already in memory (no draft model: plain rows and prompt lookup)."""
    from specdec.batch.runner import BatchRunner
    from specdec.config import ModelConfig, SpeculationConfig
    from specdec.engine import Engine
    from specdec.engine.target import TargetStep

    runner = BatchRunner(model, capacity_tokens=kv_cache_tokens, invariant=numerics == "batch_invariant")
    return Engine.from_parts(tok, TargetStep(runner), None, ModelConfig(target="in-memory", numerics=numerics),
                             eos_token_ids=frozenset(), capacity_tokens=runner.capacity,
                             max_length=runner.max_length, speculation=SpeculationConfig(),
                             max_num_seqs=max_num_seqs, step_tokens=step_tokens)


def dense_step_s(model, rows: int, context: int, reps: int) -> float:
    """Median seconds of one plain transformers forward: ``rows`` x 1 token over a cache of
    ``context`` tokens (a DynamicCache, no engine; the engine's attention is SDPA's when no
    step is bound)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (rows, context), generator=gen).to(model.device)
    times = []
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = ids[:, -1:]
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.cpu()  # what the engine does with every step's tokens (and a device sync)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)  # the same context every time
    return statistics.median(times[2:])


def engine_step_s(engine, rows: int, steps: int) -> tuple[float, dict]:
    """Median seconds of a step with ``rows`` plain rows decoding together, and the median
    split of those steps (plan / the target's call / the rest)."""
    gen = torch.Generator().manual_seed(2)
    vocab = min(len(engine.tokenizer), engine.target_model.config.vocab_size)
    prompts = [torch.randint(1, vocab, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(rows)]
    engine.loop.timings.clear()
    with engine.loop.together():  # admitted in one step (threads started one by one were not always)
        handles = [engine.loop.submit(engine.request(p, max_tokens=steps, mode="off", ignore_eos=True))
                   for p in prompts]
    for handle in handles:
        for _ in handle:
            pass
    full = [t for t in engine.loop.timings if t.rows == rows and t.decoding]
    if len(full) < 3:
        raise RuntimeError(f"only {len(full)} steps ran all {rows} rows together")
    full = full[1:]
    split = {"plan": statistics.median(t.plan_s for t in full),
             "target call": statistics.median(t.target_call_s for t in full),
             "forward": statistics.median(t.verify_s for t in full)}
    split["commit"] = statistics.median(t.total_s - t.plan_s - t.target_call_s for t in full)
    return statistics.median(t.total_s for t in full), split


def run(rows_list: list[int], steps: int = 24, threads: int | None = None, numerics: str = "fast",
        repeats: int = 3, phase: Phase = SILENT) -> list[dict]:
    """One result per level of ``rows_list`` (``phase`` counts the levels). Each level times the
    engine and the dense forward in turn ``repeats`` times, side by side, so that a machine's
    drift falls on both: the medians, their ratio, and the range of the paired ratios."""
    if threads:
        compute.set_threads(threads)
    model = compute.run(build_model)
    engine = engine_for(model, tokenizer(), max_num_seqs=max(rows_list), numerics=numerics,
                        kv_cache_tokens=max(rows_list) * (PROMPT_TOKENS + steps + 16) + 64)
    engine.generate(list(range(1, 9)), max_tokens=4, mode="off")  # warm-up
    results = []
    for rows in rows_list:
        phase.now(f"{rows} rows, {steps} steps")
        pairs = []
        for _ in range(max(1, repeats)):
            step, split = engine_step_s(engine, rows, steps)
            dense = compute.run(dense_step_s, model, rows, PROMPT_TOKENS + steps // 2, reps=max(8, steps // 2))
            pairs.append((step, dense, split))
        step = statistics.median(p[0] for p in pairs)
        dense = statistics.median(p[1] for p in pairs)
        split = {k: statistics.median(p[2][k] for p in pairs) for k in pairs[0][2]}
        ratios = [p[0] / p[1] for p in pairs]
        results.append({"rows": rows, "engine_ms": 1e3 * step, "dense_ms": 1e3 * dense, "ratio": step / dense,
                        "ratio_range": [min(ratios), max(ratios)], "repeats": len(pairs),
                        **{f"{k}_ms": 1e3 * v for k, v in split.items()}})
        phase.advance()
    engine.loop.close()
    return results


def table(results: list[dict]) -> str:
    lines = ["| rows | engine ms/step | dense forward ms | engine / dense (paired range) | plan | target call (forward) "
             "| commit |", "|---|---|---|---|---|---|---|"]
    for r in results:
        paired = r.get("ratio_range")  # absent for a single turn (scripts/gpu_costs.py)
        ratio = f"{r['ratio']:.2f}" + (f" ({paired[0]:.2f}-{paired[1]:.2f})" if paired else "")
        lines.append(f"| {r['rows']} | {r['engine_ms']:.1f} | {r['dense_ms']:.1f} | {ratio} | "
                     f"{r['plan_ms']:.2f} | {r['target call_ms']:.1f} ({r['forward_ms']:.1f}) | {r['commit_ms']:.2f} |")
    return "\n".join(lines)
