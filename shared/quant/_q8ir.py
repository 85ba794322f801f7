"""The LLVM IR of the int8-activation row dots (the drivers and the activation rounding: _q8).

One generator per type emits the loop over a weight row's blocks; the
intrinsic made from it (`rowdot(gen, nt)`) multiplies that row by `nt`
activation rows at once. Each block's integer codes are unpacked once into
u8 vectors laid out like the activation, then every activation row takes its
own integer dots, scale factors and accumulators. The float operations of
activation row i are the same whatever `nt` is, in the same order (the
per-row chains are independent; nothing here carries fast-math flags, so
LLVM may not reorder them): a row of a several-row call equals the one-row
call bit for bit, and decode (nt = 1) and prefill (nt = 4, 2) agree.

Q4_K, Q6_K (per 256-weight super-block): the codes become four 64-byte u8
vectors (Q4_K: low/high nibble planes interleaved by a lane shuffle; Q6_K:
nibbles | 2-bit planes << 4), each multiplied with 64 activation bytes by one
`vpdpbusd` (u8·i8, sums of 4 in 16 int32 lanes), converted to float and
FMA'd into two 16-lane accumulators per activation row with a per-lane factor
d·scale·dx. Scales and mins of all sub-blocks are decoded as one vector per
super-block; the offset term (Q4_K dmin·m, Q6_K the −32) is an 8/16-lane FMA
against xs32/xs16. Nothing is reduced horizontally until the row ends.

Q8_0, MXFP4 (single scale per 32): 4 blocks per step, two vpdpbusd, a
shuffle-add tree to the 4 block sums, the code offset subtracted in exact
int32 per block (an all-zero-weight block gives exactly 0), one 4-lane FMA;
MXFP4 maps E2M1 codes with one `vpshufb`. The < 4-block tail and Q5_0 take
one 32-lane block dot each (`zext(u)·sext(xq)` + `llvm.vector.reduce.add`)
and a scalar multiply-add.

Where the CPU numba compiles for has AVX-512 VNNI (`INT8_DOT` = "vnni") the
64-byte dot is the `llvm.x86.avx512.vpdpbusd.512` intrinsic and the MXFP4
code map one `vpshufb`. On aarch64 with the dot-product extension
(FEAT_DotProd: HWCAP `asimddp`, LLVM `+dotprod`; `INT8_DOT` = "sdot") it is
four `llvm.aarch64.neon.sdot` on 16-byte quarters (i8·i8, sums of 4 into 4
int32 lanes each): codes below 128 (Q4_K, Q6_K, MXFP4) go in as they are;
the u8 codes of Q8_0 (q + 128) go in as q (xor 0x80) and 128·Σ4 xq (one more
sdot against ones) is added back, so every branch returns the same integer
sums. Anywhere else (`INT8_DOT` = "portable", also forced
by NUMBA_CPU_NAME=generic) both are target-independent IR (products in int32,
pairwise adds; the code map by arithmetic): the same integer sums, only
slower (the float scaling may round differently in the last bit, as LLVM
schedules it differently). Written in numba-level Python the same
loop is typed in int64 (numba widens small ints), and LLVM then leaves it
scalar or widens to 32-bit lanes: 6–9 G weights/s for a block dot, against
25–35 G weights/s for the whole-row kernels here (one core, in cache).

numba's disk cache keys a driver on its own source file (_q8.py), not on the
IR it inlines from here: after editing this module, touch _q8.py (CI hashes
both, .ci/run).
"""

from __future__ import annotations

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
_F16C = "+f16c" in _FEATURES
INT8_DOT = "vnni" if _VNNI else "sdot" if _SDOT else "portable"


def _vec(n, bits=8):
    return ir.VectorType(ir.IntType(bits), n)


def _fvec(n):
    return ir.VectorType(_F32, n)


