"""Quantized block formats: the one table of supported ggml types, and random
valid blocks for made models and kernel tests.

The byte layout of each block is ggml's (docs/formats.md § Quant blocks; gguf-py's `gguf.quants` decodes the
same bytes in numpy, and the kernel tests compare against it); here we only
need what every caller shares: block size, bytes per block, where the scale
fields sit (to make random blocks with a chosen spread), the MXFP4 and IQ4
code books, the i-quants' grids (data in grids.py, unpacked here) and sign
rule, and shape arithmetic. Legend: R rows, C columns (ne0, the contiguous axis),
B blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType  # an import, not an alias assignment: mypy then allows QType[name]
from gguf.quants import NVFP4, dequantize

from .grids import (
    IQ1_S_GRID_HEX,
    IQ1_S_VALUES,
    IQ2_S_GRID_HEX,
    IQ2_S_VALUES,
    IQ2_XS_GRID_HEX,
    IQ2_XS_VALUES,
    IQ2_XXS_GRID_HEX,
    IQ2_XXS_VALUES,
    IQ3_S_GRID_HEX,
    IQ3_S_VALUES,
    IQ3_XXS_GRID_HEX,
    IQ3_XXS_VALUES,
)


def _type_size(qtype: QType, block_size: int) -> int:
    """Bytes per block of `qtype`, checking that its block holds `block_size` weights."""
    weights, size = GGML_QUANT_SIZES[qtype]
    if weights != block_size:
        raise ImportError(f"gguf says a {qtype.name} block holds {weights} weights; the kernels are written for {block_size}")
    return size


# Block facts the kernels are compiled with (numba freezes module-level ints
# into the machine code, as if they were literals), taken from gguf's table so
# the kernels and the file reader cannot disagree on them.
QK = 32  # weights per block: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, and the int8 activation blocks
QK_K = 256  # weights per super-block: Q2_K .. Q6_K, IQ4_XS
Q8_0_BYTES = _type_size(QType.Q8_0, QK)  # 34: f16 d, 32 int8 codes
Q4_0_BYTES = _type_size(QType.Q4_0, QK)  # 18: f16 d, 16 nibble bytes
Q4_1_BYTES = _type_size(QType.Q4_1, QK)  # 20: f16 d, f16 m, 16 nibble bytes
Q5_0_BYTES = _type_size(QType.Q5_0, QK)  # 22: f16 d, u32 high bits, 16 nibble bytes
Q5_1_BYTES = _type_size(QType.Q5_1, QK)  # 24: f16 d, f16 m, u32 high bits, 16 nibble bytes
IQ4_NL_BYTES = _type_size(QType.IQ4_NL, QK)  # 18: f16 d, 16 nibble bytes (code book indices)
MXFP4_BYTES = _type_size(QType.MXFP4, QK)  # 17: E8M0 exponent byte, 16 nibble bytes (E2M1 codes)
QK_NV = 64  # weights per NVFP4 block: four 16-weight sub-blocks
NVFP4_BYTES = _type_size(QType.NVFP4, QK_NV)  # 36: 4 UE4M3 scale bytes, 32 nibble bytes (E2M1 codes)
Q2_K_BYTES = _type_size(QType.Q2_K, QK_K)  # 84
Q3_K_BYTES = _type_size(QType.Q3_K, QK_K)  # 110
Q4_K_BYTES = _type_size(QType.Q4_K, QK_K)  # 144
Q5_K_BYTES = _type_size(QType.Q5_K, QK_K)  # 176
Q6_K_BYTES = _type_size(QType.Q6_K, QK_K)  # 210
IQ4_XS_BYTES = _type_size(QType.IQ4_XS, QK_K)  # 136
# The i-quants: 256-weight super-blocks of grid indices, signs and small scales (docs/formats.md).
IQ2_XXS_BYTES = _type_size(QType.IQ2_XXS, QK_K)  # 66: f16 d, 8 × (4 index bytes, u32 of 4 sign indices + scale)
IQ2_XS_BYTES = _type_size(QType.IQ2_XS, QK_K)  # 74: f16 d, 32 u16 (9-bit index, 7-bit sign index), 8 scale bytes
IQ2_S_BYTES = _type_size(QType.IQ2_S, QK_K)  # 82: f16 d, 32 index bytes, 32 sign bytes, 8 high-bit bytes, 8 scale bytes
IQ3_XXS_BYTES = _type_size(QType.IQ3_XXS, QK_K)  # 98: f16 d, 64 index bytes, 8 u32 of 4 sign indices + scale
IQ3_S_BYTES = _type_size(QType.IQ3_S, QK_K)  # 110: f16 d, 64 index bytes, 8 high-bit bytes, 32 sign bytes, 4 scale bytes
IQ1_S_BYTES = _type_size(QType.IQ1_S, QK_K)  # 50: f16 d, 32 index bytes, 8 u16 (index high bits, scale, delta sign)
IQ1_M_BYTES = _type_size(QType.IQ1_M, QK_K)  # 56: 32 index bytes, 16 high-bit/delta bytes, 4 u16 of scales and d

# MXFP4 elements are E2M1 codes: bit 3 the sign, codes 0..7 the magnitudes
# 0, 0.5, 1, 1.5, 2, 3, 4, 6. Listed doubled so they are integers (the
# decoders and the int8 kernels work on 2·value; the E8M0 table halves the
# scale to match). The one copy of the code book: the kernels' decoders are
# checked against it (tests/test_quant_portable.py).
E2M1_TWICE = (0, 1, 2, 3, 4, 6, 8, 12)
# IQ4_NL / IQ4_XS: the non-linear code book, code 0..15 → value (times the block's scale).
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _unpack_grid(hex_words: str, values: tuple[int, ...], width: int) -> np.ndarray:
    """grids.py's packing (one 16-bit word per entry, element j at bits j·b) → int16 [N, width] values."""
    words = np.array([int(hex_words[i : i + 4], 16) for i in range(0, len(hex_words), 4)], np.int64)  # [N]
    bits = 3 if width == 4 else 2
    idx = (words[:, None] >> (bits * np.arange(width))) & ((1 << bits) - 1)  # [N, width]
    return np.asarray(values, np.int16)[idx]


