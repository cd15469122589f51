"""``specdec bench --structured``: what structured output costs, per speculation mode.

Each mode answers the same chat prompts (one request at a time, greedy) three ways:

- **free**: no grammar, ``max_tokens`` tokens (EOS ignored);
- **any text**: a grammar that allows any text (the regex ``[\\s\\S]*``; xgrammar does not admit a
  lone byte of a multi-byte character) through the whole mechanism (matchers synced, a mask for
  every scored position, the drafters masked): the same tokens as free wherever the answer's
  characters are whole tokens, so the difference is the mechanism's own cost;
- **JSON schema**: the person schema below; the answer ends when the object closes, so its
  tokens, and how well drafts agree, differ from free.

Printed per mode: output tokens/s of each and their ratio to free, and acceptance.
"""

from __future__ import annotations

import json
import time

from specdec.bench.progress import SILENT, Phase

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4}}}
ASK = "Describe a fictional person as JSON with the keys name, age and hobbies. Topic: {}"
TOPICS = ["a baker in Lyon", "a retired pilot", "a chess teacher", "a marine biologist", "a jazz drummer",
          "a beekeeper", "a lighthouse keeper", "a software tester"]
WAYS = ("free", "any text", "JSON schema")


def _grammars():
    from specdec.grammar import GrammarSpec

    return {"free": None, "any text": GrammarSpec("regex", r"[\s\S]*"),
            "JSON schema": GrammarSpec("json_schema", json.dumps(SCHEMA))}


def _encode(engine, text: str) -> list[int]:
    if getattr(engine.tokenizer, "chat_template", None):
        return engine.encode(messages=[{"role": "user", "content": text}])
    return engine.encode(prompt=text)


def run(models: dict, modes: list[str], *, prompts: int = 4, max_tokens: int = 96, repeats: int = 2,
        phase: Phase = SILENT) -> dict:
    """Every mode x way over ``prompts`` prompts, ``repeats`` times, the ways in a rotating order
    (drift in the machine's speed spreads over all three); ``phase`` counts the runs."""
    from specdec import grammar
    from specdec.config import ModelConfig
    from specdec.engine import Engine

    engine = Engine.load(ModelConfig(**models))
    modes = [m for m in modes if m in ("off", "auto", *engine.drafters)]
    grammars = _grammars()
    asks = [_encode(engine, ASK.format(t)) for t in TOPICS[:prompts]]
    engine.generate(asks[0], max_tokens=8, mode="off", grammar=grammars["JSON schema"])  # warm-up, compile
    masks = grammar.tracker().grammars
    rows = []
    for mode in modes:
        totals = {way: dict.fromkeys(("tokens", "seconds", "drafted", "accepted", "grammar_s"), 0) for way in WAYS}
        for rep in range(repeats):
            for j, ids in enumerate(asks):
                for w in range(len(WAYS)):
                    way = WAYS[(w + j + rep) % len(WAYS)]
                    phase.now(f"{mode}, {way}")
                    before, t0 = masks.seconds, time.perf_counter()
                    out = engine.generate(ids, max_tokens=max_tokens, mode=mode, grammar=grammars[way],
                                          ignore_eos=way != "JSON schema")
                    t = totals[way]
                    t["seconds"] += time.perf_counter() - t0
                    t["grammar_s"] += masks.seconds - before
                    t["tokens"] += len(out.token_ids)
                    t["drafted"] += out.speculation.drafted_tokens
                    t["accepted"] += out.speculation.accepted_tokens
                    phase.advance()
        row = {"mode": mode}
        for way, t in totals.items():
            row[way] = {**t, "tokens_per_s": t["tokens"] / t["seconds"],
                        "grammar_ms_per_token": 1e3 * t["grammar_s"] / t["tokens"],
                        "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else None}
        rows.append(row)
    engine.loop.close()
    return {"rows": rows, "prompts": len(asks), "repeats": repeats, "max_tokens": max_tokens, "schema": SCHEMA}


def table(result: dict) -> str:
    lines = ["| mode | free tok/s | any text tok/s | ratio | JSON schema tok/s | ratio | grammar ms / token (any, JSON) "
             "| acceptance free / any / JSON |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        free = r["free"]["tokens_per_s"]

        def acc(way: str) -> str:
            a = r[way]["acceptance"]
            return "-" if a is None else f"{a:.2f}"

        lines.append(f"| {r['mode']} | {free:.1f} | {r['any text']['tokens_per_s']:.1f} | "
                     f"{r['any text']['tokens_per_s'] / free:.2f} | {r['JSON schema']['tokens_per_s']:.1f} | "
                     f"{r['JSON schema']['tokens_per_s'] / free:.2f} | {r['any text']['grammar_ms_per_token']:.2f}, "
                     f"{r['JSON schema']['grammar_ms_per_token']:.2f} | "
                     f"{acc('free')} / {acc('any text')} / {acc('JSON schema')} |")
    lines.append(f"\n{result['prompts']} prompts x {result['repeats']}, greedy, one request at a time, up to "
                 f"{result['max_tokens']} tokens; any text: a grammar allowing any text (the mechanism's own cost); "
                 "grammar ms: time in matchers and masks per output token; target: ratio >= 0.90")
    return "\n".join(lines)
