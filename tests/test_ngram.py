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
    drafter = NgramDrafter(min_ngram=1, max_ngram=3)
    p = drafter.propose("s", [4, 5, 6, 7, 8, 4], 2, SamplingParams(), 0)
    assert p.tokens == [5, 6] and p.probs is None
    assert drafter.propose("s", [1, 2, 3], 4, SamplingParams(), 0).tokens == []
