"""The ``medusa`` drafter: ResBlock heads on the target's own features (fp32 tiny pairs).

Heads are trained here on the frozen tiny Llama target (under a second). Medusa's released
layout loads and scores like a hand-built reference; our format round-trips; trained heads
beat untrained ones held out; the tree builder gives valid, ancestor-closed trees within their
budgets (the exact best by path value, against brute force); greedy chains equal plain
decoding with drafts accepted; sampled chains keep the target's distribution (chi-square at
1e-3 with a negative control). Trees end to end wait for the engine's tree verification.
"""

import itertools
import json
import math
import random

import pytest
import torch

from specdec.batch.blocks import run_of, slot
import torch.nn.functional as F

from specdec import trees
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.bench.tiny import synthetic_corpus
from specdec.config import ModelConfig, SpeculationConfig
from specdec.demo.config import BuildConfig
from specdec.demo.medusa import MedusaTrainConfig, init_medusa_heads, medusa_agreement, train_medusa
from specdec.demo.teacher import teacher_code
from specdec.drafters import DRAFTERS
from specdec.drafters.base import DraftRow
from specdec.drafters.medusa import MedusaDrafter, medusa_chain, medusa_tree
from specdec.engine import Engine
from specdec.loading import load_model, load_tokenizer
from specdec.models.medusa import load_medusa_heads, save_medusa_heads
from specdec.sampling import SamplingParams
from three_tokens import assert_tree_sampling_exact, batched_test_and_control, greedy_accepted

PROMPTS = [" ".join(p.split()[:4]) for p in synthetic_corpus(n_sentences=20, seed=99)]


def chunks(tok, seed: int, n: int, length: int = 64) -> list[list[int]]:
    ids = tok(" ".join(synthetic_corpus(n_sentences=40 * n, seed=seed)))["input_ids"]
    return [ids[i:i + length] for i in range(0, len(ids) - length, length)][:n]


