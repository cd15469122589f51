"""Trees sized by what they pay, a tree round's acceptance counted per level, the unit's record
of every drafter that a new request starts from, and heads that run in the target's dtype."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specdec.config import ModelConfig, SpeculationConfig
from specdec.drafters import _head_dtype
from specdec.drafters.base import DraftRow, Proposal, Trees
from specdec.drafters.model import ModelDrafter
from specdec.drafters.medusa import medusa_tree
from specdec.engine import Engine
from specdec.engine.schedule import StepCosts
from specdec.engine.target import leaf
from specdec.policy import DrafterRecord, PolicyConfig, SpeculationPolicy
from specdec.sampling import SamplingParams
from specdec.stats import RoundStats
from specdec.trees import Price
from specdec.verify import Verdict


def _logits(*rows: list[float], vocab: int = 8) -> torch.Tensor:
    """Logits whose softmax puts the given probabilities on tokens 0, 1, ... (the rest spread evenly)."""
    out = []
    for probs in rows:
        rest = (1 - sum(probs)) / (vocab - len(probs))
        out.append(torch.log(torch.tensor(list(probs) + [rest] * (vocab - len(probs)))))
    return torch.stack(out)


def _hinged(costs: StepCosts) -> StepCosts:
    """``costs`` having seen a verify pass flat to 5 tokens (4 nodes), then 1 ms a token."""
    for tokens, seconds in ((1, 0.010), (2, 0.010), (4, 0.010), (5, 0.010), (9, 0.014), (17, 0.022)):
        costs.observe_verify(tokens, seconds)
    return costs


def _grow(stop_below: float, price: Price | None = None) -> tuple[Proposal, int]:
    """A width-2 tree of depth <= 3: the root's children 0.6 / 0.3, each node's 0.5 / 0.2."""
    row = DraftRow("a", [1, 2], 3, SamplingParams(), 0, nodes=8, stop_below=stop_below, price=price)
    trees = Trees([row], width=2)
    trees.extend(_logits([0.6, 0.3]), [0])
    while trees.live():
        trees.extend(_logits(*[[0.5, 0.2]] * len(trees.grown[0].frontier)), [0])
    (tree,) = trees.drafted()
    return tree, trees.steps


def test_a_tree_keeps_the_nodes_whose_path_probability_pays_and_stops_expanding_below_it():
    full, full_steps = _grow(0.0)
    sized, sized_steps = _grow(0.1)
    assert len(full) == 8 and full_steps == 3
    # path probabilities: level 1: 0.6, 0.3; level 2: 0.3, 0.12 (under 0.6), 0.15, 0.06 (under 0.3);
    # level 3, from the frontier 0.3 and 0.15: 0.15, 0.06, 0.075, 0.03. Six are >= 0.1.
    reach = [math.prod(sized.confidence[n] for n in _path(sized.parents, i)) for i in range(len(sized))]
    assert len(sized) == 6 and min(reach) >= 0.1 - 1e-6, reach
    assert sorted(reach, reverse=True) == pytest.approx([0.6, 0.3, 0.3, 0.15, 0.15, 0.12], abs=1e-6)
    assert sized_steps == 3
    one, _ = _grow(0.9)  # nothing pays: the root's best child is still proposed (as a chain's first draft)
    assert one.tokens == [0] and one.parents == (-1,)


def _rate(price: Price, reach: list[float], n: int) -> float:
    """Expected tokens per unit of round time with the best ``n`` of ``reach`` verified."""
    return (1 + price.kappa * sum(reach[:n])) / (price.v[n] + price.fixed)


HINGE = (1.0, 1.0, 1.0, 1.0) + tuple(1.0 + 0.06 * n for n in range(1, 14))  # v(0..16): flat to 3 nodes, then 0.06 a node


def test_a_price_keeps_the_tree_size_that_brings_the_most_tokens_per_unit_of_time():
    reach = [0.6, 0.3, 0.3, 0.15, 0.15, 0.12, 0.06, 0.05, 0.03, 0.02]
    flat = Price((1.0,) * 17, fixed=0.3)
    assert flat.size(reach) == len(reach)  # every node is free: all of them
    for price in (Price(HINGE, 0.3), Price(HINGE, 0.3, kappa=0.4), Price(HINGE, 0.0, kappa=2.0), Price(HINGE[:6], 0.3)):
        n = price.size(reach)
        sizes = range(1, min(len(reach), len(price.v) - 1) + 1)
        assert n in sizes and _rate(price, reach, n) == max(_rate(price, reach, m) for m in sizes), (price, n)
    assert 3 <= Price(HINGE, 0.3).size(reach) < len(reach)  # the free nodes kept, the improbable ones not
    assert Price(HINGE, 0.3, kappa=0.4).size(reach) < Price(HINGE, 0.3, kappa=2.0).size(reach)
    assert Price(HINGE, 0.3).size([]) == 0 and Price(HINGE, 0.3).size([0.01]) == 1


def test_trees_and_medusa_trees_propose_the_best_nodes_their_price_keeps():
    full, _ = _grow(0.0)
    reach = sorted((_reach(full, i) for i in range(len(full))), reverse=True)
    steep = Price(HINGE[:2] + tuple(1.0 + 0.1 * n for n in range(1, 8)), fixed=0.2)  # 0.1 a node past the first
    n = steep.size(reach)
    assert 1 < n < len(full)
    sized, steps = _grow(0.0, steep)
    assert len(sized) == n and steps == 3  # the tree grew as before; the price chose what is verified
    assert sorted(_reach(sized, i) for i in range(len(sized))) == pytest.approx(sorted(reach[:n]), abs=1e-6)
    assert all(p < i for i, p in enumerate(sized.parents))  # ancestors kept, parents first
    assert len(_grow(0.0, Price((1.0,) * 9, fixed=0.2))[0]) == 8  # nodes cost nothing: the budget
    ids, logp = [[5, 7], [9, 4]], [[math.log(0.6), math.log(0.3)], [math.log(0.5), math.log(0.2)]]
    reach = [0.6, 0.3, 0.3, 0.15, 0.12, 0.06]
    n = steep.size(reach)
    tokens, parents, _ = medusa_tree(ids, logp, 6, price=steep)
    assert len(tokens) == n and tokens == medusa_tree(ids, logp, n)[0]


def _reach(tree: Proposal, node: int) -> float:
    return math.prod(tree.confidence[n] for n in _path(tree.parents, node))


def _path(parents, node):
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out


def test_a_medusa_tree_is_cut_where_its_path_probability_falls_below_the_stop():
    ids, logp = [[5, 7], [9, 4]], [[math.log(0.6), math.log(0.3)], [math.log(0.5), math.log(0.2)]]
    assert len(medusa_tree(ids, logp, 6)[0]) == 6
    tokens, parents, _ = medusa_tree(ids, logp, 6, stop_below=0.1)
    assert (tokens, parents) == ([5, 7, 9, 9, 4], (-1, -1, 0, 1, 0))  # 0.6, 0.3 | 0.3, 0.15, 0.12 (7>4: 0.06)
    assert medusa_tree(ids, logp, 6, stop_below=0.99)[0] == [5]


def test_a_round_is_full_when_its_path_reaches_a_leaf():
    chain = Proposal([3, 4, 5])
    assert leaf(chain, Verdict([3, 4, 5, 6], 3, 3)) and not leaf(chain, Verdict([3, 9], 1, 3))
    #   0 -> 2 -> 3, and 1 (a leaf at depth 1)
    tree = Proposal([3, 4, 5, 6], parents=(-1, -1, 0, 2))
    assert leaf(tree, Verdict([4, 8], 1, 4, path=(1,)))  # the shallow leaf: nothing to try below it
    assert not leaf(tree, Verdict([3, 8], 1, 4, path=(0,)))  # node 0 had a child: a rejection
    assert leaf(tree, Verdict([3, 5, 6, 1], 3, 4, path=(0, 2, 3)))
    assert not leaf(tree, Verdict([9], 0, 4, path=()))


def _costs(slope: float) -> StepCosts:
    costs = StepCosts()
    for tokens in (1, 5, 17):
        costs.observe_verify(tokens, 0.01 * (1 + slope * (tokens - 1)))
    return costs


def test_a_tree_node_is_priced_by_its_verify_token_and_a_tree_by_the_nodes_it_proposes():
    policy = SpeculationPolicy(modes=["draft", "draft_tree"], costs=_costs(0.03),
                               config=lambda: PolicyConfig(tree_nodes=16), tree_modes={"draft_tree": "draft"})
    dv = policy.costs.v(2) - policy.costs.v(1)
    assert policy.stop_below("draft_tree") == pytest.approx(dv)  # S = 1 before a decision, kappa = 1
    assert policy.stop_below("draft") == pytest.approx(policy.costs.c("draft") + dv)
    assert policy.tree_size("draft_tree") == 1  # before its rounds: the nodes that cost nothing (a line: none)
    rounds = [RoundStats(0, "prefill", 0, 0, 0, 1, 0.0, 0.05)]
    rounds += [RoundStats(i, "draft_tree", 3, 5, 1, 2, 0.001, 0.01, full=False) for i in range(1, 40)]
    policy.observe(rounds)
    assert policy.tree_size("draft_tree") == 5
    # a leaf reached at depth 1 of a depth-3 round is no rejection
    a = policy.acceptance["draft_tree"]
    policy.observe(rounds + [RoundStats(40, "draft_tree", 3, 5, 1, 2, 0.001, 0.01, full=True)])
    assert policy.acceptance["draft_tree"] > a


def test_before_its_rounds_a_priced_tree_is_expected_to_keep_the_nodes_below_the_verify_curves_knee():
    hinge = _hinged(StepCosts())
    assert hinge.v(4) == hinge.v(1) < hinge.v(5)

    def policy(**kw):
        return SpeculationPolicy(modes=["draft", "draft_tree"], costs=hinge, tree_modes={"draft_tree": "draft"},
                                 **{"config": lambda: PolicyConfig(tree_nodes=16), **kw})

    assert policy().tree_size("draft_tree") == 4
    assert policy(config=lambda: PolicyConfig(tree_nodes=3)).tree_size("draft_tree") == 3
    assert policy(k_request=3, adaptive=False).tree_size("draft_tree") == 16  # unpriced: it fills the budget
    assert policy(config=lambda: PolicyConfig(tree_nodes=16, confidence_stop=False)).tree_size("draft_tree") == 16


def test_the_prior_tree_size_is_the_last_node_count_a_one_token_pass_prices():
    """``tree_size`` finds it by bisection (v never falls as n grows); a scan of every n agrees."""
    rng = random.Random(0)
    for _ in range(300):
        costs, step = StepCosts(), rng.uniform(0.005, 0.05)
        knee, slope = rng.randint(1, 20), rng.choice([0.0, rng.uniform(1e-5, 0.01)])
        for tokens in sorted(rng.sample(range(1, 24), rng.randint(3, 8))):
            costs.observe_verify(tokens, step + slope * max(0, tokens - knee) * rng.uniform(0.9, 1.1))
        budget = rng.randint(1, 16)
        policy = SpeculationPolicy(modes=["draft_tree"], costs=costs, tree_modes={"draft_tree": "draft"},
                                   config=lambda: PolicyConfig(tree_nodes=budget))
        scan = max((n for n in range(1, budget + 1) if costs.v(n) <= costs.v(1) * (1 + 1e-3)), default=1)
        assert policy.tree_size("draft_tree") == scan


def test_an_adaptive_request_prices_its_tree_nodes_from_the_units_costs():
    costs = _costs(0.03)
    policy = SpeculationPolicy(modes=["draft", "draft_tree"], costs=costs,
                               config=lambda: PolicyConfig(tree_nodes=16), tree_modes={"draft_tree": "draft"})
    policy.record.calibration["draft"] = (0.3, 0.6)  # its chain's confidences said twice what was accepted
    price = policy.node_price("draft_tree", 3, 12)
    assert price.v == tuple(costs.v(n) for n in range(13)) and price.v[12] > price.v[1]
    assert price.fixed == pytest.approx(3 * costs.c("draft_tree")) and price.kappa == pytest.approx(0.5)
    assert policy.node_price("draft", 3, 12) is None  # a chain
    fixed = SpeculationPolicy(modes=["draft_tree"], costs=costs, config=lambda: PolicyConfig(),
                              tree_modes={"draft_tree": "draft"}, k_request=3, adaptive=False)
    assert fixed.node_price("draft_tree", 3, 12) is None  # an explicit k fills the budget
    off = SpeculationPolicy(modes=["draft_tree"], costs=costs, config=lambda: PolicyConfig(confidence_stop=False),
                            tree_modes={"draft_tree": "draft"})
    assert off.node_price("draft_tree", 3, 12) is None


@pytest.fixture(scope="module")
def engine(llama_pair):
    return Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]), dtype="float32"),
                       SpeculationConfig(tree_width=3), kv_cache_tokens=8192, max_num_seqs=8)


PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "import os\nimport sys\n", "class Stack:\n    def"]


def test_sized_trees_keep_greedy_output_and_the_unit_record_starts_the_next_request(engine):
    """Adaptive tree rounds (their sizes chosen by the policy's stop) give plain decoding's
    tokens; every round lands in the unit's record, and a request admitted later starts from it."""
    assert engine.loop.record.trials == {}
    sizes, accepted = [], 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=24, mode="off")
        spec = engine.generate(ids, max_tokens=24, mode="draft_tree")
        assert spec.token_ids == plain.token_ids, prompt
        sizes += [r.drafted for r in spec.rounds if r.mode == "draft_tree"]
        accepted += spec.speculation.accepted_tokens
    assert accepted > 0 and sizes and max(sizes) <= PolicyConfig().tree_nodes, (accepted, sizes)
    assert min(sizes) < PolicyConfig().tree_nodes  # the stop cut some trees below the budget
    record = engine.loop.record
    assert "draft_tree" in record.trials and "draft_tree" in record.sizes
    later = engine.generate(engine.encode(prompt=PROMPTS[0]), max_tokens=2, mode="draft")
    # it never drafted a tree, yet it knows the tree's acceptance: its policy began from the record
    assert "draft_tree" in later.policy_summary["acceptance_estimate"]


