"""Integer dot products against int8 activations: Q8_0, Q4_K, Q6_K, Q5_0, MXFP4.

For these types `matvec`/`matmul` quantize the activation to int8 per block of
32 (x̂ = dx·xq, dx = amax/127, xq = rint(x/dx), the q8_0 scheme llama.cpp
uses) and take each block's dot product on the raw small integers, scaling
once per (sub-)block:

    Σ_l w_l·x̂_l = dx · (d·sc·Σ_l u_l·xq_l − offset·Σ_l xq_l)

where u_l is the weight code made non-negative (Q8_0 q+128, Q6_K q, Q5_0
nib|hi<<4, MXFP4 2·E2M1+12, Q4_K nibble) and the offset term uses the
per-16 sums of xq computed once per call. Σ u·xq is exact in int32.

The block dot is one small LLVM IR function (`_dot_*` intrinsics below):
load 16/32 bytes of codes and activations as vectors, turn codes into u8
lanes, multiply zext(u)·sext(xq) in i32 and `llvm.vector.reduce.add`. That
is plain target-independent IR; on AVX-512 VNNI LLVM selects it to
`vpdpbusd` (64 byte products per instruction), on other x86 to pmaddwd, and
anywhere else to ordinary vector code. Written in numba-level Python the
same loop is typed in int64 (numba widens small ints), and LLVM then leaves
it scalar or widens to 32-bit lanes: 6–9 G weights/s against ~40 here (one
core, in cache).

Numerics: weights are decoded exactly; the activation is rounded to int8
(|x − x̂| ≤ dx/2 = amax₃₂/254 per element); the integer sums are exact and
the float scaling adds a few float32 roundings per block.
`effective_activation(x, qtype)` returns x̂. A non-finite activation block
gives NaN/inf outputs (dx = inf or NaN), as the float path would.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._common import DRIVER, E8M0_HALF, INLINE, f16_at, k_scale_min

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)


def _vec(n, bits=8):
    return ir.VectorType(ir.IntType(bits), n)


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
def _dot_nib(typingctx, w, wo, x, xo, shift):
    """Σ_{l<32} ((w[wo+l] >> shift) & 15)·x[xo+l] (Q4_K: one sub-block's nibbles)."""
    def codegen(context, builder, sig, args):
        q = _load(context, builder, sig.args[0], args[0], args[1], 32)
        sh = _splat(builder, builder.trunc(args[4], _I8), 32)
        u = builder.and_(builder.lshr(q, sh), ir.Constant(_vec(32), [15] * 32))
        return _dot(builder, u, _load(context, builder, sig.args[2], args[2], args[3], 32), 32)

    return types.int32(w, wo, x, xo, shift), codegen


@intrinsic
def _dot_q6(typingctx, w, lo, hi, x, xo, shl, shh):
    """Σ_{l<16} (((w[lo+l] >> shl) & 15) | (((w[hi+l] >> shh) & 3) << 4))·x[xo+l] (Q6_K, q before −32)."""
    def codegen(context, builder, sig, args):
        ql = _load(context, builder, sig.args[0], args[0], args[1], 16)
        qh = _load(context, builder, sig.args[0], args[0], args[2], 16)
        a = builder.and_(builder.lshr(ql, _splat(builder, builder.trunc(args[5], _I8), 16)), ir.Constant(_vec(16), [15] * 16))
        b = builder.and_(builder.lshr(qh, _splat(builder, builder.trunc(args[6], _I8), 16)), ir.Constant(_vec(16), [3] * 16))
        u = builder.or_(a, builder.shl(b, ir.Constant(_vec(16), [4] * 16)))
        return _dot(builder, u, _load(context, builder, sig.args[3], args[3], args[4], 16), 16)

    return types.int32(w, lo, hi, x, xo, shl, shh), codegen


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


@intrinsic
def _dot_fp4(typingctx, w, wo, x, xo):
    """Σ_{l<32} (2·E2M1(code_l) + 12)·x[xo+l] over an MXFP4 block's qs at wo."""
    def codegen(context, builder, sig, args):
        n = _nibbles32(builder, _load(context, builder, sig.args[0], args[0], args[1], 16))
        c = lambda v: ir.Constant(_vec(32), [v] * 32)  # noqa: E731
        m = builder.and_(n, c(7))
        # m < 4: m; else (2 | m&1) << (m>>1 − 1): 4 6 8 12
        big = builder.shl(builder.or_(builder.and_(m, c(1)), c(2)), builder.and_(builder.sub(builder.lshr(m, c(1)), c(1)), c(3)))
        mag = builder.select(builder.icmp_unsigned("<", m, c(4)), m, big)
        neg = builder.icmp_unsigned("!=", builder.and_(n, c(8)), c(0))
        u = builder.select(neg, builder.sub(c(12), mag), builder.add(c(12), mag))
        return _dot(builder, u, _load(context, builder, sig.args[2], args[2], args[3], 32), 32)

    return types.int32(w, wo, x, xo), codegen


# ---- activation quantization ---------------------------------------------


@njit(cache=True, boundscheck=False, error_model="numpy", nogil=True)
def quantize_q8(X, XQ, DX, BS):
    """X f32 [T, C] → XQ int8 [T·C], DX f32 [T·C/32] (block scales), BS int32 [T·C/16] (sums of 16 codes).

    A block with a non-finite element gets dx = NaN (so its outputs are NaN);
    a block with amax < 2^-100 is flushed to zero (dx = 0).
    """
    T, C = X.shape
    nb = C // 32
    for t in range(T):
        for j in range(nb):
            xb = X[t, 32 * j : 32 * j + 32]
            amax = np.float32(0.0)
            finite = True
            for l in range(32):
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
            for l in range(32):
                v = np.int32(np.rint(xb[l] * inv)) if inv != 0 else np.int32(0)
                XQ[k * 32 + l] = v
                if l < 16:
                    s0 += v
                else:
                    s1 += v
            BS[2 * k] = s0
            BS[2 * k + 1] = s1


# ---- per-row dots: one weight row (byte o) · one activation row (offset xo) ----
# xq int8 [T·C], dx f32 [T·C/32], bs int32 [T·C/16]; xo = t·C.


@njit(**INLINE)
def _row_q8_0(w, o, nb, xq, dx, bs, xo, f16):
    acc = np.float32(0.0)
    j0 = xo // 32
    for b in range(nb):
        p = o + 34 * b
        j = np.uint64(j0 + b)
        s = _dot_q8(w, p + 2, xq, xo + 32 * b) - 128 * (bs[2 * j] + bs[2 * j + 1])
        acc += f16_at(w, p, f16) * dx[j] * np.float32(s)
    return acc


@njit(**INLINE)
def _row_q5_0(w, o, nb, xq, dx, bs, xo, f16):
    acc = np.float32(0.0)
    j0 = xo // 32
    for b in range(nb):
        p = o + 22 * b
        qh = np.int64(w[p + 2]) | (np.int64(w[p + 3]) << 8) | (np.int64(w[p + 4]) << 16) | (np.int64(w[p + 5]) << 24)
        j = np.uint64(j0 + b)
        s = _dot_q5_0(w, p + 6, qh, xq, xo + 32 * b) - 16 * (bs[2 * j] + bs[2 * j + 1])
        acc += f16_at(w, p, f16) * dx[j] * np.float32(s)
    return acc


@njit(**INLINE)
def _row_mxfp4(w, o, nb, xq, dx, bs, xo, half):
    acc = np.float32(0.0)
    j0 = xo // 32
    for b in range(nb):
        p = o + 17 * b
        j = np.uint64(j0 + b)
        s = _dot_fp4(w, p + 1, xq, xo + 32 * b) - 12 * (bs[2 * j] + bs[2 * j + 1])
        acc += half[w[np.uint64(p)]] * dx[j] * np.float32(s)
    return acc


@njit(**INLINE)
def _row_q4_k(w, o, nb, xq, dx, bs, xo, f16):
    acc = np.float32(0.0)
    for b in range(nb):
        p = o + 144 * b
        sm = w[p + 4 : p + 16]
        accd = np.float32(0.0)
        accm = np.float32(0.0)
        for c in range(4):
            j = np.uint64((xo + 256 * b + 64 * c) // 32)  # x block of sub-block 2c
            sc0, m0 = k_scale_min(sm, 2 * c)
            sc1, m1 = k_scale_min(sm, 2 * c + 1)
            s0 = _dot_nib(w, p + 16 + 32 * c, xq, 32 * j, 0)
            s1 = _dot_nib(w, p + 16 + 32 * c, xq, 32 * j + 32, 4)
            accd += dx[j] * (sc0 * np.float32(s0)) + dx[j + 1] * (sc1 * np.float32(s1))
            accm += dx[j] * (m0 * np.float32(bs[2 * j] + bs[2 * j + 1])) + dx[j + 1] * (m1 * np.float32(bs[2 * j + 2] + bs[2 * j + 3]))
        acc += f16_at(w, p, f16) * accd - f16_at(w, p + 2, f16) * accm
    return acc


@njit(**INLINE)
def _row_q6_k(w, o, nb, xq, dx, bs, xo, f16):
    wi = w.view(np.int8)
    acc = np.float32(0.0)
    for b in range(nb):
        p = o + 210 * b
        accd = np.float32(0.0)
        for h in range(2):
            for k in range(4):
                j = np.uint64((xo + 256 * b + 128 * h + 32 * k) // 32)
                s = p + 192 + 8 * h + 2 * k
                lo = p + 64 * h + 32 * (k & 1)
                hi = p + 128 + 32 * h
                sh = 4 * (k >> 1)
                s0 = _dot_q6(w, lo, hi, xq, 32 * j, sh, 2 * k) - 32 * bs[2 * j]
                s1 = _dot_q6(w, lo + 16, hi + 16, xq, 32 * j + 16, sh, 2 * k) - 32 * bs[2 * j + 1]
                accd += dx[j] * np.float32(np.int32(wi[np.uint64(s)]) * s0 + np.int32(wi[np.uint64(s + 1)]) * s1)
        acc += f16_at(w, p + 208, f16) * accd
    return acc


# ---- drivers: out[t, r] = row r · activation row t ------------------------
# _mq_<t>(w u8[bytes], stride, C, xq, dx, bs, table, out f32[T, R]); table is
# F16_TABLE (E8M0_HALF for MXFP4). Rows are split across threads; each row's
# bytes stay in L1 while every activation row uses them.


@njit(**DRIVER)
def _mq_q8_0(w, stride, C, xq, dx, bs, f16, out):
    T, R = out.shape
    for r in prange(R):
        for t in range(T):
            out[t, r] = _row_q8_0(w, r * stride, C // 32, xq, dx, bs, t * C, f16)


@njit(**DRIVER)
def _mq_q5_0(w, stride, C, xq, dx, bs, f16, out):
    T, R = out.shape
    for r in prange(R):
        for t in range(T):
            out[t, r] = _row_q5_0(w, r * stride, C // 32, xq, dx, bs, t * C, f16)


@njit(**DRIVER)
def _mq_mxfp4(w, stride, C, xq, dx, bs, half, out):
    T, R = out.shape
    for r in prange(R):
        for t in range(T):
            out[t, r] = _row_mxfp4(w, r * stride, C // 32, xq, dx, bs, t * C, half)


@njit(**DRIVER)
def _mq_q4_k(w, stride, C, xq, dx, bs, f16, out):
    T, R = out.shape
    for r in prange(R):
        for t in range(T):
            out[t, r] = _row_q4_k(w, r * stride, C // 256, xq, dx, bs, t * C, f16)


@njit(**DRIVER)
def _mq_q6_k(w, stride, C, xq, dx, bs, f16, out):
    T, R = out.shape
    for r in prange(R):
        for t in range(T):
            out[t, r] = _row_q6_k(w, r * stride, C // 256, xq, dx, bs, t * C, f16)


# type name → (driver, whether it takes E8M0_HALF instead of F16_TABLE)
KERNELS = {
    "Q8_0": (_mq_q8_0, False),
    "Q5_0": (_mq_q5_0, False),
    "MXFP4": (_mq_mxfp4, True),
    "Q4_K": (_mq_q4_k, False),
    "Q6_K": (_mq_q6_k, False),
}
