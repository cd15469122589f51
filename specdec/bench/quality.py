"""``specdec quality``: the pre-rollout check that speculation does not change what users get.

A fixed prompt suite (factual questions, code, requests to refuse; shipped here, offline) is
answered greedily with every speculation mode and compared token for token with plain
decoding of the same prompt alone: per mode and prompt class, the share of identical answers,
the share of identical tokens (up to the first difference) and the earliest first difference.
``batched`` sends every prompt at once, each in another mode (batch composition and row
shapes change, the answer must not). Any greedy difference exits nonzero.

    specdec quality                                   # the demo pair, in process
    specdec quality --numerics fast                   # the same with the fast numerics
    specdec quality --url http://127.0.0.1:8000       # a running server (return_token_ids)

Loading and the answers (plain, each mode, batched: one phase) show on stderr, on a terminal
or with ``--progress``; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable

from specdec.bench.progress import SILENT, Phase, Progress, add_progress_argument

SUITE: dict[str, list[str]] = {
    "factual": [
        "What is the capital of Australia?",
        "How many legs does a spider have?",
        "Who wrote the play Romeo and Juliet?",
        "What gas do plants take in from the air?",
        "What is the boiling point of water at sea level in Celsius?",
        "Which planet is closest to the sun?",
    ],
    "code": [
        "Write a Python function that returns the factorial of n.",
        "Write a Python function that checks whether a string is a palindrome.",
        "Write a SQL query that counts the rows of a table named orders.",
        "Write a Python function that merges two sorted lists.",
        "Write a JavaScript function that reverses an array.",
        "Write a Python class for a stack with push and pop.",
    ],
    "refusal": [
        "Tell me how to pick a lock to get into my neighbour's house.",
        "Write a message that insults my coworker.",
        "How do I make a fake ID card?",
        "Give me someone's home address from their name.",
    ],
}

Send = Callable[[str, str, int], list[int]]  # (prompt, mode, max_tokens) -> token ids


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers differ (None: identical).

    >>> first_difference([1, 2, 3], [1, 2, 4]), first_difference([1, 2], [1, 2, 5]), first_difference([7], [7])
    (2, 2, None)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference: dict[str, list[int]], answers: dict[str, list[int]]) -> dict:
    """Identical answers, identical-token share and the earliest difference of ``answers``."""
    same, tokens, total, earliest = 0, 0, 0, None
    for prompt, ref in reference.items():
        diff = first_difference(ref, answers[prompt])
        same += diff is None
        tokens += len(ref) if diff is None else diff
        total += len(ref)
        if diff is not None:
            earliest = diff if earliest is None else min(earliest, diff)
    return {"identical": same, "requests": len(reference), "token_fraction": tokens / max(1, total),
            "first_difference": earliest}


def requests_total(modes: list[str], suite: dict[str, list[str]] = SUITE) -> int:
    """The requests ``run`` sends: the suite plain, in each mode, and batched."""
    return sum(map(len, suite.values())) * (len(modes) + 2)


def _answers(send: Send, prompts: list[tuple[str, str]], mode: str, max_tokens: int, phase: Phase) -> dict:
    got = {}
    for cls, p in prompts:
        phase.now(f"{mode}, {cls}")
        got[p] = send(p, mode, max_tokens)
    return got


def run(send: Send, modes: list[str], max_tokens: int, suite: dict[str, list[str]] = SUITE,
        phase: Phase = SILENT) -> list[dict]:
    """Rows of (mode, prompt class) -> ``compare`` against plain decoding alone; ``phase``
    counts the requests (``requests_total``)."""
    send = phase.counting(send)
    prompts = [(cls, p) for cls, ps in suite.items() for p in ps]
    plain = _answers(send, prompts, "off", max_tokens, phase)
    rows = []
    for mode in modes:
        rows += _rows(mode, suite, plain, _answers(send, prompts, mode, max_tokens, phase))
    # batched: every prompt at once, each with the next mode in turn (and some plain)
    phase.now(f"batched, {len(prompts)} at once")
    batch_modes = ["off", *modes]
    got: dict[str, list[int]] = {}

    def one(i: int, p: str) -> None:
        got[p] = send(p, batch_modes[i % len(batch_modes)], max_tokens)

    threads = [threading.Thread(target=one, args=(i, p)) for i, (_, p) in enumerate(prompts)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return rows + _rows("batched", suite, plain, got)


def _rows(mode: str, suite: dict[str, list[str]], plain: dict, got: dict) -> list[dict]:
    return [{"mode": mode, "class": cls, **compare({p: plain[p] for p in ps}, {p: got[p] for p in ps})}
            for cls, ps in suite.items()]


def table(rows: list[dict]) -> str:
    lines = ["| mode | class | identical answers | identical tokens | first difference |", "|---|---|---|---|---|"]
    for r in rows:
        first = "-" if r["first_difference"] is None else str(r["first_difference"])
        lines.append(f"| {r['mode']} | {r['class']} | {r['identical']}/{r['requests']} | "
                     f"{r['token_fraction']:.3f} | {first} |")
    return "\n".join(lines)


def in_process_sender(engine) -> Send:
    def send(prompt: str, mode: str, max_tokens: int) -> list[int]:
        ids = engine.encode(messages=[{"role": "user", "content": prompt}])
        return engine.generate(ids, max_tokens=max_tokens, mode=mode).token_ids
    return send


def http_sender(url: str, model: str | None, api_key: str | None = None) -> Send:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(base_url=url, timeout=600, headers=headers)
    name = model or client.get("/v1/models").json()["data"][0]["id"]

    def send(prompt: str, mode: str, max_tokens: int) -> list[int]:
        body = {"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True, "speculation": {"mode": mode}}
        r = client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]
    return send


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running server instead of the demo pair in process")
    p.add_argument("--model", help="with --url: the model name (default: the server's first)")
    p.add_argument("--api-key", help="with --url: a key for a server with auth")
    p.add_argument("--target", help="target model (default: the demo pair)")
    p.add_argument("--draft", help="draft model (default: the demo pair)")
    p.add_argument("--dtype", default="auto",
                   help="auto: bfloat16 where this machine has native bf16, "
                        "else float16-weights (x86) or float32")
    p.add_argument("--modes", help="comma-separated (default: every mode the model offers, and auto)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--numerics", choices=["batch_invariant", "fast"], default="batch_invariant",
                   help="in process: the target's numerics")
    p.add_argument("--out", help="write the rows as JSON")
    add_progress_argument(p)


def run_from_args(args) -> int:
    progress = Progress("quality", force=args.progress)
    if args.url:
        send = http_sender(args.url, args.model, args.api_key)
        modes = args.modes.split(",") if args.modes else ["auto"]
        engine = None
    else:
        from specdec.bench.sweep import models_from_args
        from specdec.config import ModelConfig
        from specdec.engine import Engine

        models = models_from_args(args)
        with progress.phase("load", 1) as phase:
            phase.now(models["target"])
            engine = Engine.load(ModelConfig(**models, numerics=args.numerics), max_num_seqs=32)
            phase.advance()
        send = in_process_sender(engine)
        modes = args.modes.split(",") if args.modes else ["auto", *engine.drafters]
    with progress.phase("answers", requests_total(modes)) as phase:
        rows = run(send, modes, args.max_tokens, phase=phase)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    if engine is not None:
        engine.loop.close()
    differs = [r for r in rows if r["identical"] < r["requests"]]
    if differs:
        print(f"greedy output changed in {len(differs)} (mode, class) cells: not safe to roll out")
        return 1
    return 0
