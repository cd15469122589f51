"""What the machine offers: the device models run on, and the dtype that is fastest there."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # native bf16 matrix instructions (Zen 4, Sapphire Rapids)


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


def resolve_dtype(dtype: str, device: str = "auto") -> str:
    """``auto``: the fastest dtype for a model on ``device``. A GPU with bf16 takes bfloat16; a
    CPU takes bfloat16 only with native bf16 instructions (measured on the demo target: a bf16
    (k+1)-token pass costs about one step with AVX-512 BF16, v(4) = 1.04, but k steps without,
    v(4) = 2.6, where float32 is faster); float32 otherwise. Any other value is returned as is."""
    if dtype != "auto":
        return dtype
    if resolve_device(device) == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if native_bf16() else "float32"
