"""Batch-invariant numerics (``numerics: batch_invariant``, the default): in bf16 and fp32 a token's logits
do not depend on how many tokens its row carries or what else is in the step, so greedy output
is the same with speculation on or off and alone or batched. The negative control: the fast
numerics, where they are not invariant, give other logits for the same token."""

import functools
import threading

import pytest
import torch

from specdec.batch import attention
from specdec.batch.blocks import blocks_for, run_of
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.config import ModelConfig
from specdec.engine import Engine
from specdec.hardware import native_bf16
from specdec.trees import path_to

CAP = 128


@pytest.fixture(scope="module", params=[(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True),
                                        (torch.float32, True), (torch.float32, "half")],
                ids=["bf16", "fp32", "bf16-packed", "fp32-packed", "fp32-half-weights"])
def target(request):
    """Two layers with the demo target's attention shape (9 heads of 64, 3 key heads), random
    weights, in bf16 (a CPU with AVX-512 BF16 serves it so) and fp32 (``dtype: auto`` on one
    without): the shape at which kernels round other query counts differently. Packed: its
    linear layers on prepacked weights, as ``load_model`` serves a model on a CPU (other kernels,
    other rounding: ``specdec.models.packed``); half: on fp16 weights (``dtype: float16-weights``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.packed import available, half_available, pack_linears

    dtype, pack = request.param
    if pack and not available(dtype) or pack == "half" and not half_available():
        pytest.skip(f"no packed {dtype} products {'on half weights ' if pack == 'half' else ''}on this machine")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=512, max_position_embeddings=1024, initializer_range=0.1)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    if pack:
        assert pack_linears(model, half=pack == "half") == 2 * 7 + 1  # q, k, v, o, gate, up, down a layer; the LM head
    return model


def _logits_of_one_token(model, invariant: bool) -> dict[str, torch.Tensor]:
    """The logits after ``ctx + [7]`` computed as a plain decode step, as the first of 4 drafts
    of a draft row, inside a token tree, and with other rows in the step. As in the step loop,
    the last token of ``ctx`` is the pending one: the step that scores 7 (or the one before it,
    for a plain step) feeds it."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ctx = torch.randint(1, vocab, (60,), generator=gen).tolist()
    others = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (9, 31, 14)]
    tree, parents = [7, 8, 9, 10], (-1, -1, 0, 0)

    def blocks(i):
        return run_of(1 + blocks_for(CAP) * i, CAP)

    def runner():
        r = BatchRunner(model, capacity_tokens=8 * CAP, invariant=invariant)
        r.forward([BatchRow("s", ctx[:-1], 0, blocks(0))] +
                  [BatchRow(f"o{i}", o[:-2], 0, blocks(i + 1)) for i, o in enumerate(others)])
        return r

    def step(r, row, *, with_others: bool, last: bool = True):
        rows = [row] + [BatchRow(f"o{i}", o if last else o[:-1], 1, blocks(i + 1)) for i, o in enumerate(others)]
        return r.forward(rows if with_others else rows[:1])[0]

    def plain(with_others: bool):
        r = runner()
        step(r, BatchRow("s", ctx, 1, blocks(0)), with_others=with_others, last=False)
        return step(r, BatchRow("s", ctx + [7], 1, blocks(0)), with_others=with_others)[0]

    def chain(with_others: bool):
        return step(runner(), BatchRow("s", ctx + [7, 3, 4, 5], 5, blocks(0)), with_others=with_others)[1]

    # the tree's node 0 is token 7: its logits are the same token's at the same position
    assert path_to(parents, 0) == [0]
    return {"plain": plain(False), "chain": chain(False), "batch": plain(True), "batch+chain": chain(True),
            "batch+tree": step(runner(), BatchRow("s", ctx + tree, 5, blocks(0), parents), with_others=True)[1]}


def test_a_tokens_logits_are_the_same_in_any_row_and_batch(target):
    got = _logits_of_one_token(target, invariant=True)
    for name, logits in got.items():
        assert torch.equal(logits, got["plain"]), name


