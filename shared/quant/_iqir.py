"""The i-quants' decoders for the int8 kernels (_q8ir's row, pack and tile kernels).

IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M store, per 256 weights, grid
indices (an index names 8 weights, or 4 on the IQ3 types), signs and small per-block
scales (docs/formats.md § Quant blocks). A decoder here turns one super-block into what
_q8ir's Layout asks of every type: four <64 x i8> u8 code vectors in element order and
the L block scales as one float vector; the kernels then run the same integer dots and
the same one float step per block as for Q4_K (_q8ir's module doc: the numerics contract,
batch-exact by construction).

    IQ2_*:   u = 64 ± g, g ∈ {8, 25, 43}         wsc = d·(2s + 1)/8     offset 64
    IQ3_XXS: u = 64 ± g, g ∈ {4, 12, .. 52, 62}  wsc = d·(2s + 1)/4     offset 64
    IQ3_S:   u = 16 ± g, g ∈ {1, 3, .. 15}       wsc = d·(2s + 1)       offset 16
    IQ1_*:   u = 16 + 8·g ± 1, g ∈ {-1, 0, 1}    wsc = d·(2s + 1)/8     offset 16

so u·wsc − offset·wsc is the weight gguf's dequantizer gives (IQ1's ±1/8 delta folded
into the codes as ±1 eighth), wsc is exact in float32 (11 bits of d times ≤ 5 bits), and
every code is below 128 (one sdot on aarch64). Blocks of 32 weights take one scale (L = 8)
except IQ2_XS, IQ2_S and IQ1_M, which scale each 16 (L = 16).

A grid entry is fetched by its index from the type's table (`TABLES`, the `tab` argument
of the kernels: the grid's values as bytes, 8·g on IQ1), one 8-byte (IQ3: 4-byte) load
per entry, 32 (IQ3: 64) a super-block; the signs come from sign bytes, or from 7-bit
sign indices whose eighth bit is their parity (`llvm.ctpop`), one bit per weight
expanded by a shuffle and a compare. Nothing here is target-specific: the VNNI, sdot and
portable builds share these decoders and differ only in _q8ir's dot.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from ._q8ir import _F32, _I16, _I32, _I64, QK, Layout, _Emit, _fvec, _splat, _vec
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
)

_IQ2_OFFSET = 64  # above the largest IQ2 (43) and IQ3_XXS (62) grid value
_IQ3_S_OFFSET = 16  # above IQ3_S's largest (15)
_IQ1_OFFSET = 16  # above |8·g ± 1| ≤ 9
_IQ1_LARGEST = 9  # |8·g ± 1|, g in {-1, 0, 1}: the codes are 16 ± it, so an i16 holds 5 pair sums (code_max)
assert max(int(IQ2_XXS_GRID.max()), int(IQ3_XXS_GRID.max())) < _IQ2_OFFSET and int(IQ3_S_GRID.max()) < _IQ3_S_OFFSET


def _table(grid: np.ndarray, times: int = 1) -> np.ndarray:
    """A grid [N, width] as the kernels read it: entry i's bytes at width·i (values as u8, two's complement)."""
    return np.ascontiguousarray((grid.astype(np.int16) * times).astype(np.int8).view(np.uint8).reshape(-1))


# type name → its grid table, the kernels' `tab` argument (_q8.KERNELS).
TABLES = {
    "IQ2_XXS": _table(IQ2_XXS_GRID),
    "IQ2_XS": _table(IQ2_XS_GRID),
    "IQ2_S": _table(IQ2_S_GRID),
    "IQ3_XXS": _table(IQ3_XXS_GRID),
    "IQ3_S": _table(IQ3_S_GRID),
    "IQ1_S": _table(IQ1_GRID, 8),
    "IQ1_M": _table(IQ1_GRID, 8),
}


def _lanes(e: _Emit, v, idx):
    """A shuffle of one vector by the list idx."""
    return e.shuf(v, None, list(idx))


def _shift_and(e: _Emit, v, shifts, mask):
    """(v >> shifts) & mask lane by lane (<n x i32>, shifts a list)."""
    n = v.type.count
    return e.b.and_(e.b.lshr(v, e.const(_vec(n, 32), shifts)), e.const(_vec(n, 32), mask))


def _u32s(e: _Emit, w, off, n, bits):
    """n little-endian u8/u16 fields from byte off as <n x i32>."""
    return e.b.zext(e.load(w, off, _vec(n, bits)), _vec(n, 32))


def _gather(e: _Emit, tab, idx, width: int):
    """<64 x i8>: the grid entries at lanes of idx (<n x i32>, n = 64/width) from tab, in order."""
    ty = _I64 if width == 8 else _I32
    n = 64 // width
    v = ir.Constant(ir.VectorType(ty, n), [0] * n)  # every lane is written: no undefined lanes to depend on
    for k in range(n):
        i = e.b.zext(e.b.extract_element(idx, ir.Constant(_I32, k)), _I64)
        v = e.b.insert_element(v, e.load(tab, e.b.mul(i, e.i64(width)), ty), ir.Constant(_I32, k))
    return e.b.bitcast(v, _vec(64))


def _sign_bytes(e: _Emit, s7):
    """<8 x i32> 7-bit sign indices → <8 x i32> sign bytes: the eighth bit is the seven's parity."""
    b = e.b
    pop = b.call(e.fn("llvm.ctpop.v8i32", _vec(8, 32), [_vec(8, 32)]), [s7])
    return b.or_(s7, b.shl(b.and_(pop, e.const(_vec(8, 32), 1)), e.const(_vec(8, 32), 7)))


