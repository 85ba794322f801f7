"""The LLVM IR of attention's two products, as numba intrinsics (the drivers: attend.py).

    qk_tile(q, qo, qs, nq, k, ko, ks, nk, d, scale, s, so, ss)
        s[so + i·ss + j] = scale · Σ_c q[qo + i·qs + c] · k[ko + j·ks + c]   i < nq ≤ 4, j < nk ≤ 4
    pv_tile(p, po, ps, nr, v, vo, vs, nk, dv, o, oo, os)
        o[oo + i·os + c] += Σ_j p[po + i·ps + j] · v[vo + j·vs + c]          i < nr ≤ 4, j = 0..nk-1 in order

Offsets and strides count float32 elements of the arrays' data; d and dv are
multiples of LANES. numba-level loops could not keep a tile's sums in
registers (every step went through memory: ~1 multiply-add per cycle where
the CPU does two 16-lane ones); here they are SSA values.

Every pair's numbers are fixed by the pair alone, never by the tile it is in
or by the target (no fast-math flags; llvm.fma rounds once in a vector lane
or alone), which is what lets a position compute the same in a prompt block
as in a decode step (attend.py):

- a score: 16 running sums s_l = fma(q[c], k[c], s_l) over c ≡ l (mod 16)
  in increasing c, then the lanes added 8 apart, 4, 2, 1 apart — the same
  tree whether the 16 pairs of a tile are reduced together (as here: one
  transposing shuffle-add tree for all of them) or one at a time; times scale;
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

LANES = 16
TILE = 4  # query rows × keys of a score tile, rows of a value tile
_V_PER_ROW = 4  # 16-lane vectors of a value tile's row kept in registers (64 columns at a time)

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


def _reduce_tree() -> list[tuple[list[int], list[int]]]:
    """The transposing tree as shuffle masks: four rounds, lanes added 8, 4, 2, 1 apart.
    Round r pairs vectors (2m, 2m+1) and returns one vector of their partial sums; the
    masks pick, from the 32 lanes of the pair, the lanes each sum adds."""
    rounds = []
    for width in (8, 4, 2, 1):
        first, second = [], []
        # each vector holds 16 / (2·width) groups of 2·width lanes of one pair each;
        # of every group the low half adds the high half
        for group in range(LANES // (2 * width)):
            for src in (0, 1):
                base = src * LANES + group * 2 * width
                first += list(range(base, base + width))
                second += list(range(base + width, base + 2 * width))
        rounds.append((first, second))
    return rounds


def _lane_of_pair() -> list[int]:
    """After the tree, which lane holds pair p's sum (p = i·4 + j), found by following labels."""
    vectors = [[p] * LANES for p in range(LANES)]  # lane contents: the pair each partial sum belongs to
    for first, _ in _reduce_tree():
        nxt = []
        for m in range(len(vectors) // 2):
            pair = vectors[2 * m] + vectors[2 * m + 1]
            nxt.append([pair[k] for k in first])
        vectors = nxt
    (final,) = vectors
    return [final.index(p) for p in range(LANES)]


_TREE = _reduce_tree()
_ORDER = _lane_of_pair()


def _qk_tile_typed(typingctx, q, qo, qs, nq, k, ko, ks, nk, d, scale, s, so, ss):
    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        qo_, qs_, nq_, ko_, ks_, nk_, d_, so_, ss_ = (e.cast(sig, args, i) for i in (1, 2, 3, 5, 6, 7, 8, 11, 12))
        qp, kp, sp = e.ptr(sig.args[0], args[0]), e.ptr(sig.args[4], args[4]), e.ptr(sig.args[10], args[10])
        qrow = [b.add(qo_, b.mul(e.clamp_row(i, nq_), qs_)) for i in range(TILE)]
        krow = [b.add(ko_, b.mul(e.clamp_row(j, nk_), ks_)) for j in range(TILE)]
        accs = [cgutils.alloca_once_value(b, ir.Constant(_VEC, [0.0] * LANES)) for _ in range(TILE * TILE)]
        with cgutils.for_range(b, b.udiv(d_, e.i64(LANES))) as loop:
            c = b.mul(loop.index, e.i64(LANES))
            qv = [e.load_vec(qp, b.add(r, c)) for r in qrow]
            kv = [e.load_vec(kp, b.add(r, c)) for r in krow]
            for i in range(TILE):
                for j in range(TILE):
                    acc = accs[i * TILE + j]
                    b.store(e.fma(qv[i], kv[j], b.load(acc)), acc)
        vectors = [b.load(a) for a in accs]
        for first, second in _TREE:
            vectors = [
                b.fadd(
                    b.shuffle_vector(vectors[2 * m], vectors[2 * m + 1], _idx(first)),
                    b.shuffle_vector(vectors[2 * m], vectors[2 * m + 1], _idx(second)),
                )
                for m in range(len(vectors) // 2)
            ]
        sums = b.fmul(b.shuffle_vector(vectors[0], ir.Constant(_VEC, None), _idx(_ORDER)), e.splat(args[9]))
        for i in range(TILE):
            with e.when(i, nq_):
                for j in range(TILE):
                    with e.when(j, nk_):
                        at = b.add(b.add(so_, b.mul(e.i64(i), ss_)), e.i64(j))
                        b.store(b.extract_element(sums, ir.Constant(_I32, i * TILE + j)), b.gep(sp, [at]))
        return context.get_dummy_value()

    return types.void(q, qo, qs, nq, k, ko, ks, nk, d, scale, s, so, ss), codegen


def _pv_tile_typed(typingctx, p, po, ps, nr, v, vo, vs, nk, dv, o, oo, os):
    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        po_, ps_, nr_, vo_, vs_, nk_, dv_, oo_, os_ = (e.cast(sig, args, i) for i in (1, 2, 3, 5, 6, 7, 8, 10, 11))
        pp, vp, op = e.ptr(sig.args[0], args[0]), e.ptr(sig.args[4], args[4]), e.ptr(sig.args[9], args[9])
        prow = [b.add(po_, b.mul(e.clamp_row(i, nr_), ps_)) for i in range(TILE)]
        orow = [b.add(oo_, b.mul(e.clamp_row(i, nr_), os_)) for i in range(TILE)]

        def columns(c, width: int):
            """Columns c .. c + width·16 of every row: sums in registers across all nk keys."""
            accs = []
            for i in range(TILE):
                for u in range(width):
                    accs.append(cgutils.alloca_once_value(b, e.load_vec(op, b.add(orow[i], b.add(c, e.i64(LANES * u))))))
            with cgutils.for_range(b, nk_) as loop:
                j = loop.index
                vrow = b.add(vo_, b.mul(j, vs_))
                vv = [e.load_vec(vp, b.add(vrow, b.add(c, e.i64(LANES * u)))) for u in range(width)]
                for i in range(TILE):
                    pj = e.splat(b.load(b.gep(pp, [b.add(prow[i], j)])))
                    for u in range(width):
                        acc = accs[i * width + u]
                        b.store(e.fma(pj, vv[u], b.load(acc)), acc)
            for i in range(TILE):
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

    return types.void(p, po, ps, nr, v, vo, vs, nk, dv, o, oo, os), codegen


qk_tile: Any = intrinsic(_qk_tile_typed)
pv_tile: Any = intrinsic(_pv_tile_typed)
