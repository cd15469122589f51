import random

import pytest

from specdec.drafters.base import DraftRow
from specdec.drafters.ngram import NgramDrafter, prompt_lookup
from specdec.sampling import SamplingParams


def test_docstring_example():
    assert prompt_lookup([7, 1, 2, 3, 4, 9, 1, 2], 3, 1, 2) == [3, 4, 9]


def test_longest_ngram_wins_and_latest_match_is_used():
    # suffix [2, 3]: the 2-gram matches at index 4 (followed by 8); the 1-gram [3] alone
    # would match later at index 7 (followed by 6). The longer match is more specific.
    ctx = [0, 2, 9, 1, 2, 3, 8, 3, 6, 2, 3]
    assert prompt_lookup(ctx, 1, 1, 2) == [8]
    assert prompt_lookup(ctx, 1, 1, 1) == [6]
    assert prompt_lookup([1, 2, 1, 2, 5, 1, 2], 2, 2, 2) == [5, 1]


def test_no_match_is_an_empty_proposal_and_k_caps_length():
    assert prompt_lookup([1, 2, 3, 4], 3) == []
    assert prompt_lookup([1], 3) == []
    rows = [DraftRow("a", [4, 5, 6, 7, 8, 4], 2, SamplingParams(), 0),
            DraftRow("b", [1, 2, 3], 4, SamplingParams(), 0),
            DraftRow("c", [4, 5, 6, 7, 8, 4], 0, SamplingParams(), 0),  # k = 0: no lookup at all
            DraftRow("d", [0, 2, 9, 1, 2, 3, 8, 3, 6, 2, 3], 3, SamplingParams(1.0), 0)]
    a, b, c, d = NgramDrafter(1, 3).propose(rows).proposals
    assert a.tokens == [5, 6] and a.probs is None  # a point mass, also for sampled rows
    assert b.tokens == [] and c.tokens == []
    assert d.tokens == [8, 3, 6] and d.probs is None
    assert [p.tokens for p in NgramDrafter(1, 1).propose(rows[3:]).proposals] == [[6, 2, 3]]  # the rows' min/max n apply


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (1, 1)])
def test_the_index_answers_as_the_scan_does_as_a_sequence_grows(min_n, max_n):
    """The drafter's per-row index gives prompt_lookup's answer (and the length of the suffix
    it matched: the longest n a scan finds) after every token, over
    sequences with many repeats (a small vocabulary), and starts afresh for another sequence
    under the same key (a shorter one, and one of the same length with another last token)."""
    rng = random.Random(min_n * 10 + max_n)
    drafter = NgramDrafter(min_n, max_n)
    for trial in range(6):
        seq = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
        for _ in range(120):
            k = rng.randrange(1, 9)
            assert drafter.lookup("r", seq, k) == prompt_lookup(seq, k, min_n, max_n), (trial, seq, k)
            longest = next((n for n in range(max_n, min_n - 1, -1) if prompt_lookup(seq, 1, n, n)), 0)
            assert drafter.match_length("r", seq) == longest, (trial, seq)
            seq = seq + [rng.randrange(5)] * rng.choice([1, 1, 1, 3])  # one token, or a round's worth
    assert drafter.lookup("r", seq, 3) == prompt_lookup(seq, 3, min_n, max_n)
    swapped = seq[:-2] + [7, seq[-1]]  # as long as the indexed sequence, another token before the last
    assert drafter.lookup("r", swapped, 3) == prompt_lookup(swapped, 3, min_n, max_n)
    other = [9, 9, 1, 9, 9]  # shorter
    assert drafter.lookup("r", other, 3) == prompt_lookup(other, 3, min_n, max_n)
    drafter.release("r")
    assert "r" not in drafter._index
