"""The batched runner's cache: reconcile with the caller's ids, roll back, keep sequences apart.

Every logit is checked against a plain transformers forward over the full ids (no cache)."""

import pytest
import torch

from specdec.batch.blocks import blocks_for, run_of, slots
from specdec.batch.runner import BatchRow, BatchRunner, common_prefix_len
from specdec.loading import load_model

CAP = 64  # pool rows per sequence


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request, llama_pair, gpt2_pair):
    pair = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return load_model(str(pair["target"]))


def full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def row(key, ids, num_logits=1, slot=0):
    return BatchRow(key, ids, num_logits, run_of(1 + blocks_for(CAP) * slot, CAP))


def one(runner, key, ids, num_logits=1, slot=0):
    return runner.forward([row(key, ids, num_logits, slot)])[0]


def test_prefill_speculate_reject_continue_matches_plain(model):
    """Rollback: rejected drafts leave no trace in the cache (docs/architecture.md: rollback)."""
    runner = BatchRunner(model, capacity_tokens=4 * CAP)
    prompt = [5, 17, 42, 8, 99]
    one(runner, "s", prompt)  # prefill
    drafts = [7, 7, 7]
    scored = one(runner, "s", prompt + drafts, len(drafts) + 1)  # speculate k=3
    assert torch.allclose(scored, full_logits(model, prompt + drafts)[-4:], atol=1e-5)
    runner.truncate("s", len(prompt) + 1)  # reject after the first draft
    assert runner.cached_ids("s") == prompt + [7]
    cont = prompt + [7, 3, 11]
    step = one(runner, "s", cont)  # continue with different tokens
    assert runner.last_fed == 2  # only the new tokens were fed: the kept prefix stayed
    assert torch.allclose(step[0], full_logits(model, cont)[-1], atol=1e-5)
    # And the pool now holds what a fresh prefill of the same tokens writes, position by
    # position, every layer (the fresh one in another runner, at another place in its pool).
    fresh = BatchRunner(model, capacity_tokens=4 * CAP)
    one(fresh, "f", cont, slot=2)
    a, b = slots(run_of(1, CAP), 0, len(cont)), slots(run_of(1 + 2 * blocks_for(CAP), CAP), 0, len(cont))
    for la, lb in zip(runner.cache.keys + runner.cache.values, fresh.cache.keys + fresh.cache.values):
        assert torch.allclose(la[:, a], lb[:, b], atol=1e-5)


def test_reconcile_keeps_common_prefix_and_recomputes_divergence(model):
    runner = BatchRunner(model, capacity_tokens=CAP)
    one(runner, "s", [1, 2, 3, 4, 5, 6])
    other = [1, 2, 3, 9, 9]  # diverges at position 3: a failover or a different branch
    out = one(runner, "s", other, 2)
    assert runner.cached_ids("s") == other and runner.last_fed == 2  # [1, 2, 3] kept
    assert torch.allclose(out, full_logits(model, other)[-2:], atol=1e-5)
    # Asking for logits of already-cached positions recomputes them.
    again = one(runner, "s", other, 3)
    assert runner.last_fed == 3 and runner.cached_ids("s") == other
    assert torch.allclose(again, full_logits(model, other)[-3:], atol=1e-5)
    # Nothing new and no logits asked for: nothing to feed.
    assert runner.forward([row("s", other, 0)])[0].shape[0] == 0 and runner.cached_ids("s") == other


def test_sequences_are_independent_and_release_frees(model):
    runner = BatchRunner(model, capacity_tokens=3 * CAP)
    seqs = {"a": [1, 2, 3], "b": [4, 5], "c": [6]}
    slots = {"a": 0, "b": 1, "c": 2}
    outs = runner.forward([row(k, ids, len(ids), slots[k]) for k, ids in seqs.items()])  # one pass, ragged rows
    for (key, ids), out in zip(seqs.items(), outs):
        assert torch.allclose(out, full_logits(model, ids), atol=1e-5), key
    assert runner.keys() == {"a", "b", "c"}
    # Rolling one back and sending it elsewhere leaves the others as they were.
    runner.truncate("a", 1)
    one(runner, "a", [1, 8, 8, 8], slot=0)
    for key in ("b", "c"):
        ids = seqs[key] + [9]
        assert torch.allclose(one(runner, key, ids, slot=slots[key])[0], full_logits(model, ids)[-1], atol=1e-5)
        assert runner.last_fed == 1
    # A released sequence is forgotten (its range is the allocator's to hand out again): the
    # same key in the same range comes back as a fresh prefill of the ids the caller owns.
    runner.release("a")
    assert "a" not in runner and runner.cached_ids("a") == [] and runner.keys() == {"b", "c"}
    assert torch.allclose(one(runner, "a", [1, 2, 3], slot=0)[0], full_logits(model, [1, 2, 3])[-1], atol=1e-5)
    assert runner.last_fed == 3  # all of it (held, it would have kept its first token)
    b = seqs["b"] + [9, 10]
    assert torch.allclose(one(runner, "b", b, slot=1)[0], full_logits(model, b)[-1], atol=1e-5)


def test_a_sequence_outside_its_range_is_refused(model):
    runner = BatchRunner(model, capacity_tokens=CAP)
    with pytest.raises(ValueError, match="its blocks hold 16"):
        runner.forward([BatchRow("s", list(range(20)), 1, run_of(1, 8))])
    with pytest.raises(ValueError, match="outside the pool"):
        runner.forward([BatchRow("s", [1, 2], 1, (runner.num_blocks,))])


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_len([], [1]) == 0