def _signed(e: _Emit, g, signs, offset: int):
    """offset ± g (<64 x i8>) by 8 sign bytes (<8 x i32>; bit l of byte k: weight 8k + l negative)."""
    b = e.b
    bits = b.and_(_lanes(e, b.trunc(signs, _vec(8)), [k // 8 for k in range(64)]), e.const(_vec(64), [1 << (k % 8) for k in range(64)]))
    neg = b.icmp_unsigned("!=", bits, e.const(_vec(64), 0))
    return b.select(neg, b.sub(e.const(_vec(64), offset), g), b.add(e.const(_vec(64), offset), g))


def _scales(e: _Emit, s, d, times: float):
    """wsc = float(2s + 1)·(d·times) for <L x i32> s (exact: d·times is d shifted, 2s + 1 ≤ 31)."""
    b = e.b
    n = s.type.count
    odd = b.or_(b.shl(s, e.const(_vec(n, 32), 1)), e.const(_vec(n, 32), 1))
    return b.fmul(b.sitofp(odd, _fvec(n)), _splat(b, b.fmul(d, ir.Constant(_F32, times)), n))


def _nibbles16(e: _Emit, w, off, n_bytes):
    """The 2·n_bytes nibbles of the bytes at off (low, then high, per byte) as <2n x i32>: the per-16 scales."""
    v = _u32s(e, w, off, n_bytes, 8)
    return _shift_and(e, _lanes(e, v, [j // 2 for j in range(2 * n_bytes)]), [0, 4] * n_bytes, 15)


def _unit_iq2_xxs(e: _Emit, w, p, tab):
    """IQ2_XXS at p: d, then per 32 weights 4 index bytes and a u32 (4 sign indices of 7 bits, scale in bits 28..31)."""
    b = e.b
    d = e.half(w, p)
    q = e.load(w, b.add(p, e.i64(2)), _vec(16, 32))
    aux = _lanes(e, q, range(1, 16, 2))  # [8] the blocks' u32
    idx = b.zext(b.bitcast(q, _vec(64)), _vec(64, 32))  # byte k: an index where k mod 8 < 4
    codes = []
    for c in range(4):  # blocks 2c, 2c + 1
        g = _gather(e, tab, _lanes(e, idx, [8 * (2 * c + k // 4) + k % 4 for k in range(8)]), 8)
        s7 = _shift_and(e, _lanes(e, aux, [2 * c] * 4 + [2 * c + 1] * 4), [0, 7, 14, 21] * 2, 127)
        codes.append(_signed(e, g, _sign_bytes(e, s7), _IQ2_OFFSET))
    return codes, _scales(e, b.lshr(aux, e.const(_vec(8, 32), 28)), d, 0.125), None


def _unit_iq2_xs(e: _Emit, w, p, tab):
    """IQ2_XS at p: d, 32 u16 (9-bit index, 7-bit sign index) per 8 weights, 8 bytes of 4-bit scales per 16."""
    b = e.b
    d = e.half(w, p)
    q = _u32s(e, w, b.add(p, e.i64(2)), 32, 16)
    idx, s7 = b.and_(q, e.const(_vec(32, 32), 511)), b.lshr(q, e.const(_vec(32, 32), 9))
    codes = []
    for c in range(4):
        g = _gather(e, tab, _lanes(e, idx, range(8 * c, 8 * c + 8)), 8)
        codes.append(_signed(e, g, _sign_bytes(e, _lanes(e, s7, range(8 * c, 8 * c + 8))), _IQ2_OFFSET))
    return codes, _scales(e, _nibbles16(e, w, b.add(p, e.i64(66)), 8), d, 0.125), None


def _unit_iq2_s(e: _Emit, w, p, tab):
    """IQ2_S at p: d, 32 index bytes, 32 sign bytes, 8 bytes of 2 high index bits per 8 weights, 8 scale bytes."""
    b = e.b
    d = e.half(w, p)
    qh = _u32s(e, w, b.add(p, e.i64(66)), 8, 8)
    hi = b.shl(_shift_and(e, _lanes(e, qh, [g // 4 for g in range(32)]), [2 * (g % 4) for g in range(32)], 3), e.const(_vec(32, 32), 8))
    idx = b.or_(_u32s(e, w, b.add(p, e.i64(2)), 32, 8), hi)
    signs = _u32s(e, w, b.add(p, e.i64(34)), 32, 8)
    codes = []
    for c in range(4):
        g = _gather(e, tab, _lanes(e, idx, range(8 * c, 8 * c + 8)), 8)
        codes.append(_signed(e, g, _lanes(e, signs, range(8 * c, 8 * c + 8)), _IQ2_OFFSET))
    return codes, _scales(e, _nibbles16(e, w, b.add(p, e.i64(74)), 8), d, 0.125), None


def _unit_iq3_xxs(e: _Emit, w, p, tab):
    """IQ3_XXS at p: d, 64 index bytes (4 weights each), per 32 weights a u32 (4 sign indices, scale in bits 28..31)."""
    b = e.b
    d = e.half(w, p)
    idx = _u32s(e, w, b.add(p, e.i64(2)), 64, 8)
    aux = e.load(w, b.add(p, e.i64(66)), _vec(8, 32))
    codes = []
    for c in range(4):
        g = _gather(e, tab, _lanes(e, idx, range(16 * c, 16 * c + 16)), 4)
        s7 = _shift_and(e, _lanes(e, aux, [2 * c] * 4 + [2 * c + 1] * 4), [0, 7, 14, 21] * 2, 127)
        codes.append(_signed(e, g, _sign_bytes(e, s7), _IQ2_OFFSET))
    return codes, _scales(e, b.lshr(aux, e.const(_vec(8, 32), 28)), d, 0.25), None


def _unit_iq3_s(e: _Emit, w, p, tab):
    """IQ3_S at p: d, 64 index bytes, 8 bytes of high index bits (one per index), 32 sign bytes, 4 scale bytes."""
    b = e.b
    d = e.half(w, p)
    qs = _u32s(e, w, b.add(p, e.i64(2)), 64, 8)
    qh = _u32s(e, w, b.add(p, e.i64(66)), 8, 8)
    signs = _u32s(e, w, b.add(p, e.i64(74)), 32, 8)
    codes = []
    for c in range(4):  # indices 16c .. 16c + 15: high bits in qh bytes 2c, 2c + 1
        hi = _shift_and(e, _lanes(e, qh, [2 * c + k // 8 for k in range(16)]), [k % 8 for k in range(16)], 1)
        idx = b.or_(_lanes(e, qs, range(16 * c, 16 * c + 16)), b.shl(hi, e.const(_vec(16, 32), 8)))
        codes.append(_signed(e, _gather(e, tab, idx, 4), _lanes(e, signs, range(8 * c, 8 * c + 8)), _IQ3_S_OFFSET))
    s = _shift_and(e, _lanes(e, _u32s(e, w, b.add(p, e.i64(106)), 4, 8), [j // 2 for j in range(8)]), [0, 4] * 4, 15)
    return codes, _scales(e, s, d, 1.0), None


def _iq1_codes(e: _Emit, tab, idx, plus):
    """IQ1's four code vectors: 8·g from the table plus 16 ± 1 per group of 8 (<32 x i32> idx and plus)."""
    b = e.b
    codes = []
    for c in range(4):
        g = _gather(e, tab, _lanes(e, idx, range(8 * c, 8 * c + 8)), 8)
        codes.append(b.add(g, _lanes(e, b.trunc(plus, _vec(32)), [8 * c + k // 8 for k in range(64)])))
    return codes


def _plus(e: _Emit, negative):
    """<32 x i32>: 16 − 1 where the delta is negative, else 16 + 1."""
    b = e.b
    n = negative.type.count
    return b.select(negative, e.const(_vec(n, 32), _IQ1_OFFSET - 1), e.const(_vec(n, 32), _IQ1_OFFSET + 1))


def _unit_iq1_s(e: _Emit, w, p, tab):
    """IQ1_S at p: d, 32 index bytes, per 32 weights a u16 (3 high bits per index, scale in 12..14, delta sign in 15)."""
    b = e.b
    d = e.half(w, p)
    qh = _u32s(e, w, b.add(p, e.i64(34)), 8, 16)
    per = _lanes(e, qh, [g // 4 for g in range(32)])
    idx = b.or_(
        _u32s(e, w, b.add(p, e.i64(2)), 32, 8), b.shl(_shift_and(e, per, [3 * (g % 4) for g in range(32)], 7), e.const(_vec(32, 32), 8))
    )
    negative = b.icmp_unsigned("!=", _shift_and(e, per, [15] * 32, 1), e.const(_vec(32, 32), 0))
    return _iq1_codes(e, tab, idx, _plus(e, negative)), _scales(e, _shift_and(e, qh, [12] * 8, 7), d, 0.125), None


def _unit_iq1_m(e: _Emit, w, p, tab):
    """IQ1_M at p: 32 index bytes, 16 bytes of a nibble per 8 weights (3 high index bits, delta sign), 4 u16 of
    3-bit scales per 16 whose top nibbles are d."""
    b = e.b
    sw = _u32s(e, w, b.add(p, e.i64(48)), 4, 16)
    top = b.shl(b.lshr(sw, e.const(_vec(4, 32), 12)), e.const(_vec(4, 32), [0, 4, 8, 12]))
    bits = b.or_(
        b.or_(*(b.extract_element(top, ir.Constant(_I32, k)) for k in (0, 1))),
        b.or_(*(b.extract_element(top, ir.Constant(_I32, k)) for k in (2, 3))),
    )
    d = e.half_bits(b.trunc(bits, _I16))
    nib = _shift_and(e, _lanes(e, _u32s(e, w, b.add(p, e.i64(32)), 16, 8), [g // 2 for g in range(32)]), [0, 4] * 16, 15)
    idx = b.or_(_u32s(e, w, p, 32, 8), b.shl(b.and_(nib, e.const(_vec(32, 32), 7)), e.const(_vec(32, 32), 8)))
    negative = b.icmp_unsigned("!=", b.and_(nib, e.const(_vec(32, 32), 8)), e.const(_vec(32, 32), 0))
    s = _shift_and(e, _lanes(e, sw, [j // 4 for j in range(16)]), [3 * (j % 4) for j in range(16)], 7)
    return _iq1_codes(e, tab, idx, _plus(e, negative)), _scales(e, s, d, 0.125), None


IQ_LAYOUTS = {
    "IQ2_XXS": Layout(IQ2_XXS_BYTES, QK, _IQ2_OFFSET, False, True, 0, _unit_iq2_xxs),
    "IQ2_XS": Layout(IQ2_XS_BYTES, 16, _IQ2_OFFSET, False, True, 0, _unit_iq2_xs),
    "IQ2_S": Layout(IQ2_S_BYTES, 16, _IQ2_OFFSET, False, True, 0, _unit_iq2_s),
    "IQ3_XXS": Layout(IQ3_XXS_BYTES, QK, _IQ2_OFFSET, False, True, 0, _unit_iq3_xxs),
    "IQ3_S": Layout(IQ3_S_BYTES, QK, _IQ3_S_OFFSET, False, True, 0, _unit_iq3_s, _IQ3_S_OFFSET + int(IQ3_S_GRID.max())),
    "IQ1_S": Layout(IQ1_S_BYTES, QK, _IQ1_OFFSET, False, True, 0, _unit_iq1_s, _IQ1_OFFSET + _IQ1_LARGEST),
    "IQ1_M": Layout(IQ1_M_BYTES, 16, _IQ1_OFFSET, False, True, 0, _unit_iq1_m, _IQ1_OFFSET + _IQ1_LARGEST),
}
