"""One generation per call, timed: our engine, and transformers' ``generate`` as the peer.

Both sides ignore EOS so that every run produces exactly ``max_tokens`` tokens (as serving
benchmarks do with ``ignore_eos``): tokens per second then compare like with like.

transformers' runs use the engine's own model objects: outside one of the engine's steps their
attention is SDPA's, with SDPA's mask (``specdec.batch.attention``; without that mask the
peer's multi-token verify passes over a cache were wrong, and its rows with them), and their
linear layers run ``F.linear`` on the plain weights (``specdec.models.packed.stock``), as in
transformers, not the engine's prepacked products. transformers
does not report acceptance, so while
one of its assisted or prompt-lookup runs is in flight the candidate generator it builds is
caught (``record_hf_rounds``): its settings are recorded, and its ``update_candidate_strategy``,
called once after every verification with the round's logits and number of matches, counts
``(drafted, accepted)``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specdec.bench.configs import BenchConfig
from specdec.bench.workloads import Prompt
from specdec.drafters import DRAFTERS
from specdec.models import packed
from specdec.sampling import SamplingParams


@dataclass(frozen=True)
class Round:
    """One speculation round after prefill: draft tokens proposed and kept."""

    drafted: int
    accepted: int
    draft_s: float | None = None
    verify_s: float | None = None
    mode: str | None = None  # the drafter that drafted it ("off": a plain step the policy chose)
    depth: int | None = None  # the most drafts it could accept (a tree: its depth); None: drafted


@dataclass
class RunResult:
    config: str
    prompt: str  # Prompt.key
    workload: str
    repeat: int
    output_ids: list[int] | None  # None where only text came back (http)
    output_tokens: int
    seconds: float
    ttft_s: float | None
    rounds: list[Round] = field(default_factory=list)
    rss_mb: float | None = None
    speculation: dict | None = None  # what a server reported (http)
    policy_summary: dict | None = None  # the speculation controller's summary (adaptive runs)
    hf_settings: dict | None = None  # what transformers ran with (``candidate_settings``, attention)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return max(self.seconds - self.ttft_s, 0.0) / (self.output_tokens - 1)


def rss_mb() -> float | None:
    """This process's resident set size now, in MiB."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            return None


def peak_rss_mb() -> float:
    """The process's peak RSS so far (``ru_maxrss`` is KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(engine, cfg: BenchConfig, prompt: Prompt, max_tokens: int, repeat: int) -> RunResult:
    """One request through ``Engine.generate`` (EOS ignored: the caller clears ``eos_token_ids``).

    A fixed configuration asks for its ``k``; an adaptive one asks for none, which leaves k
    (and, for ``auto``, the drafter and plain fallback) to the engine's policy.
    """
    params = SamplingParams(temperature=prompt.temperature, seed=prompt.seed)
    k = None if cfg.schedule == "adaptive" else cfg.k
    t0 = time.perf_counter()
    out = engine.generate(prompt.ids, max_tokens=max_tokens, params=params, mode=cfg.mode, k=k)
    seconds = time.perf_counter() - t0
    rounds = [
        Round(r.drafted, r.accepted, r.draft_s, r.verify_s, r.mode, r.k if r.mode in DRAFTERS and DRAFTERS[r.mode].trees else None)
        for r in out.rounds if r.mode != "prefill"
    ]
    return RunResult(
        config=cfg.name, prompt=prompt.key, workload=prompt.workload, repeat=repeat,
        output_ids=list(out.token_ids), output_tokens=len(out.token_ids), seconds=seconds,
        ttft_s=out.ttft_s, rounds=rounds, rss_mb=rss_mb(), policy_summary=getattr(out, "policy_summary", None) or None,
    )


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class HfRecording:
    """What ``record_hf_rounds`` saw: the rounds, and each candidate generator's settings."""

    rounds: list[Round] = field(default_factory=list)
    settings: list[dict] = field(default_factory=list)


def candidate_settings(generator, generation_config=None) -> dict:
    """The settings a transformers candidate generator was built with, by transformers' names.

    transformers 5.24 (``candidate_generator.AssistedCandidateGenerator.__init__``) reads
    ``num_assistant_tokens``, ``num_assistant_tokens_schedule`` and
    ``assistant_confidence_threshold`` from a copy of ``assistant_model.generation_config``
    with its global defaults (20, "constant", 0.4) filled in where unset; the main call's
    values of these are not read (its ``assistant_confidence_threshold`` is overwritten with
    the assistant's). The threshold stops a draft early (``ConfidenceCriteria``); it adapts
    between rounds (an ROC fit) only when scikit-learn is importable: ``confidence_threshold_adapts``.
    """
    from transformers.generation import candidate_generator as cg

    out: dict = {"candidate_generator": type(generator).__name__}
    if isinstance(generator, cg.AssistedCandidateGenerator):
        out.update(
            num_assistant_tokens=generator.num_assistant_tokens,
            num_assistant_tokens_schedule=generator.assistant_generation_config.num_assistant_tokens_schedule,
            assistant_confidence_threshold=generator.generation_config.assistant_confidence_threshold,
            confidence_threshold_adapts=hasattr(generator, "probs"),
        )
    elif isinstance(generator, cg.PromptLookupCandidateGenerator):
        out.update(prompt_lookup_num_tokens=generator.num_output_tokens,
                   max_matching_ngram_size=generator.max_matching_ngram_size)
    if generation_config is not None:
        out["eos_token_id"] = generation_config.eos_token_id
    return out


