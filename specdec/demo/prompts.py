"""A fixed, deterministic list of diverse chat prompts (topics x templates) for the demo draft."""

from __future__ import annotations

import random

TOPICS = [
    # science & nature
    "photosynthesis", "black holes", "plate tectonics", "the water cycle", "DNA replication",
    "vaccines", "climate change", "the immune system", "volcanoes", "the speed of light",
    "evolution by natural selection", "antibiotics", "the human heart", "earthquakes", "rainbows",
    "the moon's phases", "nuclear fusion", "magnetism", "bees and pollination", "coral reefs",
    "the periodic table", "gravity", "sleep", "tides", "the solar system",
    # computing
    "a hash table", "binary search", "recursion", "TCP and UDP", "a compiler", "garbage collection",
    "public key cryptography", "git branches", "a database index", "HTTP requests", "machine learning",
    "neural networks", "sorting algorithms", "operating system processes", "cloud computing",
    "unit testing", "regular expressions", "Python decorators", "Python generators", "linked lists",
    "object-oriented programming", "APIs", "caching", "version control", "the Linux command line",
    "JSON", "SQL joins", "multithreading", "big O notation", "Docker containers",
    # everyday life, society, history
    "inflation", "budgeting", "compound interest", "healthy eating", "time management",
    "learning a new language", "public speaking", "the French Revolution", "the Roman Empire",
    "the printing press", "democracy", "the stock market", "renewable energy", "recycling",
    "remote work", "job interviews", "writing a resume", "meditation", "running a marathon",
    "gardening", "baking bread", "coffee brewing", "chess openings", "photography basics",
    "traveling on a budget", "the Olympic Games", "jazz music", "the Renaissance", "social media",
    "electric cars", "bicycles", "airplanes", "the internet", "smartphones", "libraries",
    "volunteering", "friendship", "kindness", "dogs as pets", "houseplants", "the ocean",
    "mountains", "deserts", "rain forests", "the history of writing", "poetry", "museums",
]

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Give a short answer.",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "How would you explain {t} to a ten-year-old?",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "Summarize the key ideas of {t} in a few bullet points.",
    "Why is {t} important?",
    "What are common misconceptions about {t}?",
    "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}, with brief answers.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the words in a text", "merges two sorted lists",
    "removes duplicates from a list while keeping order", "reads a CSV file and sums a column",
    "finds the largest element in a list", "checks whether a string is a palindrome",
    "flattens a nested list", "computes the average of a list of numbers",
    "converts Celsius to Fahrenheit", "sorts a list of dictionaries by a key",
    "counts the vowels in a string", "implements binary search", "returns the GCD of two numbers",
    "validates an email address with a regular expression", "groups words by their first letter",
    "parses a date string and returns the weekday", "computes the median of a list",
    "checks whether two strings are anagrams", "implements a simple stack class",
    "writes a dictionary to a JSON file",
]

CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a Python function that {t}. Add a docstring and an example.",
    "How do I write code in Python that {t}? Explain briefly.",
]

SNIPPET_TEMPLATES = [
    "Explain what this Python function does:\n\n```python\n{s}\n```",
    "Rewrite this function to be more readable:\n\n```python\n{s}\n```",
    "Add type hints and a docstring to this function:\n\n```python\n{s}\n```",
]


def split_topics(seed: int, n_heldout: int = 12) -> tuple[list[str], list[str]]:
    topics = list(TOPICS)
    random.Random(seed).shuffle(topics)
    return topics[n_heldout:], topics[:n_heldout]


def chat_prompts(seed: int, n_train: int, n_heldout: int, snippets: list[str] = (),
                 snippet_frac: float = 0.12, code_frac: float = 0.15) -> tuple[list[str], list[str]]:
    """Deterministic (train, held-out) prompt lists; held-out prompts use held-out topics/tasks."""
    rng = random.Random(seed)
    train_topics, held_topics = split_topics(seed)
    tasks = list(CODE_TASKS)
    rng.shuffle(tasks)
    train_tasks, held_tasks = tasks[4:], tasks[:4]

    def make(topics, code_tasks, n, snips, r):
        general = [tp.format(t=t) for t in topics for tp in TEMPLATES]
        code = [tp.format(t=t) for t in code_tasks for tp in CODE_TEMPLATES]
        snip = [tp.format(s=s) for s in snips for tp in SNIPPET_TEMPLATES]
        r.shuffle(general), r.shuffle(code), r.shuffle(snip)
        n_code = min(len(code), int(n * code_frac))
        n_snip = min(len(snip), int(n * snippet_frac))
        out = code[:n_code] + snip[:n_snip] + general[: n - n_code - n_snip]
        r.shuffle(out)
        return out

    snips = list(snippets)
    n_held_snip = max(1, len(snips) // 8) if snips else 0
    held = make(held_topics, held_tasks, n_heldout, snips[:n_held_snip], random.Random(seed + 1))
    train = make(train_topics, train_tasks, n_train, snips[n_held_snip:], random.Random(seed + 2))
    return train, held
