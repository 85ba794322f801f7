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
  `scale` (attend_ir's tiles, or `_dot` where the width is not whole vectors);
- a row's softmax is online, over the 32-key chunks it sees, in position
  order: chunks are aligned to positions (keys 0..31, 32..63, ...), so a decode
  step and every prompt block meet a position's keys in the same chunks. A
  chunk's step keeps the running max m and sum l: m' = max(m, the chunk's
  scores), weights exp(s − m'), l' = l·exp(m − m') + Σ weights, and the output
  row o' = o·exp(m − m') + Σ weight·value, the values one after another by
  fused multiply-adds in position order. A key a row does not see gets weight
  0 (its multiply-add changes nothing), so a block may take whole chunks.
  The output is o / l at the end.

What a prompt batch shares is the work around them: its queries are taken in
blocks of tokens (`_block_tokens`) for one kv head, and each chunk of
`KEY_CHUNK` keys and values is converted to float32 once for the whole block
instead of once per query. No score outlives its chunk: a row's 32 scores,
weights and sums stay in registers (attend_ir `qk_softmax`), so a long prompt
needs no memory for its score matrix.
Blocks run on numba's threads. `exp` is `_exp`, a polynomial numba can
vectorize (libm's expf is a call per element: a quarter of a long prompt's
attention time before).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..quant import _target  # noqa: F401  (before any jit: the ARM dot-product target, shared/quant/_target.py)
from .attend_ir import (
    EXP_LN2_HI,
    EXP_LN2_LO,
    EXP_LOG2E,
    EXP_MAX,
    EXP_MIN,
    EXP_POLY,
    KEY_LANES,
    LANES,
    Q_ROWS,
    keys_t,
    pv_rows,
    qk_softmax,
    values_f32,
)

# Keys converted to float32 at a time: 32 rows of d = 128 are 16 KB, in L1 beside the block's queries
# (the score tile takes them transposed: 32 keys are its two vectors).
KEY_CHUNK = KEY_LANES
# A decode step over at least this many keys splits its kv heads across threads, and with fewer
# kv heads than threads (deepseek2's one latent head) their query heads (the same per-row work,
# so the same numbers): ~1 ms a layer at 3k positions on one core of
# the AVX-512 host, and on a Zen 3 (AVX2) 0.56 ms at 512 positions, its keys and values
# coming from DRAM between the layers' weights, where a parallel region costs a few µs.
# From 1,024 to 128 keys took that decode step's attention 4.6 → 2.4 ms a token
# (qwen30b-shape L8, 512 positions, 8 layers, two runs each, 2026-12-05).
PARALLEL_DECODE_KEYS = 256
# Query rows (tokens × the kv head's G query heads) a prompt block aims at: enough to reuse each
# converted key row many times, few enough that the block's scores (rows × keys × 4 B) stay in L2
# for prompts of a few thousand tokens.
BLOCK_QUERY_ROWS = 128


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


# ---- exp ----------------------------------------------------------------------
# The constants and why: attend_ir (EXP_*), whose 16-lane exp is this one operation for operation.
_LOG2E, _LN2_HI, _LN2_LO, _EXP_MIN, _EXP_MAX = EXP_LOG2E, EXP_LN2_HI, EXP_LN2_LO, EXP_MIN, EXP_MAX
_P0, _P1, _P2, _P3, _P4, _P5 = EXP_POLY


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


# ---- one row's step over a chunk where the head width is not whole vectors ---------


@njit(inline="always", boundscheck=False)
def _dot(q, k, d):
    """q · k: one chain of fused multiply-adds over the head width."""
    s = np.float32(0.0)
    for c in range(d):
        s = _fma(q[c], k[c], s)
    return s


@njit(inline="always", boundscheck=False)
def _row_step(q, rows, a, b, d, dv, scale, m, l, r, w, o):
    """The online-softmax step of one row over keys a..b-1 of a chunk (rows[j]: key j, then its
    value at column d): what qk_softmax and pv_rows do for a tile, one row in scalar code."""
    m_new = m[r]
    for j in range(a, b):
        w[j] = _dot(q, rows[j], d) * scale
        m_new = w[j] if w[j] > m_new else m_new
    alpha = np.float32(1.0) if m_new == -np.inf else _exp(m[r] - m_new)
    total = np.float32(0.0)
    for j in range(a, b):
        w[j] = _exp(w[j] - m_new)
        total += w[j]
    m[r], l[r, 0] = m_new, _fma(l[r, 0], alpha, total)
    for c in range(dv):
        acc = o[c] * alpha
        for j in range(a, b):
            acc = _fma(w[j], rows[j, d + c], acc)
        o[c] = acc


@njit(inline="always", boundscheck=False)
def _lanes_total(x):
    """Σ of 16 lanes in place, pairwise 8, 4, 2, 1 apart (a fixed order)."""
    width = 8
    while width:
        for lane in range(width):
            x[lane] += x[lane + width]
        width //= 2
    return x[0]


# ---- one block: tokens t0..t1-1 of kv head h ------------------------------------


@njit(inline="always")
def _first_key(p, window):
    return max(0, p - window + 1) if window > 0 else 0


@njit(inline="always", boundscheck=False)
def _load_rows(x, h, a, c1, c0, base, rows, col, width):
    """rows[j − c0, col:col + width] = the first `width` columns of position j's row of kv head h
    as float32, for j = a..c1-1."""
    for j in range(a, c1):
        _load_row(x[h, (j - base) % x.shape[1], :width], rows[j - c0, col : col + width])


@njit(cache=True, boundscheck=False, nogil=True)
def _attend_block(q, k, v, base, start, t0, t1, h, g0, g1, window, scale, sinks, use_sinks, out):
    """out[t, h, g0:g1] for t in t0..t1-1 (module doc): the block's rows are (token, query head g0..g1-1) in order;
    chunks of 32 keys aligned to positions (multiples of 32, whatever the block: a decode step meets
    the same chunks) are converted to float32 once for the block, and each row takes each chunk it
    sees in one online-softmax step (running max m, sum l, output rescaled by exp(m − m')); at the
    end the output is divided by l (gpt-oss's sink first joins the max and the sum)."""
    hk, g_count, d = q.shape[1], q.shape[2], q.shape[3]
    dv = out.shape[3]  # v's first dv columns (v may be k itself: deepseek2's latent head)
    g_part = g1 - g0
    n_rows = (t1 - t0) * g_part
    tiled = d % LANES == 0 and dv % LANES == 0
    m = np.full(n_rows + Q_ROWS, -np.inf, np.float32)  # running max and (16 lanes of) sum per row,
    l = np.zeros((n_rows + Q_ROWS, LANES), np.float32)  # with a partial tile's padding
    for t in range(t0, t1):
        out[t, h, g0:g1, :] = 0.0
    rows = np.empty((KEY_CHUNK, (0 if tiled else d) + dv), np.float32)  # the chunk's values (after its keys, untiled)
    kt = np.empty(d * KEY_CHUNK if tiled else 0, np.float32)
    w = np.empty(Q_ROWS * KEY_CHUNK, np.float32)
    alpha = np.empty(Q_ROWS, np.float32)
    # per row: where its query and output start, its first key and its position
    qoff, ooff = np.empty(n_rows, np.int64), np.empty(n_rows, np.int64)
    first, last = np.empty(n_rows, np.int64), np.empty(n_rows, np.int64)
    for r in range(n_rows):
        t, g = t0 + r // g_part, g0 + r % g_part
        qoff[r], ooff[r] = ((t * hk + h) * g_count + g) * d, ((t * hk + h) * g_count + g) * dv
        first[r], last[r] = _first_key(start + t, window), start + t
    lo, hi = np.empty(Q_ROWS, np.int64), np.empty(Q_ROWS, np.int64)
    jlo = first[0]
    for c0 in range(jlo - jlo % KEY_CHUNK, start + t1, KEY_CHUNK):
        a, c1 = max(c0, jlo), min(c0 + KEY_CHUNK, start + t1)
        if tiled:
            keys_t(k, h, c0, a, c1, base, kt)
            values_f32(v, h, c0, a, c1, base, rows, dv)
        else:
            _load_rows(k, h, a, c1, c0, base, rows, 0, d)
            _load_rows(v, h, a, c1, c0, base, rows, d, dv)
        for r0 in range(0, n_rows, Q_ROWS):
            n = min(Q_ROWS, n_rows - r0)
            if last[r0 + n - 1] < c0 or first[r0] >= c1:  # no row of the tile sees this chunk: a step would change nothing
                continue
            for i in range(n):
                lo[i], hi[i] = max(a, first[r0 + i]) - c0, min(c1, last[r0 + i] + 1) - c0
            if tiled:
                qk_softmax(q, qoff[r0:], lo, hi, n, kt, d, scale, m, l, r0, alpha, w)
                pv_rows(w, a - c0, n, alpha, rows, a - c0, dv, c1 - a, dv, out, ooff[r0:])
            else:
                for i in range(n):
                    if lo[i] < hi[i]:
                        t, g = t0 + (r0 + i) // g_part, g0 + (r0 + i) % g_part
                        _row_step(q[t, h, g], rows, lo[i], hi[i], d, dv, scale, m, l, r0 + i, w, out[t, h, g])
    for r in range(n_rows):
        t, g = t0 + r // g_part, g0 + r % g_part
        total = _lanes_total(l[r])
        if use_sinks:
            sink = sinks[(h * g_count + g) % sinks.size]
            if sink > m[r]:
                f = _exp(m[r] - sink)
                out[t, h, g, :] *= f
                total = _fma(total, f, np.float32(1.0))
            else:
                total += _exp(sink - m[r])
        out[t, h, g, :] /= total


@njit(cache=True, boundscheck=False, parallel=True, nogil=True)
def _attend_blocks(q, k, v, base, start, block, parts, window, scale, sinks, use_sinks, out):
    """Every (kv head, block of `block` tokens, part of its query heads: `parts` of them) on
    numba's threads. A causal block's work grows with its position, and a thread takes a
    contiguous share of the items: they go shortest, longest, second shortest, second longest,
    ..., so every share holds as much work."""
    t_count, hk, g_count = q.shape[0], q.shape[1], q.shape[2]
    n_blocks = (t_count + block - 1) // block
    for item in prange(hk * n_blocks * parts):
        part, rest = item % parts, item // parts
        h, n = rest % hk, rest // hk
        b = n // 2 if n % 2 == 0 else n_blocks - 1 - n // 2
        g0, g1 = part * g_count // parts, (part + 1) * g_count // parts
        _attend_block(q, k, v, base, start, b * block, min(t_count, b * block + block), h, g0, g1, window, scale, sinks, use_sinks, out)


@njit(cache=True, boundscheck=False, nogil=True)
def _attend_token(q, k, v, base, start, window, scale, sinks, use_sinks, out):
    """One token (decode): each kv head in turn on this thread."""
    for h in range(q.shape[1]):
        _attend_block(q, k, v, base, start, 0, 1, h, 0, q.shape[2], window, scale, sinks, use_sinks, out)


_NO_SINKS = np.zeros(1, np.float32)


def _block_tokens(g: int) -> int:
    return max(1, BLOCK_QUERY_ROWS // g)


def attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray | int, base: int, start: int, window: int, scale: float, sinks: np.ndarray | None
) -> np.ndarray:
    """Causal attention of T queries at positions start..start+T-1 (module doc):
    q [T, Hk, G, d] → [T, Hk, G, dv]. `v` is the value rows, or an int dv: each key's
    first dv columns are its value (deepseek2's latent head). Every key a query sees
    must be held: base ≤ its first key and its last key − that first key < cap."""
    t, hk, g, d = q.shape
    if isinstance(v, int):
        v, dv = k, v
    else:
        dv = v.shape[2]
    if k.shape[0] != hk or k.shape[2] != d or v.shape[:2] != k.shape[:2] or not 0 < dv <= v.shape[2] or v.dtype != k.dtype:
        raise ValueError(f"attend: q {q.shape} does not match k {k.shape} and v {v.shape} ({dv} value columns)")
    # its Python: a call to the compiled helper from here compiles it afresh in every process
    # (not cacheable on its own: ~0.26 s of each start-up) and costs ~3 µs a call
    first = _first_key.py_func(int(start), int(window))
    if t and (first < base or start + t - 1 - first >= k.shape[1]):
        raise ValueError(f"attend: positions {first}..{start + t - 1} are not all held by {k.shape[1]} rows from position {base}")
    # One type per dtype for the kernels (each type is a compile of its own): C-contiguous
    # (a cache's arrays are; a view is copied) and writable sinks (a file's tensor is read-only).
    k = np.ascontiguousarray(k)
    v = k if v is k else np.ascontiguousarray(v)
    if k.dtype == np.float16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    out = np.empty((t, hk, g, dv), np.float32)
    if not t:
        return out
    s = _NO_SINKS if sinks is None else np.array(sinks, np.float32)
    q = np.ascontiguousarray(q, np.float32)
    args = (q, k, v, int(base), int(start))
    if t == 1 and start + 1 - first < PARALLEL_DECODE_KEYS:
        _attend_token(*args, int(window), np.float32(scale), s, sinks is not None, out)
    else:  # a prompt's blocks, or a long decode step's kv heads (and with fewer of them than threads, their query heads) on numba's threads
        parts = 1 if t > 1 else max(1, min(g, -(-get_num_threads() // hk)))
        _attend_blocks(*args, _block_tokens(g) if t > 1 else 1, parts, int(window), np.float32(scale), s, sinks is not None, out)
    return out
