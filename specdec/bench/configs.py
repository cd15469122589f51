"""What the benchmark runs: our loop, transformers' peers, and optionally a server over HTTP.

Every configuration runs on the same prompts, interleaved per prompt and repeat. Names are
short and stable (they key the JSON and the plots): ``off``, ``draft-k4``, ``ngram-k4``,
``draft-adaptive``, ``ngram-adaptive``, ``auto``, ``hf-plain``, ``hf-assisted-default``,
``hf-assisted-constant-k4``, ``hf-assisted-heuristic-k5``, ``hf-lookup-k4``, ``hf-lookup-k10``,
``http-off``, ``http-draft-k4``, ``http-auto``.

transformers' assisted rows are named after the settings transformers reads (from the draft's
generation config, see ``inproc.assistant_settings``):

- ``hf-assisted-default``: nothing set; transformers 5.24's defaults, ``num_assistant_tokens=20``,
  ``num_assistant_tokens_schedule="constant"``, ``assistant_confidence_threshold=0.4`` (drafting
  stops early below it);
- ``hf-assisted-constant-k{k}``: ``num_assistant_tokens=k``, ``"constant"``, threshold 0 (off);
- ``hf-assisted-heuristic-k5``: ``num_assistant_tokens=5``, ``"heuristic_transient"``, threshold 0;
- ``hf-lookup-k{k}``: prompt lookup, ``prompt_lookup_num_tokens=k`` (``max_matching_ngram_size``
  left at its default, 2).

Each row also carries the settings transformers' candidate generator was actually built with
(``transformers_settings``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

# Our speculation modes and how each runs: "fixed" at every --ks value, "adaptive" with the
# engine's k policy choosing k every round (``Engine.generate(k=None)``; ``auto`` is always
# adaptive and may also switch drafter or fall back to plain). A new mode is one line here,
# e.g. ``"early_exit": ("fixed", "adaptive"),``; one the engine cannot serve is skipped.
OUR_MODES: dict[str, tuple[str, ...]] = {
    "draft": ("fixed", "adaptive"),
    "ngram": ("fixed", "adaptive"),
    "early_exit": ("fixed",),
    "eagle": ("fixed", "adaptive"),
    "medusa": ("fixed",),
    "draft_tree": ("fixed", "adaptive"),
    "eagle_tree": ("fixed", "adaptive"),
    "medusa_tree": ("fixed",),
    "auto": ("adaptive",),
}

# Left out of --quick to keep it under 3 minutes (the full run has them). transformers'
# defaults stay: they are what a user of assisted generation gets.
QUICK_SKIP = ("ngram-adaptive", "draft_tree-adaptive", "eagle_tree-adaptive", "hf-assisted-heuristic-k5")

# transformers' prompt lookup default candidate count (PromptLookupCandidateGenerator).
HF_LOOKUP_DEFAULT_TOKENS = 10


@dataclass(frozen=True)
class BenchConfig:
    """One way of generating.

    runner:   "ours" (``Engine.generate``), "hf" (``model.generate``), "http" (a server).
    mode:     ours / http: "off" or a speculation mode; hf: "plain", "assisted" or "lookup".
    k:        draft tokens per round, fixed; None for plain decoding or when ``schedule`` decides;
              hf assisted: ``num_assistant_tokens`` (the start, for "heuristic_transient").
    schedule: "fixed"; ours / http: "adaptive" (the engine's k policy); hf assisted, by
              transformers' ``num_assistant_tokens_schedule`` names: "constant" (k every round,
              confidence stop off), "heuristic_transient" (start at k, +2 after a full accept,
              -1 otherwise, reset per call, confidence stop off) or "default" (nothing set:
              transformers' defaults, 20 tokens, "constant", stop drafting below 0.4 confidence).
    in_process: for an http configuration, the in-process configuration it is compared with.
    """

    name: str
    runner: str
    mode: str
    k: int | None = None
    schedule: str = "fixed"
    in_process: str | None = None

    @property
    def speculative(self) -> bool:
        return self.mode not in ("off", "plain")

    @property
    def needs_draft_model(self) -> bool:
        return self.mode in ("draft", "draft_tree", "assisted")


def _mid(ks: tuple[int, ...]) -> int:
    return sorted(ks)[len(ks) // 2]


def our_name(mode: str, schedule: str, k: int | None) -> str:
    if schedule == "adaptive":
        return mode if mode == "auto" else f"{mode}-adaptive"
    return f"{mode}-k{k}"


def our_configs(ks: tuple[int, ...], modes: dict[str, tuple[str, ...]] = OUR_MODES) -> list[BenchConfig]:
    out = [BenchConfig("off", "ours", "off")]
    for mode, schedules in modes.items():
        if "fixed" in schedules:
            out += [BenchConfig(our_name(mode, "fixed", k), "ours", mode, k) for k in ks]
    for mode, schedules in modes.items():
        if "adaptive" in schedules:
            out.append(BenchConfig(our_name(mode, "adaptive", None), "ours", mode, schedule="adaptive"))
    return out


def hf_configs(ks: tuple[int, ...], *, quick: bool) -> list[BenchConfig]:
    out = [BenchConfig("hf-plain", "hf", "plain")]
    out.append(BenchConfig("hf-assisted-default", "hf", "assisted", schedule="default"))
    out += [BenchConfig(f"hf-assisted-constant-k{k}", "hf", "assisted", k, schedule="constant") for k in ks]
    out.append(BenchConfig("hf-assisted-heuristic-k5", "hf", "assisted", 5, schedule="heuristic_transient"))
    lookup_ks = {HF_LOOKUP_DEFAULT_TOKENS} | (set() if quick else set(ks))  # quick: transformers' default
    out += [BenchConfig(f"hf-lookup-k{k}", "hf", "lookup", k) for k in sorted(lookup_ks)]
    return out


def http_configs(ks: tuple[int, ...], modes: dict[str, tuple[str, ...]] = OUR_MODES) -> list[BenchConfig]:
    """Single-stream HTTP runs of plain decoding and of each mode (fixed at the middle k where
    the mode has a fixed schedule, else adaptive), against their in-process twins."""
    k = _mid(ks)
    out = [BenchConfig("http-off", "http", "off", in_process="off")]
    for mode, schedules in modes.items():
        schedule, kk = ("fixed", k) if "fixed" in schedules else ("adaptive", None)
        name = our_name(mode, schedule, kk)
        out.append(BenchConfig(f"http-{name}", "http", mode, kk, schedule=schedule, in_process=name))
    return out


def build_configs(
    ks: tuple[int, ...], *, quick: bool, http: bool, only: list[str] | None = None
) -> list[BenchConfig]:
    """The configuration list; ``only`` keeps names matching any glob (``off`` always stays)."""
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"--ks needs values >= 1, got {ks}")
    configs = our_configs(ks) + hf_configs(ks, quick=quick) + (http_configs(ks) if http else [])
    if quick:
        configs = [c for c in configs if c.name not in QUICK_SKIP]
    if only:
        configs = [c for c in configs if c.name == "off" or any(fnmatch.fnmatch(c.name, p) for p in only)]
    return configs
