"""``draft``: a smaller causal LM with the target's tokenizer proposes k tokens."""

from __future__ import annotations

import torch

from specdec.drafters.base import EMPTY_PROPOSAL, Proposal
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, logits_to_probs, make_generator


class ModelDrafter:
    """Autoregressive drafting with its own KV cache per sequence (reconciled every call)."""

    name = "draft"

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(
        self, seq_id: str, context: list[int], k: int, params: SamplingParams, seed: int
    ) -> Proposal:
        if k <= 0:
            return EMPTY_PROPOSAL
        generator = None if params.greedy else make_generator(seed)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        # The first step feeds whatever the cache misses (the last round's accepted tail);
        # each later step feeds the one token just drafted.
        ids = list(context)
        for _ in range(k):
            logits = self.runner.forward(seq_id, ids, 1)[0]  # [vocab]
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = logits_to_probs(logits, params)
                token = int(torch.multinomial(q, 1, generator=generator))
                rows.append(q)
            tokens.append(token)
            ids.append(token)
        return Proposal(tokens=tokens, probs=torch.stack(rows) if rows else None)

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)


def check_same_vocabulary(target_tokenizer, draft_tokenizer) -> None:
    """Refuse a pair whose tokenizers map text to different ids."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            "draft and target tokenizers differ: speculative decoding needs a draft with the "
            f"target's vocabulary (target has {len(target_tokenizer)} tokens, draft has "
            f"{len(draft_tokenizer)})"
        )
