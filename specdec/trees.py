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
