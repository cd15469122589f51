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

Siblings that read the same input (a Llama layer's q / k / v projections; its gate and up
projections) run as ONE product on their weights stacked (``fuse_siblings``): whichever of them
is called first with an input computes all of them, and the others take their part of it. On the
demo target's shapes that takes 30 layers' products from 15.7 to 12.9 ms at one row and from 17.6
to 14.7 ms at eight (2-core AMD EPYC, AVX-512 BF16, cold weights), and each part equals its own
product bit for bit there (bf16 and fp32, 1 to 130 rows), so fusing changes no number.

**Half weights** (``pack_linears(model, half=True)``, what ``dtype: float16-weights`` serves): an fp32
model's weights are rounded to fp16 and packed for FBGEMM's fp16 product
(``torch.ops.quantized.linear_prepack_fp16``), which widens them to fp32 as it reads them and
computes in fp32: a weight-only format that halves the bytes each product reads. The layers'
weights are rounded to fp16 in place, so the model served is the one with those weights
everywhere (``F.linear``'s paths below, a tied embedding), its products equal to ``F.linear``'s
to fp32 rounding. The demo target's products per step, on a 2-core AMD EPYC with AVX2 only (no
native bf16), against the fp32 packed ones: 8.3-9.0 ms against 15.8-18.2 at one row, 10.2-10.3
against 20.9 at four, 18.1-20.0 against 26.6-27.1 at eight, 35.7-45.0 against 45.4-48.2 at 20.

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

from specdec.hardware import half_available

_STOCK = threading.local()


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Can this CPU run packed products in ``dtype`` (oneDNN built in; bf16: natively)?"""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack(weight: torch.Tensor, half: bool = False):
    """[out, in] -> oneDNN's blocked layout for ``linear``; ``half``: FBGEMM's packed fp16 weight."""
    if half:
        return torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on a packed weight (either kind ``pack`` makes): x [..., in] -> [..., out]."""
    if isinstance(packed, torch.Tensor):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.quantized.linear_dynamic_fp16(x, packed)
    return out if bias is None else out.add_(bias)


def _version(weight: torch.Tensor) -> int:
    """How often ``weight`` was written in place (an inference tensor, made under
    ``torch.inference_mode``, cannot be written outside it and keeps no count: 0)."""
    return 0 if weight.is_inference() else weight._version


