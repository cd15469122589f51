"""The decoding loop: plain and speculative decoding over one sequence.

A round reads like the paper:

1. draft ``k`` tokens (the drafter, on its own cache);
2. score ``k + 1`` positions in one target pass;
3. accept / reject (``verify``): ``accepted + 1`` tokens come out;
4. roll back the target's cache to the accepted length.

Plain decoding is the same round with ``k = 0``, and prefill is the first such round, so one
code path produces every token. Randomness is derived per round from the request's seed
(``round_seed``), so a seeded request is reproducible and a worker needs no RNG state: a
restarted worker continues the same stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specdec.runner import ModelRunner
from specdec.stats import RoundStats
from specdec.sampling import SamplingParams, logits_to_probs, make_generator
from specdec.verify import Verdict, verify_greedy, verify_sampled

log = logging.getLogger(__name__)

_MASK64 = 0xFFFF_FFFF_FFFF_FFFF
DRAFT_RETRY_ROUNDS = 8  # plain rounds after a drafter failure before drafting again


class DraftUnavailable(RuntimeError):
    """Raised by a Target when the proposal it was handed failed (e.g. the draft worker died)."""
TARGET, DRAFT = 0, 1  # the two consumers of a round's randomness


def round_seed(request_seed: int, round_index: int, role: int) -> int:
    """A 63-bit seed for one round and one role (splitmix64 of the three numbers)."""
    z = (request_seed * 0x9E3779B97F4A7C15 + round_index * 2 + role + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def cut_round(tokens: list[int], remaining: int, stop_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """What a request keeps of a round's tokens, and why it ends (None: it goes on).

    At most ``remaining`` tokens; a stop token (EOS, a stop id) ends the request and is kept.

        >>> cut_round([5, 9, 2, 7], 10, frozenset({2}))
        ([5, 9, 2], 'stop')
        >>> cut_round([5, 9, 2, 7], 2, frozenset({2}))
        ([5, 9], 'length')
    """
    tokens = tokens[:remaining]
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1], "stop"
    return tokens, ("length" if len(tokens) >= remaining else None)


def draft_budget(k: int, remaining: int) -> int:
    """A round emits at most k + 1 tokens: never draft past ``max_tokens``."""
    return max(0, min(k, remaining - 1))


def _pad_vocab(probs: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad [..., v] to [..., width]: ids a model cannot emit have probability 0."""
    extra = width - probs.shape[-1]
    return torch.nn.functional.pad(probs, (0, extra)) if extra > 0 else probs


def verify_round(
    target: ModelRunner,
    seq_id: str,
    context: list[int],
    proposal: Proposal,
    params: SamplingParams,
    seed: int,
) -> Verdict:
    """Score ``context + proposal`` in one target pass, verify, and roll back the cache.

    Runs where ``p`` lives (the target worker). Afterwards the target's cache holds
    ``context`` plus the accepted drafts; the round's last token is not yet fed.
    """
    k = len(proposal)
    logits = target.forward(seq_id, context + proposal.tokens, k + 1)  # [k + 1, vocab]
    drafts = torch.tensor(proposal.tokens, dtype=torch.long)
    if params.greedy:
        verdict = verify_greedy(drafts, logits.argmax(-1))
    else:
        p = logits_to_probs(logits, params)
        q = proposal.probs
        if q is not None and q.shape[-1] != p.shape[-1]:  # e.g. a padded embedding matrix
            width = max(q.shape[-1], p.shape[-1])
            p, q = _pad_vocab(p, width), _pad_vocab(q.to(p.dtype), width)
        verdict = verify_sampled(drafts, q, p, generator=make_generator(seed))
    target.rollback(seq_id, len(context) + verdict.num_accepted)
    return verdict


class Target(Protocol):
    """The verifying side of the loop: in process (``LocalTarget``) or a remote worker."""

    max_length: int | None

    def verify(
        self, seq_id: str, context: list[int], proposal: Proposal, params: SamplingParams, seed: int
    ) -> Verdict: ...

    def release(self, seq_id: str) -> None: ...


class LocalTarget:
    """A target model in this process."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.max_length = runner.max_length

    def verify(
        self, seq_id: str, context: list[int], proposal: Proposal, params: SamplingParams, seed: int
    ) -> Verdict:
        return verify_round(self.runner, seq_id, context, proposal, params, seed)

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)


@dataclass
class Step:
    """Tokens produced by one round, in order, and the round's statistics."""

    tokens: list[int]
    stats: RoundStats
    finish_reason: str | None = None  # "stop" (EOS) or "length" on the last step


