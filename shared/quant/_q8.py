"""Integer dot products against int8 activations: Q8_0, Q4_K, Q6_K, Q5_0, MXFP4.

For these types a one-row call (matvec, matmul with T = 1: the decode
step) quantizes the activation to int8 per block of 32 (x̂ = dx·xq, dx = amax/127,
xq = rint(x/dx), the q8_0 rounding) and multiplies on the raw small integers.
Per call, row-independent sums of the codes are computed once: bs (int32, per
16), xs16 = dx·bs (float, per 16) and xs32 (float, per 32), the Σ x̂ that the
weight offsets multiply.

Q4_K and Q6_K (the expert and head types) run a whole row in one LLVM IR
function (`_rowdot_q4_k`, `_rowdot_q6_k`): per 256-weight super-block the
codes are unpacked with a few vector ops into 64-byte u8 vectors laid out like
the activation, each multiplied with 64 activation bytes by one
`vpdpbusd` (u8·i8, sums of 4 in 16 int32 lanes), and the 16 lanes are
converted to float and FMA'd into a 16-lane float accumulator with a factor
vector d·scale·dx per lane. Scales and mins of all sub-blocks are decoded as
one vector per super-block; the offset term (Q4_K dmin·m, Q6_K the −32)
is an 8/16-lane FMA against xs32/xs16. Nothing is reduced horizontally until
the row ends. Per super-block (Q4_K) this is ~60 instructions for 256 weights.

Q8_0 and MXFP4 (single scale per 32) take 4 blocks per step in IR
(`_gen_block4`): two vpdpbusd, a shuffle-add tree to the 4 block sums, the
code offset subtracted in exact int32 per block (an all-zero-weight block
gives exactly 0), one 4-lane FMA. Q5_0 and the < 4-block tails keep a
per-block IR dot (`_dot_*`: `zext(u)·sext(xq)` + `llvm.vector.reduce.add`).

Where the CPU numba compiles for has AVX-512 VNNI (`INT8_DOT` = "vnni") the
64-byte dot is the `llvm.x86.avx512.vpdpbusd.512` intrinsic and the MXFP4
code map one `vpshufb`; anywhere else (`INT8_DOT` = "portable", also forced
by NUMBA_CPU_NAME=generic) both are target-independent IR (products in int32,
pairwise adds; the code map by arithmetic): the same integer sums, only
slower (the float scaling may round differently in the last bit, as LLVM
schedules it differently). Written in numba-level Python the same
loop is typed in int64 (numba widens small ints), and LLVM then leaves it
scalar or widens to 32-bit lanes: 6–9 G weights/s for a block dot, against
25–35 G weights/s for the whole-row kernels here (one core, in cache).

Numerics: weights are decoded exactly; the activation is rounded to int8
(|x − x̂| ≤ dx/2 = amax₃₂/254 per element); the integer sums are exact and
the float scaling adds a few float32 roundings per block.
`effective_activation(x, qtype)` returns x̂. A non-finite activation block
gives NaN/inf outputs (dx = inf or NaN), as the float path would.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

from moe_pipe.shared.quant._common import DRIVER, INLINE, f16_at
from moe_pipe.shared.quant.blocks import E2M1_TWICE, MXFP4_BYTES, Q4_K_BYTES, Q5_0_BYTES, Q6_K_BYTES, Q8_0_BYTES, QK, QK_K

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
_F16C = "+f16c" in _FEATURES
INT8_DOT = "vnni" if _VNNI else "portable"


def _vec(n, bits=8):
    return ir.VectorType(ir.IntType(bits), n)


def _fvec(n):
    return ir.VectorType(_F32, n)


def _load(context, builder, aty, arr, off, n):
    a = context.make_array(aty)(context, builder, arr)
    p = builder.gep(a.data, [off])
    return builder.load(builder.bitcast(p, _vec(n).as_pointer()), align=1)


def _splat(builder, v, n):
    t = ir.VectorType(v.type, n)
    s = builder.insert_element(ir.Constant(t, None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(s, ir.Constant(t, None), ir.Constant(_vec(n, 32), [0] * n))


def _dot(builder, u, xq, n):
    """Σ zext(u)·sext(xq) over n u8/i8 lanes → i32 (VNNI vpdpbusd where there is one)."""
    prod = builder.mul(builder.zext(u, _vec(n, 32)), builder.sext(xq, _vec(n, 32)))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_vec(n, 32)]), f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(fn, [prod])


def _nibbles32(builder, q16):
    """16 bytes in nibble order → 32 u8 lanes: low nibbles, then high nibbles."""
    lo = builder.and_(q16, ir.Constant(_vec(16), [15] * 16))
    hi = builder.lshr(q16, ir.Constant(_vec(16), [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(_vec(32, 32), list(range(32))))


@intrinsic
def _dot_q8(typingctx, w, wo, x, xo):
    """Σ_{l<32} (int8 w[wo+l] + 128)·x[xo+l]."""

    def codegen(context, builder, sig, args):
        q = _load(context, builder, sig.args[0], args[0], args[1], 32)
        u = builder.xor(q, ir.Constant(_vec(32), [0x80] * 32))
        return _dot(builder, u, _load(context, builder, sig.args[2], args[2], args[3], 32), 32)

    return types.int32(w, wo, x, xo), codegen


@intrinsic
def _dot_q5_0(typingctx, w, wo, qh, x, xo):
    """Σ_{l<32} (nibble_l | bit_l(qh) << 4)·x[xo+l] over a Q5_0 block's qs at wo (q before −16)."""

    def codegen(context, builder, sig, args):
        nib = _nibbles32(builder, _load(context, builder, sig.args[0], args[0], args[1], 16))
        bits = builder.lshr(_splat(builder, builder.trunc(args[2], _I32), 32), ir.Constant(_vec(32, 32), list(range(32))))
        hb = builder.trunc(builder.and_(bits, ir.Constant(_vec(32, 32), [1] * 32)), _vec(32))
        u = builder.or_(nib, builder.shl(hb, ir.Constant(_vec(32), [4] * 32)))
        return _dot(builder, u, _load(context, builder, sig.args[3], args[3], args[4], 32), 32)

    return types.int32(w, wo, qh, x, xo), codegen


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


