"""Integer dot products against int8 activations: Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, MXFP4, IQ4_XS.

For these types every matvec/matmul call (decode's one activation row and
prefill's several alike) quantizes each activation row to int8 per block of
32 (x̂ = dx·xq, dx = amax/127, xq = rint(x/dx), the q8_0 rounding) and
multiplies on the raw small integers. Per call, row-independent sums of the
codes are computed once: bs (int32, per 16), xs16 = dx·bs (float, per 16)
and xs32 (float, per 32), the Σ x̂ that the weight offsets multiply.

The row dots are LLVM IR (_q8ir, which says how and why). With one
activation row (decode) the weight rows are split across threads, one
intrinsic call per row. With several (a prompt batch, an expert several
tokens route to) the call is a GEMM: weight rows are grouped into tiles of
about 16 KB (they stay in L1 while used) split across threads, and each
tile is multiplied by 4 activation rows at a time (`TILE_TOKENS`; then 2
and 1 for what is left): each block's codes are unpacked once per 4 rows
instead of once per row, and the 4 rows' int8 codes (4·C bytes) stay in L1
across the tile. Each activation row's float operations are those of the
one-row call, in the same order, so every row of a matmul equals the matvec
of that row bit for bit.

The drivers carry no fast-math flags (unlike the float-tile ones, _common):
the rounding of x̂ must be exactly `quantize_q8`'s (what
`effective_activation` returns; `arcp` would let LLVM turn amax/127 into a
multiply by 1/127), and the few scalar float steps here must not be
reassociated differently in the one-row and several-row paths.

Numerics: weights are decoded exactly; the activation is rounded to int8
(|x − x̂| ≤ dx/2 = amax₃₂/254 per element); the integer sums are exact and
the float scaling adds a few float32 roundings per block.
`effective_activation(x, qtype)` returns x̂. A non-finite activation block
gives NaN/inf outputs (dx = inf or NaN), as the float path would.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._q8ir import GENERATORS, INT8_DOT, TILE_TOKENS, rowdot
from .blocks import QK, QK_K

INT8_DOT = INT8_DOT  # re-exported: which build of the dot this process compiles ("vnni", "sdot" or "portable")
assert TILE_TOKENS == 4, "the drivers below spell out tiles of 4, 2 and 1 activation rows"

_DRIVER = dict(cache=True, parallel=True, boundscheck=False, error_model="numpy", nogil=True)
# Bytes of weight rows per GEMM tile: with the 4 activation rows' codes (≤ 4·C
# bytes, 8 KB at C = 2048) it stays within a 32 KB L1.
_TILE_BYTES = 16384

# ---- activation quantization ---------------------------------------------


@njit(inline="always", boundscheck=False, error_model="numpy")
def _quantize_row(X, t, XQ, DX, BS, XS, XS32):
    """Row t of X f32 [T, C] → XQ int8 [T·C], DX f32 [T·C/32] (block scales), BS int32 [T·C/16] (sums of 16 codes),
    XS f32 [T·C/16] (dx·BS: Σ x̂ per 16), XS32 f32 [T·C/32] (Σ x̂ per 32), at row t's offsets.

    A block with a non-finite element gets dx = NaN (so its outputs are NaN);
    a block with amax < 2^-100 is flushed to zero (dx = 0).
    """
    C = X.shape[1]
    nb = C // QK
    for j in range(nb):
        xb = X[t, QK * j : QK * j + QK]
        amax = np.float32(0.0)
        finite = True
        for l in range(QK):
            a = abs(xb[l])
            finite = finite and np.isfinite(a)
            amax = a if a > amax else amax
        k = t * nb + j
        if not finite:
            DX[k] = np.float32(np.nan)
            inv = np.float32(0.0)
        elif amax < np.float32(2.0**-100):
            DX[k] = np.float32(0.0)
            inv = np.float32(0.0)
        else:
            DX[k] = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax
        s0 = 0
        s1 = 0
        for l in range(QK):
            v = np.int32(np.rint(xb[l] * inv)) if inv != 0 else np.int32(0)
            XQ[k * QK + l] = v
            if l < QK // 2:
                s0 += v
            else:
                s1 += v
        BS[2 * k] = s0
        BS[2 * k + 1] = s1
        XS[2 * k] = DX[k] * np.float32(s0)
        XS[2 * k + 1] = DX[k] * np.float32(s1)
        XS32[k] = DX[k] * np.float32(s0 + s1)


@njit(cache=True, boundscheck=False, error_model="numpy", nogil=True)
def quantize_q8(X, XQ, DX, BS, XS, XS32):
    """The activation rounding alone (for effective_activation); see _quantize_row."""
    for t in range(X.shape[0]):
        _quantize_row(X, t, XQ, DX, BS, XS, XS32)


@njit(inline="always")
def _alloc(T, C):
    """The arrays _quantize_row fills, for T rows of C."""
    return (
        np.empty(T * C, np.int8),
        np.empty(T * C // QK, np.float32),
        np.empty(T * C // (QK // 2), np.int32),
        np.empty(T * C // (QK // 2), np.float32),
        np.empty(T * C // QK, np.float32),
    )


# ---- drivers: out[t, r] = weight row r · activation row t ------------------
# _mm_<t>(w u8[bytes], stride, X f32[T, C], table, out f32[T, R], C-contiguous);
# table is F16_TABLE (E8M0_HALF for MXFP4). The activation is rounded first
# (on one thread; from _PARALLEL_ROUNDING_ROWS rows on, one row per thread), then (one row) weight rows
# split across threads, or (several) tiles of weight rows split across
# threads, each tile × 4 activation rows at a time. Spelled out per type: an
# intrinsic cannot be passed to a cached njit function (_common says why).
# `s` is the sum array the type's offsets need: xs32 (Q4_K), xs16 (Q6_K),
# bs (the single-scale types).

_ROW = {(name, nt): rowdot(gen, nt) for name, gen in GENERATORS.items() for nt in (1, 2, 4)}
_q8_0_1, _q8_0_2, _q8_0_4 = (_ROW["Q8_0", nt] for nt in (1, 2, 4))
_q5_0_1, _q5_0_2, _q5_0_4 = (_ROW["Q5_0", nt] for nt in (1, 2, 4))
_mxfp4_1, _mxfp4_2, _mxfp4_4 = (_ROW["MXFP4", nt] for nt in (1, 2, 4))
_q4_k_1, _q4_k_2, _q4_k_4 = (_ROW["Q4_K", nt] for nt in (1, 2, 4))
_q5_k_1, _q5_k_2, _q5_k_4 = (_ROW["Q5_K", nt] for nt in (1, 2, 4))
_iq4_xs_1, _iq4_xs_2, _iq4_xs_4 = (_ROW["IQ4_XS", nt] for nt in (1, 2, 4))
_q6_k_1, _q6_k_2, _q6_k_4 = (_ROW["Q6_K", nt] for nt in (1, 2, 4))


# Activation rows from which the rounding is split across threads. Rounding
# costs ~1 ns per element on one thread (~10 µs for an expert's 5 rows of
# 2048), less than a second parallel region's start and barrier, which on
# busy cores waits for a scheduler slice; a prompt batch's 64 rows (~150 µs)
# are worth splitting.
_PARALLEL_ROUNDING_ROWS = 16


@njit(inline="always")
def _round(X):
    """X rounded to int8 per 32 (_quantize_row), rows across threads when there are many."""
    T, C = X.shape
    xq, dx, bs, xs, xs32 = _alloc(T, C)
    if T < _PARALLEL_ROUNDING_ROWS:
        for t in range(T):
            _quantize_row(X, t, xq, dx, bs, xs, xs32)
    else:
        for t in prange(T):
            _quantize_row(X, t, xq, dx, bs, xs, xs32)
    return xq, dx, bs, xs, xs32


@njit(inline="always")
def _tile_rows(stride):
    return max(1, _TILE_BYTES // stride)


@njit(**_DRIVER)
def _mm_q8_0(w, stride, X, tab, out):
    xq, dx, s, _, _ = _round(X)
    T, C = X.shape
    R, nb = out.shape[1], C // QK
    if T == 1:
        for r in prange(R):
            _q8_0_1(w, r * stride, nb, xq, 0, C, dx, s, tab, out, r, R)
        return
    g = _tile_rows(stride)
    for i in prange((R + g - 1) // g):
        rows = range(i * g, min(R, i * g + g))
        for t in range(0, T - 3, 4):
            for r in rows:
                _q8_0_4(w, r * stride, nb, xq, t * C, C, dx, s, tab, out, t * R + r, R)
        t2 = T - T % 4
        if T % 4 >= 2:
            for r in rows:
                _q8_0_2(w, r * stride, nb, xq, t2 * C, C, dx, s, tab, out, t2 * R + r, R)
        if T % 2:
            for r in rows:
                _q8_0_1(w, r * stride, nb, xq, (T - 1) * C, C, dx, s, tab, out, (T - 1) * R + r, R)


@njit(**_DRIVER)
def _mm_q5_0(w, stride, X, tab, out):
    xq, dx, s, _, _ = _round(X)
    T, C = X.shape
    R, nb = out.shape[1], C // QK
    if T == 1:
        for r in prange(R):
            _q5_0_1(w, r * stride, nb, xq, 0, C, dx, s, tab, out, r, R)
        return
    g = _tile_rows(stride)
    for i in prange((R + g - 1) // g):
        rows = range(i * g, min(R, i * g + g))
        for t in range(0, T - 3, 4):
            for r in rows:
                _q5_0_4(w, r * stride, nb, xq, t * C, C, dx, s, tab, out, t * R + r, R)
        t2 = T - T % 4
        if T % 4 >= 2:
            for r in rows:
                _q5_0_2(w, r * stride, nb, xq, t2 * C, C, dx, s, tab, out, t2 * R + r, R)
        if T % 2:
            for r in rows:
                _q5_0_1(w, r * stride, nb, xq, (T - 1) * C, C, dx, s, tab, out, (T - 1) * R + r, R)


@njit(**_DRIVER)
def _mm_mxfp4(w, stride, X, tab, out):
    xq, dx, s, _, _ = _round(X)
    T, C = X.shape
    R, nb = out.shape[1], C // QK
    if T == 1:
        for r in prange(R):
            _mxfp4_1(w, r * stride, nb, xq, 0, C, dx, s, tab, out, r, R)
        return
    g = _tile_rows(stride)
    for i in prange((R + g - 1) // g):
        rows = range(i * g, min(R, i * g + g))
        for t in range(0, T - 3, 4):
            for r in rows:
                _mxfp4_4(w, r * stride, nb, xq, t * C, C, dx, s, tab, out, t * R + r, R)
        t2 = T - T % 4
        if T % 4 >= 2:
            for r in rows:
                _mxfp4_2(w, r * stride, nb, xq, t2 * C, C, dx, s, tab, out, t2 * R + r, R)
        if T % 2:
            for r in rows:
                _mxfp4_1(w, r * stride, nb, xq, (T - 1) * C, C, dx, s, tab, out, (T - 1) * R + r, R)


@njit(**_DRIVER)
def _mm_q4_k(w, stride, X, tab, out):
    xq, dx, _, _, s = _round(X)
    T, C = X.shape
    R, nb = out.shape[1], C // QK_K
    if T == 1:
        for r in prange(R):
            _q4_k_1(w, r * stride, nb, xq, 0, C, dx, s, tab, out, r, R)
        return
    g = _tile_rows(stride)
    for i in prange((R + g - 1) // g):
        rows = range(i * g, min(R, i * g + g))
        for t in range(0, T - 3, 4):
            for r in rows:
                _q4_k_4(w, r * stride, nb, xq, t * C, C, dx, s, tab, out, t * R + r, R)
        t2 = T - T % 4
        if T % 4 >= 2:
            for r in rows:
                _q4_k_2(w, r * stride, nb, xq, t2 * C, C, dx, s, tab, out, t2 * R + r, R)
        if T % 2:
            for r in rows:
                _q4_k_1(w, r * stride, nb, xq, (T - 1) * C, C, dx, s, tab, out, (T - 1) * R + r, R)


@njit(**_DRIVER)
def _mm_q5_k(w, stride, X, tab, out):
    xq, dx, _, _, s = _round(X)
    T, C = X.shape
    R, nb = out.shape[1], C // QK_K
    if T == 1:
        for r in prange(R):
            _q5_k_1(w, r * stride, nb, xq, 0, C, dx, s, tab, out, r, R)
        return
    g = _tile_rows(stride)
    for i in prange((R + g - 1) // g):
        rows = range(i * g, min(R, i * g + g))
        for t in range(0, T - 3, 4):
            for r in rows:
                _q5_k_4(w, r * stride, nb, xq, t * C, C, dx, s, tab, out, t * R + r, R)
        t2 = T - T % 4
        if T % 4 >= 2:
            for r in rows:
                _q5_k_2(w, r * stride, nb, xq, t2 * C, C, dx, s, tab, out, t2 * R + r, R)
        if T % 2:
            for r in rows:
                _q5_k_1(w, r * stride, nb, xq, (T - 1) * C, C, dx, s, tab, out, (T - 1) * R + r, R)


@njit(**_DRIVER)
def _mm_iq4_xs(w, stride, X, tab, out):
    xq, dx, s, _, _ = _round(X)
    T, C = X.shape
    R, nb = out.shape[1], C // QK_K
    if T == 1:
        for r in prange(R):
            _iq4_xs_1(w, r * stride, nb, xq, 0, C, dx, s, tab, out, r, R)
        return
    g = _tile_rows(stride)
    for i in prange((R + g - 1) // g):
        rows = range(i * g, min(R, i * g + g))
        for t in range(0, T - 3, 4):
            for r in rows:
                _iq4_xs_4(w, r * stride, nb, xq, t * C, C, dx, s, tab, out, t * R + r, R)
        t2 = T - T % 4
        if T % 4 >= 2:
            for r in rows:
                _iq4_xs_2(w, r * stride, nb, xq, t2 * C, C, dx, s, tab, out, t2 * R + r, R)
        if T % 2:
            for r in rows:
                _iq4_xs_1(w, r * stride, nb, xq, (T - 1) * C, C, dx, s, tab, out, (T - 1) * R + r, R)


@njit(**_DRIVER)
def _mm_q6_k(w, stride, X, tab, out):
    xq, dx, _, s, _ = _round(X)
    T, C = X.shape
    R, nb = out.shape[1], C // QK_K
    if T == 1:
        for r in prange(R):
            _q6_k_1(w, r * stride, nb, xq, 0, C, dx, s, tab, out, r, R)
        return
    g = _tile_rows(stride)
    for i in prange((R + g - 1) // g):
        rows = range(i * g, min(R, i * g + g))
        for t in range(0, T - 3, 4):
            for r in rows:
                _q6_k_4(w, r * stride, nb, xq, t * C, C, dx, s, tab, out, t * R + r, R)
        t2 = T - T % 4
        if T % 4 >= 2:
            for r in rows:
                _q6_k_2(w, r * stride, nb, xq, t2 * C, C, dx, s, tab, out, t2 * R + r, R)
        if T % 2:
            for r in rows:
                _q6_k_1(w, r * stride, nb, xq, (T - 1) * C, C, dx, s, tab, out, (T - 1) * R + r, R)


# type name → (driver, whether it takes E8M0_HALF instead of F16_TABLE)
KERNELS = {
    "Q8_0": (_mm_q8_0, False),
    "Q5_0": (_mm_q5_0, False),
    "MXFP4": (_mm_mxfp4, True),
    "Q4_K": (_mm_q4_k, False),
    "Q5_K": (_mm_q5_k, False),
    "Q6_K": (_mm_q6_k, False),
    "IQ4_XS": (_mm_iq4_xs, False),
}
