"""What every per-type kernel shares: compile flags, small lookup tables,
field readers, and the float tile × activations product.

How the kernels are built (and why): each type has one *row decoder*
`_row_<type>(w, o, nb, dst, f16, lanes)` that turns `nb` blocks starting at byte `o`
of the flat weight buffer into float32 weights `dst[0 : nb·block_size]`, and
two thin parallel drivers, `_mm_<type>` (W @ x and X @ W.T) and
`_rows_<type>` (embedding rows). The drivers decode a small group of rows into
a float32 tile that stays in L1/L2 and multiply it by every activation row, so
a block is decoded once per call however many tokens there are.

Activations stay float32 here (the int8-activation kernels that every call
on Q8_0/Q4_K/Q5_K/Q6_K/Q5_0/MXFP4/IQ4_XS and the i-quants (_iqir) uses while int8 activations are on are in _q8
and _q8ir, written as LLVM IR for the reason below): the decoded weight
is exact in float32 (f16 scale × ≤ 8-bit code fits the 24-bit mantissa), so
the only error is float32 accumulation. Measured on this EPYC (1 thread, data
in cache), a float-activation Q8_0 dot ran at 6.3 G weights/s against 2.5 for
int8 activations with int accumulation: numba widens int8·int8 to int64 and
LLVM then leaves the block dot scalar. Decoding is cheap next to DRAM reads,
so the float form reaches the bandwidth targets without the rounding.

Drivers are spelled out per type, not made from a factory or passed the
decoder as an argument: numba cannot cache a closure or a function that takes
a dispatcher argument, and one driver with a type switch would compile every
decoder on first use.

The drivers inline the helpers and tables here and the constants of blocks.py
(frozen into the code as literals); numba's disk cache stamps them with every
kernel source, these included (_jitcache.py), so an edit here recompiles them.

Legend: R rows, C columns, T activation rows (tokens), G rows per tile,
B blocks per row.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import _target  # noqa: F401  (before any jit: the ARM dot-product target, shared/quant/_target.py)
from ._floatir import PART_FLOATS, W_ROWS, X_ROWS, float_rows
from .blocks import IQ4_NL_VALUES

# No nnan/ninf: an inf or NaN weight must propagate like in numpy, not be
# assumed away. reassoc lets LLVM vectorize the dot reductions; contract
# makes d·q − m one FMA.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
INLINE = dict(inline="always", fastmath=FASTMATH, boundscheck=False, error_model="numpy")
DRIVER = dict(cache=True, parallel=True, fastmath=FASTMATH, boundscheck=False, error_model="numpy", nogil=True)

# Lane count of the decoders' inner loops, passed at run time on purpose: with
# a literal 16/32 LLVM fully unrolls the loop before the loop vectorizer runs,
# and the unrolled stores into the tile cannot be proven not to alias the
# block bytes, so the SLP vectorizer leaves them scalar. As a run-time trip
# count the loop vectorizer takes it (with a cheap overlap check). Measured per
# type (decode, 1 core, in cache, G weights/s): Q8_0 2.0 → 3.9–7.1, Q4_0
# 1.5 → 4.3, Q4_1 1.3 → 7.0, Q2_K 1.3 → 4.6; the others were as fast or faster
# with the literal (Q4_K 10.8 vs 9.0, table lookups 2.1 vs 1.6), so only
# Q8_0, Q4_0, Q4_1 and Q2_K loop over `lanes`.
LANES = 16

# f16 bit pattern → float32, exact (every f16 is a float32). Block scales are
# read through it; 256 KB, shared by all calls.
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

# IQ4_NL / IQ4_XS non-linear code book.
IQ4_VALUES = np.array(IQ4_NL_VALUES, np.float32)
# MXFP4: E8M0 exponent byte → 2^(e−128), half the block scale, because the
# decoder produces twice each E2M1 value as an integer. Exact for every e
# (e = 0 gives the float32 subnormal 2^−128); e = 255 (NaN in the OCP spec) → inf.
with np.errstate(over="ignore"):
    E8M0_HALF = np.ldexp(np.float32(1.0), np.arange(256) - 128).astype(np.float32)


# NVFP4: an unsigned E4M3 scale byte (4 exponent bits, bias 7, 3 mantissa bits; bit 7 unused)
# → half its value, because the decoder produces twice each E2M1 value (as for MXFP4). Code
# 0x7F (E4M3's NaN) → 0, as ggml and gguf-py decode it.
_UE4M3 = np.arange(256)
_UE4M3_EXP, _UE4M3_MAN = (_UE4M3 >> 3) & 15, (_UE4M3 & 7).astype(np.float64)
UE4M3_HALF = (
    np.where(_UE4M3_EXP == 0, _UE4M3_MAN * 2.0**-9, (1.0 + _UE4M3_MAN / 8.0) * np.exp2(_UE4M3_EXP - 7.0))
    * np.where(_UE4M3 == 0x7F, 0.0, 0.5)
).astype(np.float32)


@njit(**INLINE)
def f16_at(w, o, f16):
    """The little-endian f16 field at byte `o` of `w`, as float32."""
    return f16[np.uint64(w[np.uint64(o)]) | (np.uint64(w[np.uint64(o + 1)]) << np.uint64(8))]


@njit(**INLINE)
def k_scale_min(s, j):
    """Q4_K/Q5_K: 6-bit (scale, min) of sub-block j from the 12-byte field `s`."""
    if j < 4:
        return np.float32(s[j] & 63), np.float32(s[j + 4] & 63)
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@njit(**INLINE)
def tile_product(tile, n, X, out, r0):
    """out[:, r0:r0+n] = X @ tile[:n].T for a float32 tile [G, C], X [T, C]: one fixed chain
    of sums per element, the same for one activation row and for many (_floatir)."""
    T, C = X.shape
    groups = (n + W_ROWS - 1) // W_ROWS
    scratch = np.empty(X_ROWS * C + groups * W_ROWS * PART_FLOATS if T >= X_ROWS else 0, np.float32)
    float_rows(X, tile, n, out, r0, scratch)