@pytest.fixture(scope="module")
def trained(llama_pair, tmp_path_factory):
    """Heads trained on the tiny target's own top-K and features, saved; and the metrics."""
    model, tok = load_model(str(llama_pair["target"])), load_tokenizer(str(llama_pair["target"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = BuildConfig(topk=8)
    train = teacher_code(model, chunks(tok, 5, 48), cfg, "teacher")
    held = teacher_code(model, chunks(tok, 6, 8), cfg, "teacher")
    tcfg = MedusaTrainConfig(num_heads=3, steps=200, batch_rows=256, lr=3e-3, warmup=10)
    heads = init_medusa_heads(model, torch.arange(model.config.vocab_size), tcfg)
    untrained = medusa_agreement(heads, held)
    train_medusa(heads, train, tcfg)
    out = tmp_path_factory.mktemp("medusa")
    save_medusa_heads(heads, out, dtype=torch.float32)
    return {"paths": llama_pair, "dir": out, "model": model, "tok": tok, "before": before, "heads": heads,
            "untrained": untrained, "agreement": medusa_agreement(heads, held)}


def test_training_only_moves_the_heads_and_they_learn(trained):
    after = trained["model"].state_dict()
    assert all(torch.equal(trained["before"][k], after[k]) for k in after)  # the target is frozen
    got, before = trained["agreement"], trained["untrained"]
    assert got["top1"][0] > 0.4 > before["top1"][0] + 0.2, (got, before)
    assert all(a > b + 0.1 for a, b in zip(got["top1"], before["top1"])), (got, before)
    assert all(t4 >= t1 for t4, t1 in zip(got["top4"], got["top1"]))


def test_an_untrained_head_is_the_base_lm_head(trained):
    """Zero ResBlock weights (Medusa's init) and, here, zero biases: every head IS the target's
    LM head on the feature, restricted to ``token_ids`` (-inf elsewhere)."""
    model = trained["model"]
    ids = torch.arange(0, model.config.vocab_size, 3)
    heads = init_medusa_heads(model, ids, MedusaTrainConfig(num_heads=2))
    with torch.no_grad():
        for p in heads.parameters():
            p.zero_()
        f = torch.randn(5, heads.hidden_size)
        got = heads.logits(f)  # [5, 2, V]
        want = model.get_output_embeddings()(f)
    assert got.shape == (5, 2, model.config.vocab_size)
    torch.testing.assert_close(got[:, 1, ids], want[:, ids])
    assert torch.isinf(got[:, 0, 1]).all() and int(torch.isfinite(got[0, 0]).sum()) == len(ids)


def test_our_format_round_trips_and_refuses(trained, tmp_path):
    model, heads = trained["model"], trained["heads"]
    loaded = load_medusa_heads(trained["dir"], model)
    f = torch.randn(4, heads.hidden_size)
    with torch.no_grad():
        assert torch.equal(loaded.logits(f), heads.logits(f))
    assert json.loads((trained["dir"] / "specdec_medusa.json").read_text())["num_heads"] == 3
    reduced = init_medusa_heads(model, torch.tensor([0, 5, 9]), MedusaTrainConfig(num_heads=2))
    save_medusa_heads(reduced, tmp_path / "reduced")
    assert torch.equal(load_medusa_heads(tmp_path / "reduced", model).token_ids, torch.tensor([0, 5, 9]))
    other = type(model.config)(**{**model.config.to_dict(), "vocab_size": model.config.vocab_size + 64})
    with pytest.raises(ValueError, match="vocabulary"):
        load_medusa_heads(trained["dir"], type(model)(other))
    with pytest.raises(FileNotFoundError):
        load_medusa_heads(tmp_path / "nothing", model)


@pytest.mark.parametrize("layers,suffix", [(1, "safetensors"), (2, "pt")])
def test_medusas_released_layout_loads(trained, tmp_path, layers, suffix):
    """Medusa-1's checkpoints: config.json (medusa_num_heads, medusa_num_layers) and
    medusa_lm_head.* with ``{i}.{j}.linear.*`` ResBlocks and ``{i}.{layers}.weight`` heads of
    the full vocabulary. The loaded heads score like the formula written out by hand."""
    from safetensors.torch import save_file

    model = trained["model"]
    d, V, K = model.config.hidden_size, model.config.vocab_size, 3
    g = torch.Generator().manual_seed(7)
    sd = {}
    for i in range(K):
        for j in range(layers):
            sd[f"{i}.{j}.linear.weight"] = torch.randn(d, d, generator=g) * 0.1
            sd[f"{i}.{j}.linear.bias"] = torch.randn(d, generator=g) * 0.1
        sd[f"{i}.{layers}.weight"] = torch.randn(V, d, generator=g) * 0.1
    if suffix == "safetensors":
        save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    else:
        torch.save(sd, tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({
        "medusa_num_heads": K, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}))
    heads = load_medusa_heads(tmp_path, model)
    assert heads.own_heads and (heads.num_heads, heads.num_layers) == (K, layers)
    f = torch.randn(6, d, generator=g)
    want = []
    for i in range(K):
        x = f
        for j in range(layers):
            x = x + F.silu(x @ sd[f"{i}.{j}.linear.weight"].T + sd[f"{i}.{j}.linear.bias"])
        want.append(x @ sd[f"{i}.{layers}.weight"].T)
    with torch.no_grad():
        torch.testing.assert_close(heads.logits(f), torch.stack(want, 1))


# ----------------------------------------------------------------------------- the tree builder
def _brute_force(top_ids, top_logp, nodes):
    """Every path through the candidates, the ``nodes`` best by value, as sets of token paths."""
    paths = []
    for depth in range(1, len(top_ids) + 1):
        for choice in itertools.product(*[range(len(top_ids[d])) for d in range(depth)]):
            value = sum(top_logp[d][c] for d, c in enumerate(choice))
            paths.append((value, tuple(top_ids[d][c] for d, c in enumerate(choice))))
    paths.sort(key=lambda p: -p[0])
    return {p for _, p in paths[:nodes]}


def _token_paths(tokens, parents):
    return {tuple(tokens[n] for n in trees.path_to(parents, i)) for i in range(len(tokens))}


@pytest.mark.parametrize("seed", range(12))
def test_the_tree_is_valid_and_the_best_by_path_value(seed):
    rng = random.Random(seed)
    depth, w, nodes = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 20)
    top_ids = [rng.sample(range(50), w) for _ in range(depth)]
    top_logp = [sorted((math.log(rng.random()) for _ in range(w)), reverse=True) for _ in range(depth)]
    tokens, parents, confidence = medusa_tree(top_ids, top_logp, nodes)
    trees.check(parents)  # parents earlier: topological, ancestor-closed
    assert len(tokens) == min(nodes, sum(w ** d for d in range(1, depth + 1)))
    assert max(trees.depths(parents)) <= depth
    for node in [trees.ROOT, *range(len(tokens))]:  # siblings distinct
        kids = [tokens[c] for c in trees.children(parents, node)]
        assert len(kids) == len(set(kids))
    for i, dep in enumerate(trees.depths(parents)):  # each node's confidence: its head's probability
        assert confidence[i] == pytest.approx(math.exp(top_logp[dep - 1][top_ids[dep - 1].index(tokens[i])]))
    assert _token_paths(tokens, parents) == _brute_force(top_ids, top_logp, nodes)


def test_the_tree_respects_a_narrow_frontier_and_empty_budgets():
    ids, lps = [[5, 7], [9, 4], [1, 2]], [[-0.1, -2.5], [-0.5, -1.0], [-0.2, -0.3]]
    tokens, parents, _ = medusa_tree(ids, lps, 6, width=1)  # only the best node of each depth expands
    assert (tokens, parents) == ([5, 7, 9, 4, 1, 2], (-1, -1, 0, 0, 2, 2))
    assert medusa_tree(ids, lps, 0) == ([], (), ())
    assert medusa_tree([], [], 5) == ([], (), ())
    chain = medusa_chain([5, 9, 1], [-0.1, -0.5, -0.2], stop_below=0.6)
    assert chain.tokens == [5, 9] and chain.probs is None and chain.parents is None  # 0.90 * 0.61 < 0.6
    assert medusa_chain([5, 9, 1], [-0.1, -0.5, -0.2]).tokens == [5, 9, 1]


def test_the_drafter_reads_the_last_fed_feature_once_for_all_rows(trained):
    """Chains are the heads' argmax on the feature of position n-2 (its pool row through the block table);
    trees are medusa_tree's on the same log-probs; rows the target has not fed are fed first;
    sampled rows get point masses; one batched pass."""
    model, tok, heads = trained["model"], trained["tok"], trained["heads"]
    runner = BatchRunner(model, capacity_tokens=512)
    drafter = MedusaDrafter(runner, heads, width=3)
    x, y = tok(PROMPTS[0])["input_ids"], tok(PROMPTS[1] + " " + PROMPTS[2])["input_ids"]
    runner.forward([BatchRow("x", x[:-1], 0, run_of(1, 100))])  # y and z are behind: the drafter feeds them
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0)
    rows = [DraftRow("x", x, 5, greedy, 1, run_of(1, 100)), DraftRow("y", y, 2, sampled, 2, run_of(8, 100)),
            DraftRow("w", x, 0, greedy, 3, run_of(15, 100)), DraftRow("z", y, 3, greedy, 4, run_of(22, 100), nodes=7)]
    out = drafter.propose(rows)
    assert out.steps == 1 and len(out.proposals) == 4 and len(out.proposals[2]) == 0
    assert runner.cached_ids("y") == y[:-1] and runner.cached_ids("z") == y[:-1]
    with torch.no_grad():
        ref = model.base_model(input_ids=torch.tensor([y[:-1]])).last_hidden_state[0, -1]
        torch.testing.assert_close(runner.features[slot(run_of(22, 100), len(y) - 2)], ref, rtol=1e-4, atol=1e-5)
        logp = {key: torch.log_softmax(heads.logits(runner.features[slot(run_of(first, 100), len(c) - 2)][None])[0], -1)
                for key, c, first in (("x", x, 1), ("y", y, 8), ("z", y, 22))}  # [K, V] each
    assert out.proposals[0].tokens == logp["x"].argmax(-1).tolist()  # k=5, but only 3 heads
    drawn = out.proposals[1]  # sampled: drawn from each head's q, proposed with it
    q_y = logp["y"][:2].exp()
    assert len(drawn.tokens) == 2 and drawn.probs.shape == (2, q_y.shape[-1]) and drawn.parents is None
    torch.testing.assert_close(drawn.probs, q_y, rtol=1e-4, atol=1e-6)
    assert all(float(q_y[d, t]) > 0 for d, t in enumerate(drawn.tokens))
    assert list(drawn.confidence) == pytest.approx([float(q_y[d, t]) for d, t in enumerate(drawn.tokens)], rel=1e-4)
    tree = out.proposals[3]
    top_v, top_i = logp["z"].topk(3, -1)
    want = medusa_tree(top_i.tolist(), top_v.tolist(), 7)
    assert tree.tokens == want[0] and tree.parents == want[1] and tree.probs is None
    assert max(trees.depths(tree.parents)) <= 3 and len(tree) == 7
    assert list(tree.confidence) == pytest.approx(list(want[2]), rel=1e-5)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def engine(trained):
    return Engine.load(ModelConfig(target=str(trained["paths"]["target"]), dtype="float32",
                                   medusa_heads=str(trained["dir"])),
                       SpeculationConfig(mode="medusa", num_speculative_tokens=3), kv_cache_tokens=4096)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_chains_equal_plain_decoding(engine, k):
    assert "medusa" in engine.drafters
    accepted = 0
    for prompt in PROMPTS[:8]:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=30, mode="off")
        spec = engine.generate(ids, max_tokens=30, mode="medusa", k=k)
        assert spec.token_ids == plain.token_ids, (prompt, k)
        assert spec.speculation.mode == "medusa"
        accepted += spec.speculation.accepted_tokens
    assert accepted > 40, accepted