# The i-quants' grids, entry → its 8 (IQ3: 4) weights before sign and scale. IQ2: 8, 25, 43;
# IQ3_XXS: 4 .. 62; IQ3_S: 1, 3, .. 15; IQ1 (S and M share one): -1, 0, 1.
IQ2_XXS_GRID = _unpack_grid(IQ2_XXS_GRID_HEX, IQ2_XXS_VALUES, 8)  # [256, 8]
IQ2_XS_GRID = _unpack_grid(IQ2_XS_GRID_HEX, IQ2_XS_VALUES, 8)  # [512, 8]
IQ2_S_GRID = _unpack_grid(IQ2_S_GRID_HEX, IQ2_S_VALUES, 8)  # [1024, 8]
IQ3_XXS_GRID = _unpack_grid(IQ3_XXS_GRID_HEX, IQ3_XXS_VALUES, 4)  # [256, 4]
IQ3_S_GRID = _unpack_grid(IQ3_S_GRID_HEX, IQ3_S_VALUES, 4)  # [512, 4]
IQ1_GRID = _unpack_grid(IQ1_S_GRID_HEX, IQ1_S_VALUES, 8)  # [2048, 8]


def sign_bits(index7: np.ndarray) -> np.ndarray:
    """IQ2_XXS / IQ2_XS / IQ3_XXS: a 7-bit sign index → the 8 sign bits of its 8 weights (bit j set:
    weight j negative). The eighth bit is the parity of the seven, so a group always has an even
    number of negative weights (ggml's ksigns table is this rule written out)."""
    i = np.asarray(index7, np.int64) & 127
    parity = np.zeros_like(i)
    for k in range(7):
        parity ^= (i >> k) & 1
    return i | (parity << 7)


