import pytest
import torch

from specdec.batch.runner import common_prefix_len
from specdec.runner import ModelRunner
from specdec.loading import load_model


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request, llama_pair, gpt2_pair):
    pair = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return load_model(str(pair["target"]))


def full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_prefill_speculate_reject_continue_matches_plain(model):
    """Rollback: rejected drafts leave no trace in the cache (docs/architecture.md: rollback)."""
    runner = ModelRunner(model)
    prompt = [5, 17, 42, 8, 99]
    runner.forward("s", prompt, 1)  # prefill
    drafts = [7, 7, 7]
    scored = runner.forward("s", prompt + drafts, len(drafts) + 1)  # speculate k=3
    assert torch.allclose(scored, full_logits(model, prompt + drafts)[-4:], atol=1e-5)
    runner.rollback("s", len(prompt) + 1)  # reject after the first draft
    assert len(runner._seqs["s"].ids) == len(prompt) + 1
    cont = prompt + [7, 3, 11]
    step = runner.forward("s", cont, 1)  # continue with different tokens
    assert torch.allclose(step[0], full_logits(model, cont)[-1], atol=1e-5)
    # And the cache now equals a fresh prefill of the same tokens, position by position.
    fresh = ModelRunner(model)
    fresh.forward("f", cont, 1)
    a, b = runner._seqs["s"].cache, fresh._seqs["f"].cache
    for la, lb in zip(a.layers, b.layers):
        assert torch.allclose(la.keys, lb.keys, atol=1e-5)
        assert torch.allclose(la.values, lb.values, atol=1e-5)


def test_reconcile_keeps_common_prefix_and_recomputes_divergence(model):
    runner = ModelRunner(model)
    runner.forward("s", [1, 2, 3, 4, 5, 6], 1)
    other = [1, 2, 3, 9, 9]  # diverges at position 3: a failover or a different branch
    out = runner.forward("s", other, 2)
    assert runner._seqs["s"].ids == other
    assert torch.allclose(out, full_logits(model, other)[-2:], atol=1e-5)
    # Asking for logits of already-cached positions recomputes them.
    again = runner.forward("s", other, 3)
    assert torch.allclose(again, full_logits(model, other)[-3:], atol=1e-5)


def test_sequences_are_independent_and_lru_evicted(model):
    runner = ModelRunner(model, max_sequences=2)
    runner.forward("a", [1, 2, 3], 1)
    runner.forward("b", [4, 5], 1)
    runner.forward("c", [6], 1)
    assert "a" not in runner._seqs and len(runner._seqs["b"].ids) == 2
    # An evicted sequence is simply re-prefilled from the ids the caller owns.
    assert torch.allclose(runner.forward("a", [1, 2, 3], 1)[0], full_logits(model, [1, 2, 3])[-1], atol=1e-5)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_len([], [1]) == 0
