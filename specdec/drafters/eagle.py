"""``eagle``: feature-level drafting on the target's own features, for a whole step at once.

The head (``specdec.models.eagle``) lives with the target: the target's ``BatchRunner`` keeps
every fed token's final hidden state in a feature pool (``keep_features``), so the verify
pass that scores a round also hands the next round the features of its accepted positions,
without an extra target pass. The head keeps its own one-layer KV cache, laid out like the
target's pool (a sequence's entry ``i`` at pool row ``start + i``).

A round for one row, context ``x_0 .. x_{n-1}`` (the target holds ``x_0 .. x_{n-2}``, so its
features ``f_0 .. f_{n-2}`` are known):

1. **Catch up.** Entry ``i`` is ``(f_i, x_{i+1})``. Entries built on true features stay; the
   first one that is not (a changed token, or a prediction from the last round's chain) and
   everything after it is fed again, through entry ``n - 2``, in ONE flat pass over all rows.
   Usually that is the ``accepted + 1`` tokens of the last round. Entry ``n - 2``'s output is
   the predicted ``f_{n-1}``: its logits give draft 1.
2. **Chain.** Entry ``n - 2 + j`` is ``(predicted f_{n-2+j}, d_j)``; its output gives draft
   ``j + 1``. Rows leave once they have their ``k`` (one batched pass per step).
3. **Forget the chain.** Only the true entries are recorded as held: the chain's are
   overwritten next round. Rollback is bookkeeping, as in the target's pool.

A row that asks for a tree (``DraftRow.nodes``, mode ``eagle_tree``) grows one instead of step
2, EAGLE-2 style (``base.Trees``): each level feeds the frontier's entries with tree attention.

Sampling draws each token from the head's processed distribution ``q`` with the row's own
generator; the target verifies with the same exact rejection sampling as for any drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.batch import attention
from specdec.batch.blocks import slots
from specdec.batch.cache import FlatBatchCache, RowPlan, kv_shape
from specdec.batch.runner import BatchRow, BatchRunner, common_prefix_len
from specdec import trees
from specdec.drafters.base import Chains, Drafted, DraftRow, Trees
from specdec.models.eagle import EagleHead


@dataclass
class _Held:
    """What the head's cache holds for one sequence: ``tokens[i]`` = ``x_{i+1}`` of entry ``i``,
    every entry built on the target's true feature."""

    blocks: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)


