"""Quantized kernels against gguf-py's dequantizer, for every supported type.

Reference: `gguf.quants.dequantize(w)` in float64 times the activation in
float64. Two comparisons are asked of the kernels:

1. layout exactness: against dequantize(w) @ x̂ with
   x̂ = effective_activation(x, qtype), exactly what the kernels multiply by:
   x rounded to float32, and on the int8-activation types
   (quant.INT8_ACTIVATION_TYPES: Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, MXFP4, IQ4_XS and the
   i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S; default on)
   each row further rounded to int8 per block of 32 (x̂ = dx·xq,
   dx = amax/127), in matvec and matmul alike. The decoded
   weights are exact and the integer block sums are exact, so the only error
   is float32 products and accumulation: |err| ≤ (n + 2)·u·Σ|w·x̂| with
   u = 2⁻²⁴ and n = C terms, the standard bound for a float dot product.
2. against dequantize(w) @ x with the raw float64 x: add the activation
   rounding. Float activations: |x − x̂| ≤ u·|x|. Int8 activations:
   |x − x̂| ≤ (amax₃₂/254)·(1 + 4u) + u·|x| per element (amax₃₂ the largest
   |x| in its block of 32), so |err| grows by at most Σ|w|·that.
3. every row of a matmul equals the matvec of that row bit for bit, on every
   type, with int8 activations on and off (the several-row kernels run each
   row's float operations in the one-row order).

Legend: R rows, C columns, T activation rows.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf.quants import dequantize

from moe_pipe.shared import quant
from moe_pipe.shared.quant import _q8, _q8ir
from moe_pipe.shared.quant.blocks import SUPPORTED, QType, block_format, put_iq1_m_d, random_blocks

U32 = 2.0**-24  # float32 unit roundoff
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
# The i-quants' kernels take 7-18 s each to compile from an empty cache (int8 and float tiles,
# 2026-12-03, this machine): IQ2_XXS (the expert type of unsloth's UD-IQ2_XXS files) runs in the
# default tier, the other six in the slow tier.
IQ_SLOW = (QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S, QType.IQ1_S, QType.IQ1_M)


def _params(types) -> list:
    return [pytest.param(t, id=t.name, marks=pytest.mark.slow if t in IQ_SLOW else ()) for t in types]


TYPES = _params(SUPPORTED)

# The types public dumps of real unsloth UD headers use: a Qwen3.8-27B UD-Q2_K_XL's fifteen, a
# Qwen3.6-35B-A3B UD-Q4_K_M's and Kimi-K2 UD-IQ3_XXS's (docs/formats.md § Real files' quant mixes).
UD_HEADER_TYPES = "F32 Q8_0 IQ3_XXS IQ2_S IQ3_S IQ2_XXS IQ2_XS Q4_K IQ1_S IQ4_XS Q2_K Q6_K Q3_K Q5_K IQ1_M".split()


def test_every_type_a_published_ud_mix_uses_is_decoded():
    assert sorted(set(UD_HEADER_TYPES) - {t.name for t in SUPPORTED}) == []


# With int8 activations off (MOE_PIPE_INT8_ACT=0) a type that has int8 kernels computes on its
# float tiles, compiled for that mode alone (~8 s a type from an empty cache): the default tier
# checks them on Q4_K, the slow tier on every type. The kernel cache's second start likewise.
FLOAT_MODE_FAST = (QType.Q4_K,)


def slow_case(name: str, params: dict) -> bool:
    """The cases tests/conftest.py moves to the slow tier (see FLOAT_MODE_FAST)."""
    if params.get("int8_mode", True):
        return False
    qtype = params.get("qtype")
    if name == "test_kernels_load_from_the_disk_cache_on_the_second_start":
        return True
    return qtype in quant.INT8_ACTIVATION_TYPES and qtype not in FLOAT_MODE_FAST


@pytest.fixture(autouse=True, params=[False, True], ids=["f32act", "int8act"])
def int8_mode(request):
    """Every test runs with int8 activations off (float everywhere) and on (the default)."""
    before = quant.int8_activations()
    quant.set_int8_activations(request.param)
    yield request.param
    quant.set_int8_activations(before)


def _cols(qtype: QType) -> list[int]:
    """C = one block, a few blocks, many blocks (11 × 256 = 2816 is Gemma4's width). NVFP4: three
    of its 64-blocks (the float tiles: its int8 kernel takes whole 256-weight units), one unit, 11."""
    if qtype == QType.NVFP4:
        return [192, 256, 2816]
    bs = block_format(qtype).block_size
    return [32, 96, 1056] if bs == 1 else [bs, 3 * bs, 11 * bs]


def _reference(qtype: QType, w: np.ndarray, n_cols: int) -> np.ndarray:
    return dequantize(w, qtype).astype(np.float64).reshape(w.shape[0], n_cols)  # [R, C]


def _edge_blocks(qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """A few blocks at the edges of each type's fields, uint8 [B, type_size]."""
    fmt = block_format(qtype)
    if qtype in FLOAT_TYPES:
        if qtype == QType.F32:
            # big but with room: x·w summed over C must stay finite in float32
            vals = np.array([1e30, -1e30, 1e-45, -0.0, 1.17e-38, 1.0, -2.5, 0.0] * 4, np.float32).view(np.uint32)
            return vals.view(np.uint8).reshape(-1, 4)
        # f16: largest finite, smallest subnormal, largest subnormal, −0, ±1;
        # bf16: ±2^99 (room to sum in float32), smallest subnormal, −0, ±1
        bits = [0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x8000, 0x3C00, 0xBC00]
        if qtype == QType.BF16:
            bits = [0x7100, 0xF100, 0x0001, 0x8001, 0x007F, 0x8000, 0x3F80, 0xBF80]
        return np.array(bits * 4, np.uint16).view(np.uint8).reshape(-1, 2)
    base = random_blocks(qtype, 6 * fmt.block_size, rng)  # [6, type_size]
    normal = np.array([0.01], np.float16).view(np.uint8)
    base[0] = 0xFF  # largest codes / all high bits
    base[1] = 0x00  # smallest codes
    base[2:3] = random_blocks(qtype, fmt.block_size, rng)
    for off in fmt.f16_scales:  # normal scales on the extreme-code blocks, zero on block 2
        base[0, off : off + 2] = normal
        base[1, off : off + 2] = normal
        base[2, off : off + 2] = 0
    if qtype == QType.IQ1_M:  # d is the scale words' top nibbles: normal on the extreme-code blocks, zero on block 2
        put_iq1_m_d(base[:3], np.array([normal.view(np.uint16)[0], normal.view(np.uint16)[0], 0], np.uint16))
    if qtype == QType.MXFP4:
        base[0, 0] = base[1, 0] = 127
        base[2:6, 0] = [0, 1, 2, 3]  # subnormal block scales 2^-127 .. 2^-124
    if qtype == QType.NVFP4:
        base[0, 0:4] = base[1, 0:4] = 0x38  # scale 1.0 on the extreme-code blocks
        base[2, 0:4] = [0x7F, 0x7E, 0x01, 0x07]  # E4M3's NaN code (decoded 0), its largest (448), two subnormals
        base[3, 0:4] = [0x80, 0xFF, 0x00, 0x08]  # bit 7 set (not read), 0, the smallest normal
    return base


def _weights(qtype: QType, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [R, row_bytes]: random valid blocks with the edge blocks spliced in."""
    fmt = block_format(qtype)
    w = random_blocks(qtype, n_rows * n_cols, rng)  # [B, type_size]
    edge = _edge_blocks(qtype, rng)
    k = min(len(edge), len(w))
    w[rng.choice(len(w), size=k, replace=False)] = edge[:k]
    return w.reshape(n_rows, fmt.row_bytes(n_cols))


def _assert_close(what: str, qtype: QType, w, got, ref, tol) -> None:
    """Fail with: type, shape, worst rows, max abs/rel error, first bad block."""
    err = np.abs(got.astype(np.float64) - ref)
    bad = ~(err <= tol)  # NaN counts as bad
    if not bad.any():
        return
    fmt = block_format(qtype)
    flat_err = np.where(bad, err, -1).reshape(-1)
    worst = np.argsort(flat_err)[::-1][:5]
    lines = [f"{what} {fmt.name} w {list(w.shape)} out {list(got.shape)}: {int(bad.sum())} of {bad.size} outside tolerance"]
    lines.append(f"max abs err {np.max(err):.3e}, max rel err {np.max(err / np.maximum(np.abs(ref), 1e-30)):.3e}")
    for i in worst:
        idx = np.unravel_index(i, got.shape)
        lines.append(
            f"  at {tuple(int(v) for v in idx)}: got {got[idx]:.6e} want {ref[idx]:.6e} err {err[idx]:.2e} tol {np.broadcast_to(tol, got.shape)[idx]:.2e}"
        )
    row = int(np.unravel_index(worst[0], got.shape)[-1])
    mine = quant.dequantize_rows(qtype, w, [row])[0]
    theirs = dequantize(np.ascontiguousarray(w[row : row + 1]), qtype).reshape(-1)
    diff = np.nonzero(~np.isclose(mine, theirs, rtol=4 * U32, atol=0, equal_nan=True))[0]
    first = f"block {diff[0] // fmt.block_size} (element {diff[0]})" if diff.size else "none (decode matches; the dot is wrong)"
    lines.append(f"first differing decoded block in row {row}: {first}")
    pytest.fail("\n".join(lines))


def _int8(qtype: QType) -> bool:
    """Whether calls on qtype run on int8 activations."""
    return qtype in quant.INT8_ACTIVATION_TYPES and quant.int8_activations()


def _tolerances(deq: np.ndarray, X64: np.ndarray, qtype: QType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x̂ [T, C], tol vs x̂ [T, R], tol vs raw x [T, R]) from the bounds in the module doc."""
    Xh = quant.effective_activation(X64, qtype).astype(np.float64)  # [T, C]
    n = deq.shape[1]
    tol_hat = (n + 2) * U32 * (np.abs(Xh) @ np.abs(deq).T) + 1e-30  # [T, R]
    dev = U32 * np.abs(X64)  # [T, C] bound on |x − x̂| per element
    if _int8(qtype):
        amax = np.abs(X64).reshape(X64.shape[0], -1, 32).max(axis=2)  # [T, C/32]
        dev = dev + np.repeat(amax / 254 * (1 + 4 * U32), 32, axis=1)
    tol_raw = tol_hat + dev @ np.abs(deq).T
    return Xh, tol_hat, tol_raw


@pytest.mark.parametrize("qtype", TYPES)
def test_matvec_matches_gguf_dequantize(qtype):
    rng = np.random.default_rng(int(qtype))
    for n_rows in (1, 7, 130):
        for n_cols in _cols(qtype):
            w = _weights(qtype, n_rows, n_cols, rng)
            x = rng.standard_normal(n_cols)  # float64 on purpose: the kernel rounds it to float32
            deq = _reference(qtype, w, n_cols)
            xh, tol_hat, tol_raw = _tolerances(deq, x[None, :], qtype)
            got = quant.matvec(qtype, w, x)
            assert got.dtype == np.float32 and got.shape == (n_rows,)
            _assert_close("matvec vs deq@x̂", qtype, w, got, deq @ xh[0], tol_hat[0])
            _assert_close("matvec vs deq@x", qtype, w, got, deq @ x, tol_raw[0])


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_matches_gguf_dequantize(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    n_cols = _cols(qtype)[1]
    w = _weights(qtype, 33, n_cols, rng)
    deq = _reference(qtype, w, n_cols)
    # T = 1, 2: the one-row kernel a row; 3, 4: the 4-row kernel (3 over a zero row); 5, 6: a
    # call of it and the rest a row at a time; 7: two calls (the second over a zero row); 12: a
    # tile call of 8 and one of 4; 17: two calls of 8 and a call of 4 holding one row; 64: whole
    # calls of 8 only
    for n_tok in (1, 2, 3, 4, 5, 6, 7, 12, 17, 64):
        X = rng.standard_normal((n_tok, n_cols))
        Xh, tol_hat, tol_raw = _tolerances(deq, X, qtype)
        got = quant.matmul(qtype, w, X)
        assert got.shape == (n_tok, 33)
        _assert_close(f"matmul T={n_tok} vs deq@x̂", qtype, w, got, Xh @ deq.T, tol_hat)
        _assert_close(f"matmul T={n_tok} vs deq@x", qtype, w, got, X @ deq.T, tol_raw)
        # every row is the matvec of that row, bit for bit (prefill and decode agree)
        for t in range(n_tok):
            np.testing.assert_array_equal(got[t], quant.matvec(qtype, w, X[t]), err_msg=f"{qtype.name} T={n_tok} row {t}")


@pytest.mark.parametrize("qtype", FLOAT_TYPES)
def test_float_tiles_rows_equal_matvec(qtype):
    """The float tiles' product (_floatir): rows in sixes and one at a time, weight rows in
    groups of 4 (the last partial) and several tiles a call, every tail of a row (whole 64s,
    then 8s, then single columns): each row of a matmul is the matvec of that row, bit for bit."""
    rng = np.random.default_rng(7)
    for n_cols in (5, 40, 96, 203, 2048):
        W = rng.standard_normal((70, n_cols)).astype(np.float32)
        w = W if qtype == QType.F32 else W.astype(np.float16) if qtype == QType.F16 else (W.view(np.uint32) >> 16).astype(np.uint16)
        X = rng.standard_normal((13, n_cols)).astype(np.float32)
        rows = np.stack([quant.matvec(qtype, w, x) for x in X])
        deq = W if qtype == QType.F32 else w.astype(np.float32) if qtype == QType.F16 else (w.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_allclose(rows, X.astype(np.float64) @ deq.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(n_cols))
        for n_tok in (2, 6, 7, 13):
            np.testing.assert_array_equal(quant.matmul(qtype, w, X[:n_tok]), rows[:n_tok], err_msg=f"{qtype.name} C={n_cols} T={n_tok}")


@pytest.mark.parametrize("qtype", _params(quant.INT8_ACTIVATION_TYPES))
def test_int8_gemm_tiles_rows_and_threads(qtype):
    """Several 16-row tiles (the last one partial), rows inside a wider buffer, a row ending in part of
    a 256-weight unit: rows equal matvec bit for bit, whatever the thread count, and match deq@x̂ to
    float32 rounding."""
    rng = np.random.default_rng(500 + int(qtype))
    fmt = block_format(qtype)
    # 9 blocks: a unit of 8 and a part unit of 1; the whole-unit types (NVFP4's 64-blocks too) one unit
    n_cols = 256 if fmt.block_size in (64, 256) else 9 * 32
    n_rows = 2 * 16 + 5  # two whole tiles of 16 weight rows and a part tile
    w = _weights(qtype, n_rows, n_cols, rng)
    wide = np.zeros((n_rows, w.shape[1] + 7), np.uint8)
    wide[:, 3 : 3 + w.shape[1]] = w
    deq = _reference(qtype, w, n_cols)
    X = rng.standard_normal((23, n_cols)) * np.logspace(-3, 3, 23)[:, None]  # rows of very different scale
    Xh, tol_hat, _ = _tolerances(deq, X, qtype)
    got = quant.matmul(qtype, wide[:, 3 : 3 + w.shape[1]], X)
    _assert_close("matmul T=23 vs deq@x̂", qtype, w, got, Xh @ deq.T, tol_hat)
    for t in range(X.shape[0]):
        np.testing.assert_array_equal(got[t], quant.matvec(qtype, w, X[t]), err_msg=f"row {t}")
    before = quant.get_threads()
    try:
        quant.set_threads(1)
        np.testing.assert_array_equal(quant.matmul(qtype, w, X), got)
    finally:
        quant.set_threads(before)
    # more rows than a block of activation rows (_q8._row_block), the last block ending in a
    # 4-row call: the rows at either side of the block's edge and the last are their matvecs
    cp = -(-n_cols // 256) * 256
    block = max(_q8.TILE_TOKENS, _q8.ROW_BLOCK_BYTES // cp // _q8.TILE_TOKENS * _q8.TILE_TOKENS)
    X = rng.standard_normal((block + 11, n_cols))
    got = quant.matmul(qtype, w, X)
    Xh, tol_hat, _ = _tolerances(deq, X, qtype)
    _assert_close(f"matmul T={X.shape[0]} vs deq@x̂", qtype, w, got, Xh @ deq.T, tol_hat)
    for t in (0, block - 1, block, block + 7, block + 8, block + 10):
        np.testing.assert_array_equal(got[t], quant.matvec(qtype, w, X[t]), err_msg=f"row {t} of {X.shape[0]}")


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q5_0, QType.MXFP4])
def test_a_rows_part_unit_read_in_place_ignores_the_bytes_after_it(qtype):
    """Rows of 9 blocks (a unit of 8 and a part unit of 1): every row but a matrix's last reads
    its part unit in place, 7 blocks' worth of the bytes after it included, which meet the
    activation's zero padding with their scales masked. Here those bytes are 0xFF (NaN f16
    scales, the largest E8M0): the results are the contiguous matrix's bit for bit (whose rows
    read the next row's bytes there, and whose last row is copied), on the row kernel, and on
    the GEMM's pack, and finite."""
    rng = np.random.default_rng(900 + int(qtype))
    w = _weights(qtype, 21, 9 * 32, rng)
    pad = 7 * block_format(qtype).type_size
    wide = np.full((w.shape[0], w.shape[1] + pad), 0xFF, np.uint8)
    wide[:, : w.shape[1]] = w
    X = rng.standard_normal((23, 9 * 32))
    for n_tok in (1, 3, 23):
        got = quant.matmul(qtype, wide[:, : w.shape[1]], X[:n_tok])
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, quant.matmul(qtype, w, X[:n_tok]), err_msg=f"{qtype.name} T={n_tok}")


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0])
def test_a_matrix_that_ends_at_an_unreadable_page_multiplies_as_anywhere(qtype):
    """The row kernel (T = 1) asks for the bytes PREFETCH_BYTES past each unit (a hint), so a
    matrix's last rows ask for memory past its end; the row kernel and the GEMM's pack (T = 23)
    read a part unit in place except in the last row. Here the memory after the matrix is a
    page mapped with no access: a prefetch there is dropped, a load would fault. The products
    are a copy's elsewhere, bit for bit (Q8_0's 9 blocks a row: its last row's part unit is
    copied, the others read in place)."""
    page = mmap.PAGESIZE
    rng = np.random.default_rng(31 + int(qtype))
    n_cols = 256 if block_format(qtype).block_size in (64, 256) else 9 * 32
    w = _weights(qtype, 37, n_cols, rng)
    span = -(-w.nbytes // page) * page
    guard = page + _q8ir.PREFETCH_BYTES
    region = mmap.mmap(-1, span + guard)
    first = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(first)
    del first  # (an exported buffer keeps the mapping from closing)
    mprotect = ctypes.CDLL(None, use_errno=True).mprotect
    mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    at_edge = np.frombuffer(region, np.uint8, w.nbytes, span - w.nbytes).reshape(w.shape)
    at_edge[:] = w
    assert mprotect(base + span, guard, 0) == 0  # PROT_NONE (the mmap module names no PROT_NONE)
    try:
        X = rng.standard_normal((23, n_cols))
        for n_tok in (1, 23):
            np.testing.assert_array_equal(quant.matmul(qtype, at_edge, X[:n_tok]), quant.matmul(qtype, w, X[:n_tok]))
    finally:
        assert mprotect(base + span, guard, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        del at_edge
        region.close()


def _prepared_in_wider_rows(qtype, n_mats: int, n_rows: int, rng) -> tuple[int, list]:
    """(columns, n_mats prepared random matrices of qtype whose rows sit inside wider rows of a
    buffer): a whole 256-weight unit, or 9 blocks of 32 (a unit and a part unit)."""
    n_cols = 256 if block_format(qtype).block_size in (64, 256) else 9 * 32
    mats = [_weights(qtype, n_rows, n_cols, rng) for _ in range(n_mats)]
    wide = np.zeros((n_mats, n_rows, mats[0].shape[1] + 5), np.uint8)
    for m, w in zip(wide, mats):
        m[:, 2 : 2 + w.shape[1]] = w
    return n_cols, [quant.prepare(qtype, m[:, 2 : 2 + w.shape[1]]) for m, w in zip(wide, mats)]


GATHER_FAST = (QType.Q4_K,)  # the default tier's; every int8 type behind -m slow (a compile each)


def test_the_gather_and_grouped_drivers_compile_once_whatever_the_count_of_matrices(int8_mode):
    """A decode step's experts come to the gather driver in groups of any size as their reads
    land, and a prompt's to the grouped one: the matrices travel as addresses, so one compiled
    driver serves every count (a tuple of arrays compiled one a count, 2-4 s each mid-reply)."""
    if not int8_mode:
        pytest.skip("the int8 drivers")
    rng = np.random.default_rng(77)
    n_cols, ps = _prepared_in_wider_rows(QType.Q4_K, 5, 19, rng)
    X = rng.standard_normal((5, n_cols)).astype(np.float32)
    for n in (1, 2, 3, 5):
        assert quant.gather_apply(ps[:n], X, np.arange(n)) is not None
        assert quant.grouped_apply(ps[:n], X, np.zeros(n, np.int64), np.full(n, 4)) is not None
    assert len(_q8._gather_q4_k.signatures) == 1 and len(_q8._grouped_q4_k.signatures) == 1


def test_a_second_level_scale_multiplies_every_product_in_every_driver(int8_mode):
    """A matrix prepared with its `.scale` sidecar's value: apply gives the unscaled product times
    it (a row alone as in a batch), a row range keeps it, and gather_apply / grouped_apply give
    each matrix's rows its own scale."""
    rng = np.random.default_rng(41)
    for qtype in (QType.NVFP4, QType.Q4_K):
        n_cols = _cols(qtype)[1]
        w = _weights(qtype, 9, n_cols, rng)
        X = rng.standard_normal((3, n_cols)).astype(np.float32)
        plain, scaled = quant.prepare(qtype, w), quant.prepare(qtype, w, 0.0123)
        want = quant.apply(plain, X) * np.float32(0.0123)
        np.testing.assert_array_equal(quant.apply(scaled, X), want)
        np.testing.assert_array_equal(quant.apply(scaled, X[1:2])[0], want[1])
        np.testing.assert_array_equal(quant.apply(quant.row_range(scaled, 2, 5), X), want[:, 2:5])
        other = quant.prepare(qtype, w, 3.5)
        got = quant.gather_apply([plain, scaled, other], X, np.array([2, 0, 1]))
        if not int8_mode:
            assert got is None
            continue
        for e, (p, row) in enumerate(((plain, 2), (scaled, 0), (other, 1))):
            np.testing.assert_array_equal(got[e], quant.apply(p, X[row : row + 1])[0], err_msg=f"{qtype.name} gather {e}")
        runs = quant.grouped_apply([scaled, plain, other], X, np.array([0, 1, 0]), np.array([2, 2, 3]))
        for part, (p, rows) in zip(np.split(runs, [2, 4]), ((scaled, X[0:2]), (plain, X[1:3]), (other, X[0:3]))):
            np.testing.assert_array_equal(part, quant.apply(p, rows), err_msg=f"{qtype.name} grouped")


@pytest.mark.parametrize(
    "qtype", [pytest.param(q, marks=[] if q in GATHER_FAST else [pytest.mark.slow]) for q in quant.INT8_ACTIVATION_TYPES]
)
def test_gather_apply_rows_equal_each_matrix_alone(qtype, int8_mode):
    """Several matrices of one type in one call, on one shared activation row (gates and ups) or
    each on its own (downs), from a wider buffer: every row equals that matrix's own product bit
    for bit; without int8 activations, or across types, the call declines (None)."""
    rng = np.random.default_rng(900 + int(qtype))
    n_cols, ps = _prepared_in_wider_rows(qtype, 5, 19, rng)
    X = (rng.standard_normal((5, n_cols)) * np.logspace(-2, 2, 5)[:, None]).astype(np.float32)
    for act in (np.zeros(5, np.int64), np.arange(5, dtype=np.int64), np.array([4, 0, 4, 2, 1])):
        got = quant.gather_apply(ps, X, act)
        if not int8_mode:
            assert got is None
            continue
        for e, p in enumerate(ps):
            np.testing.assert_array_equal(got[e], quant.apply(p, X[act[e] : act[e] + 1])[0], err_msg=f"matrix {e}, row {act[e]}")
    other = quant.prepare(
        QType.Q8_0 if qtype != QType.Q8_0 else QType.Q4_K, _weights(QType.Q8_0 if qtype != QType.Q8_0 else QType.Q4_K, 19, 256, rng)
    )
    if int8_mode and n_cols == 256:
        assert quant.gather_apply([ps[0], other], X, np.zeros(2, np.int64)) is None


@pytest.mark.parametrize(
    "qtype", [pytest.param(q, marks=[] if q in GATHER_FAST else [pytest.mark.slow]) for q in quant.INT8_ACTIVATION_TYPES]
)
def test_grouped_apply_rows_equal_each_matrix_alone(qtype, int8_mode):
    """Several matrices of one type in one call, each on its own run of activation rows (a
    prompt's experts, each on the tokens routed to it: 0, 1-3 rows on the row kernel, 4-row
    and 8-row tiles, runs that overlap or repeat, the last run ending at X's last row): every
    output row equals that matrix's own product bit for bit; without int8 activations, or
    across types, the call declines (None)."""
    rng = np.random.default_rng(950 + int(qtype))
    n_cols, ps = _prepared_in_wider_rows(qtype, 6, 37, rng)
    X = (rng.standard_normal((40, n_cols)) * np.logspace(-2, 2, 40)[:, None]).astype(np.float32)
    first = np.array([0, 3, 3, 10, 21, 27])
    count = np.array([3, 0, 12, 9, 1, 13])  # the last run ends at row 39, X's last
    got = quant.grouped_apply(ps, X, first, count)
    if not int8_mode:
        assert got is None
        return
    assert got.shape == (count.sum(), 37)
    at = 0
    for p, f, c in zip(ps, first, count):
        if c:
            np.testing.assert_array_equal(got[at : at + c], quant.apply(p, X[f : f + c]), err_msg=f"rows {f}..{f + c}")
        at += c
    with pytest.raises(ValueError, match="needs a run inside the 40 rows"):
        quant.grouped_apply(ps, X, first, count + 1)
    other = QType.Q8_0 if qtype != QType.Q8_0 else QType.Q4_K
    if n_cols == 256:
        assert quant.grouped_apply([ps[0], quant.prepare(other, _weights(other, 37, 256, rng))], X, first[:2], count[:2]) is None


@pytest.mark.parametrize(
    "qtype", [pytest.param(q, marks=[] if q in GATHER_FAST else [pytest.mark.slow]) for q in quant.INT8_ACTIVATION_TYPES]
)
def test_grouped_apply_takes_its_rows_where_they_lie(qtype, int8_mode):
    """A prompt layer's tokens rounded once (int8_rows) and each matrix's run of them given by
    index (`rows`: repeated, out of order, the last row of X among them), written into a given
    output: every row equals that matrix's own product on a copy of its rows, bit for bit, as
    with X passed as floats; rows outside X and a wrong output are refused."""
    if not int8_mode:
        pytest.skip("the int8 drivers")
    rng = np.random.default_rng(970 + int(qtype))
    n_cols, ps = _prepared_in_wider_rows(qtype, 5, 37, rng)
    X = (rng.standard_normal((23, n_cols)) * np.logspace(-2, 2, 23)[:, None]).astype(np.float32)
    rows = np.concatenate([[22, 5, 5], rng.integers(0, 23, 30), [0, 22]])
    first = np.array([0, 3, 3, 14, 25])
    count = np.array([3, 0, 11, 11, 10])  # 1-3 rows on the row kernel, 8- and 4-row tiles
    rounded = quant.int8_rows(X)
    out = np.full((count.sum(), 37), np.nan, np.float32)
    got = quant.grouped_apply(ps, rounded, first, count, rows=rows, out=out)
    assert got is out
    np.testing.assert_array_equal(quant.grouped_apply(ps, X, first, count, rows=rows), out)
    at = 0
    for p, f, c in zip(ps, first, count):
        if c:
            np.testing.assert_array_equal(out[at : at + c], quant.apply(p, X[rows[f : f + c]]), err_msg=f"rows {rows[f : f + c]}")
        at += c
    with pytest.raises(ValueError, match=r"rows must be in \[0, 23\)"):
        quant.grouped_apply(ps, rounded, first, count, rows=np.where(rows == 0, 23, rows))
    with pytest.raises(ValueError, match="out must be float32"):
        quant.grouped_apply(ps, rounded, first, count, rows=rows, out=out[:-1])


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_rows_is_exact(qtype):
    rng = np.random.default_rng(200 + int(qtype))
    n_cols = _cols(qtype)[1]
    w = _weights(qtype, 19, n_cols, rng)
    rows = [18, 0, 5, 5]
    got = quant.dequantize_rows(qtype, w, rows)
    want = dequantize(w, qtype).reshape(19, n_cols)[rows].astype(np.float32)
    # The same float32 arithmetic as gguf-py up to one rounding of d·q − m
    # (an FMA here, two steps there): allow 2 ulp.
    np.testing.assert_allclose(got, want, rtol=2 * U32, atol=0)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.MXFP4, QType.F16])
def test_rows_from_a_bigger_buffer_and_a_read_only_memmap(qtype, tmp_path):
    rng = np.random.default_rng(300 + int(qtype))
    fmt = block_format(qtype)
    n_cols = _cols(qtype)[1]
    rb = fmt.row_bytes(n_cols)
    w = _weights(qtype, 24, n_cols, rng)
    x = rng.standard_normal(n_cols).astype(np.float32)
    want = quant.matvec(qtype, w, x)
    # rows padded and shifted inside a wider buffer: strides (rb + 13, 1), odd offsets
    wide = rng.integers(0, 256, size=(24, rb + 13), dtype=np.uint8)
    wide[:, 5 : 5 + rb] = w
    np.testing.assert_array_equal(quant.matvec(qtype, wide[:, 5 : 5 + rb], x), want)
    np.testing.assert_array_equal(quant.matvec(qtype, wide[::3, 5 : 5 + rb], x), want[::3])
    np.testing.assert_array_equal(quant.dequantize_rows(qtype, wide[:, 5 : 5 + rb], [3]), quant.dequantize_rows(qtype, w, [3]))
    # an expert slab read in place from a file, at an unaligned offset
    path = tmp_path / "slab.bin"
    path.write_bytes(b"\0" * 7 + w.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=7, shape=w.shape)
    np.testing.assert_array_equal(quant.matvec(qtype, mm, x), want)
    X = rng.standard_normal((3, n_cols)).astype(np.float32)
    np.testing.assert_array_equal(quant.matmul(qtype, mm, X), quant.matmul(qtype, w, X))


def test_out_buffers_and_threads():
    rng = np.random.default_rng(4)
    w = _weights(QType.Q4_K, 50, 512, rng)
    x = rng.standard_normal(512).astype(np.float32)
    y = np.empty(50, np.float32)
    assert quant.matvec(QType.Q4_K, w, x, out=y) is y
    before = quant.get_threads()
    try:
        quant.set_threads(1)
        one = quant.matvec(QType.Q4_K, w, x)
        quant.set_threads(before)
        np.testing.assert_array_equal(one, y)  # rows are independent: same bits whatever the split
    finally:
        quant.set_threads(before)
    with pytest.raises(ValueError, match="threads"):
        quant.set_threads(0)
    Y = np.empty((2, 50), np.float32)
    assert quant.matmul(QType.Q4_K, w, np.stack([x, x]), out=Y) is Y
    np.testing.assert_array_equal(Y[1], Y[0])
    np.testing.assert_array_equal(quant.matmul(QType.Q4_K, w, x[None], out=Y[1:]), y[None])  # one row: the matvec
    assert quant.matvec(QType.Q4_K, w[:0], x).shape == (0,)
    assert quant.dequantize_rows(QType.Q4_K, w, []).shape == (0, 512)


def test_float_types_accept_native_arrays():
    rng = np.random.default_rng(5)
    W = rng.standard_normal((9, 40)).astype(np.float32)
    x = rng.standard_normal(40).astype(np.float32)
    np.testing.assert_allclose(quant.matvec(QType.F32, W, x), W.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        quant.matvec(QType.F16, W.astype(np.float16), x), W.astype(np.float16).astype(np.float64) @ x, rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda w, x: quant.matvec(QType.Q8_1, w, x), "Q8_1 is not supported"),
        (lambda w, x: quant.matvec(999, w, x), "unknown type id 999"),
        (lambda w, x: quant.matvec(QType.Q4_K, w, x), "rows of C=256 weights are 144 bytes"),
        (lambda w, x: quant.matvec(QType.Q8_0, w, x[:40]), "multiple of 32"),
        (lambda w, x: quant.matvec(QType.Q8_0, w.astype(np.float64), x), "must be uint8"),
        (lambda w, x: quant.matvec(QType.Q8_0, w.view(np.int8), x), "must be uint8"),
        (lambda w, x: quant.matvec(QType.Q8_0, w[0], x), "must be uint8 \\[rows, row_bytes\\]"),
        (lambda w, x: quant.matvec(QType.Q8_0, w, x[None]), "x must be 1-D"),
        (lambda w, x: quant.matmul(QType.Q8_0, w, x), "X must be 2-D"),
        (lambda w, x: quant.matvec(QType.Q8_0, w, x, out=np.empty(3, np.float64)), "out must be"),
        (lambda w, x: quant.matvec(QType.Q8_0, np.asfortranarray(w), x), "contiguous"),
        (lambda w, x: quant.dequantize_rows(QType.Q8_0, w, [4]), "row ids"),
        (lambda w, x: quant.dequantize_rows(QType.Q8_0, w[:, :50], [0]), "whole 34-byte blocks"),
    ],
)
def test_bad_input_is_a_value_error(call, message):
    w = np.zeros((4, 8 * 34), np.uint8)  # Q8_0, C = 256
    x = np.zeros(256, np.float32)
    with pytest.raises(ValueError, match=message):
        call(w, x)


