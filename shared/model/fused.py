"""Small fused loops for the decode hot path, where a chain of numpy calls on a
few thousand floats costs more in dispatch than in arithmetic (measured: ~10 µs
of numpy calls per SwiGLU against ~1 µs fused), and for a prompt chunk's rows,
which run on numba's threads (PARALLEL_ROWS). Compiled once, cached on disk."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant import _target  # noqa: F401  (before any jit: the ARM dot-product target, shared/quant/_target.py)
from .attend import _exp

# From this many rows (a prompt chunk's tokens) a fused loop runs its rows on numba's threads;
# below (decode: one row), one thread, where a parallel region would cost more than the work.
# Each row computes the same either way: one inline function per row.
PARALLEL_ROWS = 64


@njit(inline="always", boundscheck=False)
def _swiglu_row(g, u, out, r):
    one = np.float32(1.0)
    for i in range(g.shape[1]):
        x = g[r, i]
        out[r, i] = x / (one + _exp(-x)) * u[r, i]  # silu(x)·u; _exp saturates, so large -x gives -0


# error_model="numpy": a float division by zero gives inf or nan rather than raising (it cannot
# happen here: the divisor is 1 + exp(-x) ≥ 1, or nan). Python's model tests every divisor,
# which kept the loop scalar: 23 µs for a decode step's 8 × 768, 2.3 µs as 16-lane vectors.
@njit(cache=True, boundscheck=False, error_model="numpy")
def _swiglu(g, u, out):
    for r in range(g.shape[0]):
        _swiglu_row(g, u, out, r)


@njit(cache=True, boundscheck=False, parallel=True, error_model="numpy")
def _swiglu_rows(g, u, out):
    for r in prange(g.shape[0]):
        _swiglu_row(g, u, out, r)


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) ⊙ u for float32 arrays of one shape (exp: the attention kernels' polynomial)."""
    g = np.ascontiguousarray(g, dtype=np.float32)
    u = np.ascontiguousarray(u, dtype=np.float32)
    out = np.empty_like(g)
    g2, u2, o2 = (a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1) for a in (g, u, out))
    (_swiglu_rows if g2.shape[0] >= PARALLEL_ROWS else _swiglu)(g2, u2, o2)
    return out


@njit(inline="always", boundscheck=False)
def _choice_sum_row(ys, at, weights, out, t):
    y, w0 = ys[at[t, 0]], weights[t, 0]
    for c in range(ys.shape[1]):
        out[t, c] = y[c] * w0
    for s in range(1, at.shape[1]):
        y, ws = ys[at[t, s]], weights[t, s]
        for c in range(ys.shape[1]):
            out[t, c] = out[t, c] + y[c] * ws


@njit(cache=True, boundscheck=False)
def _choice_sum(ys, at, weights, out):
    for t in range(at.shape[0]):
        _choice_sum_row(ys, at, weights, out, t)


@njit(cache=True, boundscheck=False, parallel=True)
def _choice_sum_rows(ys, at, weights, out):
    for t in prange(at.shape[0]):
        _choice_sum_row(ys, at, weights, out, t)


