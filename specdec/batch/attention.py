"""Ragged attention straight from the token pool: each row attends to its own keys only.

A flat step holds ``T`` new tokens of ``B`` rows. One dense masked attention over every row's
keys back to back would cost ``T x sum_r n_r`` scores and a gather of every key each layer
(quadratic in the batch). Instead, for each row, its queries attend to a VIEW of its own
contiguous pool range (no copy): ``sum_r q_r x n_r`` scores, no gather.

Registered with transformers as the attention implementation ``specdec_ragged``. It acts only
while a ``BatchRunner`` step is bound (``bind`` / ``unbind``, per thread); any other call of
the same model (``generate``, assisted generation in the benchmark) is SDPA's, mask and all:
the name is registered with SDPA's mask function too, without which transformers builds no
mask for an implementation it does not know and SDPA, told the attention is causal, lines a
multi-token query over a cache up with the first keys instead of the last.
"""

from __future__ import annotations

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
    """Row r of a step: its queries are flat tokens [t0, t0 + q); its keys pool rows
    [start, start + n), the last q of them its own new tokens. ``mask``: [q, n] bool (True =
    attend), None when every query sees every key before it (one query, no token tree)."""

    t0: int
    q: int
    start: int
    n: int
    mask: torch.Tensor | None


def bind(rows: list[RaggedRow]) -> None:
    _BOUND.rows = rows


def unbind() -> None:
    _BOUND.rows = None


def bound() -> bool:
    return getattr(_BOUND, "rows", None) is not None


def ragged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [1, H, T, D]; key / value: the layer's whole pool [Hkv, capacity + 1, D] while a
    step is bound. Returns [1, T, H, D] as transformers' attention functions do."""
    rows = getattr(_BOUND, "rows", None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    heads, kv_heads, dim = query.shape[1], key.shape[0], query.shape[3]
    groups = heads // kv_heads
    outs = []
    for r in rows:
        q = query[:, :, r.t0: r.t0 + r.q]
        k = key[:, r.start: r.start + r.n].unsqueeze(0)  # a view: [1, Hkv, n, D]
        v = value[:, r.start: r.start + r.n].unsqueeze(0)
        if r.q == 1 and groups > 1 and r.mask is None:
            # One query: fold the heads that share a key head into its query rows (no repeat).
            packed = q.reshape(1, kv_heads, groups, dim)
            out = F.scaled_dot_product_attention(packed, k, v, scale=scaling)
            outs.append(out.reshape(1, heads, 1, dim))
        else:
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=r.mask, scale=scaling,
                                                       enable_gqa=groups > 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, ragged_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # unbound calls: SDPA's own mask


def use_ragged(model: torch.nn.Module) -> None:
    """Make ``model`` (and every sub-config sharing its config) attend through ``NAME``."""
    model.config._attn_implementation = NAME