def test_a_float16_weights_target_runs_its_heads_on_fp16_weights_and_stays_exact(trained):
    """``medusa_dtype: auto`` follows a ``float16-weights`` target: the heads' products and their
    rows of the target's LM head on fp16 weights; greedy chains are still plain decoding's."""
    from specdec.models import packed

    if not packed.half_available():
        pytest.skip("no FBGEMM fp16 products on this machine")
    engine = Engine.load(ModelConfig(target=str(trained["paths"]["target"]), dtype="float16-weights",
                                     medusa_heads=str(trained["dir"])),
                         SpeculationConfig(mode="medusa", num_speculative_tokens=3), kv_cache_tokens=4096)
    heads = engine.loop.target.drafters["medusa"].heads
    layers = [m for m in heads.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(isinstance(m, packed.PackedLinear) and m.half for m in layers) and heads.rows.half
    accepted = greedy_accepted(engine, PROMPTS[:4], "medusa", 3)
    assert accepted > 0 and heads.rows._packed is not None


def test_medusa_in_a_batch_with_other_modes_and_auto(engine):
    """Rows of every mode share steps; each gets its plain tokens; auto may choose medusa."""
    import threading

    ids = [engine.encode(prompt=p) for p in PROMPTS[8:14]]
    plain = [engine.generate(i, max_tokens=24, mode="off").token_ids for i in ids]
    got = {}

    def run(j):
        got[j] = engine.generate(ids[j], max_tokens=24, mode=["medusa", "auto", "ngram"][j % 3], k=2 + j % 3).token_ids

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(ids))]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert [got[j] for j in range(len(ids))] == plain
    policy = engine.loop._new_policy(engine.request(ids[0], max_tokens=1, mode="auto"))
    assert set(policy.modes) == {"ngram", "medusa", "medusa_tree"}


