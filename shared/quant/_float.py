"""Unquantized types: F32, F16, BF16 — plain float math, no activation rounding.

The row decoders widen to float32 by bit manipulation (the flat buffer is
bytes, with no alignment promise): F32 reassembles its four bytes, BF16 is the
top half of a float32, F16 moves its exponent/mantissa into float32 position
and multiplies by 2^112, which rebases the exponent and turns f16 subnormals
into the right float32 normals exactly; inf/NaN get the all-ones exponent.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import DRIVER, INLINE, tile_product

_TWO_112 = np.float32(2.0**112)


@njit(**INLINE)
def _row_f32(w, o, nb, dst, f16, lanes):
    bits = dst.view(np.uint32)
    src = w[o : o + 4 * nb]
    for l in range(nb):
        bits[l] = (
            np.uint32(src[4 * l]) | (np.uint32(src[4 * l + 1]) << 8) | (np.uint32(src[4 * l + 2]) << 16) | (np.uint32(src[4 * l + 3]) << 24)
        )


@njit(**INLINE)
def _row_bf16(w, o, nb, dst, f16, lanes):
    bits = dst.view(np.uint32)
    src = w[o : o + 2 * nb]
    for l in range(nb):
        bits[l] = (np.uint32(src[2 * l]) << 16) | (np.uint32(src[2 * l + 1]) << 24)


@njit(**INLINE)
def _row_f16(w, o, nb, dst, f16, lanes):
    bits = dst.view(np.uint32)
    src = w[o : o + 2 * nb]
    for l in range(nb):
        h = np.uint32(src[2 * l]) | (np.uint32(src[2 * l + 1]) << 8)
        special = np.uint32(0x7F800000) if (h & 0x7C00) == 0x7C00 else np.uint32(0)
        bits[l] = ((h & 0x7FFF) << 13) | ((h & 0x8000) << 16) | special
    for l in range(nb):
        dst[l] = dst[l] * _TWO_112


@njit(**DRIVER)
def _mm_f32(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)  # [G, C]
        for i in range(n):
            _row_f32(w, (r0 + i) * stride, C, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_f32(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_f32(w, rows[i] * stride, out.shape[1], out[i], f16, lanes)


@njit(**DRIVER)
def _mm_f16(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_f16(w, (r0 + i) * stride, C, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_f16(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_f16(w, rows[i] * stride, out.shape[1], out[i], f16, lanes)


@njit(**DRIVER)
def _mm_bf16(w, stride, X, G, f16, lanes, out):
    R, C = out.shape[1], X.shape[1]
    for g in prange((R + G - 1) // G):
        r0 = g * G
        n = min(G, R - r0)
        tile = np.empty((n, C), np.float32)
        for i in range(n):
            _row_bf16(w, (r0 + i) * stride, C, tile[i], f16, lanes)
        tile_product(tile, n, X, out, r0)


@njit(**DRIVER)
def _rows_bf16(w, stride, rows, f16, lanes, out):
    for i in prange(rows.size):
        _row_bf16(w, rows[i] * stride, out.shape[1], out[i], f16, lanes)


KERNELS = {
    "F32": (_mm_f32, _rows_f32),
    "F16": (_mm_f16, _rows_f16),
    "BF16": (_mm_bf16, _rows_bf16),
}
