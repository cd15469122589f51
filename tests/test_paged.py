"""Paged KV and prefix caching: blocks as sequences grow, shared prompt prefixes, preemption.

Exactness in fp32 on the tiny Llama pair: a prompt whose first blocks come from the prefix
cache gets the logits a fresh prefill gives; requests sharing a system prompt (one after
another and at once, chains and trees) get plain decoding's tokens; a pool too small for
its requests preempts and recomputes them, token-identical; a pool smaller than the working
set evicts cached blocks and still answers every request exactly.
"""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.batch.blocks import BLOCK, BlockPool, prefix_hashes, run_of
from specdec.batch import attention
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.bench.tiny import synthetic_corpus
from specdec.config import ModelConfig
from specdec.engine import Engine
from specdec.loading import load_model

PROMPTS = [" ".join(p.split()[:6]) for p in synthetic_corpus(n_sentences=16, seed=5)]


# --- the block pool ------------------------------------------------------------------------


def test_blocks_are_allocated_referenced_and_evicted_least_recently_used_first():
    pool = BlockPool(7)  # blocks 1..6
    a = pool.allocate(3)
    assert len(set(a)) == 3 and 0 not in a and pool.free_blocks == 3
    assert pool.allocate(4) is None and pool.free_blocks == 3  # nothing taken by a failed allocation
    names = prefix_hashes(list(range(3 * BLOCK)))
    for block, name in zip(a, names):
        pool.register(block, name)
    b = pool.match(names[:2])
    assert b == a[:2] and pool.refs(a[0]) == 2
    pool.release(a)  # a leaves: its blocks stay cached (b still holds two of them)
    assert pool.refs(a[0]) == 1 and pool.cached_blocks == 1 and pool.free_blocks == 4
    pool.release(b)
    assert pool.cached_blocks == 3 and pool.free_blocks == 6
    # Free blocks go first; then cached ones, the tail of a prefix before its head.
    c = pool.allocate(4)
    assert a[2] in c and a[0] not in c and a[1] not in c and pool.evicted == 1
    assert pool.match(names) == [a[0], a[1]]  # the head survived; the evicted tail is a miss
    assert pool.allocate(1) is None  # 4 in use, 2 referenced by the match: nothing left


def test_a_prefix_is_named_by_every_token_before_it():
    ids = list(range(5 * BLOCK))
    names = prefix_hashes(ids)
    assert len(names) == 5 and len(set(names)) == 5
    other = ids[:]
    other[BLOCK + 3] = 999  # block 1 differs: blocks 1.. are named differently, block 0 the same
    changed = prefix_hashes(other)
    assert changed[0] == names[0] and all(x != y for x, y in zip(changed[1:], names[1:]))
    assert prefix_hashes(ids, start=names[:2]) == names  # continued from known names
    assert prefix_hashes(ids[: BLOCK - 1]) == []  # only full blocks have names


def test_a_pool_without_caching_shares_nothing():
    pool = BlockPool(4, caching=False)
    a = pool.allocate(2)
    names = prefix_hashes(list(range(2 * BLOCK)))
    pool.register(a[0], names[0])
    assert pool.match(names) == []
    pool.release(a)
    assert pool.free_blocks == 3 and pool.cached_blocks == 0


# --- a runner on shared blocks -------------------------------------------------------------


@pytest.fixture(scope="module")
def model(llama_pair):
    return load_model(str(llama_pair["target"]), "float32")