def _attention_calls(monkeypatch) -> tuple[list, list]:
    """The SDPA calls the ragged attention makes (their query shapes), and the steps it binds."""
    calls, steps = [], []
    sdpa, bind = attention.F.scaled_dot_product_attention, attention.bind
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: calls.append(tuple(q.shape)) or sdpa(q, *a, **kw))
    monkeypatch.setattr(attention, "bind", lambda *a, **kw: bind(*a, **kw) or steps.append(attention._BOUND.step))
    return calls, steps


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "fallback"])
def test_a_chain_across_key_slot_counts_gives_each_token_its_decode_logits(target, monkeypatch, one_call):
    """A verify pass of 11 queries whose key counts straddle a key-slot count (128: 124 to 134):
    its queries attend in one call per slot count (``attention._Chain``, where
    ``chain_calls_agree`` says it rounds as a lone query; else, and here when told it does not,
    as a group), and every one of its logits equals, bit for bit, the same token's logits from a
    plain decode step."""
    if not one_call:
        monkeypatch.setattr(attention, "chain_calls_agree", lambda *shape: False)
    calls, steps = _attention_calls(monkeypatch)
    edge = attention.key_slots(1)  # the first key-slot count: 124 to 128 keys below it, 129 to 134 above
    assert attention.key_slots(edge + 1) > edge
    ids = torch.randint(1, target.config.vocab_size, (edge + 6,), generator=torch.Generator().manual_seed(1)).tolist()
    start = edge - 5  # the pass feeds ids[start:], each query seeing the keys up to it
    blocks = run_of(1, 2 * CAP)

    def runner():
        r = BatchRunner(target, capacity_tokens=4 * CAP, invariant=True)
        r.forward([BatchRow("s", ids[:start], 0, blocks)])
        return r

    r = runner()
    calls.clear()  # the prompt's own chains (``attention.prompt_chains``)
    chain = r.forward([BatchRow("s", ids, 11, blocks)])[0]  # after ids[start], ..., ids[-1]
    assert sorted(c.tokens.numel() for c in steps[-1].chains) == [5, 6]
    assert len(calls) == 2 * target.config.num_hidden_layers  # a call a chain (or its group) a layer
    r = runner()
    for i in range(start, len(ids)):
        assert torch.equal(r.forward([BatchRow("s", ids[: i + 1], 1, blocks)])[0][0], chain[i - start]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_flat_attention_gives_the_bits_of_a_call_a_part(dtype, monkeypatch):
    """``attention._FlatPlan``: a step's queries gathered straight into each call's layout and
    its outputs put in place by one gather give, bit for bit, what the groups' and chains' own
    gathers and calls give (``_Groups.attend``, ``_Chains.attend``, ``_chain_attention``), for
    decode rows, draft chains (batched and alone) and token trees in one step, whichever way
    the step's queries lie in memory."""
    from specdec.batch.cache import FlatBatchCache, RowPlan

    heads, kv_heads, dim = 9, 3, 64
    cache = FlatBatchCache(1, kv_heads, dim, 160, dtype=dtype, device="cpu")
    cache.invariant, cache.chain_prompts = True, True
    cache.batch_chains = attention.batched_chains_agree(kv_heads, heads // kv_heads, dim, dtype, "cpu")
    gen = torch.Generator().manual_seed(5)
    for pool in (cache.keys[0], cache.values[0]):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    tree, rows, block = (-1, -1, -1, 0, 0, 1, 3, 3, 6), [], 1
    for i, n in enumerate((60, 250, 90, 130, 300, 41, 200, 127, 128)):  # lone chains, batched ones, trees
        kind = i % 3
        feed = (5, 1 + len(tree), 1)[kind]
        rows.append(RowPlan(run_of(block, n + feed), n, feed, tree_at=n + 1 if kind == 1 else 0,
                            parents=tree if kind == 1 else None))
        block += blocks_for(n + feed) + 1
    flat, steps = [], []
    real = attention._flat_attention
    monkeypatch.setattr(attention, "_flat_attention", lambda *a: flat.append(1) or real(*a))
    for plans in (rows, rows[2::3], rows[:1], rows[1:2]):  # mixed; decode rows; a lone chain; a tree
        positions, _ = cache.plan(plans)
        total = positions.shape[1]
        steps.append(attention._BOUND.step)
        for query in (torch.randn(1, total, heads, dim, generator=gen).to(dtype).transpose(1, 2),  # token-major
                      torch.randn(1, heads, total, dim, generator=gen).to(dtype)):  # head-major
            flat.clear()
            got, _ = attention.ragged_attention(None, query, cache.keys[0], cache.values[0], None, scaling=0.125)
            assert flat and steps[-1].flat and all(p is not None for p in steps[-1].flat.values())
            with monkeypatch.context() as m:
                m.setattr(attention, "_flat_attention", lambda *a: None)  # a call a part, as before
                want, _ = attention.ragged_attention(None, query, cache.keys[0], cache.values[0], None, scaling=0.125)
            assert torch.equal(got, want)
        cache.unbind()
    parts = ("groups", "chains", "batches") if cache.batch_chains else ("groups", "chains")
    assert all(any(getattr(step, part) for step in steps) for part in parts)  # each kind of call was compared


def _decoded(model, ctx: list[int], path: list[int]) -> list[torch.Tensor]:
    """The logits after ``ctx`` and after each token of ``path``, decoded one step at a time."""
    r = BatchRunner(model, capacity_tokens=4 * CAP, invariant=True)
    r.forward([BatchRow("d", ctx[:-1], 0, run_of(1, CAP))])
    return [r.forward([BatchRow("d", ctx + path[:i], 1, run_of(1, CAP))])[0][0] for i in range(len(path) + 1)]


def test_the_steps_chains_and_trees_share_a_call_and_give_each_token_its_decode_logits(target, monkeypatch):
    """A verify pass of two draft chains and a token tree over contexts of one key-slot count:
    where ``batched_chains_agree`` (the demo target's shape, on the CPUs measured), their
    queries attend in ONE call a layer (``attention._Chains``: the chains, and the tree as one
    chain a path), and every query's logits equal, bit for bit, those of a plain decode step of
    its own context and path."""
    calls, steps = _attention_calls(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    vocab = target.config.vocab_size
    ctxs = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (60, 41, 75)]
    chain, tree, parents = [11, 12, 13, 14], [21, 22, 23, 24, 25, 26, 27], (-1, -1, 0, 0, 1, 2, 4)
    r = BatchRunner(target, capacity_tokens=8 * CAP, invariant=True)

    def blocks(i):
        return run_of(1 + blocks_for(CAP) * i, CAP)

    r.forward([BatchRow(f"r{i}", c[:-1], 0, blocks(i)) for i, c in enumerate(ctxs)])
    calls.clear()
    a, t, b = r.forward([BatchRow("r0", ctxs[0] + chain, 5, blocks(0)),
                         BatchRow("r1", ctxs[1] + tree, 1 + len(tree), blocks(1), parents),
                         BatchRow("r2", ctxs[2] + chain[:2], 3, blocks(2))])
    assert r.cache.batch_chains == attention.batched_chains_agree(3, 3, 64, target.dtype, "cpu")
    if r.cache.batch_chains:  # 5 + 3 chained queries and the tree's 8: one call a layer
        assert [b.tokens.numel() for b in steps[-1].batches] == [5 + 3 + 8] and not steps[-1].groups
        assert len(calls) == target.config.num_hidden_layers
    for got, want in ((a, _decoded(target, ctxs[0], chain)), (b, _decoded(target, ctxs[2], chain[:2]))):
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert torch.equal(t[0], _decoded(target, ctxs[1], [])[0])
    for node in range(len(tree)):
        path = path_to(parents, node)
        assert torch.equal(t[1 + node], _decoded(target, ctxs[1], [tree[j] for j in path])[-1]), node


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_batched_chains_probe_fails_a_call_that_rounds_otherwise(dtype, monkeypatch):
    """``batched_chains_agree`` compares the step's own ``_Chains`` call with each query's
    ``_Group`` entry. Negative control: a call that computes the same attention in another order
    (scores, softmax and product as three operations) fails it."""
    import torch.nn.functional as F

    def unfused(q, k, v, mask, scaling):
        scores = (q.float() @ k.float().transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
        return (F.softmax(scores, dim=-1) @ v.float()).to(q.dtype)

    monkeypatch.setattr(attention, "_chains_call", unfused)
    assert not attention.batched_chains_agree.__wrapped__(3, 3, 64, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_chain_of_any_length_rounds_as_its_queries_alone(dtype):
    """A ``_Chain`` call (a verify pass's queries, a prompt chunk's) gives each of its 2 to 70
    queries over 64 to 1,280 keys bitwise the output of its own ``_Group`` entry, on both
    threads: its query rows are padded to a multiple of an entry's (``group_query_rows``).
    Negative control, where this CPU shows it: rows made only even, chains of 11 and 22 queries
    (34 and 66 rows, a last SDPA block of 2) round otherwise (fp32 on a 2-core AMD EPYC with
    AVX-512 BF16)."""
    kv_heads, groups, dim = 3, 3, 64
    rows = attention.group_query_rows(kv_heads, groups, dim, dtype, "cpu")

    def differing(sizes, multiple) -> list[int]:
        gen, bad = torch.Generator().manual_seed(6), []
        for length in (64, 704, 1280):
            for b in sizes:
                counts = torch.arange(length - min(b, 63), length - min(b, 63) + b).clamp(max=length)
                q = torch.randn(kv_heads, b, groups, dim, generator=gen).to(dtype)
                k, v = (torch.randn(1, kv_heads, length, dim, generator=gen).to(dtype) for _ in range(2))
                seen = torch.arange(length)[None] < counts[:, None]  # [b, L]
                mask = attention._pad_rows(seen.repeat_interleave(groups, dim=0), multiple)[None, None]
                one = attention._chain_call(q, k, v, mask, 0.125).unflatten(1, (b, groups)).transpose(0, 1)
                alone = attention._entries(q.transpose(0, 1), k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1),
                                           seen[:, None, None], 0.125, rows)
                if not torch.equal(one, alone):
                    bad.append(b)
        return bad

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs on one (``conftest.py``); a server on every core
    try:
        assert differing([*range(2, 24), 43, 64, 70], rows) == []
        control = differing([11, 22], 2) if rows > 2 else []
    finally:
        torch.set_num_threads(before)
    if not control:
        pytest.skip("chains of 2-row remainders round alike on this CPU: no negative control here")


def test_negative_control_the_fast_numerics_are_not_invariant(target):
    got = _logits_of_one_token(target, invariant=False)
    assert not all(torch.equal(logits, got["plain"]) for logits in got.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16-weights"])
def test_greedy_output_alone_batched_and_speculative(llama_pair, dtype):
    """Eight greedy requests of mixed modes and lengths, at once, each equal to its prompt alone
    with speculation off, in bf16, fp32 and fp32 on fp16 weights (the tiny pair's heads are too narrow to round
    differently here even with fast numerics: the logit-level control above is the one that
    must fail)."""
    engine = Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]),
                                     dtype=dtype), max_num_seqs=8)
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


