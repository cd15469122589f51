import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from specdec.sampling import SamplingParams, logits_to_probs, make_generator


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
        return [int(torch.multinomial(probs, 1, generator=gen)) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)]
)
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
