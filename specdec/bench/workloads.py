"""The benchmark's workloads: fixed, seeded prompt sets that stress speculation differently.

- ``chat``: short questions through the tokenizer's chat template, greedy. A draft model's
  home ground; prompt lookup finds little to copy.
- ``code``: the beginning of held-out standard-library files, continued greedily. Drafts
  agree most here; some identifiers repeat.
- ``grounded``: "rewrite this function with renamed variables" over a stdlib function: the
  output largely copies the input, prompt lookup's best case.
- ``sampling``: the chat questions at temperature 1 (seeded): acceptance is probabilistic
  and outputs differ from run to run of different configurations.

Code comes from the stdlib files the demo draft held out of its training set when that split
is importable (``specdec.demo.corpus``), else from a seeded choice of stdlib files.
"""

from __future__ import annotations

import ast
import functools
import logging
import random
import sysconfig
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

WORKLOADS = ("chat", "code", "grounded", "sampling")

CHAT_QUESTIONS = [
    "Why do leaves change colour in autumn?",
    "How does a refrigerator keep food cold?",
    "What should I pack for a three-day hiking trip?",
    "Can you explain what a mortgage is and how interest on it works?",
    "What is the difference between weather and climate?",
    "How do I make a good first impression at a new job?",
    "Why is the sky blue during the day and red at sunset?",
    "What are some tips for writing clear emails?",
    "How does a bicycle stay upright while moving?",
    "What is the difference between a list and a tuple in Python?",
    "How can I improve my sleep schedule?",
    "Explain how a search engine finds web pages.",
    "What causes the seasons on Earth?",
    "How do airplanes fly?",
    "What is a good way to start learning to draw?",
    "Why do we need to drink water every day?",
]

REWRITE_INSTRUCTION = (
    "Rewrite this Python function with clearer, more descriptive variable names. Keep the "
    "logic exactly the same and reply with only the code."
)


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``ids`` for in-process runs, ``text`` for an HTTP server."""

    workload: str
    index: int
    text: str
    ids: list[int]
    temperature: float
    seed: int

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.index}"


@functools.lru_cache(maxsize=4)
def stdlib_code_files(seed: int) -> tuple[tuple[Path, ...], bool]:
    """Stdlib ``.py`` files for code prompts, and whether they are held out of draft training."""
    try:
        from specdec.demo.config import BuildConfig
        from specdec.demo.corpus import split_files, stdlib_files

        demo = BuildConfig()  # the split the default demo build holds out
        files = split_files(stdlib_files(), demo.seed, demo.heldout_file_frac)[1]
        held_out = True
    except Exception as exc:  # the demo builder is optional here
        log.info("demo held-out file split unavailable (%s): choosing stdlib files by seed", exc)
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(
            p for p in root.glob("*.py") if 4_000 <= p.stat().st_size <= 200_000 and not p.name.startswith("_")
        )
        held_out = False
    # Lookup tables (codecs) are data, not code.
    files = [f for f in files if "encodings" not in f.parts]
    random.Random(seed).shuffle(files)
    return tuple(files), held_out


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _functions(source: str, min_lines: int = 6, max_lines: int = 24) -> list[str]:
    """Top-level and method definitions of a module, dedented, within a size range."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            seg = ast.get_source_segment(source, node)
            if seg and min_lines <= seg.count("\n") + 1 <= max_lines:
                out.append(textwrap.dedent(" " * node.col_offset + seg))
    return out


class PromptBuilder:
    """Turns questions and code into prompt ids and text with one tokenizer."""

    def __init__(self, tokenizer, max_prompt_tokens: int):
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def chat(self, user: str) -> tuple[str, list[int]]:
        """(text, ids) of a one-turn chat ready for the assistant's answer."""
        if self.has_chat_template:
            messages = [{"role": "user", "content": user}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            return text, list(ids)
        text = f"Question: {user}\nAnswer:"
        return text, self.encode(text)

    def head(self, source: str) -> tuple[str, list[int]]:
        """The longest run of whole lines from the start of ``source`` within the token budget."""
        ids = self.encode(source[: self.max_prompt_tokens * 8])[: self.max_prompt_tokens + 1]
        text = self.tokenizer.decode(ids[: self.max_prompt_tokens])
        if len(ids) > self.max_prompt_tokens and "\n" in text:
            text = text[: text.rindex("\n") + 1]  # whole lines only
        ids = self.encode(text)
        while len(ids) > self.max_prompt_tokens and "\n" in text[:-1]:  # re-encoding merged differently
            text = text[: text[:-1].rindex("\n") + 1]
            ids = self.encode(text)
        return text, ids


def _questions(n: int, seed: int, offset: int) -> list[str]:
    """``n`` questions from a seeded order, starting at ``offset`` (chat and sampling differ)."""
    questions = list(CHAT_QUESTIONS)
    random.Random(seed).shuffle(questions)
    return [questions[(offset + i) % len(questions)] for i in range(n)]


def _code(b: PromptBuilder, n: int, seed: int) -> list[tuple[str, list[int]]]:
    out = []
    for path in stdlib_code_files(seed)[0]:
        text, ids = b.head(_read(path))
        if len(ids) >= min(32, b.max_prompt_tokens // 2):
            out.append((text, ids))
        if len(out) == n:
            break
    return out


def _grounded(b: PromptBuilder, n: int, seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    out = []
    for path in stdlib_code_files(seed)[0][:60]:
        fits = []
        for fn in sorted(_functions(_read(path)), key=len)[:10]:  # the shortest first
            text, ids = b.chat(f"{REWRITE_INSTRUCTION}\n\n```python\n{fn}\n```")
            if len(ids) > b.max_prompt_tokens:
                break
            fits.append((text, ids))
        if fits:
            out.append(rng.choice(fits))
        if len(out) == n:
            break
    return out


_BUILDERS: dict[str, Callable[[PromptBuilder, int, int], list[tuple[str, list[int]]]]] = {
    "chat": lambda b, n, seed: [b.chat(q) for q in _questions(n, seed, 0)],
    "code": _code,
    "grounded": _grounded,
    "sampling": lambda b, n, seed: [b.chat(q) for q in _questions(n, seed, len(CHAT_QUESTIONS) // 2)],
}
TEMPERATURE = {"chat": 0.0, "code": 0.0, "grounded": 0.0, "sampling": 1.0}


def build_prompts(
    tokenizer, workloads: list[str], per_workload: int, *, max_prompt_tokens: int = 256, seed: int = 0
) -> list[Prompt]:
    """``per_workload`` prompts of each workload, deterministic from ``seed``."""
    unknown = [w for w in workloads if w not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    b = PromptBuilder(tokenizer, max_prompt_tokens)
    prompts = []
    for w_index, name in enumerate(workloads):
        made = _BUILDERS[name](b, per_workload, seed)
        if len(made) < per_workload:
            log.warning("workload %s: only %d of %d prompts fit in %d tokens", name, len(made), per_workload,
                        max_prompt_tokens)
        for i, (text, ids) in enumerate(made):
            prompts.append(
                Prompt(workload=name, index=i, text=text, ids=ids, temperature=TEMPERATURE[name],
                       seed=seed * 1_000 + w_index * 100 + i)
            )
    return prompts