@intrinsic
def _dot_fp4(typingctx, w, wo, x, xo):
    """Σ_{l<32} (2·E2M1(code_l) + 12)·x[xo+l] over an MXFP4 block's qs at wo."""

    def codegen(context, builder, sig, args):
        u = _fp4_u_arith(builder, _nibbles32(builder, _load(context, builder, sig.args[0], args[0], args[1], 16)))
        return _dot(builder, u, _load(context, builder, sig.args[2], args[2], args[3], 32), 32)

    return types.int32(w, wo, x, xo), codegen


# ---- whole-row IR: Q4_K, Q6_K ----------------------------------------------


class _Emit:
    """Small vector-IR vocabulary over one llvmlite builder."""

    def __init__(self, context, builder):
        self.b = builder
        self.mod = builder.module
        self.context = context

    def data(self, aty, arr):
        return self.context.make_array(aty)(self.context, self.b, arr).data

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
        h = self.load(base, off, _I16)
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

    def fma(self, a, b, c):
        n = a.type.count
        return self.b.call(self.fn(f"llvm.fma.v{n}f32", _fvec(n), [_fvec(n)] * 3), [a, b, c])

    def dp(self, u, x):
        """<16 x i32>: lane i = Σ_{k<4} zext(u[4i+k])·sext(x[4i+k]) for 64 u8 (u) / i8 (x) lanes."""
        zero = ir.Constant(_vec(16, 32), [0] * 16)
        if _VNNI:
            f = self.fn("llvm.x86.avx512.vpdpbusd.512", _vec(16, 32), [_vec(16, 32)] * 3)
            return self.b.call(f, [zero, self.b.bitcast(u, _vec(16, 32)), self.b.bitcast(x, _vec(16, 32))])
        p = self.b.mul(self.b.zext(u, _vec(64, 32)), self.b.sext(x, _vec(64, 32)))
        p = self.b.add(self.shuf(p, None, list(range(0, 64, 2))), self.shuf(p, None, list(range(1, 64, 2))))
        return self.b.add(self.shuf(p, None, list(range(0, 32, 2))), self.shuf(p, None, list(range(1, 32, 2))))

    def hsum(self, v):
        """Σ lanes of a float vector, as a fixed pairwise tree."""
        n = v.type.count
        while n > 1:
            n //= 2
            v = self.b.fadd(self.shuf(v, None, list(range(n))), self.shuf(v, None, list(range(n, 2 * n))))
        return self.b.extract_element(v, ir.Constant(_I32, 0))

    def acc(self, n):
        return cgutils.alloca_once_value(self.b, ir.Constant(_fvec(n), [0.0] * n))


