"""The value pass's one computation over every byte it reads: the L2 norm of every row of a slot.

:func:`row_norms` returns float32 norms, each the square root of a float32 sum of the row's squares
(exact products: a half-precision value squared fits float32). For ``bfloat16`` and ``float16`` rows
it runs a numba kernel: the products summed in several float32 accumulators at once (vectorised;
only the order of the additions differs from a plain loop), ~3x torch's ``vector_norm``, which
sums them in one chain and rounds the norm to the rows' dtype (up to ~0.3% apart for ``bfloat16``
rows 2048 wide).
NaN and Inf propagate as in a plain sum (the kernel allows reassociation and contraction, not
``nnan``/``ninf``): a row holding one has a NaN or Inf norm, wherever it sits in the row. Wider
dtypes go through torch (float64 norms rounded to float32).

:func:`scan_chunk` runs the same kernel over a chunk of a file as it is read, and copies the rows'
hashed columns and the sampled rows while the chunk is in the cache. Both call one compiled
function, so a row's norm is the same bits whichever reads it (a file in chunks, or its tensors).
:func:`half_moments` sums the sampled rows and their squares per channel in one pass.

The kernels compile on first use (about 1 s for all four, numba's import included) and numba with
its compiler adds ~140 MB to the process (65 MB the import, 68 the first compile, ~3 each after:
measured with torch 2.13 and numba 0.65), which a pool's forked workers share.
"""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def _kernels() -> dict[str, Any]:
    """The compiled kernels by dtype name, (norms, moments) each (numba imported, and each compiled,
    on first use; a pool's workers are forked after the driver's :func:`warm`)."""
    import numpy as np
    from llvmlite import ir
    from numba import njit, types
    from numba.core.extending import intrinsic

    @intrinsic
    def bf16(typingctx, bits):  # the float32 whose upper half is these bf16 bits
        def codegen(context, builder, signature, args):
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())
        return types.float32(types.uint16), codegen

    @intrinsic
    def f16(typingctx, bits):  # the float32 of these IEEE half bits
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen

    def make(widen):
        @njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
        def norms_of(u, stride, n, H, r0, norms):
            """The norms of rows ``r0 .. r0+n`` of ``S`` slots, row i's slot s at ``u[i*stride + s*H:][:H]``,
            to ``norms[s, r0+i]``."""
            for i in range(n):
                for s in range(norms.shape[0]):
                    a = i * stride + s * H
                    row = u[a:a + H]  # a slice: indices from 0, no wraparound check to block vectorising
                    acc = np.float32(0.0)
                    for j in range(H):
                        x = widen(row[j])
                        acc += x * x
                    norms[s, r0 + i] = np.sqrt(acc)

        @njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True)
        def moments(u, good, total, sumsq):
            """Per slot s, the sum and the sum of squares of the rows ``u[s, p]`` that ``good[s, p]``
            holds, per channel, added to ``total[s]`` and ``sumsq[s]``."""
            S, P, H = u.shape
            for s in range(S):
                t, q = total[s], sumsq[s]
                for p in range(P):
                    if good[s, p]:
                        row = u[s, p]
                        for j in range(H):
                            x = widen(row[j])
                            t[j] += x
                            q[j] += x * x
        return norms_of, moments

    return {"bfloat16": make(bf16), "float16": make(f16)}


def _flat_rows(x):
    """(flat uint16 numpy view from the first row's start, row stride, rows) of ``x`` [..., H] whose
    rows are evenly spaced, each contiguous; None for any other layout."""
    import torch

    H = x.shape[-1]
    try:
        v = x.view(-1, H)
    except RuntimeError:
        return None
    R = v.shape[0]
    if R == 0 or H == 0 or (v.stride(1) != 1 and H > 1):
        return None
    stride = v.stride(0) if R > 1 else H
    span = (R - 1) * stride + H
    bits = torch.as_strided(v.view(torch.int16), (span,), (1,), v.storage_offset())
    return bits.numpy().view("uint16"), stride, R


HALF = ("bfloat16", "float16")  # the dtypes the kernel reads


def row_norms(x):
    """float32 [...] the L2 norm of each row of ``x`` [..., H] (torch, a float dtype), as the
    module says."""
    import torch

    name = str(x.dtype).replace("torch.", "")
    if name in HALF and x.numel():
        flat = _flat_rows(x)
        if flat is None:
            flat = _flat_rows(x.contiguous())
        out = torch.empty(x.shape[:-1], dtype=torch.float32)
        _kernels()[name][0](flat[0], flat[1], flat[2], x.shape[-1], 0, out.view(1, -1).numpy())
        return out
    return torch.linalg.vector_norm(x, dim=-1).float()


def _numpy(t):
    """A numpy view of torch ``t``: its bits as uint16 for a half dtype (numpy has no bfloat16)."""
    import torch

    return t.view(torch.int16).numpy().view("uint16") if str(t.dtype).replace("torch.", "") in HALF else t.numpy()


def scan_chunk(X, r0: int, norms, blocks, c0: int, picks, lo: int, hi: int, samples) -> None:
    """One pass over a chunk ``X`` (``[n, S, H]`` torch, contiguous, rows ``r0 ..`` of ``S`` slots)
    while it is in the cache: its rows' norms into ``norms`` (``[S, T]`` float32: the kernel's for
    half rows, :func:`row_norms`' otherwise), the ``W`` columns from ``c0`` of each row into
    ``blocks`` (``[S, T, W]``), and the rows ``picks[lo:hi]`` (int64 numpy, ascending, in the chunk)
    into ``samples[:, lo:hi]`` (``[S, P, H]``); all torch, C-contiguous, of the chunk's dtype but
    ``norms``. The copies are numpy's: ~25 and ~20 us a [341, 3, 2048] bf16 chunk, where torch's
    ops on these transposed views took ~35 and ~60 and the kernel's element-by-element copies ~58
    and ~50."""
    n, S, H = X.shape
    if not n:
        return
    bits = _numpy(X)  # [n, S, H]
    name = str(X.dtype).replace("torch.", "")
    if name in HALF:
        _kernels()[name][0](bits.reshape(-1), S * H, n, H, r0, norms.numpy())
    else:
        norms.numpy()[:, r0:r0 + n] = row_norms(X).numpy().T
    b = _numpy(blocks)
    b[:, r0:r0 + n] = bits[:, :, c0:c0 + b.shape[2]].transpose(1, 0, 2)
    if hi > lo:
        _numpy(samples)[:, lo:hi] = bits[picks[lo:hi] - r0].transpose(1, 0, 2)


def half_moments(samples, good):
    """(sum, sum of squares) ``[S, H]`` float32 numpy over the rows ``good`` ([S, P] bool numpy)
    holds of ``samples`` ([S, P, H] torch, half, contiguous), per channel; None for a sample of any
    other dtype or layout (the caller sums it)."""
    import numpy as np

    name = str(samples.dtype).replace("torch.", "")
    if name not in HALF or not samples.is_contiguous():
        return None
    S, _, H = samples.shape
    total, sumsq = np.zeros((S, H), np.float32), np.zeros((S, H), np.float32)
    _kernels()[name][1](_numpy(samples), np.ascontiguousarray(good), total, sumsq)
    return total, sumsq


def warm() -> None:
    """Compile the kernels now (the driver, before it forks its workers)."""
    import numpy as np
    import torch

    for dt in (torch.bfloat16, torch.float16):
        row_norms(torch.zeros(2, 3, dtype=dt))  # the same specialisation scan_chunk calls
        half_moments(torch.zeros(1, 2, 3, dtype=dt), np.ones((1, 2), bool))
