"""The demo's code corpus: Python stdlib sources, a fixed held-out file split, token chunks and
function snippets (standard library only; tokenising takes the caller's tokenizer).

The demo build trains on the split's first part; the benchmark's ``code`` workload draws its
prompts from the held-out part. Chat prompts are :mod:`specdec.demo.prompts`.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo")
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(s in rel for s in skip) or any(part.startswith("test") for part in rel):
            continue
        try:
            if 2_000 <= p.stat().st_size <= 400_000:
                out.append(p)
        except OSError:
            pass
    return out


def split_files(files: list[Path], seed: int, frac: float) -> tuple[list[Path], list[Path]]:
    names = sorted(str(f) for f in files)
    rng = random.Random(seed)
    held = set(rng.sample(names, max(2, int(len(names) * frac))))
    return [Path(n) for n in names if n not in held], [Path(n) for n in names if n in held]


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def code_chunks(tok, files: list[Path], n: int, length: int, seed: int) -> list[list[int]]:
    """n chunks of `length` tokens, drawn deterministically (files shuffled, up to 3 chunks/file)."""
    rng = random.Random(seed)
    files = list(files)
    rng.shuffle(files)
    out = []
    for f in files:
        ids = tok(read(f), add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            continue
        starts = list(range(0, len(ids) - length + 1, length))
        rng.shuffle(starts)
        for s in starts[:3]:
            out.append(ids[s:s + length])
            if len(out) >= n:
                return out
    return out


def function_snippets(files: list[Path], seed: int, n: int = 120) -> list[str]:
    rng = random.Random(seed)
    files = list(files)
    rng.shuffle(files)
    out = []
    for f in files:
        src = read(f)
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 18:
                out.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
                break
        if len(out) >= n:
            break
    return out


def file_heads(tok, files: list[Path], n: int, length: int, seed: int) -> list[list[int]]:
    """The first ``length`` tokens of ``n`` files (seeded order; shorter files skipped): prompts
    the target continues, like the benchmark's ``code`` workload does with held-out files."""
    files = list(files)
    random.Random(seed).shuffle(files)
    out = []
    for f in files:
        ids = tok(read(f)[: length * 8], add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            out.append(ids[:length])
            if len(out) >= n:
                break
    return out