@dataclass(frozen=True)
class BlockFormat:
    qtype: QType
    block_size: int  # weights per block
    type_size: int  # bytes per block
    f16_scales: tuple[int, ...] = ()  # byte offsets of f16 scale fields (d, dmin, m)

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, n_cols: int) -> int:
        if n_cols % self.block_size:
            raise ValueError(f"{self.name} needs rows that are a multiple of {self.block_size} wide, not {n_cols}")
        return n_cols // self.block_size * self.type_size

    def tensor_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor with numpy `shape` (last axis contiguous)."""
        n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        return n_rows * self.row_bytes(int(shape[-1]))


def _fmt(qtype: QType, *f16_scales: int) -> BlockFormat:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return BlockFormat(qtype, block_size, type_size, tuple(f16_scales))


# The types the engine computes on. Scale offsets from the block layouts.
FORMATS: dict[QType, BlockFormat] = {
    f.qtype: f
    for f in (
        _fmt(QType.F32),
        _fmt(QType.F16),
        _fmt(QType.BF16),
        _fmt(QType.Q8_0, 0),
        _fmt(QType.Q4_0, 0),
        _fmt(QType.Q4_1, 0, 2),
        _fmt(QType.Q5_0, 0),
        _fmt(QType.Q5_1, 0, 2),
        _fmt(QType.Q2_K, 80, 82),
        _fmt(QType.Q3_K, 108),
        _fmt(QType.Q4_K, 0, 2),
        _fmt(QType.Q5_K, 0, 2),
        _fmt(QType.Q6_K, 208),
        _fmt(QType.IQ4_NL, 0),
        _fmt(QType.IQ4_XS, 0),
        _fmt(QType.MXFP4),  # scale is a u8 power-of-two exponent at byte 0
        _fmt(QType.NVFP4),  # four UE4M3 sub-block scales at bytes 0-3 (random_blocks sets them)
        _fmt(QType.IQ2_XXS, 0),
        _fmt(QType.IQ2_XS, 0),
        _fmt(QType.IQ2_S, 0),
        _fmt(QType.IQ3_XXS, 0),
        _fmt(QType.IQ3_S, 0),
        _fmt(QType.IQ1_S, 0),
        _fmt(QType.IQ1_M),  # d is the top nibbles of the four scale words at 48 (random_blocks sets it)
    )
}

SUPPORTED = tuple(FORMATS)
# The same table keyed by plain int: a QType (an IntEnum) hashes and compares
# like its int, so the hot path looks ids up with no enum construction.
_BY_ID: dict[int, BlockFormat] = {int(q): f for q, f in FORMATS.items()}


def block_format(qtype: int | QType) -> BlockFormat:
    """The format of a ggml type id; ValueError names unsupported ones."""
    fmt = _BY_ID.get(qtype)
    if fmt is not None:
        return fmt
    try:  # ids that only equal their int after int() (e.g. "12")
        name = QType(int(qtype)).name
        fmt = _BY_ID.get(int(qtype))
    except ValueError:
        name = f"unknown type id {int(qtype)}"
    if fmt is not None:
        return fmt
    raise ValueError(f"quant type {name} is not supported (supported: {', '.join(t.name for t in SUPPORTED)})")


def qtype_from_name(name: str) -> QType:
    try:
        qtype = QType[name.upper()]
    except KeyError:
        raise ValueError(f"unknown quant type {name!r} (supported: {', '.join(t.name for t in SUPPORTED)})") from None
    block_format(qtype)
    return qtype


# Qn_K blocks carry a per-sub-block min; a block of random bytes has minima
# unrelated to the scales, which biases every sub-block. Tying min to scale
# (m = sc, dmin = mid-code × d) centres each sub-block on zero like trained
# weights, so made models have sane activations.
_K_MID_CODE = {QType.Q2_K: 1.5, QType.Q4_K: 7.5, QType.Q5_K: 15.5}


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit (scale, min) pairs [B, 8] → the 12-byte Q4_K/Q5_K scale field."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _centre_k_minima(qtype: QType, blocks: np.ndarray, rng: np.random.Generator) -> None:
    b = blocks.shape[0]
    if qtype in (QType.Q4_K, QType.Q5_K):
        sc = rng.integers(1, 64, size=(b, 8), dtype=np.uint8)
        blocks[:, 4:16] = _pack_k_scales(sc, sc)
    elif qtype == QType.Q2_K:
        sc = rng.integers(1, 16, size=(b, 16), dtype=np.uint8)
        blocks[:, 0:16] = sc | (sc << 4)
    mid = _K_MID_CODE[qtype]
    d = blocks[:, 80:82] if qtype == QType.Q2_K else blocks[:, 0:2]
    dmin = blocks[:, 82:84] if qtype == QType.Q2_K else blocks[:, 2:4]
    dmin[:] = (d.copy().view(np.float16).astype(np.float32) * mid).astype(np.float16).view(np.uint8)


def random_blocks(qtype: int | QType, n_weights: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """Random valid quantized data for `n_weights` weights as uint8 [B, type_size].

    The dequantized values have mean ≈ 0 and standard deviation ≈ `std`
    (measured on a sample with gguf's own dequantizer, then rescaled), with the
    per-block scales jittered so blocks differ like real ones do.
    """
    fmt = block_format(qtype)
    qtype = fmt.qtype
    if n_weights % fmt.block_size:
        raise ValueError(f"{fmt.name}: {n_weights} weights is not a whole number of {fmt.block_size}-blocks")
    n_blocks = n_weights // fmt.block_size
    if qtype in (QType.F32, QType.F16, QType.BF16):
        return _random_float(qtype, n_weights, rng, std).reshape(n_blocks, fmt.type_size)
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.type_size), dtype=np.uint8)
    if qtype == QType.MXFP4:
        return _set_mxfp4_exponents(blocks, rng, std)
    if qtype == QType.NVFP4:
        return _set_nvfp4_scales(blocks, rng, std)
    if qtype == QType.IQ1_M:
        return _set_iq1_m_scales(blocks, rng, std)
    jitter = rng.uniform(0.5, 1.5, size=n_blocks).astype(np.float32)
    for off in fmt.f16_scales:
        blocks[:, off : off + 2] = jitter.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype in _K_MID_CODE:
        _centre_k_minima(qtype, blocks, rng)
    if qtype in (QType.Q4_1, QType.Q5_1):  # x = d·q + m: centre with m = -mid·d
        mid = 7.5 if qtype == QType.Q4_1 else 15.5
        blocks[:, 2:4] = (-mid * jitter).astype(np.float16).view(np.uint8).reshape(-1, 2)
    sample = dequantize(blocks[: min(n_blocks, 512)], qtype).astype(np.float64)
    factor = std / max(float(sample.std()), 1e-30)
    for off in fmt.f16_scales:
        field = blocks[:, off : off + 2].copy().view(np.float16).astype(np.float32)
        blocks[:, off : off + 2] = (field * factor).astype(np.float16).view(np.uint8)
    return blocks


def _random_float(qtype: QType, n: int, rng: np.random.Generator, std: float) -> np.ndarray:
    x = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
    if qtype == QType.F32:
        return x.view(np.uint8)
    if qtype == QType.F16:
        return x.astype(np.float16).view(np.uint8)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # BF16 by truncation


# E2M1 magnitudes have RMS ≈ 2.93 over uniform codes; the block exponent sets
# the scale as a power of two, so spread comes from jittering the exponent.
_FP4_RMS = float(np.sqrt(np.mean(np.square(np.array(E2M1_TWICE) / 2))))


def _set_mxfp4_exponents(blocks: np.ndarray, rng: np.random.Generator, std: float) -> np.ndarray:
    centre = 127 + int(round(np.log2(std / _FP4_RMS)))
    blocks[:, 0] = np.clip(centre + rng.integers(-1, 2, size=blocks.shape[0]), 1, 254).astype(np.uint8)
    return blocks


def _set_nvfp4_scales(blocks: np.ndarray, rng: np.random.Generator, std: float) -> np.ndarray:
    """NVFP4's four UE4M3 sub-block scales (a weight is its scale's E4M3 value times its E2M1
    value): the scale that gives `std`, jittered, rounded to E4M3 as ggml rounds it (small spreads
    land on E4M3's subnormals; real files keep their blocks in range with a `.scale` per tensor)."""
    scales = (std / _FP4_RMS) * rng.uniform(0.5, 1.5, size=(blocks.shape[0], 4))
    blocks[:, 0:4] = NVFP4.fp32_to_ue4m3(scales.astype(np.float32))
    return blocks


def iq1_m_d(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M blocks uint8 [B, 56] → their f16 d as uint16 bits [B]: the top nibble of scale word k is
    bits 4k..4k+3 of d."""
    words = blocks[:, 48:56].copy().view(np.uint16)  # [B, 4]
    return ((words >> 12) << np.array([0, 4, 8, 12], np.uint16)).astype(np.uint16).sum(axis=1, dtype=np.uint16)


def put_iq1_m_d(blocks: np.ndarray, d_bits: np.ndarray) -> None:
    """Set IQ1_M blocks' f16 d (uint16 bits [B]) in the top nibbles of their scale words, in place."""
    words = blocks[:, 48:56].copy().view(np.uint16)  # [B, 4]
    top = (d_bits[:, None].astype(np.uint16) >> np.array([0, 4, 8, 12], np.uint16)) & 15
    blocks[:, 48:56] = ((words & 0x0FFF) | (top << 12)).astype(np.uint16).view(np.uint8)


def _set_iq1_m_scales(blocks: np.ndarray, rng: np.random.Generator, std: float) -> np.ndarray:
    """IQ1_M has no f16 field of its own: d is spread over the scale words, set like the others' d."""
    jitter = np.asarray(rng.uniform(0.5, 1.5, size=len(blocks)), np.float16)  # [B]
    put_iq1_m_d(blocks, jitter.view(np.uint16))
    sample = dequantize(blocks[: min(len(blocks), 512)], QType.IQ1_M).astype(np.float64)
    factor = std / max(float(sample.std()), 1e-30)
    scaled = jitter.astype(np.float32) * np.float32(factor)  # [B]
    put_iq1_m_d(blocks, scaled.astype(np.float16).view(np.uint16))
    return blocks
