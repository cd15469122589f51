"""What the machine offers: the device models run on, and the dtype that is fastest there."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # native bf16 matrix instructions (Zen 4, Sapphire Rapids)
# A CPU format: float32 activations and arithmetic on linear layers whose weights are rounded to
# and stored as float16 (``specdec.models.packed``'s half weights).
HALF_WEIGHTS = "float16-weights"


def resolve_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """The CPU has native bf16 matrix instructions (elsewhere bf16 is emulated in float32)."""
    return any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)


@functools.cache
def half_available() -> bool:
    """Can this CPU run fp32 products on fp16 weights (FBGEMM's, x86 with AVX2: ``HALF_WEIGHTS``)?"""
    try:
        ops = torch.ops.quantized
        ops.linear_dynamic_fp16(torch.ones(1, 8), ops.linear_prepack_fp16(torch.ones(8, 8)))
    except (RuntimeError, AttributeError):
        return False
    return True


def resolve_dtype(dtype: str, device: str = "auto") -> str:
    """``auto``: the fastest dtype for a model on ``device``. A GPU with bf16 takes bfloat16; a
    CPU takes bfloat16 only with native bf16 instructions (measured on the demo target: a bf16
    (k+1)-token pass costs about one step with AVX-512 BF16, v(4) = 1.04, but k steps without,
    v(4) = 2.6, where float32 is faster); without them, float32 on float16 weights where FBGEMM's
    fp16 product runs (x86 with AVX2: the demo target's products per step in half the time of
    float32's at 1 to 4 rows and 0.7 of it at 8, on a 2-core AMD EPYC with AVX2 only), float32
    otherwise. Any other value is returned as is."""
    if dtype != "auto":
        return dtype
    if resolve_device(device) == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if native_bf16():
        return "bfloat16"
    return HALF_WEIGHTS if half_available() else "float32"
