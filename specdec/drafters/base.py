"""The one drafter interface: propose for many rows at once, and say what it cost.

A row drafts ``k_i`` tokens; a drafter with a model runs ``max_i k_i`` batched draft steps,
a row leaving once it has its ``k_i`` (or once the drafter is unsure of it). Each row samples
with its own generator seeded from the round's seed, so what a row drafts never depends on
what it is batched with. A drafter without a distribution (prompt lookup) and greedy rows
return ``probs=None``: the verifier treats those drafts as point masses, which keeps sampling
exact. The verifier never asks which drafter it has.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec import trees
from specdec.batch.verify import batched_probs
from specdec.sampling import SamplingParams, make_generator


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one row and the distribution each was drawn from.

    tokens:     [k'] ids, k' <= k; "no proposal" is an empty list, never None.
    probs:      [k', vocab] the processed q rows, or None (point masses: prompt lookup, greedy).
    confidence: [k'] the drafter's probability of each of its own tokens, or () for a drafter
                without a distribution (prompt lookup).
    parents:    None for a chain; for a token tree (``specdec.trees``) [k'] each node's parent
                (-1: a child of the pending token). A tree's candidates are chosen from the
                drafter's own distribution, never drawn from it: it carries ``probs=None`` and
                verification treats every node as a point mass (exact; ``specdec.batch.verify``).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: tuple[float, ...] = ()
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        assert self.probs is None or self.probs.shape[0] == len(self.tokens), (self.probs.shape, len(self.tokens))
        if self.parents is not None:
            assert len(self.parents) == len(self.tokens) and self.probs is None, (self.parents, len(self.tokens))

    @property
    def depth(self) -> int:
        """The longest root path: the most drafts a round can accept."""
        return max(trees.depths(self.parents), default=0) if self.parents is not None else len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_PROPOSAL = Proposal(tokens=[])


@dataclass(frozen=True)
class DraftRow:
    """One row to draft for: ``context`` is the sequence's full ids (its last token not yet
    fed to the target), ``start`` / ``capacity`` its pool range (a drafter with a cache lays
    it out like the target's). ``stop_below``: the row's chain stops once the product of the
    drafter's probabilities of its own tokens so far falls below it (0: draft all ``k``).
    ``nodes``: 0 for a chain of ``k``; else a token tree of at most ``nodes`` nodes and depth ``k``."""

    key: str
    context: list[int]
    k: int
    params: SamplingParams
    seed: int
    start: int = 0
    capacity: int = 0
    stop_below: float = 0.0
    nodes: int = 0


@dataclass
class Drafted:
    """A drafter's proposals for a step (one per row, in order), and what drafting cost:
    ``seconds`` of compute where it ran, over ``steps`` batched draft passes."""

    proposals: list[Proposal]
    seconds: float = 0.0
    steps: int = 0


class BatchDrafter(Protocol):
    """Proposes up to ``row.k`` tokens for every row of one step."""

    name: str

    def propose(self, rows: list[DraftRow]) -> Drafted: ...

    def release(self, key: str) -> None:
        """The sequence finished: drop any state kept for it."""


class Chains:
    """The draft chains of one step being built: each row's tokens, q rows, confidences and
    generator.

    Confidence stop: after each token a row stops when the product of its tokens' confidences
    (the drafter's probability of each token it chose: the chance, as the drafter sees it, that
    the whole chain so far is right) is below the row's ``stop_below``, or when one token's
    confidence is below ``threshold``. The token is still proposed: verifying it costs almost
    nothing; the draft steps after it are saved. The stop reads only the drafter's own
    distribution, so rejection sampling stays exact (a proposal's length may depend on q,
    never on p).
    """

    def __init__(self, rows: list[DraftRow]):
        self.rows = rows
        self.tokens: list[list[int]] = [[] for _ in rows]
        self.qs: list[list[torch.Tensor]] = [[] for _ in rows]
        self.confidence: list[list[float]] = [[] for _ in rows]
        self.reach = [1.0] * len(rows)  # product of each row's confidences so far
        self.gens = [None if r.params.greedy else make_generator(r.seed) for r in rows]
        self.stopped: set[int] = set()
        self.steps = 0
        self.began = time.perf_counter()

    def live(self) -> list[int]:
        """The rows still drafting."""
        return [i for i, r in enumerate(self.rows) if len(self.tokens[i]) < r.k and i not in self.stopped]

    def extend(self, logits: torch.Tensor, live: list[int], threshold: float = 0.0) -> None:
        """Each live row's next draft token from its logits [len(live), V]: greedy or drawn from
        q with the row's generator; then the confidence stop (class docstring)."""
        rows = self.rows
        sampled = [j for j, i in enumerate(live) if not rows[i].params.greedy]
        probs = batched_probs(logits[sampled], [rows[live[j]].params for j in sampled]) if sampled else None
        flat = logits.float()
        top, greedy = flat.max(-1)
        # a greedy token's confidence: its probability under the untempered distribution,
        # exp(max - logsumexp) without a softmax over the vocabulary
        greedy_conf = (top - flat.logsumexp(-1)).exp().tolist()
        greedy = greedy.tolist()
        at = 0
        for j, i in enumerate(live):
            if rows[i].params.greedy:
                token, confidence = greedy[j], greedy_conf[j]
            else:
                q = probs[at]
                at += 1
                token = int(torch.multinomial(q, 1, generator=self.gens[i]))
                self.qs[i].append(q)
                confidence = float(q[token])
            self.tokens[i].append(token)
            self.confidence[i].append(confidence)
            self.reach[i] *= confidence
            if confidence < threshold or self.reach[i] < rows[i].stop_below:
                self.stopped.add(i)  # unsure: let the target speak before drafting further
        self.steps += 1

    def drafted(self) -> Drafted:
        proposals = [Proposal(t, torch.stack(q) if q else None, tuple(c))
                     for t, q, c in zip(self.tokens, self.qs, self.confidence)]
        return Drafted(proposals, time.perf_counter() - self.began, self.steps)
