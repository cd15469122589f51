"""Verification of a round of draft tokens: greedy matching and exact rejection sampling.

Notation (Leviathan et al. 2023; Chen et al. 2023): ``p`` is the target's distribution, ``q``
the draft's. A round drafts ``k`` tokens ``x_1..x_k``; the target scores ``k + 1`` positions
in one pass, so ``p`` has one more row than ``q``.

- *accepted*: draft token ``x_i`` kept, with probability ``min(1, p_i(x_i) / q_i(x_i))``;
- *recovered*: at the first rejection, a token drawn from ``norm(max(p_i - q_i, 0))``;
- *bonus*: when all ``k`` are accepted, a token drawn from the next distribution ``p_{k+1}``.

Every round therefore emits ``accepted + 1`` tokens. A drafter without a distribution (n-gram)
passes ``q = None``, a point mass on each proposed token: acceptance is then ``p_i(x_i)``
and the residual is ``p_i`` with ``x_i`` removed. The output distribution equals ``p``
exactly, whatever ``q`` is.

Worked example (k = 2, greedy)::

    >>> verify_greedy(torch.tensor([5, 7]), torch.tensor([5, 2, 9]))
    Verdict(tokens=[5, 2], num_accepted=1, num_drafted=2)

The target agreed on 5, preferred 2 over 7 (recovered token 2); 9 is never reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.sampling import draw


@dataclass(frozen=True)
class Verdict:
    """The outcome of one round: ``tokens`` = accepted drafts + one recovered or bonus token.
    ``path``: for a token tree, the accepted nodes' flat indices (a chain's are 0 .. n-1)."""

    tokens: list[int]
    num_accepted: int
    num_drafted: int
    path: tuple[int, ...] | None = field(default=None, repr=False)
    # When asked: per token, (its log-probability, ((id, log-probability) of the most likely, ...))
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = field(default=None, repr=False)

    @property
    def bonus(self) -> bool:
        """True when every draft was accepted and the last token came from ``p_{k+1}``."""
        return self.num_accepted == self.num_drafted


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> Verdict:
    """Accept the longest prefix of drafts that equals the target's argmax, then one more.

    draft_tokens:  [k]     proposed ids
    target_argmax: [k + 1] the target's greedy token at each scored position
    """
    k = draft_tokens.shape[0]
    assert target_argmax.shape == (k + 1,), (draft_tokens.shape, target_argmax.shape)
    mismatch = (draft_tokens != target_argmax[:k]).nonzero()
    n = int(mismatch[0]) if mismatch.numel() else k
    return Verdict(tokens=target_argmax[: n + 1].tolist(), num_accepted=n, num_drafted=k)


def acceptance_probs(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> torch.Tensor:
    """``min(1, p_i(x_i) / q_i(x_i))`` for each draft position.

    draft_tokens: [k]; draft_probs: [k, vocab] or None (point masses); target_probs: [>= k, vocab].
    Returns [k].
    """
    k = draft_tokens.shape[0]
    idx = draft_tokens.unsqueeze(-1)
    p_x = target_probs[:k].gather(-1, idx).squeeze(-1)
    if draft_probs is None:
        return p_x.clamp(max=1.0)
    q_x = draft_probs.gather(-1, idx).squeeze(-1)
    # q_x > 0 whenever x was sampled from q; guard against a drafter that reports q_x = 0.
    return torch.where(q_x > 0, (p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny)).clamp(max=1.0), 1.0)


def residual_distribution(
    target_row: torch.Tensor, draft_row: torch.Tensor | None, draft_token: int
) -> torch.Tensor:
    """``norm(max(p - q, 0))`` for one position; q = None is a point mass on ``draft_token``.

    target_row, draft_row: [vocab]. If the residual has no mass (p == q, where rejection has
    probability 0 and only rounding can get here), fall back to ``p``.
    """
    if draft_row is None:
        residual = target_row.clone()
        residual[draft_token] = 0.0
    else:
        residual = (target_row - draft_row).clamp(min=0.0)
    total = residual.sum()
    if total <= 0:
        return target_row
    return residual / total


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator,
) -> Verdict:
    """Exact rejection sampling over one round.

    draft_tokens: [k]          the drafts
    draft_probs:  [k, vocab]   the q rows they were drawn from, or None (point masses)
    target_probs: [k + 1, vocab] p at each scored position (already temperature/top-k/top-p
                  processed, like q)
    """
    k = draft_tokens.shape[0]
    assert target_probs.dim() == 2 and target_probs.shape[0] == k + 1, target_probs.shape
    assert draft_probs is None or draft_probs.shape == (k, target_probs.shape[1]), (
        None if draft_probs is None else draft_probs.shape
    )
    if k:
        ratio = acceptance_probs(draft_tokens, draft_probs, target_probs)
        u = torch.rand(k, generator=generator, dtype=ratio.dtype)
        rejected = (u >= ratio).nonzero()
        n = int(rejected[0]) if rejected.numel() else k
    else:
        n = 0
    accepted = draft_tokens[:n].tolist()
    if n < k:
        row = residual_distribution(
            target_probs[n], None if draft_probs is None else draft_probs[n], int(draft_tokens[n])
        )
    else:
        row = target_probs[k]
    last = draw(row, generator)
    return Verdict(tokens=accepted + [last], num_accepted=n, num_drafted=k)