def test_sampled_medusa_has_the_target_distribution(engine, monkeypatch):
    """Chi-square over the first 3 sampled tokens (top_k=3: 27 cells) at significance 1e-3,
    2000 seeded samples batched 16 at a time; drafts drawn from the heads' q, proposed with it.
    Negative control: a verifier that accepts every draft fails the same test."""
    ids = engine.encode(prompt=PROMPTS[4])
    n = 2000
    honest, control = batched_test_and_control(engine, ids, n, "medusa", monkeypatch)
    assert honest["drafted"] >= n and honest["impossible"] == 0 and honest["p"] > 1e-3
    assert control["impossible"] > 0 or control["p"] < 1e-3


def test_sampled_medusa_trees_have_the_target_distribution(engine, monkeypatch):
    """The same chi-square for mode medusa_tree (4 tokens, 81 cells, 2000 samples): each depth's
    candidates one draw without replacement from its head's q, shared by the nodes of that
    depth, recursive rejection sampling at each node. Negative control: the residual update
    after a rejected candidate skipped."""
    assert_tree_sampling_exact(engine, engine.encode(prompt=PROMPTS[4]), 2000, "medusa_tree", monkeypatch, k=3)


@pytest.mark.skipif(not getattr(DRAFTERS.get("medusa_tree"), "trees", False),
                    reason="the engine's token-tree verification (mode medusa_tree) is not here yet")
def test_greedy_trees_equal_plain_decoding(engine):
    accepted = 0
    for prompt in PROMPTS[:8]:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=30, mode="off")
        spec = engine.generate(ids, max_tokens=30, mode="medusa_tree", k=3)
        assert spec.token_ids == plain.token_ids, prompt
        accepted += spec.speculation.accepted_tokens
    assert accepted > 40, accepted
