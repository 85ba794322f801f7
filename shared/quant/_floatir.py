"""The LLVM IR of the float tiles' product (the drivers: the per-type modules, through
_common.tile_product).

    float_rows(X, tile, n, out, r0, scratch)
        out[t, r0 + r] = X[t] · tile[r] for every activation row t of X [T, C] and r < n
        (tile [G, C] float32: the weight rows a driver decoded; scratch: X_ROWS·C + PART_FLOATS
        per weight row, n rounded up to W_ROWS, where T ≥ X_ROWS)

One chain per output element, whatever T, the tile or the target's vector width, which is
what makes a prompt's row equal to the decode step of that token (docs/kernels.md, "Numerics (the
contract)"):

    a_u[l] = fma(w[c], x[c], a_u[l]) over c = 64·k + 16·u + l, k = 0, 1, ... in order
             (u = 0..3, l = 0..15: 64 sums over the row's whole 64-column steps, from 0)
    y = tree((a_0 + a_1) + (a_2 + a_3))          tree: lane l + lane l + 8, halving
    then the last C mod 64 columns: while 8 are left, 8 lanes [y, 0, ..., 0] take
    fma(w[c], x[c], ·) per 8 columns and y = their tree; then y = fma(w[c], x[c], y) per column

— the order LLVM's loop vectorizer gave the former numba loop on AVX-512 (16 lanes, 4
accumulators interleaved, an 8-lane epilogue), so every row computes what it did before.
Where the target has no fused multiply-add (x86 without FMA, e.g. NUMBA_CPU_NAME=generic),
each step is a multiply then an add: the same chain there for one row and for many, where
llvm.fma would be a libm call per lane. Nothing may be regrouped: the drivers are compiled
with fast-math flags, which numba puts on every float operation of the function that has
none, so every operation here carries a flag of no effect (`_EXACT`).

Two layouts of the work compute it:

- rows in sixes (a prompt): 6 activation rows × 4 weight rows = 24 accumulators of one u at a
  time (10 vector loads per 24 multiply-adds, where one row against four needs 8 per 16).
  The six rows' columns of a u are first copied together (6 × C/4 floats in a row) and stay
  in L1 while every weight row group of the tile passes them; a_0 + a_1 and a_2 wait in the
  scratch between passes.
- one row at a time (decode, and a call's last T mod 6 rows): 1 × 4 weight rows, all four u
  in one pass (16 accumulators).

numba's disk cache stamps the drivers with every kernel source, this module included
(_jitcache.py), so an edit here recompiles them.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._q8ir import _ARM, _FEATURES

LANES = 16
PHASES = 4  # accumulators a row's 64-column step is split into (one per 16 columns)
STEP = LANES * PHASES
X_ROWS = 6  # activation rows of a prompt tile
W_ROWS = 4  # weight rows of any tile
# Scratch per weight row of a tile (float32s): a_0 + a_1 and a_2 of its X_ROWS pairs (after
# the six rows' packed columns).
PART_FLOATS = 2 * X_ROWS * LANES
FUSED = _ARM or "+fma" in _FEATURES

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)
_EIGHT = ir.VectorType(_F32, 8)
_ONE = ir.VectorType(_F32, 1)
# The float tile drivers are compiled with fast-math flags, and numba puts its flags on every
# float operation of the function that has none, inlined intrinsics included: LLVM then
# regrouped these sums (a prompt's rows came out other than decode's). So every add and
# multiply here carries `arcp` (reciprocals: nothing to an add or a multiply), and the
# scalar steps are <1 x float> vectors (numba flags calls that return a float).
_EXACT = ("arcp",)


class VecEmit:
    """An IR builder's 16-lane float32 loads and stores at element offsets of an array's data
    (what this module's tiles and attention's, shared/model/attend_ir.py, share)."""

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


class _Emit(VecEmit):
    def fma(self, a, x, acc):
        """a·x + acc on vectors: rounded once where the target fuses, else a multiply then an add."""
        if not FUSED:
            return self.add(self.b.fmul(a, x, flags=_EXACT), acc)
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(a.type, [a.type] * 3), f"llvm.fma.v{a.type.count}f32")
        return self.b.call(fn, [a, x, acc])

    def add(self, a, x):
        return self.b.fadd(a, x, flags=_EXACT)

    def tree(self, v):
        """The lanes of v summed: lane l + lane l + 8 (of 16), then l + l + 4, ..., to one number (<1 x float>)."""
        width = v.type.count
        while width > 1:
            width //= 2
            lo = ir.Constant(ir.VectorType(_I32, width), list(range(width)))
            hi = ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width)))
            v = self.add(self.b.shuffle_vector(v, ir.Constant(v.type, None), lo), self.b.shuffle_vector(v, ir.Constant(v.type, None), hi))
        return v

    def clamp(self, i, n):
        """Row i of a tile, or the last real one (n rows) where the tile is partial: read, never stored."""
        return self.b.select(self.b.icmp_signed("<", i, n), i, self.b.sub(n, self.i64(1)))


def _float_rows_typed(typingctx, X, tile, n, out, r0, scratch):
    """out[t, r0 + r] = X[t] · tile[r] for t < T, r < n (module doc: the chain, the two layouts)."""

    def codegen(context, builder, sig, args):
        e = _Emit(context, builder)
        b = builder
        xarr = context.make_array(sig.args[0])(context, b, args[0])
        T, C = cgutils.unpack_tuple(b, xarr.shape, 2)
        oarr = context.make_array(sig.args[3])(context, b, args[3])
        _, R = cgutils.unpack_tuple(b, oarr.shape, 2)
        xp, wp, op, pp = xarr.data, e.ptr(sig.args[1], args[1]), oarr.data, e.ptr(sig.args[5], args[5])
        n_ = context.cast(b, args[2], sig.args[2], types.int64)
        r0_ = context.cast(b, args[4], sig.args[4], types.int64)
        steps = b.udiv(C, e.i64(STEP))
        whole = b.mul(steps, e.i64(STEP))
        zero = ir.Constant(_VEC, [0.0] * LANES)

        def accumulate(xat, nx, wrows, phases):
            """The sums a_u of every (x row i < nx, w row) pair for u in phases, over the whole steps;
            xat(i, u, k, c): where x row i's 16 columns c = 64·k + 16·u .. are (pointer, offset)."""
            accs = {(i, j, u): cgutils.alloca_once_value(b, zero) for i in range(nx) for j in range(len(wrows)) for u in phases}
            with cgutils.for_range(b, steps) as loop:
                k = loop.index
                base = b.mul(k, e.i64(STEP))
                for u in phases:
                    c = b.add(base, e.i64(LANES * u))
                    wv = [e.load_vec(wp, b.add(w, c)) for w in wrows]
                    for i in range(nx):
                        xv = e.load_vec(*xat(i, u, k, c))
                        for j in range(len(wrows)):
                            acc = accs[(i, j, u)]
                            b.store(e.fma(wv[j], xv, b.load(acc)), acc)
            return {key: b.load(acc) for key, acc in accs.items()}

        def finish(v, xr, wr, t, r):
            """The tree of v, then the last C mod 64 columns, stored at out[t, r0 + r] if r < n and t < T."""

            def at(p, row, c, ty):
                return b.load(b.bitcast(b.gep(p, [b.add(row, c)]), ty.as_pointer()), align=4)

            y = cgutils.alloca_once_value(b, e.tree(v))  # <1 x float> (why: _EXACT)
            eights = b.udiv(b.sub(C, whole), e.i64(_EIGHT.count))
            with cgutils.if_unlikely(b, b.icmp_signed(">", eights, e.i64(0))):
                zero8 = ir.Constant(_EIGHT, [0.0] * _EIGHT.count)
                acc = cgutils.alloca_once_value(b, b.insert_element(zero8, b.extract_element(b.load(y), e.i64(0)), e.i64(0)))
                with cgutils.for_range(b, eights) as loop:
                    c = b.add(whole, b.mul(loop.index, e.i64(_EIGHT.count)))
                    b.store(e.fma(at(wp, wr, c, _EIGHT), at(xp, xr, c, _EIGHT), b.load(acc)), acc)
                b.store(e.tree(b.load(acc)), y)
            ones = b.add(whole, b.mul(eights, e.i64(_EIGHT.count)))
            with cgutils.for_range(b, b.sub(C, ones)) as loop:
                c = b.add(ones, loop.index)
                b.store(e.fma(at(wp, wr, c, _ONE), at(xp, xr, c, _ONE), b.load(y)), y)
            real = b.and_(b.icmp_signed("<", r, n_), b.icmp_signed("<", t, T))
            with cgutils.if_likely(b, real):
                b.store(b.load(y), b.bitcast(b.gep(op, [b.add(b.mul(t, R), b.add(r0_, r))]), _ONE.as_pointer()), align=4)

        def weight_rows(r):
            return [b.mul(e.clamp(b.add(r, e.i64(j)), n_), C) for j in range(W_ROWS)]

        groups = b.udiv(b.add(n_, e.i64(W_ROWS - 1)), e.i64(W_ROWS))
        sixes = b.udiv(T, e.i64(X_ROWS))
        # Rows in sixes: per u, every weight row group of the tile against the six rows, whose
        # columns of that u are first copied together (packed[u][i][k]: 6 × C/4 floats in a row).
        # In place, a u's lines of rows 8 KB apart fall in a quarter of L1's sets and evict
        # each other before the next weight rows come (~19 G multiply-adds/s a core against ~30 packed).
        packed, pp = pp, b.gep(pp, [b.mul(whole, e.i64(X_ROWS))])
        with cgutils.for_range(b, sixes) as tl:
            t0 = b.mul(tl.index, e.i64(X_ROWS))
            ts = [b.add(t0, e.i64(i)) for i in range(X_ROWS)]
            xrows = [b.mul(t, C) for t in ts]

            def packed_at(i, u, k):
                return b.mul(b.add(b.mul(b.add(b.mul(e.i64(u), e.i64(X_ROWS)), e.i64(i)), steps), k), e.i64(LANES))

            with cgutils.for_range(b, steps) as loop:
                for u in range(PHASES):
                    c = b.add(b.mul(loop.index, e.i64(STEP)), e.i64(LANES * u))
                    for i in range(X_ROWS):
                        e.store_vec(e.load_vec(xp, b.add(xrows[i], c)), packed, packed_at(i, u, loop.index))

            def xat(i, u, k, c):
                return packed, packed_at(i, u, k)

            for u in range(PHASES):
                with cgutils.for_range(b, groups) as gl:
                    r = b.mul(gl.index, e.i64(W_ROWS))
                    wrows = weight_rows(r)
                    sums = accumulate(xat, X_ROWS, wrows, [u])
                    for i in range(X_ROWS):
                        for j in range(W_ROWS):
                            at = b.mul(b.add(b.mul(b.add(r, e.i64(j)), e.i64(2 * X_ROWS)), e.i64(i)), e.i64(LANES))
                            later = b.add(at, e.i64(X_ROWS * LANES))  # a_2's place
                            a = sums[(i, j, u)]
                            if u == 0:
                                e.store_vec(a, pp, at)
                            elif u == 1:
                                e.store_vec(e.add(e.load_vec(pp, at), a), pp, at)
                            elif u == 2:
                                e.store_vec(a, pp, later)
                            else:
                                v = e.add(e.load_vec(pp, at), e.add(e.load_vec(pp, later), a))
                                finish(v, xrows[i], wrows[j], ts[i], b.add(r, e.i64(j)))
        # The last T mod 6 rows one at a time, all four u in one pass.
        done = b.mul(sixes, e.i64(X_ROWS))
        with cgutils.for_range(b, b.sub(T, done)) as tl:
            t = b.add(done, tl.index)
            xr = b.mul(t, C)
            with cgutils.for_range(b, groups) as gl:
                r = b.mul(gl.index, e.i64(W_ROWS))
                wrows = weight_rows(r)
                sums = accumulate(lambda i, u, k, c: (xp, b.add(xr, c)), 1, wrows, list(range(PHASES)))
                for j in range(W_ROWS):
                    a = [sums[(0, j, u)] for u in range(PHASES)]
                    finish(e.add(e.add(a[0], a[1]), e.add(a[2], a[3])), xr, wrows[j], t, b.add(r, e.i64(j)))
        return context.get_dummy_value()

    return types.void(X, tile, n, out, r0, scratch), codegen


float_rows: Any = intrinsic(_float_rows_typed)