def choice_sum(ys: np.ndarray, at: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_s weights[t, s] · ys[at[t, s]] for ys f32 [N, D] (each token's chosen experts' outputs,
    at [T, K] their rows), added in choice order s = 0, 1, ... with each product rounded
    first, as `out = y0 · w0; out += y1 · w1; ...` in numpy rounds: [T, D]."""
    out = np.empty((at.shape[0], ys.shape[1]), np.float32)
    kernel = _choice_sum_rows if at.shape[0] >= PARALLEL_ROWS else _choice_sum
    kernel(ys, at, np.ascontiguousarray(weights, dtype=np.float32), out)
    return out


@njit(inline="always", boundscheck=False)
def _rms_norm_row(x, w, use_w, eps, out, r):
    cols = x.shape[1]
    # float64 (the mean of squares without float32 drift) in 8 running sums, element c in sum
    # c mod 8, added pairwise at the end: a fixed order that vectorizes
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    c = 0
    while c + 8 <= cols:
        v0, v1, v2, v3 = np.float64(x[r, c]), np.float64(x[r, c + 1]), np.float64(x[r, c + 2]), np.float64(x[r, c + 3])
        v4, v5, v6, v7 = np.float64(x[r, c + 4]), np.float64(x[r, c + 5]), np.float64(x[r, c + 6]), np.float64(x[r, c + 7])
        a0 += v0 * v0
        a1 += v1 * v1
        a2 += v2 * v2
        a3 += v3 * v3
        a4 += v4 * v4
        a5 += v5 * v5
        a6 += v6 * v6
        a7 += v7 * v7
        c += 8
    while c < cols:  # widths that are not a multiple of 8: the rest into the first sum
        v = np.float64(x[r, c])
        a0 += v * v
        c += 1
    acc = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
    scale = np.float32(1.0 / np.sqrt(acc / cols + eps))
    for c in range(cols):
        y = x[r, c] * scale
        out[r, c] = y * w[c] if use_w else y


@njit(cache=True, boundscheck=False)
def _rms_norm(x, w, use_w, eps, out):
    for r in range(x.shape[0]):
        _rms_norm_row(x, w, use_w, eps, out, r)


@njit(cache=True, boundscheck=False, parallel=True)
def _rms_norm_rows(x, w, use_w, eps, out):
    for r in prange(x.shape[0]):
        _rms_norm_row(x, w, use_w, eps, out, r)


_NO_WEIGHT = np.ones(1, np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x · (mean(x²) + eps)^-½ · w over the last axis (w None: no weight)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    kernel = _rms_norm_rows if flat.shape[0] >= PARALLEL_ROWS else _rms_norm
    kernel(flat, weight if weight is not None else _NO_WEIGHT, weight is not None, float(eps), out)
    return out.reshape(x.shape)


@njit(cache=True, boundscheck=False)
def _softmax_top_k(logits, k, renormalize, ids, weights):
    """Row-wise: softmax over all, the k best (ties: lower id), optionally renormalized."""
    rows, e = logits.shape
    p = np.empty(e, np.float32)
    for r in range(rows):
        m = logits[r, 0]
        for i in range(1, e):
            if logits[r, i] > m:
                m = logits[r, i]
        total = np.float32(0.0)
        for i in range(e):
            p[i] = np.exp(logits[r, i] - m)
            total += p[i]
        for i in range(e):
            p[i] /= total
        taken = 0.0
        for s in range(k):
            best = -1
            for i in range(e):
                if best < 0 or p[i] > p[best]:
                    used = False
                    for t in range(s):
                        if ids[r, t] == i:
                            used = True
                            break
                    if not used:
                        best = i
            ids[r, s] = best
            weights[r, s] = p[best]
            taken += p[best]
        if renormalize:
            for s in range(k):
                weights[r, s] = weights[r, s] / np.float32(taken)


@njit(inline="always", boundscheck=False)
def _rope_token(x, cos, sin, half, t):
    """In place, NEOX pairs (i, i + half) of every head of token t: x [T, heads, d], cos/sin [T, half]."""
    for h in range(x.shape[1]):
        for i in range(half):
            a, b = x[t, h, i], x[t, h, i + half]
            c, s = cos[t, i], sin[t, i]
            x[t, h, i] = a * c - b * s
            x[t, h, i + half] = b * c + a * s


@njit(cache=True, boundscheck=False)
def _rope_tokens(x, cos, sin, half):
    for t in range(x.shape[0]):
        _rope_token(x, cos, sin, half, t)


@njit(cache=True, boundscheck=False, parallel=True)
def _rope_tokens_parallel(x, cos, sin, half):
    for t in prange(x.shape[0]):
        _rope_token(x, cos, sin, half, t)


def _rope_rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, half: int) -> None:
    """In place, NEOX pairs (i, i + half) of every head: x [T, heads, d], cos/sin [T, half]; a
    prompt chunk's tokens on numba's threads (the same numbers: each element is its own)."""
    (_rope_tokens_parallel if x.shape[0] >= PARALLEL_ROWS else _rope_tokens)(x, cos, sin, half)


@njit(cache=True, boundscheck=False, parallel=True)
def _norm_rope_tokens(x, w, eps, cos, sin, half, out_rows, out):
    """out = RoPE(rms_norm(x) · w) per token, its heads' norms then their rotation while the
    token's rows are in L1 (x, out_rows [T·heads, d]; out the same memory as [T, heads, d])."""
    heads = out.shape[1]
    for t in prange(out.shape[0]):
        for h in range(heads):
            _rms_norm_row(x, w, True, eps, out_rows, t * heads + h)
        _rope_token(out, cos, sin, half, t)


def norm_rope(
    x: np.ndarray, weight: np.ndarray, eps: float, cos: np.ndarray, sin: np.ndarray, half: int, out: np.ndarray | None = None
) -> np.ndarray:
    """rms_norm(x, weight, eps) then RoPE's rotation of each head's pairs (i, i + half), the
    numbers of `rms_norm` then `Rope.apply` (the same operations per element), in one pass
    over a prompt chunk's x [T, heads, d] on numba's threads where those take two passes and a
    copy (a 3,600-token prompt's q and k: 95 → 45 ms a layer). `out` may be x itself (a row
    is read whole before it is written): a prompt's q is 59 MB, and a fresh array of that
    size is as many page faults on its first writes."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    t, heads, d = x.shape
    if t < PARALLEL_ROWS:
        rows = rms_norm(x, weight, eps)
        _rope_tokens(rows, np.ascontiguousarray(cos), np.ascontiguousarray(sin), half)
        return rows
    if out is None:
        out = np.empty_like(x)
    _norm_rope_tokens(
        x.reshape(t * heads, d),
        weight,
        float(eps),
        np.ascontiguousarray(cos),
        np.ascontiguousarray(sin),
        half,
        out.reshape(t * heads, d),
        out,
    )
    return out
