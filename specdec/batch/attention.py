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
import functools
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


INVARIANT_MIN_QUERIES = 2  # invariant: a group's fewest entries (fp32 SDPA rounds a batch of one apart)


def key_slots(n: int) -> int:
    """The key slots of a ``_Group`` entry with ``n`` keys: ``n`` rounded up to a multiple of 128
    up to 2,048 keys, then of a sixteenth of the power of two at or above it (padding under 1/8
    of the keys from 1,024 on; at most eight groups an octave of lengths).

    Each distinct count is a call a layer, and a call of a few entries costs its overhead, not
    its keys: on the demo target (bf16, a 2-core AMD EPYC with AVX-512 BF16) an SDPA call of 2
    entries over 256 to 448 slots took 106-119 us, and 8 decode rows of 60-250 keys fell in up
    to 4 groups on a grid of 64. On a grid of 128, a runner's decode step took 0.90-0.95 of the
    time on a grid of 64 at 4, 8 and 16 rows of 40-300 keys (medians of 6 alternations). Whole
    chat requests, in process at 1 to 16 streams, showed no change that machine's turn-to-turn
    noise (10-25%) let paired turns resolve.

    >>> [key_slots(n) for n in (1, 128, 129, 300, 513, 1000, 1100, 2100, 5000)]
    [128, 128, 256, 384, 640, 1024, 1152, 2304, 5120]
    """
    step = max(128, 1 << max(0, (max(n, 1) - 1).bit_length() - 4))
    return -(-max(n, 1) // step) * step


@dataclass(frozen=True)
class _Group:
    """Queries that each attend alone to their own keys, in ONE call per layer (batch-invariant
    numerics): ``B`` entries of one query (its heads folded onto its key heads) over ``L`` key
    slots, a mask marking the query's keys, ``L = key_slots(n)`` for every entry's ``n`` keys.
    A query's output then depends on its keys alone: the call's shape for it follows from its
    key count, and CPU SDPA rounds an entry alike in any batch of at least
    ``INVARIANT_MIN_QUERIES`` entries at any position (given ``group_query_rows``), while a
    batch of one or another padding can round differently (measured in fp32 and bf16 on an AMD
    EPYC with AVX2 only; ``tests/test_numerics.py`` checks it wherever it runs).

    tokens:  [b] the flat token of each real entry (the group's output rows, in order)
    queries: [B] the flat token of each entry (past b: repeats, their outputs dropped)
    keys:    [B * L] the pool row of each key slot (0, the scratch row, past a query's keys)
    mask:    [B, 1, 1, L] bool, True = attend
    """

    tokens: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor
    l: int  # noqa: E741


def _query_keys(r: RaggedRow) -> list[tuple[int, torch.Tensor]]:
    """(flat token, [count] pool rows it may see) for each query of a row: the context and, in a
    chain, the tokens before it; in a tree, its ancestors."""
    rows = r.key_rows()
    if r.mask is None:
        return [(r.t0 + j, rows) for j in range(r.q)]
    return [(r.t0 + j, rows[r.mask[j]]) for j in range(r.q)]


def _groups(queries: list[tuple[int, torch.Tensor]], device) -> list[_Group]:
    """The queries in one ``_Group`` per key-slot count."""
    by_slots: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for t, keys in queries:
        by_slots.setdefault(key_slots(len(keys)), []).append((t, keys))
    out = []
    for length, chunk in sorted(by_slots.items()):
        entries = chunk + [chunk[-1]] * max(0, INVARIANT_MIN_QUERIES - len(chunk))
        keys = torch.zeros(len(entries), length, dtype=torch.long)
        mask = torch.zeros(len(entries), 1, 1, length, dtype=torch.bool)
        for b, (_, rows) in enumerate(entries):
            keys[b, : len(rows)] = rows
            mask[b, 0, 0, : len(rows)] = True
        out.append(_Group(torch.tensor([t for t, _ in chunk], device=device),
                          torch.tensor([t for t, _ in entries], device=device),
                          keys.flatten().to(device), mask.to(device), length))
    return out


@dataclass(frozen=True)
class _Groups:
    """A step's ``_Group``s read from the layer in ONE gather each of keys, values and queries
    (not one a group): each group's call then sees slices of them, the same values in the same
    order, so it rounds as it would alone. On the demo target (bf16, 2-core AMD EPYC with
    AVX-512 BF16), 8 decode rows of 21-256 keys fell in up to 4 groups a layer on a grid of 64
    key slots, in up to 2 on the grid of 128 (``key_slots``).

    keys [sum B * L] / queries [sum B]: the groups' ``keys`` / ``queries`` back to back;
    tokens [sum b]: their ``tokens``, the order of ``attend``'s output."""

    groups: list[_Group]
    keys: torch.Tensor
    queries: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def of(cls, groups: list[_Group]) -> "_Groups":
        return cls(groups, torch.cat([g.keys for g in groups]), torch.cat([g.queries for g in groups]),
                   torch.cat([g.tokens for g in groups]))

    def attend(self, query, key, value, scaling) -> torch.Tensor:
        """[H, sum b, D]: every group's real entries (``_group_attention`` on each)."""
        keys, values = key.index_select(1, self.keys), value.index_select(1, self.keys)
        queries = query[0].index_select(1, self.queries)
        outs, at, first = [], 0, 0
        for g in self.groups:
            entries = g.queries.numel()
            span = slice(at, at + entries * g.l)
            outs.append(_group_call(g, queries[:, first: first + entries], keys[:, span], values[:, span], scaling))
            at, first = span.stop, first + entries
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


@dataclass
class _Chain:
    """Queries of ONE row that each see a prefix of the row's keys (a decode row's pending token
    and its draft chain) and share a key-slot count ``L``: they attend in one call a layer, their
    heads folded onto the key heads as query rows ``(query, head)``, each row masked to its own
    prefix, the row's keys gathered once (not once a query, as a ``_Group`` does). Where
    ``chain_calls_agree`` says such a call rounds each query exactly as its own ``_Group`` entry
    would, the outputs are the same bits; elsewhere the queries attend as a ``_Group``
    (``fallback``, built only then). On the demo target's shape, 17 queries over 256 keys took 0.16 ms against
    0.49 ms as 17 entries, and 0.38 against 6.5 ms over 768 keys (bf16, 2-core AMD EPYC with
    AVX-512 BF16): a verify pass's attention no longer grows with its drafts times its context.

    tokens: [b] the flat tokens of the queries, in the row's order; counts: [b] the keys each
    sees (a prefix of ``keys``); keys: [L] pool rows (0, the scratch row, past the row's keys);
    queries: (flat token, key rows) of each, for ``fallback``."""

    tokens: torch.Tensor
    counts: torch.Tensor
    keys: torch.Tensor
    l: int  # noqa: E741
    queries: list[tuple[int, torch.Tensor]]
    _masks: dict = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def fallback(self) -> _Group:
        return _groups(self.queries, self.tokens.device)[0]

    def mask(self, groups: int, rows: int) -> torch.Tensor:
        """[1, 1, R, L] bool: query row (j, g) sees its query's prefix; ``R`` is ``b * groups``
        made a multiple of ``rows`` (a ``_Group`` entry's, ``_pad_rows``) by repeating the last."""
        if (groups, rows) not in self._masks:
            seen = torch.arange(self.l, device=self.counts.device)[None] < self.counts[:, None]  # [b, L]
            self._masks[groups, rows] = _pad_rows(seen.repeat_interleave(groups, dim=0), rows)[None, None]
        return self._masks[groups, rows]


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` with its last row repeated up to a multiple of ``multiple`` rows.

    A chain call's query rows are padded to a multiple of a group entry's: CPU SDPA splits them
    into blocks of 32 (64 from 192 rows), and a last block of fewer rows than an entry's rounds
    otherwise (fp32 at the demo target's shape, 4-row entries, on a 2-core AMD EPYC with AVX-512
    BF16: every chain of 34, 66, 130, 162 or 258 rows, i.e. 11 / 22 / 43 / 54 / 86 queries, gave
    other bits with its rows only made even; bf16 at 2,048 keys too; as a multiple of 4, none
    did, 2 to 130 queries over 64 to 2,048 keys)."""
    short = -x.shape[0] % multiple
    return torch.cat([x, x[-1:].expand(short, *x.shape[1:])]) if short else x


CHAIN_MIN_QUERIES = 2  # fewer share nothing: the query joins a ``_Group``


@dataclass
class _Chains:
    """``_Chain``s of one key-slot count ``L`` in ONE call a layer: entry ``b`` is chain ``b``,
    its keys gathered as ``_Chain`` gathers them and its query rows ``(query, head)`` padded,
    by repeating its last, to the count ``R`` of the longest (a multiple of a ``_Group``
    entry's, ``_pad_rows``). Where ``batched_chains_agree`` says such a call rounds every
    query as its own ``_Group`` entry would, the outputs are the same bits as one call a chain;
    the rows of a step's draft chains and token trees then share a call a layer. A runner's
    verify step on the demo target (bf16, 2-core AMD EPYC with AVX-512 BF16, medians of 12
    alternations in one process, the same logits): 4 / 8 / 16 rows of 4 drafts each over 40-300
    keys took 0.92 / 0.77-0.82 / 0.70 of the time of one call a chain; a lone row's tree of 4 to
    16 nodes 0.91-0.94 of the time as ``_Group`` entries.

    keys: [B * L] the chains' ``keys`` back to back; tokens: [b] their queries' flat tokens."""

    chains: list[_Chain]
    keys: torch.Tensor
    tokens: torch.Tensor
    l: int  # noqa: E741
    _plans: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, chains: list[_Chain]) -> "_Chains":
        return cls(chains, torch.cat([c.keys for c in chains]), torch.cat([c.tokens for c in chains]), chains[0].l)

    def plan(self, groups: int, rows: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R, [B * R] the query row of each entry row in [b * G] (the tokens' rows (query, head)),
        mask [B, 1, R, L], [b * G] each of those rows' place in [B * R])."""
        if (groups, rows) not in self._plans:
            sizes = [c.tokens.numel() * groups for c in self.chains]
            r = max(-(-n // rows) * rows for n in sizes)
            device = self.tokens.device
            source, place, masks, at = [], [], [], 0
            for b, (c, n) in enumerate(zip(self.chains, sizes)):
                source.extend(range(at, at + n))
                source.extend([at + n - 1] * (r - n))
                place.extend(range(b * r, b * r + n))
                masks.append(c.mask(groups, r)[0, 0])  # [R, L]: padding rows as its last
                at += n
            self._plans[groups, rows] = (r, torch.tensor(source, device=device), torch.stack(masks)[:, None],
                                         torch.tensor(place, device=device))
        return self._plans[groups, rows]

    def attend(self, query, key, value, scaling) -> torch.Tensor:
        """[H, b, D]: every chain's queries (``query`` [1, H, T, D], the pool [Hkv, N, D])."""
        heads, kv_heads, dim = query.shape[1], key.shape[0], query.shape[3]
        groups = heads // kv_heads
        r, source, mask, place = self.plan(groups, group_query_rows(kv_heads, groups, dim, query.dtype,
                                                                     str(query.device)))
        b = self.tokens.numel()
        q = query[0].index_select(1, self.tokens).unflatten(0, (kv_heads, groups)).transpose(1, 2)  # [Hkv, b, G, D]
        q = q.reshape(kv_heads, b * groups, dim).index_select(1, source).unflatten(1, (len(self.chains), r))
        k = key.index_select(1, self.keys).unflatten(1, (len(self.chains), self.l)).transpose(0, 1)  # [B, Hkv, L, D]
        v = value.index_select(1, self.keys).unflatten(1, (len(self.chains), self.l)).transpose(0, 1)
        out = _chains_call(q.transpose(0, 1), k, v, mask, scaling)  # [B, Hkv, R, D]
        out = out.transpose(0, 1).reshape(kv_heads, -1, dim).index_select(1, place)  # [Hkv, b * G, D]
        return out.unflatten(1, (b, groups)).transpose(1, 2).reshape(heads, b, dim)


def _chains_call(q, k, v, mask, scaling) -> torch.Tensor:
    """[B, Hkv, R, D]: entries of query rows q [B, Hkv, R, D] over k / v [B, Hkv, L, D], mask [B, 1, R, L]."""
    return F.scaled_dot_product_attention(q.contiguous(), k, v, attn_mask=mask, scale=scaling)


def _split_chains(r: RaggedRow, device, trees: bool = False) -> tuple[list[_Chain], list[tuple[int, torch.Tensor]]]:
    """A row's queries as ``_Chain`` calls, by key-slot count, and the rest as (flat token, key
    rows) for the ``_Group``s. A chain's queries each see a prefix of its keys: a row whose
    queries see prefixes of its own keys is one chain (a slot count); with ``trees`` (the step's
    chains batched, ``_Chains``), a token tree is one a path (``_tree_paths``), each node in the
    chain of one path through it, a path's lone node a chain of one (its call the batch's)."""
    queries = _query_keys(r)
    if r.q < CHAIN_MIN_QUERIES:
        return [], queries
    rows = r.key_rows()
    if r.mask is None:
        paths = [(rows, list(range(r.q)), [r.n] * r.q)]
    else:
        counts = r.mask.sum(dim=1)
        if torch.equal(r.mask, torch.arange(r.n)[None] < counts[:, None]):  # a chain, a prompt chunk
            paths = [(rows, list(range(r.q)), counts.tolist())]
        elif not trees or (paths := _tree_paths(r, rows)) is None:
            return [], queries
    chains, rest = [], []
    for keys_of_path, js, counts in paths:
        by_slots: dict[int, list[int]] = {}
        for j, c in zip(js, counts):
            by_slots.setdefault(key_slots(c), []).append(j)
        count_of = dict(zip(js, counts))
        for length, members in sorted(by_slots.items()):
            if len(members) < (1 if len(paths) > 1 else CHAIN_MIN_QUERIES):  # a tree's lone node: a chain
                rest.extend(queries[j] for j in members)
                continue
            keys = torch.zeros(length, dtype=torch.long)
            n = min(len(keys_of_path), length)
            keys[:n] = keys_of_path[:n]
            chains.append(_Chain(torch.tensor([r.t0 + j for j in members], device=device),
                                 torch.tensor([count_of[j] for j in members], device=device),
                                 keys.to(device), length, [queries[j] for j in members]))
    return chains, rest


def _tree_paths(r: RaggedRow, rows: torch.Tensor) -> list[tuple[torch.Tensor, list[int], list[int]]] | None:
    """A row's queries as paths: (key rows, queries, each query's key count), every query in one
    path and seeing a prefix of its key rows; None unless every query sees all keys before the
    row's own tokens (a chain's mask, or a token tree's: the context, then its ancestors and
    itself). Deepest query first, a path is its keys and takes every query whose keys are a
    prefix of them: a chain is one path, a tree one a leaf.

    >>> m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # 2 nodes under a root
    >>> [(k.tolist(), js, n) for k, js, n in _tree_paths(RaggedRow(0, 3, slice(10, 14), 4, m), torch.arange(10, 14))]
    [([10, 11, 12], [0, 1], [2, 3]), ([10, 11, 13], [2], [3])]
    """
    context = r.n - r.q
    if not bool(r.mask[:, :context].all()):
        return None
    seen = [[context + i for i, s in enumerate(row) if s] for row in r.mask[:, context:].tolist()]
    paths, taken = [], set()
    for j in sorted(range(r.q), key=lambda j: -len(seen[j])):
        if j in taken:
            continue
        own = seen[j]
        members = [i for i in range(r.q) if i not in taken and own[: len(seen[i])] == seen[i]]
        members.sort(key=lambda i: len(seen[i]))  # shallowest first, as a chain's queries
        taken.update(members)
        keys = torch.cat([rows[:context], rows[torch.tensor(own, dtype=torch.long)]]) if own else rows[:context]
        paths.append((keys, members, [context + len(seen[i]) for i in members]))
    return paths


@dataclass(frozen=True)
class _Step:
    rows: list[RaggedRow]
    packed: Packed | None
    groups: list[_Group]  # invariant: the queries of the rows of at most PACK_MAX_QUERIES tokens ...
    alone: list[int]  # the rows neither packed nor grouped
    chains: list[_Chain] = dataclasses.field(default_factory=list)  # ... but those that share a call
    pad: int = 0  # padding tokens after the rows: no queries of any row, outputs zeros
    together: _Groups | None = None  # the groups' gathers, made once a step
    batches: list[_Chains] = dataclasses.field(default_factory=list)  # chains of one slot count, a call
    flat: dict = dataclasses.field(default_factory=dict)  # the query's shape and layout -> its _FlatPlan

    @property
    def flattens(self) -> bool:
        """Whether every query is a group's or a chain's (``_FlatPlan``)."""
        return self.packed is None and not self.alone and (
            self.together is not None or bool(self.batches) or bool(self.chains))


def bind(rows: list[RaggedRow], device: torch.device | str = "cpu", *, invariant: bool = False, pad: int = 0,
         chain_prompts: bool = False, batch_chains: bool = False) -> None:
    """Bind a step's rows (their masks on the host) to this thread's next forward on ``device``;
    ``pad`` tokens after them (a step padded to a row count, ``specdec.batch.numerics``) belong
    to no row and attend to nothing: their outputs are zeros.

    ``invariant``: batch-invariant numerics. Every query of a row of at most
    ``PACK_MAX_QUERIES`` tokens (a decode row's pending token, drafts, tree nodes) attends alone
    to exactly the keys it may see, in a ``_Group`` call whose rounding does not depend on the
    other queries in it: the logits of a token then do not depend on how many tokens its row
    carries or on what else is in the step, and a step of many rows still makes few calls a
    layer. A longer row (a prompt chunk) attends in one causal call: it depends only on the
    chunk, which the step loop cuts at fixed places in this mode; with ``chain_prompts`` (where
    ``chain_calls_agree``, ``prompt_chains``) its queries attend as ``_Chain``s too, so that
    every token's keys and values are what a decode step computes for it, wherever its chunk
    begins: a prefix any other sequence filled is then the same bits. With ``batch_chains``
    (where ``batched_chains_agree``) the chains of one key-slot count share a call
    (``_Chains``), token trees' paths among them.
    """
    packed = None if invariant else pack(rows, device)
    small = [i for i, r in enumerate(rows) if r.q <= PACK_MAX_QUERIES or chain_prompts] if invariant else []
    chains, queries = [], []
    for i in small:
        c, rest = _split_chains(rows[i], device, trees=batch_chains)
        chains.extend(c)
        queries.extend(rest)
    batches = _batched(chains) if batch_chains else []
    batched = {id(c) for batch in batches for c in batch.chains}
    chains = [c for c in chains if id(c) not in batched]
    queries.extend(q for c in chains if c.tokens.numel() < CHAIN_MIN_QUERIES for q in c.queries)  # a tree's, alone
    chains = [c for c in chains if c.tokens.numel() >= CHAIN_MIN_QUERIES]
    groups = _groups(queries, device) if queries else []
    taken = set(packed.rows if packed is not None else ()) | set(small)
    alone = [i for i in range(len(rows)) if i not in taken]
    rows = [_on(r, device) if i not in taken else r for i, r in enumerate(rows)]
    _BOUND.step = _Step(rows, packed, groups, alone, chains, pad, _Groups.of(groups) if groups else None, batches)


def _batched(chains: list[_Chain]) -> list[_Chains]:
    """The step's chains of at most ``PACK_MAX_QUERIES`` queries (a decode row's drafts, a tree's
    paths; not a prompt chunk's, whose rows would pad the others') that share a key-slot count
    with another, as one ``_Chains`` a count."""
    by_slots: dict[int, list[_Chain]] = {}
    for c in chains:
        if c.tokens.numel() <= PACK_MAX_QUERIES:
            by_slots.setdefault(c.l, []).append(c)
    return [_Chains.of(cs) for _, cs in sorted(by_slots.items()) if len(cs) >= 2]


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


def _group_attention(g: _Group, query, key, value, scaling) -> torch.Tensor:
    """[H, b, D]: each real entry's query over its own keys (``_Group``)."""
    return _group_call(g, query[0].index_select(1, g.queries), key.index_select(1, g.keys),
                       value.index_select(1, g.keys), scaling)


def _group_call(g: _Group, q, k, v, scaling) -> torch.Tensor:
    """[H, b, D]: ``_group_attention`` on its gathered queries [H, B, D] and keys / values
    [Hkv, B * L, D]."""
    heads, kv_heads, dim = q.shape[0], k.shape[0], q.shape[2]
    entries = g.queries.numel()
    k = k.unflatten(1, (entries, g.l)).transpose(0, 1)  # [B, Hkv, L, D]
    v = v.unflatten(1, (entries, g.l)).transpose(0, 1)
    q = q.transpose(0, 1).reshape(entries, kv_heads, heads // kv_heads, dim)
    out = _entries(q, k, v, g.mask, scaling)  # [B, Hkv, G, D]
    return out.reshape(entries, heads, dim)[: g.tokens.numel()].transpose(0, 1)


def _chain_attention(c: _Chain, query, key, value, scaling) -> torch.Tensor:
    """[H, b, D]: a ``_Chain``'s queries, in one call where it rounds as their ``_Group`` would."""
    heads, kv_heads, dim = query.shape[1], key.shape[0], query.shape[3]
    groups = heads // kv_heads
    if not chain_calls_agree(kv_heads, groups, dim, query.dtype, str(query.device)):
        return _group_attention(c.fallback, query, key, value, scaling)
    b = c.tokens.numel()
    q = query[0].index_select(1, c.tokens).unflatten(0, (kv_heads, groups)).transpose(1, 2)  # [Hkv, b, G, D]
    k = key.index_select(1, c.keys)[None]  # [1, Hkv, L, D]
    v = value.index_select(1, c.keys)[None]
    rows = group_query_rows(kv_heads, groups, dim, query.dtype, str(query.device))
    return _chain_call(q, k, v, c.mask(groups, rows), scaling).unflatten(1, (b, groups)).transpose(1, 2).reshape(heads, b, dim)


def _chain_call(q, k, v, mask, scaling) -> torch.Tensor:
    """[Hkv, b * G, D]: q [Hkv, b, G, D] as one entry's query rows (the last repeated to
    ``mask``'s row count) over k / v [1, Hkv, L, D]."""
    kv_heads, b, groups, dim = q.shape
    q = q.reshape(kv_heads, b * groups, dim)
    if mask.shape[2] > b * groups:
        q = torch.cat([q, q[:, -1:].expand(-1, mask.shape[2] - b * groups, -1)], dim=1)
    return F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask, scale=scaling)[0, :, : b * groups]


@functools.cache
def chain_calls_agree(kv_heads: int, groups: int, dim: int, dtype: torch.dtype, device: str) -> bool:
    """Whether a ``_Chain`` call gives every query bitwise the output its own ``_Group`` entry
    gives (with ``group_query_rows``), for chains of 2 to 22 queries over 37 to 700 keys, two
    random draws each. Measured once per shape: it is the kernel's. Seen on a 2-core AMD EPYC
    with AVX-512 BF16: agree in bf16 and fp32 wherever the chain's queries share a key-slot
    count (which ``_split_chains`` ensures), differ by an ulp where they do not."""
    return _chains_agree(kv_heads, groups, dim, dtype, device, (37, 250, 700), (2, 3, 5, 11, 17, 22))


@functools.cache
def prompt_chains(kv_heads: int, groups: int, dim: int, dtype: torch.dtype, device: str) -> bool:
    """Whether batch-invariant numerics can attend a prompt chunk's queries as ``_Chain``s
    (``bind``'s ``chain_prompts``): where chains of up to 128 queries (a chunk's queries of one
    key-slot count) round each query as its own ``_Group`` entry would, over 37 to 1,300 keys.
    Then a token's keys and values do not depend on where its chunk began, and a prefix cache
    may share any full block of a prompt, not only whole chunks
    (``specdec.batch.numerics.INVARIANT_CHUNK``). Seen on a 2-core AMD EPYC with AVX-512 BF16
    at the demo target's shape (3 key heads, 3 query heads each, 64 dims): so in bf16 and fp32
    (once a chain's rows are padded as ``_pad_rows`` says); not at the tiny test pairs' shapes
    (2-row entries), where even short chains do not (``chain_calls_agree``)."""
    return chain_calls_agree(kv_heads, groups, dim, dtype, device) and _chains_agree(
        kv_heads, groups, dim, dtype, device, (37, 250, 700, 1100), (64, 160))


@functools.cache
def batched_chains_agree(kv_heads: int, groups: int, dim: int, dtype: torch.dtype, device: str) -> bool:
    """Whether a ``_Chains`` call gives every query bitwise the output its own ``_Group`` entry
    gives: batches of 2 to 8 chains of 1 to 17 queries, their rows padded to the longest's, over
    37 to 700 keys, through the step's own gathers and calls (``_Chains.attend`` against
    ``_Groups.attend``). Measured once per shape: it is the kernel's. Seen on a 2-core AMD EPYC
    with AVX-512 BF16 at the demo target's shape: agree in bf16 and fp32."""
    if not chain_calls_agree(kv_heads, groups, dim, dtype, device):
        return False
    gen = torch.Generator().manual_seed(2)
    heads = kv_heads * groups
    for n0 in (37, 250, 700):
        for sizes in ((2, 5), (5,) * 8, (2, 3, 11, 17), (17, 2, 4), (1, 5, 1, 3, 1)):
            length = key_slots(n0 + max(sizes) - 1)
            chains, queries, base, t = [], [], 1, 0
            for size in sizes:
                counts = [n for n in range(n0, n0 + size) if key_slots(n) == length]
                if not counts:
                    continue
                rows = torch.arange(base, base + counts[-1])
                keys = torch.zeros(length, dtype=torch.long)
                keys[: len(rows)] = rows
                mine = [(t + j, rows[:n]) for j, n in enumerate(counts)]
                chains.append(_Chain(torch.arange(t, t + len(counts), device=device),
                                     torch.tensor(counts, device=device), keys.to(device), length, mine))
                queries.extend(mine)
                base, t = base + len(rows), t + len(counts)
            if len(chains) < 2:
                continue
            query = torch.randn(1, heads, t, dim, generator=gen).to(dtype=dtype, device=device)
            key, value = (torch.randn(kv_heads, base, dim, generator=gen).to(dtype=dtype, device=device)
                          for _ in range(2))
            batch, alone = _Chains.of(chains), _Groups.of(_groups(queries, device))
            got = batch.attend(query, key, value, 1.0)[:, torch.argsort(batch.tokens)]
            want = alone.attend(query, key, value, 1.0)[:, torch.argsort(alone.tokens)]
            if not torch.equal(got, want):
                return False
    return True


def _chains_agree(kv_heads: int, groups: int, dim: int, dtype: torch.dtype, device: str,
                  starts: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """``chain_calls_agree`` on chains of the queries of ``n0 .. n0 + size - 1`` keys (those of
    one key-slot count) for each start ``n0`` and size."""
    rows = group_query_rows(kv_heads, groups, dim, dtype, device)
    if rows == 0:
        return False
    gen = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    for n0 in starts:
        for size in sizes:
            for _ in range(2):
                length = key_slots(n0 + size - 1)
                counts = [n for n in range(n0, n0 + size) if key_slots(n) == length]  # as _split_chains
                b = len(counts)
                if b < CHAIN_MIN_QUERIES:
                    continue
                q, k, v = rand(kv_heads, b, groups, dim), rand(1, kv_heads, length, dim), rand(1, kv_heads, length, dim)
                c = torch.tensor(counts, device=device)
                seen = (torch.arange(length, device=device)[None] < c[:, None]).repeat_interleave(groups, dim=0)
                mask = _pad_rows(seen, rows)
                one = _chain_call(q, k, v, mask[None, None], 1.0).unflatten(1, (b, groups)).transpose(0, 1)
                entry_mask = (torch.arange(length, device=device)[None] < c[:, None])[:, None, None]
                alone = _entries(q.transpose(0, 1), k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1), entry_mask, 1.0, rows)
                if not torch.equal(one, alone):
                    return False
    return True


def _entries(q, k, v, mask, scaling, rows: int | None = None) -> torch.Tensor:
    """[B, Hkv, G, D]: q [B, Hkv, G, D] over k / v [B, Hkv, L, D] where ``mask`` [B, 1, 1, L] is
    True, each entry carrying ``rows`` query rows (``group_query_rows``; 0: a call an entry)."""
    batch, kv_heads, groups, dim = q.shape
    if rows is None:
        rows = group_query_rows(kv_heads, groups, dim, q.dtype, str(q.device))
    if rows == 0:
        return torch.cat([F.scaled_dot_product_attention(q[b: b + 1], k[b: b + 1], v[b: b + 1], attn_mask=mask[b: b + 1],
                                                         scale=scaling) for b in range(batch)])
    if rows > groups:  # repeats of the last query row, dropped after
        q = torch.cat([q, q[:, :, -1:].expand(-1, -1, rows - groups, -1)], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)[:, :, :groups]


@functools.cache
def group_query_rows(kv_heads: int, groups: int, dim: int, dtype: torch.dtype, device: str) -> int:
    """How many query rows a ``_Group`` entry carries (its ``groups`` query heads, then repeats
    of the last): the fewest even count, from ``groups`` to 16, at which an entry's output is
    bitwise the same at every position of batches of 2, 5 and 9 entries; 0 where none is (then
    each entry has a call of its own). Measured once per shape because it is the kernel's: CPU
    SDPA splits a batch across threads, and an entry of an odd number of rows can round
    differently on the second thread: fp32 on an AMD EPYC with AVX2 only; on one with AVX-512
    BF16, fp32 in 55 of 60 random masked cases at 3 rows, and bf16 in a case the random probe
    passed (the demo target's 3 query heads a key head: a batched greedy answer changed at
    token 37); with 4 rows, none."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    def output(rows, q0, k0, v0, entries, at, length):
        """The probed entry's output at position ``at`` among random others, laid out as a
        group's gather is (a transposed view of [Hkv, B * L, D])."""
        n = k0.shape[1]
        q = rand(entries, kv_heads, groups, dim)
        q[at] = q0
        k, v = rand(kv_heads, entries, length, dim), rand(kv_heads, entries, length, dim)
        k[:, at, :n], v[:, at, :n] = k0, v0
        mask = torch.zeros(entries, 1, 1, length, dtype=torch.bool, device=device)
        for b in range(entries):
            mask[b, 0, 0, : n if b == at else 1 + (17 * b) % length] = True
        return _entries(q, k.transpose(0, 1), v.transpose(0, 1), mask, 1.0, rows)[at]

    cases = [(rand(kv_heads, groups, dim), rand(kv_heads, n, dim), rand(kv_heads, n, dim)) for n in (37, 300, 700)]
    for rows in range(groups + groups % 2, 17, 2):
        def agrees(q0, k0, v0):
            length = key_slots(k0.shape[1])
            ref = output(rows, q0, k0, v0, 2, 0, length)
            return all(torch.equal(output(rows, q0, k0, v0, entries, at, length), ref)
                       for entries in (2, 5, 9) for at in range(entries))

        if all(agrees(*case) for case in cases):
            return rows
    return 0


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
    if step.pad:  # [1, T, H, D]: the rows' outputs, then zeros for the padding
        out = _step_attention(step, query[:, :, : query.shape[2] - step.pad], key, value, scaling)
        return F.pad(out, (0, 0, 0, 0, 0, step.pad)), None
    return _step_attention(step, query, key, value, scaling), None


def _step_attention(step: _Step, query, key, value, scaling) -> torch.Tensor:
    """[1, T, H, D]: every query of the step's rows (query [1, H, T, D])."""
    p = step.packed
    if p is not None and p.everything:
        return _packed_attention(p, query, key, value, scaling).transpose(0, 1)[None]
    if step.flattens and (out := _flat_attention(step, query, key, value, scaling)) is not None:
        return out
    if p is None and not step.groups and not step.chains and not step.batches:
        outs = [_row_attention(r, query, key, value, scaling) for r in step.rows]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).contiguous()
    out = query.new_empty(query.shape[1], query.shape[2], query.shape[3])  # [H, T, D]
    if p is not None:
        out.index_copy_(1, p.tokens, _packed_attention(p, query, key, value, scaling))
    if step.together is not None:
        out.index_copy_(1, step.together.tokens, step.together.attend(query, key, value, scaling))
    for batch in step.batches:
        out.index_copy_(1, batch.tokens, batch.attend(query, key, value, scaling))
    for c in step.chains:
        out.index_copy_(1, c.tokens, _chain_attention(c, query, key, value, scaling))
    for i in step.alone:
        r = step.rows[i]
        out[:, r.t0: r.t0 + r.q] = _row_attention(r, query, key, value, scaling)[0]
    return out.transpose(0, 1)[None]


@dataclass(frozen=True)
class _FlatPlan:
    """A step whose every query is a ``_Group`` entry's or a chain's (``_Chains``, ``_Chain``), as
    index tensors made at its first layer. Each call's query rows are gathered in one op
    straight from the step's (token, head) rows, padding rows included, in the layout the call
    takes; every call's output is a run of rows of one flat buffer; one gather puts each
    (token, head) row in its place. The calls see the same values in the same layout as
    ``_Groups.attend``, ``_Chains.attend`` and ``_chain_attention`` give theirs (the keys
    gathered as those gather them, float masks equal to the ones SDPA makes of their bool
    ones), so they round alike: the same bits (``tests/test_numerics.py``), without the
    reshapes, padding copies and scatter of each part's output. Attention of 30 layers of the
    demo target's shape (bf16, a 2-core AMD EPYC with AVX-512 BF16), this against a call a
    part: a decode row 2.5-2.9 vs 3.5-4.1 ms, a 4-draft chain 2.1-2.3 vs 3.8-4.0, a 16-node
    tree 10.4 vs 12.3-13.1, 8 decode rows 12.3 vs 15.9-17.3; building the plan, once a step,
    0.1 to 0.95 ms.

    queries: [sum B * Hkv * rows] the flat query row of each group entry's rows, the groups
    back to back; group_masks: each group's mask in the query's dtype; chain_queries /
    chain_masks: the same for each ``_Chains`` call ([B * Hkv * R]), then each lone ``_Chain``'s
    ([Hkv * R]); out: [T * H] the buffer row of each (token, head), token-major."""

    queries: torch.Tensor | None
    group_masks: list[torch.Tensor]
    rows: int
    chain_queries: list[torch.Tensor]
    chain_masks: list[torch.Tensor]
    out: torch.Tensor


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as SDPA makes it a float one: 0 where True, -inf elsewhere, in ``dtype``."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _flat_plan(step: _Step, heads: int, kv_heads: int, dim: int, total: int, dtype: torch.dtype, device,
               token_major: bool) -> _FlatPlan | None:
    """``step``'s ``_FlatPlan`` for ``total`` tokens of ``heads`` query heads over ``kv_heads``;
    None where a group's entries would each have a call of their own (no ``group_query_rows``)
    or some token would have no output."""
    groups = heads // kv_heads
    rows = group_query_rows(kv_heads, groups, dim, dtype, str(device))
    if rows == 0:
        return None

    def flat(tokens: torch.Tensor, head: torch.Tensor) -> torch.Tensor:  # a (token, head) pair's query row
        return tokens * heads + head if token_major else head * total + tokens

    out = torch.full((total, heads), -1, dtype=torch.long)
    kv = torch.arange(kv_heads)
    queries, masks, at = [], [], 0
    if step.together is not None:
        r = torch.arange(rows).clamp(max=groups - 1)  # an entry's rows: its kv head's query heads, then repeats
        for g in step.groups:
            entries = g.queries.cpu()
            queries.append(flat(entries[:, None, None], kv[None, :, None] * groups + r[None, None, :]).flatten())
            masks.append(_float_mask(g.mask, dtype))
            tokens = g.tokens.cpu()
            e, j, i = torch.meshgrid(torch.arange(len(tokens)), kv, torch.arange(groups), indexing="ij")
            out[tokens[:, None, None], j * groups + i] = at + (e * kv_heads + j) * rows + i
            at += len(entries) * kv_heads * rows
    chain_queries, chain_masks = [], []
    for batch in step.batches:
        r, source, mask, place = batch.plan(groups, rows)
        tokens, source, place = batch.tokens.cpu(), source.cpu(), place.cpu()
        b = len(batch.chains)
        src = source.view(b, 1, r)  # [B, 1, R]: each entry row's (query, head-in-group) row
        heads_of = kv[None, :, None] * groups + src % groups  # [B, Hkv, R]
        chain_queries.append(flat(tokens[src // groups], heads_of).flatten().to(device))
        chain_masks.append(_float_mask(mask, dtype))
        s = torch.arange(len(tokens) * groups)
        spot = place[s]  # entry * R + row of the (query, head-in-group) row s
        out[tokens[s // groups], kv[:, None] * groups + s % groups] = at + ((spot // r) * kv_heads + kv[:, None]) * r + spot % r
        at += b * kv_heads * r
    if step.chains and not chain_calls_agree(kv_heads, groups, dim, dtype, str(device)):
        return None  # each lone chain's queries attend as a ``_Group`` (``_chain_attention``)
    for c in step.chains:
        mask = c.mask(groups, rows)  # [1, 1, R, L]: its (query, head-in-group) rows, the last repeated
        r, tokens = mask.shape[2], c.tokens.cpu()
        s = torch.arange(r).clamp(max=len(tokens) * groups - 1)[None]  # [1, R]
        chain_queries.append(flat(tokens[s // groups], kv[:, None] * groups + s % groups).flatten().to(device))
        chain_masks.append(_float_mask(mask, dtype))
        s = torch.arange(len(tokens) * groups)
        out[tokens[s // groups], kv[:, None] * groups + s % groups] = at + kv[:, None] * r + s
        at += kv_heads * r
    if bool((out < 0).any()):
        return None
    return _FlatPlan(torch.cat(queries).to(device) if queries else None, masks, rows, chain_queries, chain_masks,
                     out.flatten().to(device))


def _flat_attention(step: _Step, query, key, value, scaling) -> torch.Tensor | None:
    """[1, T, H, D]: every query of a step whose queries are all groups' and chains'
    (``_FlatPlan``); None where it has no such plan."""
    _, heads, total, dim = query.shape
    kv_heads = key.shape[0]
    q = query[0]
    token_major = total == 1 or q.transpose(0, 1).is_contiguous()
    rows_of = q.transpose(0, 1).reshape(total * heads, dim) if token_major else q.reshape(heads * total, dim)
    plan_key = (heads, kv_heads, dim, total, query.dtype, str(query.device), token_major)
    if plan_key not in step.flat:
        step.flat[plan_key] = _flat_plan(step, heads, kv_heads, dim, total, query.dtype, query.device, token_major)
    plan = step.flat[plan_key]
    if plan is None:
        return None
    outs = []
    if step.together is not None:
        together = step.together
        keys, values = key.index_select(1, together.keys), value.index_select(1, together.keys)
        qs = rows_of.index_select(0, plan.queries)
        at, first = 0, 0
        for g, mask in zip(step.groups, plan.group_masks):
            entries = g.queries.numel()
            span = slice(at, at + entries * g.l)
            n = entries * kv_heads * plan.rows
            k = keys[:, span].unflatten(1, (entries, g.l)).transpose(0, 1)  # [B, Hkv, L, D]
            v = values[:, span].unflatten(1, (entries, g.l)).transpose(0, 1)
            out = F.scaled_dot_product_attention(qs[first: first + n].view(entries, kv_heads, plan.rows, dim), k, v,
                                                 attn_mask=mask, scale=scaling)
            outs.append(out.view(n, dim))
            at, first = span.stop, first + n
    for batch, index, mask in zip(step.batches, plan.chain_queries, plan.chain_masks):
        b = len(batch.chains)
        k = key.index_select(1, batch.keys).unflatten(1, (b, batch.l)).transpose(0, 1)  # [B, Hkv, L, D]
        v = value.index_select(1, batch.keys).unflatten(1, (b, batch.l)).transpose(0, 1)
        qs = rows_of.index_select(0, index).view(b, kv_heads, -1, dim)
        outs.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scaling).view(-1, dim))
    lone = zip(step.chains, plan.chain_queries[len(step.batches):], plan.chain_masks[len(step.batches):])
    for c, index, mask in lone:  # as _chain_call: one entry, its keys gathered alone
        k, v = key.index_select(1, c.keys)[None], value.index_select(1, c.keys)[None]  # [1, Hkv, L, D]
        qs = rows_of.index_select(0, index).view(1, kv_heads, -1, dim)
        outs.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scaling).view(-1, dim))
    flat = outs[0] if len(outs) == 1 else torch.cat(outs)
    return flat.index_select(0, plan.out).view(1, total, heads, dim)


AttentionInterface.register(NAME, ragged_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # unbound calls: SDPA's own mask


def use_ragged(model: torch.nn.Module) -> None:
    """Make ``model`` (and every sub-config sharing its config) attend through ``NAME``."""
    model.config._attn_implementation = NAME
