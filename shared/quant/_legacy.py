"""32-weight block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4; and NVFP4 (64 weights, the E2M1 codes of MXFP4).

Byte layouts: docs/formats.md § Quant blocks. "Nibble order": byte j of qs holds
element j in its low nibble and element j+16 in its high nibble.

Per type: `_row_<t>(w, o, nb, dst, f16)` decodes nb blocks from byte o of the
flat buffer w (uint8) into float32 dst[0 : 32·nb]; `_mm_<t>` and `_rows_<t>`
are the drivers described in _common. Each inner loop runs 16 or 32 lanes
with no branches, so LLVM turns it into AVX-512 code; Q8_0/Q4_0/Q4_1 take the
lane count at run time (see LANES in _common for why).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import DRIVER, E8M0_HALF, INLINE, IQ4_VALUES, UE4M3_HALF, f16_at, tile_product
from .blocks import IQ4_NL_BYTES, MXFP4_BYTES, NVFP4_BYTES, Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q8_0_BYTES, QK, QK_NV


@njit(**INLINE)
def _row_q8_0(w, o, nb, dst, f16, lanes):
    wi = w.view(np.int8)
    for b in range(nb):
        p = o + Q8_0_BYTES * b
        d = f16_at(w, p, f16)
        q = wi[p + 2 : p + Q8_0_BYTES]
        y = dst[QK * b : QK * b + QK]
        for l in range(2 * lanes):
            y[l] = d * np.float32(q[l])


@njit(**INLINE)
def _row_q4_0(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + Q4_0_BYTES * b
        d = f16_at(w, p, f16)
        q = w[p + 2 : p + Q4_0_BYTES]
        y = dst[QK * b : QK * b + QK]
        for l in range(lanes):
            y[l] = d * np.float32(np.int32(q[l] & 15) - 8)
            y[l + 16] = d * np.float32(np.int32(q[l] >> 4) - 8)


@njit(**INLINE)
def _row_q4_1(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + Q4_1_BYTES * b
        d = f16_at(w, p, f16)
        m = f16_at(w, p + 2, f16)
        q = w[p + 4 : p + Q4_1_BYTES]
        y = dst[QK * b : QK * b + QK]
        for l in range(lanes):
            y[l] = d * np.float32(q[l] & 15) + m
            y[l + 16] = d * np.float32(q[l] >> 4) + m


@njit(**INLINE)
def _qh32(w, p):
    """The u32 little-endian high-bit field of Q5_0/Q5_1 at byte p."""
    return np.int64(w[p]) | (np.int64(w[p + 1]) << 8) | (np.int64(w[p + 2]) << 16) | (np.int64(w[p + 3]) << 24)


@njit(**INLINE)
def _row_q5_0(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + Q5_0_BYTES * b
        d = f16_at(w, p, f16)
        qh = _qh32(w, p + 2)
        q = w[p + 6 : p + Q5_0_BYTES]
        y = dst[QK * b : QK * b + QK]
        for l in range(16):
            lo = np.int64(q[l] & 15) | (((qh >> l) & 1) << 4)
            hi = np.int64(q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)
            y[l] = d * np.float32(lo - 16)
            y[l + 16] = d * np.float32(hi - 16)


@njit(**INLINE)
def _row_q5_1(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + Q5_1_BYTES * b
        d = f16_at(w, p, f16)
        m = f16_at(w, p + 2, f16)
        qh = _qh32(w, p + 4)
        q = w[p + 8 : p + Q5_1_BYTES]
        y = dst[QK * b : QK * b + QK]
        for l in range(16):
            lo = np.int64(q[l] & 15) | (((qh >> l) & 1) << 4)
            hi = np.int64(q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)
            y[l] = d * np.float32(lo) + m
            y[l + 16] = d * np.float32(hi) + m


@njit(**INLINE)
def _row_iq4_nl(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ4_NL_BYTES * b
        d = f16_at(w, p, f16)
        q = w[p + 2 : p + IQ4_NL_BYTES]
        y = dst[QK * b : QK * b + QK]
        for l in range(16):
            y[l] = d * IQ4_VALUES[q[l] & 15]
            y[l + 16] = d * IQ4_VALUES[q[l] >> 4]


@njit(**INLINE)
def _fp4_twice(n):
    """E2M1 code n (0..15) → twice its value as an integer: blocks.E2M1_TWICE, sign bit 8.

    Arithmetic instead of the 16-entry table: a table lookup becomes a gather
    (or stays scalar), this becomes shifts and selects (decode 1.9 → 3.9 G weights/s, one core).
    """
    m = np.int32(n & 7)
    mag = m if m < 4 else (2 | (m & 1)) << ((m >> 1) - 1)
    return -mag if n & 8 else mag


@njit(**INLINE)
def _row_mxfp4(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + MXFP4_BYTES * b
        half = E8M0_HALF[w[p]]  # 2^(e−128): the table holds doubled values
        q = w[p + 1 : p + MXFP4_BYTES]
        y = dst[QK * b : QK * b + QK]
        for l in range(16):
            y[l] = half * np.float32(_fp4_twice(q[l] & 15))
            y[l + 16] = half * np.float32(_fp4_twice(q[l] >> 4))


@njit(**INLINE)
def _row_nvfp4(w, o, nb, dst, f16, lanes):
    """nb NVFP4 blocks: sub-block s of 16 weights has scale byte s and nibble bytes 4 + 8s ..
    11 + 8s, byte j's low nibble element j and its high nibble element j + 8."""
    for b in range(nb):
        p = o + NVFP4_BYTES * b
        for s in range(4):
            half = UE4M3_HALF[w[p + s]]  # the table holds half the scale: the codes are doubled
            q = w[p + 4 + 8 * s : p + 12 + 8 * s]
            y = dst[QK_NV * b + 16 * s : QK_NV * b + 16 * s + 16]
            for l in range(8):
                y[l] = half * np.float32(_fp4_twice(q[l] & 15))
                y[l + 8] = half * np.float32(_fp4_twice(q[l] >> 4))


