"""Sampling parameters and logits -> probabilities.

Both the target's distribution ``p`` and the draft's ``q`` go through the same
``logits_to_probs`` with the same parameters, so rejection sampling reproduces exactly the
distribution a plain sampler with these parameters would draw from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` (or below ``MIN_TEMPERATURE``) means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1.0 = no filter
    seed: int | None = None  # None: a non-reproducible seed is drawn

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        # Below MIN_TEMPERATURE, logits / T overflows float32: such a request is greedy (as vLLM).
        return self.temperature < MIN_TEMPERATURE


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request generator: a seeded request is reproducible."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution that ``params`` define.

    logits: [..., vocab] (any float dtype; computed in float32, or float64 if given float64).
    Returns probabilities of the same shape. For greedy params this is the one-hot of the
    argmax, so greedy decoding is the temperature -> 0 limit of the same code path.
    Filtering order follows transformers: temperature, then top-k, then top-p.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most
        # likely token is always kept.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's range compares as 0 >= 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.softmax(-1)

