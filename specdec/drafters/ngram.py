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


class LookupIndex:
    """``prompt_lookup`` over one growing sequence, answered from an index instead of a scan.

    For each n-gram size it maps every n-gram of the sequence but its last token to where its
    latest occurrence ends, so a lookup is ``max_ngram`` dictionary probes and a new token
    costs ``max_ngram`` insertions (a scan of a 1,000-token context costs ~0.1-0.2 ms, which
    at 64 rows would be several ms a step). ``lookup(context, k) == prompt_lookup(context, k,
    min_ngram, max_ngram)`` for any context; one that does not extend the indexed sequence
    (its last indexed token differs) is indexed afresh.
    """

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0  # n-grams ending at or before this position are in ``_ends``
        self._last: int | None = None  # the token at ``_indexed - 1``, to notice another sequence

    def _extend(self, context: list[int]) -> None:
        end = len(context) - 1  # the n-grams of context[:-1]: earlier occurrences, never the suffix
        if end < self._indexed or (self._indexed and context[self._indexed - 1] != self._last):
            self.__init__(self.min_ngram, self.max_ngram)
        for e in range(self._indexed + 1, end + 1):
            for n, ends in self._ends.items():
                if e >= n:
                    ends[tuple(context[e - n : e])] = e
        if end > self._indexed:
            self._indexed, self._last = end, context[end - 1]

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's suffix."""
        return self.match(context, k)[1]

    def match(self, context: list[int], k: int) -> tuple[int, list[int]]:
        """``lookup``, and the length of the suffix it matched (0: none, nothing proposed)."""
        self._extend(context)
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            start = self._ends[n].get(tuple(context[n_ctx - n :]))
            if start is not None:
                return n, context[start : start + k]
        return 0, []


class NgramDrafter:
    """Prompt lookup for every row (no model): runs in the step loop itself, over an index
    per row (``LookupIndex``) kept until ``release(key)``."""

    name = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._index: dict[str, LookupIndex] = {}

    def lookup(self, key: str, context: list[int], k: int) -> list[int]:
        """What a round of ``k`` drafts would propose for row ``key`` at ``context``."""
        return self.match(key, context, k)[1]

    def match(self, key: str, context: list[int], k: int) -> tuple[int, list[int]]:
        """``lookup``, and the length of the suffix it matched (0: none)."""
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = LookupIndex(self.min_ngram, self.max_ngram)
        return index.match(context, k)

    def propose(self, rows: list[DraftRow]) -> Drafted:
        t0 = time.perf_counter()
        proposals = [Proposal(self.lookup(r.key, r.context, r.k)) if r.k else EMPTY_PROPOSAL for r in rows]
        return Drafted(proposals, time.perf_counter() - t0, 1)

    def match_length(self, key: str, context: list[int]) -> int:
        """How long a suffix of ``context`` a round would match (0: it would propose nothing).
        The policy asks before it picks a drafter (prompt lookup costs nothing to ask): the
        longer the match, the likelier its proposal is the target's text."""
        return self.match(key, context, 1)[0]

    def release(self, key: str) -> None:
        self._index.pop(key, None)
