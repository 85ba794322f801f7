"""The i-quants' tables (shared/quant/grids.py, blocks.py) against gguf-py, and gguf-py's dequantizer against
ggml's own C decoders, without compiling a kernel.

The kernels themselves are checked against gguf's dequantizer in tests/test_quant.py (IQ2_XXS in
the default tier, the other six in the slow tier) and tests/test_quant_portable.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import quants as gq
from gguf.quants import dequantize

from moe_pipe.shared.quant import _iqir, blocks
from moe_pipe.shared.quant.blocks import QType

IQ_TYPES = (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S, QType.IQ1_S, QType.IQ1_M)
GRIDS = {
    "IQ2_XXS": blocks.IQ2_XXS_GRID,
    "IQ2_XS": blocks.IQ2_XS_GRID,
    "IQ2_S": blocks.IQ2_S_GRID,
    "IQ3_XXS": blocks.IQ3_XXS_GRID,
    "IQ3_S": blocks.IQ3_S_GRID,
    "IQ1_S": blocks.IQ1_GRID,
    "IQ1_M": blocks.IQ1_GRID,
}


@pytest.mark.parametrize("name", GRIDS)
def test_each_grid_is_gguf_s(name):
    ref = getattr(gq, name)
    ref.init_grid()
    assert ref.grid is not None
    np.testing.assert_array_equal(GRIDS[name], ref.grid.reshape(ref.grid_shape))


@pytest.mark.parametrize("name", GRIDS)
def test_the_kernels_tables_are_the_grids(name):
    """The int8 kernels' tables: the grid's values as bytes (8·g on IQ1), one entry per row."""
    grid = GRIDS[name]
    table = _iqir.TABLES[name].view(np.int8).reshape(grid.shape)
    np.testing.assert_array_equal(table, grid * (8 if name.startswith("IQ1") else 1))


def test_sign_rule_is_gguf_s_ksigns():
    np.testing.assert_array_equal(blocks.sign_bits(np.arange(128)), np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8))


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_block_sizes_and_random_blocks(qtype):
    fmt = blocks.block_format(qtype)
    assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[qtype]
    assert blocks.qtype_from_name(qtype.name.lower()) == qtype
    w = blocks.random_blocks(qtype, 64 * 256, np.random.default_rng(int(qtype)), std=0.05)
    assert w.shape == (64, fmt.type_size)
    deq = dequantize(w, qtype).astype(np.float64)
    assert np.isfinite(deq).all()
    assert abs(deq.std() - 0.05) < 0.005 and abs(deq.mean()) < 0.01


def test_iq1_m_d_is_the_scale_words_top_nibbles():
    rng = np.random.default_rng(7)
    w = rng.integers(0, 256, size=(5, blocks.IQ1_M_BYTES), dtype=np.uint8)
    d = np.array([0.5, -0.25, 1e-3, 0.0, 2.0], np.float16)
    low = w[:, 48:56].copy().view(np.uint16) & 0x0FFF
    blocks.put_iq1_m_d(w, d.view(np.uint16))
    np.testing.assert_array_equal(blocks.iq1_m_d(w), d.view(np.uint16))
    np.testing.assert_array_equal(w[:, 48:56].copy().view(np.uint16) & 0x0FFF, low)  # the 3-bit scales untouched
    # gguf agrees on where d lives: all weights of a block scale with it
    twice = w.copy()
    blocks.put_iq1_m_d(twice, (d.astype(np.float32) * 2).astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(dequantize(twice, QType.IQ1_M), 2 * dequantize(w, QType.IQ1_M))


@pytest.mark.parametrize("qtype", (*IQ_TYPES, QType.NVFP4), ids=lambda t: t.name)
def test_gguf_s_dequantizer_is_ggml_s_own(qtype):
    """The kernels' reference, gguf-py's dequantizer, against ggml's C decoder (`dequantize_row_<type>` in the
    libggml-base that llama-cpp-python ships; skipped without it): bit for bit on random blocks (and NVFP4's,
    whose E4M3 scales these i-quant tests share the check with)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional llama.cpp oracle) is not installed")
    so = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not so.exists():
        pytest.skip(f"{so} is not there (another llama-cpp-python build layout)")
    lib = ctypes.CDLL(str(so))
    decode = getattr(lib, f"dequantize_row_{qtype.name.lower()}")
    decode.argtypes, decode.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    w = np.ascontiguousarray(blocks.random_blocks(qtype, 64 * 256, np.random.default_rng(100 + int(qtype))))  # [64, type_size]
    w[0] = 0xFF  # the largest indices, every sign and scale bit set (IQ1_M: d then is NaN in both)
    if qtype == QType.NVFP4:
        w[1, :4] = [0x7F, 0x7E, 0x80, 0x01]  # E4M3's NaN code, its largest, bit 7 alone, a subnormal
    out = np.empty(64 * 256, np.float32)
    decode(w.ctypes.data, out.ctypes.data, out.size)
    np.testing.assert_array_equal(out, dequantize(w, qtype).reshape(-1))