def test_steps_are_padded_onto_the_row_counts_that_round_alike(target, monkeypatch):
    """A matrix product of few rows can take another kernel than a many-row one and round
    differently (which counts do is the CPU's and the dtype's: ``specdec.batch.numerics``
    measures them); invariant numerics pad a step's tokens and the LM head's rows up to a count
    that rounds as a large batch does. Negative control, where this CPU has such counts:
    without the padding the same 40 tokens give other logits somewhere."""
    from specdec.batch import numerics

    assert _plain_and_chained_logits(target) == 0
    agreeing = numerics.agreeing_counts(numerics.product_shapes(target), target.dtype, "cpu")
    if 1 in agreeing and 5 in agreeing:
        pytest.skip(f"{target.dtype} products of 1 and 5 rows round as a large batch's here: nothing to pad")
    monkeypatch.setattr(numerics, "padded", lambda count, agreeing: count)
    assert _plain_and_chained_logits(target) > 0


def test_the_probed_row_counts_round_as_a_large_batch():
    """What the probe reports, checked on other weights and inputs: every count it calls agreeing
    gives a 800-row product's rows bitwise, at two offsets (fp32 and bf16 ``F.linear``, and fp32
    products on half weights where this CPU has them, the demo target's shapes; on half weights
    the probe covers the grid's counts to WIDE_ROWS). Where it calls a count of half weights
    disagreeing (on an AVX2-only EPYC it does; on one with AVX-512 BF16, none), that count gives
    some other rows here too: the probe is not vacuous."""
    import torch.nn.functional as F

    from specdec.batch import numerics
    from specdec.models import packed

    gen = torch.Generator().manual_seed(1)
    cases = [(dtype, "linear") for dtype in (torch.float32, torch.bfloat16)]
    if packed.half_available():
        cases.append((torch.float32, "packed16"))
    for dtype, op in cases:
        shapes = ((op, 576, 1536), (op, 1536, 576))
        agreeing = numerics.agreeing_counts(shapes, dtype, "cpu")
        top = numerics.WIDE_ROWS if op == "packed16" else numerics.PROBE_ROWS
        assert agreeing and max(agreeing) <= numerics.WIDE_ROWS
        for _, n_in, n_out in shapes:
            w = torch.randn(n_out, n_in, generator=gen).to(dtype)
            x = torch.randn(800, n_in, generator=gen).to(dtype)
            product = functools.partial(F.linear, weight=w) if op == "linear" else \
                functools.partial(packed.linear, packed=packed.pack(w, half=True), bias=None)
            with torch.inference_mode():
                ref = product(x)
                for m in agreeing:
                    if m <= top:
                        assert all(torch.equal(product(x[s: s + m]), ref[s: s + m]) for s in (0, 5)), (dtype, op, m)
                if op == "packed16":
                    grid = sorted({numerics.on_grid(n) for n in range(1, top + 1)})
                    odd = [m for m in grid if m not in agreeing]
                    # None where the kernel rounds every count alike (FBGEMM's fp16 product on a 2-core
                    # AMD EPYC with AVX-512 BF16): then the check above covered the whole grid.
                    assert all(any(not torch.equal(product(x[s: s + m]), ref[s: s + m]) for s in range(0, 32, 1))
                                       for m in odd[:3]), odd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_grouped_query_rounds_alike_at_any_position_and_batch(dtype):
    """The invariant attention's premise (``attention._Group``): with the probed query rows, a
    query's output over its keys is bitwise the same at every position of groups of 2 to 12
    entries whose other queries see other keys. Negative control, where the probe had to add
    rows past the even count: with the query heads alone, some position rounds differently."""
    from specdec.batch import attention

    kv_heads, groups, dim = 3, 3, 64
    gen = torch.Generator().manual_seed(2)
    rows = attention.group_query_rows(kv_heads, groups, dim, dtype, "cpu")
    assert rows >= groups

    def outputs(rows):
        q0 = torch.randn(kv_heads, groups, dim, generator=gen).to(dtype)
        n = 150
        k0, v0 = (torch.randn(kv_heads, n, dim, generator=gen).to(dtype) for _ in range(2))
        length = attention.key_slots(n)
        out = []
        for entries in (2, 3, 7, 12):
            for at in range(entries):
                q = torch.randn(entries, kv_heads, groups, dim, generator=gen).to(dtype)
                k, v = (torch.randn(kv_heads, entries, length, dim, generator=gen).to(dtype) for _ in range(2))
                q[at], k[:, at, :n], v[:, at, :n] = q0, k0, v0
                mask = torch.zeros(entries, 1, 1, length, dtype=torch.bool)
                for b in range(entries):
                    mask[b, 0, 0, : n if b == at else 1 + (31 * b) % length] = True
                out.append(attention._entries(q, k.transpose(0, 1), v.transpose(0, 1), mask, 0.125, rows)[at])
        return out

    got = outputs(rows)
    assert all(torch.equal(o, got[0]) for o in got)
    if rows > groups + groups % 2:  # the probe had to add rows past the even count
        alone = outputs(groups)
        assert not all(torch.equal(o, alone[0]) for o in alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_grouped_query_rounds_alike_on_either_thread(dtype):
    """The same entry four times in one group call (CPU SDPA gives each thread a share of the
    entries): every copy's output is bitwise the same, over 60 random masked cases, with the
    probed query rows (an even count). Negative control, where this CPU shows it: with 3 rows
    (odd) an entry rounds differently on the second thread (fp32: 55 of 60 cases on a 2-core AMD
    EPYC with AVX-512 BF16; a batched greedy answer of the demo target changed with it)."""
    from specdec.batch import attention

    kv_heads, groups, dim = 3, 3, 64
    rows = attention.group_query_rows(kv_heads, groups, dim, dtype, "cpu")
    assert rows >= groups and rows % 2 == 0

    def differing(rows: int) -> int:
        gen, bad = torch.Generator().manual_seed(4), 0
        for case in range(60):
            length = (64, 128, 320)[case % 3]
            q = torch.randn(1, kv_heads, groups, dim, generator=gen).to(dtype)
            k, v = (torch.randn(1, kv_heads, length, dim, generator=gen).to(dtype) for _ in range(2))
            mask = torch.zeros(1, 1, 1, length, dtype=torch.bool)
            mask[..., : 1 + (37 * case) % length] = True
            four = [t.expand(4, *t.shape[1:]).contiguous() for t in (q, k, v, mask)]
            out = attention._entries(*four[:3], four[3], 0.125, rows)
            bad += not all(torch.equal(out[0], out[i]) for i in range(1, 4))
        return bad

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs on one (``conftest.py``); a server on every core
    try:
        assert differing(rows) == 0
        control = differing(3) if dtype == torch.float32 else None  # bf16 showed it on real data only
    finally:
        torch.set_num_threads(before)
    if control == 0:
        pytest.skip("odd query rows round alike on every thread of this CPU: no negative control here")


def _prompt_logits_fed_again(model) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A 45-token prompt's logits fed whole, and fed again as a new sequence on the same blocks
    (the pool says its first two blocks hold that prefix, as after an identical earlier request),
    and how many tokens the second forward fed."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, model.config.vocab_size, (45,), generator=gen).tolist()
    r = BatchRunner(model, capacity_tokens=4 * CAP, invariant=True)
    first = r.forward([BatchRow("a", prompt, 1, run_of(1, CAP))])[0][0]
    r.release("a")
    again = r.forward([BatchRow("b", prompt, 1, run_of(1, CAP))])[0][0]
    return first, again, r.last_fed


def test_a_prompt_fed_again_on_blocks_it_filled_gives_the_same_logits(target, monkeypatch):
    """Where a chunk's queries attend as chains (``attention.prompt_chains``: each as a decode
    step's query would), a runner trusts every full block its pool says holds the prompt's
    prefix (32 of the 45 tokens), feeds the other 13, and the logits are bitwise those of the
    whole prefill. Where they attend in one causal call, it trusts only multiples of
    ``INVARIANT_CHUNK`` (here none, so all 45 are fed again), and the logits are the same too.
    Negative control, where this model's kernels round so: causal calls, and trusting every
    full block, give other logits."""
    from specdec.batch import numerics, runner

    first, again, fed = _prompt_logits_fed_again(target)
    assert torch.equal(first, again)
    chains = attention.prompt_chains(3, 3, 64, target.dtype, "cpu")
    assert fed == (13 if chains else 45)
    monkeypatch.setattr(runner, "prompt_chains", lambda *shape: False)
    first, again, fed = _prompt_logits_fed_again(target)
    assert torch.equal(first, again) and fed == 45
    monkeypatch.setattr(numerics, "INVARIANT_CHUNK", 16)
    first, again, fed = _prompt_logits_fed_again(target)
    assert fed == 13
    if target.dtype == torch.bfloat16:
        if torch.equal(first, again) and not native_bf16():
            pytest.skip("this CPU emulates bf16, and its kernels round both prefills alike: no negative control here")
        assert not torch.equal(first, again)