def _splat(builder, v, n):
    t = ir.VectorType(v.type, n)
    s = builder.insert_element(ir.Constant(t, None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(s, ir.Constant(t, None), ir.Constant(_vec(n, 32), [0] * n))


def _dot(builder, u, xq, n):
    """Σ zext(u)·sext(xq) over n u8/i8 lanes → i32."""
    prod = builder.mul(builder.zext(u, _vec(n, 32)), builder.sext(xq, _vec(n, 32)))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_vec(n, 32)]), f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(fn, [prod])


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

    def dp(self, u, x, below128: bool = False):
        """<16 x i32>: lane i = Σ_{k<4} zext(u[4i+k])·sext(x[4i+k]) for 64 u8 (u) / i8 (x) lanes.
        `below128`: every u is < 128 (so it is also its own i8: one sdot on aarch64)."""
        zero = ir.Constant(_vec(16, 32), [0] * 16)
        if _VNNI:
            f = self.fn("llvm.x86.avx512.vpdpbusd.512", _vec(16, 32), [_vec(16, 32)] * 3)
            return self.b.call(f, [zero, self.b.bitcast(u, _vec(16, 32)), self.b.bitcast(x, _vec(16, 32))])
        if _SDOT:
            return self._sdot64(u, x, below128)
        p = self.b.mul(self.b.zext(u, _vec(64, 32)), self.b.sext(x, _vec(64, 32)))
        p = self.b.add(self.shuf(p, None, list(range(0, 64, 2))), self.shuf(p, None, list(range(1, 64, 2))))
        return self.b.add(self.shuf(p, None, list(range(0, 32, 2))), self.shuf(p, None, list(range(1, 32, 2))))

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

    def hsum(self, v):
        """Σ lanes of a float vector, as a fixed pairwise tree."""
        n = v.type.count
        while n > 1:
            n //= 2
            v = self.b.fadd(self.shuf(v, None, list(range(n))), self.shuf(v, None, list(range(n, 2 * n))))
        return self.b.extract_element(v, ir.Constant(_I32, 0))

    def acc(self, n):
        return cgutils.alloca_once_value(self.b, ir.Constant(_fvec(n), [0.0] * n) if n else ir.Constant(_F32, 0.0))

    def block_sum(self, bs, j):
        """Σ xq over 32-block j (two int32 sums of 16 at 2j, 2j+1)."""
        two = self.b.shl(j, self.i64(1))
        return self.b.add(self.load(bs, two, _I32), self.load(bs, self.b.add(two, self.i64(1)), _I32))


def rowdot(gen, nt: int):
    """An intrinsic `f(w, o, n, xq, xo, cs, dx, s, tab, out, oo, os)` from an IR body generator.

    One weight row (w u8, at byte o, n blocks or super-blocks) times `nt`
    activation rows: row i of the int8 activation xq starts at element
    xo + i·cs, dx are its per-32 scales, s a per-call sum array and tab a
    lookup table (as the generator needs; unused ones are passed anyway so
    every kernel has the same shape). Result i goes to element oo + i·os of
    the float32 array `out` (flat index; out[t, r] of a C-contiguous [T, R] is
    t·R + r).
    """

    def typer(typingctx, w, o, n, xq, xo, cs, dx, s, tab, out, oo, os):
        def codegen(context, builder, sig, args):
            e = _Emit(context, builder)
            o_, n_, xo_, cs_, oo_, os_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4, 5, 10, 11))
            ptr = [e.data(sig.args[i], args[i]) for i in (0, 3, 6, 7, 8, 9)]
            res = gen(e, ptr[0], o_, n_, ptr[1], xo_, cs_, ptr[2], ptr[3], ptr[4], nt)
            for i, v in enumerate(res):
                builder.store(v, builder.gep(ptr[5], [builder.add(oo_, builder.mul(os_, e.i64(i)))]))
            return context.get_dummy_value()

        return types.void(w, o, n, xq, xo, cs, dx, s, tab, out, oo, os), codegen

    typer.__name__ = f"{gen.__name__}_x{nt}"
    return intrinsic(typer)


def _rows(e: _Emit, xb, cs, nt):
    """Element offsets of the nt activation rows' copies of position xb."""
    return [xb if i == 0 else e.b.add(xb, e.b.mul(cs, e.i64(i))) for i in range(nt)]