def test_a_model_on_the_pool_still_decodes_correctly_outside_a_step(model):
    """Outside a bound step (transformers' own generate, the benchmark's assisted runs) the
    ragged attention is SDPA's with SDPA's mask: a multi-token forward over a cache gives a
    fresh forward's logits (without the mask function it lined the queries up with the first
    keys)."""
    import copy

    from transformers import DynamicCache

    ids = [5, 9, 3, 7, 11, 2, 8, 4, 6, 10]
    want = full_logits(model, ids)
    on_pool = copy.deepcopy(model)
    BatchRunner(on_pool, capacity_tokens=256)  # switches its attention to the pool's
    assert on_pool.config._attn_implementation == "specdec_ragged"
    with torch.inference_mode():
        cache = DynamicCache(config=on_pool.config)
        on_pool(input_ids=torch.tensor([ids[:4]]), use_cache=True, cache=cache)
        out = on_pool(input_ids=torch.tensor([ids[4:]]), use_cache=True, cache=cache).logits[0]
    torch.testing.assert_close(out.float(), want[4:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_queries, invariant", [(0, False), (32, False), (32, True)],
                         ids=["alone", "packed", "invariant"])
def test_one_padded_call_and_rows_alone_give_the_logits_of_a_dense_forward(model, monkeypatch, max_queries,
                                                                           invariant):
    """A step of every kind of row: decode rows, a k-draft chain, a token tree, a prompt chunk
    (over PACK_MAX_QUERIES: alone) and a row far longer than the others (alone); with packing
    off (0) every row attends alone; with the invariant numerics every query of the short rows
    attends alone in its key-length group, over padded steps. Every logit equals a plain
    forward over the row's ids."""
    from specdec.batch import attention
    from specdec.trees import path_to

    monkeypatch.setattr(attention, "PACK_MAX_QUERIES", max_queries)
    packs = []
    real_pack = attention.pack
    monkeypatch.setattr(attention, "pack", lambda rows, dev: packs.append(real_pack(rows, dev)) or packs[-1])
    cap = 128
    runner = BatchRunner(model, capacity_tokens=8 * cap, invariant=invariant)
    steps = []  # each bound step's attention plan
    real_bind = attention.bind
    monkeypatch.setattr(attention, "bind", lambda *a, **kw: real_bind(*a, **kw) or steps.append(attention._BOUND.step))
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (6, 9, 7, 8, 40, 90)]
    tree_tokens, parents = [11, 12, 13, 14], (-1, -1, 0, 0)
    at = lambda i: run_of(1 + blocks_for(cap) * i, cap)  # noqa: E731
    runner.forward([BatchRow(str(i), s[:-1], 0, at(i)) for i, s in enumerate(ids) if i != 4])
    rows = [BatchRow("0", ids[0], 1, at(0)), BatchRow("1", ids[1], 1, at(1)),
            BatchRow("2", ids[2] + [3, 4, 5], 4, at(2)),  # a chain of 3 drafts
            BatchRow("3", ids[3] + tree_tokens, 5, at(3), parents),  # a tree
            BatchRow("4", ids[4], 1, at(4)),  # a whole prompt: 40 queries
            BatchRow("5", ids[5], 1, at(5))]  # 90 keys: over twice the median
    out = runner.forward(rows)
    if invariant:  # no packing; of the 12 queries of rows 0-3 and 5, the chain's 4 share a call (one key
        # count), the others are grouped by key count (padding: none)
        assert not packs and [c.tokens.numel() for c in steps[-1].chains] == [4]
        assert sum(g.tokens.numel() for g in steps[-1].groups) == 1 + 1 + 5 + 1
    else:
        expected_packed = [0, 1, 2, 3] if max_queries else None
        assert (packs[-1].rows if packs[-1] else None) == expected_packed
    for i in (0, 1, 4, 5):
        assert torch.allclose(out[i][0], full_logits(model, ids[i])[-1], atol=1e-5), i
    assert torch.allclose(out[2], full_logits(model, ids[2] + [3, 4, 5])[-4:], atol=1e-5)
    assert torch.allclose(out[3][0], full_logits(model, ids[3])[-1], atol=1e-5)
    for n in range(len(tree_tokens)):
        path = [tree_tokens[j] for j in path_to(parents, n)]
        assert torch.allclose(out[3][1 + n], full_logits(model, ids[3] + path)[-1], atol=1e-5), n


def test_products_run_at_row_counts_on_the_grid_and_padding_changes_no_logits(model):
    """Steps of every size from 1 to 140 tokens: each product ran at a count of
    ``numerics.on_grid`` (a bounded set of compiled kernels), and each row's logits equal a dense
    forward's though the step was padded."""
    from specdec.batch import numerics

    seen, recording = set(), [False]

    def record(_module, args):
        if recording[0]:
            seen.add(args[0].shape[-2])

    hooks = [m.register_forward_pre_hook(record)
             for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    try:
        runner = BatchRunner(model, capacity_tokens=8 * CAP)
        gen = torch.Generator().manual_seed(1)
        for n in range(1, 141, 3):  # two rows: n - 1 prompt tokens and one of 1 token
            a = torch.randint(1, 300, (max(1, n - 1),), generator=gen).tolist()
            recording[0] = True
            out = runner.forward([BatchRow("a", a, 1, run_of(1, 160)), BatchRow("b", [7], 1, run_of(1 + blocks_for(160), 16))])
            recording[0] = False
            assert torch.allclose(out[0][0], full_logits(model, a)[-1], atol=1e-5), n
            runner.release("a"), runner.release("b")
    finally:
        for h in hooks:
            h.remove()
    grid = set(range(1, 17)) | set(range(20, 65, 4)) | set(range(80, 257, 16))
    assert seen and seen <= grid, sorted(seen - grid)
    assert all(numerics.on_grid(m) == m for m in seen)
    assert {n + 1 for n in range(1, 141, 3)} - grid  # steps off the grid were run: the test did pad
