"""What the machine offers: the device models run on, and the dtype that is fastest there."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import platform
from pathlib import Path

import torch

from specdec.paths import specdec_home

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


def resolve_dtype(dtype: str, device: str = "auto") -> str:
    """``auto``: the fastest dtype for a model on ``device``. A GPU with bf16 takes bfloat16; a
    CPU with native bf16 instructions takes bfloat16 (measured on the demo target: a bf16
    (k+1)-token pass costs about one step with AVX-512 BF16, v(4) = 1.04); any other CPU takes
    what ``measured_cpu_dtype`` found faster there (without native bf16 either can win: on one
    AVX2 CPU fp32 was faster for 5-token passes, on another bf16 was for every pass). Any other
    value is returned as is."""
    if dtype != "auto":
        return dtype
    if resolve_device(device) == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if any(flag in cpu_flags() for flag in BF16_CPU_FLAGS):
        return "bfloat16"
    return measured_cpu_dtype()["dtype"]


MEASURED_SHAPES = (("linear", 1024, 4096), ("linear", 4096, 1024))  # a decoder layer's MLP, 1B-class
MEASURED_STEPS = (1, 5)  # a plain decode step's tokens, a chain of 4 drafts'
BF16_MARGIN = 1.2  # emulated bf16 is taken only when this much faster: a close call keeps fp32


def measured_cpu_dtype() -> dict:
    """This machine's choice for ``auto`` without native bf16: {"dtype", "float32_ms",
    "bfloat16_ms"}, the time of ``MEASURED_SHAPES``' products for ``MEASURED_STEPS`` tokens in
    each dtype, each step padded to a row count that rounds as a large batch
    (``specdec.numerics``: what the default batch-invariant numerics feed). Measured once per
    machine (CPU, flags, torch, threads) and kept in ``$SPECDEC_HOME/hardware.json`` under a
    lock, so every process on the machine (a unit's workers, its replicas) takes the same
    dtype, and with it the same greedy answers."""
    key = _machine_key()
    if key in _MEASURED:
        return _MEASURED[key]
    path = specdec_home() / "hardware.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            known = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            known = {}
        if key not in known:
            from specdec import compute

            known[key] = compute.run(_measure)
            path.write_text(json.dumps(known, indent=2))
    _MEASURED[key] = known[key]
    return known[key]


_MEASURED: dict[str, dict] = {}


def _machine_key() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{model} | flags {flags} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def _measure() -> dict:
    import statistics
    import time

    import torch.nn.functional as F

    from specdec import numerics

    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        # the counts that round alike, probed on a small product (cheap; the same counts as
        # the large ones' on the CPUs measured)
        agreeing = numerics.agreeing_counts((("linear", 576, 1536),), dtype, "cpu")
        total = 0.0
        for _, n_in, n_out in MEASURED_SHAPES:
            w = torch.randn(n_out, n_in, generator=gen).to(dtype)
            for tokens in MEASURED_STEPS:
                x = torch.randn(numerics.padded(tokens, agreeing), n_in, generator=gen).to(dtype)
                times = []
                for _ in range(9):
                    start = time.perf_counter()
                    F.linear(x, w)
                    times.append(time.perf_counter() - start)
                total += statistics.median(times[2:])
        out[f"{name}_ms"] = round(total * 1000, 3)
    out["dtype"] = "bfloat16" if out["bfloat16_ms"] * BF16_MARGIN < out["float32_ms"] else "float32"
    return out