def _block4_sums(e: _Emit, lo, hi):
    """Two <16 x i32> dot vectors (8 lanes per 32-block: blocks 0,1 and 2,3) → <4 x i32> block sums."""
    b = e.b
    s = b.add(
        e.shuf(lo, hi, [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]),
        e.shuf(lo, hi, [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]),
    )
    s = b.add(e.shuf(s, None, [0, 1, 4, 5, 8, 9, 12, 13]), e.shuf(s, None, [2, 3, 6, 7, 10, 11, 14, 15]))
    return b.add(e.shuf(s, None, [0, 2, 4, 6]), e.shuf(s, None, [1, 3, 5, 7]))


def _gen_blocks(e: _Emit, w, o, nb, xq, xo, cs, dx, bs, nt, *, size, codes4, codes1, scale, offset):
    """Σ over nb single-scale 32-blocks: Σ_blocks scale·dx·(Σ u·xq − offset·Σ xq), per activation row.

    Groups of 4 blocks first (`codes4(p)` → two <64 x i8> u vectors, blocks
    0,1 and 2,3 of the group at byte p), then the < 4 left one at a time
    (`codes1(p)` → <32 x i8>). The block sums are reduced and offset-corrected
    in exact int32 before any float rounding (so an all-zero-weight block
    contributes exactly 0).
    """
    b = e.b
    ng = b.lshr(nb, e.i64(2))
    accs = [e.acc(4) for _ in range(nt)]
    with cgutils.for_range(b, ng) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(4 * size)))
        u01, u23 = codes4(p)
        sc = ir.Constant(_fvec(4), None)
        for k in range(4):
            sc = b.insert_element(sc, scale(b.add(p, e.i64(size * k))), ir.Constant(_I32, k))
        for i, xb in enumerate(_rows(e, b.add(xo, b.mul(loop.index, e.i64(4 * QK))), cs, nt)):
            j = b.lshr(xb, e.i64(_LOG2_QK))
            small = offset < 128  # MXFP4's codes (≤ 24); Q8_0's q + 128 are not
            dots = _block4_sums(e, e.dp(u01, e.load(xq, xb, _vec(64)), small), e.dp(u23, e.load(xq, b.add(xb, e.i64(64)), _vec(64)), small))
            bs8 = e.load(bs, b.shl(j, e.i64(1)), _vec(8, 32))  # Σ xq per 16 → per 32
            bsum = b.add(e.shuf(bs8, None, [0, 2, 4, 6]), e.shuf(bs8, None, [1, 3, 5, 7]))
            ints = b.sub(dots, b.mul(bsum, e.const(_vec(4, 32), offset)))
            f = b.fmul(sc, e.load(dx, j, _fvec(4)))
            b.store(e.fma(b.sitofp(ints, _fvec(4)), f, b.load(accs[i])), accs[i])
    sums = [cgutils.alloca_once_value(b, e.hsum(b.load(a))) for a in accs]
    with cgutils.for_range(b, nb, start=b.shl(ng, e.i64(2))) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(size)))
        u = codes1(p)
        d = scale(p)
        for i, xb in enumerate(_rows(e, b.add(xo, b.mul(loop.index, e.i64(QK))), cs, nt)):
            j = b.lshr(xb, e.i64(_LOG2_QK))
            s = b.sub(_dot(b, u, e.load(xq, xb, _vec(32)), 32), b.mul(e.block_sum(bs, j), ir.Constant(_I32, offset)))
            b.store(b.fadd(b.load(sums[i]), b.fmul(b.fmul(d, e.load(dx, j, _F32)), b.sitofp(s, _F32))), sums[i])
    return [b.load(s) for s in sums]


def _gen_q8_0(e: _Emit, w, o, nb, xq, xo, cs, dx, bs, tab, nt):
    flip = e.const(_vec(64), 0x80)  # int8 q → u8 q + 128

    def codes4(p):
        q = [e.load(w, e.b.add(p, e.i64(Q8_0_BYTES * i + 2)), _vec(32)) for i in range(4)]
        return (e.b.xor(e.shuf(q[0], q[1], list(range(64))), flip), e.b.xor(e.shuf(q[2], q[3], list(range(64))), flip))

    def codes1(p):
        return e.b.xor(e.load(w, e.b.add(p, e.i64(2)), _vec(32)), e.const(_vec(32), 0x80))

    return _gen_blocks(
        e, w, o, nb, xq, xo, cs, dx, bs, nt, size=Q8_0_BYTES, codes4=codes4, codes1=codes1, scale=lambda p: e.half(w, p), offset=128
    )


