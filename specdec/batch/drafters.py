"""Drafters for a whole step: every row of one mode drafts in the same passes.

A row drafts ``k_i`` tokens; rows of one mode go through ``max_i k_i`` batched draft steps,
a row leaving once it has its ``k_i``. Each row samples with its own generator seeded from
``round_seed`` (the same draws, in the same order, as the one-sequence drafters), so what a
row drafts never depends on what it is batched with.

- ``ModelBatchDrafter``: a separate draft model on its own ``BatchRunner`` (the first step
  also catches up whatever the draft's cache misses: the tokens accepted last round).
- ``EarlyExitBatchDrafter``: the target's first ``L`` layers on the TARGET's pool. It writes
  only layers ``0..L-1`` at positions the verify pass rewrites for every layer right after,
  and never moves the runner's record of what each row holds, so no restore is needed.
- ``EagleBatchDrafter`` (``specdec.drafters.eagle``): a one-layer head on the target's features.
- ``propose_ngram``: prompt lookup per row (no model).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.batch.runner import BatchRow, BatchRunner
from specdec.batch.verify import batched_probs
from specdec.drafters.base import EMPTY_PROPOSAL, Proposal
from specdec.drafters.ngram import prompt_lookup
from specdec.sampling import SamplingParams, make_generator


@dataclass(frozen=True)
class DraftRow:
    """One row to draft for: ``context`` is the sequence's full ids (its last token not yet
    fed to the target), ``capacity`` the pool rows the sequence reserved."""

    key: str
    context: list[int]
    k: int
    params: SamplingParams
    seed: int
    start: int = 0
    capacity: int = 0


def propose_ngram(rows: list[DraftRow], min_ngram: int, max_ngram: int) -> list[Proposal]:
    return [Proposal(tokens=prompt_lookup(r.context, r.k, min_ngram, max_ngram)) if r.k else EMPTY_PROPOSAL
            for r in rows]


def choose_tokens(logits: torch.Tensor, rows: list[DraftRow], live: list[int], gens: list, out, qs,
            confidence_needed: bool = False) -> list[float]:
    """Pick each live row's next draft token from its logits [len(live), V]; returns each
    token's probability under q (for a confidence stop; 1.0 for greedy rows unless needed)."""
    sampled = [j for j, i in enumerate(live) if not rows[i].params.greedy]
    probs = batched_probs(logits[sampled], [rows[live[j]].params for j in sampled]) if sampled else None
    greedy_tokens = logits.argmax(-1).tolist()
    confidence = []
    at = 0
    for j, i in enumerate(live):
        if rows[i].params.greedy:
            token = greedy_tokens[j]
            confidence.append(float(torch.softmax(logits[j], -1)[token]) if confidence_needed else 1.0)
        else:
            q = probs[at]
            at += 1
            token = int(torch.multinomial(q, 1, generator=gens[i]))
            qs[i].append(q)
            confidence.append(float(q[token]))
        out[i].append(token)
    return confidence


def proposals_of(out: list[list[int]], qs: list[list[torch.Tensor]]) -> list[Proposal]:
    return [Proposal(tokens=t, probs=torch.stack(q) if q else None) for t, q in zip(out, qs)]


@dataclass
class DraftResult:
    """The draft model's proposals for a step, and what drafting cost where it ran."""

    proposals: list[Proposal]
    seconds: float
    steps: int


class LocalDraft:
    """The draft model's side of a step, in this process."""

    def __init__(self, drafter: "ModelBatchDrafter"):
        self.drafter = drafter

    def propose(self, rows: list[DraftRow], release: list[str] = ()) -> DraftResult:
        for key in release:
            self.drafter.release(key)
        t0 = time.perf_counter()
        proposals = self.drafter.propose_batch(rows)
        return DraftResult(proposals, time.perf_counter() - t0, self.drafter.last_steps)


class ModelBatchDrafter:
    """A separate draft model: batched catch-up, then batched single-token draft steps."""

    name = "draft"

    def __init__(self, runner: BatchRunner):
        self.runner = runner
        self.last_steps = 0

    def propose_batch(self, rows: list[DraftRow]) -> list[Proposal]:
        gens = [None if r.params.greedy else make_generator(r.seed) for r in rows]
        out: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        steps = 0
        while live := [i for i, r in enumerate(rows) if len(out[i]) < r.k]:
            batch = [BatchRow(rows[i].key, rows[i].context + out[i], 1, rows[i].start, rows[i].capacity) for i in live]
            logits = torch.cat(self.runner.forward(batch))  # [len(live), V]
            choose_tokens(logits, rows, live, gens, out, qs)
            steps += 1
        self.last_steps = steps
        return proposals_of(out, qs)

    def release(self, key: str) -> None:
        self.runner.release(key)


class EarlyExitBatchDrafter:
    """Self-speculation on the target's pool: its first layers plus an exit head."""

    name = "early_exit"

    def __init__(self, runner: BatchRunner, stack, head: torch.nn.Module, threshold: float = 0.0):
        self.runner, self.stack, self.head = runner, stack, head.eval()
        self.head_dtype = next(head.parameters()).dtype
        self.threshold = threshold
        self.last_steps = 0

    @torch.inference_mode()
    def propose_batch(self, rows: list[DraftRow]) -> list[Proposal]:
        runner = self.runner
        # The target's cache must hold each row's context but its last token (it does after
        # the previous verify; after a restart the full model catches up first).
        behind = [BatchRow(r.key, r.context[:-1], 0, r.start, r.capacity) for r in rows
                  if r.k and runner.cached_ids(r.key) != r.context[:-1]]
        if behind:
            runner.forward(behind)
        gens = [None if r.params.greedy else make_generator(r.seed) for r in rows]
        out: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        stopped: set[int] = set()
        steps = 0
        with runner.lock:
            while live := [i for i, r in enumerate(rows) if len(out[i]) < r.k and i not in stopped]:
                feeds = [rows[i].context[-1] if not out[i] else out[i][-1] for i in live]
                base = [len(rows[i].context) - 1 + len(out[i]) for i in live]
                hidden = self.stack.hidden_rows(runner, [rows[i].key for i in live], feeds, base)
                logits = self.head(hidden.to(self.head_dtype)).float().cpu()  # [len(live), V]
                confidence = choose_tokens(logits, rows, live, gens, out, qs, self.threshold > 0)
                steps += 1
                for i, conf in zip(live, confidence):
                    if conf < self.threshold:
                        stopped.add(i)  # unsure: let the target speak before drafting further
        self.last_steps = steps
        return proposals_of(out, qs)

    def release(self, key: str) -> None:
        pass  # the cache is the target's: the target releases it