def full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_a_prefix_cached_prefill_gives_a_fresh_prefills_logits(model):
    """Sequence b's first two blocks are sequence a's (the same 32-token prefix): b feeds only
    its own tokens, and every logit of its prefill equals a fresh prefill's; a runner whose
    pool never filled those blocks (a restarted worker) feeds b whole."""
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 300, (2 * BLOCK,), generator=gen).tolist()
    a = prefix + torch.randint(0, 300, (7,), generator=gen).tolist()
    b = prefix + torch.randint(0, 300, (11,), generator=gen).tolist()
    runner = BatchRunner(model, capacity_tokens=16 * BLOCK)
    table_a = run_of(1, len(a) + 1)
    runner.forward([BatchRow("a", a, 1, table_a)])
    table_b = table_a[:2] + run_of(10, len(b) - 2 * BLOCK + 1)  # shares a's first two blocks
    got = runner.forward([BatchRow("b", b, len(b) - 2 * BLOCK, table_b)])[0]
    assert runner.last_fed == len(b) - 2 * BLOCK and runner.cached_ids("b") == b
    fresh = BatchRunner(model, capacity_tokens=16 * BLOCK)
    want = fresh.forward([BatchRow("b", b, len(b) - 2 * BLOCK, run_of(1, len(b) + 1))])[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, full_logits(model, b)[2 * BLOCK:], rtol=1e-4, atol=1e-4)
    # a goes on (decodes past its blocks) while b reads them: both stay exact
    outs = runner.forward([BatchRow("a", a + [5], 1, table_a), BatchRow("b", b + [6], 1, table_b)])
    torch.testing.assert_close(outs[0][0], full_logits(model, a + [5])[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1][0], full_logits(model, b + [6])[-1], rtol=1e-4, atol=1e-4)
    # the same table on a pool that never held the prefix: nothing is trusted, b is fed whole
    fresh.release("b")
    other = BatchRunner(model, capacity_tokens=16 * BLOCK)
    other.forward([BatchRow("b", b, 1, table_b)])
    assert other.last_fed == len(b)


def test_a_block_written_again_is_no_longer_trusted(model):
    """A pool forgets what a block held as soon as anything writes it (here: the block is
    handed to another sequence, which fills it with other tokens)."""
    ids = list(range(3, 3 + 2 * BLOCK + 4))
    runner = BatchRunner(model, capacity_tokens=8 * BLOCK)
    runner.forward([BatchRow("a", ids, 1, run_of(1, len(ids)))])
    runner.release("a")
    runner.forward([BatchRow("c", [9] * (BLOCK + 2), 1, (1, 2))])  # block 1 now holds c's tokens
    runner.forward([BatchRow("b", ids + [7], 1, run_of(1, len(ids) + 1))])
    assert runner.last_fed == len(ids) + 1  # block 1 is c's now: b trusts nothing after it


# --- the step loop -------------------------------------------------------------------------

SYSTEM = " ".join(synthetic_corpus(n_sentences=10, seed=11))  # a shared system prompt, several blocks


def _engine(pair, **kw):
    spec = {"numerics": "fast", **kw.pop("models", {})}
    return Engine.load(ModelConfig(target=str(pair["target"]), draft=str(pair["draft"]), dtype="float32",
                                   early_exit_layer=2, **spec), **kw)


@pytest.fixture(scope="module")
def engine(llama_pair):
    return _engine(llama_pair, kv_cache_tokens=4096, max_num_seqs=8)


@pytest.fixture(scope="module")
def plain(llama_pair):
    """The reference: the same models, no prefix cache."""
    return _engine(llama_pair, kv_cache_tokens=4096, max_num_seqs=8, prefix_caching=False)


def _greedy(engine, ids, n=16, mode="off", k=None):
    return engine.generate(ids, max_tokens=n, mode=mode, k=k, ignore_eos=True)


