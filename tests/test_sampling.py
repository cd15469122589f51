import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from specdec import sampling
from specdec.sampling import SamplingParams, draw, logits_to_probs, make_generator, nucleus


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (7, 0.9), (1, 1.0), (0, 1e-6)])
def test_filters_match_transformers(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 32, dtype=torch.float64)
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    ref = logits / 0.7
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.allclose(logits_to_probs(logits, params), ref.softmax(-1), atol=1e-12)


def test_top_k_keeps_exactly_k_and_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert (logits_to_probs(logits, SamplingParams(temperature=1, top_k=2)) > 0).sum() == 2
    # 0.5 + 0.2 = 0.7 < 0.8, so the nucleus needs the third token too.
    nucleus = logits_to_probs(logits, SamplingParams(temperature=1, top_p=0.8)) > 0
    assert nucleus.tolist() == [True, True, True, False, False]


def test_seeded_generator_is_reproducible():
    probs = torch.full((50,), 1 / 50)

    def draws(seed):
        gen = make_generator(seed)
        return [draw(probs, gen) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def _sorted_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: sort the whole row, keep each token while the mass before it is below top_p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop[..., 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)


def test_the_nucleus_from_a_partial_top_k_equals_a_sort_of_the_whole_vocabulary():
    """``nucleus`` starts from 8 candidates of 3,000 here: a peaked row is decided by them, a flat
    one (its nucleus holds hundreds of tokens) after widening; a row at top_p 1 and a top-k'd
    row (-inf past its k) come out as the reference's (a sort of the whole vocabulary) gives."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3000, generator=gen, dtype=torch.float64)
    logits[0] *= 8  # peaked: a handful of tokens hold 0.9
    logits[3] = logits[3].masked_fill(logits[3] < torch.topk(logits[3], 40).values[-1], -math.inf)
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.7], dtype=torch.float64)
    got = nucleus(logits, top_p, first=8)
    for row, p in enumerate(top_p.tolist()):
        want = logits[row] if p == 1.0 else _sorted_nucleus(logits[row], p)
        assert torch.equal(got[row], want), row
    kept = torch.isfinite(got).sum(-1).tolist()
    assert kept[0] < 8 < kept[2] and kept[1] == 3000, kept  # both paths ran


SIGNIFICANCE = 1e-3


def _draw_pvalue(draw_fn, weights: torch.Tensor, n: int = 20000) -> tuple[float, torch.Tensor]:
    from scipy.stats import chisquare

    gen = make_generator(1234)
    counts = torch.bincount(torch.tensor([draw_fn(weights, gen) for _ in range(n)]), minlength=len(weights))
    mass = weights > 0
    expected = weights.double()[mass] / weights.double().sum() * n
    return float(chisquare(counts[mass].double().numpy(), expected.numpy()).pvalue), counts


def test_draw_gives_each_id_its_probability_and_never_one_of_probability_zero():
    """``draw`` (inverse transform sampling, one uniform a token) over unnormalised weights with
    zeros, first and last included: 20,000 draws pass the chi-square test at significance 1e-3
    and never land on a zero. Negative control: the same draw with the uniform not scaled by the
    total (as if the weights summed to 1, a residual left unnormalised) fails it."""
    weights = torch.tensor([0.0, 0.6, 0.0, 0.3, 0.9, 0.0, 0.05, 1.2, 0.0])  # sums to 3.05
    pvalue, counts = _draw_pvalue(draw, weights)
    assert pvalue > SIGNIFICANCE
    assert counts[weights == 0].sum() == 0

    def unscaled(probs, generator):
        u = torch.rand(1, generator=generator, dtype=torch.float64)
        return int(torch.searchsorted(probs.double().cumsum(-1), u, right=True))

    assert _draw_pvalue(unscaled, weights)[0] < SIGNIFICANCE


def test_draw_at_the_top_of_the_unit_interval_takes_the_last_id_with_mass(monkeypatch):
    """A uniform that rounds ``u * total`` up to the total still gives an id that has mass."""
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor([1.0], dtype=torch.float64))
    assert draw(torch.tensor([0.2, 0.5, 0.3, 0.0, 0.0]), make_generator(0)) == 2


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)]
)
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