def _fp4_u(e: _Emit, n):
    """<64 x i8> E2M1 codes (0..15) → 2·value + 12 (u8)."""
    if _VNNI:  # one vpshufb: a 16-entry table per 128-bit lane
        f = e.fn("llvm.x86.avx512.pshuf.b.512", _vec(64), [_vec(64), _vec(64)])
        return e.b.call(f, [e.const(_vec(64), _FP4_U * 4), n])
    return _fp4_u_arith(e.b, n)


def _gen_mxfp4(e: _Emit, w, o, nb, xq, xo, cs, dx, bs, half, nt):
    def codes4(p):
        q = [e.load(w, e.b.add(p, e.i64(MXFP4_BYTES * i + 1)), _vec(16)) for i in range(4)]
        q = e.shuf(e.shuf(q[0], q[1], list(range(32))), e.shuf(q[2], q[3], list(range(32))), list(range(64)))
        lo = _fp4_u(e, e.b.and_(q, e.const(_vec(64), 15)))
        hi = _fp4_u(e, e.b.lshr(q, e.const(_vec(64), 4)))
        # block i: low nibbles are elements 0..15, high nibbles 16..31
        return (
            e.shuf(lo, hi, list(range(16)) + list(range(64, 80)) + list(range(16, 32)) + list(range(80, 96))),
            e.shuf(lo, hi, list(range(32, 48)) + list(range(96, 112)) + list(range(48, 64)) + list(range(112, 128))),
        )

    def codes1(p):
        return _fp4_u_arith(e.b, _nibbles32(e.b, e.load(w, e.b.add(p, e.i64(1)), _vec(16))))

    def scale(p):
        return e.b.load(e.b.gep(half, [e.b.zext(e.load(w, p, _I8), _I64)]))

    return _gen_blocks(e, w, o, nb, xq, xo, cs, dx, bs, nt, size=MXFP4_BYTES, codes4=codes4, codes1=codes1, scale=scale, offset=_FP4_OFFSET)


def _gen_q5_0(e: _Emit, w, o, nb, xq, xo, cs, dx, bs, tab, nt):
    """Σ over nb Q5_0 blocks: d·dx·(Σ (nibble | high bit << 4)·xq − 16·Σ xq), one block at a time."""
    b = e.b
    sums = [e.acc(0) for _ in range(nt)]
    with cgutils.for_range(b, nb) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(Q5_0_BYTES)))
        d = e.half(w, p)
        nib = _nibbles32(b, e.load(w, b.add(p, e.i64(6)), _vec(16)))
        qh = e.load(w, b.add(p, e.i64(2)), _I32)
        bits = b.lshr(_splat(b, qh, 32), ir.Constant(_vec(32, 32), list(range(32))))
        hb = b.trunc(b.and_(bits, ir.Constant(_vec(32, 32), [1] * 32)), _vec(32))
        u = b.or_(nib, b.shl(hb, e.const(_vec(32), 4)))
        for i, xb in enumerate(_rows(e, b.add(xo, b.mul(loop.index, e.i64(QK))), cs, nt)):
            j = b.lshr(xb, e.i64(_LOG2_QK))
            s = b.sub(_dot(b, u, e.load(xq, xb, _vec(32)), 32), b.mul(e.block_sum(bs, j), ir.Constant(_I32, 16)))
            b.store(b.fadd(b.load(sums[i]), b.fmul(b.fmul(d, e.load(dx, j, _F32)), b.sitofp(s, _F32))), sums[i])
    return [b.load(s) for s in sums]


def _gen_q4_k(e: _Emit, w, o, nb, xq, xo, cs, dx, xs32, tab, nt):
    """Σ over nb Q4_K super-blocks from byte o of w · activation rows from element xo (xs = xs32)."""
    return _gen_q45_k(e, w, o, nb, xq, xo, cs, dx, xs32, nt, size=Q4_K_BYTES, codes_at=16, fifth_bit_at=None)


