"""Sampling parameters and logits -> probabilities.

Both the target's distribution ``p`` and the draft's ``q`` go through the same
``logits_to_probs`` with the same parameters, so rejection sampling reproduces exactly the
distribution a plain sampler with these parameters would draw from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    min_p: float = 0.0  # drop tokens below min_p times the most likely one's probability (after temperature)
    # Logits processors (``penalize``): they read the sequence so far, so each scored position of a
    # round sees its own history (the drafts before it). The OpenAI API's ranges.
    presence_penalty: float = 0.0  # minus this once for each token the output already holds
    frequency_penalty: float = 0.0  # minus this times how often the output holds it
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits / r, negative * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2 <= getattr(self, name) <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0 < self.repetition_penalty <= 2 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not (-100 <= bias <= 100):
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        # Below MIN_TEMPERATURE, logits / T overflows float32: such a request is greedy (as vLLM).
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether logits processors apply (``penalize``): a token's logit depends on the history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request generator: a seeded request is reproducible."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` [vocab] (non-negative, not all zero; normalised or not) by
    inverse transform sampling: one uniform ``u`` from ``generator``, then the first id whose
    cumulative probability exceeds ``u`` times the total. Exact: id ``i`` comes out with
    probability ``probs[i] / sum(probs)``, and an id of probability 0 never does.

    Why not ``torch.multinomial(probs, 1)``: it draws one exponential per vocabulary entry
    (argmax of ``p / E``): 1.0 ms against 0.08 ms here for 49,152 ids on a 2-core AMD EPYC,
    paid for every sampled token and every sampled draft. And its draws come from the tensor's
    own device: the uniform here always comes from the row's CPU generator, so a seed gives the
    same token wherever ``probs`` lives (the sum is taken in float64 there).

        >>> draw(torch.tensor([0.0, 1.0, 0.0]), torch.Generator().manual_seed(0))
        1
    """
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    i = int(torch.searchsorted(cdf, u.to(cdf.device) * cdf[-1], right=True))
    if i >= cdf.shape[-1]:  # u * total rounded up to the total: the last id that has mass
        i = int((probs > 0).nonzero()[-1])
    return i


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution that ``params`` define.

    logits: [..., vocab] (any float dtype; computed in float32, or float64 if given float64).
    Returns probabilities of the same shape. For greedy params this is the one-hot of the
    argmax, so greedy decoding is the temperature -> 0 limit of the same code path.
    Filtering order follows vLLM: temperature, then min-p, then top-k, then top-p (logits
    processors, ``penalize``, come before all of them).
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype)
    logits = logits / params.temperature
    if params.min_p > 0:
        logits = _min_p(logits, params.min_p)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        flat = logits.reshape(-1, logits.shape[-1])
        top_p = torch.full((flat.shape[0],), params.top_p, dtype=logits.dtype, device=logits.device)
        logits = nucleus(flat, top_p).reshape(logits.shape)
    return logits.softmax(-1)


NUCLEUS_FIRST = 256  # the candidates a top-p row starts from (x4 until they hold its mass)


def nucleus(logits: torch.Tensor, top_p: torch.Tensor, first: int = NUCLEUS_FIRST) -> torch.Tensor:
    """``logits`` [N, V] with every token outside its row's top-p nucleus at -inf (``top_p`` [N];
    a row at 1 is left as it is).

    The nucleus: tokens by descending probability, each kept while the mass strictly before it
    is below ``top_p``; the most likely one always (a ``top_p`` below float32's range is 0).
    It lies among a row's most likely tokens that hold ``top_p`` of its mass, so a partial
    top-k of ``first`` candidates (times 4 until every row's hold enough) decides it: the same
    tokens as sorting the whole vocabulary, without the sort (49,152 ids, one row at top_p 0.9:
    ``batched_probs`` 0.45 against 4.1 ms on a 2-core AMD EPYC with AVX-512 BF16).

        >>> nucleus(torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])), torch.tensor([0.8]), first=2)
        tensor([[-0.6931, -1.6094, -1.8971,    -inf,    -inf]])
    """
    rows = (top_p < 1.0).nonzero()[:, 0]
    if rows.numel() == 0:
        return logits
    sub, p = logits[rows], top_p[rows].to(logits.dtype)[:, None]
    vocab = sub.shape[-1]
    total = sub.logsumexp(-1, keepdim=True)
    k = min(first, vocab)
    while True:
        top, order = torch.topk(sub, k, dim=-1)  # [n, k], most likely first
        probs = (top - total).exp()
        held = probs.cumsum(-1)
        if k == vocab or bool((held[:, -1:] >= p).all()):
            break  # every token past the k has at least top_p of mass before it: dropped
        k = min(vocab, 4 * k)
    drop = (held - probs) >= p
    drop[:, 0] = False
    keep = torch.zeros_like(sub, dtype=torch.bool).scatter(-1, order, ~drop)
    out = logits.clone()
    out[rows] = sub.masked_fill(~keep, -math.inf)
    return out



def _min_p(logits: torch.Tensor, min_p: float | torch.Tensor) -> torch.Tensor:
    """Tokens whose probability is below ``min_p`` times the most likely token's, at -inf:
    ``log p(t) < log p_max + log min_p`` is ``logit(t) < max logit + log min_p``."""
    floor = logits.amax(-1, keepdim=True) + torch.log(torch.as_tensor(min_p, dtype=logits.dtype, device=logits.device))
    return logits.masked_fill(logits < floor, -math.inf)


def penalize(logits: torch.Tensor, params: SamplingParams, history: Sequence[int], prompt_len: int,
             paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """The logits processors of ``params`` at ``n`` scored positions of one sequence: float32 [n, V].

    logits:  [n, V] raw logits, position ``j`` following ``history + paths[j]``
    history: the sequence's ids before the first scored position; its output starts at ``prompt_len``
    paths:   [n] the tokens between ``history`` and each position (a round's drafts before it)

    In vLLM's order: ``logit_bias`` is added; then the repetition penalty (every prompt and output
    token: a positive logit divided by it, a negative one multiplied); then OpenAI's frequency
    and presence penalties over the output's counts. A change of the distribution itself, made
    before sampling or verification: speculation verifies against the penalized ``p`` at each
    position, with that position's own history, so it stays exact.
    """
    n, vocab = logits.shape
    dev = logits.device
    logits = logits.float().clone()
    if params.logit_bias:
        ids = [t for t, _ in params.logit_bias if t < vocab]
        bias = [b for t, b in params.logit_bias if t < vocab]
        if ids:
            logits[:, torch.tensor(ids, device=dev)] += torch.tensor(bias, device=dev)
    if not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0):
        return logits
    counts = torch.zeros(n, vocab, device=dev)
    out = [t for t in history[prompt_len:] if t < vocab]
    if out:
        counts += torch.bincount(torch.tensor(out, device=dev), minlength=vocab)[:vocab].float()
    rows = [j for j, path in enumerate(paths) for t in path if t < vocab]
    if rows:
        cols = [t for path in paths for t in path if t < vocab]
        counts.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.ones(len(rows), device=dev), accumulate=True)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = [t for t in history[:prompt_len] if t < vocab]
        if prompt:
            seen[:, torch.tensor(prompt, device=dev)] = True
        r = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    return logits
