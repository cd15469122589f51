"""The lean Llama stack (``specdec.batch.lean``) gives transformers' logits bit for bit.

Two runners on one model, one running the step through ``LeanLlama`` and one through the
model's own forward, are fed the same steps of every kind of row; their logits, pools and
captured features must be equal exactly, not within a tolerance."""

import pytest
import torch

from specdec.batch.blocks import blocks_for, run_of
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.loading import load_model
from specdec.models.draft import ReducedHeadLlamaForCausalLM, draft_llama_config
from specdec.batch.lean import LeanLlama
from specdec.models.packed import pack_linears

CAP = 128


def steps(gen):
    """A prefill of five rows, then one step of every kind of row (decode rows, a chain of 3
    drafts, a token tree, a 40-token prompt, a row far longer than the others), then a decode
    step of all six."""
    ids = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (6, 9, 7, 8, 40, 90)]
    at = lambda i: run_of(1 + blocks_for(CAP) * i, CAP)  # noqa: E731
    yield [BatchRow(str(i), s[:-1], 0, at(i)) for i, s in enumerate(ids) if i != 4]
    yield [BatchRow("0", ids[0], 1, at(0)), BatchRow("1", ids[1], 1, at(1)),
           BatchRow("2", ids[2] + [3, 4, 5], 4, at(2)),
           BatchRow("3", ids[3] + [11, 12, 13, 14], 5, at(3), (-1, -1, 0, 0)),
           BatchRow("4", ids[4], 1, at(4)), BatchRow("5", ids[5], 1, at(5))]
    yield [BatchRow(str(i), s + [21], 1, at(i)) for i, s in enumerate(ids)]


def both(model, invariant=False, features=False):
    """(lean runner, transformers runner) on ``model``."""
    lean, stock = (BatchRunner(model, capacity_tokens=8 * CAP, invariant=invariant) for _ in range(2))
    stock._lean = None
    if features:
        lean.keep_features(), stock.keep_features()
    return lean, stock


def assert_same_steps(model, invariant=False, features=False):
    lean, stock = both(model, invariant, features)
    assert lean._lean is not None
    gen = torch.Generator().manual_seed(0)
    for rows in steps(gen):
        got, want = lean.forward(rows), stock.forward(rows)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    for a, b in zip(lean.cache.keys + lean.cache.values, stock.cache.keys + stock.cache.values):
        assert torch.equal(a, b)
    if features:
        assert lean.features.abs().sum() > 0 and torch.equal(lean.features, stock.features)


@pytest.mark.parametrize("invariant", [False, True], ids=["packed", "invariant"])
def test_lean_steps_give_the_logits_and_pool_of_the_models_own_forward(llama_pair, invariant):
    assert_same_steps(load_model(str(llama_pair["target"])), invariant)


def test_lean_steps_in_bf16_and_with_features_captured(llama_pair):
    """bf16 (packed where the CPU packs it, F.linear elsewhere), with the final norm's output
    kept for an EAGLE head: the forward hook still fires, with the same values."""
    assert_same_steps(load_model(str(llama_pair["target"]), dtype="bfloat16"), features=True)


def test_a_reduced_head_draft_runs_lean_with_its_own_head(llama_pair):
    target = load_model(str(llama_pair["target"]))
    torch.manual_seed(0)
    draft = ReducedHeadLlamaForCausalLM(draft_llama_config(target.config, 1), head_vocab_size=50).eval()
    draft.token_ids.copy_(torch.randperm(target.config.vocab_size)[:50])
    pack_linears(draft)  # as load_model serves it
    assert_same_steps(draft)
    out = both(draft)[0].forward([BatchRow("a", [1, 2, 3], 2, run_of(1, CAP))])[0]
    assert torch.isinf(out).sum(-1).tolist() == [target.config.vocab_size - 50] * 2  # its head, not the full one


def test_the_lean_runner_does_not_call_the_models_forward(llama_pair, monkeypatch):
    model = load_model(str(llama_pair["target"]))
    lean, _ = both(model)

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' forward ran")

    monkeypatch.setattr(model.model, "forward", refuse)
    out = lean.forward([BatchRow("a", [1, 2, 3, 4], 1, run_of(1, CAP))])[0]
    assert out.shape == (1, model.config.vocab_size)
    with pytest.raises(AssertionError, match="transformers' forward ran"):
        both(model)[1].forward([BatchRow("a", [1, 2, 3, 4], 1, run_of(1, CAP))])


def test_only_stacks_it_runs_exactly_are_taken(llama_pair, gpt2_pair):
    llama = load_model(str(llama_pair["target"]))
    assert LeanLlama.supports(llama)
    assert not LeanLlama.supports(load_model(str(gpt2_pair["target"])))
    llama.config.hidden_act = "gelu"  # the layers' act_fn is still SiLU, but the config says otherwise
    assert not LeanLlama.supports(llama)
    assert BatchRunner(llama, capacity_tokens=CAP)._lean is None


def test_the_early_exit_stack_runs_its_layers_lean_bit_for_bit(llama_pair):
    from specdec.drafters.early_exit import ShallowStack

    model = load_model(str(llama_pair["target"]))
    runner = BatchRunner(model, capacity_tokens=4 * CAP)
    runner.forward([BatchRow("a", list(range(5, 30)), 1, run_of(1, CAP)),
                    BatchRow("b", list(range(40, 47)), 1, run_of(1 + blocks_for(CAP), CAP))])
    stack = ShallowStack(model, 2)
    assert stack.lean is not None
    lean = stack.hidden_rows(runner, ["a", "b"], [3, 4], [25, 7])
    stack.lean = None
    assert torch.equal(lean, stack.hidden_rows(runner, ["a", "b"], [3, 4], [25, 7]))
