"""The one drafter interface every speculation mode implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.sampling import SamplingParams


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round and the distribution each was drawn from.

    tokens: [k'] ids, k' <= k; "no proposal" is an empty list, never None.
    probs:  [k', vocab] the processed q rows, or None for a drafter without a distribution
            (n-gram) and for greedy drafts, both of which the verifier treats as point masses.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.probs is None or self.probs.shape[0] == len(self.tokens), (
            self.probs.shape,
            len(self.tokens),
        )

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_PROPOSAL = Proposal(tokens=[])


class Drafter(Protocol):
    """Proposes up to ``k`` tokens to continue ``context`` (the sequence's full ids)."""

    name: str

    def propose(
        self, seq_id: str, context: list[int], k: int, params: SamplingParams, seed: int
    ) -> Proposal: ...

    def release(self, seq_id: str) -> None:
        """The sequence finished: drop any state kept for it."""
