"""Shared forward-pass blocks: RMSNorm, RoPE (plain, YaRN, per-pair factors),
grouped-query attention over a KV cache (causal, sliding window, sinks).

Everything is float32 numpy; the KV cache may store f16 or q8_0, but its reads
are float32. Legend: T new tokens, N cached positions (including the new
ones), H query heads, Hk kv heads, G = H/Hk, d head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..gguf.spec import Q8_0_BLOCK, RopeSpec, check_kv_type
from .attend import attend
from .fused import _rope_rotate, rms_norm, swiglu  # noqa: F401  (fused loops, part of the blocks' API)

# ---- rotary position embedding --------------------------------------------------


@dataclass(frozen=True)
class Rope:
    """Rotation of the first `n_rot` dims of each head, NEOX (rotate-half) pairs (i, i + n_rot/2)."""

    inv_freq: np.ndarray  # [n_rot/2] radians per position
    attn_factor: float = 1.0  # multiplies cos and sin (YaRN's mscale)

    @property
    def n_rot(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Every layer of a forward pass asks for the same positions: keep the last answer.
        key = (int(positions[0]), positions.shape[0]) if positions.size else None
        memo = self.__dict__.get("_memo")
        if memo is not None and memo[0] == key:
            return memo[1]
        angles = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [T, n_rot/2]
        f = np.float32(self.attn_factor)
        out = (np.cos(angles) * f, np.sin(angles) * f)
        object.__setattr__(self, "_memo", (key, out))  # a cache, not state: the dataclass stays frozen in meaning
        return out

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [T, heads, d] rotated in place-safe fashion; dims ≥ n_rot pass through."""
        out = np.array(x, dtype=np.float32, order="C")  # [T, heads, d]
        _rope_rotate(out, np.ascontiguousarray(cos), np.ascontiguousarray(sin), self.inv_freq.shape[0])
        return out