def test_a_shared_system_prompt_is_prefilled_once_and_answers_are_unchanged(engine, plain):
    """Requests with one system prompt and their own questions, one after another and then at
    once, chains and trees: every answer is plain decoding's without a prefix cache; all but
    the first take the system prompt's blocks from the cache, and say so."""
    ids = [engine.encode(prompt=SYSTEM + " " + q) for q in PROMPTS[:6]]
    assert len(engine.encode(prompt=SYSTEM)) >= 4 * BLOCK
    want = [_greedy(plain, i).token_ids for i in ids]
    hits_before = engine.loop.usage()["prefix_hit_tokens"]
    first = _greedy(engine, ids[0])
    assert first.token_ids == want[0]
    cached = []
    for i in range(1, 3):  # in sequence
        handle = engine.loop.submit(engine.request(ids[i], max_tokens=16, mode="off", ignore_eos=True))
        events = list(handle)
        cached.append(events[0].cached_tokens)
        assert [t for e in events for t in e.token_ids] == want[i]
    assert all(c >= 4 * BLOCK and c % BLOCK == 0 for c in cached)
    modes = [("draft", 3), ("ngram", 2), ("draft_tree", 3), ("early_exit", 2)]
    results = {}

    def run(j):
        mode, k = modes[j]
        results[j] = _greedy(engine, ids[2 + j] if j else ids[1], mode=mode, k=k)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(modes))]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    for j in range(len(modes)):
        assert results[j].token_ids == want[2 + j if j else 1], modes[j]
    assert sum(r.speculation.drafted_tokens for r in results.values()) > 0
    usage = engine.loop.usage()
    assert usage["prefix_hit_tokens"] - hits_before >= 6 * 4 * BLOCK
    assert usage["running"] == 0 and usage["free_tokens"] == usage["capacity_tokens"]


def test_requests_with_large_max_tokens_and_short_answers_run_at_once(llama_pair):
    """Blocks are taken as answers grow: eight requests that may each write 480 tokens, in a
    pool of 512, all run at once (a reservation of prompt + max_tokens would hold one)."""
    engine = _engine(llama_pair, kv_cache_tokens=512, max_num_seqs=8)
    ids = [engine.encode(prompt=p) for p in PROMPTS[:8]]
    solo = [_greedy(engine, i, n=12).token_ids for i in ids]
    engine.loop.peak_running = 0
    results = {}
    barrier = threading.Barrier(8)

    def run(i):
        barrier.wait()
        # stop at the solo answer's 10th token: a short answer, however long it may be
        results[i] = engine.generate(ids[i], max_tokens=480, mode="off", ignore_eos=True,
                                     stop_token_ids=[solo[i][9]])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    for i in range(8):
        end = solo[i].index(solo[i][9]) + 1
        assert results[i].token_ids == solo[i][:end]
    assert engine.loop.peak_running == 8 and engine.loop.preempted == 0


def test_a_pool_too_small_preempts_and_recomputes_token_for_token(llama_pair):
    """Six requests of 60 output tokens in a pool of 12 blocks: they cannot all grow, so the
    newest are preempted (blocks freed) and resume by prefilling their tokens so far; each
    answer equals its plain decoding alone, in chains too."""
    ref = _engine(llama_pair, kv_cache_tokens=4096)
    engine = _engine(llama_pair, kv_cache_tokens=12 * BLOCK, max_num_seqs=6)
    ids = [engine.encode(prompt=p) for p in PROMPTS[8:14]]
    want = [_greedy(ref, i, n=60).token_ids for i in ids]
    modes = [("off", None), ("draft", 3), ("off", None), ("ngram", 2), ("draft", 2), ("off", None)]
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _greedy(engine, ids[i], 60, *modes[i])))
               for i in range(6)]
    [t.start() for t in threads]
    [t.join(timeout=180) for t in threads]
    for i in range(6):
        assert results[i].token_ids == want[i], modes[i]
    usage = engine.loop.usage()
    assert usage["preempted"] > 0 and usage["running"] == 0 and usage["free_tokens"] == usage["capacity_tokens"]


def test_a_pool_smaller_than_the_working_set_evicts_and_stays_exact(llama_pair):
    """Prompts that share a prefix two by two, more of them than the pool can keep cached:
    cached blocks are evicted (least recently used first) and every answer is still exact;
    a prefix asked for again after its eviction is prefilled again."""
    ref = _engine(llama_pair, kv_cache_tokens=4096, prefix_caching=False)
    engine = _engine(llama_pair, kv_cache_tokens=16 * BLOCK, max_num_seqs=2)
    bases = [" ".join(synthetic_corpus(n_sentences=3, seed=s)) for s in range(5)]
    ids = [engine.encode(prompt=b + " " + q) for b in bases for q in PROMPTS[:2]]
    ids += ids[:2]  # the first prefix again, long evicted
    for i in ids:
        assert _greedy(engine, i, n=8).token_ids == _greedy(ref, i, n=8).token_ids
    assert engine.loop.blocks.evicted > 0 and engine.loop.usage()["prefix_hit_tokens"] > 0