def _rowdot(gen):
    """An intrinsic `f(w, o, n, xq, xo, dx, s, tab) → float32` from an IR body generator.

    w u8 weights (row at byte o), n blocks (or groups) to take, xq int8
    activation (row at element xo), dx its per-32 scales, s a per-call sum
    array and tab a lookup table (both as the generator needs; unused ones are
    passed anyway so every kernel has the same shape).
    """

    def typer(typingctx, w, o, n, xq, xo, dx, s, tab):
        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            o_, n_, xo_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4))
            ptr = [e.data(sig.args[i], args[i]) for i in (0, 3, 5, 6, 7)]
            return gen(e, ptr[0], o_, n_, ptr[1], xo_, ptr[2], ptr[3], ptr[4])

        return types.float32(w, o, n, xq, xo, dx, s, tab), codegen

    typer.__name__ = gen.__name__
    return intrinsic(typer)


def _block4_sums(e: _Emit, lo, hi):
    """Two <16 x i32> dot vectors (8 lanes per 32-block: blocks 0,1 and 2,3) → <4 x i32> block sums."""
    b = e.b
    s = b.add(
        e.shuf(lo, hi, [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]),
        e.shuf(lo, hi, [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]),
    )
    s = b.add(e.shuf(s, None, [0, 1, 4, 5, 8, 9, 12, 13]), e.shuf(s, None, [2, 3, 6, 7, 10, 11, 14, 15]))
    return b.add(e.shuf(s, None, [0, 2, 4, 6]), e.shuf(s, None, [1, 3, 5, 7]))


def _gen_block4(e: _Emit, w, o, ng, xq, xo, dx, bs, tab, *, size, codes, scale, offset):
    """Σ over ng groups of 4 single-scale 32-blocks: Σ_blocks scale·dx·(Σ u·xq − offset·Σ xq).

    The block sums are reduced and offset-corrected in exact int32 before
    any float rounding (so an all-zero-weight block contributes exactly 0).
    `codes(p)` → two <64 x i8> u vectors (blocks 0,1 and 2,3) for the group at byte p.
    """
    b = e.b
    acc = e.acc(4)
    with cgutils.for_range(b, ng) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(4 * size)))
        xb = b.add(xo, b.mul(loop.index, e.i64(4 * QK)))
        j = b.lshr(xb, e.i64(_LOG2_QK))
        u01, u23 = codes(p)
        dots = _block4_sums(e, e.dp(u01, e.load(xq, xb, _vec(64))), e.dp(u23, e.load(xq, b.add(xb, e.i64(64)), _vec(64))))
        bs8 = e.load(bs, b.shl(j, e.i64(1)), _vec(8, 32))  # Σ xq per 16 → per 32
        bsum = b.add(e.shuf(bs8, None, [0, 2, 4, 6]), e.shuf(bs8, None, [1, 3, 5, 7]))
        ints = b.sub(dots, b.mul(bsum, e.const(_vec(4, 32), offset)))
        sc = ir.Constant(_fvec(4), None)
        for i in range(4):
            sc = b.insert_element(sc, scale(b.add(p, e.i64(size * i))), ir.Constant(_I32, i))
        f = b.fmul(sc, e.load(dx, j, _fvec(4)))
        b.store(e.fma(b.sitofp(ints, _fvec(4)), f, b.load(acc)), acc)
    return e.hsum(b.load(acc))