def _gen_q5_k(e: _Emit, w, o, nb, xq, xo, cs, dx, xs32, tab, nt):
    """Q5_K: Q4_K's layout with the 32 bytes of fifth bits (qh) before the nibbles; element
    64c + l takes bit 2c of qh[l], element 64c + 32 + l bit 2c + 1 (codes 0..31 < 128)."""
    return _gen_q45_k(e, w, o, nb, xq, xo, cs, dx, xs32, nt, size=Q5_K_BYTES, codes_at=48, fifth_bit_at=16)


def _gen_q45_k(e: _Emit, w, o, nb, xq, xo, cs, dx, xs32, nt, *, size, codes_at, fifth_bit_at):
    """Σ over nb Q4_K/Q5_K super-blocks (d, dmin, 12 bytes of 6-bit scales and mins at 4, the
    nibbles at `codes_at`, Q5_K's fifth bits at `fifth_bit_at`)."""
    b = e.b
    accs = [(e.acc(16), e.acc(16), e.acc(8)) for _ in range(nt)]
    v8 = _vec(8, 32)
    with cgutils.for_range(b, nb) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(size)))
        d, dmin = e.half(w, p), e.half(w, b.add(p, e.i64(2)))
        # 6-bit scales / mins of the 8 sub-blocks, from the 12 bytes at p+4
        s = b.zext(e.load(w, b.add(p, e.i64(4)), _vec(16)), _vec(16, 32))
        hi2 = lambda idx: b.and_(b.lshr(e.shuf(s, None, idx), e.const(v8, 2)), e.const(v8, [0] * 4 + [48] * 4))  # noqa: E731
        sc = b.or_(b.and_(e.shuf(s, None, [0, 1, 2, 3, 8, 9, 10, 11]), e.const(v8, [63] * 4 + [15] * 4)), hi2([0, 0, 0, 0, 0, 1, 2, 3]))
        mv = b.lshr(e.shuf(s, None, [4, 5, 6, 7, 8, 9, 10, 11]), e.const(v8, [0] * 4 + [4] * 4))
        m = b.or_(b.and_(mv, e.const(v8, [63] * 4 + [15] * 4)), hi2([0, 0, 0, 0, 4, 5, 6, 7]))
        scf, dmm = b.sitofp(sc, _fvec(8)), b.fmul(b.sitofp(m, _fvec(8)), _splat(b, dmin, 8))
        us = []  # (sub-blocks 2c, 2c+1) as 64 u8 lanes in activation order, c = 2·half + k
        for half in range(2):  # 32-byte chunks 2·half, 2·half+1 = sub-blocks 4·half .. 4·half+3
            q = e.load(w, b.add(p, e.i64(codes_at + 64 * half)), _vec(64))
            lo, hi = b.and_(q, e.const(_vec(64), 15)), b.lshr(q, e.const(_vec(64), 4))
            us += [e.shuf(lo, hi, list(range(32 * k, 32 * k + 32)) + list(range(64 + 32 * k, 96 + 32 * k))) for k in range(2)]
        if fifth_bit_at is not None:
            qh = e.load(w, b.add(p, e.i64(fifth_bit_at)), _vec(32))
            one = e.const(_vec(32), 1)
            for c in range(4):
                bits = [b.and_(b.lshr(qh, e.const(_vec(32), 2 * c + k)), one) for k in range(2)]
                us[c] = b.or_(us[c], b.shl(e.shuf(bits[0], bits[1], list(range(64))), e.const(_vec(64), 4)))
        for (acc, acc2, accm), xb in zip(accs, _rows(e, b.add(xo, b.mul(loop.index, e.i64(QK_K))), cs, nt), strict=True):
            j = b.lshr(xb, e.i64(_LOG2_QK))
            f8 = b.fmul(b.fmul(scf, e.load(dx, j, _fvec(8))), _splat(b, d, 8))
            b.store(e.fma(dmm, e.load(xs32, j, _fvec(8)), b.load(accm)), accm)
            a = [b.load(acc), b.load(acc2)]  # two chains: each FMA waits on the one before last
            for c in range(4):  # elements 64c .. 64c+64; chain k = c % 2
                x = e.load(xq, b.add(xb, e.i64(64 * c)), _vec(64))
                a[c % 2] = e.fma(b.sitofp(e.dp(us[c], x, True), _fvec(16)), e.shuf(f8, None, [2 * c] * 8 + [2 * c + 1] * 8), a[c % 2])
            b.store(a[0], acc)
            b.store(a[1], acc2)
    return [b.fsub(e.hsum(b.fadd(b.load(acc), b.load(acc2))), e.hsum(b.load(accm))) for acc, acc2, accm in accs]


