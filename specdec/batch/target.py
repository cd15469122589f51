"""The target's half of a step: draft what drafts on the target (early exit, EAGLE), then ONE
forward over every row, verify the whole batch, roll back. It runs where ``p`` lives: in the
unit's process (``in_process``) or in the TargetWorker (``actors``), one call per step either way.

1. draft  : rows drafting with ``early_exit`` or ``eagle`` do so here, on the target's own pool
            (EAGLE reads the features the previous verify pass kept);
2. verify : one target pass: prefill chunks, and each decode row's pending token + drafts;
3. accept : ``verify_batch`` over the flattened logits;
4. roll back each decode row to its context + accepted drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.batch.drafters import DraftResult, DraftRow
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.batch.verify import VerifyRow, verify_batch
from specdec.drafters.base import EMPTY_PROPOSAL, Proposal
from specdec.sampling import SamplingParams
from specdec.verify import Verdict


@dataclass(frozen=True)
class TargetRow:
    """A decode row. ``source``: where its drafts come from: ``"given"`` (``proposal``, e.g.
    prompt lookup, or none), ``"external"`` (the next of the draft worker's proposals, in
    order), or ``"early_exit"`` / ``"eagle"`` (drafted here, ``k`` tokens, with ``draft_seed``)."""

    key: str
    context: list[int]
    params: SamplingParams
    seed: int  # the target's round seed
    start: int  # the sequence's pool range
    capacity: int
    source: str = "given"
    proposal: Proposal = EMPTY_PROPOSAL
    k: int = 0
    draft_seed: int = 0
    suppress: tuple[int, ...] = ()  # min_tokens: ids the target may not emit ...
    suppress_for: int = 0  # ... at this round's first positions


@dataclass
class StepResult:
    verdicts: list[Verdict | None]  # per decode row; None: its external draft failed (re-run plain)
    proposals: list[Proposal]  # what each decode row drafted (for its statistics)
    verify_s: float = 0.0
    draft_s: dict[str, float] = field(default_factory=dict)  # drafting done here, per mode
    draft_steps: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # tokens in the target pass


class TargetStep:
    """The verifying side of the step loop, around a ``BatchRunner``."""

    def __init__(self, runner: BatchRunner, early_exit=None, eagle=None):
        self.runner = runner
        self.early_exit = early_exit  # an EarlyExitBatchDrafter on this runner, or None
        self.eagle = eagle  # an EagleBatchDrafter on this runner, or None

    @property
    def local_drafters(self) -> dict:
        """The drafters that run here, on the target's pool, by mode."""
        return {mode: d for mode, d in (("early_exit", self.early_exit), ("eagle", self.eagle)) if d is not None}

    @property
    def max_length(self) -> int | None:
        return self.runner.max_length

    def run(self, rows: list[TargetRow], chunks: list[BatchRow], external: DraftResult | None = None,
            release: list[str] = ()) -> StepResult:
        """``external``: the draft model's result for the ``"external"`` rows, in order."""
        for key in release:
            self.runner.release(key)
            for drafter in self.local_drafters.values():
                drafter.release(key)
        result = StepResult(verdicts=[None] * len(rows), proposals=[EMPTY_PROPOSAL] * len(rows))
        if external is not None:
            result.draft_s["draft"], result.draft_steps["draft"] = external.seconds, external.steps
        proposals = self._proposals(rows, external.proposals if external else [], result)
        # 2. one pass: prefill chunks and every decode row's pending token + drafts
        batch = list(chunks) + [
            BatchRow(r.key, r.context + p.tokens, len(p) + 1, r.start, r.capacity) for r, p in zip(rows, proposals)
        ]
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        result.verify_s = time.perf_counter() - t0
        result.tokens = self.runner.last_fed
        if not rows:
            return result
        # 3. accept / reject over the flattened rows
        flat = torch.cat(logits[len(chunks):])
        verify_rows = [VerifyRow(p.tokens, r.params, r.seed, p.probs, r.suppress, r.suppress_for)
                       for r, p in zip(rows, proposals)]
        verdicts = verify_batch(verify_rows, flat)
        # 4. roll back: each row keeps its context and accepted drafts (the last token is fed next step)
        for r, v in zip(rows, verdicts):
            self.runner.truncate(r.key, len(r.context) + v.num_accepted)
        result.verdicts, result.proposals = verdicts, proposals
        return result

    def _proposals(self, rows: list[TargetRow], external: list[Proposal], result: StepResult) -> list[Proposal]:
        """1. Every decode row's drafts: given, from the draft worker, or drafted here."""
        proposals = [r.proposal if r.source == "given" else EMPTY_PROPOSAL for r in rows]
        ext = iter(external)
        for i, r in enumerate(rows):
            if r.source == "external":
                proposals[i] = next(ext, EMPTY_PROPOSAL)
        for mode, drafter in self.local_drafters.items():
            mine = [i for i, r in enumerate(rows) if r.source == mode and r.k]
            if not mine:
                continue
            t0 = time.perf_counter()
            drafted = drafter.propose_batch(
                [DraftRow(rows[i].key, rows[i].context, rows[i].k, rows[i].params, rows[i].draft_seed,
                          rows[i].start, rows[i].capacity) for i in mine]
            )
            result.draft_s[mode] = time.perf_counter() - t0
            result.draft_steps[mode] = drafter.last_steps
            for i, p in zip(mine, drafted):
                proposals[i] = p
        return proposals