class _FrozenCosts(StepCosts):
    """A unit's costs that no step changes."""

    def observe_verify(self, tokens: int, seconds: float) -> None:
        pass

    def observe_draft(self, mode: str, rows: int, seconds_per_step: float) -> None:
        pass


def _frozen_costs() -> StepCosts:
    """Cheap drafts (the priors' c) and the hinged verify pass of ``_hinged``, which no step changes."""
    costs = _hinged(StepCosts())
    costs.__class__ = _FrozenCosts
    return costs


def test_adaptive_tree_rows_reach_the_drafter_with_their_price_and_explicit_k_rows_without(engine, monkeypatch):
    seen = []
    propose = ModelDrafter.propose

    def spy(self, rows):
        seen.extend((r.nodes, r.price) for r in rows if r.nodes)
        return propose(self, rows)

    monkeypatch.setattr(ModelDrafter, "propose", spy)
    ids = engine.encode(prompt=PROMPTS[0])
    plain = engine.generate(ids, max_tokens=16, mode="off")
    # Whether an adaptive request drafts at all is the policy's call on the unit's measured costs
    # and record; on the tiny pair (a draft about the target's size) it may keep the request
    # plain. Freeze both where draft trees pay, so this test sees the wiring and nothing else.
    monkeypatch.setattr(engine.loop, "costs", _frozen_costs())
    monkeypatch.setattr(engine.loop, "record", DrafterRecord(trials={"draft_tree": (0.9, 0.1)}, sizes={"draft_tree": 4}))
    assert engine.generate(ids, max_tokens=16, mode="draft_tree").token_ids == plain.token_ids
    assert seen and all(price is not None and len(price.v) == nodes + 1 for nodes, price in seen), seen
    seen.clear()
    record = engine.loop.record.copy()
    assert engine.generate(ids, max_tokens=16, mode="draft_tree", k=3).token_ids == plain.token_ids
    assert seen and all(price is None for _, price in seen)
    # its full-budget trees leave the unit's record of the priced ones alone
    assert engine.loop.record.sizes == record.sizes and engine.loop.record.trials == record.trials


