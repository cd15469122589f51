"""``draft``: a smaller causal LM with the target's tokenizer, on its own ``BatchRunner``.

Each step feeds every row what the draft's cache misses (the tokens accepted last round) in
the first batched pass, then one token per row per pass until each row has its ``k``. A row
that asks for a tree (``DraftRow.nodes``, mode ``draft_tree``) feeds its tree's frontier each
pass instead (``base.Trees``; the draft's cache holds the tree with tree attention, and the
next round keeps the path the target took through it). Chains and trees share the passes. It
runs in the unit's process or in the DraftWorker; the pool is laid out like the target's.
"""

from __future__ import annotations

import torch

from specdec.batch.runner import BatchRow, BatchRunner
from specdec.drafters.base import Chains, Drafted, DraftRow, Trees


class ModelDrafter:
    name = "draft"

    def __init__(self, runner: BatchRunner, tree_width: int = 6):
        self.runner = runner
        self.tree_width = tree_width

    def propose(self, rows: list[DraftRow]) -> Drafted:
        chains, grown = Chains(rows), Trees(rows, self.tree_width)
        chains.stopped.update(i for i, r in enumerate(rows) if r.nodes > 0)
        passes = 0
        while True:
            live, branching = chains.live(), grown.live()
            if not (live or branching):
                break
            batch = [BatchRow(rows[i].key, rows[i].context + chains.tokens[i], 1, rows[i].blocks)
                     for i in live]
            for i in branching:
                tokens, parents, new = grown.feed(i)
                batch.append(BatchRow(rows[i].key, rows[i].context + tokens, new, rows[i].blocks, parents))
            logits = torch.cat(self.runner.forward(batch))  # [len(live) + frontier nodes, V]
            passes += 1
            if live:
                chains.extend(logits[: len(live)], live)
            if branching:
                grown.extend(logits[len(live):], branching)
        drafted = chains.drafted()
        for i, tree in enumerate(grown.drafted()):
            if tree is not None:
                drafted.proposals[i] = tree
        drafted.steps = passes  # one batched pass serves chains and trees alike
        return drafted

    def release(self, key: str) -> None:
        self.runner.release(key)
