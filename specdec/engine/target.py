"""The target's half of a step: draft what drafts on the target (early exit, EAGLE), then ONE
forward over every row, verify the whole batch, roll back. It runs where ``p`` lives: in the
unit's process (``in_process``) or in the TargetWorker (``actors``), one call per step either way.

1. draft  : rows of a ``"target"`` drafter draft here, on the target's own pool (EAGLE reads
            the features the previous verify pass kept); the others bring their proposals
            (``Row.proposal`` from the loop, ``external`` from the draft side);
2. verify : one target pass over every row: what its cache misses, plus its drafts;
3. accept : ``verify_batch`` over the flattened logits of the emitting rows;
4. roll back each emitting row to its context + accepted drafts (the last token is fed next step);
            a token tree's accepted path is first moved into place (``BatchRunner.accept``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specdec import grammar, trees
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.batch.verify import VerifyRow, verify_batch
from specdec.drafters import DRAFTERS, drafter_of
from specdec.drafters.base import BatchDrafter, Drafted, DraftRow, Proposal
from specdec.engine.plan import Row, StepPlan
from specdec.verify import Verdict

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What the target side did. Per emitting row (plan order): its verdict and its drafts'
    confidences (as many as it drafted). Per drafting mode that ran away from the loop:
    (seconds, draft passes)."""

    verdicts: list[Verdict]
    confidence: list[tuple[float, ...]]
    verify_s: float = 0.0
    draft_costs: dict[str, tuple[float, int]] = field(default_factory=dict)
    draft_errors: dict[str, str] = field(default_factory=dict)  # key -> why its drafter failed (it ran plainly)
    tokens: int = 0  # tokens in the target pass (its cost driver)
    full: list[bool] = field(default_factory=list)  # per emitting row: its drafts ran out unrejected (``leaf``)


def leaf(proposal: Proposal, verdict: Verdict) -> bool:
    """Whether verification ran out of drafts rather than rejecting one: a chain's were all
    accepted; a tree's accepted path ends at a node without children (nothing was left to try
    at the next level). What a policy counts as a round without a rejection."""
    if proposal.parents is None or verdict.path is None:
        return verdict.num_accepted == verdict.num_drafted
    last = verdict.path[-1] if verdict.path else trees.ROOT
    return not trees.children(proposal.parents, last)


def allowed(row: Row, proposal: Proposal, width: int) -> torch.Tensor | None:
    """A structured-output row's grammar masks: bool [1 + drafts, width], row j what the grammar
    allows after the output and the drafts before position j (``specdec.grammar``)."""
    if row.grammar is None:
        return None
    tracker = grammar.tracker()
    state = tracker.state(row.key, row.grammar, row.context[row.prompt_len:])
    return tracker.grammars.tree_allowed(state, proposal.tokens, proposal.parents, width)


def draft_rows(rows: list[Row]) -> list[DraftRow]:
    return [DraftRow(r.key, r.context, r.k, r.params, r.draft_seed, r.blocks, r.stop_below, r.nodes, r.prompt_len,
                     r.grammar, r.price) for r in rows]