@contextmanager
def record_hf_rounds(mode: str | None = None) -> Iterator[HfRecording]:
    """Record every transformers assisted / prompt-lookup round in the block, and the settings
    of the candidate generator each ``generate`` call built.

    transformers 5.24 ``GenerationMixin._assisted_decoding`` builds one candidate generator
    per call (``_get_candidate_generator``) and, after each verification, calls its
    ``update_candidate_strategy(input_ids, new_logits, n_matches)`` once: ``new_logits`` has
    ``candidate_length + 1`` rows and ``n_matches`` is recomputed after the max-length / EOS
    crop as ``valid_tokens.shape[1] - 1``. The generator caught here gets that method wrapped
    on the instance (nothing on the classes, so a subclass calling ``super()`` counts once).
    Every round, the first (the prompt's prefill, which also verifies a draft) included,
    appends ``n_matches + 1`` tokens, so ``accepted + rounds == new tokens`` exactly. A round
    that drafted nothing (lookup found no match; the draft budget was 0) is a plain step,
    ``Round(0, 0)``. Only for prompt lookup can ``drafted`` exceed what could be kept: its
    candidates are capped at ``max_length``, not ``max_length - 1``, and the crop keeps one
    fewer in the last round.
    """
    from transformers.generation.utils import GenerationMixin

    recording = HfRecording()
    name = "_get_candidate_generator"
    original = vars(GenerationMixin)[name]

    def _get_candidate_generator(self, *args, **kwargs):
        generator = original(self, *args, **kwargs)
        recording.settings.append(candidate_settings(generator, kwargs.get("generation_config")))
        update = generator.update_candidate_strategy

        def update_candidate_strategy(input_ids, scores, num_matches):
            # scores: [batch, candidate_length + 1, vocab]
            recording.rounds.append(Round(drafted=int(scores.shape[1]) - 1, accepted=int(num_matches), mode=mode))
            return update(input_ids, scores, num_matches)

        generator.update_candidate_strategy = update_candidate_strategy
        return generator

    setattr(GenerationMixin, name, _get_candidate_generator)
    try:
        yield recording
    finally:
        setattr(GenerationMixin, name, original)


_ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def assistant_settings(cfg: BenchConfig) -> dict:
    """The draft's generation-config fields to set for one assisted configuration.

    transformers 5.24 reads these from ``assistant_model.generation_config`` only (see
    ``candidate_settings``), so that is where they go. ``default`` sets nothing: transformers'
    defaults apply (``GenerationConfig._get_default_generation_params``: 20 tokens, "constant",
    threshold 0.4), or what the draft's own generation config says. ``constant`` is a fixed k
    with the confidence stop off (0); ``heuristic_transient`` starts at k, +2 after a round
    that kept every draft, -1 otherwise, reset per call, confidence stop off.
    """
    if cfg.schedule == "default":
        return {}
    if cfg.schedule in ("constant", "heuristic_transient"):
        return {"num_assistant_tokens": cfg.k, "num_assistant_tokens_schedule": cfg.schedule,
                "assistant_confidence_threshold": 0.0}
    raise ValueError(f"{cfg.name}: unknown transformers assistant schedule {cfg.schedule!r}")


@contextmanager
def _assistant_config(draft, settings: dict):
    """Set ``settings`` on the draft's generation config; restore every assistant field after
    (transformers' "heuristic" schedule writes its last k back there)."""
    if draft is None:
        yield
        return
    saved = {key: getattr(draft.generation_config, key, None) for key in _ASSISTANT_KEYS}
    for key, value in settings.items():
        setattr(draft.generation_config, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(draft.generation_config, key, value)


def run_hf(
    model, draft, cfg: BenchConfig, prompt: Prompt, max_tokens: int, repeat: int, pad_token_id: int
) -> RunResult:
    """One ``model.generate`` call: plain, assisted by ``draft``, or prompt lookup."""
    ids = torch.tensor([prompt.ids], dtype=torch.long, device=model.device)
    clock = _FirstTokenClock()
    kwargs = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=None,
        eos_token_id=None, pad_token_id=pad_token_id, streamer=clock,
    )
    if prompt.temperature == 0:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(do_sample=True, temperature=prompt.temperature, top_k=0, top_p=1.0)
        torch.manual_seed(prompt.seed)
    settings: dict = {}
    if cfg.mode == "assisted":
        if draft is None:
            raise ValueError(f"{cfg.name}: no draft model")
        kwargs["assistant_model"] = draft
        settings = assistant_settings(cfg)
    elif cfg.mode == "lookup":
        kwargs["prompt_lookup_num_tokens"] = cfg.k
    elif cfg.mode != "plain":
        raise ValueError(f"unknown transformers mode {cfg.mode!r}")
    with torch.inference_mode(), record_hf_rounds(cfg.mode) as recording, _assistant_config(draft, settings), \
            packed.stock():  # transformers as a user runs it: F.linear, not our packed weights
        attention = model.config._attn_implementation
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - t0
    tokens = out[0, ids.shape[1]:].tolist()
    ttft = clock.first_token_at - t0 if clock.first_token_at is not None else None
    if cfg.speculative and len(recording.settings) != 1:
        raise RuntimeError(f"{cfg.name}: expected one transformers candidate generator, saw {len(recording.settings)}")
    hf_settings = dict(recording.settings[0]) if recording.settings else {}
    hf_settings["attn_implementation"] = attention
    return RunResult(
        config=cfg.name, prompt=prompt.key, workload=prompt.workload, repeat=repeat,
        output_ids=tokens, output_tokens=len(tokens), seconds=seconds, ttft_s=ttft,
        rounds=list(recording.rounds) if cfg.speculative else [], rss_mb=rss_mb(), hf_settings=hf_settings,
    )
