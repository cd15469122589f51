"""Paged KV memory: fixed-size blocks, block tables, and the prefix cache.

A sequence's keys and values live in blocks of ``BLOCK`` tokens; its block table says which:
position ``p`` is pool row ``table[p // BLOCK] * BLOCK + p % BLOCK``. Blocks are allocated as a
sequence grows and returned when it leaves, so memory follows what requests use, not what
they might.

Prefix caching (vLLM's automatic prefix caching, at block granularity): a full block is named
by the hash of every token up to its end (``prefix_hashes``), so two prompts that share their
first 2,000 tokens share the blocks that hold them. A block is reference-counted; when its
last sequence leaves, a block with a name stays cached (least recently used first out) until
its memory is needed. A shared block is read-only: sequences write only past the blocks they
were given as hits.

    >>> pool = BlockPool(8)                          # blocks 1..7 (0 is scratch)
    >>> ids = list(range(2 * BLOCK + 3))
    >>> first = pool.allocate(3)                     # a fresh sequence: 3 blocks, no hits
    >>> hashes = prefix_hashes(ids)
    >>> pool.register(first[0], hashes[0]); pool.register(first[1], hashes[1])
    >>> pool.match(hashes) == first[:2]              # a second sequence with the same prefix
    True
    >>> pool.refs(first[0]), pool.free_blocks       # 3 in use: 2 shared, 1 private; 4 free
    (2, 4)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

BLOCK = 16  # tokens per block (vLLM's default on GPUs): a sequence wastes under one block


def blocks_for(tokens: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // BLOCK)


def prefix_hashes(ids: Sequence[int], *, start: Sequence[bytes] = ()) -> list[bytes]:
    """The name of each full block of ``ids``: block ``j``'s is a digest of ``ids[:(j + 1) * BLOCK]``
    (chained: the previous block's name and this block's tokens). ``start``: names already
    computed for the first blocks (they are returned first, not recomputed).

    A cryptographic digest, not Python's ``hash``: a tenant must not be able to craft a prompt
    whose block is named like another tenant's and read its keys and values.
    """
    out = list(start)
    prev = out[-1] if out else b""
    for j in range(len(out), len(ids) // BLOCK):
        prev = hashlib.blake2b(prev + array("q", ids[j * BLOCK: (j + 1) * BLOCK]).tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


def slots(table: Sequence[int], a: int, b: int) -> torch.Tensor:
    """[b - a] the pool rows of positions ``[a, b)`` of a sequence with block table ``table``."""
    pos = torch.arange(a, b)
    return torch.tensor(table, dtype=torch.long)[pos // BLOCK] * BLOCK + pos % BLOCK


def slot(table: Sequence[int], p: int) -> int:
    """The pool row of position ``p``."""
    return table[p // BLOCK] * BLOCK + p % BLOCK


def span(table: Sequence[int], n: int) -> int | None:
    """The first pool row of positions ``[0, n)`` when the blocks that hold them are consecutive
    (they are one slice of the pool), else None."""
    first = table[0] if table else 0
    for j in range(1, blocks_for(n)):
        if table[j] != first + j:
            return None
    return first * BLOCK


def _runs(free: set[int]) -> list[tuple[int, int]]:
    """The runs of consecutive blocks in ``free``: (first, length), ascending."""
    runs: list[tuple[int, int]] = []
    for b in sorted(free):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class BlockPool:
    """Blocks ``1 .. num_blocks - 1`` (block 0 is scratch): free, in use (reference-counted), or
    cached (a named block no sequence uses, evicted least recently used first).

    Allocation keeps a sequence's blocks consecutive while the pool allows: a sequence's first
    blocks go to the middle of the largest free run (room to grow on either side) and its later
    ones right after its last (``after``). The attention reads consecutive blocks as one view
    of the pool; any other table costs a gather per layer.
    """

    def __init__(self, num_blocks: int, *, caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks, self.caching = num_blocks, caching
        self._free: set[int] = set(range(1, num_blocks))
        self._refs: dict[int, int] = {}
        self._name: dict[int, bytes] = {}  # block -> its prefix hash
        self._by_name: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced named blocks, oldest first
        self.evicted = 0  # cached blocks handed out again

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * BLOCK

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody uses."""
        return len(self._free) + len(self._cached)

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def allocate(self, n: int, *, after: int | None = None, evict_next: bool = False) -> list[int] | None:
        """``n`` blocks for one sequence, referenced once; None (and nothing taken) when fewer
        than ``n`` are free or evictable. ``after``: the sequence's last block (it grows);
        ``evict_next``: cached blocks right after it are taken too (a prompt that continues a
        cached prefix elsewhere: the blocks that held the prefix's old continuation)."""
        if n > self.free_blocks:
            return None
        out = self._consecutive(n, after, evict_next)
        while len(out) < n:
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently used cached block
                block, _ = self._cached.popitem(last=False)
                del self._by_name[self._name.pop(block)]
                self.evicted += 1
            out.append(block)
        for block in out:
            self._refs[block] = 1
        return out

    def _consecutive(self, n: int, after: int | None, evict_next: bool = False) -> list[int]:
        """Up to ``n`` free blocks in a row: right after ``after``, or amid the largest free run."""
        if after is not None:
            start = after + 1
        else:
            runs = _runs(self._free)
            if not runs:
                return []
            first, length = max(runs, key=lambda r: r[1])
            start = first if first == 1 else first + max(0, length - n) // 2
        out = []
        while len(out) < n:
            block = start + len(out)
            if block in self._free:
                self._free.discard(block)
            elif evict_next and block in self._cached:
                del self._cached[block]
                del self._by_name[self._name.pop(block)]
                self.evicted += 1
            else:
                break
            out.append(block)
        return out

    def match(self, hashes: Sequence[bytes], *, multiple: int = 1) -> list[int]:
        """The cached blocks holding the longest prefix named by ``hashes`` (a multiple of
        ``multiple`` blocks), each referenced once more (the caller owns them now, read-only)."""
        out: list[int] = []
        if not self.caching:
            return out
        found = 0
        while found < len(hashes) and hashes[found] in self._by_name:
            found += 1
        for h in hashes[: found - found % multiple]:
            block = self._by_name[h]
            self._cached.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
            out.append(block)
        return out

    def register(self, block: int, h: bytes) -> None:
        """``block`` (in use) now holds the full prefix named ``h``: later sequences may share it.
        A prefix another block already holds keeps that block (this one stays private)."""
        if not self.caching or block in self._name or h in self._by_name:
            return
        self._name[block], self._by_name[h] = h, block

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence gives its blocks back. An unreferenced named block stays cached; its tail
        blocks become the first to evict (a prefix outlives its continuations)."""
        for block in reversed(blocks):
            left = self._refs[block] - 1
            if left:
                self._refs[block] = left
                continue
            del self._refs[block]
            if block in self._name:
                self._cached[block] = None
            else:
                self._free.add(block)


def run_of(first: int, tokens: int) -> tuple[int, ...]:
    """A block table of consecutive blocks from ``first`` that holds ``tokens`` tokens (tests and
    tools that lay sequences out by hand)."""
    return tuple(range(first, first + blocks_for(tokens)))
