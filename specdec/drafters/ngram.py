"""``ngram``: prompt lookup decoding (Saxena 2023). No model: the request's own tokens draft.

The last ``n`` tokens of the sequence are searched for earlier in the sequence, longest
``n`` first (``max_ngram`` down to ``min_ngram``); the tokens that followed the most recent
earlier match are proposed. The proposal has no distribution (``probs=None``): the verifier
treats it as a point mass, which keeps sampling exact.

Worked example (min_ngram=1, max_ngram=2, k=3)::

    context  = [7, 1, 2, 3, 4, 9, 1, 2]
    suffix [1, 2] occurred at position 1 -> propose what followed it: [3, 4, 9]
"""

from __future__ import annotations

import time

import numpy as np

from specdec.drafters.base import EMPTY_PROPOSAL, Drafted, DraftRow, Proposal


def prompt_lookup(context: list[int], k: int, min_ngram: int = 1, max_ngram: int = 4) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's suffix."""
    seq = np.asarray(context, dtype=np.int64)
    n_ctx = seq.shape[0]
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = seq[n_ctx - n :]
        # Windows starting at 0 .. n_ctx - n - 1: every earlier occurrence, not the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(seq[: n_ctx - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


class NgramDrafter:
    """Prompt lookup for every row (no model, no state): runs in the step loop itself."""

    name = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, rows: list[DraftRow]) -> Drafted:
        t0 = time.perf_counter()
        proposals = [Proposal(prompt_lookup(r.context, r.k, self.min_ngram, self.max_ngram)) if r.k else EMPTY_PROPOSAL
                     for r in rows]
        return Drafted(proposals, time.perf_counter() - t0, 1)

    def has_match(self, context: list[int]) -> bool:
        """Whether a round would propose anything for ``context`` (the policy asks before it
        picks a drafter: prompt lookup costs nothing to ask)."""
        return bool(prompt_lookup(context, 1, self.min_ngram, self.max_ngram))

    def release(self, key: str) -> None:
        pass
