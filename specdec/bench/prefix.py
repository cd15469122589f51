"""``specdec bench --prefix``: what the paged KV cache buys, with and without prefix caching.

Two measurements on one engine configuration (the demo pair in process unless ``--target``):

- **TTFT with a shared system prompt**: a system prompt of ``--system-tokens`` (2,000) tokens and
  8 different questions, the requests one after another; the first prefills everything, the
  rest find the system prompt's blocks in the prefix cache. Printed per request, with prefix
  caching on and off (off is what every request paid before the cache existed).
- **Requests held at once by a fixed KV budget**: chat requests with ``max_tokens`` unset (the
  server's default, 2,048) all submitted together to a unit of ``--kv-budget`` tokens; each
  runs until it has ~100 tokens of answer (then it is cancelled: the measurement is how many
  the budget holds, not how long answers run). The count held at once is the engine's peak;
  the reservation rule it replaces (prompt + max_tokens + drafts reserved at admission) is
  computed from the same prompts: ``budget // (prompt + max_tokens + k_max + 1)``.
"""

from __future__ import annotations

import statistics
import threading
import time

from specdec.bench.progress import SILENT, Phase
from specdec.bench.workloads import CHAT_QUESTIONS

ANSWER_TOKENS = 100  # what a request writes before the capacity measurement cancels it


