"""The LLVM IR of attention's products, as numba intrinsics (the drivers: attend.py).

    keys_t(k, h, c0, a, c1, base, kt)
        kt[c·32 + j − c0] = key j of kv head h as float32, j = a..c1-1 (k [Hk, cap, d], f32 or f16 bits)
    qk_softmax(q, qoff, lo, hi, nq, kt, d, scale, m, l, r0, alpha, p)
        rows i < nq ≤ 8: scores s_j = scale · Σ_c q[qoff[i] + c] · kt[c·32 + j] for lo[i] ≤ j < hi[i],
        then the online-softmax step: m and the 16 lanes of l of row r0 + i updated, alpha[i], weights p[32·i + j]
    values_f32(v, h, c0, a, c1, base, rows, dv)
        rows[(j − c0)·dv + c] = the first dv columns of value j of kv head h as float32, j = a..c1-1
    pv_rows(p, pj, nr, alpha, v, vo, vs, nk, dv, o, ooff)
        o[ooff[i] + c] = o·alpha[i] + Σ_j p[32·i + pj + j] · v[(vo + j)·vs + c]   i < nr ≤ 8, j in order

Offsets and strides count float32 elements of the arrays' data; d and dv are
multiples of LANES. numba-level loops could not keep a tile's sums in
registers (every step went through memory: ~1 multiply-add per cycle where
the CPU does two); here they are SSA values.

Scores take a chunk of 32 keys transposed (keys in the lanes: 16 × 16 or, on
256-bit vectors, 8 × 8 keys × columns loaded, widened from f16, and transposed in
registers at a time), so a
tile of Q_ROWS query rows × 32 keys is 2·Q_ROWS accumulators, each step one query element
broadcast against two vectors of keys: no reduction across lanes for the
products. The softmax step then works on those registers: the row's max and
sum across its 32 lanes (fixed trees), exp on 16 lanes at a time.

Every row's numbers are fixed by the row and the chunk alone, never by the
tile it is in or by the target (no fast-math flags; llvm.fma rounds once in a
vector lane or alone), which is what lets a position compute the same in a
prompt block as in a decode step (attend.py):

- a score: one chain s = fma(q[c], k[c], s) over c = 0, 1, ..., d − 1, times
  scale (attend._dot is the same chain where d is not whole vectors);
- a chunk's max (a fixed tree), its weights exp(s − m') (0 for a key the row
  does not see) and its sum's 16 lanes, whatever else the tile holds;
- a value sum: o = fma(p_j, v_j, o·alpha) for j in order, one key after another.

numba's disk cache stamps the drivers with every kernel source, this module included
(shared/quant/_jitcache.py), so an edit here recompiles them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant._floatir import VecEmit
from ..quant._q8ir import WIDE_VECTORS, transpose

LANES = 16
KEY_LANES = 32  # keys of a transposed chunk (two vectors): attend.KEY_CHUNK
# Query rows of a score tile, and 16-lane vectors of a value tile's row kept in registers: a tile's
# sums are Q_ROWS × 2 vectors, which fill 32 registers of 512 bits at 8 rows; with 256-bit AVX2
# (16 registers, two a vector) or 128-bit NEON (32, four a vector) 8 rows spill to the stack,
# and 2 rows ran a 512-token prompt block 1.8× faster on AVX2 (Zen 3: 65.5 against 117.6 ms,
# bench/bench_attention.py --cached 512 --block 512). A value tile's row keeps two vectors (32
# columns) on every target: at one, AVX2's 2-row tile had 4 multiply-add chains of 4 cycles'
# latency, one multiply-add a cycle where the core does two (Zen 3, two against one: a
# 512-token block after 512 positions 58-59 → 50-51 ms, a decode step after 2,048 ~5 %
# sooner, best of 15 and 300 runs, 2026-12-06). A row's numbers do not depend on its tile.
Q_ROWS = 8 if WIDE_VECTORS else 2
PV_ROWS = Q_ROWS  # a value tile takes a score tile's rows and weights
_V_PER_ROW = 2
# Keys × columns keys_t transposes at a time: a whole register file's worth. 16 × 16 floats in
# 256-bit registers are 32 of AVX2's 16 and went through the stack (~1,000 instructions a
# 16-column step of a 32-key chunk, a decode step's keys_t 0.4 ms of its 1.7 at 3,585 positions
# on Zen 3); 8 × 8 are 8 registers, 24 shuffles.
TRANSPOSE_LANES = LANES if WIDE_VECTORS else 8

# exp: Cody–Waite range reduction x = n·ln2 + r, |r| ≤ ln2/2, and the degree-7 minimax polynomial
# of Cephes' expf (relative error ~1 ulp on float32); 2^n is built in the exponent bits. Arguments
# below ln(2^−126) give that smallest normal's share (~1e−38 of the largest key's weight: nothing),
# NaN stays NaN. attend._exp (numba) and _Emit.exp (16 lanes here) are the same operations.
EXP_LOG2E = np.float32(1.44269504088896341)
EXP_LN2_HI = np.float32(0.693359375)
EXP_LN2_LO = np.float32(-2.12194440e-4)
EXP_MIN = np.float32(-87.3365447505531)  # ln(2^-126)
EXP_MAX = np.float32(88.3762626647949)  # below ln(2^128)
EXP_POLY = tuple(
    np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
)

_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)


def _idx(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


class _Emit(VecEmit):
    def splat(self, x):
        v = self.b.insert_element(ir.Constant(_VEC, None), x, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(_VEC, None), _idx([0] * LANES))

    def fma(self, a, x, acc):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(_VEC, [_VEC] * 3), f"llvm.fma.v{LANES}f32")
        return self.b.call(fn, [a, x, acc])

    def vconst(self, x: float) -> ir.Constant:
        return ir.Constant(_VEC, [x] * LANES)

    def splat_i32(self, x):
        """An int64 key index (0..32) in all 16 lanes as int32: one compare a vector, where int64
        lanes take two and a mask merge."""
        vt = ir.VectorType(_I32, LANES)
        v = self.b.insert_element(ir.Constant(vt, None), self.b.trunc(x, _I32), ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(vt, None), _idx([0] * LANES))

    def fma_scalar(self, a, x, acc):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        return self.b.call(fn, [a, x, acc])

    def max(self, a, x):
        """The larger of each pair of lanes (a where x is not larger)."""
        return self.b.select(self.b.fcmp_ordered(">", x, a), x, a)

    def reduce(self, v, op):
        """op over the 16 lanes in a fixed tree: lanes k and k + 8, then k and k + 4, ..., to one number."""
        width = LANES
        while width > 1:
            width //= 2
            v = op(
                self.b.shuffle_vector(v, ir.Constant(v.type, None), _idx(list(range(width)))),
                self.b.shuffle_vector(v, ir.Constant(v.type, None), _idx(list(range(width, 2 * width)))),
            )
        return self.b.extract_element(v, ir.Constant(_I32, 0))

    def lane(self, v, i: int):
        """Lane i of v in all 16 lanes."""
        return self.b.shuffle_vector(v, ir.Constant(v.type, None), _idx([i] * LANES))

    def rows_max(self, vs):
        """The max of each of 8 vectors' 16 lanes, vector i's in lane i of the result: the pairs
        `reduce` takes (lanes k and k + 8, then k and k + 4, ...), 2, 4, 8 rows a max instruction
        (rows side by side by shuffles), so each row's number is reduce's."""

        def take(x, y, idx):
            return self.b.shuffle_vector(x, y, _idx(idx))

        def halves(x, y, h, width):
            """Lanes of x then y, in groups of 2h: their first halves (lo) and second halves (hi)."""
            groups = [(src, g) for src in (0, 1) for g in range(0, width, 2 * h)]
            lo = [src * width + g + k for src, g in groups for k in range(h)]
            hi = [src * width + g + h + k for src, g in groups for k in range(h)]
            return take(x, y, lo), take(x, y, hi)

        n_rows, h = len(vs), LANES // 2
        while len(vs) > 1:  # 8 → 4 → 2 → 1 vectors: halves 8, 4, 2 lanes apart
            vs = [self.max(*halves(vs[2 * j], vs[2 * j + 1], h, LANES)) for j in range(len(vs) // 2)]
            h //= 2
        v = vs[0]  # row i's 2h lanes at 2h·i
        while h:  # within the vector: each row's halves h lanes apart, until a lane a row
            lo = [2 * h * i + k for i in range(n_rows) for k in range(h)]
            v = self.max(take(v, v, lo), take(v, v, [k + h for k in lo]))
            h //= 2
        return v

    def exp(self, x):
        """attend._exp on 16 lanes, operation for operation (the same numbers)."""
        b = self.b

        def c(x) -> ir.Constant:
            return self.vconst(float(x))

        y = self.max(c(EXP_MIN), x)
        y = b.select(b.fcmp_ordered(">", y, c(EXP_MAX)), c(EXP_MAX), y)
        floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(_VEC, [_VEC]), f"llvm.floor.v{LANES}f32")
        n = b.call(floor, [self.fma(y, c(EXP_LOG2E), c(0.5))])
        r = self.fma(n, c(-EXP_LN2_HI), y)
        r = self.fma(n, c(-EXP_LN2_LO), r)
        p = self.fma(c(EXP_POLY[0]), r, c(EXP_POLY[1]))
        for coef in EXP_POLY[2:]:
            p = self.fma(p, r, c(coef))
        p = b.fadd(self.fma(p, b.fmul(r, r), r), c(1.0))
        vi = ir.VectorType(_I32, LANES)
        two_n = b.bitcast(b.shl(b.add(b.fptosi(n, vi), ir.Constant(vi, [127] * LANES)), ir.Constant(vi, [23] * LANES)), _VEC)
        return b.select(b.fcmp_unordered("uno", x, x), x, b.fmul(p, two_n))

    def cast(self, sig, args, i):
        return self.context.cast(self.b, args[i], sig.args[i], types.int64)

    def clamp_row(self, i: int, n):
        """Row i of a tile, or the last real one (n rows) where the tile is partial: read, never stored."""
        return self.b.select(self.b.icmp_signed("<", self.i64(i), n), self.i64(i), self.b.sub(n, self.i64(1)))

    def when(self, i: int, n):
        return cgutils.if_likely(self.b, self.b.icmp_signed("<", self.i64(i), n))


def _qk_softmax_typed(typingctx, q, qoff, lo, hi, nq, kt, d, scale, m, l, r0, alpha, p):
    """One online-softmax step of a tile: rows i < nq ≤ 8 of a block against a transposed chunk
    of 32 keys (keys in lanes). Scores s_j = scale · Σ_c q[qoff[i] + c]·kt[c·32 + j] (one chain of
    fused multiply-adds over c = 0, 1, ... per pair, the query element broadcast) for the keys
    lo[i] ≤ j < hi[i] the row sees; then with the row's running max m[r0 + i] and sum l[r0 + i]:
    m' = max(m, max_j s_j), alpha[i] = exp(m − m') (1 while m' is −inf), p[32·i + j] = exp(s_j − m')
    for the keys it sees and 0 for the others, and the row's sum kept as 16 lanes,
    l[16·(r0 + i) + k] = fma(l, alpha[i], p_k + p_{16+k}) (summed across lanes once, at the end).
    Nothing leaves the registers but the row's 32 weights and its m, l and alpha. m and l have
    Q_ROWS rows past the block's last (a partial tile writes there).

    The rows' maxima come out of one transposed tree (`rows_max`: the pairs of `reduce`, 2 to
    8 rows a max), so m, m' and alpha are Q_ROWS-lane vectors; a tile whose rows all see all 32 keys
    (most of a long prompt's) skips the masks. Both make the same numbers: a third fewer
    instructions after the score loop."""

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        nq_, d_, r0_ = e.cast(sig, args, 4), e.cast(sig, args, 6), e.cast(sig, args, 10)
        qp, kp = e.ptr(sig.args[0], args[0]), e.ptr(sig.args[5], args[5])
        mp, lp, ap, pp = (e.ptr(sig.args[i], args[i]) for i in (8, 9, 11, 12))
        tabs = [e.ptr(sig.args[i], args[i]) for i in (1, 2, 3)]

        def entry(t, i):
            return b.load(b.gep(tabs[t], [e.clamp_row(i, nq_)]))

        qrow = [entry(0, i) for i in range(Q_ROWS)]
        accs = [cgutils.alloca_once_value(b, ir.Constant(_VEC, [0.0] * LANES)) for _ in range(2 * Q_ROWS)]
        with cgutils.for_range(b, d_) as loop:
            c = loop.index
            kv = [e.load_vec(kp, b.add(b.mul(c, e.i64(KEY_LANES)), e.i64(LANES * u))) for u in range(2)]
            for i in range(Q_ROWS):
                qb = e.splat(b.load(b.gep(qp, [b.add(qrow[i], c)])))
                for u in range(2):
                    acc = accs[2 * i + u]
                    b.store(e.fma(qb, kv[u], b.load(acc)), acc)
        # Straight-line code for all the tile's rows (a partial tile's rows past nq repeat the last one and
        # write only padding: m and l have 8 spare rows), so the core overlaps the rows' chains.
        sc = e.splat(args[7])
        minus_inf = e.vconst(float("-inf"))
        zero = e.vconst(0.0)
        scores = [b.fmul(b.load(acc), sc) for acc in accs]
        r0_at = b.gep(mp, [r0_])
        row8 = ir.VectorType(_F32, Q_ROWS)

        def step(masked: bool):
            """The softmax step of the tile's rows; unmasked where every row sees all 32 keys (a key
            a row does not see is masked to −inf, then weighs 0: with none, no lane changes)."""
            seen, s = [], scores
            if masked:
                s = []
                for i in range(Q_ROWS):
                    lo_, hi_ = e.splat_i32(entry(1, i)), e.splat_i32(entry(2, i))
                    for u in range(2):
                        lanes = ir.Constant(ir.VectorType(_I32, LANES), [LANES * u + k for k in range(LANES)])
                        seen.append(b.and_(b.icmp_signed("<=", lo_, lanes), b.icmp_signed("<", lanes, hi_)))
                        s.append(b.select(seen[-1], scores[2 * i + u], minus_inf))
            top = e.rows_max([e.max(s[2 * i], s[2 * i + 1]) for i in range(Q_ROWS)])  # row i's in lane i
            m_old = b.load(b.bitcast(r0_at, row8.as_pointer()), align=4)
            m_new = b.select(b.fcmp_ordered(">", top, m_old), top, m_old)
            step = e.b.shuffle_vector(
                b.fsub(m_old, m_new), ir.Constant(row8, [0.0] * Q_ROWS), _idx(list(range(Q_ROWS)) + [Q_ROWS] * (LANES - Q_ROWS))
            )
            shrink = e.b.shuffle_vector(e.exp(step), ir.Constant(_VEC, None), _idx(list(range(Q_ROWS))))  # exp(m − m')
            fresh = b.fcmp_ordered("==", m_new, ir.Constant(row8, [float("-inf")] * Q_ROWS))
            alpha = b.select(fresh, ir.Constant(row8, [1.0] * Q_ROWS), shrink)
            b.store(m_new, b.bitcast(r0_at, row8.as_pointer()), align=4)
            b.store(alpha, b.bitcast(ap, row8.as_pointer()), align=4)
            for i in range(Q_ROWS):
                m_vec = e.lane(m_new, i)
                w = [e.exp(b.fsub(s[2 * i + u], m_vec)) for u in range(2)]
                if masked:
                    w = [b.select(seen[2 * i + u], w[u], zero) for u in range(2)]
                l_at = b.mul(b.add(r0_, e.i64(i)), e.i64(LANES))
                e.store_vec(e.fma(e.load_vec(lp, l_at), e.lane(alpha, i), b.fadd(w[0], w[1])), lp, l_at)
                for u in range(2):
                    e.store_vec(w[u], pp, e.i64(KEY_LANES * i + LANES * u))

        full = ir.Constant(ir.IntType(1), 1)
        for i in range(Q_ROWS):
            whole = b.and_(b.icmp_signed("==", entry(1, i), e.i64(0)), b.icmp_signed("==", entry(2, i), e.i64(KEY_LANES)))
            full = b.and_(full, whole)
        with b.if_else(full, likely=True) as (unmasked, masked):
            with unmasked:
                step(False)
            with masked:
                step(True)
        return context.get_dummy_value()

    return types.void(q, qoff, lo, hi, nq, kt, d, scale, m, l, r0, alpha, p), codegen


def _row_reader(e: _Emit, sig, args, ki: int, hi_: int, base_i: int):
    """Two functions over k [Hk, cap, d] at args[ki] (f32 or f16 bits, any strides but a contiguous
    row) for kv head h: row_at(j), the byte offset of position j's row ((j − base) mod cap), and
    read(at, column), the 16 elements of the row at `at` from that column, widened to float32;
    and the row width d. A row's offset is a division (the ring): values_f32 takes it once a row,
    outside its loop over the columns; keys_t per read (its 32 offsets held across that loop
    measured no faster, 2026-12-06)."""
    b = e.b
    half = sig.args[ki].dtype == types.uint16
    karr = e.context.make_array(sig.args[ki])(e.context, b, args[ki])
    _, cap, d = cgutils.unpack_tuple(b, karr.shape, 3)
    s0, s1, _ = cgutils.unpack_tuple(b, karr.strides, 3)  # bytes: k may be a view (rows of a longer cache)
    kp = b.bitcast(karr.data, ir.IntType(8).as_pointer())
    h_, base_ = e.cast(sig, args, hi_), e.cast(sig, args, base_i)
    src_vec = ir.VectorType(ir.IntType(16) if half else _F32, LANES)

    def row_at(j):
        return b.add(b.mul(h_, s0), b.mul(b.urem(b.sub(j, base_), cap), s1))

    def read(at, column, lanes: int = LANES):
        vec = ir.VectorType(src_vec.element, lanes)
        raw = b.load(b.bitcast(b.gep(kp, [b.add(at, b.mul(column, e.i64(2 if half else 4)))]), vec.as_pointer()), align=2 if half else 4)
        return b.fpext(b.bitcast(raw, ir.VectorType(ir.HalfType(), lanes)), ir.VectorType(_F32, lanes)) if half else raw

    def run_at(j, n):
        """The byte offset of position j's row and whether positions j .. j + n − 1 (n an int or
        an i64) are rows one after another (the ring does not wrap among them): then row j + r is
        at that offset + r·s1."""
        r = b.urem(b.sub(j, base_), cap)
        n = e.i64(n) if isinstance(n, int) else n
        return b.add(b.mul(h_, s0), b.mul(r, s1)), b.icmp_unsigned("<=", b.add(r, n), cap), s1

    return row_at, read, d, run_at


def _keys_t_typed(typingctx, k, h, c0, a, c1, base, kt):
    """kt[c·32 + j − c0] = key j of kv head h as float32 (row (j − base) mod cap of k [Hk, cap, d],
    float32 or float16 bits, any strides but a contiguous row), for j = a .. c1 − 1 (c0 ≤ a,
    c1 ≤ c0 + 32), d a multiple of 16; the other lanes are zero (rows the cache may not hold are
    never read). TRANSPOSE_LANES keys × as many columns at a time: loaded, widened, transposed;
    a chunk whose 32 keys are all held in rows one after another (all but a prompt's first and
    last chunks and a ring's wrap) finds its rows by addition, without a division or a mask a row."""

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        row_at, read, d, run_at = _row_reader(e, sig, args, 0, 1, 5)
        tp = e.ptr(sig.args[6], args[6])
        c0_, a_, c1_ = (e.cast(sig, args, i) for i in (2, 3, 4))
        at0, contiguous, s1 = run_at(c0_, KEY_LANES)
        whole = b.and_(b.and_(b.icmp_signed("==", a_, c0_), b.icmp_signed("==", c1_, b.add(c0_, e.i64(KEY_LANES)))), contiguous)

        t = TRANSPOSE_LANES
        zero = ir.Constant(ir.VectorType(_F32, t), [0.0] * t)

        def chunk(key_at):
            """kt's columns t at a time: t keys × t columns, key i's from key_at(i, column)."""
            with cgutils.for_range(b, b.udiv(d, e.i64(t))) as loop:
                cb = b.mul(loop.index, e.i64(t))
                for g in range(KEY_LANES // t):
                    vs = [key_at(t * g + r, cb) for r in range(t)]
                    for r, v in enumerate(transpose(b, vs)):
                        at = b.gep(tp, [b.add(b.mul(b.add(cb, e.i64(r)), e.i64(KEY_LANES)), e.i64(t * g))])
                        b.store(v, b.bitcast(at, v.type.as_pointer()), align=4)

        def masked(i, cb):
            j = b.add(c0_, e.i64(i))
            held = b.and_(b.icmp_signed("<=", a_, j), b.icmp_signed("<", j, c1_))
            return b.select(held, read(row_at(b.select(held, j, a_)), cb, t), zero)

        with b.if_else(whole, likely=True) as (fast, partial):
            with fast:  # every key held, rows one after another: offsets by addition, no masks
                chunk(lambda i, cb: read(b.add(at0, b.mul(s1, e.i64(i))), cb, t))
            with partial:  # the chunk's first or last keys, or a ring's wrap: each row found and masked
                chunk(masked)
        return context.get_dummy_value()

    return types.void(k, h, c0, a, c1, base, kt), codegen


def _values_f32_typed(typingctx, v, h, c0, a, c1, base, rows, dv):
    """rows[(j − c0)·dv + c] = value j of kv head h as float32 (row (j − base) mod cap of v
    [Hk, cap, ≥ dv], as keys_t reads it), its first dv columns (a multiple of 16), j = a .. c1 − 1."""

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        row_at, read, _, run_at = _row_reader(e, sig, args, 0, 1, 5)
        rp, dv = e.ptr(sig.args[6], args[6]), e.cast(sig, args, 7)
        c0_, a_, c1_ = (e.cast(sig, args, i) for i in (2, 3, 4))
        n = b.sub(c1_, a_)
        at_a, contiguous, s1 = run_at(a_, n)

        def rows(offset):
            with cgutils.for_range(b, n) as rl:
                out, at = b.mul(b.add(b.sub(a_, c0_), rl.index), dv), offset(rl.index)
                with cgutils.for_range(b, b.udiv(dv, e.i64(LANES))) as loop:
                    cb = b.mul(loop.index, e.i64(LANES))
                    e.store_vec(read(at, cb), rp, b.add(out, cb))

        with b.if_else(contiguous, likely=True) as (run, wraps):
            with run:  # rows one after another: by addition (a division a row cost half of this call)
                rows(lambda i: b.add(at_a, b.mul(i, s1)))
            with wraps:
                rows(lambda i: row_at(b.add(a_, i)))
        return context.get_dummy_value()

    return types.void(v, h, c0, a, c1, base, rows, dv), codegen


def _pv_rows_typed(typingctx, p, pj, nr, alpha, v, vo, vs, nk, dv, o, ooff):
    """For rows i < nr ≤ 8: o[ooff[i] + c] = o[ooff[i] + c]·alpha[i] + Σ_j p[32·i + pj + j] · v[(vo + j)·vs + c]
    for j = 0 .. nk − 1 in order, every column c < dv: 32 columns (two vectors) × 8 rows of sums in
    registers across the keys, each step a value vector against a weight broadcast."""

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        pj_, nr_, vo_, vs_, nk_, dv_ = (e.cast(sig, args, i) for i in (1, 2, 5, 6, 7, 8))
        pp, ap, vp, op = (e.ptr(sig.args[i], args[i]) for i in (0, 3, 4, 9))
        otab = e.ptr(sig.args[10], args[10])
        prow = [b.add(b.mul(e.clamp_row(i, nr_), e.i64(KEY_LANES)), pj_) for i in range(PV_ROWS)]
        orow = [b.load(b.gep(otab, [e.clamp_row(i, nr_)])) for i in range(PV_ROWS)]
        scale = [e.splat(b.load(b.gep(ap, [e.clamp_row(i, nr_)]))) for i in range(PV_ROWS)]

        def columns(c, width: int):
            """Columns c .. c + width·16 of every row: sums in registers across all nk keys."""
            accs = [
                cgutils.alloca_once_value(b, b.fmul(e.load_vec(op, b.add(orow[i], b.add(c, e.i64(LANES * u)))), scale[i]))
                for i in range(PV_ROWS)
                for u in range(width)
            ]
            with cgutils.for_range(b, nk_) as loop:
                j = loop.index
                vrow = b.add(b.mul(b.add(vo_, j), vs_), c)
                vv = [e.load_vec(vp, b.add(vrow, e.i64(LANES * u))) for u in range(width)]
                for i in range(PV_ROWS):
                    pw = e.splat(b.load(b.gep(pp, [b.add(prow[i], j)])))
                    for u in range(width):
                        acc = accs[i * width + u]
                        b.store(e.fma(pw, vv[u], b.load(acc)), acc)
            for i in range(PV_ROWS):
                with e.when(i, nr_):
                    for u in range(width):
                        e.store_vec(b.load(accs[i * width + u]), op, b.add(orow[i], b.add(c, e.i64(LANES * u))))

        wide = LANES * _V_PER_ROW
        n_wide = b.udiv(dv_, e.i64(wide))
        with cgutils.for_range(b, n_wide) as loop:
            columns(b.mul(loop.index, e.i64(wide)), _V_PER_ROW)
        done = b.mul(n_wide, e.i64(wide))
        with cgutils.for_range(b, b.udiv(b.sub(dv_, done), e.i64(LANES))) as loop:
            columns(b.add(done, b.mul(loop.index, e.i64(LANES))), 1)
        return context.get_dummy_value()

    return types.void(p, pj, nr, alpha, v, vo, vs, nk, dv, o, ooff), codegen


qk_softmax: Any = intrinsic(_qk_softmax_typed)
keys_t: Any = intrinsic(_keys_t_typed)
values_f32: Any = intrinsic(_values_f32_typed)
pv_rows: Any = intrinsic(_pv_rows_typed)
