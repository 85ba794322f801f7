"""The i-quants on float tiles: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

Byte layouts: docs/formats.md § Quant blocks. Every weight is a grid entry's
element (8 weights an entry; 4 on the IQ3 types) times a sign and the block's
scale; the IQ1 types add ±1/8 to the grid value before scaling. These decoders
serve embedding rows, the int8-off reference and the float tiles (as in _legacy
/ _common); with int8 activations on, matvec and matmul take the integer
kernels (_q8ir), which decode the same bytes to integer codes.

The decoded weights are exact in float32 (an f16 d times an odd number ≤ 31,
times a power of two, times a grid value ≤ 62, or 8·grid ± 1 over 8), so these
rows equal gguf's dequantizer's.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import DRIVER, INLINE, f16_at, tile_product
from .blocks import (
    IQ1_GRID,
    IQ1_M_BYTES,
    IQ1_S_BYTES,
    IQ2_S_BYTES,
    IQ2_S_GRID,
    IQ2_XS_BYTES,
    IQ2_XS_GRID,
    IQ2_XXS_BYTES,
    IQ2_XXS_GRID,
    IQ3_S_BYTES,
    IQ3_S_GRID,
    IQ3_XXS_BYTES,
    IQ3_XXS_GRID,
    QK_K,
    sign_bits,
)

# Grids as float32 (numba freezes module-level arrays into the code as constants).
_G2XXS = IQ2_XXS_GRID.astype(np.float32)  # [256, 8]
_G2XS = IQ2_XS_GRID.astype(np.float32)  # [512, 8]
_G2S = IQ2_S_GRID.astype(np.float32)  # [1024, 8]
_G3XXS = IQ3_XXS_GRID.astype(np.float32)  # [256, 4]
_G3S = IQ3_S_GRID.astype(np.float32)  # [512, 4]
_G1 = IQ1_GRID.astype(np.float32)  # [2048, 8]
# A sign byte (bit l: weight l negative) → the 8 factors ±1.
_SIGN8 = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1)).astype(np.float32)  # [256, 8]
# A 7-bit sign index → its sign byte (blocks.sign_bits: the eighth bit is the parity).
_KSIGNS = sign_bits(np.arange(128)).astype(np.int64)  # [128]
_IQ1_DELTA = np.float32(0.125)


@njit(**INLINE)
def _u16(w, p):
    return np.int64(w[p]) | (np.int64(w[p + 1]) << 8)


@njit(**INLINE)
def _u32(w, p):
    return _u16(w, p) | (_u16(w, p + 2) << 16)


@njit(**INLINE)
def _put8(y, g, s, db):
    """y[0:8] = db · grid entry g (float32 [8]) · sign factors s (float32 [8])."""
    for l in range(8):
        y[l] = db * (g[l] * s[l])


@njit(**INLINE)
def _row_iq2_xxs(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ2_XXS_BYTES * b
        d = f16_at(w, p, f16)
        for j in range(8):  # blocks of 32: 4 index bytes, then a u32 of 4 sign indices and the scale
            q = p + 2 + 8 * j
            aux = _u32(w, q + 4)
            db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
            for k in range(4):
                y = dst[QK_K * b + 32 * j + 8 * k : QK_K * b + 32 * j + 8 * k + 8]
                _put8(y, _G2XXS[w[q + k]], _SIGN8[_KSIGNS[(aux >> (7 * k)) & 127]], db)


@njit(**INLINE)
def _row_iq2_xs(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ2_XS_BYTES * b
        d = f16_at(w, p, f16)
        for g in range(32):  # groups of 8: a u16 of a 9-bit index and a 7-bit sign index
            v = _u16(w, p + 2 + 2 * g)
            sc = (np.int64(w[p + 66 + g // 4]) >> (4 * ((g // 2) % 2))) & 15  # a scale per 16
            db = d * (np.float32(0.5) + np.float32(sc)) * np.float32(0.25)
            y = dst[QK_K * b + 8 * g : QK_K * b + 8 * g + 8]
            _put8(y, _G2XS[v & 511], _SIGN8[_KSIGNS[v >> 9]], db)


@njit(**INLINE)
def _row_iq2_s(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ2_S_BYTES * b
        d = f16_at(w, p, f16)
        for g in range(32):  # groups of 8: index low byte, sign byte, 2 high index bits per group
            idx = np.int64(w[p + 2 + g]) | (((np.int64(w[p + 66 + g // 4]) >> (2 * (g % 4))) & 3) << 8)
            sc = (np.int64(w[p + 74 + g // 4]) >> (4 * ((g // 2) % 2))) & 15
            db = d * (np.float32(0.5) + np.float32(sc)) * np.float32(0.25)
            y = dst[QK_K * b + 8 * g : QK_K * b + 8 * g + 8]
            _put8(y, _G2S[idx], _SIGN8[w[p + 34 + g]], db)


@njit(**INLINE)
def _row_iq3_xxs(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ3_XXS_BYTES * b
        d = f16_at(w, p, f16)
        for j in range(8):  # blocks of 32: 8 index bytes (4 weights each) at 2 + 8j, a u32 at 66 + 4j
            aux = _u32(w, p + 66 + 4 * j)
            db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)
            for k in range(4):
                s = _SIGN8[_KSIGNS[(aux >> (7 * k)) & 127]]
                y = dst[QK_K * b + 32 * j + 8 * k : QK_K * b + 32 * j + 8 * k + 8]
                g0 = _G3XXS[w[p + 2 + 8 * j + 2 * k]]
                g1 = _G3XXS[w[p + 3 + 8 * j + 2 * k]]
                for l in range(4):
                    y[l] = db * (g0[l] * s[l])
                    y[l + 4] = db * (g1[l] * s[l + 4])


@njit(**INLINE)
def _row_iq3_s(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ3_S_BYTES * b
        d = f16_at(w, p, f16)
        for g in range(32):  # groups of 8: two index bytes (+ a high bit each from 66), a sign byte at 74
            j = g // 4
            sc = (np.int64(w[p + 106 + j // 2]) >> (4 * (j % 2))) & 15
            db = d * np.float32(1 + 2 * sc)
            hb = np.int64(w[p + 66 + j])
            i0 = np.int64(w[p + 2 + 2 * g]) | (((hb >> (2 * (g % 4))) & 1) << 8)
            i1 = np.int64(w[p + 3 + 2 * g]) | (((hb >> (2 * (g % 4) + 1)) & 1) << 8)
            s = _SIGN8[w[p + 74 + g]]
            y = dst[QK_K * b + 8 * g : QK_K * b + 8 * g + 8]
            g0, g1 = _G3S[i0], _G3S[i1]
            for l in range(4):
                y[l] = db * (g0[l] * s[l])
                y[l + 4] = db * (g1[l] * s[l + 4])


@njit(**INLINE)
def _put_iq1(y, g, dl, delta):
    for l in range(8):
        y[l] = dl * (g[l] + delta)


@njit(**INLINE)
def _row_iq1_s(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ1_S_BYTES * b
        d = f16_at(w, p, f16)
        for j in range(8):  # blocks of 32: 4 index bytes at 2 + 4j, a u16 at 34 + 2j (3 high bits per index, scale, delta sign)
            h = _u16(w, p + 34 + 2 * j)
            dl = d * np.float32(2 * ((h >> 12) & 7) + 1)
            delta = -_IQ1_DELTA if h & 0x8000 else _IQ1_DELTA
            for k in range(4):
                idx = np.int64(w[p + 2 + 4 * j + k]) | (((h >> (3 * k)) & 7) << 8)
                _put_iq1(dst[QK_K * b + 32 * j + 8 * k : QK_K * b + 32 * j + 8 * k + 8], _G1[idx], dl, delta)


@njit(**INLINE)
def _iq1_m_d(w, p, f16):
    """IQ1_M's f16 d: the top nibbles of the four scale words at 48, lowest word first."""
    bits = (_u16(w, p + 48) >> 12) | ((_u16(w, p + 50) >> 12) << 4) | ((_u16(w, p + 52) >> 12) << 8) | ((_u16(w, p + 54) >> 12) << 12)
    return f16[bits]


