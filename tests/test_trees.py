"""Token trees in the runner: tree attention, and compaction of the accepted path.

Every node's logits must equal those of a fresh forward over the node's root-to-node path, and
after ``accept`` the pool must hold what a fresh prefill of context + path writes."""

import pytest
import torch

from specdec import trees
from specdec.batch.blocks import blocks_for, run_of
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.loading import load_model

CAP = 64

# (tokens, parents): a chain, a bushy tree, a deep and narrow one
SHAPES = [
    ([7, 8, 9], (-1, 0, 1)),
    ([7, 11, 13, 8, 21, 9], (-1, -1, -1, 0, 0, 3)),
    ([7, 8, 30, 9, 31, 10], (-1, 0, 0, 1, 2, 3)),
]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request, llama_pair, gpt2_pair):
    pair = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return load_model(str(pair["target"]))


def full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_tree_helpers():
    tokens, parents = SHAPES[1]
    trees.check(parents)
    assert trees.depths(parents) == [1, 1, 1, 2, 2, 3]
    assert trees.children(parents, trees.ROOT) == [0, 1, 2]
    assert trees.path_to(parents, 5) == [0, 3, 5]
    assert trees.follow(tokens, parents, [7, 8, 9, 4]) == [0, 3, 5]
    assert trees.follow(tokens, parents, [13, 1]) == [2]
    with pytest.raises(ValueError):
        trees.check((-1, 1))


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_every_node_sees_its_own_path(model, shape):
    tokens, parents = SHAPES[shape]
    runner = BatchRunner(model, capacity_tokens=4 * CAP)
    prompt = [5, 17, 42, 8, 99]
    runner.forward([BatchRow("s", prompt[:-1], 0, run_of(1, CAP))])  # the target holds all but the pending token
    # a second sequence in the same pass, plain, to show trees and rows mix
    out = runner.forward([BatchRow("s", prompt + tokens, len(tokens) + 1, run_of(1, CAP), parents),
                          BatchRow("o", [3, 4, 5], 1, run_of(1 + blocks_for(CAP), CAP))])
    scored = out[0]
    assert torch.allclose(scored[0], full_logits(model, prompt)[-1], atol=1e-5)  # the root
    for i in range(len(tokens)):
        path = [tokens[j] for j in trees.path_to(parents, i)]
        assert torch.allclose(scored[1 + i], full_logits(model, prompt + path)[-1], atol=1e-5), i
    assert torch.allclose(out[1][0], full_logits(model, [3, 4, 5])[-1], atol=1e-5)


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_accepting_a_path_leaves_the_cache_of_a_fresh_prefill(model, shape):
    tokens, parents = SHAPES[shape]
    runner = BatchRunner(model, capacity_tokens=4 * CAP)
    prompt = [5, 17, 42, 8, 99]
    runner.forward([BatchRow("s", prompt + tokens, len(tokens) + 1, run_of(1, CAP), parents)])
    path = trees.path_to(parents, len(tokens) - 1)  # the last node's path: moved, not in place
    runner.accept([("s", path)])
    kept = prompt + [tokens[j] for j in path]
    assert runner.cached_ids("s") == kept
    cont = kept + [3]
    step = runner.forward([BatchRow("s", cont, 1, run_of(1, CAP))])[0]
    assert runner.last_fed == 1
    assert torch.allclose(step[0], full_logits(model, cont)[-1], atol=1e-5)
    fresh = BatchRunner(model, capacity_tokens=4 * CAP)
    fresh.forward([BatchRow("f", cont, 1, run_of(1 + 2 * blocks_for(CAP), CAP))])
    a, b = slice(1, 1 + len(cont)), slice(1 + 2 * CAP, 1 + 2 * CAP + len(cont))
    for la, lb in zip(runner.cache.keys + runner.cache.values, fresh.cache.keys + fresh.cache.values):
        assert torch.allclose(la[:, a], lb[:, b], atol=1e-5)


def test_a_tree_grows_level_by_level_and_settles_along_the_ids(model):
    """How a drafter with a cache builds a tree: one pass per level, earlier levels kept; the
    next round's context settles the path it took without being told."""
    tokens, parents = SHAPES[1]
    runner = BatchRunner(model, capacity_tokens=4 * CAP)
    prompt = [5, 17, 42, 8, 99]
    runner.forward([BatchRow("s", prompt, 1, run_of(1, CAP))])
    for lo, hi in ((0, 3), (3, 5), (5, 6)):  # nodes 0-2, then 3-4, then 5
        got = runner.forward([BatchRow("s", prompt + tokens[:hi], hi - lo, run_of(1, CAP), parents[:hi])])[0]
        new = range(lo, hi)
        assert runner.last_fed == len(new)  # only the new level was fed
        for row, i in zip(got, new):
            path = [tokens[j] for j in trees.path_to(parents, i)]
            assert torch.allclose(row, full_logits(model, prompt + path)[-1], atol=1e-5)
    # the next round: the path 7 -> 8 -> 9 was taken, and the bonus token 4 follows
    cont = prompt + [7, 8, 9, 4]
    step = runner.forward([BatchRow("s", cont, 1, run_of(1, CAP))])[0]
    assert runner.last_fed == 1  # 7, 8, 9 came from the tree
    assert torch.allclose(step[0], full_logits(model, cont)[-1], atol=1e-5)


