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
