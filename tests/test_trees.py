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

from three_tokens import assert_tree_sampling_exact  # noqa: E402

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
    significance 1e-3, 3,000 seeded samples of mode draft_tree, 16 at a time: candidates drawn
    from q without replacement, recursive rejection sampling. Negative control: the same test
    with a verifier that skips the residual update after a rejected candidate (it tries the next
    one against p again) must fail."""
    engine = Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]), dtype="float32"),
                         SpeculationConfig(tree_width=3), kv_cache_tokens=8192, max_num_seqs=16)
    tree_shape(engine, 8, 3)
    assert_tree_sampling_exact(engine, engine.encode(prompt=PROMPTS[3]), 3000, "draft_tree", monkeypatch, k=2)


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


def test_recursive_rejection_over_a_draw_without_replacement_leaves_p_exactly_analytically():
    """In float64: the token a node emits under ``recursive_rejection``, averaged over every
    ordered draw of m candidates without replacement from q (each with its probability
    prod_j q_j(x_j)), is distributed as p, for q far from p and near it, with zeros in either;
    and it is not with the residual update skipped, nor with q kept whole after a draw (a
    verifier that forgets the draw was without replacement)."""
    import itertools

    from specdec.batch import verify as bv

    def emitted(p, q, m, residual=bv.rejection_residual, drop=bv.drop_drawn):
        out = torch.zeros_like(p)
        for draw in itertools.permutations(range(len(p)), m):
            weight, qj = 1.0, q
            for x in draw:  # the draw's probability: each candidate from q without the earlier ones
                weight *= float(qj[x])
                qj = bv.drop_drawn(qj, x)
            if weight == 0:
                continue
            reach, pj, qj = weight, p, q
            for x in draw:
                accept = min(1.0, float(pj[x] / qj[x]))
                out[x] += reach * accept
                reach *= 1 - accept
                pj, qj = residual(pj, qj), drop(qj, x)
            out += reach * pj
        return out

    gen = torch.Generator().manual_seed(5)
    for trial in range(12):
        p = torch.rand(5, generator=gen, dtype=torch.float64) ** 2
        q = torch.rand(5, generator=gen, dtype=torch.float64) ** (3 if trial % 2 else 0.3)
        p[trial % 5], q[(trial + 2) % 5] = 0.0, 0.0  # a token the target never emits, one q never draws
        p, q = p / p.sum(), q / q.sum()
        m = 1 + trial % 3
        assert torch.allclose(emitted(p, q, m), p, atol=1e-12), trial
        assert not torch.allclose(emitted(p, q, m, residual=lambda a, b: a), p, atol=1e-6), trial
        if m > 1:
            assert not torch.allclose(emitted(p, q, m, drop=lambda a, x: a), p, atol=1e-6), trial


def test_a_sampled_tree_draws_its_candidates_and_verifies_every_draw():
    """A sampled row's tree carries q and the draw at each node it expanded; candidates drawn
    but not kept as nodes are still verified: accepting one ends the round with it."""
    from specdec.batch.verify import VerifyRow, verify_batch
    from specdec.drafters.base import DraftRow, Trees, draw_without_replacement
    from specdec.sampling import SamplingParams

    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.0, 0.6, 0.3, 0.1, 0.0]])
    for _ in range(50):  # never a token of probability 0, never twice
        logq, ids = draw_without_replacement(q, 4, gen)
        drawn = [i for v, i in zip(logq[0].tolist(), ids[0].tolist()) if v > float("-inf")]
        assert sorted(drawn) == [1, 2, 3]

    params = SamplingParams(temperature=1.0)
    row = DraftRow("r", [1, 2, 3], k=2, params=params, seed=7, nodes=2)
    grown = Trees([row], width=3)
    logits = torch.log(torch.tensor([[0.0, 0.5, 0.3, 0.2, 0.0]]) + 1e-30)
    grown.extend(logits, [0])
    grown.feed(0)
    grown.extend(logits, [0])
    [proposal] = grown.drafted()
    assert len(proposal.tokens) == 2 and proposal.branches is not None
    assert proposal.probs.shape[0] == len(proposal.branches)
    root = dict(proposal.branches)[trees.ROOT]
    assert len(root) == 3 and set(root) == {1, 2, 3}  # three drawn, at most two kept as nodes

    # the target puts all its mass on a root candidate that is not a node: accepted, round ends
    kept = {proposal.tokens[i] for i, parent in enumerate(proposal.parents) if parent == trees.ROOT}
    virtual = next(t for t in root if t not in kept)
    logits = torch.full((1 + len(proposal.tokens), 5), -1e9)
    logits[:, virtual] = 0.0
    [verdict] = verify_batch([VerifyRow(proposal.tokens, params, 3, proposal.probs, parents=proposal.parents,
                                        branches=proposal.branches)], logits)
    assert verdict.tokens == [virtual] and verdict.num_accepted == 0 and verdict.path == ()


def test_draws_without_replacement_follow_the_sequential_law():
    """Ordered triples from ``draw_without_replacement`` (one cumulative sum a row) against
    their exact probability prod_j q(x_j) / (1 - q(earlier)), chi-square at significance 1e-3,
    20,000 seeded draws, with zeros in q and a row whose support runs out; negative control:
    the same test on draws WITH replacement (three independent draws, repeats dropped, as a
    drafter that forgot to remove its candidates would make) must fail."""
    import itertools

    from scipy.stats import chisquare

    from specdec.drafters.base import draw_without_replacement
    from specdec.sampling import draw

    q = torch.tensor([[0.05, 0.0, 0.15, 0.3, 0.5, 0.0], [0.0, 0.7, 0.0, 0.3, 0.0, 0.0]])
    n = 20_000

    def pvalue(sample) -> float:
        counts = [{}, {}]
        gen = torch.Generator().manual_seed(11)
        for _ in range(n):
            for r, drawn in enumerate(sample(gen)):
                counts[r][drawn] = counts[r].get(drawn, 0) + 1
        worst = 1.0
        for r in range(2):
            support = [i for i in range(q.shape[1]) if q[r, i] > 0]
            exact = {}
            for perm in itertools.permutations(support, min(3, len(support))):
                prob, left = 1.0, 1.0
                for x in perm:
                    prob, left = prob * float(q[r, x]) / left, left - float(q[r, x])
                exact[perm] = prob
            if set(counts[r]) - set(exact):
                return 0.0
            keys, total = sorted(exact), sum(exact.values())  # 1 up to rounding
            worst = min(worst, float(chisquare([counts[r].get(k, 0) for k in keys],
                                               [exact[k] / total * n for k in keys]).pvalue))
        return worst

    def ours(gen):
        logq, ids = draw_without_replacement(q, 3, gen)
        return [tuple(i for v, i in zip(lq, row) if v > float("-inf")) for lq, row in zip(logq.tolist(), ids.tolist())]

    def with_replacement(gen):
        out = []
        for r in range(2):
            picks = []
            for _ in range(3):
                x = draw(q[r], gen)
                if x not in picks:
                    picks.append(x)
            out.append(tuple(picks))
        return out

    assert pvalue(ours) > 1e-3
    assert pvalue(with_replacement) < 1e-3
