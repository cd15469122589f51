"""Token trees: a round's drafts as a tree instead of a chain, in one flat layout.

A tree of ``N`` draft nodes hangs under the row's pending token (the root: the last token of
the context, which the target has not fed yet). Node ``i`` has token ``tokens[i]`` and parent
``parents[i]``: ``-1`` for a child of the root, otherwise an earlier node (``parents[i] < i``),
so the flat order is topological. A chain of ``k`` is the tree ``parents = (-1, 0, 1, ..)``.

In the target's pass the root and every node are fed together: node ``i`` sits at position
``n - 1 + depth(i)`` (``n``: the context's length; the root is at ``n - 1``), is written to
the row's pool slot ``n + i``, and attends to the context and to its own ancestors only
(tree attention). Verification walks from the root to the deepest node the target accepts;
the accepted path's keys and values are then moved to slots ``n, n + 1, ..`` (compaction),
so the cache holds exactly what a chain of those tokens would have left.

Worked example (two children of the root, one grandchild under the first)::

    tokens  = [5, 7, 9]      parents = (-1, -1, 0)
    depths(parents) = [1, 1, 2]          children(parents, -1) = [0, 1]
    path_to(parents, 2) = [0, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROOT = -1  # the parent of the root's children: the row's pending token


def check(parents: Sequence[int]) -> None:
    """Raise ValueError unless every parent is -1 or an earlier node."""
    for i, p in enumerate(parents):
        if not (ROOT <= p < i):
            raise ValueError(f"tree node {i} has parent {p}: parents must be -1 or an earlier node")


def depths(parents: Sequence[int]) -> list[int]:
    """[N] each node's depth (a child of the root has depth 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p == ROOT else out[p] + 1)
    return out


def children(parents: Sequence[int], node: int) -> list[int]:
    """The children of ``node`` (``ROOT`` for the root's), in flat order."""
    return [i for i, p in enumerate(parents) if p == node]


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node``, inclusive."""
    out = []
    while node != ROOT:
        out.append(node)
        node = parents[node]
    return out[::-1]


def follow(tokens: Sequence[int], parents: Sequence[int], ids: Sequence[int]) -> list[int]:
    """The longest root path whose tokens are a prefix of ``ids``: its nodes, in order."""
    path, node = [], ROOT
    for token in ids:
        nxt = next((i for i in children(parents, node) if tokens[i] == token), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


@dataclass(frozen=True)
class Price:
    """What a round that verifies ``n`` tree nodes costs, in plain steps of one row: ``v[n]``
    (the target's pass over the pending token and ``n`` nodes, ``n <= len(v) - 1``) plus
    ``fixed`` (the tree's draft passes, spent whatever is kept); ``kappa``: how far the
    drafter's path probabilities are believed (its accepted drafts over those its
    probabilities predicted).

    ``size(reach)``: of the candidates best first (each after its ancestors), how many to
    verify. Node ``i`` is on the accepted path with probability about ``kappa * reach[i]`` (its
    path probability), so ``n`` nodes bring ``1 + kappa * sum(reach[:n])`` tokens a round
    (the bonus or recovered token included); the round keeps the ``n`` that brings the most
    tokens per unit of its time. A pass costs what one token does while it is memory-bound
    and grows once it is compute-bound (``specdec.engine.schedule._Curve.hinge``), so no one
    per-node price is right at every size: nodes below the knee are kept whatever their
    probability, past it only those that pay for the slope. (A threshold from ``v(2) - v(1)``
    priced every node at nothing below the knee and kept the whole budget: on the demo pair
    a 16-node EAGLE tree verified in 56-64 ms against 44-51 ms for 8 nodes, for 1.97 against
    1.87 tokens a round; 2-core AMD EPYC, AVX-512 BF16.)

        rates (tokens / time) at n = 1..5: 1.6 / 1.2, 1.9 / 1.2, 2.1 / 1.25, 2.2 / 1.3, 2.25 / 1.4

        >>> Price(v=(1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.3), fixed=0.2).size([0.6, 0.3, 0.2, 0.1, 0.05, 0.02])
        4
        >>> Price(v=(1.0,) * 7, fixed=0.2).size([0.6, 0.3, 0.2, 0.1, 0.05, 0.02])  # flat: all
        6
    """

    v: tuple[float, ...]
    fixed: float = 0.0
    kappa: float = 1.0

    def size(self, reach: Sequence[float]) -> int:
        best, best_rate, tokens = min(1, len(reach)), -1.0, 1.0
        for n, r in enumerate(reach[: len(self.v) - 1], start=1):
            tokens += self.kappa * r
            rate = tokens / (self.v[n] + self.fixed)
            if rate > best_rate * (1 + 1e-12):  # a tie keeps the smaller tree
                best, best_rate = n, rate
        return best