def _gen_q8_0(e: _Emit, w, o, ng, xq, xo, dx, bs, tab):
    def codes(p):
        q = [e.load(w, e.b.add(p, e.i64(Q8_0_BYTES * i + 2)), _vec(32)) for i in range(4)]
        flip = e.const(_vec(64), 0x80)  # int8 q → u8 q + 128
        return (e.b.xor(e.shuf(q[0], q[1], list(range(64))), flip), e.b.xor(e.shuf(q[2], q[3], list(range(64))), flip))

    return _gen_block4(e, w, o, ng, xq, xo, dx, bs, tab, size=Q8_0_BYTES, codes=codes, scale=lambda p: e.half(w, p), offset=128)


def _fp4_u(e: _Emit, n):
    """<64 x i8> E2M1 codes (0..15) → 2·value + 12 (u8)."""
    if _VNNI:  # one vpshufb: a 16-entry table per 128-bit lane
        f = e.fn("llvm.x86.avx512.pshuf.b.512", _vec(64), [_vec(64), _vec(64)])
        return e.b.call(f, [e.const(_vec(64), _FP4_U * 4), n])
    return _fp4_u_arith(e.b, n)


def _gen_mxfp4(e: _Emit, w, o, ng, xq, xo, dx, bs, half):
    def codes(p):
        q = [e.load(w, e.b.add(p, e.i64(MXFP4_BYTES * i + 1)), _vec(16)) for i in range(4)]
        q = e.shuf(e.shuf(q[0], q[1], list(range(32))), e.shuf(q[2], q[3], list(range(32))), list(range(64)))
        lo = _fp4_u(e, e.b.and_(q, e.const(_vec(64), 15)))
        hi = _fp4_u(e, e.b.lshr(q, e.const(_vec(64), 4)))
        # block i: low nibbles are elements 0..15, high nibbles 16..31
        return (
            e.shuf(lo, hi, list(range(16)) + list(range(64, 80)) + list(range(16, 32)) + list(range(80, 96))),
            e.shuf(lo, hi, list(range(32, 48)) + list(range(96, 112)) + list(range(48, 64)) + list(range(112, 128))),
        )

    def scale(p):
        return e.b.load(e.b.gep(half, [e.b.zext(e.load(w, p, _I8), _I64)]))

    return _gen_block4(e, w, o, ng, xq, xo, dx, bs, half, size=MXFP4_BYTES, codes=codes, scale=scale, offset=_FP4_OFFSET)


