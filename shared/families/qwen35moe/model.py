"""Qwen3.5/3.6 MoE (GGUF arch `qwen35moe`; HF Qwen3_5MoeForConditionalGeneration text model).

A hybrid: every `full_attention_interval`-th layer is gated full attention,
the others are linear attention (Gated DeltaNet) with a recurrent state
instead of a KV cache. Every layer's FFN is the routed MoE plus an always-on
shared expert behind a sigmoid gate. docs/models.md § qwen35moe.

Full attention: q projects to a query and a gate per head; per-head RMSNorm
on q and k; NEOX RoPE on the first `rope.dimension_count` dims of each head;
GQA scaled 1/√d; the output is multiplied by σ(gate) before `attn_output`.

Linear attention, per token t and value head h (state S [d_k, d_v]):
qkv = conv(`attn_qkv`·n) → SiLU → q, k (L2-normed as x/√(Σx² + eps); q also × 1/√d_k), v;
β = σ(`ssm_beta`·n), g = softplus(`ssm_alpha`·n + dt_bias) · a (a < 0);
S ← S·exp(g); S ← S + k ⊗ β(v − kᵀS); o = qᵀS; out = `ssm_out`·(RMSNorm(o) ⊙ silu(`attn_gate`·n)).
Value head h reads key head h mod G (the GGUF stores the value heads in that
tiled order; see convert.py beside this module).
Legend: T tokens, D hidden, H/Hk heads, d head width, G key heads, Hv value heads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...gguf.model_file import ModelFile
from ...model import delta_rule
from ...model.base import MoEModel
from ...model.blocks import KVCache, RecurrentState, attention, causal_conv, per_sequence, rms_norm, rope_from_spec, sigmoid, silu_in_place
from ...model.moe import apply_experts, gated_shared_expert, load_shared_expert, swiglu_expert


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0), x).astype(np.float32)


def l2_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """x / √(Σx² + eps) over the last axis, the sum in float64: transformers' (and
    flash-linear-attention's) l2norm, and llama.cpp's qwen35moe graph, which takes it as an
    RMSNorm with eps / d scaled by 1/√d. Not ggml_l2_norm's x / max(‖x‖, eps): on short
    rows (‖x‖ ~ 0.07 in tiny random models) that is 1e-4 off, enough to flip a near-tied
    expert choice."""
    return (x / np.sqrt(np.sum(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + eps)).astype(np.float32)


class Model(MoEModel):
    arch = "qwen35moe"
    nextn_feeds_normed = True  # its MTP module's last step is its norm (Qwen3-Next's `mtp.norm`)
    nextn_masks_first = False  # and it embeds the position-0 pair's token like any other

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        self.rope = rope_from_spec(self.spec.rope)
        self.scale = 1.0 / math.sqrt(self.spec.head_dim_k[0])

    def load_layer(self, i: int) -> dict:
        p, w, s = f"blk.{i}.", self.w, self.spec
        L: dict[str, Any] = dict(
            attn_norm=w.vector(p + "attn_norm.weight"),
            ffn_norm=w.vector(p + "post_attention_norm.weight"),  # the pre-FFN norm, despite the name
            router=w.matrix(p + "ffn_gate_inp.weight"),
            **load_shared_expert(w, p, s.n_embd),
        )
        if s.is_recurrent(i):
            L.update(
                qkv=w.matrix(p + "attn_qkv.weight"),
                z=w.matrix(p + "attn_gate.weight"),
                beta=w.matrix(p + "ssm_beta.weight"),
                alpha=w.matrix(p + "ssm_alpha.weight"),
                out=w.matrix(p + "ssm_out.weight"),
                conv=np.ascontiguousarray(w.vector(p + "ssm_conv1d.weight").T),  # [kernel, channels]
                dt_bias=w.vector(p + "ssm_dt.bias"),
                a=w.vector(p + "ssm_a"),
                ssm_norm=w.vector(p + "ssm_norm.weight"),
            )
        else:
            L.update(
                q=w.matrix(p + "attn_q.weight"),
                k=w.matrix(p + "attn_k.weight"),
                v=w.matrix(p + "attn_v.weight"),
                o=w.matrix(p + "attn_output.weight"),
                q_norm=w.vector(p + "attn_q_norm.weight"),
                k_norm=w.vector(p + "attn_k_norm.weight"),
            )
        return L

    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> KVCache:
        """KV rows for the full-attention layers only, and the recurrent state of the others."""
        s = self.spec
        hk = tuple(0 if s.is_recurrent(i) else h for i, h in enumerate(s.n_head_kv))
        cache = KVCache(n_ctx, hk, s.head_dim_k, s.head_dim_v, kv_type or self.kv_type)
        layers = [i for i in range(s.n_layer) if s.is_recurrent(i)]
        cache.state = RecurrentState(layers, s.ssm_conv_kernel, s.ssm_conv_channels, s.ssm_heads, s.ssm_state, s.ssm_state)
        return cache

    def layer(self, i, x, cache, start, positions):
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        with self.stage("attention"):
            n = rms_norm(x, L["attn_norm"], eps)  # [T, D]
            if s.is_recurrent(i):
                a = self.linear_attention(i, n, cache)
            else:
                a = self.full_attention(i, n, cache, start, positions)
            h = x + a
        with self.stage("router"):
            n2 = rms_norm(h, L["ffn_norm"], eps)
            scores = L["router"](n2)
            routing = self.routed(i, scores)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            y = apply_experts(n2, routing, self.source, i, swiglu_expert)
        with self.stage("dense_mlp"):  # the shared expert: always on, resident
            shared = gated_shared_expert(L, n2)
        return h + (y + shared)

    def full_attention(self, i: int, n: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        t, hd, hk = n.shape[0], s.head_dim_k[i], s.n_head_kv[i]
        qg = L["q"](n).reshape(t, s.n_head, 2, hd)  # per head: the query, then its gate
        q = rms_norm(qg[:, :, 0], L["q_norm"], eps)  # [T, H, d]
        gate = qg[:, :, 1].reshape(t, s.n_head * hd)
        k = rms_norm(L["k"](n).reshape(t, hk, hd), L["k_norm"], eps)
        v = L["v"](n).reshape(t, hk, s.head_dim_v[i])
        cos, sin = self.rope.tables(positions)
        cache.store(i, self.rope.apply(k, cos, sin, in_place=True), v)
        q = self.rope.apply(q, cos, sin, in_place=True)  # rms_norm's own array
        out = attention(q, cache, i, start, self.scale)  # [T, H·dv]
        return L["o"](out * sigmoid(gate))

    def linear_attention(self, i: int, n: np.ndarray, cache: KVCache) -> np.ndarray:
        """The projections on every row; the conv and the recurrence per sequence, on its own state."""
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        t, st, v_heads = n.shape[0], s.ssm_state, s.ssm_heads
        beta = sigmoid(L["beta"](n))  # [T, Hv]
        decay = np.exp(softplus(L["alpha"](n) + L["dt_bias"]) * L["a"])  # [T, Hv], in (0, 1]
        o = per_sequence(cache, 0, lambda c, _, *rows: self.scan(i, c, *rows), L["qkv"](n), beta, decay)  # [T, Hv, d_v]
        z = L["z"](n).reshape(t, v_heads, st)  # after the scan: not alive beside its [T, C] arrays
        y = rms_norm(o, L["ssm_norm"], eps) * (z * sigmoid(z))
        return L["out"](y.reshape(t, v_heads * st))

    def scan(self, i: int, cache: KVCache, mixed: np.ndarray, beta: np.ndarray, decay: np.ndarray) -> np.ndarray:
        """One sequence's rows through the short causal conv and the gated delta rule, from and
        into its cache's recurrent state: mixed [T, C], beta and decay [T, Hv] → o [T, Hv, d_v]."""
        if cache.state is None:
            raise ValueError("a qwen35moe layer needs the cache of Model.new_cache (it holds the recurrent state)")
        s, L, eps, state = self.spec, self.layers[i], self.spec.rms_eps, cache.state
        t, st, g_heads, v_heads = mixed.shape[0], s.ssm_state, s.ssm_groups, s.ssm_heads
        # The short causal conv over the channels, continuing from the previous tokens' inputs.
        state.keep_conv(i, mixed)
        conv = silu_in_place(causal_conv(state.conv[i], mixed, L["conv"]))  # [T, C]
        kd = g_heads * st
        q = l2_normalize(conv[:, :kd].reshape(t, g_heads, st), eps)
        k = l2_normalize(conv[:, kd : 2 * kd].reshape(t, g_heads, st), eps)
        v = conv[:, 2 * kd :].reshape(t, v_heads, st)
        q *= np.float32(1.0 / math.sqrt(st))  # value head h reads key head h mod G: delta_rule.scan maps them
        return delta_rule.scan(state, i, q, k, v, beta, decay)  # [T, Hv, d_v]
