"""The grouped-query self-attention that several families share (qwen3moe,
qwen2moe, mixtral, lfm2moe's attention layers): q, k and v projections with
optional biases, optional per-head RMS norms on q and k before RoPE, the KV
cache, causal attention and the output projection. A family differs only in
which of these tensors its layers hold, so the layer's weights say it.

Legend: T tokens, D hidden, H/Hk heads, d head width.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..gguf.spec import ModelSpec
from .blocks import KVCache, Rope, attention, rms_norm
from .fused import norm_rope
from .weights import Weights


def load_gqa(w: Weights, p: str, *, biases: bool = False, qk_norm: bool = False) -> dict:
    """The attention tensors of the layer with prefix `p` ("blk.i."): q, k, v, o, and
    their biases (`biases`) or the per-head q/k norms (`qk_norm`) where the family has them."""
    L: dict[str, Any] = dict(
        q=w.matrix(p + "attn_q.weight"),
        k=w.matrix(p + "attn_k.weight"),
        v=w.matrix(p + "attn_v.weight"),
        o=w.matrix(p + "attn_output.weight"),
    )
    if biases:
        L.update(q_b=w.vector(p + "attn_q.bias"), k_b=w.vector(p + "attn_k.bias"), v_b=w.vector(p + "attn_v.bias"))
    if qk_norm:
        L.update(q_norm=w.vector(p + "attn_q_norm.weight"), k_norm=w.vector(p + "attn_k_norm.weight"))
    return L


def gqa(
    L: dict,
    n: np.ndarray,
    s: ModelSpec,
    i: int,
    cache: KVCache,
    start: int,
    positions: np.ndarray,
    rope: Rope,
    scale: float,
    perm: np.ndarray | None = None,
) -> np.ndarray:
    """Layer i's self-attention on its normed input n [T, D] → [T, D]: its keys and
    values stored at positions start.. of `cache`. `perm` reorders each head's
    dims before RoPE (mixtral: llama.cpp's adjacent pairs back to rotate-half)."""
    t, hd, hk = n.shape[0], s.head_dim_k[i], s.n_head_kv[i]
    q, k, v = L["q"](n), L["k"](n), L["v"](n)  # [T, H·d], [T, Hk·d], [T, Hk·dv]
    if "q_b" in L:  # in the projections' own arrays: one query array alive
        q += L["q_b"]
        k += L["k_b"]
        v += L["v_b"]
    q, k, v = q.reshape(t, s.n_head, hd), k.reshape(t, hk, hd), v.reshape(t, hk, s.head_dim_v[i])
    cos, sin = rope.tables(positions)
    if "q_norm" in L and perm is None:  # qwen3moe: each head's norm and rotation in one pass, in place (the projections' own arrays)
        half = rope.inv_freq.shape[0]
        q = norm_rope(q, L["q_norm"], s.rms_eps, cos, sin, half, out=q)
        k = norm_rope(k, L["k_norm"], s.rms_eps, cos, sin, half, out=k)
    else:
        if "q_norm" in L:
            q, k = rms_norm(q, L["q_norm"], s.rms_eps), rms_norm(k, L["k_norm"], s.rms_eps)
        if perm is not None:
            q, k = q[:, :, perm], k[:, :, perm]
        q, k = rope.apply(q, cos, sin, in_place=True), rope.apply(k, cos, sin, in_place=True)  # this function's own arrays
    cache.store(i, k, v)
    return L["o"](attention(q, cache, i, start, scale))
