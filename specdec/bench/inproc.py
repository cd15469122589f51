"""One generation per call, timed: our engine, and transformers' ``generate`` as the peer.

Both sides ignore EOS so that every run produces exactly ``max_tokens`` tokens (as serving
benchmarks do with ``ignore_eos``): tokens per second then compare like with like.

transformers' runs use the engine's own model objects, switched to SDPA for the call
(``transformers_attention``: the engine's attention gets no mask from transformers, which
breaks multi-token forwards over a cache).

transformers does not report acceptance, so while one of its assisted runs is in flight the
``update_candidate_strategy`` hook every candidate generator gets after each round (with the
round's scores and number of matches) is wrapped to record ``(drafted, accepted)``.
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
from specdec.sampling import SamplingParams


@dataclass(frozen=True)
class Round:
    """One speculation round after prefill: draft tokens proposed and kept."""

    drafted: int
    accepted: int
    draft_s: float | None = None
    verify_s: float | None = None
    mode: str | None = None  # the drafter that drafted it ("off": a plain step the policy chose)


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
        Round(r.drafted, r.accepted, r.draft_s, r.verify_s, r.mode) for r in out.rounds if r.mode != "prefill"
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


@contextmanager
def record_hf_rounds(mode: str | None = None) -> Iterator[list[Round]]:
    """Record ``(drafted, accepted)`` of every transformers assisted round in the block."""
    from transformers.generation import candidate_generator as cg

    rounds: list[Round] = []
    hook = "update_candidate_strategy"
    originals = {c: vars(c)[hook] for c in (cg.CandidateGenerator, cg.AssistedCandidateGenerator) if hook in vars(c)}

    def wrap(original):
        def update_candidate_strategy(self, input_ids, scores, num_matches):
            # scores: [batch, candidates + 1, vocab]
            rounds.append(Round(drafted=int(scores.shape[1]) - 1, accepted=int(num_matches), mode=mode))
            return original(self, input_ids, scores, num_matches)

        return update_candidate_strategy

    for cls, original in originals.items():
        setattr(cls, "update_candidate_strategy", wrap(original))
    try:
        yield rounds
    finally:
        for cls, original in originals.items():
            setattr(cls, "update_candidate_strategy", original)


_ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def assistant_settings(cfg: BenchConfig) -> dict:
    """The draft's generation-config fields transformers reads for one assisted configuration.

    transformers 5.24 takes these from ``assistant_model.generation_config`` (not from the
    ``generate`` call): a fixed k is ``constant`` with the confidence stop disabled (0).
    """
    if cfg.schedule == "default":
        from transformers import GenerationConfig

        defaults = GenerationConfig._get_default_generation_params()
        return {key: defaults[key] for key in _ASSISTANT_KEYS}
    if cfg.schedule == "heuristic":
        return {"num_assistant_tokens": cfg.k, "num_assistant_tokens_schedule": "heuristic_transient",
                "assistant_confidence_threshold": 0.0}
    return {"num_assistant_tokens": cfg.k, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}


@contextmanager
def _assistant_config(draft, settings: dict):
    saved = {key: getattr(draft.generation_config, key, None) for key in settings}
    for key, value in settings.items():
        setattr(draft.generation_config, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(draft.generation_config, key, value)


@contextmanager
def transformers_attention(*models):
    """Run ``generate`` on the engine's models with an attention transformers builds masks for.

    The engine's ``BatchRunner`` sets ``config._attn_implementation = "specdec_ragged"``,
    which outside one of its steps falls through to SDPA. transformers 5.24 builds no mask for
    an implementation that has no mask function (``masking_utils._preprocess_mask_arguments``:
    ``if config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
    return True, None, ...``), and SDPA without a mask and with more than one query runs
    ``is_causal=True`` (``integrations/sdpa_attention.py``), which torch aligns top-left: over
    a cache, query i sees keys 0..i only. Prefill (as many queries as keys) and one-token
    steps come out right, so plain ``generate`` does; assisted and prompt-lookup verification
    (``candidate_length + 1`` queries over the cache) and the assistant's first forward of a
    round do not. Such models run as "sdpa" for the block (restored after).
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    saved = []
    for model in models:
        if model is None:
            continue
        config = model.config
        if config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            saved.append((config, config._attn_implementation))
            config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        for config, implementation in reversed(saved):
            config._attn_implementation = implementation


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
    with torch.inference_mode(), record_hf_rounds(cfg.mode) as rounds, _assistant_config(draft, settings), \
            transformers_attention(model, draft if cfg.mode == "assisted" else None):
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - t0
    tokens = out[0, ids.shape[1]:].tolist()
    ttft = clock.first_token_at - t0 if clock.first_token_at is not None else None
    return RunResult(
        config=cfg.name, prompt=prompt.key, workload=prompt.workload, repeat=repeat,
        output_ids=tokens, output_tokens=len(tokens), seconds=seconds, ttft_s=ttft,
        rounds=list(rounds) if cfg.speculative else [], rss_mb=rss_mb(),
    )
