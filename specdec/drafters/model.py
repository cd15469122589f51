"""``draft``: a smaller causal LM with the target's tokenizer, on its own ``BatchRunner``.

Each step feeds every row what the draft's cache misses (the tokens accepted last round) in
the first batched pass, then one token per row per pass until each row has its ``k``. It runs
in the unit's process or in the DraftWorker; the pool is laid out like the target's.
"""

from __future__ import annotations

import torch

from specdec.batch.runner import BatchRow, BatchRunner
from specdec.drafters.base import Chains, Drafted, DraftRow


class ModelDrafter:
    name = "draft"

    def __init__(self, runner: BatchRunner):
        self.runner = runner

    def propose(self, rows: list[DraftRow]) -> Drafted:
        chains = Chains(rows)
        while live := chains.live():
            batch = [BatchRow(rows[i].key, rows[i].context + chains.tokens[i], 1, rows[i].start, rows[i].capacity)
                     for i in live]
            chains.extend(torch.cat(self.runner.forward(batch)), live)  # [len(live), V]
        return chains.drafted()

    def release(self, key: str) -> None:
        self.runner.release(key)
