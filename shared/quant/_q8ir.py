"""The LLVM IR of the int8-activation kernels (the drivers and the activation rounding: _q8).

Every call on these types computes, for weight row r and activation row t, the same float
operations in the same order, whatever else is in the call (batch-exact by construction):

    per block b of the row (32 weights, or 16 for Q6_K), in order:
        isum_b = Σ u·xq − offset·Σ xq                  (int32, exact)
        acc_{b mod L} = fma(float(isum_b), wsc_b·dx_b, acc_{b mod L})
        accm_{b mod 8} = fma(dmm_b, Σx̂_b, accm_{b mod 8})   (Q4_K, Q5_K: the mins)
    y = tree(acc) − tree(accm)

u are the weight's codes as u8 (a type's offset makes signed codes non-negative), wsc_b the
block's weight scale (d·scale: exact in float32 for every K-type), dx_b the activation's
int8 scale, L = 256 / block lanes, and tree the halving sum (lane j + lane j + L/2, ...).
Only the integer sums may be formed in any order; everything after them is fixed.

Two kernels compute it, one per layout of the work:

- row_kernel (decode, and a matrix's call of up to 8 activation rows, 1 or 4 a call): a weight
  row as it is stored. Per unit of 256 weights, four 64-byte dots (`vpdpbusd`: 16 lanes of
  sums of 4) against each activation row, a shuffle-add tree to the L block sums in one
  vector (block j in lane j), one L-lane multiply-add; the lanes are summed at the row's end.
  On AVX2 a unit takes one
  `vpmaddubsw` per 32 codes and a tree of its own, which adds in i16 before it widens where the
  codes are small (`_avx2_row_block_sums`).
- pack_kernel + tile_kernel (a GEMM: 9 or more rows, or an expert's 4 or more): 16 weight rows are
  repacked once per call so that one 64-byte vector holds 4 codes of each of the 16 rows
  (row r in lane r), a block's codes for all 16 rows in block/4 vectors; then every
  activation row takes block/4 dots against its 4 codes broadcast, one conversion, one
  multiply and one multiply-add per block for all 16 rows — about 12 instructions per 512
  multiply-adds, where the row layout needs about 6 per 64. The lane-j accumulators are
  separate vectors here, summed by the same tree.

Per type a decoder turns 256 weights of a row into four <64 x i8> code vectors in element
order and its block scales as one L-lane vector (LAYOUTS). Q4_K/Q5_K: nibble planes
interleaved by a lane shuffle (Q5_K or's in the fifth bit); Q6_K: nibbles | 2-bit planes <<
4, offset 32 per 16; IQ4_XS and MXFP4: code-book values through one `vpshufb`, offsets 128
and 12; Q8_0: q + 128; Q5_0: nibble | fifth bit, offset 16; the i-quants: grid entries by
index, signed (_iqir, whose IQ_LAYOUTS `layout` finds). The 32-block types' rows may end
in part of a unit: read in place where a whole unit lies inside the matrix, else (the last
row) copied to a zeroed stack buffer; either way the blocks past the row have their scales
masked to 0 and meet the activation's zero padding, so they leave every accumulator as it
was (_part_unit).

Where the CPU numba compiles for has AVX-512 VNNI (`INT8_DOT` = "vnni") the 64-byte dot is
the `llvm.x86.avx512.vpdpbusd.512` intrinsic and the code-book maps one `vpshufb`. On
aarch64 with the dot-product extension (FEAT_DotProd: HWCAP `asimddp`, LLVM `+dotprod`;
`INT8_DOT` = "sdot") it is four `llvm.aarch64.neon.sdot` on 16-byte quarters (i8·i8, sums
of 4 into 4 int32 lanes each): codes below 128 go in as they are; u8 codes ≥ 128 go in as
u xor 0x80 and 128·Σ4 xq (one more sdot against ones) is added back, so every build returns
the same integer sums. On x86 with AVX2 but not AVX-512 VNNI (`INT8_DOT` = "avx2") the dot
is `vpmaddubsw` (u8·i8 pairs into i16) and `vpmaddwd` against ones (i16 pairs into i32) per
32-byte half, which no sum here can saturate (`_Emit._maddubs64` says why), and the code
maps one `vpshufb` per half. Anywhere else (`INT8_DOT` = "portable", also forced by
NUMBA_CPU_NAME=generic) both are target-independent IR (products in int32, pairwise adds;
the code maps by arithmetic or selects): the same integer sums, only slower.

Nothing here carries fast-math flags: LLVM may not reorder the float steps, so the two
kernels agree bit for bit (tests/test_quant.py). numba's disk cache stamps the drivers with
every kernel source, this module included (_jitcache.py), so an edit here recompiles them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

from ._target import ARM as _ARM
from .blocks import (
    E2M1_TWICE,
    IQ4_NL_VALUES,
    IQ4_XS_BYTES,
    MXFP4_BYTES,
    NVFP4_BYTES,
    Q4_K_BYTES,
    Q5_0_BYTES,
    Q5_K_BYTES,
    Q6_K_BYTES,
    Q8_0_BYTES,
    QK,
    QK_K,
)

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_HALF = ir.HalfType()
# An activation element index → its QK-block (>> _LOG2_QK) or half-block (>> _LOG2_QK - 1).
_LOG2_QK = QK.bit_length() - 1
assert 1 << _LOG2_QK == QK


def _target_features() -> str:
    """The LLVM feature string numba compiles for, as its codegen computes it.

    NUMBA_CPU_FEATURES when set (NUMBA_CPU_NAME=generic sets it to ""), else
    the host's features (minus AVX when NUMBA_ENABLE_AVX=0). The CPU name
    alone does not decide: numba pairs any name with the host's features.
    """
    feats = vars(numba.config)["CPU_FEATURES"]  # set at run time from the environment
    return feats if feats is not None else get_host_cpu_features()


# Fixed at import, so one process never mixes the two builds; numba's disk
# cache keys each kernel on the target name and features, so a process with
# another target compiles (or loads) its own build. VNNI: vpdpbusd on 512-bit
# vectors; F16C: f16 → float32 in one instruction (every AVX-512 CPU has it).
_FEATURES = set(_target_features().split(","))
_VNNI = {"+avx512vnni", "+avx512bw"} <= _FEATURES
_SDOT = _ARM and "+dotprod" in _FEATURES
# AVX2 without VNNI (Zen 2/3, Haswell to Comet Lake): vpmaddubsw + vpmaddwd on 32-byte halves.
_AVX2 = not _VNNI and not _ARM and "+avx2" in _FEATURES
_F16C = "+f16c" in _FEATURES
# 32 registers of 512 bits: the tiles that keep 16 vectors of 16 float lanes in registers (attention's
# score and value tiles) size themselves by it.
WIDE_VECTORS = "+avx512f" in _FEATURES
INT8_DOT = "vnni" if _VNNI else "avx2" if _AVX2 else "sdot" if _SDOT else "portable"


def _vec(n, bits=8):
    return ir.VectorType(ir.IntType(bits), n)


def _fvec(n):
    return ir.VectorType(_F32, n)


def _splat(builder, v, n):
    t = ir.VectorType(v.type, n)
    s = builder.insert_element(ir.Constant(t, None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(s, ir.Constant(t, None), ir.Constant(_vec(n, 32), [0] * n))


def _nibbles32(builder, q16):
    """16 bytes in nibble order → 32 u8 lanes: low nibbles, then high nibbles."""
    lo = builder.and_(q16, ir.Constant(_vec(16), [15] * 16))
    hi = builder.lshr(q16, ir.Constant(_vec(16), [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(_vec(32, 32), list(range(32))))


# E2M1 code → 2·value + 12 ≥ 0, so the codes fit u8 lanes for the u8·i8 dot
# (12 = 2·6, the largest magnitude; the kernels subtract 12·Σ xq again).
_FP4_OFFSET = 2 * 6
assert E2M1_TWICE[-1] == _FP4_OFFSET
# The same as a 16-entry table (code 8..15: the negatives), for vpshufb.
_FP4_U = [_FP4_OFFSET + v for v in E2M1_TWICE] + [_FP4_OFFSET - v for v in E2M1_TWICE]


def _fp4_u_arith(builder, n):
    """<k x i8> E2M1 codes (0..15) → 2·value + 12, by arithmetic (any k, any target).

    The magnitude code m = n & 7 maps to E2M1_TWICE[m]: m itself for m < 4,
    else (2 | m&1) << (m>>1 − 1) (4 6 8 12); bit 3 is the sign.
    """
    k = n.type.count
    c = lambda v: ir.Constant(_vec(k), [v] * k)  # noqa: E731
    m = builder.and_(n, c(7))
    big = builder.shl(builder.or_(builder.and_(m, c(1)), c(2)), builder.and_(builder.sub(builder.lshr(m, c(1)), c(1)), c(3)))
    mag = builder.select(builder.icmp_unsigned("<", m, c(4)), m, big)
    neg = builder.icmp_unsigned("!=", builder.and_(n, c(8)), c(0))
    return builder.select(neg, builder.sub(c(_FP4_OFFSET), mag), builder.add(c(_FP4_OFFSET), mag))


class _Emit:
    """Small vector-IR vocabulary over one llvmlite builder."""

    def __init__(self, context, builder):
        self.b = builder
        self.mod = builder.module
        self.context = context

    def data(self, aty, arr):
        return self.context.make_array(aty)(self.context, self.b, arr).data

    def nitems(self, aty, arr):
        """An array argument's element count (i64)."""
        return self.context.make_array(aty)(self.context, self.b, arr).nitems

    def load(self, base, off, ty):
        """ty loaded from element `off` of pointer `base` (unaligned)."""
        return self.b.load(self.b.bitcast(self.b.gep(base, [off]), ty.as_pointer()), align=1)

    def i64(self, v):
        return ir.Constant(_I64, v)

    def const(self, ty, vals):
        return ir.Constant(ty, vals if isinstance(vals, list) else [vals] * ty.count)

    def shuf(self, a, b, idx):
        return self.b.shuffle_vector(a, b if b is not None else ir.Constant(a.type, None), ir.Constant(_vec(len(idx), 32), idx))

    def half(self, base, off):
        """The f16 at byte `off` of i8 pointer `base`, as float (exact)."""
        return self.half_bits(self.load(base, off, _I16))

    def half_bits(self, h):
        """An i16 holding f16 bits, as float (exact)."""
        if _F16C:
            return self.b.fpext(self.b.bitcast(h, _HALF), _F32)
        # Without F16C, LLVM lowers fpext half to a call of __extendhfsf2, a
        # compiler-rt function numba's JIT cannot link ("Symbol not found").
        # Instead, as _float's F16 decoder: exponent and mantissa moved into
        # float32 position, times 2^112 to rebase the exponent (f16 subnormals
        # become float32 normals exactly); all-ones exponent → inf/NaN.
        b, x = self.b, self.b.zext(h, _I32)
        bits = b.or_(
            b.shl(b.and_(x, ir.Constant(_I32, 0x7FFF)), ir.Constant(_I32, 13)),
            b.shl(b.and_(x, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 16)),
        )
        special = b.icmp_unsigned("==", b.and_(x, ir.Constant(_I32, 0x7C00)), ir.Constant(_I32, 0x7C00))
        bits = b.select(special, b.or_(bits, ir.Constant(_I32, 0x7F800000)), bits)
        return b.fmul(b.bitcast(bits, _F32), ir.Constant(_F32, 2.0**112))

    def fn(self, name, ret, args):
        return cgutils.get_or_insert_function(self.mod, ir.FunctionType(ret, args), name)

    def prefetch(self, ptr, at, nbytes: int):
        """Ask for the nbytes at byte `at` of ptr into L1 (a hint: no fault past an array's end)."""
        f = self.fn("llvm.prefetch.p0i8", ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
        for line in range(0, nbytes, 64):
            self.b.call(
                f, [self.b.gep(ptr, [self.b.add(at, self.i64(line))]), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)]
            )

    def fma(self, a, b, c):
        n = a.type.count
        return self.b.call(self.fn(f"llvm.fma.v{n}f32", _fvec(n), [_fvec(n)] * 3), [a, b, c])

    def dp(self, acc, u, x, below128: bool = False):
        """acc + <16 x i32>: lane i = Σ_{k<4} zext(u[4i+k])·sext(x[4i+k]) for 64 u8 (u) / i8 (x) lanes.
        `below128`: every u is < 128 (so it is also its own i8: one sdot on aarch64)."""
        if _VNNI:
            f = self.fn("llvm.x86.avx512.vpdpbusd.512", _vec(16, 32), [_vec(16, 32)] * 3)
            return self.b.call(f, [acc, self.b.bitcast(u, _vec(16, 32)), self.b.bitcast(x, _vec(16, 32))])
        if _SDOT:
            return self.b.add(acc, self._sdot64(u, x, below128))
        if _AVX2:
            return self.b.add(acc, self._maddubs64(u, x, below128))
        p = self.b.mul(self.b.zext(u, _vec(64, 32)), self.b.sext(x, _vec(64, 32)))
        p = self.b.add(self.shuf(p, None, list(range(0, 64, 2))), self.shuf(p, None, list(range(1, 64, 2))))
        return self.b.add(acc, self.b.add(self.shuf(p, None, list(range(0, 32, 2))), self.shuf(p, None, list(range(1, 32, 2)))))

    def _sdot64(self, u, x, below128: bool):
        """dp on aarch64: four sdot (i8·i8 → 4 x i32, sums of 4) on 16-byte quarters."""
        f = self.fn("llvm.aarch64.neon.sdot.v4i32.v16i8", _vec(4, 32), [_vec(4, 32), _vec(16), _vec(16)])
        z4 = ir.Constant(_vec(4, 32), [0] * 4)
        quarters = []
        for k in range(4):
            uk, xk = self.shuf(u, None, list(range(16 * k, 16 * k + 16))), self.shuf(x, None, list(range(16 * k, 16 * k + 16)))
            if below128:
                quarters.append(self.b.call(f, [z4, uk, xk]))
                continue
            # u = (u xor 0x80 as i8) + 128 for every u8: Σ u·x = sdot(u ^ 0x80, x) + 128·Σ x
            d = self.b.call(f, [z4, self.b.xor(uk, self.const(_vec(16), 0x80)), xk])
            s = self.b.call(f, [z4, self.const(_vec(16), 1), xk])
            quarters.append(self.b.add(d, self.b.shl(s, self.const(_vec(4, 32), 7))))
        lo = self.shuf(quarters[0], quarters[1], list(range(8)))
        hi = self.shuf(quarters[2], quarters[3], list(range(8)))
        return self.shuf(lo, hi, list(range(16)))

    def half32(self, v, h: int):
        """Bytes 32h .. 32h + 31 of a <64 x i8> (an AVX2 register's worth)."""
        return self.shuf(v, None, list(range(32 * h, 32 * h + 32)))

    def maddubs(self, u, x):
        """vpmaddubsw: <32 x i8> u8 u against i8 x, adjacent products summed into <16 x i16>."""
        return self.b.call(self.fn("llvm.x86.avx2.pmadd.ub.sw", _vec(16, 16), [_vec(32), _vec(32)]), [u, x])

    def widen_pairs(self, s16):
        """vpmaddwd against ones: adjacent i16 lanes summed into <8 x i32>."""
        f = self.fn("llvm.x86.avx2.pmadd.wd", _vec(8, 32), [_vec(16, 16), _vec(16, 16)])
        return self.b.call(f, [s16, self.const(_vec(16, 16), 1)])

    def abs8(self, q):
        """vpabsb: |q| of <32 x i8> lanes, as u8 (|−128| is 128)."""
        return self.b.call(self.fn("llvm.abs.v32i8", _vec(32), [_vec(32), ir.IntType(1)]), [q, ir.Constant(ir.IntType(1), 0)])

    def sign8(self, x, q):
        """vpsignb: x · sign(q) per <32 x i8> lane (0 where q is 0)."""
        return self.b.call(self.fn("llvm.x86.avx2.psign.b", _vec(32), [_vec(32), _vec(32)]), [x, q])

    def _maddubs64(self, u, x, below128: bool):
        """dp on AVX2: per 32-byte half, vpmaddubsw (u8·i8, adjacent pairs summed into i16) then
        vpmaddwd against ones (adjacent i16 pairs into i32): lane i = Σ of 4, as vpdpbusd. No i16
        sum saturates: a pair is at most 2·127·128 in magnitude when u < 128 and x > −128 (the
        activation's codes are in [−127, 127]). Codes ≥ 128 go in as q = u − 128 (u xor 0x80 as
        i8): |q| against x·sign(q) (vpsignb), and 128·Σ4 x (ones against x) is added back."""
        halves = []
        for k in range(2):
            uk, xk = self.half32(u, k), self.half32(x, k)
            if below128:
                halves.append(self.widen_pairs(self.maddubs(uk, xk)))
                continue
            q = self.b.xor(uk, self.const(_vec(32), 0x80))
            d = self.widen_pairs(self.maddubs(self.abs8(q), self.sign8(xk, q)))
            s = self.widen_pairs(self.maddubs(self.const(_vec(32), 1), xk))
            halves.append(self.b.add(d, self.b.shl(s, self.const(_vec(8, 32), 7))))
        return self.shuf(halves[0], halves[1], list(range(16)))

    def pshufb64(self, table: list[int], n):
        """<64 x i8> indices (0..15) → table[n] by vpshufb (a 16-entry table per 128-bit lane), or
        None where the target has no such instruction."""
        if _VNNI:
            f = self.fn("llvm.x86.avx512.pshuf.b.512", _vec(64), [_vec(64), _vec(64)])
            return self.b.call(f, [self.const(_vec(64), table * 4), n])
        if _AVX2:
            f = self.fn("llvm.x86.avx2.pshuf.b", _vec(32), [_vec(32), _vec(32)])
            lo, hi = (self.b.call(f, [self.const(_vec(32), table * 2), self.half32(n, k)]) for k in range(2))
            return self.shuf(lo, hi, list(range(64)))
        return None

    def hsum(self, v):
        """Σ lanes of a float vector as the fixed halving tree (lane j + lane j + n/2, ...): `tree`'s order."""
        n = v.type.count
        while n > 1:
            n //= 2
            v = self.b.fadd(self.shuf(v, None, list(range(n))), self.shuf(v, None, list(range(n, 2 * n))))
        return self.b.extract_element(v, ir.Constant(_I32, 0))

    def tree(self, vs):
        """Σ of float vectors v_0 .. v_{L-1} lane by lane in hsum's order: v_j + v_{j+L/2}, halving."""
        while len(vs) > 1:
            n = len(vs) // 2
            vs = [self.b.fadd(vs[j], vs[j + n]) for j in range(n)]
        return vs[0]

    def splat_i32(self, v):
        """An i32 repeated in 16 lanes, as 64 i8 lanes (4 activation codes for every row of a tile)."""
        return self.b.bitcast(_splat(self.b, v, 16), _vec(64))


