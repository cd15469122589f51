"""Batch-invariant numerics (``numerics: batch_invariant``, the default): in bf16 a token's logits
do not depend on how many tokens its row carries or what else is in the step, so greedy output
is the same with speculation on or off and alone or batched. The negative control: the fast
numerics, where they are not invariant, give other logits for the same token."""

import threading

import pytest
import torch

from specdec.batch import attention
from specdec.batch.blocks import blocks_for, run_of
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.config import ModelConfig
from specdec.engine import Engine
from specdec.trees import path_to

CAP = 128


@pytest.fixture(scope="module")
def bf16_target():
    """Two layers with the demo target's attention shape (9 heads of 64, 3 key heads), random
    weights, bf16: the shape at which bf16 kernels round other query counts differently."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=512, max_position_embeddings=1024, initializer_range=0.1)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _logits_of_one_token(model, invariant: bool) -> dict[str, torch.Tensor]:
    """The logits after ``ctx + [7]`` computed as a plain decode step, as the first of 4 tokens
    of a draft row, inside a token tree, and with other rows in the step."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ctx = torch.randint(1, vocab, (60,), generator=gen).tolist()
    others = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (9, 31, 14)]
    tree, parents = [7, 8, 9, 10], (-1, -1, 0, 0)

    def runner():
        r = BatchRunner(model, capacity_tokens=8 * CAP, invariant=invariant)
        r.forward([BatchRow("s", ctx, 0, run_of(1, CAP))] +
                  [BatchRow(f"o{i}", o[:-1], 0, run_of(1 + blocks_for(CAP) * (i + 1), CAP)) for i, o in enumerate(others)])
        return r

    def with_others(row):
        return [row] + [BatchRow(f"o{i}", o, 1, run_of(1 + blocks_for(CAP) * (i + 1), CAP)) for i, o in enumerate(others)]

    out = {"plain": runner().forward([BatchRow("s", ctx + [7], 1, run_of(1, CAP))])[0][0],
           "chain": runner().forward([BatchRow("s", ctx + [7, 3, 4, 5], 4, run_of(1, CAP))])[0][0],
           "batch": runner().forward(with_others(BatchRow("s", ctx + [7], 1, run_of(1, CAP))))[0][0],
           "batch+chain": runner().forward(with_others(BatchRow("s", ctx + [7, 3, 4, 5], 4, run_of(1, CAP))))[0][0]}
    # the tree's node 0 is token 7: its logits are the same token's at the same position
    scored = runner().forward(with_others(BatchRow("s", ctx[:-1] + [ctx[-1]] + tree, 5, run_of(1, CAP), parents)))[0]
    assert path_to(parents, 0) == [0]
    out["batch+tree"] = scored[1]
    return out


def test_a_tokens_bf16_logits_are_the_same_in_any_row_and_batch(bf16_target):
    got = _logits_of_one_token(bf16_target, invariant=True)
    for name, logits in got.items():
        assert torch.equal(logits, got["plain"]), name


def test_negative_control_the_fast_numerics_are_not_invariant_in_bf16(bf16_target):
    got = _logits_of_one_token(bf16_target, invariant=False)
    assert not all(torch.equal(logits, got["plain"]) for logits in got.values())


def test_bf16_greedy_output_alone_batched_and_speculative(llama_pair):
    """Eight greedy requests of mixed modes and lengths, at once, each equal to its prompt alone
    with speculation off (the tiny pair's heads are too narrow for bf16 to round differently
    here even with fast numerics: the logit-level control above is the one that must fail)."""
    engine = Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]),
                                     dtype="bfloat16"), max_num_seqs=8)
    prompts = ["The cat", "A dog sees", "My friend likes the", "The robot builds a red ball at night. The",
               "Our teacher", "The river follows", "A bird hears a song", "def f3(x): return x +"]
    modes = ["off", "draft", "draft_tree", "ngram", "auto", "draft", "off", "draft_tree"]
    lengths = [24, 17, 30, 12, 26, 20, 15, 28]
    ids = [engine.encode(prompt=p) for p in prompts]
    alone = [engine.generate(i, max_tokens=n, mode="off").token_ids for i, n in zip(ids, lengths)]
    together: list = [None] * 8

    def run(j):
        together[j] = engine.generate(ids[j], max_tokens=lengths[j], mode=modes[j]).token_ids

    threads = [threading.Thread(target=run, args=(j,)) for j in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    engine.loop.close()
    assert together == alone


def _plain_and_chained_logits(model) -> int:
    """40 greedy tokens decoded one step at a time, then the same tokens fed as chains of a
    pending token and 4 drafts: how many positions' logits differ (bitwise)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (37,), generator=gen).tolist()
    r = BatchRunner(model, capacity_tokens=4 * CAP, invariant=True)
    ids, plain = list(prompt), []
    logits = r.forward([BatchRow("p", ids, 1, run_of(1, CAP))])[0][0]
    for _ in range(40):
        ids.append(int(logits.argmax()))
        plain.append(logits)
        logits = r.forward([BatchRow("p", ids, 1, run_of(1, CAP))])[0][0]
    s = BatchRunner(model, capacity_tokens=4 * CAP, invariant=True)
    chained, n = [s.forward([BatchRow("q", prompt, 1, run_of(1, CAP))])[0][0]], len(prompt)
    while len(chained) < 40:
        chained.extend(s.forward([BatchRow("q", ids[: n + 5], 5, run_of(1, CAP))])[0])
        n += 5
    return sum(not torch.equal(a, b) for a, b in zip(plain, chained))


def test_one_token_steps_are_padded_onto_the_many_row_products(bf16_target, monkeypatch):
    """A one-row matrix product takes another path than a many-row one and rounds differently
    (bf16 on this CPU class): invariant numerics pad a one-token step to two tokens. Negative
    control: without the padding the same 40 tokens give other logits somewhere."""
    from specdec.batch import runner as runner_mod

    assert _plain_and_chained_logits(bf16_target) == 0
    monkeypatch.setattr(runner_mod, "INVARIANT_MIN_TOKENS", {torch.bfloat16: 1})
    assert _plain_and_chained_logits(bf16_target) > 0
