"""A KV cache shared by many sequences: one paged token pool per model, a flat ragged layout per step.

Memory is a budget in blocks of ``BLOCK`` tokens. Each layer's keys and values live in one pool
tensor ``[kv_heads, blocks * BLOCK, head_dim]``; block 0 is scratch (padding writes there). A
sequence holds a block table: position ``p`` lives at pool row ``table[p // BLOCK] * BLOCK +
p % BLOCK``. Blocks are handed out as a sequence grows (``specdec.batch.blocks``) and a full
block of a shared prompt prefix can sit in several tables at once; nothing here cares which.

A step runs every row's new tokens as ONE flat sequence of ``T`` tokens (batch size 1, no
padding): a prefill chunk of 200 tokens and seven 1-token decode rows cost 207 positions, not
8 x 200. ``FlatBatchCache.plan`` turns the rows into

- ``position_ids`` [1, T]: each token's position within its own sequence;
- write indices [T]: the pool row each new token's key/value goes to;
- for the attention (``specdec.batch.attention``), each row's slice of the T queries and its
  keys' pool rows (a slice of the pool when its blocks are consecutive, an index otherwise):
  its queries attend to its own keys, old and new, nothing else.

Rollback is bookkeeping only: a row's length is whatever its caller says it keeps; positions
past it are overwritten by the next tokens fed there.

The pool also remembers which token prefix each full block holds (``holds``: block -> the
``prefix_hashes`` value of the tokens up to its end), so a runner can trust a block another
sequence filled: every write forgets what the written blocks held.

Worked example (``BLOCK`` = 4; row a holds 3 tokens in block 1 and feeds 1, row b holds 2 in
block 5 and feeds 2)::

    position_ids = [3 | 2, 3]            write = [7 | 22, 23]
    row a: query 0 attends to pool rows 4-7; row b: queries 1-2 to pool rows 20-23 (causally)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from specdec import trees
from specdec.batch import attention
from specdec.batch.blocks import BLOCK, slots, span


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a Hugging Face decoder config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, head_dim


@dataclass
class RowPlan:
    """One row of a step: the sequence's block table, tokens it keeps, tokens it feeds.

    A row whose last tokens are a token tree (``specdec.trees``) says where the tree begins
    (``tree_at``: the context's length ``n``) and every node's parent, kept nodes included:
    node ``i`` is token ``n + i`` of the row (the pool row of position ``n + i``), at position
    ``n - 1 + depth(i)``, and attends to the context and its own ancestors only.
    """

    blocks: tuple[int, ...]  # the sequence's block table (``specdec.batch.blocks``)
    keep: int  # tokens already in the cache that stay (the rest is rolled back)
    feed: int  # new tokens this step
    tree_at: int = 0  # with parents: the index of the tree's first node
    parents: tuple[int, ...] | None = None  # the tree's nodes' parents (-1: the root, token n - 1)


def _tree_rows(row: RowPlan, q: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [feed] and the attention mask [feed, keep + feed] of a row ending in a tree:
    a node's position is its depth below the root, and it sees the context and its ancestors."""
    n, at = row.keep + row.feed, row.tree_at
    parents = row.parents
    depth = trees.depths(parents)
    q = q.clone()
    if mask is None:
        mask = torch.ones(1, n, dtype=torch.bool)
    for j in range(row.feed):
        i = row.keep + j - at  # the node this fed token is (negative: a context token)
        if i < 0:
            continue
        q[j] = at - 1 + depth[i]
        mask[j, at:] = False
        node = i
        while node != trees.ROOT:
            mask[j, at + node] = True
            node = parents[node]
    return q, mask


class FlatBatchCache(Cache):
    """The pool, seen by a Hugging Face model as its cache for one flat step.

    ``update`` writes the step's keys / values into the pool and hands the attention the
    layer's whole pool; the bound rows say which part of it each query sees.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, *,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__(layers=[])
        self.num_blocks = num_blocks
        # [heads, tokens, dim]: a run of consecutive blocks is one contiguous slice per head, so
        # attention reads it as a view. Block 0 is scratch.
        shape = (kv_heads, num_blocks * BLOCK, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.dtype, self.device = dtype, torch.device(device)
        self._write: torch.Tensor | None = None
        self._placeholder_mask = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)
        self.invariant = False  # batch-invariant attention (``specdec.batch.attention.bind``)
        self.chain_prompts = False  # ... its prompt chunks' queries too (``attention.prompt_chains``)
        self.batch_chains = False  # ... chains of one key-slot count in one call (``attention.batched_chains_agree``)
        self.holds: dict[int, bytes] = {}  # full block -> the prefix hash of what it holds

    @property
    def capacity(self) -> int:
        """Tokens the pool holds (scratch excluded)."""
        return (self.num_blocks - 1) * BLOCK

    @staticmethod
    def bytes_per_token(config, dtype: torch.dtype) -> int:
        """Pool bytes one cached token takes (keys and values, every layer)."""
        layers, heads, head_dim = kv_shape(config)
        return 2 * layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def forget(self, rows: torch.Tensor) -> None:
        """Pool rows [t] are about to be written: their blocks no longer hold what they held."""
        if self.holds:
            for block in set((rows // BLOCK).tolist()):
                self.holds.pop(block, None)

    def plan(self, rows: list[RowPlan], *, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Bind the next forward to ``rows``; returns (position_ids [1, T], a placeholder 4D
        mask: attention is ``specdec.batch.attention``'s, per row, so transformers must not
        build a mask of its own). ``pad``: that many padding tokens after the rows, written to
        the scratch block; their attention outputs are zeros (no call)."""
        dev = self.device
        q_pos, write, ragged, t0 = [], [], [], 0
        for row in rows:
            q = torch.arange(row.keep, row.keep + row.feed)
            n = row.keep + row.feed
            first = span(row.blocks, n)
            if first is not None:
                keys = slice(first, first + n)
                write.append(first + q)
            else:
                keys = index = slots(row.blocks, 0, n)
                write.append(index[row.keep:])
            mask = None
            if row.feed > 1:  # causal among the row's own new tokens
                mask = torch.arange(n)[None, :] <= q[:, None]
            if row.parents is not None and n > row.tree_at:
                q, mask = _tree_rows(row, q, mask)
            q_pos.append(q)
            ragged.append(attention.RaggedRow(t0, row.feed, keys, n, mask))
            t0 += row.feed
        if pad:
            q_pos.append(torch.zeros(pad, dtype=torch.long))
            write.append(torch.zeros(pad, dtype=torch.long))
        written = torch.cat(write)
        self.forget(written)
        self._write = written.to(dev)
        attention.bind(ragged, dev, invariant=self.invariant, pad=pad, chain_prompts=self.chain_prompts,
                       batch_chains=self.batch_chains)
        return torch.cat(q_pos)[None].to(dev), self._placeholder_mask

    def unbind(self) -> None:
        attention.unbind()

    @property
    def written(self) -> torch.Tensor:
        """[T] the pool rows the bound step writes, token by token."""
        assert self._write is not None, "no step planned"
        return self._write

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [1, kv_heads, T, head_dim]; the attention reads rows of the pool in place.
        # index_copy_, not ``keys[:, rows] = ...``: on the compute thread the indexed assignment of a
        # 20-token step took 80-100 us a call against 10-16 (the demo target, bf16, a 2-core AMD EPYC
        # with AVX-512 BF16), a sixth of what a 17-token verify pass cost over a 1-token step.
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(1, self._write, key_states[0].to(keys.dtype))
        values.index_copy_(1, self._write, value_states[0].to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from plan(); nothing in a model should need this

    @property
    def is_compileable(self) -> bool:
        return False
