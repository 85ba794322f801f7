"""Small fused loops for the decode hot path, where a chain of numpy calls on a
few thousand floats costs more in dispatch than in arithmetic (measured: ~10 µs
of numpy calls per SwiGLU against ~1 µs fused). Compiled once, cached on disk."""

from __future__ import annotations

import numpy as np
from numba import njit

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
def _choice_sum(ys, at, weights, out):
    rows, k = at.shape
    cols = ys.shape[1]
    for t in range(rows):
        y, w0 = ys[at[t, 0]], weights[t, 0]
        for c in range(cols):
            out[t, c] = y[c] * w0
        for s in range(1, k):
            y, ws = ys[at[t, s]], weights[t, s]
            for c in range(cols):
                out[t, c] = out[t, c] + y[c] * ws


def choice_sum(ys: np.ndarray, at: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_s weights[t, s] · ys[at[t, s]] for ys f32 [N, D] (each token's chosen experts' outputs,
    at [T, K] their rows), added in choice order s = 0, 1, ... with each product rounded
    first (what decode's `out += y · w` does): [T, D]."""
    out = np.empty((at.shape[0], ys.shape[1]), np.float32)
    _choice_sum(ys, at, np.ascontiguousarray(weights, dtype=np.float32), out)
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
