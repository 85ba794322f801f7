"""The LLVM IR of attention's products, as numba intrinsics (the drivers: attend.py).

    keys_t(k, h, c0, c1, base, kt)
        kt[c·32 + j − c0] = key j of kv head h as float32 (k [Hk, cap, d], f32 or f16 bits)
    qk_lanes(q, qoff, soff, lo, hi, nq, kt, d, scale, s)
        s[soff[i] + j] = scale · Σ_c q[qoff[i] + c] · kt[c·32 + j]     i < nq ≤ 8, lo[i] ≤ j < hi[i]
    pv_rows(p, poff, nr, v, vo, vs, nk, dv, o, ooff)
        o[ooff[i] + c] += Σ_j p[poff[i] + j] · v[(vo + j)·vs + c]      i < nr ≤ 8, j = 0..nk-1 in order

Offsets and strides count float32 elements of the arrays' data; d and dv are
multiples of LANES. numba-level loops could not keep a tile's sums in
registers (every step went through memory: ~1 multiply-add per cycle where
the CPU does two 16-lane ones); here they are SSA values.

Scores take a chunk of 32 keys transposed (keys in the lanes: 16 keys × 16
columns loaded, widened from f16, and transposed in registers at a time), so a
tile of 8 query rows × 32 keys is 16 accumulators, each step one query element
broadcast against two vectors of keys: no reduction across lanes at all.

Every pair's numbers are fixed by the pair alone, never by the tile it is in
or by the target (no fast-math flags; llvm.fma rounds once in a vector lane
or alone), which is what lets a position compute the same in a prompt block
as in a decode step (attend.py):

- a score: one chain s = fma(q[c], k[c], s) over c = 0, 1, ..., d − 1, times
  scale (attend._dot is the same chain where d is not whole vectors);
- a value sum: o = fma(p_j, v_j, o) for j in order, one key after another.

numba's disk cache keys the drivers on attend.py, not on the IR they inline
from here: after editing this module, touch attend.py (CI hashes both, .ci/run).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant._q8ir import transpose16

LANES = 16
KEY_LANES = 32  # keys of a transposed chunk (two vectors): attend.KEY_CHUNK
Q_ROWS = 8  # query rows of a score tile
PV_ROWS = 8  # rows of a value tile
_V_PER_ROW = 2  # 16-lane vectors of a value tile's row kept in registers (32 columns at a time)

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)


def _idx(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


class _Emit:
    def __init__(self, context, builder):
        self.context, self.b = context, builder

    def i64(self, v: int) -> ir.Constant:
        return ir.Constant(_I64, v)

    def ptr(self, aty, arr):
        return self.context.make_array(aty)(self.context, self.b, arr).data

    def load_vec(self, base, off):
        return self.b.load(self.b.bitcast(self.b.gep(base, [off]), _VEC.as_pointer()), align=4)

    def store_vec(self, v, base, off):
        self.b.store(v, self.b.bitcast(self.b.gep(base, [off]), _VEC.as_pointer()), align=4)

    def splat(self, x):
        v = self.b.insert_element(ir.Constant(_VEC, None), x, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(_VEC, None), _idx([0] * LANES))

    def fma(self, a, x, acc):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(_VEC, [_VEC] * 3), f"llvm.fma.v{LANES}f32")
        return self.b.call(fn, [a, x, acc])

    def cast(self, sig, args, i):
        return self.context.cast(self.b, args[i], sig.args[i], types.int64)

    def clamp_row(self, i: int, n):
        """Row i of a tile, or the last real one (n rows) where the tile is partial: read, never stored."""
        return self.b.select(self.b.icmp_signed("<", self.i64(i), n), self.i64(i), self.b.sub(n, self.i64(1)))

    def when(self, i: int, n):
        return cgutils.if_likely(self.b, self.b.icmp_signed("<", self.i64(i), n))


def _qk_lanes_typed(typingctx, q, qoff, soff, lo, hi, nq, kt, d, scale, s):
    """For rows i < nq ≤ 8: s[soff[i] + j] = scale · Σ_c q[qoff[i] + c]·kt[c·32 + j] for the keys
    lo[i] ≤ j < hi[i] ≤ 32 of a transposed chunk (keys in lanes): one chain of fused
    multiply-adds over c = 0, 1, ... per pair, the query element broadcast."""

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        nq_, d_ = e.cast(sig, args, 5), e.cast(sig, args, 7)
        qp, kp, sp = e.ptr(sig.args[0], args[0]), e.ptr(sig.args[6], args[6]), e.ptr(sig.args[9], args[9])
        tabs = [e.ptr(sig.args[i], args[i]) for i in (1, 2, 3, 4)]

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
        sc = e.splat(args[8])
        for i in range(Q_ROWS):
            with e.when(i, nq_):
                row, lo_, hi_ = entry(1, i), entry(2, i), entry(3, i)
                for u in range(2):
                    v = b.fmul(b.load(accs[2 * i + u]), sc)
                    whole = b.and_(b.icmp_signed("<=", lo_, e.i64(LANES * u)), b.icmp_signed(">=", hi_, e.i64(LANES * (u + 1))))
                    with b.if_else(whole) as (full, part):
                        with full:
                            e.store_vec(v, sp, b.add(row, e.i64(LANES * u)))
                        with part:
                            for lane in range(LANES):
                                j = e.i64(LANES * u + lane)
                                inside = b.and_(b.icmp_signed("<=", lo_, j), b.icmp_signed("<", j, hi_))
                                with b.if_then(inside):
                                    b.store(b.extract_element(v, ir.Constant(_I32, lane)), b.gep(sp, [b.add(row, j)]))
        return context.get_dummy_value()

    return types.void(q, qoff, soff, lo, hi, nq, kt, d, scale, s), codegen


def _keys_t_typed(typingctx, k, h, c0, c1, base, kt):
    """kt[c·32 + j − c0] = key j of kv head h as float32 (row (j − base) mod cap of k [Hk, cap, d],
    float32 or float16 bits, any strides but a contiguous row), for j = c0 .. c1 − 1 ≤ c0 + 32, d a
    multiple of 16; the lanes of keys past c1 are zero. 16 keys × 16 columns at a time: loaded,
    widened, transposed."""
    half = k.dtype == types.uint16

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        karr = context.make_array(sig.args[0])(context, builder, args[0])
        _, cap, d = cgutils.unpack_tuple(b, karr.shape, 3)
        s0, s1, _ = cgutils.unpack_tuple(b, karr.strides, 3)  # bytes: k may be a view (rows of a longer cache)
        kp, tp = b.bitcast(karr.data, ir.IntType(8).as_pointer()), e.ptr(sig.args[5], args[5])
        h_, c0_, c1_, base_ = (e.cast(sig, args, i) for i in (1, 2, 3, 4))
        elem = ir.IntType(16) if half else _F32
        src_vec = ir.VectorType(elem, LANES)
        zero = ir.Constant(_VEC, [0.0] * LANES)
        with cgutils.for_range(b, b.udiv(d, e.i64(LANES))) as loop:
            cb = b.mul(loop.index, e.i64(LANES))
            for g in range(KEY_LANES // LANES):
                vs = []
                for r in range(LANES):
                    j = b.add(c0_, e.i64(LANES * g + r))
                    row = b.urem(b.sub(b.select(b.icmp_signed("<", j, c1_), j, c0_), base_), cap)
                    at = b.add(b.add(b.mul(h_, s0), b.mul(row, s1)), b.mul(cb, e.i64(2 if half else 4)))
                    raw = b.load(b.bitcast(b.gep(kp, [at]), src_vec.as_pointer()), align=2 if half else 4)
                    v = b.fpext(b.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _VEC) if half else raw
                    vs.append(b.select(b.icmp_signed("<", j, c1_), v, zero))
                for r, v in enumerate(transpose16(b, vs)):
                    e.store_vec(v, tp, b.add(b.mul(b.add(cb, e.i64(r)), e.i64(KEY_LANES)), e.i64(LANES * g)))
        return context.get_dummy_value()

    return types.void(k, h, c0, c1, base, kt), codegen


def _pv_rows_typed(typingctx, p, poff, nr, v, vo, vs, nk, dv, o, ooff):
    """For rows i < nr ≤ 8: o[ooff[i] + c] += Σ_j p[poff[i] + j] · v[(vo + j)·vs + c] for j = 0 ..
    nk − 1 in order, every column c < dv: 32 columns (two vectors) × 8 rows of sums in registers
    across the keys, each step a value vector against a probability broadcast."""

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        nr_, vo_, vs_, nk_, dv_ = (e.cast(sig, args, i) for i in (2, 4, 5, 6, 7))
        pp, vp, op = e.ptr(sig.args[0], args[0]), e.ptr(sig.args[3], args[3]), e.ptr(sig.args[8], args[8])
        tabs = [e.ptr(sig.args[i], args[i]) for i in (1, 9)]
        prow = [b.load(b.gep(tabs[0], [e.clamp_row(i, nr_)])) for i in range(PV_ROWS)]
        orow = [b.load(b.gep(tabs[1], [e.clamp_row(i, nr_)])) for i in range(PV_ROWS)]

        def columns(c, width: int):
            """Columns c .. c + width·16 of every row: sums in registers across all nk keys."""
            accs = [
                cgutils.alloca_once_value(b, e.load_vec(op, b.add(orow[i], b.add(c, e.i64(LANES * u)))))
                for i in range(PV_ROWS)
                for u in range(width)
            ]
            with cgutils.for_range(b, nk_) as loop:
                j = loop.index
                vrow = b.add(b.mul(b.add(vo_, j), vs_), c)
                vv = [e.load_vec(vp, b.add(vrow, e.i64(LANES * u))) for u in range(width)]
                for i in range(PV_ROWS):
                    pj = e.splat(b.load(b.gep(pp, [b.add(prow[i], j)])))
                    for u in range(width):
                        acc = accs[i * width + u]
                        b.store(e.fma(pj, vv[u], b.load(acc)), acc)
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

    return types.void(p, poff, nr, v, vo, vs, nk, dv, o, ooff), codegen


qk_lanes: Any = intrinsic(_qk_lanes_typed)
keys_t: Any = intrinsic(_keys_t_typed)
pv_rows: Any = intrinsic(_pv_rows_typed)
