"""How well and how fast a demo draft runs: greedy top-1 agreement with the target's teacher
data, and the time of one cached decode step (the cost ratio c = draft step / target step).
Phase 6 of the demo build; the exit adapters' build times its draft steps the same way."""

from __future__ import annotations

import time

import torch


@torch.no_grad()
def agreement(draft, examples: list[dict]) -> float:
    hit = tot = 0
    for ex in examples:
        out = draft(input_ids=ex["ids"][None], use_cache=False)
        pred = out.logits[0, ex["pos"]].argmax(-1)
        hit += (pred == ex["top_i"][:, 0].long()).sum().item()
        tot += len(ex["pos"])
    return hit / max(1, tot)


@torch.no_grad()
def step_time(model, n_prompt: int = 64, n_steps: int = 24, seed: int = 0, vocab: int = 8000) -> float:
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    vocab = min(vocab, getattr(getattr(model, "config", None), "vocab_size", vocab))
    ids = torch.randint(0, vocab, (1, n_prompt), generator=g)
    times = []
    for rep in range(2):
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(n_steps):
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
            nxt = out.logits[:, -1:].argmax(-1)
    times = sorted(times[n_steps:])
    return sum(times[: len(times) * 3 // 4]) / (len(times) * 3 // 4)


@torch.no_grad()
def eagle_step_time(head, n_prompt: int = 64, n_steps: int = 24, seed: int = 0) -> float:
    """One chained EAGLE draft step (one entry through the head, its cache, the reduced-vocab
    logits), as the step loop runs it for a single row."""
    from specdec.batch.attention import NAME
    from specdec.batch.blocks import blocks_for, run_of
    from specdec.batch.cache import FlatBatchCache, RowPlan, kv_shape

    g = torch.Generator().manual_seed(seed)
    d = head.config.hidden_size
    head.config._attn_implementation = NAME
    tokens = n_prompt + n_steps + 2
    cache = FlatBatchCache(*kv_shape(head.config), blocks_for(tokens) + 1, dtype=head.fc.weight.dtype, device="cpu")
    table = run_of(1, tokens)

    def run(keep: int, feats, ids):
        position_ids, mask = cache.plan([RowPlan(table, keep, ids.shape[1])])
        try:
            return head(feats, ids, position_ids, mask, cache)
        finally:
            cache.unbind()

    times = []
    vocab = min(8000, head.vocab_size)
    try:
        out = run(0, torch.randn(1, n_prompt, d, generator=g), torch.randint(0, vocab, (1, n_prompt), generator=g))
        for i in range(n_steps):
            t = time.perf_counter()
            out = run(n_prompt + i, out[:, -1:], torch.tensor([[int(head.logits(out[0, -1]).argmax())]]))
            times.append(time.perf_counter() - t)
    finally:
        head.config._attn_implementation = "sdpa"  # the head's own default (see EagleHead)
    times = sorted(times)
    return sum(times[: len(times) * 3 // 4]) / (len(times) * 3 // 4)