# ---- the layouts: a unit is 256 weights of one row ----------------------------------
# A type's decoder turns one unit of a weight row into its codes, as four
# <64 x i8> u8 vectors in element order (the activation's), and its per-block
# scale factors as one float vector of L = 256 / block lanes (block j of the
# unit in lane j): wsc (the weight's scale, d·scale) and, for Q4_K/Q5_K, dmm
# (dmin·min). The integer offset of the codes (Q8_0's q + 128, Q6_K's 32, ...)
# is subtracted per block in exact int32: isum = Σ u·xq − offset·Σ xq.

UNIT = QK_K  # weights of a row decoded together
CODE_VECTORS = UNIT // 64
# Bytes of one unit of a 16-row tile, repacked (pack_kernel): 16 × 256 codes, then 16 scale
# vectors (L wsc, and 8 dmm after 8 wsc; every type takes the same room).
PACKED_UNIT = 16 * UNIT + 16 * 64


@dataclass(frozen=True)
class Layout:
    unit_bytes: int  # bytes of one unit of a row
    block: int  # weights per scale: 32, or 16 (Q6_K)
    offset: int  # the codes' integer offset (isum = Σ u·xq − offset·Σ xq per block)
    mins: bool  # a second per-block term, dmm·Σ x̂ (Q4_K, Q5_K)
    below128: bool  # every code < 128 (one sdot on aarch64)
    block_bytes: int  # > 0: the row is whole 32-blocks of this many bytes and may end in a part unit; 0: whole super-blocks
    decode: Callable  # (e, src, p, tab) → (codes, wsc, dmm | None)
    code_max: int = 255  # the largest code u: how many u8·i8 pair sums an i16 holds (_avx2_isums)

    @property
    def lanes(self) -> int:
        return UNIT // self.block