# Chooses the draft length of the next round; gets the rounds so far. Fixed k by default.
KPolicy = Callable[[list[RoundStats]], int]


@dataclass
class DecodeRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    seq_id: str = "seq"


def _check(target: Target, request: DecodeRequest) -> None:
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if not request.prompt_ids:
        raise ValueError("the prompt must have at least one token")
    limit = target.max_length
    if limit is not None and len(request.prompt_ids) + request.max_tokens > limit:
        raise ValueError(
            f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) "
            f"exceeds the model's context length ({limit})"
        )


def _draft(drafter, seq_id: str, ids: list[int], k: int, params: SamplingParams, seed: int):
    """1. The drafter's proposal of ``k`` tokens, or none (and why) if it failed."""
    if not k:
        return EMPTY_PROPOSAL, None
    try:
        return drafter.propose(seq_id, ids, k, params, seed), None
    except Exception as exc:  # a draft failure never fails the request
        return EMPTY_PROPOSAL, f"{type(exc).__name__}: {exc}"


def _verify(target: Target, seq_id: str, ids: list[int], proposal: Proposal, params: SamplingParams,
            seed: int, draft_error: str | None):
    """2-4. The target's verdict on ``proposal``; a plain step if the draft never arrived."""
    try:
        return target.verify(seq_id, ids, proposal, params, seed), draft_error
    except DraftUnavailable as exc:  # the draft's result never arrived
        return target.verify(seq_id, ids, EMPTY_PROPOSAL, params, seed), f"{type(exc).__name__}: {exc}"


def decode(
    target: Target,
    drafter: Drafter | None,
    request: DecodeRequest,
    *,
    k: int | KPolicy = 4,
) -> Iterator[Step]:
    """Generate up to ``max_tokens`` tokens, yielding each round's tokens as they come.

    ``drafter=None`` (or ``k=0``) is plain decoding. The last step has ``finish_reason`` set.
    Never drafts past ``max_tokens``: a round near the end drafts fewer tokens.
    """
    _check(target, request)
    choose_k = k if callable(k) else (lambda _rounds, k=k: k)
    params, seq_id = request.params, request.seq_id
    seed = params.seed if params.seed is not None else int(make_generator(None).initial_seed())
    ids = list(request.prompt_ids)
    produced = 0
    draft_retry_at = 0
    rounds: list[RoundStats] = []
    try:
        while True:
            index = len(rounds)
            remaining = request.max_tokens - produced
            # 1. draft k (a round emits at most k + 1 tokens: never draft past max_tokens)
            kk = 0 if (drafter is None or index == 0) else draft_budget(choose_k(rounds), remaining)
            if index < draft_retry_at:
                kk = 0  # the drafter failed recently: plain steps until the retry
            started_at = time.time()
            t0 = time.perf_counter()
            proposal, draft_error = _draft(drafter, seq_id, ids, kk, params, round_seed(seed, index, DRAFT))
            t1 = time.perf_counter()
            # 2-4. score k + 1 positions in one target pass, accept / reject, roll back
            verdict, draft_error = _verify(target, seq_id, ids, proposal, params,
                                           round_seed(seed, index, TARGET), draft_error)
            t2 = time.perf_counter()
            if draft_error:
                log.warning("request %s: drafter failed (%s); plain decoding for now", seq_id, draft_error)
                draft_retry_at = index + DRAFT_RETRY_ROUNDS
            tokens, finish = cut_round(verdict.tokens, remaining, request.eos_token_ids)
            produced += len(tokens)
            ids.extend(tokens)
            mode = "prefill" if index == 0 else ("off" if kk == 0 or draft_error else drafter.name)
            stats = RoundStats(index=index, mode=mode, k=kk, drafted=verdict.num_drafted,
                               accepted=verdict.num_accepted, emitted=len(tokens), draft_s=t1 - t0,
                               verify_s=t2 - t1, started_at=started_at, draft_error=draft_error)
            rounds.append(stats)
            yield Step(tokens=tokens, stats=stats, finish_reason=finish)
            if finish:
                return
    finally:
        target.release(seq_id)
        if drafter is not None:
            drafter.release(seq_id)