def system_prompt(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of instructions: the Python standard library's own prose (the
    docstrings of a few modules), the same text on every machine."""
    import argparse
    import collections
    import json as json_module
    import textwrap as textwrap_module

    parts = [m.__doc__ or "" for m in (argparse, collections, json_module, textwrap_module)]
    parts += [f.__doc__ or "" for f in (argparse.ArgumentParser.add_argument, textwrap_module.wrap,
                                         json_module.dumps, json_module.loads)]
    text = "You are a careful assistant for Python programmers. Follow this reference:\n\n" + "\n\n".join(parts)
    ids = tokenizer(text)["input_ids"]
    while len(ids) < tokens:  # a short standard library: say it again
        text += "\n\n" + text
        ids = tokenizer(text)["input_ids"]
    return tokenizer.decode(ids[:tokens])


def _encode(engine, user: str, system: str | None = None) -> list[int]:
    """A one-turn chat through the tokenizer's template (a plain prompt without one)."""
    if getattr(engine.tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return engine.encode(messages=messages)
    return engine.encode(prompt=(f"{system}\n\n" if system else "") + f"Question: {user}\nAnswer:")


def _first_token_s(engine, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """Seconds from submit to the first event, and the prompt tokens the cache held."""
    t0 = time.perf_counter()
    handle = engine.loop.submit(engine.request(ids, max_tokens=max_tokens, mode="off", ignore_eos=True))
    first, cached = None, 0
    for event in handle:
        if first is None:
            first, cached = time.perf_counter() - t0, event.cached_tokens or 0
    return first, cached


def ttft(engine, system: str, questions: list[str], max_tokens: int = 4) -> list[dict]:
    """One request after another, each the system prompt and its own question."""
    rows = []
    for i, q in enumerate(questions):
        ids = _encode(engine, q, system)
        seconds, cached = _first_token_s(engine, ids, max_tokens)
        rows.append({"request": i + 1, "prompt_tokens": len(ids), "cached_tokens": cached, "ttft_s": seconds})
    return rows


def capacity(engine, questions: list[str], *, default_max_tokens: int = 2048, timeout_s: float = 900) -> dict:
    """All ``questions`` at once with ``max_tokens`` unset; each cancelled at ``ANSWER_TOKENS``."""
    prompts = [_encode(engine, q) for q in questions]
    if engine.max_length:  # a short model: the rest of its context, as a server would default
        default_max_tokens = min(default_max_tokens, engine.max_length - max(len(p) for p in prompts))
    loop = engine.loop
    loop.peak_running, preempted = 0, loop.preempted
    handles = [loop.submit(engine.request(p, max_tokens=default_max_tokens, mode="off")) for p in prompts]
    lengths = [0] * len(handles)

    def drain(i):
        for event in handles[i]:
            lengths[i] += len(event.token_ids)
            if lengths[i] >= ANSWER_TOKENS:
                handles[i].cancel()
                return

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(handles))]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join(timeout=max(1.0, timeout_s - (time.perf_counter() - t0))) for t in threads]
    for h in handles:
        h.cancel()
    budget = loop.blocks.capacity_tokens
    lookahead = loop._lookahead(engine.request(prompts[0], max_tokens=1, mode="auto"))
    reserve = statistics.mean(len(p) for p in prompts) + default_max_tokens + lookahead
    return {"kv_budget_tokens": budget, "requests": len(prompts), "held_at_once": loop.peak_running,
            "held_by_reservation": int(budget // reserve), "preempted": loop.preempted - preempted,
            "mean_answer_tokens": statistics.mean(lengths), "max_tokens": default_max_tokens,
            "seconds": time.perf_counter() - t0}


def run(models: dict, *, system_tokens: int = 2000, requests: int = 8, kv_budget: int = 8192,
        capacity_requests: int = 64, phase: Phase = SILENT) -> dict:
    """TTFT without and with the prefix cache, then the capacity run (``phase`` counts the three)."""
    from specdec.config import ModelConfig
    from specdec.engine import Engine

    out: dict = {"ttft": {}, "capacity": None}
    for caching in (False, True):
        phase.now(f"TTFT, prefix cache {'on' if caching else 'off'}, {system_tokens}-token system prompt")
        engine = Engine.load(ModelConfig(**models), kv_cache_tokens=16384, max_num_seqs=16, prefix_caching=caching)
        system = system_prompt(engine.tokenizer, system_tokens)
        engine.generate(engine.encode(prompt="Hello"), max_tokens=2, mode="off")  # warm-up
        out["ttft"]["on" if caching else "off"] = ttft(engine, system, CHAT_QUESTIONS[:requests])
        engine.loop.close()
        phase.advance()
    phase.now(f"capacity, {capacity_requests} requests in {kv_budget} KV tokens")
    engine = Engine.load(ModelConfig(**models), kv_cache_tokens=kv_budget, max_num_seqs=capacity_requests)
    questions = (CHAT_QUESTIONS * (capacity_requests // len(CHAT_QUESTIONS) + 1))[:capacity_requests]
    out["capacity"] = capacity(engine, questions)
    engine.loop.close()
    phase.advance()
    return out


def table(result: dict) -> str:
    off, on = result["ttft"]["off"], result["ttft"]["on"]
    lines = ["| request | prompt tokens | TTFT, no prefix cache | TTFT, prefix cache | cached tokens |",
             "|---|---|---|---|---|"]
    for a, b in zip(off, on):
        lines.append(f"| {b['request']} | {b['prompt_tokens']} | {1e3 * a['ttft_s']:.0f} ms | "
                     f"{1e3 * b['ttft_s']:.0f} ms | {b['cached_tokens']} |")
    later = [r["ttft_s"] for r in on[1:]]
    if later:
        lines.append(f"\nrequests 2-{len(on)}, prefix cache: TTFT {1e3 * max(later):.0f} ms at most = "
                     f"{max(later) / on[0]['ttft_s']:.1%} of the first's (target <= 15%)")
    c = result["capacity"]
    if c:
        ratio = c["held_at_once"] / max(1, c["held_by_reservation"])
        lines.append(f"\nKV budget {c['kv_budget_tokens']} tokens, {c['requests']} chat requests, max_tokens unset "
                     f"({c['max_tokens']}), answers cut at {ANSWER_TOKENS} tokens (mean {c['mean_answer_tokens']:.0f}):\n"
                     f"  held at once: {c['held_at_once']} (paged) vs {c['held_by_reservation']} "
                     f"(reserving prompt + max_tokens + drafts) = {ratio:.1f}x (target >= 4x); "
                     f"preempted {c['preempted']}; {c['seconds']:.0f} s")
    return "\n".join(lines)
