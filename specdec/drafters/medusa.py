"""``medusa``: Medusa heads on the target's own features: a chain or a token tree per row, one
batched pass of all heads for the whole step.

The heads (``specdec.models.medusa``) live with the target: its ``BatchRunner`` keeps every fed
token's final hidden state in a feature pool (``keep_features``; position ``p`` of a sequence
at pool row ``start + p``). A row's context ``x_0 .. x_{n-1}`` has its last token pending (the
target holds ``x_0 .. x_{n-2}``), so the feature of the last FED position ``n - 2`` is known:
the target's LM head there gave ``x_{n-1}``, and head ``d`` there guesses draft ``d + 1``
(``x_{n+d}``). One batched evaluation of every head for every row is the whole draft step
(``Drafted.steps == 1``): no head sees another's guess, which is what makes Medusa cheap.

Per row:

- ``row.nodes == 0``: a chain of ``min(k, heads)``: head ``d``'s argmax, cut after the token
  where the product of the heads' probabilities falls below ``row.stop_below``;
- ``row.nodes > 0``: a token tree (``specdec.trees``) of at most ``row.nodes`` nodes and depth
  ``min(k, heads)``, built by ``medusa_tree`` from the heads' top-``width`` log-probs.

Sampled rows DRAW from each head's processed distribution ``q_d`` (the row's temperature,
top-k, top-p over the heads' vocabulary) with the row's generator: a chain's draft ``d + 1`` from
``q_d``, proposed with those q rows and verified by rejection sampling; a tree's candidates at
depth ``d + 1``, one draw of ``width`` without replacement from ``q_d`` shared by every node of
depth ``d`` (a head's guess does not depend on the path, and a verified path passes one node a
depth), verified by recursive rejection sampling at each node (``Proposal.branches``). A head
that ignores the drafts before it is still a proposal distribution for the draft it makes, so
both stay exact (``specdec.batch.verify``); they accept ``min(1, p/q)`` where the argmax as a
point mass gets ``p(argmax)``.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence

import torch

from specdec import trees
from specdec.batch.blocks import slot
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.batch.verify import batched_probs
from specdec.drafters.base import EMPTY_PROPOSAL, Drafted, DraftRow, Proposal, draw_without_replacement
from specdec.models.medusa import MedusaHeads
from specdec.sampling import draw, make_generator


def medusa_tree(top_ids: Sequence[Sequence[int]], top_logp: Sequence[Sequence[float]], nodes: int,
                width: int | None = None, stop_below: float = 0.0,
                price: trees.Price | None = None) -> tuple[list[int], tuple[int, ...], tuple[float, ...]]:
    """The best token tree of at most ``nodes`` nodes from per-depth candidates (EAGLE-2 style).

    ``top_ids[d]`` / ``top_logp[d]`` [w]: head ``d``'s best tokens (distinct) and their
    log-probs; the tree's depth is at most ``len(top_ids)``. A node's value is the sum of the
    log-probs along its path (a Medusa head's guess does not depend on the path: every node at
    depth ``d`` gets the same candidate children, head ``d``'s). Expansion keeps the ``width``
    best nodes of each depth as its frontier (default: ``nodes``); of every node generated the
    ``nodes`` best by value are kept. A child's value never exceeds its parent's (ties go to
    the shallower, then the earlier node), so the kept set is ancestor-closed. Returns
    ``(tokens, parents, confidence)`` in topological order (by depth, then value), ``parents``
    as in ``specdec.trees`` (-1: a child of the pending token) and ``confidence`` each node's
    head probability ``exp(logp)``. ``stop_below``: a node whose path probability ``exp(value)``
    is below it is left out, as are its descendants (the best child of the root always stays),
    so the tree is as large as it pays (``specdec.drafters.base.Trees``); ``price`` then keeps
    the best ``n`` of those (``specdec.trees.Price``).

    Worked example (two heads, two candidates each, four nodes)::

        head 0: tokens [5, 7] log-probs [-0.1, -2.5]
        head 1: tokens [9, 4] log-probs [-0.5, -1.0]
        depth 1: 5 (-0.1), 7 (-2.5)
        depth 2: 5>9 (-0.6), 5>4 (-1.1), 7>9 (-3.0), 7>4 (-3.5)
        best 4: 5, 5>9, 5>4, 7  ->  tokens [5, 7, 9, 4], parents (-1, -1, 0, 0)

    >>> medusa_tree([[5, 7], [9, 4]], [[-0.1, -2.5], [-0.5, -1.0]], 4)[:2]
    ([5, 7, 9, 4], (-1, -1, 0, 0))
    """
    assert len(top_ids) == len(top_logp), (len(top_ids), len(top_logp))
    if nodes <= 0 or not top_ids:
        return [], (), ()
    width = max(1, width or nodes)
    # a generated node: (value, depth, order, parent's order, token, logp); order = creation index
    made: list[tuple[float, int, int, int, int, float]] = []
    frontier = [(0.0, -1)]  # (value, order) of the nodes to expand; the root first
    for d, (ids, lps) in enumerate(zip(top_ids, top_logp)):
        assert len(set(ids)) == len(ids), f"head {d}'s candidates repeat a token: {ids}"
        level = []
        for value, parent in frontier:
            for token, lp in zip(ids, lps):
                node = (value + float(lp), d + 1, len(made), parent, int(token), float(lp))
                made.append(node)
                level.append(node)
        frontier = [(n[0], n[2]) for n in heapq.nsmallest(width, level, key=lambda n: (-n[0], n[2]))]
    kept = heapq.nsmallest(nodes, made, key=lambda n: (-n[0], n[1], n[2]))
    floor = math.log(stop_below) if stop_below > 0 else -math.inf
    kept = kept[:1] + [n for n in kept[1:] if n[0] >= floor]  # the first is the root's best child
    if price is not None:
        kept = kept[: price.size([math.exp(n[0]) for n in kept])]  # best first: ancestor-closed
    kept.sort(key=lambda n: (n[1], -n[0], n[2]))  # by depth: every parent before its children
    index = {n[2]: i for i, n in enumerate(kept)}
    parents = tuple(-1 if n[3] == -1 else index[n[3]] for n in kept)
    return [n[4] for n in kept], parents, tuple(math.exp(n[5]) for n in kept)


def medusa_chain(ids: Sequence[int], logp: Sequence[float], stop_below: float = 0.0) -> Proposal:
    """Head ``d``'s argmax for each depth ``d``, as point masses; cut after the token where the
    product of their probabilities falls below ``stop_below`` (the drafter's own belief only)."""
    tokens, confidence, reach = [], [], 1.0
    for token, lp in zip(ids, logp):
        c = math.exp(lp)
        tokens.append(int(token))
        confidence.append(c)
        reach *= c
        if reach < stop_below:
            break
    return Proposal(tokens, None, tuple(confidence))


class MedusaDrafter:
    """Medusa heads drafting on the target's ``BatchRunner`` (its feature pool); ``width``: the
    candidates per head a tree considers (EAGLE-2's top-k)."""

    name = "medusa"

    def __init__(self, runner: BatchRunner, heads: MedusaHeads, width: int = 4):
        runner.keep_features()
        self.runner, self.heads, self.width = runner, heads.eval(), width

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> Drafted:
        began, runner = time.perf_counter(), self.runner
        todo = [i for i, r in enumerate(rows) if r.k and len(r.context) >= 2]
        proposals = [EMPTY_PROPOSAL] * len(rows)
        if not todo:
            return Drafted(proposals, time.perf_counter() - began, 0)
        # The target must hold each row's context but its last token (it does after the previous
        # verify; after a restart the full model catches up first), so f_{n-2} exists.
        behind = [BatchRow(rows[i].key, rows[i].context[:-1], 0, rows[i].blocks) for i in todo
                  if runner.cached_ids(rows[i].key) != rows[i].context[:-1]]
        if behind:
            runner.forward(behind)
        depth = min(self.heads.num_heads, max(rows[i].k for i in todo))
        width = min(self.width, len(self.heads.token_ids))
        with runner.lock:
            at = torch.tensor([slot(rows[i].blocks, len(rows[i].context) - 2) for i in todo], device=runner.device)
            features = runner.features[at]  # [R, d] the last fed position of each row
        logits = self.heads.reduced_logits(features)[:, :depth].float()  # [R, K, H] one batched pass
        top_logp, top_j = torch.log_softmax(logits, -1).topk(width, -1)  # [R, K, w]
        top_ids = self.heads.token_ids[top_j].tolist()
        top_logp = top_logp.tolist()
        for j, i in enumerate(todo):
            r = rows[i]
            k = min(r.k, depth)
            if not r.params.greedy:
                proposals[i] = self._sampled(r, logits[j, :k], width)
            elif r.nodes <= 0:
                proposals[i] = medusa_chain([t[0] for t in top_ids[j][:k]], [v[0] for v in top_logp[j][:k]],
                                            r.stop_below)
            else:
                w = min(width, r.nodes)
                tokens, parents, confidence = medusa_tree([t[:w] for t in top_ids[j][:k]],
                                                          [v[:w] for v in top_logp[j][:k]], r.nodes,
                                                          stop_below=r.stop_below, price=r.price)
                proposals[i] = Proposal(tokens, None, confidence, parents)
        return Drafted(proposals, time.perf_counter() - began, 1)

    def _sampled(self, row: DraftRow, logits: torch.Tensor, width: int) -> Proposal:
        """A sampled row's chain or tree from its heads' logits [k, heads' vocabulary], drawn
        from their processed distributions (module docstring)."""
        full = logits.new_full((logits.shape[0], self.heads.vocab_size), -math.inf)
        full[:, self.heads.token_ids] = logits
        q = batched_probs(full, [row.params] * logits.shape[0]).cpu()  # [k, V]
        gen = make_generator(row.seed)
        if row.nodes <= 0:
            tokens, confidence, reach = [], [], 1.0
            for d in range(q.shape[0]):
                token = draw(q[d], gen)
                tokens.append(token)
                confidence.append(float(q[d, token]))
                reach *= confidence[-1]
                if reach < row.stop_below:
                    break
            return Proposal(tokens, q[: len(tokens)], tuple(confidence))
        logq, ids = draw_without_replacement(q, min(width, row.nodes), gen)  # [k, w]: one draw a depth
        drawn = [[t for t, v in zip(ts, vs) if v > -math.inf] for ts, vs in zip(ids.tolist(), logq.tolist())]
        tokens, parents, confidence = medusa_tree(drawn, [[v for v in vs if v > -math.inf] for vs in logq.tolist()],
                                                  row.nodes, stop_below=row.stop_below, price=row.price)
        if not tokens:
            return EMPTY_PROPOSAL
        depths = trees.depths(parents)
        at = [(trees.ROOT, 0)] + [(n, depths[n]) for n in range(len(tokens)) if depths[n] < len(drawn)]
        return Proposal(tokens, q[[d for _, d in at]], confidence, parents,
                        tuple((n, tuple(drawn[d])) for n, d in at))

    def release(self, key: str) -> None:
        """Nothing is kept per sequence: the features are the target's."""