def test_invariant_numerics_take_hits_on_the_chunk_grid(llama_pair):
    """With batch-invariant numerics a prompt is prefilled in fixed chunks; a prefix hit ends
    where a chunk does, so the cached prompt's KV is what its own prefill would write."""
    engine = _engine(llama_pair, kv_cache_tokens=4096, step_tokens=48, max_num_seqs=16,
                     models={"numerics": "batch_invariant"})
    assert engine.loop.chunk == 32
    plain = _engine(llama_pair, kv_cache_tokens=4096, step_tokens=48, max_num_seqs=16, prefix_caching=False,
                    models={"numerics": "batch_invariant"})
    ids = [engine.encode(prompt=SYSTEM + " " + q) for q in PROMPTS[:3]]
    for i in ids:
        events = list(engine.loop.submit(engine.request(i, max_tokens=12, mode="draft", k=3, ignore_eos=True)))
        assert events[0].cached_tokens % 32 == 0
        assert [t for e in events for t in e.token_ids] == _greedy(plain, i, 12, "draft", 3).token_ids
    assert engine.loop.usage()["prefix_hit_tokens"] >= 2 * 64


def test_a_unit_keeps_the_pool_size_its_first_start_measured(tmp_path, monkeypatch):
    """A restarted target worker gets the size the unit measured at its first start, not a
    new measurement (``deployments.workers``); a configured size always wins."""
    from deployments import workers

    monkeypatch.setattr(workers, "POOL_SIZES", tmp_path)
    assert workers.pool_tokens("unit-a", None) is None  # the first start measures
    workers.remember_pool("unit-a", 4096)
    assert workers.pool_tokens("unit-a", None) == 4096  # a restart
    assert workers.pool_tokens("unit-a", 512) == 512 and workers.pool_tokens("unit-b", None) is None



def _chunked(runner, key, ids, table, start, chunk=128):
    """Prefill ``ids`` from ``start`` in the chunks the step loop cuts; the last position's logits."""
    for a in range(start, len(ids), chunk):
        end = min(len(ids), a + chunk)
        out = runner.forward([BatchRow(key, ids[:end], 1 if end == len(ids) else 0, table)])
    return out[0]


@pytest.mark.parametrize("hit, chains, same", [(256, False, True), (192, False, False), (192, True, True),
                                               (208, True, True)])
