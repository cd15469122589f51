"""A trained early-exit head for the ``early_exit`` drafter: the module and its on-disk format.

The adapter (in the spirit of Kangaroo, Liu et al. 2024) reads the residual stream after the
target's layer ``L`` and returns draft logits::

    h' = h + W_down( silu(W_gate x) * W_up x ),   x = norm_in(h)     # one gated-MLP block
    logits = head( norm_out(h') )                                    # over ``token_ids`` only

It is per-position (no attention): the first ``L`` layers already mixed the context, and an
adapter without attention needs no KV cache of its own, so the drafter's only state is the
target's own cache (see ``specdec.drafters.early_exit``). The head covers a reduced vocabulary
(the demo draft's 8,192 frequency-ranked tokens): the full 49k-row head would cost more than
the first layers.

On disk (a directory): ``specdec_exit.json`` (format, exit layer, sizes, the target it was
built for) and ``exit.safetensors`` (file names: :mod:`specdec.models.files`). How the demo
initialises and distils an adapter is ``specdec.demo.exit_adapter``; nothing here depends on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.files import EXIT_FORMAT, EXIT_MARKER, EXIT_VERSION, EXIT_WEIGHTS
from specdec.models.packed import pack_linears

__all__ = ["ExitAdapter", "load_exit_adapter", "save_exit_adapter"]


def _norm(kind: str, size: int, eps: float) -> nn.Module:
    return nn.RMSNorm(size, eps=eps) if kind == "rms" else nn.LayerNorm(size, eps=eps)


class ExitAdapter(nn.Module):
    """Hidden states after layer ``exit_layer`` [n, d] -> float32 logits [n, vocab_size].

    Columns outside ``token_ids`` are -inf, so sampling from ``softmax(logits)`` is exact with
    respect to the ``q`` it reports.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, vocab_size: int, token_ids: torch.Tensor,
                 exit_layer: int, norm: str = "rms", eps: float = 1e-5):
        super().__init__()
        self.exit_layer, self.vocab_size, self.norm_kind, self.eps = exit_layer, vocab_size, norm, eps
        self.norm_in = _norm(norm, hidden_size, eps)
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.norm_out = _norm(norm, hidden_size, eps)
        self.head = nn.Linear(hidden_size, len(token_ids), bias=False)
        self.register_buffer("token_ids", token_ids.long().clone(), persistent=True)

    def reduced_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, H]
        x = self.norm_in(hidden)
        h = hidden + self.down(F.silu(self.gate(x)) * self.up(x))
        return self.head(self.norm_out(h))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, V] float32
        small = self.reduced_logits(hidden).float()
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.token_ids, small)

    def describe(self) -> dict:
        return {"format": EXIT_FORMAT, "version": EXIT_VERSION, "exit_layer": self.exit_layer,
                "hidden_size": self.gate.in_features, "intermediate_size": self.gate.out_features,
                "vocab_size": self.vocab_size, "head_vocab_size": len(self.token_ids), "norm": self.norm_kind,
                "eps": self.eps}


def save_exit_adapter(adapter: ExitAdapter, path: Path, target_config=None, extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in adapter.state_dict().items()}
    save_file(sd, str(path / EXIT_WEIGHTS))
    meta = adapter.describe()
    if target_config is not None:
        meta["target"] = {k: getattr(target_config, k, None)
                          for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")}
    meta.update(extra or {})
    (path / EXIT_MARKER).write_text(json.dumps(meta, indent=2, default=str))  # marker last


def load_exit_adapter(path, dtype: torch.dtype = torch.float32, target_config=None) -> ExitAdapter:
    """Load an adapter directory (eval mode); refuse one built for a different target shape."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / EXIT_MARKER).read_text())
    if meta.get("format") != EXIT_FORMAT:
        raise ValueError(f"{path / EXIT_MARKER} is not a specdec exit adapter")
    if target_config is not None:
        for key in ("hidden_size", "vocab_size"):
            if meta[key] != getattr(target_config, key):
                raise ValueError(f"exit adapter {path} has {key}={meta[key]}, the target "
                                 f"{getattr(target_config, key)}")
        if meta["exit_layer"] >= target_config.num_hidden_layers:
            raise ValueError(f"exit layer {meta['exit_layer']} >= the target's {target_config.num_hidden_layers}")
    sd = load_file(str(path / EXIT_WEIGHTS))
    adapter = ExitAdapter(meta["hidden_size"], meta["intermediate_size"], meta["vocab_size"], sd["token_ids"],
                          meta["exit_layer"], meta["norm"], meta["eps"])
    adapter.load_state_dict(sd)
    adapter = adapter.to(dtype).eval()
    pack_linears(adapter)
    return adapter
