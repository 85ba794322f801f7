"""Integer dot products against int8 activations: Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, MXFP4, IQ4_XS
and the i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (their decoders: _iqir).

For these types every matvec/matmul call (decode's one activation row and
prefill's several alike) rounds each activation row to int8 per block of 32
(x̂ = dx·xq, dx = amax/127, xq = rint(x/dx), the q8_0 rounding; _q8ir.round_row)
and multiplies on the raw small integers. Per call, row-independent sums of
the codes are computed once: bs16 and bs32 (int32, per 16 and per 32), which
the weight codes' integer offsets multiply, and xs32 = dx·bs32 (float), the
Σ x̂ that Q4_K's and Q5_K's mins multiply. Rows are padded with zeros to whole
units of 256 (and a call's rows to a whole tile-kernel call).

The kernels are LLVM IR (_q8ir, which says how and why). A matrix's call of up
to 8 activation rows (decode; a batch of a few sequences' decode rows, a short
verify pass) takes each weight row as stored on the row kernel, the rows split
across threads: 4 activation rows a call while 3 or more are left, the row's
codes decoded once for the four, and the last one or two once each. With more (a prompt batch; in a grouped
call, an expert on 4 or more tokens) the call is a GEMM: tiles of 16 weight rows, split
across threads, are each repacked so that a vector holds 4 codes of each
of the 16 rows, then multiplied by 8 activation rows at a time (4 for the
last few), a block of activation rows that stays in L2 after another. Both
compute the same float operations per (weight row, activation row) in the
same order (_q8ir's module doc), so every row of a matmul equals the matvec
of that row bit for bit.

Nothing here carries fast-math flags (unlike the float-tile kernels, _common):
the rounding of x̂ must be exactly what `effective_activation` returns (`arcp`
would let LLVM turn amax/127 into a multiply by 1/127), and the float steps
must not be reassociated differently in the two kernels.

Numerics: weights are decoded exactly; the activation is rounded to int8
(|x − x̂| ≤ dx/2 = amax₃₂/254 per element); the integer sums are exact and
the float scaling adds a few float32 roundings per block.
`effective_activation(x, qtype)` returns x̂. A non-finite activation block
gives NaN/inf outputs (dx = NaN), as the float path would.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import E8M0_HALF, F16_TABLE, UE4M3_HALF
from ._iqir import TABLES
from ._q8ir import INT8_DOT, PACKED_UNIT, UNIT, bytes_at, pack_kernel, round_row, row_kernel, tile_kernel
from ._q8ir import WIDE_VECTORS as _WIDE_VECTORS
from .blocks import QK

INT8_DOT = INT8_DOT  # re-exported: which build of the dot this process compiles ("vnni", "sdot" or "portable")

_DRIVER = dict(cache=True, parallel=True, boundscheck=False, error_model="numpy", nogil=True)
# From this many activation rows a grouped call repacks a matrix's weight rows (pack + tile
# kernels): the repack and one pass of the tile kernel cost about what three rows cost on the
# stored layout.
GEMM_ROWS = 4
# A matmul's call (one matrix: a projection, the output head) takes up to 8 rows on the row
# kernels, ROW_TOKENS at a time while 3 or more are left and the last one or two once each: a
# batch of a few decode rows or a short verify pass streams each matrix from memory once, where
# the repack cost ~3 rows a tile. The output head of qwen30b-shape (Q6_K, 151,936 × 2,048, from
# DRAM, two cores): 4 rows 5.9 ms on the row kernel against 12.7 repacked (one row 4.7 ms); 8
# rows 11.4 against 16.3. One or two rows left take the one-row kernel once a row: the 4-row
# kernel over two zero rows costs more than decoding the row twice (head: 2 rows 5.1 against
# 5.8 ms).
MATMUL_GEMM_ROWS = 9
ROW_TOKENS = 4
# Activation rows per tile-kernel call (the last call's rows past T are _round's zero rows): 8 rows
# keep 8 × (integer sum, accumulator, mins accumulator) and a block's 8 code vectors and 2
# scale vectors in the 32 vector registers, and the tile's packed bytes (5 KB per 256
# columns) are read once per 8 rows (4: the tile comes from L2 too often; 12: spills).
# With AVX2's 16 registers of 256 bits, 4 (_q8ir._avx2_isums: a code vector against every row
# in turn, the rows' accumulators in memory): one core, a Q4_K 768 × 2,048 in cache, 512 rows,
# 82-85 G multiply-adds/s against 68-70 at 2 rows and 71 at 8 (2026-12-06, Zen 3).
TILE_TOKENS = 8 if _WIDE_VECTORS else 4
# A call's last rows, when no more than half a tile is left, take a 4-row tile kernel: an
# expert that 5, 12 or 20 tokens of a prompt route to computes 8, 12 and 20 rows, not 8, 16
# and 24 (the zero rows were a quarter of a 512-token prompt's expert work).
HALF_TILE = TILE_TOKENS // 2
# A GEMM takes its activation rows in blocks of about this many int8 bytes, every weight tile
# sweeping one block before the next, so the block stays in the core's L2 while 16 weight rows
# at a time pass over it; each block repacks the tiles again (~3 µs a tile of 16 × 2,048 on
# AVX2, against ~0.4 ms of products per 128 rows). Without it a whole prompt's rows (3,600 ×
# 2,048 bytes) stream from L3 or DRAM once per tile, and a projection's products ran at 0.7 of
# the expert GEMM's rate (77 against 112 G multiply-adds/s a core, 2026-12-03). Half of the
# smaller L2 we run on (Zen 3's 512 KB; 1 MB on the VNNI hosts): at the whole 512 KB a Zen 3
# core's 2,048-row GEMM ran at 141 G multiply-adds/s on two cores against 150 (2026-12-06).
ROW_BLOCK_BYTES = 1 << 18

# ---- activation quantization ---------------------------------------------


_round_row = round_row()


@njit(cache=True, boundscheck=False, error_model="numpy", nogil=True)
def quantize_q8(X, XQ, DX, BS16, BS32, XS32):
    """The activation rounding alone, rows unpadded (for effective_activation): row t of X
    f32 [T, C] → XQ int8 from element t·C, DX f32 (block scales), BS16 int32 (Σ xq per 16),
    BS32 int32 and XS32 f32 (Σ xq and Σ x̂ per 32) from block t·C/32 (_q8ir.round_row)."""
    C = X.shape[1]
    for t in range(X.shape[0]):
        _round_row(X, t * C, C, XQ, t * C, DX, BS16, BS32, XS32)


# Activation rows from which the rounding is split across threads: below, a
# second parallel region's start and barrier (which on busy cores waits for a
# scheduler slice) costs more than the rounding of a few rows.
_PARALLEL_ROUNDING_ROWS = 16


@njit(inline="always")
def _round(X):
    """X rounded to int8 per 32 (_quantize_row), each row padded with zeros to whole units of
    256 (cp elements) and the rows with zero rows to a whole tile-kernel call (TILE_TOKENS),
    rows across threads when there are many."""
    return _round_to(X, (X.shape[0] + TILE_TOKENS - 1) // TILE_TOKENS * TILE_TOKENS)


@njit(cache=True, boundscheck=False, error_model="numpy", nogil=True)
def _zeroed_acts(n):
    """The rounded activation's arrays for n int8 elements, zeroed. A function of its own, not
    inlined into the parallel drivers: there numba turns each np.zeros into a parallel loop
    of its own, five thread launches a call (7 µs of a 16-row matvec's 12, 2026-12-06)."""
    return (
        np.zeros(n, np.int8),
        np.zeros(n // QK, np.float32),
        np.zeros(n // (QK // 2), np.int32),
        np.zeros(n // QK, np.int32),
        np.zeros(n // QK, np.float32),
    )


@njit(inline="always")
def _round_to(X, rows):
    """_round with `rows` rows in all (X's, then zero rows)."""
    T, C = X.shape
    cp = (C + UNIT - 1) // UNIT * UNIT
    xq, dx, bs16, bs32, xs32 = _zeroed_acts(rows * cp)
    if T < _PARALLEL_ROUNDING_ROWS:
        for t in range(T):
            _round_row(X, t * C, C, xq, t * cp, dx, bs16, bs32, xs32)
    else:
        for t in prange(T):
            _round_row(X, t * C, C, xq, t * cp, dx, bs16, bs32, xs32)
    return xq, dx, bs16, bs32, xs32, cp


@njit(inline="always")
def _row_block(cp):
    """Activation rows per block of a GEMM (ROW_BLOCK_BYTES of int8 rows cp wide, whole tiles)."""
    return max(TILE_TOKENS, ROW_BLOCK_BYTES // cp // TILE_TOKENS * TILE_TOKENS)


# ---- drivers: out[t, r] = weight row r · activation row t ------------------
# _mm_<t>(w u8[bytes], stride, X f32[T, C], table, out f32[T, R], C-contiguous);
# table is KERNELS' (F16_TABLE, E8M0_HALF for MXFP4, UE4M3_HALF for NVFP4, an i-quant's grid). The activation is rounded first
# (_round), then (up to 8 rows) weight rows split across threads on the row kernel
# (ROW_TOKENS activation rows a call while 3 or more are left, a call of 3 over one of the zero
# rows _round pads with; the last one or two a call each), or (more) tiles of 16 weight rows
# split across threads, each
# repacked once per block of activation rows (_row_block) and multiplied by 8
# activation rows at a time, the block's last 1-4 by 4 (a call's missing rows
# are the zero rows _round pads with).
# Spelled out per type: an intrinsic cannot be passed to a cached njit
# function (_common says why).

_q8_0_r1 = row_kernel("Q8_0", 1)
_q8_0_r4 = row_kernel("Q8_0", ROW_TOKENS)
_q8_0_pack = pack_kernel("Q8_0")
_q8_0_t8 = tile_kernel("Q8_0", TILE_TOKENS)
_q8_0_t4 = tile_kernel("Q8_0", HALF_TILE)
_q8_0_t8g = tile_kernel("Q8_0", TILE_TOKENS, gathered=True)
_q8_0_t4g = tile_kernel("Q8_0", HALF_TILE, gathered=True)
_q5_0_r1 = row_kernel("Q5_0", 1)
_q5_0_r4 = row_kernel("Q5_0", ROW_TOKENS)
_q5_0_pack = pack_kernel("Q5_0")
_q5_0_t8 = tile_kernel("Q5_0", TILE_TOKENS)
_q5_0_t4 = tile_kernel("Q5_0", HALF_TILE)
_q5_0_t8g = tile_kernel("Q5_0", TILE_TOKENS, gathered=True)
_q5_0_t4g = tile_kernel("Q5_0", HALF_TILE, gathered=True)
_mxfp4_r1 = row_kernel("MXFP4", 1)
_mxfp4_r4 = row_kernel("MXFP4", ROW_TOKENS)
_mxfp4_pack = pack_kernel("MXFP4")
_mxfp4_t8 = tile_kernel("MXFP4", TILE_TOKENS)
_mxfp4_t4 = tile_kernel("MXFP4", HALF_TILE)
_mxfp4_t8g = tile_kernel("MXFP4", TILE_TOKENS, gathered=True)
_mxfp4_t4g = tile_kernel("MXFP4", HALF_TILE, gathered=True)
_nvfp4_r1 = row_kernel("NVFP4", 1)
_nvfp4_r4 = row_kernel("NVFP4", ROW_TOKENS)
_nvfp4_pack = pack_kernel("NVFP4")
_nvfp4_t8 = tile_kernel("NVFP4", TILE_TOKENS)
_nvfp4_t4 = tile_kernel("NVFP4", HALF_TILE)
_nvfp4_t8g = tile_kernel("NVFP4", TILE_TOKENS, gathered=True)
_nvfp4_t4g = tile_kernel("NVFP4", HALF_TILE, gathered=True)
_q4_k_r1 = row_kernel("Q4_K", 1)
_q4_k_r4 = row_kernel("Q4_K", ROW_TOKENS)
_q4_k_pack = pack_kernel("Q4_K")
_q4_k_t8 = tile_kernel("Q4_K", TILE_TOKENS)
_q4_k_t4 = tile_kernel("Q4_K", HALF_TILE)
_q4_k_t8g = tile_kernel("Q4_K", TILE_TOKENS, gathered=True)
_q4_k_t4g = tile_kernel("Q4_K", HALF_TILE, gathered=True)
_q5_k_r1 = row_kernel("Q5_K", 1)
_q5_k_r4 = row_kernel("Q5_K", ROW_TOKENS)
_q5_k_pack = pack_kernel("Q5_K")
_q5_k_t8 = tile_kernel("Q5_K", TILE_TOKENS)
_q5_k_t4 = tile_kernel("Q5_K", HALF_TILE)
_q5_k_t8g = tile_kernel("Q5_K", TILE_TOKENS, gathered=True)
_q5_k_t4g = tile_kernel("Q5_K", HALF_TILE, gathered=True)
_q6_k_r1 = row_kernel("Q6_K", 1)
_q6_k_r4 = row_kernel("Q6_K", ROW_TOKENS)
_q6_k_pack = pack_kernel("Q6_K")
_q6_k_t8 = tile_kernel("Q6_K", TILE_TOKENS)
_q6_k_t4 = tile_kernel("Q6_K", HALF_TILE)
_q6_k_t8g = tile_kernel("Q6_K", TILE_TOKENS, gathered=True)
_q6_k_t4g = tile_kernel("Q6_K", HALF_TILE, gathered=True)
_iq4_xs_r1 = row_kernel("IQ4_XS", 1)
_iq4_xs_r4 = row_kernel("IQ4_XS", ROW_TOKENS)
_iq4_xs_pack = pack_kernel("IQ4_XS")
_iq4_xs_t8 = tile_kernel("IQ4_XS", TILE_TOKENS)
_iq4_xs_t4 = tile_kernel("IQ4_XS", HALF_TILE)
_iq4_xs_t8g = tile_kernel("IQ4_XS", TILE_TOKENS, gathered=True)
_iq4_xs_t4g = tile_kernel("IQ4_XS", HALF_TILE, gathered=True)
_iq2_xxs_r1 = row_kernel("IQ2_XXS", 1)
_iq2_xxs_r4 = row_kernel("IQ2_XXS", ROW_TOKENS)
_iq2_xxs_pack = pack_kernel("IQ2_XXS")
_iq2_xxs_t8 = tile_kernel("IQ2_XXS", TILE_TOKENS)
_iq2_xxs_t4 = tile_kernel("IQ2_XXS", HALF_TILE)
_iq2_xxs_t8g = tile_kernel("IQ2_XXS", TILE_TOKENS, gathered=True)
_iq2_xxs_t4g = tile_kernel("IQ2_XXS", HALF_TILE, gathered=True)
_iq2_xs_r1 = row_kernel("IQ2_XS", 1)
_iq2_xs_r4 = row_kernel("IQ2_XS", ROW_TOKENS)
_iq2_xs_pack = pack_kernel("IQ2_XS")
_iq2_xs_t8 = tile_kernel("IQ2_XS", TILE_TOKENS)
_iq2_xs_t4 = tile_kernel("IQ2_XS", HALF_TILE)
_iq2_xs_t8g = tile_kernel("IQ2_XS", TILE_TOKENS, gathered=True)
_iq2_xs_t4g = tile_kernel("IQ2_XS", HALF_TILE, gathered=True)
_iq2_s_r1 = row_kernel("IQ2_S", 1)
_iq2_s_r4 = row_kernel("IQ2_S", ROW_TOKENS)
_iq2_s_pack = pack_kernel("IQ2_S")
_iq2_s_t8 = tile_kernel("IQ2_S", TILE_TOKENS)
_iq2_s_t4 = tile_kernel("IQ2_S", HALF_TILE)
_iq2_s_t8g = tile_kernel("IQ2_S", TILE_TOKENS, gathered=True)
_iq2_s_t4g = tile_kernel("IQ2_S", HALF_TILE, gathered=True)
_iq3_xxs_r1 = row_kernel("IQ3_XXS", 1)
_iq3_xxs_r4 = row_kernel("IQ3_XXS", ROW_TOKENS)
_iq3_xxs_pack = pack_kernel("IQ3_XXS")
_iq3_xxs_t8 = tile_kernel("IQ3_XXS", TILE_TOKENS)
_iq3_xxs_t4 = tile_kernel("IQ3_XXS", HALF_TILE)
_iq3_xxs_t8g = tile_kernel("IQ3_XXS", TILE_TOKENS, gathered=True)
_iq3_xxs_t4g = tile_kernel("IQ3_XXS", HALF_TILE, gathered=True)
_iq3_s_r1 = row_kernel("IQ3_S", 1)
_iq3_s_r4 = row_kernel("IQ3_S", ROW_TOKENS)
_iq3_s_pack = pack_kernel("IQ3_S")
_iq3_s_t8 = tile_kernel("IQ3_S", TILE_TOKENS)
_iq3_s_t4 = tile_kernel("IQ3_S", HALF_TILE)
_iq3_s_t8g = tile_kernel("IQ3_S", TILE_TOKENS, gathered=True)
_iq3_s_t4g = tile_kernel("IQ3_S", HALF_TILE, gathered=True)
_iq1_s_r1 = row_kernel("IQ1_S", 1)
_iq1_s_r4 = row_kernel("IQ1_S", ROW_TOKENS)
_iq1_s_pack = pack_kernel("IQ1_S")
_iq1_s_t8 = tile_kernel("IQ1_S", TILE_TOKENS)
_iq1_s_t4 = tile_kernel("IQ1_S", HALF_TILE)
_iq1_s_t8g = tile_kernel("IQ1_S", TILE_TOKENS, gathered=True)
_iq1_s_t4g = tile_kernel("IQ1_S", HALF_TILE, gathered=True)
_iq1_m_r1 = row_kernel("IQ1_M", 1)
_iq1_m_r4 = row_kernel("IQ1_M", ROW_TOKENS)
_iq1_m_pack = pack_kernel("IQ1_M")
_iq1_m_t8 = tile_kernel("IQ1_M", TILE_TOKENS)
_iq1_m_t4 = tile_kernel("IQ1_M", HALF_TILE)
_iq1_m_t8g = tile_kernel("IQ1_M", TILE_TOKENS, gathered=True)
_iq1_m_t4g = tile_kernel("IQ1_M", HALF_TILE, gathered=True)


@njit(**_DRIVER)
def _mm_q8_0(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _q8_0_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _q8_0_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _q8_0_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _q8_0_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _q8_0_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_q5_0(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _q5_0_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _q5_0_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _q5_0_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _q5_0_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _q5_0_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_mxfp4(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _mxfp4_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _mxfp4_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _mxfp4_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _mxfp4_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _mxfp4_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_nvfp4(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _nvfp4_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _nvfp4_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _nvfp4_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _nvfp4_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _nvfp4_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_q4_k(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _q4_k_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _q4_k_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _q4_k_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _q4_k_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _q4_k_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_q5_k(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _q5_k_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _q5_k_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _q5_k_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _q5_k_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _q5_k_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_q6_k(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _q6_k_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _q6_k_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _q6_k_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _q6_k_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _q6_k_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_iq4_xs(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _iq4_xs_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _iq4_xs_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _iq4_xs_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _iq4_xs_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _iq4_xs_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_iq2_xxs(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _iq2_xxs_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _iq2_xxs_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _iq2_xxs_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _iq2_xxs_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _iq2_xxs_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_iq2_xs(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _iq2_xs_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _iq2_xs_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _iq2_xs_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _iq2_xs_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _iq2_xs_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_iq2_s(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _iq2_s_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _iq2_s_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _iq2_s_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _iq2_s_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _iq2_s_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_iq3_xxs(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _iq3_xxs_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _iq3_xxs_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _iq3_xxs_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _iq3_xxs_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _iq3_xxs_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_iq3_s(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _iq3_s_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _iq3_s_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _iq3_s_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _iq3_s_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _iq3_s_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_iq1_s(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _iq1_s_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _iq1_s_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _iq1_s_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _iq1_s_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _iq1_s_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


@njit(**_DRIVER)
def _mm_iq1_m(w, stride, X, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    T, R, nb = X.shape[0], out.shape[1], X.shape[1] // QK
    if T < MATMUL_GEMM_ROWS:
        for r in prange(R):
            t = 0
            while T - t >= 3:
                _iq1_m_r4(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R, T - t)
                t += ROW_TOKENS
            while t < T:
                _iq1_m_r1(w, r * stride, nb, xq, t * cp, cp, dx, bs16, bs32, xs32, tab, out, t * R + r, R)
                t += 1
        return
    nu = cp // UNIT
    rb = _row_block(cp)
    for t0 in range(0, T, rb):
        t1 = min(T, t0 + rb)
        for i in prange((R + 15) // 16):
            buf = np.empty(nu * PACKED_UNIT, np.uint8)
            _iq1_m_pack(w, stride, 16 * i, R, nb, tab, buf)
            nv = min(16, R - 16 * i)
            for t in range(t0, t1, TILE_TOKENS):
                if t1 - t <= HALF_TILE:
                    _iq1_m_t4(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)
                else:
                    _iq1_m_t8(buf, nu, xq, t * cp, cp, dx, bs16, bs32, xs32, out, t * R + 16 * i, R, nv, t1 - t)


# ---- gather drivers: several matrices of one type in one call -------------------
# _gather_<t>(addrs i64[K], nbytes, stride, X f32[A, C], act i64[K], table, out f32[K, R]):
# out[e, r] = row r of matrix e · activation row act[e]; matrix e's bytes at address addrs[e]
# (bytes_at: a tuple of arrays compiled the driver once for every count of matrices, and a
# streamed decode step's count varies with what has landed: 2-4 s of compiling mid-reply
# each). A decode step's experts of a layer (their gates and ups on one activation row, then
# their downs each on its own) in one call: one rounding of the activations and one parallel
# region over every matrix's rows, where a call per matrix pays both per matrix. The row
# kernel is the matvec's, so each output equals that matrix's matvec bit for bit
# (tests/test_quant.py).


@njit(**_DRIVER)
def _gather_q8_0(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _q8_0_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_q5_0(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _q5_0_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_mxfp4(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _mxfp4_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_nvfp4(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _nvfp4_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_q4_k(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _q4_k_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_q5_k(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _q5_k_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_q6_k(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _q6_k_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_iq4_xs(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _iq4_xs_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_iq2_xxs(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _iq2_xxs_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_iq2_xs(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _iq2_xs_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_iq2_s(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _iq2_s_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_iq3_xxs(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _iq3_xxs_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_iq3_s(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _iq3_s_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_iq1_s(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _iq1_s_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


@njit(**_DRIVER)
def _gather_iq1_m(addrs, nbytes, stride, X, act, tab, out):
    xq, dx, bs16, bs32, xs32, cp = _round(X)
    K, R, nb = out.shape[0], out.shape[1], X.shape[1] // QK
    for i in prange(K * R):
        e = i // R
        _iq1_m_r1(bytes_at(addrs[e], nbytes), (i - e * R) * stride, nb, xq, act[e] * cp, cp, dx, bs16, bs32, xs32, tab, out, i, R)


# type name → its gather driver (the table is KERNELS')
GATHER = {
    "Q8_0": _gather_q8_0,
    "Q5_0": _gather_q5_0,
    "MXFP4": _gather_mxfp4,
    "NVFP4": _gather_nvfp4,
    "Q4_K": _gather_q4_k,
    "Q5_K": _gather_q5_k,
    "Q6_K": _gather_q6_k,
    "IQ4_XS": _gather_iq4_xs,
    "IQ2_XXS": _gather_iq2_xxs,
    "IQ2_XS": _gather_iq2_xs,
    "IQ2_S": _gather_iq2_s,
    "IQ3_XXS": _gather_iq3_xxs,
    "IQ3_S": _gather_iq3_s,
    "IQ1_S": _gather_iq1_s,
    "IQ1_M": _gather_iq1_m,
}


# ---- grouped drivers: several matrices, each on its own run of activation rows --------------
# _grouped_<t>(addrs i64[M], nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows i64[N],
# first i64[M], count i64[M], at i64[M], table, out f32[N', R]): out[at[m] + i, r] = row r of
# matrix m · rounded activation row rows[first[m] + i], for i < count[m]; matrix m's bytes at
# address addrs[m] (bytes_at); the activations as round_rows leaves them (rows cp elements
# wide, nb 32-blocks of them real). A prompt's experts of a layer (each on the tokens routed
# to it) in one call: one parallel region over every matrix's 16-row tiles, where a call per
# expert pays one per expert; the rows are taken where the rounding left them (the tile
# kernels' gathered form), so a layer's tokens are rounded once and no expert's rows are
# copied. A matrix of 1-3 rows takes the row kernel, more the tile kernels (4-row ones for
# the last few), so each output is that matrix's own matmul bit for bit (tests/test_quant.py).
# The parallel loop goes tile-major (tile s of every matrix, then tile s + 1): the loop is split
# into one contiguous run a thread, and matrix-major runs gave one thread the experts many
# tokens route to and the other the few (a down projection's call ran at 0.7 of its gate's and
# up's, which pair up evenly); tile-major, each thread gets its share of every matrix.


@njit(**_DRIVER)
def round_rows(X):
    """X f32 [T, C] rounded to int8 per 32 (_round_to, no padding rows): (xq, dx, bs16, bs32,
    xs32, cp), what the grouped drivers take."""
    return _round_to(X, X.shape[0])


@njit(**_DRIVER)
def _grouped_q8_0(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _q8_0_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _q8_0_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _q8_0_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _q8_0_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_q5_0(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _q5_0_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _q5_0_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _q5_0_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _q5_0_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_mxfp4(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _mxfp4_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _mxfp4_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _mxfp4_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _mxfp4_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_nvfp4(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _nvfp4_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _nvfp4_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _nvfp4_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _nvfp4_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_q4_k(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _q4_k_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _q4_k_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _q4_k_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _q4_k_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_q5_k(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _q5_k_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _q5_k_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _q5_k_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _q5_k_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_q6_k(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _q6_k_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _q6_k_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _q6_k_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _q6_k_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_iq4_xs(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _iq4_xs_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _iq4_xs_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _iq4_xs_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _iq4_xs_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_iq2_xxs(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _iq2_xxs_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _iq2_xxs_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _iq2_xxs_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _iq2_xxs_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_iq2_xs(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _iq2_xs_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _iq2_xs_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _iq2_xs_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _iq2_xs_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_iq2_s(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _iq2_s_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _iq2_s_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _iq2_s_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _iq2_s_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_iq3_xxs(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _iq3_xxs_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _iq3_xxs_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _iq3_xxs_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _iq3_xxs_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_iq3_s(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _iq3_s_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _iq3_s_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _iq3_s_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _iq3_s_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_iq1_s(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _iq1_s_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _iq1_s_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _iq1_s_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _iq1_s_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


@njit(**_DRIVER)
def _grouped_iq1_m(addrs, nbytes, stride, xq, dx, bs16, bs32, xs32, cp, nb, rows, first, count, at, tab, out):
    M, R = addrs.shape[0], out.shape[1]
    S = (R + 15) // 16
    nu = cp // UNIT
    for i in prange(M * S):
        s = i // M
        m = i - s * M
        n, x0, o0 = count[m], first[m], at[m]
        w = bytes_at(addrs[m], nbytes)
        if n < GEMM_ROWS:
            for r in range(16 * s, min(R, 16 * s + 16)):
                for t in range(n):
                    _iq1_m_r1(w, r * stride, nb, xq, rows[x0 + t] * cp, cp, dx, bs16, bs32, xs32, tab, out, (o0 + t) * R + r, R)
            continue
        buf = np.empty(nu * PACKED_UNIT, np.uint8)
        _iq1_m_pack(w, stride, 16 * s, R, nb, tab, buf)
        nv = min(16, R - 16 * s)
        for t in range(0, n, TILE_TOKENS):
            if n - t <= HALF_TILE:
                _iq1_m_t4g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)
            else:
                _iq1_m_t8g(buf, nu, xq, x0 + t, cp, dx, bs16, bs32, xs32, out, (o0 + t) * R + 16 * s, R, nv, n - t, rows)


# type name → its grouped driver (the table is KERNELS')
GROUPED = {
    "Q8_0": _grouped_q8_0,
    "Q5_0": _grouped_q5_0,
    "MXFP4": _grouped_mxfp4,
    "NVFP4": _grouped_nvfp4,
    "Q4_K": _grouped_q4_k,
    "Q5_K": _grouped_q5_k,
    "Q6_K": _grouped_q6_k,
    "IQ4_XS": _grouped_iq4_xs,
    "IQ2_XXS": _grouped_iq2_xxs,
    "IQ2_XS": _grouped_iq2_xs,
    "IQ2_S": _grouped_iq2_s,
    "IQ3_XXS": _grouped_iq3_xxs,
    "IQ3_S": _grouped_iq3_s,
    "IQ1_S": _grouped_iq1_s,
    "IQ1_M": _grouped_iq1_m,
}


# type name → (driver, its table: F16_TABLE, E8M0_HALF for MXFP4, UE4M3_HALF for NVFP4, the grid for an i-quant)
KERNELS = {
    "Q8_0": (_mm_q8_0, F16_TABLE),
    "Q5_0": (_mm_q5_0, F16_TABLE),
    "MXFP4": (_mm_mxfp4, E8M0_HALF),
    "NVFP4": (_mm_nvfp4, UE4M3_HALF),
    "Q4_K": (_mm_q4_k, F16_TABLE),
    "Q5_K": (_mm_q5_k, F16_TABLE),
    "Q6_K": (_mm_q6_k, F16_TABLE),
    "IQ4_XS": (_mm_iq4_xs, F16_TABLE),
    "IQ2_XXS": (_mm_iq2_xxs, TABLES["IQ2_XXS"]),
    "IQ2_XS": (_mm_iq2_xs, TABLES["IQ2_XS"]),
    "IQ2_S": (_mm_iq2_s, TABLES["IQ2_S"]),
    "IQ3_XXS": (_mm_iq3_xxs, TABLES["IQ3_XXS"]),
    "IQ3_S": (_mm_iq3_s, TABLES["IQ3_S"]),
    "IQ1_S": (_mm_iq1_s, TABLES["IQ1_S"]),
    "IQ1_M": (_mm_iq1_m, TABLES["IQ1_M"]),
}