def _gen_q4_k(e: _Emit, w, o, nb, xq, xo, dx, xs32, tab):
    """Σ over nb Q4_K super-blocks from byte o of w · activation from element xo (xs = xs32)."""
    b = e.b
    acc, acc2, accm = e.acc(16), e.acc(16), e.acc(8)
    v8 = _vec(8, 32)
    with cgutils.for_range(b, nb) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(Q4_K_BYTES)))
        xb = b.add(xo, b.mul(loop.index, e.i64(QK_K)))
        j = b.lshr(xb, e.i64(_LOG2_QK))
        d, dmin = e.half(w, p), e.half(w, b.add(p, e.i64(2)))
        # 6-bit scales / mins of the 8 sub-blocks, from the 12 bytes at p+4
        s = b.zext(e.load(w, b.add(p, e.i64(4)), _vec(16)), _vec(16, 32))
        hi2 = lambda idx: b.and_(b.lshr(e.shuf(s, None, idx), e.const(v8, 2)), e.const(v8, [0] * 4 + [48] * 4))  # noqa: E731
        sc = b.or_(b.and_(e.shuf(s, None, [0, 1, 2, 3, 8, 9, 10, 11]), e.const(v8, [63] * 4 + [15] * 4)), hi2([0, 0, 0, 0, 0, 1, 2, 3]))
        mv = b.lshr(e.shuf(s, None, [4, 5, 6, 7, 8, 9, 10, 11]), e.const(v8, [0] * 4 + [4] * 4))
        m = b.or_(b.and_(mv, e.const(v8, [63] * 4 + [15] * 4)), hi2([0, 0, 0, 0, 4, 5, 6, 7]))
        f8 = b.fmul(b.fmul(b.sitofp(sc, _fvec(8)), e.load(dx, j, _fvec(8))), _splat(b, d, 8))
        b.store(e.fma(b.fmul(b.sitofp(m, _fvec(8)), _splat(b, dmin, 8)), e.load(xs32, j, _fvec(8)), b.load(accm)), accm)
        a = [b.load(acc), b.load(acc2)]  # two chains: each FMA waits on the one before last
        for half in range(2):  # 32-byte chunks 2·half, 2·half+1 = sub-blocks 4·half .. 4·half+3
            q = e.load(w, b.add(p, e.i64(16 + 64 * half)), _vec(64))
            lo, hi = b.and_(q, e.const(_vec(64), 15)), b.lshr(q, e.const(_vec(64), 4))
            for k in range(2):  # sub-blocks (4h+2k, 4h+2k+1) = elements 128h + 64k .. +64
                u = e.shuf(lo, hi, list(range(32 * k, 32 * k + 32)) + list(range(64 + 32 * k, 96 + 32 * k)))
                x = e.load(xq, b.add(xb, e.i64(128 * half + 64 * k)), _vec(64))
                sb = 4 * half + 2 * k
                a[k] = e.fma(b.sitofp(e.dp(u, x), _fvec(16)), e.shuf(f8, None, [sb] * 8 + [sb + 1] * 8), a[k])
        b.store(a[0], acc)
        b.store(a[1], acc2)
    return b.fsub(e.hsum(b.fadd(b.load(acc), b.load(acc2))), e.hsum(b.load(accm)))