# --- trees through the engine: greedy equality, rows joining and leaving, exact sampling ----

import threading  # noqa: E402

from three_tokens import batched_result  # noqa: E402

from specdec.bench.tiny import synthetic_corpus  # noqa: E402
from specdec.config import ModelConfig, SpeculationConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.policy import PolicyConfig  # noqa: E402

PROMPTS = [" ".join(p.split()[:4]) for p in synthetic_corpus(n_sentences=16, seed=77)]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def engine(request, llama_pair, gpt2_pair):
    paths = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return Engine.load(ModelConfig(target=str(paths["target"]), draft=str(paths["draft"]), dtype="float32"),
                       SpeculationConfig(tree_width=3), kv_cache_tokens=8192, max_num_seqs=8)


def tree_shape(engine, nodes: int, width: int) -> None:
    engine.policy_config = PolicyConfig(tree_nodes=nodes)
    engine.loop.draft.drafter.tree_width = width


@pytest.mark.parametrize("nodes,width,k", [(6, 2, 3), (16, 4, 4), (3, 3, 1), (12, 1, 5), (16, 8, 8)])
def test_draft_tree_greedy_equals_plain_decoding(engine, nodes, width, k):
    """Several shapes: bushy, wide and shallow (depth 1), a chain of width 1, and a deep wide
    one (width 8) whose growing tree would outgrow the row's range in the draft's cache near the end."""
    assert "draft_tree" in engine.drafters
    tree_shape(engine, nodes, width)
    accepted = 0
    for prompt in PROMPTS[:6]:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=24, mode="off")
        spec = engine.generate(ids, max_tokens=24, mode="draft_tree", k=k)
        assert spec.token_ids == plain.token_ids, (prompt, nodes, width, k)
        accepted += spec.speculation.accepted_tokens
        assert all(r.drafted <= nodes and r.draft_error is None for r in spec.rounds)
    assert accepted > 20, accepted


def test_trees_chains_and_plain_rows_share_steps_joining_and_leaving(engine):
    """Requests of every mode, with different lengths, arriving while others run: each gets its
    plain tokens, and the tree's longer accepted paths show."""
    tree_shape(engine, 12, 3)
    ids = [engine.encode(prompt=p) for p in PROMPTS[6:14]]
    lengths = [8 + 5 * j for j in range(len(ids))]
    plain = [engine.generate(i, max_tokens=n, mode="off").token_ids for i, n in zip(ids, lengths)]
    modes = ["draft_tree", "draft", "off", "draft_tree", "auto", "ngram", "draft_tree", "draft"]
    got = {}

    def run(j):
        got[j] = engine.generate(ids[j], max_tokens=lengths[j], mode=modes[j], k=3).token_ids

    threads = []
    for j in range(len(ids)):
        threads.append(threading.Thread(target=run, args=(j,)))
        threads[-1].start()
        if j % 3 == 2:
            threads[-2].join(timeout=120)  # some finish before the next ones join
    [t.join(timeout=120) for t in threads]
    assert [got[j] for j in range(len(ids))] == plain


def test_tree_verification_keeps_the_target_distribution(llama_pair, monkeypatch):
    """Chi-square over 4 sampled tokens (top_k=3: 81 cells, cells expected below 5 pooled) at
    significance 1e-3, 3,000 seeded samples of mode draft_tree, 16 at a time. Negative control:
    the same test with a verifier that skips the residual update after a rejected candidate
    (it samples from p again, rejected token included) must fail."""
    import specdec.batch.verify as batch_verify

    engine = Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]), dtype="float32"),
                         SpeculationConfig(tree_width=3), kv_cache_tokens=8192, max_num_seqs=16)
    tree_shape(engine, 8, 3)
    ids = engine.encode(prompt=PROMPTS[3])
    n = 3000
    honest = batched_result(engine, ids, n, "draft_tree", k=2, length=4)
    assert honest["drafted"] >= 2 * n and honest["impossible"] == 0 and honest["p"] > 1e-3, honest
    monkeypatch.setattr(batch_verify, "remove_candidate", lambda p, token: p)
    control = batched_result(engine, ids, n, "draft_tree", k=2, length=4)
    assert control["impossible"] > 0 or control["p"] < 1e-3, control


def test_point_mass_candidates_leave_p_exactly_analytically():
    """In float64: the token a node emits under multi-candidate sampling with point-mass
    candidates (accept x_j with p'(x_j), else remove it and renormalise; none: the residual)
    has distribution p exactly, for any candidate order, and with the residual update skipped
    it does not (the negative control of the chi-square test, here exactly)."""
    from specdec.batch.verify import remove_candidate

    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        p = torch.rand(7, generator=gen, dtype=torch.float64) ** 3
        p[trial % 7] = 0.0  # a candidate the target never emits
        p /= p.sum()
        candidates = torch.randperm(7, generator=gen)[: 1 + trial % 5].tolist()

        def emitted(update):
            out, reach, cur = torch.zeros_like(p), 1.0, p
            for x in candidates:
                out[x] += reach * cur[x]
                reach *= 1 - cur[x]
                cur = update(cur, x)
            return out + reach * cur

        assert torch.allclose(emitted(remove_candidate), p, atol=1e-12)
        if 0 < float(p[candidates[0]]) < 1:
            assert not torch.allclose(emitted(lambda q, x: q), p, atol=1e-6)
