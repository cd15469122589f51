"""Batch-invariant numerics, the matrix products' part: the token counts at which a product
rounds each row as a large batch does.

A CPU matrix product picks its kernel by the number of rows ``M``, and kernels round
differently: measured with ``agreeing_counts`` (rows of ``x[:M] @ W.T`` against the same rows
of a large product), fp32 on an AMD EPYC with AVX2 only agrees for ``M`` in {4, 8} and from 12 on,
bf16 on an AMD EPYC with AVX-512 BF16 from 2 on (with AVX2 only, from 1); fp32 products on fp16
weights (``models.packed``'s half weights, FBGEMM) on the AVX2 EPYC from 3 on but not at 7, 14,
32, 44, 56, 80, 176, 224, 320, 416, 512 or 704 rows (probed to 768). It depends on the
machine and the dtype, so a runner measures it once, on its own model's product shapes, and
pads a step of ``T`` tokens (and the LM head's rows) up to the next count that agrees
(``padded``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdec.models import packed
from specdec.models.packed import PackedLinear

# Prompts are prefilled in chunks of this many tokens (or of a power-of-two part of it), at
# multiples of it, and a prefix is shared only in multiples of it, by the step loop's prefix cache
# and by a runner trusting its pool's blocks alike: a bf16 prefill row's keys and values depend on
# where its chunk begins and ends (attention rounds by the keys its call has, a matrix product by
# its rows; a 45-token chat prompt fed whole and fed as 13 tokens after 32 shared ones gave its
# first token log-probabilities -0.743 and -0.807 with the demo target on a 2-core AMD EPYC with
# AVX-512 BF16, and another answer). The price of a finer grid, measured on that machine: a
# 2,048-token prefill took 2.78 s in chunks of 496, 3.15 s in chunks of 256 and 3.94 s in chunks
# of 128 (each step has a fixed cost).
INVARIANT_CHUNK = 128
PROBE_ROWS = 64  # every count to this is probed; a step of more tokens is taken to agree (fp32 and
#                 bf16: measured to 300 rows), except on half weights, probed on the grid to WIDE_ROWS
WIDE_ROWS = 768  # (a step of more tokens than this is taken to agree on them too)
REFERENCE_ROWS = 96
PROBE_WINDOW_ROWS = 32  # the rows each count's windows cover
PROBE_MAX_OUT = 4096  # a wider product (an LM head) is probed at this many outputs: the
#                       kernel is chosen by M and the reduction, the same outputs from 32 to 49,152 here


def product_shapes(model: torch.nn.Module) -> tuple[tuple[str, int, int], ...]:
    """The distinct (op, inputs, outputs) of the model's matrix products: ``nn.Linear`` (F.linear,
    or oneDNN's on a packed weight: ``PackedLinear``, fused siblings as their one product) and
    transformers' ``Conv1D`` (GPT-2's, an ``addmm``)."""
    shapes = set()
    for m in model.modules():
        if isinstance(m, PackedLinear) and packed.available(m.weight.dtype):  # another kernel (``models.packed``)
            shape = m.siblings.shape if m.siblings is not None else (m.in_features, m.out_features)
            shapes.add(("packed16" if m.half else "packed", *shape))
        elif isinstance(m, torch.nn.Linear):
            shapes.add(("linear", m.in_features, m.out_features))
        elif type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None and m.weight.dim() == 2:
            shapes.add(("addmm", m.weight.shape[0], m.weight.shape[1]))
    return tuple(sorted(shapes))


@functools.cache
def agreeing_counts(shapes: tuple[tuple[str, int, int], ...], dtype: torch.dtype, device: str) -> tuple[int, ...]:
    """Row counts in 1..PROBE_ROWS, and the grid's counts (``on_grid``) to WIDE_ROWS, whose
    products equal, row for row and bitwise, the same rows of a larger product, for every shape:
    every window of ``m`` rows that tiles the first ``PROBE_WINDOW_ROWS`` rows (or one window),
    not only the first. A kernel that accumulates in another order rounds differently for some
    inputs only: bf16 one-row products on an AMD EPYC with AVX-512 BF16 matched the batch's for
    row 0 of a random input but not for 2 of its first 16 rows. Counts above PROBE_ROWS are
    probed on half weights only (``packed16``; others are taken to agree there), two windows
    each."""
    gen = torch.Generator().manual_seed(0)
    good = set(range(1, PROBE_ROWS + 1)) | {on_grid(n) for n in range(PROBE_ROWS + 1, WIDE_ROWS + 1)}
    for op, n_in, n_out in shapes:
        n_out = min(n_out, PROBE_MAX_OUT)
        counts = [m for m in good if m <= PROBE_ROWS or op == "packed16"]
        rows = max(REFERENCE_ROWS, max(counts) + PROBE_WINDOW_ROWS)
        x = torch.randn(rows, n_in, generator=gen).to(dtype=dtype, device=device)
        if op in ("linear", "packed", "packed16"):
            w = torch.randn(n_out, n_in, generator=gen).to(dtype=dtype, device=device)
            product = functools.partial(F.linear, weight=w) if op == "linear" else \
                functools.partial(packed.linear, packed=packed.pack(w, op == "packed16"), bias=None)
        else:
            w = torch.randn(n_in, n_out, generator=gen).to(dtype=dtype, device=device)
            b = torch.randn(n_out, generator=gen).to(dtype=dtype, device=device)
            product = functools.partial(torch.addmm, b, mat2=w)

        def windows(m):
            return range(0, max(PROBE_WINDOW_ROWS, m), m) if m <= PROBE_ROWS else (0, PROBE_WINDOW_ROWS // 2)

        with torch.inference_mode():
            ref = product(x)
            good -= {m for m in counts if not all(torch.equal(product(x[s: s + m]), ref[s: s + m]) for s in windows(m))}
    return tuple(sorted(good))


def on_grid(count: int) -> int:
    """The fewest rows >= ``count`` on the grid of row counts a step's products run at: every
    count to 16, then multiples of 4 to 64, of 16 to 256, of 32 to 1,024, of 128 beyond. A CPU
    matrix library compiles and keeps a kernel per row count (oneDNN: about 0.6 MB each, up to
    1,024 of them a process): a server whose steps ran at every count its load produced would
    grow by hundreds of MB (seen: a worker's RSS +65 MB in a minute of mixed load after warm-up);
    on the grid a model has under 50 counts to 512 rows, and a step pays at most an eighth more
    rows from 64 on, where a product of more rows costs little more (the weights are read once).

    >>> [on_grid(n) for n in (1, 16, 17, 65, 257, 1025)]
    [1, 16, 20, 80, 288, 1152]
    """
    step = 1 if count <= 16 else 4 if count <= 64 else 16 if count <= 256 else 32 if count <= 1024 else 128
    return -(-count // step) * step


def padded(count: int, agreeing: tuple[int, ...] | None = None) -> int:
    """The fewest rows >= ``count`` on the grid (``on_grid``) that, under batch-invariant
    numerics (``agreeing``: the counts that agree, as ``agreeing_counts`` gives them), round as a
    large batch does.

    >>> padded(1, (4, 8, 12, 13)), padded(5, (4, 8, 12, 13)), padded(9, (4, 8, 12, 13)), padded(70, (4, 96))
    (4, 8, 12, 96)
    >>> padded(13, (4, 8, 12, 13)), padded(13, (4, 8, 12, 16)), padded(17, (4, 8, 12, 16)), padded(3)
    (13, 16, 800, 3)
    """
    m = on_grid(count)
    if agreeing is None:
        return m
    while m <= WIDE_ROWS and m not in agreeing:
        m = on_grid(m + 1)
    return m