def test_invariant_numerics_a_hit_on_the_chunk_grid_is_bitwise_a_fresh_prefill(hit, chains, same, monkeypatch):
    """bf16, batch-invariant numerics, prompts in chunks of 128: a prompt whose first 256 tokens
    come from another request's blocks gets, bit for bit, the logits of its own whole prefill.
    Where its chunks attend in causal calls, a hit off the chunk grid (192: what follows is cut
    elsewhere) does not: the step loop then takes hits on the grid only (the negative control);
    where they attend as chains (``attention.prompt_chains``), a hit at any block does."""
    from specdec.batch import runner as runners
    from specdec.bench.overhead import build_model

    shape = dict(hidden_size=576, intermediate_size=64, num_hidden_layers=6, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=512, max_position_embeddings=1024)
    if chains and not attention.prompt_chains(3, 3, 64, torch.bfloat16, "cpu"):
        pytest.skip("this CPU's attention kernels round a long chain otherwise: prompts attend in causal calls")
    monkeypatch.setattr(runners, "prompt_chains", lambda *shape: chains)
    model = build_model(shape)
    with torch.no_grad():  # weights of a trained model's scale: attention that is not uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model = model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 512, (300,), generator=gen).tolist()
    b = a + torch.randint(0, 512, (100,), generator=gen).tolist()
    runner = BatchRunner(model, capacity_tokens=64 * BLOCK, invariant=True)
    table_a = run_of(1, len(a) + 1)
    _chunked(runner, "a", a, table_a, 0)
    got = _chunked(runner, "b", b, table_a[: hit // BLOCK] + run_of(30, len(b) - hit + 1), hit)
    fresh = BatchRunner(model, capacity_tokens=64 * BLOCK, invariant=True)
    want = _chunked(fresh, "b", b, run_of(1, len(b) + 1), 0)
    assert torch.equal(got, want) == same


def test_growing_sequences_keep_their_blocks_consecutive():
    """Four sequences admitted one after another and grown in turns each keep one run of
    blocks (the attention reads it as a view, no gather), while the pool has room."""
    pool = BlockPool(65)
    tables = [pool.allocate(2) for _ in range(4)]
    for _ in range(3):
        for t in tables:
            t.extend(pool.allocate(1, after=t[-1]))
    assert all(t == list(range(t[0], t[0] + 5)) for t in tables) and len({t[0] for t in tables}) == 4
    full = BlockPool(4)
    a, b = full.allocate(1), full.allocate(1)
    assert len(full.allocate(1, after=a[-1])) == 1  # no neighbour free: any free block still serves


def test_a_prompt_continues_its_cached_prefix_in_the_blocks_after_it():
    """The blocks after a cached prefix held an earlier request's continuation: a new prompt
    that shares the prefix takes them (evicted), so its table is one run; a block that is in
    use is never taken."""
    pool = BlockPool(33)
    first = pool.allocate(6)
    names = prefix_hashes(list(range(6 * BLOCK)))
    for block, name in zip(first, names):
        pool.register(block, name)
    pool.release(first)
    hits = pool.match(names[:4])
    rest = pool.allocate(3, after=hits[-1], evict_next=True)
    assert hits + rest == list(range(first[0], first[0] + 7)) and pool.evicted == 2
    again = pool.match(names[:4])
    other = pool.allocate(1, after=again[-1], evict_next=True)
    assert other[0] != rest[0]  # in use by the first continuation: elsewhere


def _logprobs(engine, ids, n):
    """Greedy tokens and each one's log-probability (the logits' bits, where tokens hide them)."""
    out = engine.generate(ids, max_tokens=n, mode="off", ignore_eos=True, logprobs=0)
    return out.token_ids, [entry[0] for entry in out.logprobs], out


def test_invariant_numerics_a_preempted_request_resumes_bit_for_bit(llama_pair):
    """Batch-invariant numerics, a pool too small for four answers: the preempted requests
    prefill their prompts in chunks again but the tokens they had generated in pieces whose
    queries attend alone, as the decode steps that made them did; every token's
    log-probability equals, bitwise, the one the request got alone in a large pool (fed as a
    chunk, 7 and 18 of 60 of them differed on the tiny Llama)."""
    invariant = {"numerics": "batch_invariant"}
    ref = _engine(llama_pair, kv_cache_tokens=4096, models=invariant)
    engine = _engine(llama_pair, kv_cache_tokens=10 * BLOCK, max_num_seqs=4, models=invariant)
    ids = [engine.encode(prompt=p) for p in PROMPTS[8:12]]
    want = [_logprobs(ref, i, 60)[:2] for i in ids]
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _logprobs(engine, ids[i], 60)[:2]))
               for i in range(4)]
    [t.start() for t in threads]
    [t.join(timeout=180) for t in threads]
    assert engine.loop.usage()["preempted"] > 0
    for i in range(4):
        assert results[i] == want[i], i


