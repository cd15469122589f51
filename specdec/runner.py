"""A model runner for any Hugging Face causal LM, with one KV cache per sequence.

The caller owns the truth (the token ids of each sequence); the runner owns caches. Every
``forward`` reconciles the sequence's cache with the ids it is given: keep the longest
common prefix, crop the rest, feed the missing tokens. Rejection rollback, a restarted worker
and a failover are therefore one code path, and ``rollback`` is the one place a cache shrinks.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specdec.batch.runner import common_prefix_len
from specdec.loading import model_max_length

log = logging.getLogger(__name__)

@dataclass
class SequenceCache:
    """A KV cache and the ids it holds, position for position."""

    cache: DynamicCache
    ids: list[int] = field(default_factory=list)


class ModelRunner:
    """Runs one model over many sequences, each with its own KV cache (batch size 1).

    Thread-safe: one lock serialises the passes, so concurrent requests take turns rather
    than oversubscribing the cores (batching across sequences is future work).
    """

    def __init__(self, model: torch.nn.Module, *, max_sequences: int = 64):
        self.model = model
        self.device = next(model.parameters()).device
        self._lock = threading.RLock()
        self.max_sequences = max_sequences
        self._seqs: OrderedDict[str, SequenceCache] = OrderedDict()
        params = inspect.signature(model.forward).parameters
        self._logits_to_keep = "logits_to_keep" in params
        # transformers 5.24 renamed past_key_values to cache; older models keep the old name.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_length(self) -> int | None:
        return model_max_length(self.model.config)

    def _seq(self, seq_id: str) -> SequenceCache:
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = SequenceCache(cache=DynamicCache(config=self.model.config))
            self._seqs[seq_id] = seq
            while len(self._seqs) > self.max_sequences:  # evict the least recently used
                evicted, _ = self._seqs.popitem(last=False)
                log.warning("evicted the KV cache of %s (max_sequences=%d)", evicted, self.max_sequences)
        else:
            self._seqs.move_to_end(seq_id)
        return seq

    def rollback(self, seq_id: str, length: int) -> None:
        """Crop the sequence's cache to its first ``length`` tokens (rejected drafts go)."""
        with self._lock:
            self._rollback(seq_id, length)

    def _rollback(self, seq_id: str, length: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None or length >= len(seq.ids):
            return
        if length <= 0:
            seq.cache, seq.ids = DynamicCache(config=self.model.config), []
            return
        # transformers 5.24: crop(-n) removes n tokens; a positive argument raises.
        seq.cache.crop(length - len(seq.ids))
        del seq.ids[length:]

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._seqs.pop(seq_id, None)

    @property
    def lock(self) -> threading.RLock:
        """Held by every pass; a caller that works on a cache directly (the early-exit
        drafter) holds it too, so no pass sees the cache half-changed."""
        return self._lock

    @torch.inference_mode()
    def hold(self, seq_id: str, ids: list[int]) -> SequenceCache:
        """Make the sequence's cache hold exactly ``ids`` (crop the rest, feed what is missing)."""
        with self._lock:
            seq = self._seq(seq_id)
            keep = common_prefix_len(seq.ids, ids)
            self._rollback(seq_id, keep)
            if keep < len(ids):
                self._forward(seq_id, ids, 1)
            seq = self._seqs[seq_id]
            assert seq.ids == ids
            return seq

    @torch.inference_mode()
    def forward(self, seq_id: str, ids: list[int], num_logits: int = 1) -> torch.Tensor:
        """Logits [num_logits, vocab] (float32) for the last ``num_logits`` positions of ``ids``.

        Reconciles the cache with ``ids`` first: the longest common prefix stays (up to the
        positions whose logits are asked for, which are recomputed), the rest is cropped,
        the missing tokens are fed in one pass. Afterwards the cache holds all of ``ids``.
        """
        assert 1 <= num_logits <= len(ids), (num_logits, len(ids))
        with self._lock:
            return self._forward(seq_id, ids, num_logits)

    def _forward(self, seq_id: str, ids: list[int], num_logits: int) -> torch.Tensor:
        seq = self._seq(seq_id)
        keep = min(common_prefix_len(seq.ids, ids), len(ids) - num_logits)
        self._rollback(seq_id, keep)
        new = ids[keep:]
        kwargs = {self._cache_kw: seq.cache}
        if self._logits_to_keep:  # no LM head over the earlier positions of a long prompt
            kwargs["logits_to_keep"] = num_logits
        # The DynamicCache grows in place.
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, use_cache=True, **kwargs)
        seq.ids.extend(new)
        return out.logits[0, -num_logits:].float().cpu()  # verification runs on the CPU