@dataclass
class Drafting:
    """What a set of drafters proposed for one step: proposals by row key, (seconds, passes)
    by mode, and why a mode's drafter failed, by row key (those rows run plainly)."""

    proposals: dict[str, Proposal] = field(default_factory=dict)
    costs: dict[str, tuple[float, int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def draft_all(drafters: dict[str, BatchDrafter], plan: StepPlan) -> Drafting:
    """Each drafter drafts its mode's rows of ``plan`` in one call. A draft failure never fails
    a request: its rows get no proposal and say why."""
    out = Drafting()
    for mode in sorted(plan.modes):
        drafter = drafters.get(drafter_of(mode))
        rows = plan.drafting(mode)
        if drafter is None or not rows:
            continue
        try:
            drafted = drafter.propose(draft_rows(rows))
        except Exception as exc:
            log.exception("drafter %s failed", mode)
            out.errors.update(dict.fromkeys((r.key for r in rows), f"{type(exc).__name__}: {exc}"))
            continue
        out.costs[mode] = (drafted.seconds, drafted.steps)
        out.proposals.update({r.key: p for r, p in zip(rows, drafted.proposals)})
    return out


class TargetStep:
    """The verifying side of the step loop, around a ``BatchRunner`` and the drafters that
    live on it (``drafters``: mode -> a ``"target"`` drafter)."""

    def __init__(self, runner: BatchRunner, drafters: dict[str, BatchDrafter] | None = None):
        self.runner = runner
        self.drafters = dict(drafters or {})

    @property
    def max_length(self) -> int | None:
        return self.runner.max_length

    def run(self, plan: StepPlan, external: Drafted | None = None, release: list[str] = ()) -> StepResult:
        """``external``: the draft side's proposals for the rows of its mode(s), in plan order."""
        for key in release:
            self.runner.release(key)
            grammar.release(key)
            for drafter in self.drafters.values():
                drafter.release(key)
        result = StepResult(verdicts=[], confidence=[])
        proposals = self._proposals(plan, external, result)
        emitting = [r for r in plan.rows if r.emits]
        # 2. one pass: every row's missing tokens, and each emitting row's pending token + drafts
        batch = [BatchRow(r.key, r.context + proposals[r.key].tokens, len(proposals[r.key]) + 1, r.blocks,
                          proposals[r.key].parents, shared_upto=r.prompt_len)
                 if r.emits else BatchRow(r.key, r.context, 0, r.blocks, shared_upto=r.prompt_len) for r in plan.rows]
        t0 = time.perf_counter()
        logits = self.runner.forward(batch, on_device=True)  # verified where they are: tokens come back
        result.verify_s = time.perf_counter() - t0
        result.tokens = self.runner.last_fed
        if not emitting:
            return result
        # 3. accept / reject over the flattened rows
        flat = torch.cat([lg for lg, r in zip(logits, plan.rows) if r.emits])
        width = flat.shape[-1]
        verdicts = verify_batch([VerifyRow(proposals[r.key].tokens, r.params, r.target_seed, proposals[r.key].probs,
                                           r.suppress, r.suppress_for, proposals[r.key].parents,
                                           r.context if r.params.penalized else (), r.prompt_len, r.logprobs,
                                           allowed(r, proposals[r.key], width), proposals[r.key].branches)
                                 for r in emitting], flat)
        # 4. roll back: each row keeps its context and accepted drafts (a tree's path moved into place)
        self.runner.accept([(r.key, list(v.path)) for r, v in zip(emitting, verdicts) if v.path is not None])
        for r, v in zip(emitting, verdicts):
            self.runner.truncate(r.key, len(r.context) + v.num_accepted)
        result.verdicts, result.confidence = verdicts, [proposals[r.key].confidence for r in emitting]
        result.full = [leaf(proposals[r.key], v) for r, v in zip(emitting, verdicts)]
        return result

    def score(self, ids: list[int], n: int) -> torch.Tensor:
        """[n, vocab] float32 on the host: the target's logits for each of the last ``n`` tokens
        of ``ids``, given the tokens before it (one plain forward, no cache; the quality guard's)."""
        model = self.runner.model
        with self.runner.lock, torch.inference_mode():
            out = model(input_ids=torch.tensor([ids], device=self.runner.device), use_cache=False,
                        logits_to_keep=n + 1)
        return out.logits[0, :-1].float().cpu()

    def _proposals(self, plan: StepPlan, external: Drafted | None, result: StepResult) -> dict[str, Proposal]:
        """1. Every emitting row's drafts, by key: given, from the draft side, or drafted here."""
        proposals = {r.key: r.proposal for r in plan.rows}
        if external is not None:
            result.draft_costs.update({m: (external.seconds, external.steps) for m in plan.modes
                                       if DRAFTERS[m].where == "draft"})
            rows = [r for r in plan.rows if r.speculates and DRAFTERS[r.mode].where == "draft"]
            proposals.update({r.key: p for r, p in zip(rows, external.proposals)})
        here = draft_all(self.drafters, plan)
        proposals.update(here.proposals)
        result.draft_costs.update(here.costs)
        result.draft_errors.update(here.errors)
        return proposals