def test_invariant_numerics_share_prompts_only_a_next_turn_is_bit_for_bit_a_fresh_prefill(llama_pair):
    """Batch-invariant numerics: a conversation's next turn (the first prompt, its answer, more)
    takes from the prefix cache the first turn's prompt (its full blocks, or its whole chunks
    where prompts prefill in causal calls), not the blocks its answer
    filled (decode steps computed those; the next turn's own prefill computes them as a
    chunk, which rounds otherwise): its log-probabilities equal, bitwise, those of a unit
    without a prefix cache."""
    invariant = {"numerics": "batch_invariant"}
    engine = _engine(llama_pair, kv_cache_tokens=4096, models=invariant)
    fresh = _engine(llama_pair, kv_cache_tokens=4096, prefix_caching=False, models=invariant)
    first = engine.encode(prompt=SYSTEM + " " + PROMPTS[0])
    assert 128 < len(first) < 256
    answer = _logprobs(engine, first, 140)[0]
    nxt = first + answer + engine.encode(prompt=PROMPTS[1])
    got = _logprobs(engine, nxt, 24)
    shared = len(first) // BLOCK * BLOCK if engine.loop.prefix_grid == 1 else 128  # (``BatchRunner.prefix_grid``)
    assert got[2].rounds and engine.loop.usage()["prefix_hit_tokens"] == shared  # the first prompt's blocks
    assert got[:2] == _logprobs(fresh, nxt, 24)[:2]


def _demo_shaped_units():
    """A unit (fp32, batch-invariant numerics, no draft model) over a 2-layer model with the
    demo target's attention shape, where prompt chunks attend as chains on this CPU (skips
    where they do not), and a maker of fresh units over the same model."""
    from specdec.bench.overhead import build_model, engine_for
    from specdec.bench.tiny import build_tokenizer, synthetic_corpus

    if not attention.prompt_chains(3, 3, 64, torch.float32, "cpu"):
        pytest.skip("this CPU's attention kernels round a long chain otherwise: prompts share whole chunks only")
    tok = build_tokenizer(synthetic_corpus(500))
    model = build_model(dict(hidden_size=576, intermediate_size=64, num_hidden_layers=2, num_attention_heads=9,
                             num_key_value_heads=3, vocab_size=len(tok), max_position_embeddings=1024))
    with torch.no_grad():  # weights of a trained model's scale: attention that is not uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)

    def unit():
        return engine_for(model, tok, max_num_seqs=4, kv_cache_tokens=2048, numerics="batch_invariant")

    engine = unit()
    assert engine.loop.prefix_grid == 1
    return engine, unit


def test_invariant_numerics_a_short_prompt_asked_again_is_prefilled_once_bit_for_bit():
    """Batch-invariant numerics where a prompt chunk's queries attend as a decode step's do
    (``BatchRunner.prefix_grid`` 1; the demo target's attention shape): a prompt shorter than a
    chunk, asked again, takes every full block from the prefix cache (a whole chunk is the
    least a causal prefill could share), and its log-probabilities equal, bitwise, those of
    its first prefill in a fresh unit."""
    engine, unit = _demo_shaped_units()
    ids = engine.encode(prompt=SYSTEM)[:90]
    first = _logprobs(engine, ids, 12)
    again = _logprobs(engine, ids, 12)
    assert engine.loop.usage()["prefix_hit_tokens"] == 80  # 5 of its blocks; the rest is fed
    assert again[:2] == first[:2] == _logprobs(unit(), ids, 12)[:2]


def test_invariant_numerics_with_prompt_chains_a_next_turn_takes_the_answer_blocks_too_bit_for_bit():
    """Where a prompt chunk's queries attend as a decode step's do (``prefix_grid`` 1), the
    keys and values decode steps wrote are what a prefill would write: a conversation's next
    turn (the first prompt, its answer, more) takes from the prefix cache the answer's full
    blocks as well as the prompt's, and its log-probabilities equal, bitwise, those of a fresh
    unit that prefills it all."""
    engine, unit = _demo_shaped_units()
    first = engine.encode(prompt=SYSTEM)[:40]
    answer = _logprobs(engine, first, 60)[0]
    nxt = first + answer + engine.encode(prompt=PROMPTS[1])
    before = engine.loop.usage()["prefix_hit_tokens"]
    got = _logprobs(engine, nxt, 12)
    assert engine.loop.usage()["prefix_hit_tokens"] - before == (len(first) + len(answer)) // BLOCK * BLOCK
    assert got[:2] == _logprobs(unit(), nxt, 12)[:2]