def test_a_seeded_sampled_request_starts_from_priors_not_the_units_record(engine):
    engine.generate(engine.encode(prompt=PROMPTS[1]), max_tokens=8, mode="draft")
    assert engine.loop.record.trials
    seeded = engine.generate(engine.encode(prompt=PROMPTS[1]), max_tokens=2, mode="draft",
                             params=SamplingParams(temperature=1.0, seed=3))
    assert set(seeded.policy_summary["acceptance_estimate"]) <= {"draft"}


def test_a_head_on_the_targets_features_runs_in_the_targets_dtype(llama_pair):
    from specdec.batch.runner import BatchRunner
    from specdec.loading import load_model
    from specdec.models import packed

    for dtype in (torch.float32, torch.bfloat16):
        runner = BatchRunner(load_model(str(llama_pair["target"]), "float32").to(dtype), capacity_tokens=64)
        assert _head_dtype("auto", runner) == {"dtype": dtype, "half": False}
        assert _head_dtype("float32", runner) == {"dtype": torch.float32}
    if packed.half_available():  # a float16-weights target: its heads on fp16 weights too, unless told
        runner = BatchRunner(load_model(str(llama_pair["target"]), "float16-weights"), capacity_tokens=64)
        assert _head_dtype("auto", runner) == {"dtype": torch.float32, "half": True}
        assert _head_dtype("float32", runner) == {"dtype": torch.float32}
    assert ModelConfig(target="t").eagle_dtype == "auto" and ModelConfig(target="t").medusa_dtype == "auto"


def test_auto_gives_prompt_lookup_only_the_rounds_where_it_has_a_match(engine):
    """auto asks prompt lookup before it picks it: none of its ngram rounds comes back empty,
    and the answer is plain decoding's. The control: a request in mode ngram alone has rounds
    without a match (the case auto avoids)."""
    ngram_rounds, empty_alone = 0, 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=32, mode="off")
        auto = engine.generate(ids, max_tokens=32, mode="auto")
        assert auto.token_ids == plain.token_ids, prompt
        lookups = [r for r in auto.rounds if r.mode == "ngram"]
        assert all(r.drafted > 0 for r in lookups), [(r.k, r.drafted) for r in lookups]
        ngram_rounds += len(lookups)
        alone = engine.generate(ids, max_tokens=32, mode="ngram", k=4)
        empty_alone += sum(1 for r in alone.rounds[1:] if r.k and not r.drafted)
    assert ngram_rounds > 0 and empty_alone > 0, (ngram_rounds, empty_alone)
