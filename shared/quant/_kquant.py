"""256-weight super-block types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS.

Byte layouts: docs/formats.md § Quant blocks. Elements are indexed i = 128h + 32k + l
(Q2_K/Q3_K/Q6_K: h half, k 2-bit plane, l lane) or i = 64c + l (Q4_K/Q5_K:
c byte chunk, low nibble then high nibble); the loops below walk exactly
those indices so every inner loop is 16 or 32 lanes with fixed shifts.
Per-type row decoders and drivers as in _legacy / _common.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import DRIVER, INLINE, IQ4_VALUES, f16_at, k_scale_min, tile_product
from .blocks import IQ4_XS_BYTES, Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K


@njit(**INLINE)
def _row_q2_k(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + Q2_K_BYTES * b
        d = f16_at(w, p + 80, f16)
        dmin = f16_at(w, p + 82, f16)
        for h in range(2):
            q = w[p + 16 + 32 * h : p + 48 + 32 * h]
            for k in range(4):
                s = 8 * h + 2 * k  # sub-block of 16 for lanes 0..15; s+1 for 16..31
                a0 = d * np.float32(w[p + s] & 15)
                m0 = dmin * np.float32(w[p + s] >> 4)
                a1 = d * np.float32(w[p + s + 1] & 15)
                m1 = dmin * np.float32(w[p + s + 1] >> 4)
                y = dst[QK_K * b + 128 * h + 32 * k : QK_K * b + 128 * h + 32 * k + 32]
                for l in range(lanes):
                    y[l] = a0 * np.float32((q[l] >> (2 * k)) & 3) - m0
                    y[l + 16] = a1 * np.float32((q[l + 16] >> (2 * k)) & 3) - m1


@njit(**INLINE)
def _q3_k_scale(sc, n):
    """Signed 6-bit scale n (0..15) of a Q3_K block from its 12-byte field."""
    low4 = (np.int64(sc[n]) & 15) if n < 8 else (np.int64(sc[n - 8]) >> 4)
    high2 = (np.int64(sc[8 + (n & 3)]) >> (2 * (n >> 2))) & 3
    return np.float32((low4 | (high2 << 4)) - 32)


@njit(**INLINE)
def _row_q3_k(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + Q3_K_BYTES * b
        d = f16_at(w, p + 108, f16)
        hm = w[p : p + 32]
        sc = w[p + 96 : p + 108]
        for h in range(2):
            q = w[p + 32 + 32 * h : p + 64 + 32 * h]
            for k in range(4):
                s = 8 * h + 2 * k
                a0 = d * _q3_k_scale(sc, s)
                a1 = d * _q3_k_scale(sc, s + 1)
                hs = 4 * h + k
                y = dst[QK_K * b + 128 * h + 32 * k : QK_K * b + 128 * h + 32 * k + 32]
                for l in range(16):
                    # q = low − 4 when the high bit is clear, low when set
                    q0 = np.int32((q[l] >> (2 * k)) & 3) + 4 * np.int32((hm[l] >> hs) & 1) - 4
                    q1 = np.int32((q[l + 16] >> (2 * k)) & 3) + 4 * np.int32((hm[l + 16] >> hs) & 1) - 4
                    y[l] = a0 * np.float32(q0)
                    y[l + 16] = a1 * np.float32(q1)


@njit(**INLINE)
def _row_q4_k(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + Q4_K_BYTES * b
        d = f16_at(w, p, f16)
        dmin = f16_at(w, p + 2, f16)
        sm = w[p + 4 : p + 16]
        for c in range(4):
            sc0, m0 = k_scale_min(sm, 2 * c)
            sc1, m1 = k_scale_min(sm, 2 * c + 1)
            a0, b0, a1, b1 = d * sc0, dmin * m0, d * sc1, dmin * m1
            q = w[p + 16 + 32 * c : p + 48 + 32 * c]
            y = dst[QK_K * b + 64 * c : QK_K * b + 64 * c + 64]
            for l in range(32):
                y[l] = a0 * np.float32(q[l] & 15) - b0
                y[l + 32] = a1 * np.float32(q[l] >> 4) - b1


@njit(**INLINE)
def _row_q5_k(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + Q5_K_BYTES * b
        d = f16_at(w, p, f16)
        dmin = f16_at(w, p + 2, f16)
        sm = w[p + 4 : p + 16]
        qh = w[p + 16 : p + 48]
        for c in range(4):
            sc0, m0 = k_scale_min(sm, 2 * c)
            sc1, m1 = k_scale_min(sm, 2 * c + 1)
            a0, b0, a1, b1 = d * sc0, dmin * m0, d * sc1, dmin * m1
            q = w[p + 48 + 32 * c : p + 80 + 32 * c]
            y = dst[QK_K * b + 64 * c : QK_K * b + 64 * c + 64]
            for l in range(32):
                lo = np.int32(q[l] & 15) | (np.int32((qh[l] >> (2 * c)) & 1) << 4)
                hi = np.int32(q[l] >> 4) | (np.int32((qh[l] >> (2 * c + 1)) & 1) << 4)
                y[l] = a0 * np.float32(lo) - b0
                y[l + 32] = a1 * np.float32(hi) - b1


@njit(**INLINE)
def _row_q6_k(w, o, nb, dst, f16, lanes):
    wi = w.view(np.int8)
    for b in range(nb):
        p = o + Q6_K_BYTES * b
        d = f16_at(w, p + 208, f16)
        for h in range(2):
            qh = w[p + 128 + 32 * h : p + 160 + 32 * h]
            for k in range(4):
                s = p + 192 + 8 * h + 2 * k  # int8 scales of lanes 0..15 and 16..31
                a0 = d * np.float32(wi[s])
                a1 = d * np.float32(wi[s + 1])
                ql = w[p + 64 * h + 32 * (k & 1) : p + 64 * h + 32 * (k & 1) + 32]
                sh = 4 * (k >> 1)
                y = dst[QK_K * b + 128 * h + 32 * k : QK_K * b + 128 * h + 32 * k + 32]
                for l in range(16):
                    q0 = np.int32((ql[l] >> sh) & 15) | (np.int32((qh[l] >> (2 * k)) & 3) << 4)
                    q1 = np.int32((ql[l + 16] >> sh) & 15) | (np.int32((qh[l + 16] >> (2 * k)) & 3) << 4)
                    y[l] = a0 * np.float32(q0 - 32)
                    y[l + 16] = a1 * np.float32(q1 - 32)


@njit(**INLINE)
def _row_iq4_xs(w, o, nb, dst, f16, lanes):
    for b in range(nb):
        p = o + IQ4_XS_BYTES * b
        d = f16_at(w, p, f16)
        sh = np.int64(w[p + 2]) | (np.int64(w[p + 3]) << 8)
        for j in range(8):
            ls = ((np.int64(w[p + 4 + j // 2]) >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            q = w[p + 8 + 16 * j : p + 24 + 16 * j]
            y = dst[QK_K * b + 32 * j : QK_K * b + 32 * j + 32]
            for l in range(16):
                y[l] = dl * IQ4_VALUES[q[l] & 15]
                y[l + 16] = dl * IQ4_VALUES[q[l] >> 4]


# ---- drivers (same shape as in _legacy) ----------------------------------


@njit(**DRIVER)
def _mm_q2_k(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_q2_k(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q2_k(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q2_k(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_q3_k(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_q3_k(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q3_k(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q3_k(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_q4_k(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_q4_k(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q4_k(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q4_k(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_q5_k(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_q5_k(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q5_k(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q5_k(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_q6_k(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_q6_k(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_q6_k(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_q6_k(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


@njit(**DRIVER)
def _mm_iq4_xs(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_iq4_xs(w, (r0 + i) * stride, C // QK_K, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_iq4_xs(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_iq4_xs(w, rows[i] * stride, out.shape[1] // QK_K, out[i], f16, lanes)


KERNELS = {
    "Q2_K": (_mm_q2_k, _rows_q2_k),
    "Q3_K": (_mm_q3_k, _rows_q3_k),
    "Q4_K": (_mm_q4_k, _rows_q4_k),
    "Q5_K": (_mm_q5_k, _rows_q5_k),
    "Q6_K": (_mm_q6_k, _rows_q6_k),
    "IQ4_XS": (_mm_iq4_xs, _rows_iq4_xs),
}
