"""Small fused loops for the decode hot path, where a chain of numpy calls on a
few thousand floats costs more in dispatch than in arithmetic (measured: ~10 µs
of numpy calls per SwiGLU against ~1 µs fused). Compiled once, cached on disk."""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ..quant import _target  # noqa: F401  (before any jit: the ARM dot-product target, shared/quant/_target.py)


@njit(cache=True, boundscheck=False)
def _swiglu(g, u, out):
    gf, uf, of = g.ravel(), u.ravel(), out.ravel()
    one = np.float32(1.0)
    for i in range(gf.size):
        x = gf[i]
        of[i] = x / (one + np.exp(-x)) * uf[i]  # silu(x)·u; exp(-x) = inf gives the right -0


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) ⊙ u for float32 arrays of one shape."""
    g = np.ascontiguousarray(g, dtype=np.float32)
    u = np.ascontiguousarray(u, dtype=np.float32)
    out = np.empty_like(g)
    _swiglu(g, u, out)
    return out


@njit(cache=True, boundscheck=False)
def _rms_norm(x, w, use_w, eps, out):
    rows, cols = x.shape
    for r in range(rows):
        acc = 0.0  # float64: the mean of squares without float32 drift
        for c in range(cols):
            v = np.float64(x[r, c])
            acc += v * v
        scale = np.float32(1.0 / np.sqrt(acc / cols + eps))
        for c in range(cols):
            y = x[r, c] * scale
            out[r, c] = y * w[c] if use_w else y


_NO_WEIGHT = np.ones(1, np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x · (mean(x²) + eps)^-½ · w over the last axis (w None: no weight)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    _rms_norm(flat, weight if weight is not None else _NO_WEIGHT, weight is not None, float(eps), out)
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


@njit(cache=True, boundscheck=False)
def _rope_rotate(x, cos, sin, half):
    """In place, NEOX pairs (i, i + half) of every head: x [T, heads, d], cos/sin [T, half]."""
    t_count, heads, _ = x.shape
    for t in range(t_count):
        for h in range(heads):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                c, s = cos[t, i], sin[t, i]
                x[t, h, i] = a * c - b * s
                x[t, h, i + half] = b * c + a * s


# ---- decode attention over a float16 or float32 KV cache ----------------------
#
# One query row per head against N cached positions. numpy would first convert
# the cache's float16 rows to float32 — all N of them, every token, every layer,
# at ~0.1 G values/s (numpy's float16 cast has no SIMD path here): 36–43 ms a
# token at N = 256 on Qwen3-30B's 48 layers (4 kv heads × 128), more than the
# arithmetic. This loop converts one row at a time into a small buffer and uses
# it at once (12 ms at N = 256, same machine and load; docs/kernels.md § Attention).


def _load_row(src, dst):
    """Typed by the overload below; numba calls that, never this body."""
    raise NotImplementedError


@overload(_load_row)
def _load_row_typed(src, dst):
    """dst[:] = src as float32: float16 rows come as their uint16 bits (numba has no float16)."""
    if src.dtype == types.uint16:
        return _half_row.py_func
    return _copy_row.py_func


@njit(cache=True, boundscheck=False)
def _copy_row(src, dst):
    for i in range(dst.size):
        dst[i] = src[i]


def _half_to_float_typed(typingctx, bits):
    """float16 bits (uint16) → float32 by LLVM's own half → float extension: exact,
    and one vcvtph2ps for 16 lanes where the CPU has F16C (numba has no float16 type)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


_half_to_float: Any = intrinsic(_half_to_float_typed)


@njit(cache=True, boundscheck=False)
def _half_row(src, dst):
    for i in range(dst.size):
        dst[i] = _half_to_float(src[i])


@njit(cache=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _attend_one(q, k, v, lo, n, scale, sinks, use_sinks, out):
    """q [Hk, G, d] float32; k [Hk, n_ctx, d], v [Hk, n_ctx, dv] float32 or float16 bits;
    positions lo..n-1 → out [Hk, G, dv]. Softmax in float32 as the numpy path does."""
    hk, g, d = q.shape
    dv = v.shape[2]
    width = n - lo
    for h in range(hk):
        row = np.empty(d, np.float32)
        vrow = np.empty(dv, np.float32)
        scores = np.empty((g, width), np.float32)
        for j in range(width):
            _load_row(k[h, lo + j], row)
            for a in range(g):
                s = np.float32(0.0)
                for c in range(d):
                    s += q[h, a, c] * row[c]
                scores[a, j] = s * scale
        for a in range(g):
            m = scores[a, 0]
            for j in range(1, width):
                if scores[a, j] > m:
                    m = scores[a, j]
            if use_sinks and sinks[h * g + a] > m:
                m = sinks[h * g + a]
            total = np.float32(0.0)
            for j in range(width):
                e = np.exp(scores[a, j] - m)
                scores[a, j] = e
                total += e
            if use_sinks:
                total += np.exp(sinks[h * g + a] - m)
            for j in range(width):
                scores[a, j] /= total
            for c in range(dv):
                out[h, a, c] = 0.0
        for j in range(width):
            _load_row(v[h, lo + j], vrow)
            for a in range(g):
                p = scores[a, j]
                for c in range(dv):
                    out[h, a, c] += p * vrow[c]


_NO_SINKS = np.zeros(1, np.float32)


@njit(cache=True, boundscheck=False, parallel=True)
def _attend_rows(q, k, v, start, window, scale, sinks, use_sinks, out):
    """A prompt batch's queries, each exactly as a decode step at its position
    computes it (`_attend_one` on the same cache and bounds): q [T, Hk, G, d] →
    out [T, Hk, G, dv]. Rows are independent, so they split across threads."""
    for t in prange(q.shape[0]):
        n = start + t + 1
        lo = max(0, n - window) if window > 0 else 0
        _attend_one(q[t], k, v, lo, n, scale, sinks, use_sinks, out[t])


def attend_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int, scale: float, sinks: np.ndarray | None) -> np.ndarray:
    """Causal attention of T queries at positions start..start+T-1 over a float32 or
    float16 cache as stored, each row bit for bit what `attend_one` gives for that
    position: q [T, Hk, G, d] → [T, Hk, G, dv]. So a position's numbers do not
    depend on how a prompt was cut into batches, or on whether it was a prompt's
    or a decoded token (prefix reuse relies on it: docs/conversations.md)."""
    if k.dtype == np.float16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    out = np.empty((q.shape[0], q.shape[1], q.shape[2], v.shape[2]), np.float32)
    s = _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, np.float32)
    _attend_rows(np.ascontiguousarray(q, np.float32), k, v, start, window, np.float32(scale), s, sinks is not None, out)
    return out


def attend_one(q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int, n: int, scale: float, sinks: np.ndarray | None) -> np.ndarray:
    """One decode query per head over cached positions lo..n-1 of a float32 or
    float16 cache ([Hk, n_ctx, d] arrays as stored): q [Hk, G, d] → [Hk, G, dv]."""
    if k.dtype == np.float16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    s = _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, np.float32)
    _attend_one(np.ascontiguousarray(q, np.float32), k, v, lo, n, np.float32(scale), s, sinks is not None, out)
    return out
