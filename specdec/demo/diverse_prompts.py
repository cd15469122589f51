"""Diverse chat prompts for the EAGLE head's teacher data, beyond the topics x templates set of
:mod:`specdec.demo.prompts` (which the shipped head overfits). Offline and deterministic given
the seed (standard library only; nothing is downloaded).

Sources (``diverse_prompts`` mixes them):

- stdlib: questions from the Python standard library's module names, public function names
  and docstrings (training files only: the held-out files are the code benchmark's);
- instructions: rewrite, summarise, list, compare, explain-code, short answer, step-by-step,
  classify, ... over topics that are not the held-out topics;
- multi-sentence prompts: a persona and a situation, then a request with a constraint;
- self-instruct seeds (``self_instruct_seeds``): the target is asked to write a question about
  a topic; its question (``extract_question``) then becomes a prompt it answers.

Held-out disjointness: no held-out topic (``prompts.split_topics``) or held-out code task is
used, and any prompt equal to a held-out prompt is dropped.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

from .corpus import read
from .prompts import CODE_TASKS, TOPICS, split_topics

# topics absent from prompts.TOPICS: new content, not only new phrasings
NEW_TOPICS = [
    "quantum computing", "the Great Wall of China", "honeybees", "the Silk Road", "origami",
    "weather forecasting", "the Amazon river", "solar panels", "wind turbines", "3D printing",
    "the human brain", "bread yeast", "glaciers", "the printing of money", "elections",
    "the Moon landing", "penguins", "spiders", "mushrooms", "the metric system", "calendars",
    "maps and navigation", "the violin", "opera", "skateboarding", "yoga", "first aid",
    "fermentation", "electricity", "batteries", "semiconductors", "satellites", "Mars",
    "dinosaurs", "the Ice Age", "pyramids", "the Industrial Revolution", "trade and tariffs",
    "supply and demand", "insurance", "mortgages", "taxes", "credit scores", "negotiation",
    "teamwork", "leadership", "procrastination", "habits", "memory", "dreams", "emotions",
    "color theory", "typography", "web design", "spreadsheets", "password security",
    "phishing emails", "data privacy", "open source software", "Wikipedia", "podcasts",
    "board games", "video games", "soccer", "tennis", "swimming", "camping", "hiking safety",
    "composting", "bird migration", "whales", "wolves", "tea", "chocolate", "cheese making",
    "spices", "vegetarian cooking", "food allergies", "vitamins", "exercise", "stress",
    "city planning", "public transport", "bridges", "skyscrapers", "clocks", "the telephone",
    "radio", "television", "film making", "animation", "comic books", "sculpture", "dance",
]

PERSONAS = [
    "high school student", "retired teacher", "software engineer", "nurse", "small business owner",
    "new parent", "university student", "farmer", "journalist", "beginner programmer",
    "data analyst", "chef", "librarian", "museum guide", "travel blogger", "shop manager",
]

SITUATIONS = [
    "I have an exam next week", "I need to give a short talk tomorrow", "my friend asked me about it",
    "I keep getting confused about it", "I want to write a blog post", "I am preparing a lesson",
    "I only have five minutes", "I read an article that made me curious",
    "my manager wants a quick summary", "I am explaining it to my grandmother",
]

CONSTRAINTS = [
    "Keep it under 100 words.", "Use simple language.", "Answer in three sentences.",
    "Use a numbered list.", "Start with a one-line summary.", "Give one concrete example.",
    "Avoid jargon.", "End with a practical tip.",
]

INSTRUCTIONS = [
    "Rewrite the following sentence so it sounds more formal: \"{s}\"",
    "Rewrite this in plain English for a beginner: \"{s}\"",
    "Summarise this in one sentence: \"{s}\"",
    "List four key facts about {t}.",
    "List the steps someone should follow to learn about {t}.",
    "Compare {t} and {u}. What do they have in common?",
    "What is the difference between {t} and {u}?",
    "In one sentence, what is {t}?",
    "Short answer: why do people care about {t}?",
    "Give a step-by-step guide to getting started with {t}.",
    "Describe {t} to someone who has never heard of it.",
    "Write a tweet about {t}.",
    "Write a short email to a colleague recommending a book about {t}.",
    "Is {t} more about science, history, or everyday life? Explain your choice.",
    "Create a quiz question about {t} with four options and the answer.",
    "Tell me a fun fact about {t}.",
    "Pretend you are a tour guide and introduce {t}.",
    "Name three words related to {t} and explain each one.",
    "Suggest a title for an article about {t}, then write its first paragraph.",
    "Correct the grammar in this sentence: \"{s}\"",
    "Turn this statement into a question: \"{s}\"",
    "Can you explain how {t} works, step by step?",
    "Which is older, {t} or {u}? Answer briefly and say why.",
    "Outline a five-minute presentation about {t}.",
]

SENTENCES = [
    "{T} is something that many people find interesting but hard to understand.",
    "People has been studying {t} for a very long time.",
    "I think {t} is important for our future because it affects everyone.",
    "{T} changed the way we live, but not everybody agrees that it was good.",
    "The teacher said that {t} is easier than it looks if you practise every day.",
]

STDLIB_TEMPLATES = [
    "What is the Python `{m}` module used for?",
    "Give a short example of using `{m}.{f}` in Python.",
    "What does the function `{m}.{f}` do? Answer briefly.",
    "Summarise this Python documentation in one sentence:\n\n{d}",
    "Rewrite this docstring in plain, friendly English:\n\n{d}",
    "Explain this description of `{m}.{f}` to a beginner:\n\n{d}",
    "List three things you can do with Python's `{m}` module.",
    "Compare the Python modules `{m}` and `{n}`.",
    "When should I use `{m}.{f}` in my code?",
    "Write a Python snippet that calls `{m}.{f}` and explain the output.",
]

CODE_INSTRUCTIONS = [
    "Explain step by step how to write a Python function that {c}.",
    "Write a JavaScript function that {c}.",
    "What is a common bug when writing a function that {c}?",
    "Write pseudocode for a program that {c}.",
    "Write a unit test for a Python function that {c}.",
]

SELF_INSTRUCT = ("Write one interesting question that a {p} might ask about {t}. "
                 "Reply with the question only.")


def _train_topics(seed: int) -> list[str]:
    held = set(split_topics(seed)[1])
    return [t for t in TOPICS if t not in held] + [t for t in NEW_TOPICS if t not in held]


def _train_code_tasks(seed: int) -> list[str]:
    tasks = list(CODE_TASKS)
    random.Random(seed).shuffle(tasks)  # as prompts.chat_prompts splits them
    return tasks[4:]


def stdlib_entries(files: list[Path], root: Path | None = None, limit: int = 400) -> list[tuple[str, str, str]]:
    """(module, function, first docstring paragraph) of public top-level functions with a
    docstring, in the given (training) files, in file order."""
    out = []
    for f in files:
        mod = _module_name(f, root)
        if mod is None:
            continue
        try:
            tree = ast.parse(read(f))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node) or ""
                para = " ".join(doc.split("\n\n")[0].split())
                if 30 <= len(para) <= 400:
                    out.append((mod, node.name, para))
        if len(out) >= limit:
            break
    return out[:limit]


def _module_name(f: Path, root: Path | None) -> str | None:
    import sysconfig

    root = Path(root or sysconfig.get_paths()["stdlib"])
    try:
        parts = list(f.relative_to(root).with_suffix("").parts)
    except ValueError:
        parts = [f.stem]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") for p in parts):
        return None
    return ".".join(parts)


def diverse_prompts(seed: int, n: int, files: list[Path] = (), heldout: list[str] = (),
                    stdlib_frac: float = 0.3, multi_frac: float = 0.25, code_frac: float = 0.1) -> list[str]:
    """``n`` distinct prompts (deterministic given ``seed`` and ``files``): stdlib questions from
    ``files`` (training files), multi-sentence persona prompts, code instructions and varied
    instructions over non-held-out topics; none equal to a prompt in ``heldout``."""
    rng = random.Random(seed + 101)
    topics, tasks = _train_topics(seed), _train_code_tasks(seed)
    entries = stdlib_entries(sorted(files))
    rng.shuffle(entries)
    mods = sorted({m for m, _, _ in entries})
    banned, out = set(heldout), []

    def add(p: str) -> None:
        if p not in banned:
            banned.add(p)
            out.append(p)

    def topic_prompt() -> str:
        t, u = rng.sample(topics, 2)
        s = rng.choice(SENTENCES).format(t=t, T=t[0].upper() + t[1:])
        return rng.choice(INSTRUCTIONS).format(t=t, u=u, s=s)

    n_std = int(n * stdlib_frac) if entries else 0
    n_multi, n_code = int(n * multi_frac), int(n * code_frac)
    tries = 0
    while len(out) < n_std and tries < 20 * n:
        tries += 1
        m, f, d = entries[tries % len(entries)]
        add(rng.choice(STDLIB_TEMPLATES).format(m=m, f=f, d=d, n=rng.choice(mods)))
    while len(out) < n_std + n_multi and tries < 40 * n:
        tries += 1
        persona, situation = rng.choice(PERSONAS), rng.choice(SITUATIONS)
        request = topic_prompt() if rng.random() < 0.7 else rng.choice(CODE_INSTRUCTIONS).format(c=rng.choice(tasks))
        add(f"I am a {persona} and {situation}. {request} {rng.choice(CONSTRAINTS)}")
    while len(out) < n_std + n_multi + n_code and tries < 60 * n:
        tries += 1
        add(rng.choice(CODE_INSTRUCTIONS).format(c=rng.choice(tasks)))
    while len(out) < n and tries < 100 * n:
        tries += 1
        add(topic_prompt())
    rng.shuffle(out)
    return out


def self_instruct_seeds(seed: int, n: int) -> list[str]:
    """``n`` prompts asking the target for a question about a (non-held-out) topic."""
    rng = random.Random(seed + 202)
    topics = _train_topics(seed)
    pairs = [(p, t) for p in PERSONAS for t in topics]
    rng.shuffle(pairs)
    return [SELF_INSTRUCT.format(p=p, t=t) for p, t in pairs[:n]]


def extract_question(text: str) -> str | None:
    """The target's question from its reply to a self-instruct seed: the first line that ends
    with a question mark (quotes and list markers stripped), or None."""
    for line in text.replace("<|im_end|>", "\n").splitlines():
        line = line.strip().strip("\"'*").strip()
        line = line.lstrip("-0123456789. ").strip()
        if line.lower().startswith("question:"):
            line = line[len("question:"):].strip()
        if 12 <= len(line) <= 300 and line.endswith("?"):
            return line
    return None