class EagleDrafter:
    """An EAGLE head drafting on the target's ``BatchRunner`` (shares its pool layout)."""

    name = "eagle"

    def __init__(self, runner: BatchRunner, head: EagleHead, tree_width: int = 6):
        runner.keep_features()
        self.tree_width = tree_width
        self.runner, self.head = runner, head.eval()
        head.config._attn_implementation = attention.NAME  # rows attend to their own entries
        self.dtype = head.fc.weight.dtype
        self.cache = FlatBatchCache(*kv_shape(head.config), runner.num_blocks, dtype=self.dtype, device=runner.device)
        self._held: dict[str, _Held] = {}

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> Drafted:
        runner = self.runner
        todo = [i for i, r in enumerate(rows) if r.k and len(r.context) >= 2]
        # The target must hold each row's context but its last token (it does after the
        # previous verify; after a restart the full model catches up first), so f_0..f_{n-2} exist.
        behind = [BatchRow(rows[i].key, rows[i].context[:-1], 0, rows[i].blocks) for i in todo
                  if runner.cached_ids(rows[i].key) != rows[i].context[:-1]]
        if behind:
            runner.forward(behind)
        chains, grown = Chains(rows), Trees(rows, self.tree_width)
        with runner.lock:
            roots = self._catch_up([rows[i] for i in todo]) if todo else None  # [len(todo), d]
            live = [i for i in todo if not rows[i].nodes]
            features = roots[[j for j, i in enumerate(todo) if not rows[i].nodes]] if live else None
            while live:
                chains.extend(self.head.logits(features), live)  # 1-2. draft
                going = [j for j, i in enumerate(live) if len(chains.tokens[i]) < rows[i].k]
                if not going:
                    break
                live = [live[j] for j in going]
                features = self._chain([rows[i] for i in live], [chains.tokens[i] for i in live], features[going])
            branching = [j for j, i in enumerate(todo) if rows[i].nodes]
            if branching:
                self._grow(rows, [todo[j] for j in branching], roots[branching], grown)
        drafted = chains.drafted()
        for i, tree in enumerate(grown.drafted()):
            if tree is not None:
                drafted.proposals[i] = tree
        drafted.steps = chains.steps + grown.steps  # chains and trees run their own passes here
        return drafted

    def _grow(self, rows: list[DraftRow], live: list[int], roots: torch.Tensor, grown: Trees) -> None:
        """2'. Token trees: the root's logits from the catch-up's prediction, then one pass per
        level over every row's frontier. A node's entry is (its parent's predicted feature, its
        token), in a tree after entry ``n - 2`` (``tree_at = n - 1``), at the position of a chain
        entry of its depth; the next round overwrites them all, as it does a chain's."""
        predicted = [{trees.ROOT: roots[j]} for j in range(len(live))]  # node -> predicted feature
        grown.extend(self.head.logits(roots), live)
        while True:
            alive = set(grown.live())
            branching = [j for j, i in enumerate(live) if i in alive]
            if not branching:
                break
            plans, tokens, inputs, fed = [], [], [], []
            for j in branching:
                row, g = rows[live[j]], grown.grown[live[j]]
                before = len(g.fed)
                node_tokens, parents, new = grown.feed(live[j])
                frontier = list(g.frontier)  # what feed kept of it: the range holds that many more
                n = len(row.context)
                plans.append(RowPlan(row.blocks, n - 1 + before, new, n - 1, parents))
                tokens.extend(node_tokens[before:])
                inputs.extend(predicted[j][g.parents[f]] for f in frontier)
                fed.append((j, frontier))
            out = self._forward(plans, tokens, torch.stack(inputs)[None])  # [frontier nodes, d]
            at = 0
            for j, frontier in fed:
                for f in frontier:
                    predicted[j][f] = out[at]
                    at += 1
            grown.extend(self.head.logits(out), [live[j] for j, _ in fed])

    def _held_for(self, row: DraftRow) -> _Held:
        held = self._held.get(row.key)
        if held is None or row.blocks[: len(held.blocks)] != held.blocks:
            held = self._held[row.key] = _Held(row.blocks)  # new, or moved
        held.blocks = row.blocks
        return held

    def _catch_up(self, rows: list[DraftRow]) -> torch.Tensor:
        """1. Feed each row's entries from its first stale one through ``n - 2``; returns
        the predicted ``f_{n-1}`` of each row [rows, d]."""
        plans, tokens, rows_at = [], [], []
        for r in rows:
            held, n = self._held_for(r), len(r.context)
            keep = min(common_prefix_len(held.tokens, r.context[1:]), n - 2)  # entry n-2 always runs
            del held.tokens[keep:]
            plans.append(RowPlan(r.blocks, keep, n - 1 - keep))
            tokens.extend(r.context[1 + keep:])
            rows_at.append(slots(r.blocks, keep, n - 1))
        features = self.runner.features[torch.cat(rows_at).to(self.runner.device)][None]
        hidden = self._forward(plans, tokens, features)
        for r in rows:
            self._held[r.key].tokens = list(r.context[1:])
        ends = torch.tensor([p.feed for p in plans]).cumsum(0) - 1
        return hidden[ends.to(hidden.device)]

    def _chain(self, rows: list[DraftRow], drafted: list[list[int]], features: torch.Tensor) -> torch.Tensor:
        """2. One entry per row: (its predicted feature, its last draft); returns the next predictions."""
        plans = [RowPlan(r.blocks, len(r.context) - 2 + len(d), 1) for r, d in zip(rows, drafted)]
        return self._forward(plans, [d[-1] for d in drafted], features[None])

    def _forward(self, plans: list[RowPlan], tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """The head over one flat step of ``plans``; [T, d] predicted features."""
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.runner.device)
        position_ids, mask = self.cache.plan(plans)
        try:
            return self.head(features, input_ids, position_ids, mask, self.cache)[0]
        finally:
            self.cache.unbind()

    def release(self, key: str) -> None:
        self._held.pop(key, None)