def _k_header(e: _Emit, w, p):
    """Q4_K/Q5_K: d, dmin and the 8 six-bit scales and mins (12 bytes at p+4, as <8 x i32>) of
    the super-block at p. d and dmin convert from one 16-byte load (a 2-byte load is an insert
    into a register LLVM picks, a false dependency — once an accumulator's, which serialised the
    row loop). The scales and mins are unpacked four at a time in 32-bit scalar words, whose
    ports the vector work leaves idle: scale j < 4 is the low 6 bits of byte j, scale j ≥ 4 the
    low nibble of byte j + 4 under the top 2 bits of byte j − 4 (the mins: bytes 4..7, and the
    high nibbles of bytes 8..11)."""
    b = e.b
    head = e.load(w, p, _vec(16))
    dd = e.shuf(b.bitcast(head, _vec(8, 16)), None, [0, 1])
    if _F16C:
        dd = b.fpext(b.bitcast(dd, ir.VectorType(_HALF, 2)), _fvec(2))
        d, dmin = (b.extract_element(dd, ir.Constant(_I32, k)) for k in range(2))
    else:
        d, dmin = e.half(w, p), e.half(w, b.add(p, e.i64(2)))
    word = [e.load(w, b.add(p, e.i64(4 + 4 * k)), _I32) for k in range(3)]
    c = lambda v: ir.Constant(_I32, v)  # noqa: E731
    low6, low4, top2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)

    def bytes8(lo, hi):
        """Two words of 4 bytes each → <8 x i32>, lo's bytes first."""
        q = b.or_(b.zext(lo, _I64), b.shl(b.zext(hi, _I64), ir.Constant(_I64, 32)))
        return b.zext(b.bitcast(q, _vec(8)), _vec(8, 32))

    def with_top2(nibbles, src):
        return b.or_(nibbles, b.shl(b.and_(b.lshr(src, c(6)), top2), c(4)))

    sc = bytes8(b.and_(word[0], low6), with_top2(b.and_(word[2], low4), word[0]))
    m = bytes8(b.and_(word[1], low6), with_top2(b.and_(b.lshr(word[2], c(4)), low4), word[1]))
    return d, dmin, sc, m


def _unit_q45_k(e: _Emit, w, p, *, codes_at, fifth_bit_at):
    """Q4_K/Q5_K super-block at p: d, dmin, 12 bytes of scales and mins at 4, the nibbles at
    `codes_at` (byte l of 32-byte chunk c: element 64c + l low, 64c + 32 + l high), Q5_K's
    fifth bits at `fifth_bit_at` (element 64c + l: bit 2c of qh[l]; 64c + 32 + l: bit 2c + 1)."""
    b = e.b
    d, dmin, sc, m = _k_header(e, w, p)
    wsc = b.fmul(b.sitofp(sc, _fvec(8)), _splat(b, d, 8))  # exact: 11 × 6 bits
    dmm = b.fmul(b.sitofp(m, _fvec(8)), _splat(b, dmin, 8))
    codes = []
    for half in range(2):
        q = e.load(w, b.add(p, e.i64(codes_at + 64 * half)), _vec(64))
        lo, hi = b.and_(q, e.const(_vec(64), 15)), b.lshr(q, e.const(_vec(64), 4))
        codes += [e.shuf(lo, hi, list(range(32 * k, 32 * k + 32)) + list(range(64 + 32 * k, 96 + 32 * k))) for k in range(2)]
    if fifth_bit_at is not None:
        qh = e.load(w, b.add(p, e.i64(fifth_bit_at)), _vec(32))
        one = e.const(_vec(32), 1)
        for c in range(4):
            bits = [b.and_(b.lshr(qh, e.const(_vec(32), 2 * c + k)), one) for k in range(2)]
            codes[c] = b.or_(codes[c], b.shl(e.shuf(bits[0], bits[1], list(range(64))), e.const(_vec(64), 4)))
    return codes, wsc, dmm


def _unit_q6_k(e: _Emit, w, p, tab):
    """Q6_K super-block at p: ql (128 B), qh (64 B), 16 int8 scales at 192, d at 208; codes 0..63, offset 32."""
    b = e.b
    v64 = _vec(64)
    d = e.half(w, b.add(p, e.i64(208)))
    wsc = b.fmul(b.sitofp(e.load(w, b.add(p, e.i64(192)), _vec(16)), _fvec(16)), _splat(b, d, 16))  # exact: 11 × 8 bits
    codes = []  # elements 64c .. 64c+64, c = 2h + k: planes 2k, 2k+1 of half h
    for h in range(2):
        ql = e.load(w, b.add(p, e.i64(64 * h)), v64)
        qh = e.load(w, b.add(p, e.i64(128 + 32 * h)), _vec(32))
        sh = lambda n, qh=qh: b.lshr(qh, e.const(_vec(32), n))  # noqa: E731
        hb = (e.shuf(qh, sh(2), list(range(64))), e.shuf(sh(4), sh(6), list(range(64))))
        lo4 = (b.and_(ql, e.const(v64, 15)), b.lshr(ql, e.const(v64, 4)))
        codes += [b.or_(lo4[k], b.shl(b.and_(hb[k], e.const(v64, 3)), e.const(v64, 4))) for k in range(2)]
    return codes, wsc, None


# IQ4_XS code → its code-book value + 128 ≥ 1 (u8 lanes for the u8·i8 dot).
_IQ4_OFFSET = 128
_IQ4_U = [_IQ4_OFFSET + v for v in IQ4_NL_VALUES]


def _iq4_u(e: _Emit, n):
    """<64 x i8> codes (0..15) → code-book value + 128 (u8)."""
    looked = e.pshufb64(_IQ4_U, n)
    if looked is not None:
        return looked
    out = e.const(_vec(64), _IQ4_U[0])  # any target: one select per code value
    for code in range(1, 16):
        out = e.b.select(e.b.icmp_unsigned("==", n, e.const(_vec(64), code)), e.const(_vec(64), _IQ4_U[code]), out)
    return out


# Two 64-byte nibble vectors (4 blocks of 16 bytes: low nibbles elements 0..15, high 16..31) → element order.
_NIBBLE_BLOCKS = (
    list(range(16)) + list(range(64, 80)) + list(range(16, 32)) + list(range(80, 96)),
    list(range(32, 48)) + list(range(96, 112)) + list(range(48, 64)) + list(range(112, 128)),
)


def _unit_iq4_xs(e: _Emit, w, p, tab):
    """IQ4_XS super-block at p: d, 2 bytes of scale high bits, 4 of low nibbles, then 16 nibble
    bytes per 32-block; scale of block j: d·(ls_j − 32)."""
    b = e.b
    v8 = _vec(8, 32)
    d = e.half(w, p)
    low = b.zext(e.load(w, b.add(p, e.i64(4)), _vec(4)), _vec(4, 32))
    low = b.and_(b.lshr(e.shuf(low, None, [0, 0, 1, 1, 2, 2, 3, 3]), e.const(v8, [0, 4] * 4)), e.const(v8, 15))
    high = b.lshr(_splat(b, b.zext(e.load(w, b.add(p, e.i64(2)), _I16), _I32), 8), e.const(v8, list(range(0, 16, 2))))
    ls = b.or_(low, b.shl(b.and_(high, e.const(v8, 3)), e.const(v8, 4)))
    wsc = b.fmul(b.sitofp(b.sub(ls, e.const(v8, 32)), _fvec(8)), _splat(b, d, 8))  # exact: 11 × 6 bits
    codes = []
    for g in range(2):
        q = e.load(w, b.add(p, e.i64(8 + 64 * g)), _vec(64))
        lo, hi = _iq4_u(e, b.and_(q, e.const(_vec(64), 15))), _iq4_u(e, b.lshr(q, e.const(_vec(64), 4)))
        codes += [e.shuf(lo, hi, idx) for idx in _NIBBLE_BLOCKS]
    return codes, wsc, None


