"""Linear layers on weights prepacked for the CPU's matrix-product library (oneDNN).

``F.linear`` hands oneDNN (bf16) or MKL (fp32) a plain row-major weight on every call, and the
library reorders it into its blocked layout each time; a decode step's products are small (one
to a few dozen rows), so that reorder is a large share of each. Packing every ``nn.Linear``'s
weight once at load (``torch.ops.mkldnn._reorder_linear_weight``, the op Inductor's CPU
freezing uses, as vLLM's CPU backend prepacks its GEMMs) and calling
``torch.ops.mkldnn._linear_pointwise`` on it, measured on a 2-core AMD EPYC with AVX-512 BF16:

| product (in x out), rows | bf16 F.linear | bf16 packed | fp32 F.linear | fp32 packed |
|---|---|---|---|---|
| 576 x 1536, 1 | 80 us | 48 us | 102 us | 74 us |
| 576 x 1536, 8 | 98 us | 72 us | 294 us | 139 us |
| 576 x 49152 (an LM head), 1 | 4.8 ms | 2.3 ms | 13.1 ms | 6.0 ms |
| 576 x 49152, 2 | 4.7 ms | 1.9 ms | 25.9 ms | 6.7 ms |

bf16 packed products equal ``F.linear``'s bit for bit there; fp32 ones do not (another kernel),
so a model is packed once, at load, and every pass of it (every step, every mode, the quality
guard's replays) runs the same kernels. Their rounding across row counts is what
``specdec.batch.numerics`` measures, on the op the model runs (``product``).

The original weight stays (tied embeddings read it, training updates it): a packed layer holds
its weight twice. A packed layer computes with ``F.linear`` where autograd is recording (the
packed op has no derivative: a frozen target's LM head under a trained head's loss), and
repacks when the weight was written since it was packed. ``stock()`` runs a block with every
packed layer on ``F.linear`` (the benchmark's transformers peer: transformers as a user runs it).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F

_STOCK = threading.local()


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Can this CPU run packed products in ``dtype`` (oneDNN built in; bf16: natively)?"""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> oneDNN's blocked layout for ``linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on a packed weight: x [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _version(weight: torch.Tensor) -> int:
    """How often ``weight`` was written in place (an inference tensor, made under
    ``torch.inference_mode``, cannot be written outside it and keeps no count: 0)."""
    return 0 if weight.is_inference() else weight._version


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward uses its weight packed (``pack_linears`` makes them)."""

    def _repack(self) -> None:
        self._packed = pack(self.weight)
        self._packed_version = _version(self.weight)

    def __getstate__(self):
        """Copies and pickles leave the packed weight out (oneDNN's layout has no storage to
        copy): they repack on their first product."""
        state = super().__getstate__()
        return {**state, "_packed": None, "_packed_version": -1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(_STOCK, "on", False) or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) \
                or x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if _version(self.weight) != self._packed_version:
            self._repack()
        return linear(x, self._packed, self.bias)


def pack_linears(model: torch.nn.Module) -> int:
    """Pack every ``nn.Linear`` of a CPU model whose dtype packs here; how many were packed."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu" and available(module.weight.dtype):
            module.__class__ = PackedLinear
            module._repack()
            count += 1
    return count


@contextlib.contextmanager
def stock():
    """Every packed layer computes with ``F.linear`` in this block (this thread)."""
    before = getattr(_STOCK, "on", False)
    _STOCK.on = True
    try:
        yield
    finally:
        _STOCK.on = before