# ---- drivers: the same two functions per type (see _common for why) --------
# _mm_<t>(w u8[bytes], stride, X f32[T, C], G, f16, lanes, out f32[T, R])
# _rows_<t>(w, stride, rows i64[N], f16, lanes, out f32[N, C])


@njit(**DRIVER)
def _mm_q8_0(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_q8_0(w, (r0 + i) * stride, C // QK, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q8_0(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q8_0(w, rows[i] * stride, out.shape[1] // QK, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_q4_0(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_q4_0(w, (r0 + i) * stride, C // QK, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q4_0(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q4_0(w, rows[i] * stride, out.shape[1] // QK, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_q4_1(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_q4_1(w, (r0 + i) * stride, C // QK, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q4_1(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q4_1(w, rows[i] * stride, out.shape[1] // QK, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_q5_0(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_q5_0(w, (r0 + i) * stride, C // QK, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q5_0(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q5_0(w, rows[i] * stride, out.shape[1] // QK, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_q5_1(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_q5_1(w, (r0 + i) * stride, C // QK, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q5_1(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q5_1(w, rows[i] * stride, out.shape[1] // QK, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_iq4_nl(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_iq4_nl(w, (r0 + i) * stride, C // QK, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq4_nl(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq4_nl(w, rows[i] * stride, out.shape[1] // QK, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_mxfp4(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_mxfp4(w, (r0 + i) * stride, C // QK, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_mxfp4(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_mxfp4(w, rows[i] * stride, out.shape[1] // QK, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_nvfp4(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_nvfp4(w, (r0 + i) * stride, C // QK_NV, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_nvfp4(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_nvfp4(w, rows[i] * stride, out.shape[1] // QK_NV, out[i], f16, lanes)


KERNELS = {
    "Q8_0": (_mm_q8_0, _rows_q8_0),
    "Q4_0": (_mm_q4_0, _rows_q4_0),
    "Q4_1": (_mm_q4_1, _rows_q4_1),
    "Q5_0": (_mm_q5_0, _rows_q5_0),
    "Q5_1": (_mm_q5_1, _rows_q5_1),
    "IQ4_NL": (_mm_iq4_nl, _rows_iq4_nl),
    "MXFP4": (_mm_mxfp4, _rows_mxfp4),
    "NVFP4": (_mm_nvfp4, _rows_nvfp4),
}