@njit(**INLINE)
def _row_iq1_m(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ1_M_BYTES * b
        d = _iq1_m_d(w, p, f16)
        for g in range(32):  # groups of 8: index byte, a nibble at 32 (3 high bits, delta sign); 3-bit scale per 16
            s = g // 2
            sc = (_u16(w, p + 48 + 2 * (s // 4)) >> (3 * (s % 4))) & 7
            dl = d * np.float32(2 * sc + 1)
            nib = (np.int64(w[p + 32 + g // 2]) >> (4 * (g % 2))) & 15
            delta = -_IQ1_DELTA if nib & 8 else _IQ1_DELTA
            idx = np.int64(w[p + g]) | ((nib & 7) << 8)
            _put_iq1(dst[QK_K * b + 8 * g : QK_K * b + 8 * g + 8], _G1[idx], dl, delta)


# ---- drivers: the same two functions per type (see _common for why) --------
# _mm_<t>(w u8[bytes], stride, X f32[T, C], G, f16, lanes, out f32[T, R])
# _rows_<t>(w, stride, rows i64[N], f16, lanes, out f32[N, C])


@njit(**DRIVER)
def _mm_iq2_xxs(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_iq2_xxs(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq2_xxs(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq2_xxs(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_iq2_xs(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_iq2_xs(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq2_xs(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq2_xs(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_iq2_s(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_iq2_s(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq2_s(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq2_s(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_iq3_xxs(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_iq3_xxs(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq3_xxs(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq3_xxs(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_iq3_s(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_iq3_s(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq3_s(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq3_s(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_iq1_s(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_iq1_s(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq1_s(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq1_s(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_iq1_m(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_iq1_m(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq1_m(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq1_m(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


KERNELS = {
    "IQ2_XXS": (_mm_iq2_xxs, _rows_iq2_xxs),
    "IQ2_XS": (_mm_iq2_xs, _rows_iq2_xs),
    "IQ2_S": (_mm_iq2_s, _rows_iq2_s),
    "IQ3_XXS": (_mm_iq3_xxs, _rows_iq3_xxs),
    "IQ3_S": (_mm_iq3_s, _rows_iq3_s),
    "IQ1_S": (_mm_iq1_s, _rows_iq1_s),
    "IQ1_M": (_mm_iq1_m, _rows_iq1_m),
}