def _gather8(e: _Emit, scale, p, size):
    """<8 x float>: scale(byte offset of block k) for the 8 blocks of a unit at p."""
    v = ir.Constant(_fvec(8), None)
    for k in range(8):
        v = e.b.insert_element(v, scale(e.b.add(p, e.i64(size * k))), ir.Constant(_I32, k))
    return v


def _gather8_halves(e: _Emit, w, p, size):
    """<8 x float>: the f16 at the start of each of the 8 blocks of a unit at p (Q8_0's and Q5_0's
    d). With F16C the 8 halves are gathered as integers and converted in one instruction."""
    if not _F16C:
        return _gather8(e, lambda o: e.half(w, o), p, size)
    v = ir.Constant(_vec(8, 16), None)
    for k in range(8):
        v = e.b.insert_element(v, e.load(w, e.b.add(p, e.i64(size * k)), _I16), ir.Constant(_I32, k))
    return e.b.fpext(e.b.bitcast(v, ir.VectorType(_HALF, 8)), _fvec(8))


def _unit_q8_0(e: _Emit, w, p, tab):
    """8 Q8_0 blocks at p (d, 32 int8): codes q + 128 (offset 128), scale d."""
    b = e.b
    q = [e.load(w, b.add(p, e.i64(Q8_0_BYTES * k + 2)), _vec(32)) for k in range(8)]
    codes = [b.xor(e.shuf(q[2 * c], q[2 * c + 1], list(range(64))), e.const(_vec(64), 0x80)) for c in range(4)]
    return codes, _gather8_halves(e, w, p, Q8_0_BYTES), None


def _fp4_u(e: _Emit, n):
    """<64 x i8> E2M1 codes (0..15) → 2·value + 12 (u8)."""
    looked = e.pshufb64(_FP4_U, n)
    return looked if looked is not None else _fp4_u_arith(e.b, n)


def _unit_mxfp4(e: _Emit, w, p, half):
    """8 MXFP4 blocks at p (E8M0 byte, 16 nibble bytes): codes 2·value + 12 (offset 12), scale E8M0_HALF[e]."""
    b = e.b
    q = [e.load(w, b.add(p, e.i64(MXFP4_BYTES * k + 1)), _vec(16)) for k in range(8)]
    codes = []
    for g in range(2):  # blocks 4g .. 4g+3
        n = e.shuf(e.shuf(q[4 * g], q[4 * g + 1], list(range(32))), e.shuf(q[4 * g + 2], q[4 * g + 3], list(range(32))), list(range(64)))
        lo, hi = _fp4_u(e, b.and_(n, e.const(_vec(64), 15))), _fp4_u(e, b.lshr(n, e.const(_vec(64), 4)))
        codes += [e.shuf(lo, hi, idx) for idx in _NIBBLE_BLOCKS]
    return codes, _gather8(e, lambda o: b.load(b.gep(half, [b.zext(e.load(w, o, _I8), _I64)])), p, MXFP4_BYTES), None


# NVFP4 block k's 64 codes in element order from its 32 nibble bytes' low (lanes 0-31) and high
# (32-63) nibbles: sub-block s is bytes 8s..8s+7's low nibbles, then their high ones.
_NV_ORDER = [j for s in range(4) for j in (*range(8 * s, 8 * s + 8), *range(32 + 8 * s, 32 + 8 * s + 8))]


