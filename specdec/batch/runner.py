"""A model runner for many sequences at once: one forward per step over every row's new tokens.

The caller owns the truth (each sequence's token ids), the runner owns the cache: every row
of a step is reconciled with the ids it is given
(keep the longest common prefix, roll back the rest, feed what is missing). Rejection
rollback, a restarted worker and a re-prefill are one code path. Rows are ragged: a prefill
chunk, a plain row (1 token) and a speculative row (``k + 1`` tokens) run in the same pass.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from dataclasses import dataclass, field

import torch

from specdec import trees
from specdec.batch import numerics
from specdec.batch.attention import batched_chains_agree, prompt_chains, use_ragged
from specdec.batch.blocks import BLOCK, blocks_for, prefix_hashes, slots
from specdec.batch.cache import FlatBatchCache, RowPlan, kv_shape
from specdec.batch.lean import LeanLlama
from specdec.loading import model_max_length

log = logging.getLogger(__name__)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one extends the other
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


@dataclass
class BatchRow:
    """What one sequence asks of a step.

    ``ids``: the tokens the cache must hold afterwards (the caller's truth);
    ``num_logits``: logits wanted for the last this-many positions (0 for a prefill chunk
    that produces no token); ``blocks``: the sequence's block table (the step loop's
    ``BlockPool`` decides it; it only grows while the sequence lives). Its first blocks may be
    shared with other sequences: the runner trusts a block only when its pool says the block
    holds exactly this prefix (``FlatBatchCache.holds``), and feeds the rest.
    ``parents``: the last ``len(parents)`` ids are a token tree (``specdec.trees``), not a
    continuation: the cache then holds them as a tree until the sequence goes on along one
    of its paths (``accept`` moves that path's entries into place).
    """

    key: str
    ids: list[int]
    num_logits: int = 1
    blocks: tuple[int, ...] = ()
    parents: tuple[int, ...] | None = None
    # Batch-invariant numerics with prompts in causal calls (``prefix_grid`` > 1): how many
    # leading ids other sequences may take from its blocks (its prompt: computed as any prefill
    # of them is; what it generated was computed by decode steps, which round otherwise than a
    # prompt chunk over the same tokens). None: all.
    shared_upto: int | None = None

    @property
    def capacity(self) -> int:
        """Tokens its blocks hold."""
        return len(self.blocks) * BLOCK

    @property
    def tree_at(self) -> int:
        return len(self.ids) - len(self.parents) if self.parents is not None else len(self.ids)


@dataclass
class _Tree:
    """A token tree the cache holds after a sequence's first ``n`` tokens: node ``i`` at slot
    ``start + n + i``."""

    n: int
    tokens: list[int]
    parents: tuple[int, ...]


@dataclass
class _Seq:
    blocks: tuple[int, ...]
    ids: list[int] = field(default_factory=list)  # the tokens cached as a sequence (a tree's context)
    tree: _Tree | None = None
    named: list[bytes] = field(default_factory=list)  # prefix hashes of its first full blocks (a prefix of ids)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * BLOCK


def default_capacity(config, dtype: torch.dtype, device: torch.device, max_length: int | None) -> int:
    """Pool tokens sized from the device: 60% of free GPU memory, or 10% of RAM on a CPU;
    never more than 64 full-length sequences. A unit decides this once (``specdec.engine``)."""
    per_token = FlatBatchCache.bytes_per_token(config, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(0.6 * free)
    else:
        budget = int(0.1 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return max(1024, min(budget // per_token, 64 * (max_length or 4096)))


class BatchRunner:
    """One model, one token pool, many sequences. Thread-safe (one lock serialises passes)."""

    def __init__(self, model: torch.nn.Module, *, capacity_tokens: int | None = None,
                 max_length: int | None = None, invariant: bool = False):
        self.model = model
        self._max_length = max_length  # the operator's cap (max_model_len), below the model's own
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        cfg = model.config
        capacity = capacity_tokens or default_capacity(cfg, self.dtype, self.device, self.max_length)
        try:
            self.cache = FlatBatchCache(*kv_shape(cfg), blocks_for(capacity) + 1, dtype=self.dtype, device=self.device)
        except torch.OutOfMemoryError as exc:  # a size decided earlier (a restarted worker) no longer fits
            raise RuntimeError(f"a KV pool of {capacity} tokens does not fit on {self.device} next to the model; "
                               "free the device or configure a smaller kv_cache_tokens") from exc
        self.cache.invariant = invariant  # a token's logits do not depend on its row's length or the batch
        if invariant:  # ... nor on where its prompt chunk began, where the kernels allow it
            _, kv_heads, head_dim = kv_shape(cfg)
            shape = (kv_heads, cfg.num_attention_heads // kv_heads, head_dim, self.dtype, str(self.device))
            self.cache.chain_prompts = prompt_chains(*shape)
            self.cache.batch_chains = batched_chains_agree(*shape)
        # invariant: the row counts whose products round as a large batch's (``specdec.batch.numerics``)
        self._agreeing = (numerics.agreeing_counts(numerics.product_shapes(model), self.dtype, str(self.device))
                          if invariant else ())
        use_ragged(model)  # its attention reads each row's keys from the pool in place
        self._seqs: dict[str, _Seq] = {}
        self.features: torch.Tensor | None = None  # [pool rows, d] once keep_features() is called
        self._captured: torch.Tensor | None = None
        self.last_fed = 0  # tokens the last forward fed (its cost driver)
        self._lock = threading.RLock()
        # Llama stacks run as plain tensor code (the same logits, less Python a step)
        self._lean = LeanLlama(model) if LeanLlama.supports(model) else None
        params = inspect.signature(model.forward).parameters
        # transformers 5.24 renamed past_key_values to cache; older models keep the old name.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def prefix_grid(self) -> int:
        """The blocks a shared prefix is a multiple of: one, unless batch-invariant numerics
        prefill prompts in causal calls (``attention.prompt_chains`` false): then a token's keys
        and values depend on where its chunk began, and only whole ``INVARIANT_CHUNK``s are
        shared."""
        return numerics.INVARIANT_CHUNK // BLOCK if self.cache.invariant and not self.cache.chain_prompts else 1

    @property
    def capacity(self) -> int:
        """Tokens the pool holds."""
        return self.cache.capacity

    @property
    def num_blocks(self) -> int:
        """Blocks of the pool, scratch block 0 included (``specdec.batch.blocks.BlockPool``'s size)."""
        return self.cache.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_length(self) -> int | None:
        own = model_max_length(self.model.config)
        return min(x for x in (own, self._max_length) if x) if (own or self._max_length) else None

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def keep_features(self) -> None:
        """Also keep every fed token's final hidden state (what the LM head reads: an EAGLE
        head's input) in a pool laid out like the KV pool: position ``p`` of a sequence at the
        pool row its block table gives. Valid for the positions the sequence's cache holds. A forward hook
        on the final norm reads its output; the logits do not change."""
        from specdec.models.eagle import final_norm

        if self.features is not None:
            return
        norm = final_norm(self.model)
        width = norm.weight.shape[0]
        self.features = torch.zeros(self.num_blocks * BLOCK, width, dtype=self.dtype, device=self.device)

        def capture(module, args, output):
            self._captured = output

        norm.register_forward_hook(capture)

    def __contains__(self, key: str) -> bool:
        return key in self._seqs

    def blocks_of(self, key: str) -> tuple[int, ...]:
        """``key``'s block table."""
        return self._seqs[key].blocks

    def keys(self) -> set[str]:
        """The sequences this runner holds."""
        with self._lock:
            return set(self._seqs)

    def cached_ids(self, key: str) -> list[int]:
        seq = self._seqs.get(key)
        return list(seq.ids) if seq else []

    def release(self, key: str) -> None:
        """Forget ``key`` (its pool rows are the allocator's to hand out again)."""
        with self._lock:
            self._seqs.pop(key, None)

    def truncate(self, key: str, length: int) -> None:
        """Roll ``key`` back to its first ``length`` tokens (bookkeeping only)."""
        with self._lock:
            seq = self._seqs.get(key)
            if seq is not None:
                del seq.ids[length:]
                del seq.named[length // BLOCK:]
                if seq.tree is not None and length < seq.tree.n:
                    seq.tree = None

    def accept(self, paths: list[tuple[str, list[int]]]) -> None:
        """Each sequence goes on along ``path`` (node indices) of the tree it holds: the path's
        keys, values and features move to the slots right after the context, in one copy per
        layer for all rows, and the rest of the tree is dropped."""
        with self._lock:
            src, dst = [], []
            for key, path in paths:
                seq = self._seqs.get(key)
                if seq is None or seq.tree is None:
                    continue
                tree, n = seq.tree, seq.tree.n
                moved = [(p, j) for j, p in enumerate(path) if p != j]
                if moved:
                    where = slots(seq.blocks, n, n + max(max(m) for m in moved) + 1)
                    src.extend(int(where[m[0]]) for m in moved)
                    dst.extend(int(where[m[1]]) for m in moved)
                seq.ids = seq.ids[: tree.n] + [tree.tokens[p] for p in path]
                seq.tree = None
            if not src:
                return
            self.cache.forget(torch.tensor(dst))
            s = torch.tensor(src, device=self.device)
            d = torch.tensor(dst, device=self.device)
            for keys, values in zip(self.cache.keys, self.cache.values):  # [heads, tokens, dim]
                keys.index_copy_(1, d, keys.index_select(1, s))
                values.index_copy_(1, d, values.index_select(1, s))
            if self.features is not None:
                self.features.index_copy_(0, d, self.features.index_select(0, s))

    def _settle(self, seq: _Seq, key: str, ids: list[int]) -> None:
        """A sequence that held a tree and now goes on: keep the path ``ids`` takes through it."""
        tree = seq.tree
        if len(ids) > tree.n and ids[: tree.n] == seq.ids[: tree.n] and len(seq.ids) >= tree.n:
            self.accept([(key, trees.follow(tree.tokens, tree.parents, ids[tree.n:]))])
        seq.tree = None

    def _kept(self, seq: _Seq, row: BatchRow) -> int:
        """How many of ``row.ids`` the cache already holds: the longest common prefix of a
        sequence, or, for a tree that grew by a level, the context and every node it held.
        A held tree that the row does not grow is settled first (its path moved into place)."""
        at, held = row.tree_at, seq.tree
        if held is not None and row.parents is not None and held.n == at and seq.ids[:at] == row.ids[:at] \
                and row.parents[: len(held.parents)] == held.parents and row.ids[at: at + len(held.tokens)] == held.tokens:
            return at + len(held.tokens)
        if held is not None:
            self._settle(seq, row.key, row.ids)
        return min(common_prefix_len(seq.ids, row.ids), at)

    def _plan_row(self, row: BatchRow) -> tuple[_Seq, RowPlan] | None:
        assert 0 <= row.num_logits <= len(row.ids), (row.num_logits, len(row.ids))
        seq = self._seqs.get(row.key)
        if seq is None or row.blocks[: len(seq.blocks)] != seq.blocks:
            if not all(0 < b < self.num_blocks for b in row.blocks):
                raise ValueError(f"sequence {row.key}: a block of {row.blocks} is outside the pool")
            seq = self._seqs[row.key] = self._shared(row)  # new, or restarted elsewhere
        seq.blocks = row.blocks  # grown by the blocks its next tokens need
        if len(row.ids) > seq.capacity:
            raise ValueError(f"sequence {row.key} needs {len(row.ids)} tokens; its blocks hold {seq.capacity}")
        at = row.tree_at
        keep = min(self._kept(seq, row), len(row.ids) - row.num_logits)
        if keep < at:
            seq.tree = None
            del seq.ids[keep:]
        if keep == len(row.ids):
            return None  # nothing to feed, no logits asked
        del seq.named[keep // BLOCK:]  # the blocks it writes hold something else now
        return seq, RowPlan(seq.blocks, keep, len(row.ids) - keep, at, row.parents)

    def _shared(self, row: BatchRow) -> _Seq:
        """A sequence new to this runner: it holds the first full blocks of ``row`` that its pool
        says hold exactly that prefix (filled by another sequence with the same prompt); with
        batch-invariant numerics, as many of them as make a multiple of ``prefix_grid``."""
        seq = _Seq(row.blocks)
        holds = self.cache.holds
        if not holds or not row.blocks:
            return seq
        ids = row.ids[: min(len(row.ids) - row.num_logits, row.tree_at)]
        for j in range(min(len(ids) // BLOCK, len(row.blocks))):  # block by block: a miss ends it
            name = prefix_hashes(ids[: (j + 1) * BLOCK], start=seq.named)[j]
            if holds.get(row.blocks[j]) != name:
                break
            seq.named.append(name)
        grid = self.prefix_grid  # what it feeds then starts where a prefill chunk would
        del seq.named[len(seq.named) // grid * grid:]
        seq.ids = list(row.ids[: len(seq.named) * BLOCK])
        return seq

    def _name_blocks(self, seq: _Seq, upto: int | None = None) -> None:
        """After a forward: the sequence's full blocks (within its first ``upto`` ids) hold their
        prefixes (for other sequences)."""
        held = len(seq.ids) if upto is None else min(upto, len(seq.ids))
        full, known = min(held // BLOCK, len(seq.blocks)), len(seq.named)
        if full <= known:
            return
        seq.named = prefix_hashes(seq.ids[: full * BLOCK], start=seq.named)
        for j in range(known, full):
            self.cache.holds[seq.blocks[j]] = seq.named[j]

    @torch.inference_mode()
    def forward(self, rows: list[BatchRow], *, on_device: bool = False) -> list[torch.Tensor]:
        """Per row, logits [num_logits, vocab] (float32; on the host, or with ``on_device`` where
        the model ran: the verifier reads them there) for its last positions.

        One model pass over every row's new tokens. Afterwards each row's cache holds its ids.
        """
        with self._lock:
            return self._forward(rows, on_device)

    def _logits(self, input_ids, position_ids, mask, keep) -> torch.Tensor:
        """[1, len(keep), vocab]: one pass of the model over the planned step."""
        if self._lean is None:
            return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                              logits_to_keep=keep, **{self._cache_kw: self.cache}).logits
        hidden = self._lean.hidden(input_ids, position_ids, self.cache)[:, keep]
        head = getattr(self.model, "head_logits", None)  # a reduced-vocabulary draft's
        return head(hidden) if head is not None else self.model.lm_head(hidden)

    def _forward(self, rows: list[BatchRow], on_device: bool = False) -> list[torch.Tensor]:
        planned = [(i, *p) for i, row in enumerate(rows) if (p := self._plan_row(row)) is not None]
        out = [torch.empty(0, self.vocab_size, device=self.device if on_device else "cpu") for _ in rows]
        if not planned:
            return out
        tokens, keep_idx, offset = [], [], 0
        self.last_fed = sum(plan.feed for _, _, plan in planned)
        for i, seq, plan in planned:
            row = rows[i]
            tokens.extend(row.ids[plan.keep:])
            offset += plan.feed
            keep_idx.extend(range(offset - row.num_logits, offset))
        # Padded to a row count on the grid (a bounded set of compiled kernels) that, under
        # batch-invariant numerics, rounds as a large batch does (``specdec.batch.numerics``).
        agreeing = self._agreeing if self.cache.invariant else None
        pad = numerics.padded(len(tokens), agreeing) - len(tokens)
        tokens = tokens + [tokens[-1]] * pad
        if keep_idx:  # the LM head too: repeated rows, their logits dropped
            keep_idx = keep_idx + [keep_idx[-1]] * (numerics.padded(len(keep_idx), agreeing) - len(keep_idx))
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        # Only the positions whose logits are asked for go through the LM head.
        keep = torch.tensor(keep_idx or [len(tokens) - 1], dtype=torch.long, device=self.device)
        position_ids, mask = self.cache.plan([plan for _, _, plan in planned], pad=pad)
        try:
            logits = self._logits(input_ids, position_ids, mask, keep)
            if self.features is not None:  # [1, T, d] -> the pool rows the step wrote
                self.features.index_copy_(0, self.cache.written, self._captured[0].to(self.features.dtype))
                self._captured = None
        finally:
            self.cache.unbind()
        logits = logits[0].float()
        logits = logits if on_device else logits.cpu()
        at = 0
        for i, seq, plan in planned:
            row = rows[i]
            seq.ids = list(row.ids[: row.tree_at])
            self._name_blocks(seq, row.shared_upto if self.prefix_grid > 1 else None)
            if row.parents is not None:
                seq.tree = _Tree(row.tree_at, list(row.ids[row.tree_at:]), tuple(row.parents))
            out[i] = logits[at: at + row.num_logits]
            at += row.num_logits
        return out