def _packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of ``x`` with ``weight`` runs on the packed weight: not where autograd
    records it, nor in ``stock()``, nor off the CPU, nor in a dtype this CPU cannot pack (a model
    packed, then cast: bf16 without avx512bw)."""
    return not (stocked() or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                or x.device.type != "cpu" or x.dtype != weight.dtype or not available(x.dtype))


class PackedRows:
    """``x @ weight.T`` for a weight that is a plain tensor, not a layer's (an EAGLE or Medusa
    head's rows of the target's LM head): on the weight packed as a ``PackedLinear``'s is (``half``:
    fp16, FBGEMM), where one would be; packed again when another tensor is passed or it was
    written. The matmul otherwise (training, another device)."""

    def __init__(self, half: bool = False):
        self.half = half
        self._weight: torch.Tensor | None = None  # the tensor packed, and its version then
        self._version = -1
        self._packed = None

    def __getstate__(self):
        return {"half": self.half, "_weight": None, "_version": -1, "_packed": None}  # oneDNN's layout does not copy

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not _packs(x, weight):
            return x @ weight.T
        if weight is not self._weight or _version(weight) != self._version:
            self._packed, self._weight, self._version = pack(weight, self.half), weight, _version(weight)
        return linear(x, self._packed, None)


class Siblings:
    """Packed layers that read the same input, run as one product on their stacked weights.

    Inside their parent module's forward (``open``, between its hooks), the first member called
    with an input ``x`` computes every member's output and each member then takes its own part
    when called with that same tensor; a member called with another input starts over, so any
    calling order is correct and the usual one (each member once per input) saves products.
    The window is the parent's forward because an inference tensor keeps no count of in-place
    writes: the model's code between the calls (a Llama layer's) does not write its input.
    Outside it, a member's output is its part of a product of its own. Per thread.
    """

    def __init__(self, members: list["PackedLinear"]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.shape = (members[0].in_features, sum(self.sizes))  # (inputs, outputs) of the product
        self._versions: tuple[int, ...] | None = None
        self._local = threading.local()

    def __getstate__(self):
        return {"members": self.members, "sizes": self.sizes, "shape": self.shape}

    def __setstate__(self, state):
        self.__dict__.update(state, _versions=None, _local=threading.local())

    def open(self, *_) -> None:
        """The parent's forward begins (a forward pre-hook)."""
        self._local.held, self._local.open = None, True

    def close(self, *_) -> None:
        """The parent's forward ended (a forward hook): nothing computed is kept."""
        self._local.held, self._local.open = None, False

    def _product(self, x: torch.Tensor) -> list[torch.Tensor]:
        versions = tuple(_version(m.weight) for m in self.members) + tuple(
            _version(m.bias) for m in self.members if m.bias is not None)
        if versions != self._versions:  # a member's weight was written: stack and pack again
            weight = torch.cat([m.weight.detach() for m in self.members])
            bias = None if self.members[0].bias is None else torch.cat([m.bias.detach() for m in self.members])
            self._packed, self._bias, self._versions = pack(weight, self.members[0].half), bias, versions
        return list(linear(x, self._packed, self._bias).split(self.sizes, dim=-1))

    def part(self, member: "PackedLinear", x: torch.Tensor) -> torch.Tensor:
        """``member``'s output for ``x``: from the pending product of this input if there is one."""
        i = self.members.index(member)
        if not getattr(self._local, "open", False):
            return self._product(x)[i]
        held = self._local.held  # (x, the parts not yet taken)
        if held is None or held[0] is not x or held[1][i] is None:
            held = (x, self._product(x))
        out, held[1][i] = held[1][i], None
        self._local.held = None if all(p is None for p in held[1]) else held
        return out


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward uses its weight packed (``pack_linears`` makes them)."""

    siblings: Siblings | None = None  # the fused product it is part of (``fuse_siblings``)
    half = False  # its weight packed as fp16 (an fp32 layer: ``pack_linears(half=True)``)

    def _repack(self) -> None:
        self._packed = pack(self.weight, self.half)
        self._packed_version = _version(self.weight)

    def __getstate__(self):
        """Copies and pickles leave the packed weight out (oneDNN's layout has no storage to
        copy): they repack on their first product."""
        state = super().__getstate__()
        return {**state, "_packed": None, "_packed_version": -1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _packs(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        if self.siblings is not None:
            return self.siblings.part(self, x)
        if _version(self.weight) != self._packed_version:
            self._repack()
        return linear(x, self._packed, self.bias)


# Sibling projections of one input, by the attribute names transformers' Llama-style layers use.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def pack_linears(model: torch.nn.Module, half: bool = False) -> int:
    """Pack every ``nn.Linear`` of a CPU model whose dtype packs here, and fuse their siblings
    (``fuse_siblings``); how many were packed. ``half``: an fp32 model's weights as fp16
    (``half_available``; the module docstring)."""
    if half and not half_available():
        raise ValueError("fp16 weights need FBGEMM's fp16 product (an x86 CPU with AVX2); "
                         "serve this model in float32 instead")
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu" and available(module.weight.dtype):
            module.__class__ = PackedLinear
            module.half = half and module.weight.dtype == torch.float32
            if module.half:  # the model served has these weights: F.linear and a tied embedding read them too
                module.weight.data = module.weight.data.to(torch.float16).to(torch.float32)
            module._repack()
            count += 1
    fuse_siblings(model)
    return count


def fuse_siblings(model: torch.nn.Module) -> int:
    """Make each group of ``SIBLINGS`` under one module (packed, same input size, dtype and
    bias-or-not) one product; how many groups."""
    groups = 0
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, n, None) for n in names]
            if not all(isinstance(m, PackedLinear) and m.siblings is None for m in members):
                continue
            first = members[0]
            if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
                   or (m.bias is None) != (first.bias is None) or m.half != first.half for m in members):
                continue
            fused = Siblings(members)
            for m in members:
                m.siblings, m._packed = fused, None  # the stacked weight is the one packed
            module.register_forward_pre_hook(fused.open)
            module.register_forward_hook(fused.close, always_call=True)  # also when the forward raised
            groups += 1
    return groups


def stocked() -> bool:
    """Is this thread inside ``stock()``?"""
    return getattr(_STOCK, "on", False)


@contextlib.contextmanager
def stock():
    """Every packed layer computes with ``F.linear`` in this block (this thread)."""
    before = getattr(_STOCK, "on", False)
    _STOCK.on = True
    try:
        yield
    finally:
        _STOCK.on = before
