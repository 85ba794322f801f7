"""Attention over a float32 or float16 KV cache as stored: decode's one query
per head and a prompt's many, with the same numbers for a position either way.

    attend(q, k, v, base, start, window, scale, sinks)   q [T, Hk, G, d] → [T, Hk, G, dv]

k [Hk, cap, d] and v [Hk, cap, dv] are one layer's stored rows, float32 or
float16; key position j lives in row (j − base) mod cap, so the same call
reads a whole-context cache (base 0, cap ≥ every position), a ring of the
last `cap` positions (a sliding-window layer) or a copy of a position range.
Query t sits at position start + t and sees keys lo..start+t, lo =
start + t − window + 1 with a window, else 0.

Why a kernel of our own (docs/kernels.md § Attention): numpy would convert the
float16 cache to float32 (~0.1 G values/s here, no SIMD path) and a prompt's
masked matmuls give a position other numbers than the decode step at that
position. Here every position computes the same operations in the same order
whatever batch it is in (prefix reuse relies on it, docs/conversations.md):

- a score is one chain of fused multiply-adds over the head width, times
  `scale` (attend_ir's score tile, or `_dot` where the width is not whole
  vectors: the same chain);
- a row's softmax is `_softmax_row` over exactly the keys it sees;
- its output is the keys' values summed in position order by `_fma`, one key
  after another (an explicit fused multiply-add, so no grouping can change it).

What a prompt batch shares is the work around them: its queries are taken in
blocks of tokens (`_block_tokens`) for one kv head, and each chunk of
`KEY_CHUNK` key (then value) rows is converted to float32 once for the whole
block instead of once per query, while the block's query rows stay in L1.
Blocks run on numba's threads. `exp` is `_exp`, a polynomial numba can
vectorize (libm's expf is a call per element: a quarter of a long prompt's
attention time before).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..quant import _target  # noqa: F401  (before any jit: the ARM dot-product target, shared/quant/_target.py)
from .attend_ir import KEY_LANES, LANES, PV_ROWS, Q_ROWS, keys_t, pv_rows, qk_lanes

# Keys converted to float32 at a time: 32 rows of d = 128 are 16 KB, in L1 beside the block's queries
# (the score tile takes them transposed: 32 keys are its two vectors).
KEY_CHUNK = KEY_LANES
# A decode step over at least this many keys splits its kv heads across threads (the
# same per-head work, so the same numbers): ~1 ms a layer at 3k positions on one core,
# where a parallel region costs a few µs.
PARALLEL_DECODE_KEYS = 1024
# Query rows (tokens × the kv head's G query heads) a prompt block aims at: enough to reuse each
# converted key row many times, few enough that the block's scores (rows × keys × 4 B) stay in L2
# for prompts of a few thousand tokens.
BLOCK_QUERY_ROWS = 64


# ---- scalar helpers: float16 bits, fused multiply-add, 2^n ------------------


def _half_to_float_typed(typingctx, bits):
    """float16 bits (uint16) → float32 by LLVM's own half → float extension: exact,
    and one vcvtph2ps for 16 lanes where the CPU has F16C (numba has no float16 type)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


def _fma_typed(typingctx, a, b, c):
    """a·b + c rounded once (llvm.fma): the same result in a vector lane or alone."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, args)

    return types.float32(a, b, c), codegen


def _bits_to_float_typed(typingctx, bits):
    """The low 32 bits of an integer as a float32 (numba widens int32 arithmetic to int64)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = args[0] if bits in (types.int32, types.uint32) else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


_half_to_float: Any = intrinsic(_half_to_float_typed)
_fma: Any = intrinsic(_fma_typed)
_bits_to_float: Any = intrinsic(_bits_to_float_typed)


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


@njit(cache=True, boundscheck=False)
def _half_row(src, dst):
    for i in range(dst.size):
        dst[i] = _half_to_float(src[i])


# ---- exp -----------------------------------------------------------------------
# Cody–Waite range reduction x = n·ln2 + r, |r| ≤ ln2/2, and the degree-7
# minimax polynomial of Cephes' expf (relative error ~1 ulp on float32); 2^n
# is built in the exponent bits. Arguments below ln(2^−126) give that smallest
# normal's share (~1e−38 of the largest key's weight: nothing), NaN stays NaN.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.3365447505531)  # ln(2^-126)
_EXP_MAX = np.float32(88.3762626647949)  # below ln(2^128)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)


