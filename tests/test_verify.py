"""Exactness of verification, proven analytically and statistically (docs/architecture.md: how exactness is proven)."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import specdec.verify as verify_mod
from specdec.sampling import SamplingParams, logits_to_probs, make_generator
from specdec.verify import acceptance_probs, residual_distribution, verify_greedy, verify_sampled

SIGNIFICANCE = 1e-3


def implied_first_token_distribution(p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """P(first output token = y) that rejection sampling implies, in closed form.

    = sum over drafts x of P(draft x) * [accept x, y = x] + P(reject x) * residual_x(y),
    built from the verifier's own acceptance and residual functions.
    """
    vocab = p.shape[0]
    out = torch.zeros(vocab, dtype=torch.float64)
    drafts = range(vocab) if q is not None else [int(torch.argmax(p))]  # point mass: any fixed x
    for x in drafts:
        px_draft = q[x] if q is not None else 1.0
        if px_draft == 0:
            continue
        rows = None if q is None else q.unsqueeze(0)
        a = acceptance_probs(torch.tensor([x]), rows, p.unsqueeze(0))[0]
        out[x] += px_draft * a
        out += px_draft * (1 - a) * residual_distribution(p, q, x)
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=7, top_p=0.9),
    ],
)
def test_analytic_output_distribution_equals_p(seed, params):
    g = torch.Generator().manual_seed(seed)
    vocab = 12
    p = logits_to_probs(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, params)
    q = logits_to_probs(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, params)
    assert torch.allclose(implied_first_token_distribution(p, q), p, atol=1e-9, rtol=0)
    # A drafter with no distribution (n-gram): a point mass on whatever it proposes.
    for x in range(vocab):
        qx = torch.nn.functional.one_hot(torch.tensor(x), vocab).to(torch.float64)
        assert torch.allclose(implied_first_token_distribution(p, qx), p, atol=1e-9, rtol=0)
    assert torch.allclose(implied_first_token_distribution(p, None), p, atol=1e-9, rtol=0)


def test_greedy_verification_examples():
    v = verify_greedy(torch.tensor([5, 7]), torch.tensor([5, 2, 9]))
    assert (v.tokens, v.num_accepted, v.bonus) == ([5, 2], 1, False)
    v = verify_greedy(torch.tensor([5, 2]), torch.tensor([5, 2, 9]))
    assert (v.tokens, v.num_accepted, v.bonus) == ([5, 2, 9], 2, True)
    v = verify_greedy(torch.tensor([], dtype=torch.long), torch.tensor([4]))
    assert (v.tokens, v.num_accepted) == ([4], 0)


# --- statistical: a whole multi-token round against an exact Markov-chain target ------------

VOCAB, K, LENGTH = 8, 3, 3


def markov_chains(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)
    Q = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)
    return P, Q


def speculative_sequence(P, Q, start: int, gen: torch.Generator, use_q: bool) -> tuple[int, ...]:
    """LENGTH tokens from rounds of k=K drafts from chain Q, verified against chain P."""
    out: list[int] = []
    last = start
    while len(out) < LENGTH:
        drafts, prev = [], last
        for _ in range(K):
            prev = int(torch.multinomial(Q[prev], 1, generator=gen))
            drafts.append(prev)
        context = [last] + drafts
        p_rows = P[context]  # [K + 1, VOCAB]: p after last, after each draft
        q_rows = Q[context[:-1]] if use_q else None
        v = verify_sampled(torch.tensor(drafts), q_rows, p_rows, generator=gen)
        out.extend(v.tokens)
        last = out[-1]
    return tuple(out[:LENGTH])


def chi_square_pvalue(samples, expected_probs) -> float:
    cells = list(itertools.product(range(VOCAB), repeat=LENGTH))
    counts = torch.zeros(len(cells), dtype=torch.float64)
    index = {c: i for i, c in enumerate(cells)}
    for s in samples:
        counts[index[s]] += 1
    expected = torch.tensor([expected_probs(c) for c in cells]) * len(samples)
    # Pool the cells with small expectations into one, as the chi-square approximation needs.
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("use_q", [True, False], ids=["draft-q", "point-mass"])
def test_round_tokens_follow_target_distribution(use_q):
    P, Q = markov_chains()
    start = 0
    exact = lambda c: float(P[start, c[0]] * P[c[0], c[1]] * P[c[1], c[2]])
    gen = make_generator(1234)
    samples = [speculative_sequence(P, Q, start, gen, use_q) for _ in range(20000)]
    assert chi_square_pvalue(samples, exact) > SIGNIFICANCE


def test_negative_control_broken_residual_fails(monkeypatch):
    """Resampling from p instead of norm(max(p - q, 0)) is a classic bug; the test must see it."""
    P, Q = markov_chains()
    start = 0
    exact = lambda c: float(P[start, c[0]] * P[c[0], c[1]] * P[c[1], c[2]])
    monkeypatch.setattr(verify_mod, "residual_distribution", lambda p, q, x: p)
    gen = make_generator(1234)
    samples = [speculative_sequence(P, Q, start, gen, True) for _ in range(20000)]
    assert chi_square_pvalue(samples, exact) < SIGNIFICANCE
