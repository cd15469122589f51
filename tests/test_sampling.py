import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from specdec import sampling
from specdec.sampling import SamplingParams, draw, logits_to_probs, make_generator


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