@njit(inline="always", boundscheck=False)
def _exp(x):
    """exp(x) for float32 x, vectorizable (module doc)."""
    y = _EXP_MIN if x < _EXP_MIN else x
    y = _EXP_MAX if y > _EXP_MAX else y
    n = np.floor(_fma(y, _LOG2E, np.float32(0.5)))
    r = _fma(n, -_LN2_HI, y)
    r = _fma(n, -_LN2_LO, r)
    p = _fma(_P0, r, _P1)
    p = _fma(p, r, _P2)
    p = _fma(p, r, _P3)
    p = _fma(p, r, _P4)
    p = _fma(p, r, _P5)
    p = _fma(p, r * r, r) + np.float32(1.0)
    e = p * _bits_to_float((np.int64(n) + 127) << 23)
    return x if x != x else e


@njit(cache=True, boundscheck=False)
def _exp_array(x, out):
    for i in range(x.size):
        out[i] = _exp(x[i])


def exp32(x: np.ndarray) -> np.ndarray:
    """The kernels' exp on a float32 array (for tests and references)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _exp_array(x.reshape(-1), out.reshape(-1))
    return out


# ---- the three per-position steps ---------------------------------------------


@njit(inline="always", boundscheck=False)
def _dot(q, k, d):
    """q · k for head widths that are not whole vectors (attend_ir's tiles take the rest)."""
    s = np.float32(0.0)
    for c in range(d):
        s = _fma(q[c], k[c], s)
    return s


@njit(inline="always", boundscheck=False)
def _softmax_row(s, sink, use_sink, part):
    """In place: s[:] = softmax over s and, with use_sink, one more logit `sink` that takes
    probability mass and is then dropped (gpt-oss). `part` is 16 floats of scratch."""
    n = s.size
    m = _max(s, part)
    if use_sink and sink > m:
        m = sink
    for j in range(n):
        s[j] = _exp(s[j] - m)
    total = _sum(s, part)
    if use_sink:
        total += _exp(sink - m)
    for j in range(n):
        s[j] = s[j] / total


@njit(inline="always", boundscheck=False)
def _max(s, part):
    """max s (n ≥ 1), as 16 running maxima (any order gives the same maximum; this one vectorizes)."""
    part[:] = s[0]
    n = s.size
    j = 0
    while j + 16 <= n:
        for lane in range(16):
            x = s[j + lane]
            part[lane] = x if x > part[lane] else part[lane]
        j += 16
    for lane in range(n - j):
        x = s[j + lane]
        part[lane] = x if x > part[lane] else part[lane]
    m = part[0]
    for lane in range(1, 16):
        m = part[lane] if part[lane] > m else m
    return m


@njit(inline="always", boundscheck=False)
def _sum(s, part):
    """Σ s in a fixed order: 16 running sums of every 16th element from s[0] (one
    vector add per 16), the rest one by one, then the 16 pairwise (8, 4, 2, 1 apart)."""
    part[:] = 0.0
    n = s.size
    j = 0
    while j + 16 <= n:
        for lane in range(16):
            part[lane] += s[j + lane]
        j += 16
    for lane in range(n - j):
        part[lane] += s[j + lane]
    width = 8
    while width:
        for lane in range(width):
            part[lane] += part[lane + width]
        width //= 2
    return part[0]


@njit(inline="always", boundscheck=False)
def _add_values(p, vrows, o):
    """o[g, :] += Σ_j p[g, j]·vrows[j] for j = 0, 1, ... in that order, for every row g:
    one fused multiply-add per value, so four keys per pass over a row round as one
    at a time do; the rows' independent chains interleave (g inside the key loop)."""
    g_count, dv = o.shape
    n = vrows.shape[0]
    j = 0
    while j + 4 <= n:
        v0, v1, v2, v3 = vrows[j], vrows[j + 1], vrows[j + 2], vrows[j + 3]
        for g in range(g_count):
            p0, p1, p2, p3 = p[g, j], p[g, j + 1], p[g, j + 2], p[g, j + 3]
            og = o[g]
            for c in range(dv):
                og[c] = _fma(p3, v3[c], _fma(p2, v2[c], _fma(p1, v1[c], _fma(p0, v0[c], og[c]))))
        j += 4
    while j < n:
        vj = vrows[j]
        for g in range(g_count):
            pj = p[g, j]
            og = o[g]
            for c in range(dv):
                og[c] = _fma(pj, vj[c], og[c])
        j += 1


# ---- one block: tokens t0..t1-1 of kv head h ------------------------------------


@njit(inline="always")
def _first_key(p, window):
    return max(0, p - window + 1) if window > 0 else 0


@njit(inline="always", boundscheck=False)
def _load_rows(x, h, c0, c1, base, rows, width):
    """rows[j − c0, :width] = position j's row of kv head h as float32, for j = c0..c1-1."""
    for j in range(c0, c1):
        _load_row(x[h, (j - base) % x.shape[1]], rows[j - c0, :width])


@njit(cache=True, boundscheck=False, nogil=True)
def _block_scores(q, k, base, start, t0, t1, h, window, scale, s, rows, kt, tiled):
    """s[t − t0, g, j − first key] = q[t, h, g] · key j × scale for every key each
    query sees, chunk by chunk of keys, each chunk converted once for the block: where the
    head width allows, transposed (keys in lanes) and taken by tiles of 8 query rows of
    the block ((token, head) in order) × the chunk's 32 keys (attend_ir)."""
    hk, g_count, d = q.shape[1], q.shape[2], q.shape[3]
    span = s.shape[2]
    jlo = _first_key(start + t0, window)
    n_rows = (t1 - t0) * g_count
    qoff, soff = np.empty(Q_ROWS, np.int64), np.empty(Q_ROWS, np.int64)
    lo, hi = np.empty(Q_ROWS, np.int64), np.empty(Q_ROWS, np.int64)
    for c0 in range(jlo, start + t1, KEY_CHUNK):
        c1 = min(c0 + KEY_CHUNK, start + t1)
        if tiled:
            keys_t(k, h, c0, c1, base, kt)
            for r0 in range(0, n_rows, Q_ROWS):
                n = min(Q_ROWS, n_rows - r0)
                seen = False
                for i in range(n):
                    t, g = t0 + (r0 + i) // g_count, (r0 + i) % g_count
                    p = start + t
                    qoff[i] = ((t * hk + h) * g_count + g) * d
                    soff[i] = (r0 + i) * span + c0 - jlo
                    lo[i], hi[i] = max(c0, _first_key(p, window)) - c0, min(c1, p + 1) - c0
                    seen = seen or lo[i] < hi[i]
                if seen:
                    qk_lanes(q, qoff, soff, lo, hi, n, kt, d, scale, s)
        else:
            _load_rows(k, h, c0, c1, base, rows, d)
            for t in range(t0, t1):
                p = start + t
                for g in range(g_count):
                    for j in range(max(c0, _first_key(p, window)), min(c1, p + 1)):
                        s[t - t0, g, j - jlo] = _dot(q[t, h, g], rows[j - c0], d) * scale


@njit(cache=True, boundscheck=False, nogil=True)
def _block_values(v, base, start, t0, t1, h, window, sinks, use_sinks, s, rows, out, tiled):
    """Each query's softmax over its scores, then out[t, h, g] = Σ p_j · value j in
    position order, chunk by chunk of values, each value row converted once for the block."""
    g_count, dv = s.shape[1], v.shape[2]
    hk, span, width = out.shape[1], s.shape[2], rows.shape[1]
    jlo = _first_key(start + t0, window)
    part = np.empty(16, np.float32)
    for t in range(t0, t1):
        p = start + t
        lo = _first_key(p, window)
        for g in range(g_count):
            _softmax_row(s[t - t0, g, lo - jlo : p + 1 - jlo], sinks[(h * g_count + g) % sinks.size], use_sinks, part)
            out[t, h, g, :] = 0.0
    poff, ooff = np.empty(PV_ROWS, np.int64), np.empty(PV_ROWS, np.int64)
    for c0 in range(jlo, start + t1, KEY_CHUNK):
        c1 = min(c0 + KEY_CHUNK, start + t1)
        _load_rows(v, h, c0, c1, base, rows, dv)
        if not tiled:
            for t in range(t0, t1):
                p = start + t
                a, b = max(c0, _first_key(p, window)), min(c1, p + 1)
                if a < b:
                    _add_values(s[t - t0, :, a - jlo : b - jlo], rows[a - c0 : b - c0, :dv], out[t, h])
            continue
        # every row of the block sees the whole chunk (the usual case): tiles of any rows;
        # else each token's rows with its own keys of the chunk
        shared = _first_key(start + t1 - 1, window) <= c0 and c1 <= start + t0 + 1
        t = t0
        while t < t1:
            tn = t1 if shared else t + 1
            p = start + t
            a, b = (c0, c1) if shared else (max(c0, _first_key(p, window)), min(c1, p + 1))
            if a < b:
                r_lo, r_hi = (t - t0) * g_count, (tn - t0) * g_count
                for r0 in range(r_lo, r_hi, PV_ROWS):
                    n = min(PV_ROWS, r_hi - r0)
                    for i in range(n):
                        tt, g = t0 + (r0 + i) // g_count, (r0 + i) % g_count
                        poff[i] = (r0 + i) * span + a - jlo
                        ooff[i] = ((tt * hk + h) * g_count + g) * dv
                    pv_rows(s, poff, n, rows, a - c0, width, b - a, dv, out, ooff)
            t = tn


@njit(cache=True, boundscheck=False, nogil=True)
def _attend_block(q, k, v, base, start, t0, t1, h, window, scale, sinks, use_sinks, out):
    """out[t, h] for t in t0..t1-1: scores, softmax, values (module doc)."""
    span = start + t1 - _first_key(start + t0, window)
    s = np.empty((t1 - t0, q.shape[2], span), np.float32)
    rows = np.empty((KEY_CHUNK, max(q.shape[3], v.shape[2])), np.float32)
    tiled = q.shape[3] % LANES == 0 and v.shape[2] % LANES == 0
    kt = np.empty(q.shape[3] * KEY_CHUNK if tiled else 0, np.float32)
    _block_scores(q, k, base, start, t0, t1, h, window, scale, s, rows, kt, tiled)
    _block_values(v, base, start, t0, t1, h, window, sinks, use_sinks, s, rows, out, tiled)


@njit(cache=True, boundscheck=False, parallel=True, nogil=True)
def _attend_blocks(q, k, v, base, start, block, window, scale, sinks, use_sinks, out):
    """Every (kv head, block of `block` tokens) on numba's threads. A causal block's work grows
    with its position, and a thread takes a contiguous share of the items: they go shortest,
    longest, second shortest, second longest, ..., so every share holds as much work."""
    t_count, hk = q.shape[0], q.shape[1]
    n_blocks = (t_count + block - 1) // block
    for item in prange(hk * n_blocks):
        h, n = item % hk, item // hk
        b = n // 2 if n % 2 == 0 else n_blocks - 1 - n // 2
        _attend_block(q, k, v, base, start, b * block, min(t_count, b * block + block), h, window, scale, sinks, use_sinks, out)


@njit(cache=True, boundscheck=False, nogil=True)
def _attend_token(q, k, v, base, start, window, scale, sinks, use_sinks, out):
    """One token (decode): each kv head in turn on this thread."""
    for h in range(q.shape[1]):
        _attend_block(q, k, v, base, start, 0, 1, h, window, scale, sinks, use_sinks, out)


_NO_SINKS = np.zeros(1, np.float32)


def _block_tokens(g: int) -> int:
    return max(1, BLOCK_QUERY_ROWS // g)


def attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, base: int, start: int, window: int, scale: float, sinks: np.ndarray | None
) -> np.ndarray:
    """Causal attention of T queries at positions start..start+T-1 (module doc):
    q [T, Hk, G, d] → [T, Hk, G, dv]. Every key a query sees must be held:
    base ≤ its first key and its last key − that first key < cap."""
    t, hk, g, d = q.shape
    if k.shape[0] != hk or k.shape[2] != d or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"attend: q {q.shape} does not match k {k.shape} and v {v.shape}")
    first = _first_key(int(start), int(window))
    if t and (first < base or start + t - 1 - first >= k.shape[1]):
        raise ValueError(f"attend: positions {first}..{start + t - 1} are not all held by {k.shape[1]} rows from position {base}")
    if k.dtype == np.float16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    out = np.empty((t, hk, g, v.shape[2]), np.float32)
    if not t:
        return out
    s = _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, np.float32)
    q = np.ascontiguousarray(q, np.float32)
    args = (q, k, v, int(base), int(start))
    if t == 1 and (hk == 1 or start + 1 - first < PARALLEL_DECODE_KEYS):
        _attend_token(*args, int(window), np.float32(scale), s, sinks is not None, out)
    else:  # a prompt's blocks, or a long decode step's kv heads, on numba's threads
        _attend_blocks(*args, _block_tokens(g) if t > 1 else 1, int(window), np.float32(scale), s, sinks is not None, out)
    return out