def plain_inv_freq(base: float, n_rot: int, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """θ_i = base^(−2i/n_rot), divided by per-pair factors when the model has them
    (Gemma-4's full layers rotate only the first pairs: factor 1e30 freezes the rest)."""
    inv: np.ndarray = 1.0 / (np.float32(base) ** (np.arange(0, n_rot, 2, dtype=np.float32) / np.float32(n_rot)))
    if freq_factors is not None:
        inv = inv / freq_factors[: inv.shape[0]].astype(np.float32)
    return inv.astype(np.float32)


def yarn_rope(r: RopeSpec, n_rot: int, truncate: bool) -> Rope:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between.

    `truncate` rounds the ramp ends to whole pairs (llama.cpp always does; the
    gpt-oss reference config says truncate=false, so its models pass False).
    """
    base, factor = r.freq_base, r.factor
    orig = r.orig_ctx or 4096

    def correction_dim(rotations: float) -> float:
        return n_rot * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, n_rot - 1)
    if low == high:
        high += 0.001
    extrap = plain_inv_freq(base, n_rot)  # [n_rot/2]
    interp = extrap / np.float32(factor)
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 → extrapolate (high frequency), 0 → interpolate
    inv = interp * (1 - keep) + extrap * keep
    mscale = (0.1 * math.log(factor) + 1.0) if factor > 1 else 1.0
    return Rope(inv.astype(np.float32), mscale * r.attn_factor)


def rope_from_spec(r: RopeSpec) -> Rope:
    """The model's RoPE from its GGUF keys: plain, or YaRN.

    YaRN's ramp ends are rounded to whole dims: that is what a GGUF means, as
    llama.cpp defines it. (The HF gpt-oss config says truncate=false, ~1e-3
    apart in the logits; the GGUF has no key for it, and a GGUF must give the
    same tokens here and in llama.cpp.)
    """
    if r.scaling == "yarn":
        return yarn_rope(r, r.dim, truncate=True)
    return Rope(plain_inv_freq(r.freq_base, r.dim))


# ---- attention ---------------------------------------------------------------


class _Rows:
    """One layer's K (or V) for every kv head, [Hk, n_ctx, d], stored as `kv_type`:
    f32 and f16 as such; q8_0 as int8 values with one float16 scale per block
    of 32 along d (llama.cpp's q8_0: d = max|x|/127, q = roundf(x/d))."""

    def __init__(self, kv_type: str, hk: int, n_ctx: int, d: int):
        self.kv_type = kv_type
        dtype = {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}[kv_type]
        self.data = np.zeros((hk, n_ctx, d), dtype)
        self.scale = np.zeros((hk, n_ctx, d // Q8_0_BLOCK), np.float16) if kv_type == "q8_0" else None

    def write(self, at: int, x: np.ndarray) -> None:
        """x [Hk, T, d] float32 at positions at..at+T-1: only these rows are converted."""
        t = x.shape[1]
        if self.scale is None:
            self.data[:, at : at + t] = x  # numpy casts to float16 (round to nearest) for f16
            return
        q, scale = quantize_q8_0(x)
        self.data[:, at : at + t] = q
        self.scale[:, at : at + t] = scale

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Positions lo..hi-1 as float32 [Hk, hi-lo, d] (a view for f32, a converted copy otherwise)."""
        rows = self.data[:, lo:hi]
        if self.scale is None:
            return rows if rows.dtype == np.float32 else rows.astype(np.float32)
        hk, n, d = rows.shape
        blocks = rows.reshape(hk, n, d // Q8_0_BLOCK, Q8_0_BLOCK).astype(np.float32)
        return (blocks * self.scale[:, lo:hi, :, None].astype(np.float32)).reshape(hk, n, d)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., d] float32, d a multiple of 32 → (int8 [..., d], float16 scales [..., d/32]),
    bit for bit llama.cpp's quantize_row_q8_0_ref: the scale is computed and applied in
    float32 and only stored as float16; roundf rounds halves away from zero."""
    blocks = np.asarray(x, np.float32).reshape(*x.shape[:-1], x.shape[-1] // Q8_0_BLOCK, Q8_0_BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    y = blocks * inv
    a = np.abs(y)
    whole = np.floor(a)
    q = np.sign(y) * (whole + np.floor(2 * (a - whole)))  # roundf, not numpy's round-half-to-even
    return q.astype(np.int8).reshape(x.shape), d[..., 0].astype(np.float16)


class KVCache:
    """Keys and values per layer, [Hk, n_ctx, d], filled left to right, stored as
    `kv_type` (f32 | f16 | q8_0; shared/gguf/spec.py KV_TYPE_BYTES). Reads come
    back as float32: attention's math is float32 whatever the storage."""

    def __init__(
        self, n_ctx: int, n_head_kv: tuple[int, ...], head_dim_k: tuple[int, ...], head_dim_v: tuple[int, ...], kv_type: str = "f32"
    ):
        check_kv_type(kv_type, tuple(head_dim_k) + tuple(head_dim_v))
        self.n_ctx, self.kv_type = n_ctx, kv_type
        self.k = [_Rows(kv_type, hk, n_ctx, dk) for hk, dk in zip(n_head_kv, head_dim_k)]
        self.v = [_Rows(kv_type, hk, n_ctx, dv) for hk, dv in zip(n_head_kv, head_dim_v)]
        self.n = 0  # positions filled (all layers advance together)
        # A hybrid model's (qwen35moe) recurrent layers keep their state here, not in K/V.
        self.state: RecurrentState | None = None

    def store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """k [T, Hk, d], v [T, Hk, dv] at positions n..n+T-1 (commit with advance())."""
        t = k.shape[0]
        if self.n + t > self.n_ctx:
            raise ValueError(f"context full: {self.n} + {t} tokens > n_ctx {self.n_ctx}")
        self.k[layer].write(self.n, k.transpose(1, 0, 2))
        self.v[layer].write(self.n, v.transpose(1, 0, 2))

    def keys(self, layer: int, lo: int, hi: int) -> np.ndarray:
        """Cached keys at positions lo..hi-1, float32 [Hk, hi-lo, d]."""
        return self.k[layer].read(lo, hi)

    def values(self, layer: int, lo: int, hi: int) -> np.ndarray:
        """Cached values at positions lo..hi-1, float32 [Hk, hi-lo, dv]."""
        return self.v[layer].read(lo, hi)

    def stored(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The layer's K and V arrays as stored, [Hk, n_ctx, d], when they are
        plain float32 or float16 (decode attention reads them in place); None for q8_0."""
        k, v = self.k[layer], self.v[layer]
        return None if k.scale is not None else (k.data, v.data)

    def advance(self, t: int) -> None:
        self.n += t

    def can_truncate(self, n: int) -> bool:
        """Whether `truncate(n)` is possible: always for a pure KV cache; with a
        recurrent state only to 0 or to n ≥ the current length, because the state
        has folded every position in and cannot be rewound (reuse recomputes)."""
        return self.state is None or n <= 0 or n >= self.n

    def truncate(self, n: int) -> None:
        """Forget every position from n on (rows past n are overwritten by the next store)."""
        if not self.can_truncate(n):
            raise ValueError(f"this model's recurrent state cannot be rewound from {self.n} to {n} positions (only to 0)")
        if self.state is not None and n <= 0:
            self.state.reset()
        self.n = max(0, min(self.n, n))

    def parts(self) -> list[np.ndarray]:
        """Every stored array, [Hk, n_ctx, x], in a fixed order (per layer: K, its
        q8_0 scales if any, V, its scales): what a saved session writes and reads
        back (shared/model/session.py), positions 0..n-1 of each."""
        out: list[np.ndarray] = []
        for k, v in zip(self.k, self.v):
            for rows in (k, v):
                out.append(rows.data)
                if rows.scale is not None:
                    out.append(rows.scale)
        return out


class RecurrentState:
    """A hybrid model's per-sequence state of its linear-attention layers, float32:
    `conv[i]` [kernel-1, channels] (the last inputs of the short causal conv) and
    `delta[i]` [heads, d_k, d_v] (the gated delta rule's matrix). Its size is fixed
    whatever the context (shared/gguf/spec.py recurrent_state_bytes)."""

    def __init__(self, layers: list[int], kernel: int, channels: int, heads: int, d_k: int, d_v: int):
        self.conv = {i: np.zeros((kernel - 1, channels), np.float32) for i in layers}
        self.delta = {i: np.zeros((heads, d_k, d_v), np.float32) for i in layers}

    def reset(self) -> None:
        for a in (*self.conv.values(), *self.delta.values()):
            a.fill(0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.conv.values(), *self.delta.values()))


def attention(
    q: np.ndarray, cache: KVCache, layer: int, start: int, scale: float, window: int = 0, sinks: np.ndarray | None = None
) -> np.ndarray:
    """Causal GQA over the cache for T queries at positions start..start+T-1.

    q [T, H, d]; returns [T, H·dv]. Key j is visible to query p when j ≤ p and,
    with a window W, p − W < j. `sinks` [H] adds a per-head logit column that
    takes probability mass and is then dropped (gpt-oss).
    """
    t, h, d = q.shape
    n = start + t
    # One query (decode) sees every cached key up to itself: slice the window
    # instead of building a mask.
    lo = max(0, n - window) if (t == 1 and window) else 0
    stored = cache.stored(layer)
    if stored is not None:  # f32/f16: every row as a decode step computes it, whatever the batch
        hk = stored[0].shape[0]
        return attend(q.reshape(t, hk, h // hk, d), stored[0], stored[1], 0, start, window, scale, sinks).reshape(t, -1)
    keys, values = cache.keys(layer, lo, n), cache.values(layer, lo, n)  # float32 [Hk, N, d], [Hk, N, dv]
    hk = keys.shape[0]
    g = h // hk
    # One matmul per kv head over all its G·T query rows (not G·T separate
    # products): [Hk, G·T, d] @ [Hk, d, N].
    qg = np.ascontiguousarray(q.reshape(t, hk, g, d).transpose(1, 2, 0, 3)).reshape(hk, g * t, d)
    scores = (np.matmul(qg, keys.transpose(0, 2, 1)) * np.float32(scale)).reshape(hk, g, t, -1)  # [Hk, G, T, N]
    if t > 1:
        pos = np.arange(start, n)[:, None]  # [T, 1]
        j = np.arange(n)[None, :]  # [1, N]
        hidden = j > pos
        if window:
            hidden |= j <= pos - window
        scores = np.where(hidden, np.float32(-np.inf), scores)
    m = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        s = sinks.reshape(hk, g, 1, 1).astype(np.float32)
        m = np.maximum(m, s)
        e = np.exp(scores - m)
        probs = e / (e.sum(axis=-1, keepdims=True) + np.exp(s - m))
    else:
        e = np.exp(scores - m)
        probs = e / e.sum(axis=-1, keepdims=True)
    out = np.matmul(probs.reshape(hk, g * t, -1), values).reshape(hk, g, t, -1)  # [Hk, G, T, dv]
    return out.transpose(2, 0, 1, 3).reshape(t, -1)  # [T, H·dv]


# ---- activations -------------------------------------------------------------


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) → inf for very negative x gives the right 0
        return 1.0 / (1.0 + np.exp(-x))


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return np.float32(0.5) * x * (1.0 + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