def _gen_q6_k(e: _Emit, w, o, nb, xq, xo, dx, xs16, tab):
    """Σ over nb Q6_K super-blocks from byte o of w · activation from element xo (xs = xs16)."""
    b = e.b
    acc, acc2, accm = e.acc(16), e.acc(16), e.acc(16)
    v64 = _vec(64)
    with cgutils.for_range(b, nb) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(Q6_K_BYTES)))
        xb = b.add(xo, b.mul(loop.index, e.i64(QK_K)))
        d = e.half(w, b.add(p, e.i64(208)))
        scd = b.fmul(b.sitofp(e.load(w, b.add(p, e.i64(192)), _vec(16)), _fvec(16)), _splat(b, d, 16))  # d·scale per 16
        b.store(e.fma(scd, e.load(xs16, b.lshr(xb, e.i64(_LOG2_QK - 1)), _fvec(16)), b.load(accm)), accm)
        dx8 = e.load(dx, b.lshr(xb, e.i64(_LOG2_QK)), _fvec(8))
        g16 = b.fmul(scd, e.shuf(dx8, None, [i // 2 for i in range(16)]))  # d·scale·dx per 16
        a = [b.load(acc), b.load(acc2)]  # two FMA chains
        for h in range(2):
            ql = e.load(w, b.add(p, e.i64(64 * h)), v64)
            qh = e.load(w, b.add(p, e.i64(128 + 32 * h)), _vec(32))
            sh = lambda n, qh=qh: b.lshr(qh, e.const(_vec(32), n))  # noqa: E731
            hb = (e.shuf(qh, sh(2), list(range(64))), e.shuf(sh(4), sh(6), list(range(64))))
            us = (b.and_(ql, e.const(v64, 15)), b.lshr(ql, e.const(v64, 4)))
            for k in range(2):  # elements 128h + 64k .. +64: planes 2k, 2k+1
                u = b.or_(us[k], b.shl(b.and_(hb[k], e.const(v64, 3)), e.const(v64, 4)))
                x = e.load(xq, b.add(xb, e.i64(128 * h + 64 * k)), v64)
                g = 4 * (2 * h + k)
                a[k] = e.fma(b.sitofp(e.dp(u, x), _fvec(16)), e.shuf(g16, None, [g + i // 4 for i in range(16)]), a[k])
        b.store(a[0], acc)
        b.store(a[1], acc2)
    return b.fsub(e.hsum(b.fadd(b.load(acc), b.load(acc2))), b.fmul(ir.Constant(_F32, 32.0), e.hsum(b.load(accm))))


_rowdot_q4_k = _rowdot(_gen_q4_k)
_rowdot_q6_k = _rowdot(_gen_q6_k)
_rowdot4_q8_0 = _rowdot(_gen_q8_0)
_rowdot4_mxfp4 = _rowdot(_gen_mxfp4)


# ---- activation quantization ---------------------------------------------


@njit(inline="always", boundscheck=False, error_model="numpy")
def _quantize_into(X, XQ, DX, BS, XS, XS32):
    """X f32 [T, C] → XQ int8 [T·C], DX f32 [T·C/32] (block scales), BS int32 [T·C/16] (sums of 16 codes),
    XS f32 [T·C/16] (dx·BS: Σ x̂ per 16), XS32 f32 [T·C/32] (Σ x̂ per 32).

    A block with a non-finite element gets dx = NaN (so its outputs are NaN);
    a block with amax < 2^-100 is flushed to zero (dx = 0).
    """
    T, C = X.shape
    nb = C // QK
    for t in range(T):
        for j in range(nb):
            xb = X[t, QK * j : QK * j + QK]
            amax = np.float32(0.0)
            finite = True
            for l in range(QK):
                a = abs(xb[l])
                finite = finite and np.isfinite(a)
                amax = a if a > amax else amax
            k = t * nb + j
            if not finite:
                DX[k] = np.float32(np.nan)
                inv = np.float32(0.0)
            elif amax < np.float32(2.0**-100):
                DX[k] = np.float32(0.0)
                inv = np.float32(0.0)
            else:
                DX[k] = amax / np.float32(127.0)
                inv = np.float32(127.0) / amax
            s0 = 0
            s1 = 0
            for l in range(QK):
                v = np.int32(np.rint(xb[l] * inv)) if inv != 0 else np.int32(0)
                XQ[k * QK + l] = v
                if l < QK // 2:
                    s0 += v
                else:
                    s1 += v
            BS[2 * k] = s0
            BS[2 * k + 1] = s1
            XS[2 * k] = DX[k] * np.float32(s0)
            XS[2 * k + 1] = DX[k] * np.float32(s1)
            XS32[k] = DX[k] * np.float32(s0 + s1)


@njit(cache=True, boundscheck=False, error_model="numpy", nogil=True)
def quantize_q8(X, XQ, DX, BS, XS, XS32):
    """The activation rounding alone (for effective_activation); see _quantize_into."""
    _quantize_into(X, XQ, DX, BS, XS, XS32)


@njit(inline="always")
def _prep(X):
    """X f32 [T, C] → the rounded activation arrays of _quantize_into, allocated here."""
    T, C = X.shape
    xq = np.empty(T * C, np.int8)
    dx = np.empty(T * C // QK, np.float32)
    bs = np.empty(T * C // (QK // 2), np.int32)
    xs = np.empty(T * C // (QK // 2), np.float32)
    xs32 = np.empty(T * C // QK, np.float32)
    _quantize_into(X, xq, dx, bs, xs, xs32)
    return xq, dx, bs, xs, xs32


# ---- per-row dots: one weight row (byte o) · one activation row (offset xo) ----
# xq int8 [T·C], dx f32 [T·C/32], bs int32 [T·C/16]; xo = t·C.


@njit(**INLINE)
def _row_q8_0(w, o, nb, xq, dx, bs, xo, f16):
    n4 = nb // 4
    acc = _rowdot4_q8_0(w, o, n4, xq, xo, dx, bs, f16)
    j0 = xo // QK
    for b in range(4 * n4, nb):
        p = o + Q8_0_BYTES * b
        j = np.uint64(j0 + b)
        s = _dot_q8(w, p + 2, xq, xo + QK * b) - 128 * (bs[2 * j] + bs[2 * j + 1])
        acc += f16_at(w, p, f16) * dx[j] * np.float32(s)
    return acc


@njit(**INLINE)
def _row_q5_0(w, o, nb, xq, dx, bs, xo, f16):
    acc = np.float32(0.0)
    j0 = xo // QK
    for b in range(nb):
        p = o + Q5_0_BYTES * b
        qh = np.int64(w[p + 2]) | (np.int64(w[p + 3]) << 8) | (np.int64(w[p + 4]) << 16) | (np.int64(w[p + 5]) << 24)
        j = np.uint64(j0 + b)
        s = _dot_q5_0(w, p + 6, qh, xq, xo + QK * b) - 16 * (bs[2 * j] + bs[2 * j + 1])
        acc += f16_at(w, p, f16) * dx[j] * np.float32(s)
    return acc


@njit(**INLINE)
def _row_mxfp4(w, o, nb, xq, dx, bs, xo, half):
    n4 = nb // 4
    acc = _rowdot4_mxfp4(w, o, n4, xq, xo, dx, bs, half)
    j0 = xo // QK
    for b in range(4 * n4, nb):
        p = o + MXFP4_BYTES * b
        j = np.uint64(j0 + b)
        s = _dot_fp4(w, p + 1, xq, xo + QK * b) - _FP4_OFFSET * (bs[2 * j] + bs[2 * j + 1])
        acc += half[w[np.uint64(p)]] * dx[j] * np.float32(s)
    return acc


# ---- drivers: out[t, r] = row r · activation row t ------------------------
# _mq_<t>(w u8[bytes], stride, X f32[T, C], table, out f32[T, R]); table is
# F16_TABLE (E8M0_HALF for MXFP4). The activation is rounded first (one
# thread, ~C/32 blocks), then rows are split across threads; each row's bytes
# stay in L1 while every activation row uses them.


@njit(**DRIVER)
def _mq_q8_0(w, stride, X, f16, out):
    T, C = X.shape
    R = out.shape[1]
    xq, dx, bs, xs, xs32 = _prep(X)
    for r in prange(R):
        for t in range(T):
            out[t, r] = _row_q8_0(w, r * stride, C // QK, xq, dx, bs, t * C, f16)


@njit(**DRIVER)
def _mq_q5_0(w, stride, X, f16, out):
    T, C = X.shape
    R = out.shape[1]
    xq, dx, bs, xs, xs32 = _prep(X)
    for r in prange(R):
        for t in range(T):
            out[t, r] = _row_q5_0(w, r * stride, C // QK, xq, dx, bs, t * C, f16)


@njit(**DRIVER)
def _mq_mxfp4(w, stride, X, half, out):
    T, C = X.shape
    R = out.shape[1]
    xq, dx, bs, xs, xs32 = _prep(X)
    for r in prange(R):
        for t in range(T):
            out[t, r] = _row_mxfp4(w, r * stride, C // QK, xq, dx, bs, t * C, half)


@njit(**DRIVER)
def _mq_q4_k(w, stride, X, f16, out):
    T, C = X.shape
    R = out.shape[1]
    xq, dx, bs, xs, xs32 = _prep(X)
    for r in prange(R):
        for t in range(T):
            out[t, r] = _rowdot_q4_k(w, r * stride, C // QK_K, xq, t * C, dx, xs32, f16)


@njit(**DRIVER)
def _mq_q6_k(w, stride, X, f16, out):
    T, C = X.shape
    R = out.shape[1]
    xq, dx, bs, xs, xs32 = _prep(X)
    for r in prange(R):
        for t in range(T):
            out[t, r] = _rowdot_q6_k(w, r * stride, C // QK_K, xq, t * C, dx, xs, f16)


# type name → (driver, whether it takes E8M0_HALF instead of F16_TABLE)
KERNELS = {
    "Q8_0": (_mq_q8_0, False),
    "Q5_0": (_mq_q5_0, False),
    "MXFP4": (_mq_mxfp4, True),
    "Q4_K": (_mq_q4_k, False),
    "Q6_K": (_mq_q6_k, False),
}
