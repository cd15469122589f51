"""Ragged attention straight from the token pool: each row attends to its own keys only.

A flat step holds ``T`` new tokens of ``B`` rows. One dense masked attention over every row's
keys back to back would cost ``T x sum_r n_r`` scores (quadratic in the batch). Instead:

- the rows with few queries (decode rows, drafts, token trees) attend in ONE padded call per
  layer (``Packed``): their keys gathered from the pool into ``[B, Hkv, L, D]``, ``B x Q x L``
  scores with a mask (causal, tree, padding); one call instead of ``B`` is what keeps a step's
  host time from growing with its rows (measured on a 2-core AMD EPYC, one layer of 64 decode
  rows: 1.37 ms as 64 calls, 0.54 ms as one, hidden 64; equal, 3.7 ms, at the demo target's
  heads and 300 keys a row, where the gather costs what the calls save);
- a row with many queries (a prompt chunk) attends alone to its own keys: a VIEW of the pool
  when its blocks are consecutive (no copy), gathered through its block table otherwise:
  ``q x n`` scores.

Registered with transformers as the attention implementation ``specdec_ragged``. It acts only
while a ``BatchRunner`` step is bound (``bind`` / ``unbind``, per thread); any other call of
the same model (``generate``, assisted generation in the benchmark) is SDPA's, mask and all:
the name is registered with SDPA's mask function too, without which transformers builds no
mask for an implementation it does not know and SDPA, told the attention is causal, lines a
multi-token query over a cache up with the first keys instead of the last.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "specdec_ragged"
_BOUND = threading.local()


@dataclass(frozen=True)
class RaggedRow:
    """Row r of a step: its queries are flat tokens [t0, t0 + q); its ``n`` keys the pool rows
    ``keys`` (a slice, or an index [n] through the block table), the last q of them its own new
    tokens. ``mask``: [q, n] bool (True = attend), None when every query sees every key before
    it (one query, no token tree)."""

    t0: int
    q: int
    keys: slice | torch.Tensor
    n: int
    mask: torch.Tensor | None

    def key_rows(self) -> torch.Tensor:
        """[n] the pool rows of its keys."""
        return torch.arange(self.keys.start, self.keys.stop) if isinstance(self.keys, slice) else self.keys


PACK_MAX_QUERIES = 32  # a row feeding more tokens than this (a prompt chunk) attends alone


@dataclass(frozen=True)
class Packed:
    """The rows of a step that attend in ONE call per layer: ``B`` rows padded to ``Q`` query
    slots and ``L`` key slots each. Built once per step, read by every layer.

    keys:    [B * L] the pool row of each key slot (0, the scratch row, past a row's end)
    queries: [B * Q] the flat token of each query slot (a padding slot repeats the row's last)
    mask:    [B, 1, Q, L] bool, True = attend (a padding slot sees what the row's last query sees)
    tokens:  [t] the flat tokens these rows own, ascending; ``slots`` [t]: their query slots
    """

    rows: list[int]
    q: int
    l: int  # noqa: E741
    keys: torch.Tensor
    queries: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor
    slots: torch.Tensor
    everything: bool  # the packed rows are the whole step, in order


def pack(rows: list[RaggedRow], device: torch.device | str) -> Packed | None:
    """Which rows share one padded call, and its index tensors (None: every row alone).

    Rows with at most ``PACK_MAX_QUERIES`` queries are packed unless there are fewer than two,
    except a row holding more than twice the median of their keys (it would pad every other
    row to its length): reading keys ``n`` of ``L`` wastes at most the gather of ``L - n``.
    """
    small = [i for i, r in enumerate(rows) if r.q <= PACK_MAX_QUERIES]
    if len(small) >= 2:
        median = sorted(rows[i].n for i in small)[len(small) // 2]
        small = [i for i in small if rows[i].n <= 2 * median]
    if len(small) < 2:
        return None
    q = max(rows[i].q for i in small)
    length = max(rows[i].n for i in small)
    keys = torch.zeros(len(small), length, dtype=torch.long)
    queries = torch.empty(len(small), q, dtype=torch.long)
    mask = torch.zeros(len(small), q, length, dtype=torch.bool)
    tokens, slots = [], []
    for b, i in enumerate(small):
        r = rows[i]
        keys[b, : r.n] = r.key_rows()
        queries[b, : r.q] = torch.arange(r.t0, r.t0 + r.q)
        queries[b, r.q:] = r.t0 + r.q - 1
        mask[b, : r.q, : r.n] = True if r.mask is None else r.mask
        mask[b, r.q:] = mask[b, r.q - 1]
        tokens.extend(range(r.t0, r.t0 + r.q))
        slots.extend(range(b * q, b * q + r.q))
    everything = len(small) == len(rows)
    return Packed(small, q, length, keys.flatten().to(device), queries.flatten().to(device),
                  mask[:, None].to(device), torch.tensor(tokens, device=device), torch.tensor(slots, device=device),
                  everything)


@dataclass(frozen=True)
class _Query:
    """One query attending alone (batch-invariant numerics): flat token ``t`` over the pool rows
    ``keys`` (a slice, or an index on the device: a block table's, or a tree node's ancestors)."""

    t: int
    keys: slice | torch.Tensor


@dataclass(frozen=True)
class _Step:
    rows: list[RaggedRow]
    packed: Packed | None
    queries: dict[int, list[_Query]]  # invariant: row -> its queries, each attending alone
    alone: list[int]  # the rows neither packed nor split into queries


def _queries(r: RaggedRow, device) -> list[_Query]:
    """Each query of a multi-token row as the lone query of a decode step would attend: the
    same call (one query, no mask) over exactly the keys it may see."""
    out, rows = [], None
    for j in range(r.q):
        seen = torch.ones(r.n, dtype=torch.bool) if r.mask is None else r.mask[j]
        count = int(seen.sum())
        if bool(seen[:count].all()) and isinstance(r.keys, slice):  # causal (a chain, a prompt): a view
            out.append(_Query(r.t0 + j, slice(r.keys.start, r.keys.start + count)))
            continue
        rows = r.key_rows().to(device) if rows is None else rows
        if bool(seen[:count].all()):
            out.append(_Query(r.t0 + j, rows[:count]))
        else:  # a tree node: the context and its ancestors
            out.append(_Query(r.t0 + j, rows[seen.nonzero()[:, 0].to(device)]))
    return out


def bind(rows: list[RaggedRow], device: torch.device | str = "cpu", *, invariant: bool = False) -> None:
    """Bind a step's rows (their masks on the host) to this thread's next forward on ``device``.

    ``invariant``: batch-invariant numerics. No row shares a call, and each query of a row of
    at most ``PACK_MAX_QUERIES`` tokens (a decode row's pending token, drafts, tree nodes)
    attends alone, the way a lone decode step's query does: the logits of a token then do not
    depend on how many tokens its row carries or on what else is in the step (bf16 kernels
    round differently for other query counts, masks and paddings). A longer row (a prompt
    chunk) attends in one causal call: it depends only on the chunk, which the step loop
    cuts at fixed places in this mode.
    """
    packed = None if invariant else pack(rows, device)
    queries = {i: _queries(r, device) for i, r in enumerate(rows) if 1 < r.q <= PACK_MAX_QUERIES} if invariant else {}
    taken = set(packed.rows if packed is not None else ()) | set(queries)
    alone = [i for i in range(len(rows)) if i not in taken]
    rows = [_on(r, device) if i not in taken else r for i, r in enumerate(rows)]
    _BOUND.step = _Step(rows, packed, queries, alone)


def _on(r: RaggedRow, device) -> RaggedRow:
    """A row that attends alone, its mask and key index where the model runs."""
    mask = r.mask.to(device) if r.mask is not None else None
    keys = r.keys.to(device) if isinstance(r.keys, torch.Tensor) else r.keys
    return dataclasses.replace(r, mask=mask, keys=keys)


def unbind() -> None:
    _BOUND.step = None


def bound() -> bool:
    return getattr(_BOUND, "step", None) is not None


def _packed_attention(p: Packed, query, key, value, scaling) -> torch.Tensor:
    """[H, t, D]: the packed rows' outputs, token by token (``Packed.tokens``' order)."""
    heads, kv_heads, dim = query.shape[1], key.shape[0], query.shape[3]
    groups, b = heads // kv_heads, len(p.rows)
    k = key.index_select(1, p.keys).unflatten(1, (b, p.l)).transpose(0, 1)  # [B, Hkv, L, D]
    v = value.index_select(1, p.keys).unflatten(1, (b, p.l)).transpose(0, 1)
    q = query[0].index_select(1, p.queries).unflatten(1, (b, p.q)).transpose(0, 1)  # [B, H, Q, D]
    if p.q == 1 and groups > 1:  # fold the heads that share a key head into its query rows
        out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, groups, dim), k, v, attn_mask=p.mask,
                                             scale=scaling).reshape(b, heads, 1, dim)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scaling, enable_gqa=groups > 1)
    return out.transpose(0, 1).reshape(heads, b * p.q, dim).index_select(1, p.slots)


def _lone_query(q, k, v, scaling) -> torch.Tensor:
    """[1, H, 1, D]: one query [1, H, 1, D] over all of k / v [1, Hkv, n, D], no mask: the call of
    a decode row, and of every query that must round like one (invariant numerics)."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[3]
    if heads == kv_heads:
        return F.scaled_dot_product_attention(q, k, v, scale=scaling)
    # Fold the heads that share a key head into its query rows (no repeat).
    packed = q.reshape(1, kv_heads, heads // kv_heads, dim)
    return F.scaled_dot_product_attention(packed, k, v, scale=scaling).reshape(1, heads, 1, dim)


def _one_query(qr: _Query, query, key, value, scaling) -> torch.Tensor:
    """[1, H, 1, D]: one query of a multi-token row alone, as a decode row's is."""
    return _lone_query(query[:, :, qr.t: qr.t + 1], key[:, qr.keys].unsqueeze(0), value[:, qr.keys].unsqueeze(0),
                       scaling)


def _row_attention(r: RaggedRow, query, key, value, scaling) -> torch.Tensor:
    """[1, H, q, D]: one row's queries over its own keys (a view when they are one slice)."""
    q = query[:, :, r.t0: r.t0 + r.q]
    k = key[:, r.keys].unsqueeze(0)  # [1, Hkv, n, D]
    v = value[:, r.keys].unsqueeze(0)
    if r.q == 1 and r.mask is None:
        return _lone_query(q, k, v, scaling)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=r.mask, scale=scaling,
                                          enable_gqa=query.shape[1] > key.shape[0])


def ragged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [1, H, T, D]; key / value: the layer's whole pool [Hkv, capacity + 1, D] while a
    step is bound. Returns [1, T, H, D] as transformers' attention functions do."""
    step = getattr(_BOUND, "step", None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    p = step.packed
    if p is not None and p.everything:
        return _packed_attention(p, query, key, value, scaling).transpose(0, 1)[None], None
    if p is None:
        outs = [torch.cat([_one_query(qr, query, key, value, scaling) for qr in step.queries[i]], dim=2)
                if i in step.queries else _row_attention(r, query, key, value, scaling)
                for i, r in enumerate(step.rows)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).contiguous(), None
    out = query.new_empty(query.shape[1], query.shape[2], query.shape[3])  # [H, T, D]
    out[:, p.tokens] = _packed_attention(p, query, key, value, scaling)
    for i in step.alone:
        r = step.rows[i]
        out[:, r.t0: r.t0 + r.q] = _row_attention(r, query, key, value, scaling)[0]
    return out.transpose(0, 1)[None], None


AttentionInterface.register(NAME, ragged_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # unbound calls: SDPA's own mask


def use_ragged(model: torch.nn.Module) -> None:
    """Make ``model`` (and every sub-config sharing its config) attend through ``NAME``."""
    model.config._attn_implementation = NAME