def _unit_nvfp4(e: _Emit, w, p, half):
    """4 NVFP4 blocks at p (4 UE4M3 scale bytes, 32 nibble bytes each): codes 2·value + 12
    (offset 12), one scale UE4M3_HALF[s] per 16 weights."""
    b = e.b
    codes = []
    for k in range(4):
        q = e.load(w, b.add(p, e.i64(NVFP4_BYTES * k + 4)), _vec(32))
        n = e.shuf(b.and_(q, e.const(_vec(32), 15)), b.lshr(q, e.const(_vec(32), 4)), _NV_ORDER)
        codes.append(_fp4_u(e, n))
    wsc = ir.Constant(_fvec(16), None)
    for j in range(16):
        s = e.load(w, b.add(p, e.i64(NVFP4_BYTES * (j // 4) + j % 4)), _I8)
        wsc = b.insert_element(wsc, b.load(b.gep(half, [b.zext(s, _I64)])), ir.Constant(_I32, j))
    return codes, wsc, None


def _unit_q5_0(e: _Emit, w, p, tab):
    """8 Q5_0 blocks at p (d, 4 bytes of fifth bits, 16 nibble bytes): codes 0..31 (offset 16), scale d."""
    b = e.b
    per = []
    # Element j's fifth bit is bit j of the block's 32: byte j // 8 of them spread to lane j,
    # tested against 1 << j % 8 (a byte shuffle, an and and a compare, where a shift a lane
    # would widen to 32 bits and narrow back).
    bit = e.const(_vec(32), [1 << (j % 8) for j in range(32)])
    for k in range(8):
        o = b.add(p, e.i64(Q5_0_BYTES * k))
        nib = _nibbles32(b, e.load(w, b.add(o, e.i64(6)), _vec(16)))
        spread = e.shuf(e.load(w, b.add(o, e.i64(2)), _vec(4)), None, [j // 8 for j in range(32)])
        fifth = b.select(b.icmp_unsigned("==", b.and_(spread, bit), bit), e.const(_vec(32), 16), e.const(_vec(32), 0))
        per.append(b.or_(nib, fifth))
    codes = [e.shuf(per[2 * c], per[2 * c + 1], list(range(64))) for c in range(4)]
    return codes, _gather8_halves(e, w, p, Q5_0_BYTES), None


LAYOUTS = {
    "Q8_0": Layout(8 * Q8_0_BYTES, QK, 128, False, False, Q8_0_BYTES, _unit_q8_0),
    "Q5_0": Layout(8 * Q5_0_BYTES, QK, 16, False, True, Q5_0_BYTES, _unit_q5_0, 31),
    "MXFP4": Layout(8 * MXFP4_BYTES, QK, _FP4_OFFSET, False, True, MXFP4_BYTES, _unit_mxfp4, 2 * _FP4_OFFSET),
    "NVFP4": Layout(4 * NVFP4_BYTES, 16, _FP4_OFFSET, False, True, 0, _unit_nvfp4, 2 * _FP4_OFFSET),
    "Q4_K": Layout(Q4_K_BYTES, QK, 0, True, True, 0, lambda e, w, p, tab: _unit_q45_k(e, w, p, codes_at=16, fifth_bit_at=None), 15),
    "Q5_K": Layout(Q5_K_BYTES, QK, 0, True, True, 0, lambda e, w, p, tab: _unit_q45_k(e, w, p, codes_at=48, fifth_bit_at=16), 31),
    "Q6_K": Layout(Q6_K_BYTES, 16, 32, False, True, 0, _unit_q6_k, 63),
    "IQ4_XS": Layout(IQ4_XS_BYTES, QK, _IQ4_OFFSET, False, False, 0, _unit_iq4_xs),
}


def layout(name: str) -> Layout:
    """The Layout of a type: LAYOUTS above, or the i-quants' (_iqir, which builds on this module)."""
    if name in LAYOUTS:
        return LAYOUTS[name]
    from ._iqir import IQ_LAYOUTS

    return IQ_LAYOUTS[name]


# ---- the shared steps --------------------------------------------------------


def _block_sums(e: _Emit, vs, per):
    """The four dot vectors of a unit (16 lanes each: 16/per blocks × `per` partial sums, the
    unit's blocks in order across the vectors) → one <L x i32> of its block sums, block j in
    lane j (integer adds: exact in any order).

    Interleaves within 128-bit lanes first (unpack patterns: cheap) until lane 4k + c holds
    vector c's sum over its 128-bit lane k; then one or two lane permutes to block order.
    """
    b = e.b
    assert len(vs) == 4 and per in (4, 8)

    def fold(x, y, lo, hi):
        return b.add(e.shuf(x, y, [i for k in range(4) for i in lo(4 * k)]), e.shuf(x, y, [i for k in range(4) for i in hi(4 * k)]))

    a0, a1 = (fold(vs[c], vs[c + 1], lambda o: (o, 16 + o, o + 1, 17 + o), lambda o: (o + 2, 18 + o, o + 3, 19 + o)) for c in (0, 2))
    s = fold(a0, a1, lambda o: (o, o + 1, 16 + o, 17 + o), lambda o: (o + 2, o + 3, 18 + o, 19 + o))
    if per == 4:  # block 4c + k is vector c's 128-bit lane k
        return e.shuf(s, None, [4 * (j % 4) + j // 4 for j in range(16)])
    # block 2c is vector c's 128-bit lanes 0 and 1, block 2c + 1 its lanes 2 and 3
    return b.add(e.shuf(s, None, [8 * (j % 2) + j // 2 for j in range(8)]), e.shuf(s, None, [8 * (j % 2) + 4 + j // 2 for j in range(8)]))


# A row's units ask for the bytes this far ahead of the one they read (`llvm.prefetch`, to L1):
# the core's own prefetchers keep too few lines in flight while a unit's dots compute, so a
# matrix larger than the caches came in at the rate of compute and DRAM one after the other.
# The 201,088 × 2,880 Q8_0 head (615 MB) by two threads of the row kernel: 30 → 42-47 GB/s,
# a plain read 46 (Zen 5, 2026-12-06; 512 bytes ahead 39, 1,024 42, 2,048 44); gpt-oss's
# 4-layer cut, two thirds of whose step is that head, 31 → 43 tok/s. No number changes.
PREFETCH_BYTES = 4096


def _units(e: _Emit, lay: Layout, nb, body, w_len):
    """Call body(src, p, u, valid) for each unit of a row of nb 32-blocks (src the row's pointer,
    or, for the last part unit of a 32-block type in a matrix's last row, a zero-padded copy; p
    a byte offset, u the unit index; valid None, or the part unit's blocks: _part_unit).

    Either way the missing blocks have zero scales (and codes whose integer sums with the
    activation's zero padding are 0), so they leave every accumulator as it was.
    """
    b = e.b

    def run(w, o):
        with cgutils.for_range(b, b.lshr(nb, e.i64(3))) as loop:
            p = b.add(o, b.mul(loop.index, e.i64(lay.unit_bytes)))
            e.prefetch(w, b.add(p, e.i64(PREFETCH_BYTES)), lay.unit_bytes)
            body(w, p, loop.index, None)
        if lay.block_bytes:
            with b.if_then(b.icmp_unsigned("!=", b.and_(nb, e.i64(7)), e.i64(0)), likely=False):
                _part_unit(e, lay, nb, w, o, body, w_len)

    return run


def _part_unit(e: _Emit, lay: Layout, nb, w, o, body, w_len):
    """body for the last unit of a row of a 32-block type that ends in a part unit (nb % 8
    blocks of it at unit u = nb // 8), with `valid` = nb % 8: body masks the scales of the
    blocks past it to 0. Where a whole unit from there lies inside w (w_len bytes: another row
    follows) it is read in place, and the bytes past the row meet the activation's zero
    padding (integer sums 0); only a matrix's last row is copied into a zeroed unit first, whose
    missing blocks the mask leaves as zero as they were. Either way the same numbers, bit for
    bit. Copying every row's part (memset, memcpy, and loads that span the copy's stores, which
    the core cannot forward) cost the 2,880-wide rows of gpt-oss a fifth of their time."""
    b = e.b
    full = b.lshr(nb, e.i64(3))
    start = b.add(o, b.mul(full, e.i64(lay.unit_bytes)))
    inside = b.icmp_unsigned("<=", b.add(start, e.i64(lay.unit_bytes)), w_len)
    tmp = b.bitcast(cgutils.alloca_once(b, ir.ArrayType(_I8, lay.unit_bytes)), _I8.as_pointer())
    with b.if_then(b.not_(inside), likely=False):
        cgutils.memset(b, tmp, e.i64(lay.unit_bytes), 0)
        cgutils.raw_memcpy(b, tmp, b.gep(w, [start]), b.mul(b.and_(nb, e.i64(7)), e.i64(lay.block_bytes)), 1)
    body(b.select(inside, w, tmp), b.select(inside, start, e.i64(0)), full, b.and_(nb, e.i64(7)))


def _valid_blocks(e: _Emit, v, valid):
    """v (one lane a block of a unit) with the lanes of blocks ≥ valid set to 0 (valid None: v)."""
    if valid is None:
        return v
    n = v.type.count
    lane = ir.Constant(_vec(n, 64), list(range(n)))
    return e.b.select(e.b.icmp_unsigned("<", lane, _splat(e.b, valid, n)), v, ir.Constant(v.type, [0.0] * n))


def _unit(e: _Emit, lay: Layout, nb, w, o, u, body, w_len):
    """body(src, p, u, valid) for unit u of the row at byte o of w (nb 32-blocks): as _units does it."""
    b = e.b
    if not lay.block_bytes:
        body(w, b.add(o, b.mul(u, e.i64(lay.unit_bytes))), u, None)
        return
    with b.if_else(b.icmp_unsigned("<", u, b.lshr(nb, e.i64(3))), likely=True) as (whole, part):
        with whole:
            body(w, b.add(o, b.mul(u, e.i64(lay.unit_bytes))), u, None)
        with part:
            _part_unit(e, lay, nb, w, o, body, w_len)


class _Acts:
    """The rounded activation of a call: xq int8 [T·CP] (rows padded to a whole unit with
    zeros), dx f32 and bs32 int32 and xs32 f32 per 32, bs16 int32 per 16 (_q8._round)."""

    def __init__(self, e: _Emit, xq, dx, bs16, bs32, xs32):
        self.e, self.xq, self.dx, self.bs16, self.bs32, self.xs32 = e, xq, dx, bs16, bs32, xs32

    def bsum(self, lay: Layout, x, n):
        """Σ xq of the n blocks of `lay` from element x (<n x i32>, or i32 when n = 0)."""
        e = self.e
        arr, shift = (self.bs32, _LOG2_QK) if lay.block == QK else (self.bs16, _LOG2_QK - 1)
        return e.load(arr, e.b.lshr(x, e.i64(shift)), _vec(n, 32) if n else _I32)


def _barrier(e: _Emit):
    """An empty asm statement that may read or write memory: LLVM moves no load or store across
    it (nothing is emitted). It keeps the AVX2 tile's loads next to their uses, where LLVM's
    scheduler would hoist a block's loads to its start and spill what they filled."""
    e.b.asm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", [], True)


def _pin(e: _Emit, vs: list) -> list:
    """vs passed through an empty asm statement as register operands: each is computed by then
    and held in a register, so LLVM can neither defer the operations that make it nor spill
    their parts (nothing is emitted)."""
    if not vs:
        return vs
    ty = ir.LiteralStructType([v.type for v in vs])
    n = len(vs)
    out = e.b.asm(ir.FunctionType(ty, [v.type for v in vs]), "", ",".join(["=x"] * n + [str(i) for i in range(n)]), vs, True)
    return [e.b.extract_value(out, i) for i in range(n)]


def _avx2_isums(e: _Emit, lay: Layout, code_at, x_at, nt: int):
    """The tile kernel's block on AVX2: isum of every activation row (x_at(i, k): row i's k-th
    activation word, broadcast) against the 16 weight rows' codes (code_at(k): block/4 vectors),
    as <16 x i32> per row.

    The dots go code vector by code vector, each against every row (a code vector is loaded
    once for the rows, where row by row would keep all of them, 16 registers of the 16, live),
    and each row's `vpmaddubsw` pair sums are added as i16 for as many dots as an i16 holds (a
    pair is at most 2·code_max·127 in magnitude: 8 dots of Q4_K, 4 of Q5_K, 2 of Q6_K) before
    one `vpmaddwd` against ones widens them. Codes up to 255 (the offset-128 types: Q8_0,
    IQ4_XS) go in as q = u − 128, |q| against x·sign(q), one dot a run, and their sums are
    already isum − 128·Σ x: the caller subtracts no offset. A code vector's loads and its rows'
    activation words sit between barriers, so the registers live are the rows' sums, one code
    vector and one word. The same integers as `dp`."""
    b = e.b
    nd = lay.block // 4
    signed = not lay.below128
    assert not signed or lay.offset == 128, "codes up to 255 go in as u − 128: the offset 128's"
    run = 1 if signed else max(1, 32767 // (2 * min(lay.code_max, 127) * 127))
    wide: list[list] = [[None, None] for _ in range(nt)]
    for r0 in range(0, nd, run):
        narrow: list[list] = [[None, None] for _ in range(nt)]
        for k in range(r0, min(r0 + run, nd)):
            if signed:
                # q = u − 128: |q| against x·sign(q), as _maddubs64 (pairs up to 2·128·127: each
                # dot widened at once), a half at a time, the rows' sums pinned in registers
                # after each (LLVM otherwise keeps a block's products for later and spills them)
                for h in range(2):
                    _barrier(e)
                    q = b.xor(e.half32(code_at(k), h), e.const(_vec(32), 0x80))
                    absq = e.abs8(q)
                    for i in range(nt):
                        w = e.widen_pairs(e.maddubs(absq, e.sign8(e.half32(x_at(i, k), 0), q)))
                        wide[i][h] = w if wide[i][h] is None else b.add(wide[i][h], w)
                    pinned = iter(_pin(e, [wide[i][hh] for i in range(nt) for hh in range(2) if wide[i][hh] is not None]))
                    wide = [[next(pinned) if wide[i][hh] is not None else None for hh in range(2)] for i in range(nt)]
                continue
            _barrier(e)
            codes = code_at(k)
            code = [e.half32(codes, h) for h in range(2)]
            for i in range(nt):
                xk = e.half32(x_at(i, k), 0)  # the broadcast word: both halves alike
                for h in range(2):
                    p = e.maddubs(code[h], xk)
                    narrow[i][h] = p if narrow[i][h] is None else b.add(narrow[i][h], p)
        for i in range(nt):
            for h in range(2):
                if narrow[i][h] is not None:
                    w = e.widen_pairs(narrow[i][h])
                    wide[i][h] = w if wide[i][h] is None else b.add(wide[i][h], w)
    _barrier(e)
    return [e.shuf(lo, hi, list(range(16))) for lo, hi in wide]


def _avx2_folds_i16(lay: Layout) -> int:
    """How many `vpmaddubsw` pair sums of `lay`'s codes an i16 holds (a pair is at most
    2·code_max·127 in magnitude), as a power of two: 8 on Q4_K, 4 on Q5_K, Q5_0, MXFP4, IQ3_S and
    the IQ1s, 2 on Q6_K; 1 for codes up to 129, 0 above (a pair may not fit)."""
    n = 32767 // (2 * lay.code_max * 127)
    return 1 << (n.bit_length() - 1) if n else 0


def _avx2_row_block_sums(e: _Emit, lay: Layout, codes, x_at):
    """The row kernel's block sums on AVX2 (<L x i32>, block j in lane j): one `vpmaddubsw` per
    32 codes (x_at(k): the activation's bytes 32k .. 32k + 31), then a transposing tree of
    unpacks and adds — for codes below 128 in i16 for as many levels as an i16 holds
    (`_avx2_folds_i16`) and in i32 after one `vpmaddwd` against ones, where `dp` widens every
    product to i32 before the tree (eight `vpmaddwd` a unit, and a tree twice as long). Codes up
    to 255 (offset 128: Q8_0, IQ4_XS) go in as q = u − 128, |q| against x·sign(q), each widened
    at once (pairs reach 2·128·127), and their sums are Σ q·x = isum − 128·Σ x already (`dp`
    adds 128·Σ x back for the caller to take away). The same integers as `dp` and
    `_block_sums`: only the order of exact integer adds differs."""
    b = e.b

    def fold(xs, lo, hi):
        """lanes lo of (x, y) + lanes hi of (x, y), for x, y the pairs of xs."""
        return [b.add(e.shuf(x, y, lo), e.shuf(x, y, hi)) for x, y in zip(xs[::2], xs[1::2])]

    def unpack(width, part, lanes):
        """vpunpck{l,h}: `width` lanes of x then of y, part 0 (low) or 1 (high) of each 128-bit half."""
        half = lanes // 2
        return [
            o + h * half + part * half // 2 + i
            for h in range(2)
            for g in range(half // (2 * width))
            for o in (0, lanes)
            for i in range(g * width, g * width + width)
        ]

    def halves(lanes):
        """vperm2i128: x's low half then y's (lo), x's high half then y's (hi)."""
        half = lanes // 2
        return list(range(half)) + list(range(lanes, lanes + half)), list(range(half, lanes)) + list(range(lanes + half, 2 * lanes))

    if not lay.below128:
        assert lay.offset == 128 and lay.block == QK, f"{lay}: no AVX2 row tree"
        q = [b.xor(e.half32(codes[k // 2], k % 2), e.const(_vec(32), 0x80)) for k in range(8)]
        w = [e.widen_pairs(e.maddubs(e.abs8(qk), e.sign8(x_at(k), qk))) for k, qk in enumerate(q)]  # <8 x i32> a block
        for width in (1, 2):  # per half x y x y, then a b c d
            w = fold(w, unpack(width, 0, 8), unpack(width, 1, 8))
        (r,) = fold(w, *halves(8))  # blocks 0-3 | 4-7, the halves summed
        return r
    m = [e.maddubs(e.half32(codes[k // 2], k % 2), x_at(k)) for k in range(8)]  # <16 x i16>: 32 codes each
    folds = _avx2_folds_i16(lay)
    if lay.block == QK:  # a vector is one block: 8 pair sums in each 128-bit half
        p = fold(m, unpack(2, 0, 16), unpack(2, 1, 16))  # 4 vectors: per half x x y y x x y y
        if folds >= 4:
            p = fold(p, unpack(4, 0, 16), unpack(4, 1, 16))  # 2 vectors: per half a a b b c c d d
        if folds >= 8:
            (r,) = fold(p, *halves(16))  # blocks 0-3 | 4-7, the halves summed, as i16 pairs
            return e.widen_pairs(r)
        assert folds >= 4, f"{lay}: too few i16 folds"
        (r,) = fold([e.widen_pairs(v) for v in p], *halves(8))
        return r
    assert lay.block == 16 and folds >= 2, f"{lay}: no AVX2 row tree"
    # a vector is two blocks (its 128-bit halves: blocks 2k and 2k + 1)
    p = [e.widen_pairs(v) for v in fold(m, unpack(2, 0, 16), unpack(2, 1, 16))]  # per half x y x y
    q = fold(p, unpack(2, 0, 8), unpack(2, 1, 8))  # blocks 8j, 8j+2, 8j+4, 8j+6 | 8j+1, 8j+3, ...
    q = [e.shuf(v, None, [0, 4, 1, 5, 2, 6, 3, 7]) for v in q]
    return e.shuf(q[0], q[1], list(range(16)))


def _block_step(e: _Emit, isum, wsc, dx, acc):
    """acc + float(isum)·(wsc·dx): the one float step of a block (lane by lane)."""
    return e.fma(e.b.sitofp(isum, wsc.type), e.b.fmul(wsc, dx), acc)


# ---- the kernels -------------------------------------------------------------
# Arguments shared by all: xq, dx, bs16, bs32, xs32 (_Acts), tab (F16_TABLE, or E8M0_HALF for
# MXFP4), out f32 (flat; result i of a call goes to element oo + i·os). Activation rows are
# element offsets xo + i·cs into xq (cs = CP, a multiple of 256).


def _codegen_args(context, builder, sig, args, pointers, ints):
    e = _Emit(context, builder)
    return e, [e.data(sig.args[i], args[i]) for i in pointers], [context.cast(builder, args[i], sig.args[i], types.int64) for i in ints]


def row_kernel(name: str, nt: int):
    """`f(w, o, nb, xq, xo, cs, dx, bs16, bs32, xs32, tab, out, oo, os)`: the weight row at byte o
    of w (nb 32-blocks) times nt activation rows, with no repacking (decode, a few rows). With
    nt above 1 it takes one more argument, `nv`: only rows 0 .. nv-1 are stored (the rows past
    a call's last are _round's zero rows, multiplied and dropped as the tile kernels drop them).

    Per unit and activation row: the four 64-byte dots of the unit's codes, reduced to the
    L block sums in one vector, the offset subtracted, one L-lane multiply-add: lane j
    accumulates blocks j, j + L, j + 2L, ... of the row in order; the lanes are summed by the
    halving tree at the end. tile_kernel computes the same per row.
    """
    lay = layout(name)
    L = lay.lanes
    # AVX2 sums a unit's blocks by its own tree where an i16 holds enough pair sums for it, and
    # for the offset-128 codes (whose tree's sums have the offset taken out already)
    signed_tree = _AVX2 and not lay.below128 and lay.offset == 128 and lay.block == QK
    avx2_tree = signed_tree or (_AVX2 and lay.below128 and _avx2_folds_i16(lay) >= (4 if lay.block == QK else 2))

    def typer(typingctx, w, o, nb, xq, xo, cs, dx, bs16, bs32, xs32, tab, out, oo, os, *stored):
        def codegen(context, builder, sig, args):
            e, (w_, xq_, dx_, bs16_, bs32_, xs32_, tab_, out_), (o_, nb_, xo_, cs_, oo_, os_, *nv_) = _codegen_args(
                context, builder, sig, args, (0, 3, 6, 7, 8, 9, 10, 11), (1, 2, 4, 5, 12, 13) + tuple(range(14, 14 + len(stored)))
            )
            b = e.b
            acts = _Acts(e, xq_, dx_, bs16_, bs32_, xs32_)
            accs = [cgutils.alloca_once_value(b, ir.Constant(_fvec(L), [0.0] * L)) for _ in range(nt)]
            accm = [cgutils.alloca_once_value(b, ir.Constant(_fvec(8), [0.0] * 8)) for _ in range(nt)] if lay.mins else []
            rows = [xo_ if i == 0 else b.add(xo_, b.mul(cs_, e.i64(i))) for i in range(nt)]

            def body(src, p, u, valid):
                codes, wsc, dmm = lay.decode(e, src, p, tab_)
                wsc = _valid_blocks(e, wsc, valid)
                for i, xr in enumerate(rows):
                    x = b.add(xr, b.shl(u, e.i64(8)))
                    if avx2_tree:
                        isum = _avx2_row_block_sums(e, lay, codes, lambda k, x=x: e.load(xq_, b.add(x, e.i64(32 * k)), _vec(32)))
                    else:
                        dots = [
                            e.dp(
                                ir.Constant(_vec(16, 32), [0] * 16), codes[c], e.load(xq_, b.add(x, e.i64(64 * c)), _vec(64)), lay.below128
                            )
                            for c in range(CODE_VECTORS)
                        ]
                        isum = _block_sums(e, dots, lay.block // 4)
                    if lay.offset and not signed_tree:
                        isum = b.sub(isum, b.mul(acts.bsum(lay, x, L), e.const(_vec(L, 32), lay.offset)))
                    dx8 = e.load(dx_, b.lshr(x, e.i64(_LOG2_QK)), _fvec(8))
                    dxl = dx8 if L == 8 else e.shuf(dx8, None, [j * lay.block // QK for j in range(L)])
                    b.store(_block_step(e, isum, wsc, dxl, b.load(accs[i])), accs[i])
                    if lay.mins:
                        b.store(e.fma(dmm, e.load(xs32_, b.lshr(x, e.i64(_LOG2_QK)), _fvec(8)), b.load(accm[i])), accm[i])

            _units(e, lay, nb_, body, e.nitems(sig.args[0], args[0]))(w_, o_)
            for i in range(nt):
                r = e.hsum(b.load(accs[i]))
                if lay.mins:
                    r = b.fsub(r, e.hsum(b.load(accm[i])))
                at = builder.gep(out_, [builder.add(oo_, builder.mul(os_, e.i64(i)))])
                if i == 0:
                    builder.store(r, at)
                else:
                    with builder.if_then(builder.icmp_signed(">", nv_[0], e.i64(i))):
                        builder.store(r, at)
            return context.get_dummy_value()

        return types.void(w, o, nb, xq, xo, cs, dx, bs16, bs32, xs32, tab, out, oo, os, *stored), codegen

    # numba's intrinsic types a call by its typer's own parameters, so each kernel gets one
    # without *stored: the one-row kernel's has no `nv`.
    def one_row(typingctx, w, o, nb, xq, xo, cs, dx, bs16, bs32, xs32, tab, out, oo, os):
        return typer(typingctx, w, o, nb, xq, xo, cs, dx, bs16, bs32, xs32, tab, out, oo, os)

    def rows_stored(typingctx, w, o, nb, xq, xo, cs, dx, bs16, bs32, xs32, tab, out, oo, os, nv):
        return typer(typingctx, w, o, nb, xq, xo, cs, dx, bs16, bs32, xs32, tab, out, oo, os, nv)

    kernel = one_row if nt == 1 else rows_stored
    kernel.__name__ = f"row_{name}_x{nt}"
    return intrinsic(kernel)


def transpose(builder, vs):
    """n vectors of n lanes (n a power of two) → n vectors, vector k holding lane k of every
    input (lane r from vector r). Each round swaps one bit of the row with that bit of the lane:
    two-input shuffles of vectors h lanes apart. Below 512-bit vectors, 16 × 16 is four 8 × 8
    (32 registers would spill to the stack: ~940 stack moves in a Q4_K repack), and 8 × 8 takes
    its rounds 1, 2, 4 lanes apart, which AVX2 does in 24 shuffles (the other order took 32:
    in-lane shuffles after the 128-bit swap); 512-bit vectors take 8, 4, 2, 1."""
    vs = list(vs)
    n = len(vs)
    if n > 8 and not WIDE_VECTORS:
        h = n // 2

        def part(v, i):
            return builder.shuffle_vector(v, v, ir.Constant(_vec(h, 32), list(range(i * h, i * h + h))))

        def join(x, y):
            return builder.shuffle_vector(x, y, ir.Constant(_vec(n, 32), list(range(n))))

        blocks = [transpose(builder, [part(v, i) for v in rows]) for rows in (vs[:h], vs[h:]) for i in (0, 1)]
        top_lo, top_hi, low_lo, low_hi = blocks  # rows 0..h-1 lanes 0..h-1, their lanes h.., rows h.. likewise
        return [join(top_lo[k], low_lo[k]) for k in range(h)] + [join(top_hi[k], low_hi[k]) for k in range(h)]
    h = 1 if n <= 8 else n // 2
    while 0 < h < n:
        lo = ir.Constant(_vec(n, 32), [k if not k & h else n + k - h for k in range(n)])
        hi = ir.Constant(_vec(n, 32), [k + h if not k & h else n + k for k in range(n)])
        new = list(vs)
        for r in range(n):
            if not r & h:
                new[r], new[r + h] = builder.shuffle_vector(vs[r], vs[r + h], lo), builder.shuffle_vector(vs[r], vs[r + h], hi)
        vs = new
        h = h * 2 if n <= 8 else h // 2
    return vs


def pack_kernel(name: str):
    """`f(w, stride, r0, R, nb, tab, buf)`: weight rows r0 .. r0+15 (rows ≥ R repeat row R − 1)
    repacked into buf for tile_kernel, PACKED_UNIT bytes per unit: block j's codes as block/4
    vectors of 16 rows × 4 codes (row r's 4 codes in lane r) at 16·block·j, then from 16·256
    the L wsc vectors and, for Q4_K/Q5_K, the 8 dmm vectors (row r in lane r)."""
    lay = layout(name)
    L = lay.lanes

    def typer(typingctx, w, stride, r0, R, nb, tab, buf):
        def codegen(context, builder, sig, args):
            e, (w_, tab_, buf_), (stride_, r0_, R_, nb_) = _codegen_args(context, builder, sig, args, (0, 5, 6), (1, 2, 3, 4))
            w_len = e.nitems(sig.args[0], args[0])
            b = e.b
            last = b.sub(R_, e.i64(1))
            # A unit at a time: its 16 rows decoded into a stack copy (in L1), then transposed
            # from there into buf, rows into lanes.
            st = b.bitcast(cgutils.alloca_once(b, ir.ArrayType(_I8, PACKED_UNIT)), _I8.as_pointer())

            def at(base, off, ty):
                return b.bitcast(b.gep(base, [off]), ty.as_pointer())

            with cgutils.for_range(b, b.lshr(b.add(nb_, e.i64(7)), e.i64(3))) as ul:
                with cgutils.for_range(b, e.i64(16)) as rl:
                    r = rl.index
                    row = b.add(r0_, r)
                    row = b.select(b.icmp_signed("<", row, last), row, last)

                    def stage(src, p, u, valid, r=r):
                        codes, wsc, dmm = lay.decode(e, src, p, tab_)
                        wsc = _valid_blocks(e, wsc, valid)
                        for c in range(CODE_VECTORS):
                            b.store(codes[c], at(st, b.add(b.mul(r, e.i64(UNIT)), e.i64(64 * c)), _vec(64)), align=1)
                        sc = wsc if L == 16 else e.shuf(wsc, dmm, list(range(16))) if lay.mins else e.shuf(wsc, None, list(range(8)) * 2)
                        b.store(sc, at(st, b.add(e.i64(16 * UNIT), b.mul(r, e.i64(64))), _fvec(16)), align=1)

                    _unit(e, lay, nb_, w_, b.mul(row, stride_), ul.index, stage, w_len)
                base = b.mul(ul.index, e.i64(PACKED_UNIT))
                for c in range(CODE_VECTORS):
                    vs = [e.load(st, e.i64(UNIT * rr + 64 * c), _vec(16, 32)) for rr in range(16)]
                    for k, v in enumerate(transpose(e.b, vs)):
                        b.store(v, at(buf_, b.add(base, e.i64(1024 * c + 64 * k)), _vec(16, 32)), align=1)
                vs = [e.load(st, e.i64(16 * UNIT + 64 * rr), _vec(16, 32)) for rr in range(16)]
                for k, v in enumerate(transpose(e.b, vs)[: L if not lay.mins else 16]):
                    b.store(v, at(buf_, b.add(base, e.i64(16 * UNIT + 64 * k)), _vec(16, 32)), align=1)
            return context.get_dummy_value()

        return types.void(w, stride, r0, R, nb, tab, buf), codegen

    typer.__name__ = f"pack_{name}"
    return intrinsic(typer)


def tile_kernel(name: str, nt: int, gathered: bool = False):
    """`f(buf, nu, xq, xo, cs, dx, bs16, bs32, xs32, out, oo, os, nv, nr)`: a packed tile of 16
    weight rows (pack_kernel, nu units) times nt activation rows, of which the first nr are
    stored: row i's 16 results (the first nv) go to out[oo + i·os ...]. (Rows past nr are
    the activation's zero padding: a call's last rows take one sweep of the tile.)

    `gathered`: `f(..., nr, idx)`, activation row i is row idx[xo + i] of xq (each cs elements),
    so a prompt's expert takes its tokens' rows where the rounding left them, without a copy;
    rows past nr repeat row nr − 1 (computed, never stored), so nothing past idx's run is read.

    Block j of each unit goes to the accumulator of lane j (blocks j, j + L, ... in order), as
    in row_kernel, but here the 16 lanes of a vector are 16 weight rows: a block is block/4
    dots of the 16 rows' codes against 4 activation codes broadcast, one conversion, one
    multiply by wsc·dx and one multiply-add for all 16 rows. The L accumulators of a row are
    summed by row_kernel's halving tree.
    """
    lay = layout(name)
    L = lay.lanes
    nd = lay.block // 4  # dots per block

    def codegen(context, builder, sig, args):
        e, (buf_, xq_, dx_, bs16_, bs32_, xs32_, out_), (nu_, xo_, cs_, oo_, os_, nv_, nr_) = _codegen_args(
            context, builder, sig, args, (0, 2, 5, 6, 7, 8, 9), (1, 3, 4, 10, 11, 12, 13)
        )
        b = e.b
        acts = _Acts(e, xq_, dx_, bs16_, bs32_, xs32_)
        v16 = _fvec(16)
        sums = cgutils.alloca_once(b, v16, size=e.i64(L * nt * (2 if lay.mins else 1)))
        accs = [cgutils.alloca_once(b, v16) for _ in range(nt * (2 if lay.mins else 1))]
        zero16 = ir.Constant(_vec(16, 32), [0] * 16)
        if gathered:
            idx_ = e.data(sig.args[14], args[14])
            last = b.sub(nr_, e.i64(1))
            at = [b.select(b.icmp_signed("<", e.i64(i), last), e.i64(i), last) for i in range(nt)]
            rows = [b.mul(e.load(idx_, b.add(xo_, a), _I64), cs_) for a in at]
        else:
            rows = [xo_ if i == 0 else b.add(xo_, b.mul(cs_, e.i64(i))) for i in range(nt)]
        avx2 = _AVX2 and (lay.below128 or lay.offset == 128)
        with cgutils.for_range(b, e.i64(L)) as jl:
            j = jl.index

            def slot(a, j=j):
                """Accumulator a's lane-j sum in `sums`, where the rows' tree reads it."""
                return b.gep(sums, [b.add(b.mul(e.i64(a), e.i64(L)), j)])

            def acc_at(a):
                """Accumulator a for lane j. On AVX2 a row's block sums go straight to their slot,
                kept in memory: the barriers stop LLVM from holding it in one of the 16 registers
                the dots need. The mins' (a ≥ nt) stay in registers: their loop is a chain of
                multiply-adds, which through memory would wait for each store to be read back."""
                return slot(a) if avx2 and a < nt else accs[a]

            for a in range(len(accs)):
                b.store(ir.Constant(v16, [0.0] * 16), acc_at(a))
            with cgutils.for_range(b, nu_) as ul:
                base = b.mul(ul.index, e.i64(PACKED_UNIT))
                cb = b.add(base, b.mul(j, e.i64(16 * lay.block)))
                xu = b.add(b.shl(ul.index, e.i64(8)), b.mul(j, e.i64(lay.block)))

                def code_at(k, cb=cb):
                    return e.load(buf_, b.add(cb, e.i64(64 * k)), _vec(64))

                def x_at(i, k, xu=xu):
                    return e.splat_i32(e.load(xq_, b.add(b.add(rows[i], xu), e.i64(4 * k)), _I32))

                if avx2:
                    isums = _avx2_isums(e, lay, code_at, x_at, nt)
                else:
                    codes = [code_at(k) for k in range(nd)]
                    isums = []
                    for i in range(nt):
                        ch = [zero16, zero16]
                        for k in range(nd):
                            ch[k % 2] = e.dp(ch[k % 2], codes[k], x_at(i, k), lay.below128)
                        isums.append(b.add(ch[0], ch[1]))
                wsc = e.load(buf_, b.add(base, b.add(e.i64(16 * UNIT), b.mul(j, e.i64(64)))), v16)
                for i, xr in enumerate(rows):
                    x = b.add(xr, xu)
                    isum = isums[i]
                    if lay.offset and not (avx2 and not lay.below128):  # (_avx2_isums subtracts 128·Σ x itself)
                        isum = b.sub(isum, _splat(b, b.mul(acts.bsum(lay, x, 0), ir.Constant(_I32, lay.offset)), 16))
                    dxs = _splat(b, e.load(dx_, b.lshr(x, e.i64(_LOG2_QK)), _F32), 16)
                    b.store(_block_step(e, isum, wsc, dxs, b.load(acc_at(i))), acc_at(i))
            if lay.mins:
                # the mins' chains in a loop of their own: the same operations in the same
                # order per chain, and the code loop keeps its registers (no spills)
                with cgutils.for_range(b, nu_) as ul:
                    base = b.mul(ul.index, e.i64(PACKED_UNIT))
                    dmm = e.load(buf_, b.add(base, b.add(e.i64(16 * UNIT + 64 * 8), b.mul(j, e.i64(64)))), v16)
                    xu = b.add(b.shl(ul.index, e.i64(8)), b.mul(j, e.i64(lay.block)))
                    for i, xr in enumerate(rows):
                        x32 = b.lshr(b.add(xr, xu), e.i64(_LOG2_QK))
                        b.store(e.fma(dmm, _splat(b, e.load(xs32_, x32, _F32), 16), b.load(acc_at(nt + i))), acc_at(nt + i))
            for a, acc in enumerate(accs):
                if acc_at(a) is acc:  # a register's sum to its slot
                    b.store(b.load(acc), slot(a))
        for i in range(nt):
            r = e.tree([b.load(b.gep(sums, [e.i64(i * L + j)])) for j in range(L)])
            if lay.mins:
                r = b.fsub(r, e.tree([b.load(b.gep(sums, [e.i64((nt + i) * L + j)])) for j in range(L)]))
            dst = b.add(oo_, b.mul(os_, e.i64(i)))
            with b.if_then(b.icmp_signed("<", e.i64(i), nr_)):
                with b.if_else(b.icmp_signed("==", nv_, e.i64(16))) as (full, part):
                    with full:
                        b.store(r, b.bitcast(b.gep(out_, [dst]), v16.as_pointer()), align=4)
                    with part:
                        for lane in range(16):
                            with b.if_then(b.icmp_signed("<", e.i64(lane), nv_)):
                                b.store(b.extract_element(r, ir.Constant(_I32, lane)), b.gep(out_, [b.add(dst, e.i64(lane))]))
        return context.get_dummy_value()

    if gathered:

        def typer(typingctx, buf, nu, xq, xo, cs, dx, bs16, bs32, xs32, out, oo, os, nv, nr, idx):
            return types.void(buf, nu, xq, xo, cs, dx, bs16, bs32, xs32, out, oo, os, nv, nr, idx), codegen

    else:

        def typer(typingctx, buf, nu, xq, xo, cs, dx, bs16, bs32, xs32, out, oo, os, nv, nr):  # type: ignore[misc]
            return types.void(buf, nu, xq, xo, cs, dx, bs16, bs32, xs32, out, oo, os, nv, nr), codegen

    typer.__name__ = f"tile_{name}_x{nt}{'_gathered' if gathered else ''}"
    return intrinsic(typer)


def round_row():
    """`f(X, xo, C, xq, qo, dx, bs16, bs32, xs32)`: activation row X[xo .. xo+C] (f32) rounded
    to int8 per block of 32 into xq from element qo, its block k (= qo/32 + block) filling
    dx[k], bs16[2k], bs16[2k+1], bs32[k], xs32[k] — _q8._quantize_row's arithmetic, 32 lanes
    at a time: amax of |x|; dx = amax/127 and xq = rint(x·(127/amax)) (round half to even);
    a block with a non-finite element gets dx = NaN and zero codes; amax < 2^-100 gives dx = 0
    and zero codes; xs32 = dx·Σ xq.
    """

    def typer(typingctx, X, xo, C, xq, qo, dx, bs16, bs32, xs32):
        def codegen(context, builder, sig, args):
            e, (X_, xq_, dx_, bs16_, bs32_, xs32_), (xo_, C_, qo_) = _codegen_args(
                context, builder, sig, args, (0, 3, 5, 6, 7, 8), (1, 2, 4)
            )
            b = e.b
            f32x32, i32x32 = _fvec(32), _vec(32, 32)
            fabs = e.fn("llvm.fabs.v32f32", f32x32, [f32x32])
            rint = e.fn("llvm.rint.v32f32", f32x32, [f32x32])
            with cgutils.for_range(b, b.lshr(C_, e.i64(_LOG2_QK))) as loop:
                v = e.load(X_, b.add(xo_, b.shl(loop.index, e.i64(_LOG2_QK))), f32x32)
                a = b.call(fabs, [v])
                finite = b.icmp_unsigned(
                    "==", b.bitcast(b.fcmp_ordered("<", a, ir.Constant(f32x32, [float("inf")] * 32)), _I32), ir.Constant(_I32, -1)
                )
                m = a  # the max of a finite block by a compare-select tree (exact; NaN blocks take the other branch)
                n = 32
                while n > 1:
                    n //= 2
                    lo, hi = e.shuf(m, None, list(range(n))), e.shuf(m, None, list(range(n, 2 * n)))
                    m = b.select(b.fcmp_ordered(">", hi, lo), hi, lo)
                amax = b.extract_element(m, ir.Constant(_I32, 0))
                tiny = b.fcmp_ordered("<", amax, ir.Constant(_F32, 2.0**-100))
                dxv = b.select(
                    finite, b.select(tiny, ir.Constant(_F32, 0.0), b.fdiv(amax, ir.Constant(_F32, 127.0))), ir.Constant(_F32, float("nan"))
                )
                zero = b.or_(b.not_(finite), tiny)
                inv = b.select(zero, ir.Constant(_F32, 1.0), b.fdiv(ir.Constant(_F32, 127.0), amax))
                q = b.fptosi(b.call(rint, [b.fmul(v, _splat(b, inv, 32))]), i32x32)
                q = b.select(zero, ir.Constant(i32x32, [0] * 32), q)
                k = b.add(b.lshr(qo_, e.i64(_LOG2_QK)), loop.index)
                b.store(b.trunc(q, _vec(32)), b.bitcast(b.gep(xq_, [b.shl(k, e.i64(_LOG2_QK))]), _vec(32).as_pointer()), align=1)
                add = e.fn("llvm.vector.reduce.add.v16i32", _I32, [_vec(16, 32)])
                s0 = b.call(add, [e.shuf(q, None, list(range(16)))])
                s1 = b.call(add, [e.shuf(q, None, list(range(16, 32)))])
                b.store(dxv, b.gep(dx_, [k]))
                b.store(s0, b.gep(bs16_, [b.shl(k, e.i64(1))]))
                b.store(s1, b.gep(bs16_, [b.add(b.shl(k, e.i64(1)), e.i64(1))]))
                b.store(b.add(s0, s1), b.gep(bs32_, [k]))
                b.store(b.fmul(dxv, b.sitofp(b.add(s0, s1), _F32)), b.gep(xs32_, [k]))
            return context.get_dummy_value()

        return types.void(X, xo, C, xq, qo, dx, bs16, bs32, xs32), codegen

    typer.__name__ = "round_row"
    return intrinsic(typer)


@intrinsic
def bytes_at(typingctx, addr, n):
    """`bytes_at(addr, n)`: the n bytes at address addr as a uint8 array (no owner: the caller
    keeps the memory alive for the call). A grouped call's matrices lie wherever their expert
    was read (cache slabs, the mapped file), so they travel as addresses: a tuple of arrays
    would compile the driver once for every count of matrices."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.return_type)(context, builder)
        one = context.get_constant(types.intp, 1)
        context.populate_array(
            ary,
            data=builder.inttoptr(args[0], ir.PointerType(ir.IntType(8))),
            shape=cgutils.pack_array(builder, [args[1]]),
            strides=cgutils.pack_array(builder, [one]),
            itemsize=one,
            meminfo=None,
        )
        return ary._getvalue()

    return types.Array(types.uint8, 1, "C")(types.int64, types.int64), codegen