def _gen_q6_k(e: _Emit, w, o, nb, xq, xo, cs, dx, xs16, tab, nt):
    """Σ over nb Q6_K super-blocks from byte o of w · activation rows from element xo (xs = xs16)."""
    b = e.b
    accs = [(e.acc(16), e.acc(16), e.acc(16)) for _ in range(nt)]
    v64 = _vec(64)
    with cgutils.for_range(b, nb) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(Q6_K_BYTES)))
        d = e.half(w, b.add(p, e.i64(208)))
        scd = b.fmul(b.sitofp(e.load(w, b.add(p, e.i64(192)), _vec(16)), _fvec(16)), _splat(b, d, 16))  # d·scale per 16
        us = []  # elements 64c .. 64c+64 as 64 u8 lanes, c = 2h + k: planes 2k, 2k+1 of half h
        for h in range(2):
            ql = e.load(w, b.add(p, e.i64(64 * h)), v64)
            qh = e.load(w, b.add(p, e.i64(128 + 32 * h)), _vec(32))
            sh = lambda n, qh=qh: b.lshr(qh, e.const(_vec(32), n))  # noqa: E731
            hb = (e.shuf(qh, sh(2), list(range(64))), e.shuf(sh(4), sh(6), list(range(64))))
            lo4 = (b.and_(ql, e.const(v64, 15)), b.lshr(ql, e.const(v64, 4)))
            us += [b.or_(lo4[k], b.shl(b.and_(hb[k], e.const(v64, 3)), e.const(v64, 4))) for k in range(2)]
        for (acc, acc2, accm), xb in zip(accs, _rows(e, b.add(xo, b.mul(loop.index, e.i64(QK_K))), cs, nt), strict=True):
            b.store(e.fma(scd, e.load(xs16, b.lshr(xb, e.i64(_LOG2_QK - 1)), _fvec(16)), b.load(accm)), accm)
            dx8 = e.load(dx, b.lshr(xb, e.i64(_LOG2_QK)), _fvec(8))
            g16 = b.fmul(scd, e.shuf(dx8, None, [i // 2 for i in range(16)]))  # d·scale·dx per 16
            a = [b.load(acc), b.load(acc2)]  # two FMA chains
            for c in range(4):
                x = e.load(xq, b.add(xb, e.i64(64 * c)), v64)
                a[c % 2] = e.fma(
                    b.sitofp(e.dp(us[c], x, True), _fvec(16)), e.shuf(g16, None, [4 * c + i // 4 for i in range(16)]), a[c % 2]
                )
            b.store(a[0], acc)
            b.store(a[1], acc2)
    return [
        b.fsub(e.hsum(b.fadd(b.load(acc), b.load(acc2))), b.fmul(ir.Constant(_F32, 32.0), e.hsum(b.load(accm)))) for acc, acc2, accm in accs
    ]


# IQ4_XS code → its code-book value + 128 ≥ 1 (u8 lanes for the u8·i8 dot; the kernel
# subtracts 128·Σ xq again, exactly, per 32-block).
_IQ4_OFFSET = 128
_IQ4_U = [_IQ4_OFFSET + v for v in IQ4_NL_VALUES]


def _iq4_u(e: _Emit, n):
    """<64 x i8> codes (0..15) → code-book value + 128 (u8)."""
    if _VNNI:  # one vpshufb: a 16-entry table per 128-bit lane
        f = e.fn("llvm.x86.avx512.pshuf.b.512", _vec(64), [_vec(64), _vec(64)])
        return e.b.call(f, [e.const(_vec(64), _IQ4_U * 4), n])
    out = e.const(_vec(64), _IQ4_U[0])  # any target: one select per code value
    for code in range(1, 16):
        out = e.b.select(e.b.icmp_unsigned("==", n, e.const(_vec(64), code)), e.const(_vec(64), _IQ4_U[code]), out)
    return out


def _gen_iq4_xs(e: _Emit, w, o, nb, xq, xo, cs, dx, bs, tab, nt):
    """Σ over nb IQ4_XS super-blocks (d, 2 bytes of scale high bits, 4 of low nibbles, then
    16 nibble bytes per 32-block: low nibbles elements 0..15, high 16..31): per 32-block
    d·(ls − 32)·dx·(Σ u·xq − 128·Σ xq), the integer part exact, 4 blocks per vector step."""
    b = e.b
    accs = [e.acc(4) for _ in range(nt)]
    v8 = _vec(8, 32)
    with cgutils.for_range(b, nb) as loop:
        p = b.add(o, b.mul(loop.index, e.i64(IQ4_XS_BYTES)))
        d = e.half(w, p)
        low = b.zext(e.load(w, b.add(p, e.i64(4)), _vec(4)), _vec(4, 32))
        low = b.and_(b.lshr(e.shuf(low, None, [0, 0, 1, 1, 2, 2, 3, 3]), e.const(v8, [0, 4] * 4)), e.const(v8, 15))
        high = b.lshr(_splat(b, b.zext(e.load(w, b.add(p, e.i64(2)), _I16), _I32), 8), e.const(v8, list(range(0, 16, 2))))
        ls = b.or_(low, b.shl(b.and_(high, e.const(v8, 3)), e.const(v8, 4)))
        sc = b.fmul(b.sitofp(b.sub(ls, e.const(v8, 32)), _fvec(8)), _splat(b, d, 8))  # d·(ls − 32) per 32-block
        us = []
        for g in range(2):  # blocks 4g .. 4g+3
            q = e.load(w, b.add(p, e.i64(8 + 64 * g)), _vec(64))
            lo = _iq4_u(e, b.and_(q, e.const(_vec(64), 15)))
            hi = _iq4_u(e, b.lshr(q, e.const(_vec(64), 4)))
            us.append(e.shuf(lo, hi, list(range(16)) + list(range(64, 80)) + list(range(16, 32)) + list(range(80, 96))))
            us.append(e.shuf(lo, hi, list(range(32, 48)) + list(range(96, 112)) + list(range(48, 64)) + list(range(112, 128))))
        for i, xb in enumerate(_rows(e, b.add(xo, b.mul(loop.index, e.i64(QK_K))), cs, nt)):
            acc = b.load(accs[i])
            for g in range(2):
                xg = b.add(xb, e.i64(128 * g))
                j = b.lshr(xg, e.i64(_LOG2_QK))
                dots = _block4_sums(
                    e, e.dp(us[2 * g], e.load(xq, xg, _vec(64))), e.dp(us[2 * g + 1], e.load(xq, b.add(xg, e.i64(64)), _vec(64)))
                )
                bs8 = e.load(bs, b.shl(j, e.i64(1)), _vec(8, 32))  # Σ xq per 16 → per 32
                bsum = b.add(e.shuf(bs8, None, [0, 2, 4, 6]), e.shuf(bs8, None, [1, 3, 5, 7]))
                ints = b.sub(dots, b.mul(bsum, e.const(_vec(4, 32), _IQ4_OFFSET)))
                f = b.fmul(e.shuf(sc, None, [4 * g, 4 * g + 1, 4 * g + 2, 4 * g + 3]), e.load(dx, j, _fvec(4)))
                acc = e.fma(b.sitofp(ints, _fvec(4)), f, acc)
            b.store(acc, accs[i])
    return [e.hsum(b.load(a)) for a in accs]


# Activation rows per intrinsic call: 4 (a tile), 2 and 1 (what a tile leaves).
# Four rows keep 4 × 3 accumulators and the block's 4 code vectors in
# registers (32 zmm); more would spill.
TILE_TOKENS = 4
GENERATORS = {
    "Q8_0": _gen_q8_0,
    "Q5_0": _gen_q5_0,
    "MXFP4": _gen_mxfp4,
    "Q4_K": _gen_q4_k,
    "Q5_K": _gen_q5_k,
    "Q6_K": _gen_q6_k,
    "IQ4_XS": _gen_iq4_xs,
}