_CACHE_PROBE = textwrap.dedent(
    """
    import json, numpy as np
    from moe_pipe.shared import quant
    from moe_pipe.shared.quant.blocks import random_blocks
    w = random_blocks(quant.QType.Q4_K, 8 * 512, np.random.default_rng(0)).reshape(8, -1)
    quant.matvec(quant.QType.Q4_K, w, np.ones(512, np.float32))
    mm, _ = quant.kernels_for(quant.QType.Q4_K)
    print(json.dumps({"hits": sum(mm.stats.cache_hits.values()), "misses": sum(mm.stats.cache_misses.values())}))
    """
)


@pytest.mark.integration
def test_kernels_load_from_the_disk_cache_on_the_second_start(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["misses"] >= 1, first  # compiled and written
    assert second == {"hits": 1, "misses": 0}, second  # loaded, nothing recompiled


@pytest.mark.parametrize("qtype", _params(quant.INT8_ACTIVATION_TYPES))
def test_int8_activation_rounding(qtype, int8_mode):
    """x̂ is x rounded per block of 32 to dx·int8 with dx = amax/127; odd blocks stay exact-ish."""
    if not int8_mode:
        x = np.ones(64, np.float32)
        np.testing.assert_array_equal(quant.effective_activation(x, qtype), x)
        return
    rng = np.random.default_rng(400 + int(qtype))
    x = rng.standard_normal((2, 256)).astype(np.float32)  # a whole 256-weight unit (NVFP4's int8 kernel's least)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 32:64] *= 1e-25  # tiny values: still rounded relative to their own amax
    x[1, 64:96] *= 1e-35  # amax < 2^-100: the block is flushed to zero (documented)
    xh = np.stack([quant.effective_activation(row, qtype) for row in x])  # one-row calls round
    np.testing.assert_array_equal(quant.effective_activation(x[:1], qtype), xh[:1])  # [1, C] too
    np.testing.assert_array_equal(quant.effective_activation(x, qtype), xh)  # a batch rounds each row the same way
    many = np.repeat(x, 40, axis=0)
    np.testing.assert_array_equal(quant.effective_activation(many, qtype), np.repeat(xh, 40, axis=0))  # however long
    np.testing.assert_array_equal(xh[1, 64:96], 0.0)
    x[1, 64:96] = xh[1, 64:96]
    assert xh.shape == x.shape and xh.dtype == np.float32
    blocks, hat = x.reshape(2, 8, 32), xh.reshape(2, 8, 32)
    dx = np.abs(blocks).max(axis=2, keepdims=True) / 127
    assert np.all(np.abs(hat - blocks) <= dx / 2 * (1 + 1e-5))
    np.testing.assert_array_equal(xh[0, :32], 0.0)
    q = np.divide(hat, dx, out=np.zeros_like(hat), where=dx > 0)
    np.testing.assert_allclose(q, np.rint(q), atol=1e-3)  # integer codes
    assert np.abs(q).max() <= 127 + 1e-3
    # float types and qtype=None: float32 only
    np.testing.assert_array_equal(quant.effective_activation(x), x)
    np.testing.assert_array_equal(quant.effective_activation(x, QType.F32), x)
    # a non-finite activation block poisons only its own outputs' sums
    w = _weights(qtype, 3, 256, rng)
    xn = rng.standard_normal(256).astype(np.float32)
    xn[5] = np.inf
    assert not np.isfinite(quant.matvec(qtype, w, xn)).any()


def test_one_blas_thread_limits_numpys_blas():
    """Compute keeps numpy's BLAS to one thread: its spinning workers would compete with numba's."""
    from threadpoolctl import threadpool_info, threadpool_limits

    with threadpool_limits(limits=None):  # restored after the test
        quant.one_blas_thread()
        blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
        assert blas and all(p["num_threads"] == 1 for p in blas)
