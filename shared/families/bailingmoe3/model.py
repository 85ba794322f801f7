"""Ling 3.0 (GGUF arch `bailingmoe3`; HF BailingMoeV3ForCausalLM, transformers' BailingHybridForCausalLM).

A hybrid of two attentions over DeepSeek-V3's MoE. Layers whose head_count_kv is 1
(every layer_group_size-th) are deepseek2's multi-head latent attention (MLA,
shared/families/deepseek2/model.py, absorbed the way llama.cpp computes it) with a
sigmoid gate per head on the heads' values: out = attn_output·(σ(attn_gate·n)_h · o_h).
The others (head_count_kv 0) are Kimi Delta Attention (KDA), a gated delta rule with a
decay per key channel and a recurrent state instead of a KV cache; per token t and
head h (state S [d_k, d_v], d = kda.head_dim):
    q, k, v = SiLU(causal conv_{q,k,v}(attn_{q,k,v}·n))      [T, H, d] each, own conv each
    q, k    = L2-normed (q also × 1/√d)
    g       = lower · σ(a_h · (ssm_f_a·n + dt_bias))         [T, H, d], lower < 0, a = exp(A_log)
    β       = σ(ssm_beta·n)                                 [T, H]
    S ← diag(exp g)·S; S ← S + k ⊗ β(v − kᵀS); o = qᵀS
    out     = attn_output·(RMSNorm_d(o)·ssm_norm ⊙ σ(ssm_g_a·n))
Layers 0..n_dense_lead-1 have a dense SwiGLU FFN, the rest route (sigmoid, correction
bias for the choice only, grouped top-k, norm, scale) and add the always-on shared
experts, all as deepseek2 (its `layer`, whose `attention` this class overrides).
docs/models.md § bailingmoe3. Legend: T tokens, D hidden, H heads, d KDA head width.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...model import delta_rule
from ...model.blocks import KVCache, RecurrentState, causal_conv, per_sequence, rms_norm, sigmoid, silu_in_place
from ..deepseek2.model import Model as DeepSeek2Model

# q and k are L2-normed as the reference kernels (flash-linear-attention, transformers) do:
# x / √(Σx² + 1e-6). llama.cpp's ggml_l2_norm divides by max(‖x‖, eps) instead; on the short,
# small q and k of a tiny random model that form moves the logits by ~3e-4 relative.
L2_EPS = 1e-6


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """x / √(Σx² + L2_EPS) over the last axis, the sum in float64."""
    return (x / np.sqrt(np.sum(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + L2_EPS)).astype(np.float32)


class Model(DeepSeek2Model):
    arch = "bailingmoe3"
    nextn_feeds_normed = True  # Ling's MTP module ends in its final_layernorm (layer_output_norm)

    def load_layer(self, i: int) -> dict:
        if not self.spec.is_recurrent(i):
            L = {**self.load_attention(i), **self.load_ffn(i)}
            L["head_gate"] = self.w.matrix(f"blk.{i}.attn_gate.weight")  # [H, D]
            return L
        return {**self.load_kda(i), **self.load_ffn(i)}

    def load_kda(self, i: int) -> dict[str, Any]:
        p, w, s = f"blk.{i}.", self.w, self.spec
        inner, kernel = s.n_head * s.ssm_state, s.ssm_conv_kernel
        # the three convs as one over q, k and v's channels, taps first: [kernel, 3·H·d]
        taps = [w.vector(p + f"ssm_conv1d_{x}.weight").reshape(inner, kernel) for x in "qkv"]
        return dict(
            q=w.matrix(p + "attn_q.weight"),
            k=w.matrix(p + "attn_k.weight"),
            v=w.matrix(p + "attn_v.weight"),
            conv=np.ascontiguousarray(np.concatenate(taps).T),
            f_a=w.matrix(p + "ssm_f_a.weight"),
            dt_bias=w.vector(p + "ssm_dt.bias"),
            a=w.vector(p + "ssm_a").reshape(s.n_head),  # exp(A_log) per head
            beta=w.matrix(p + "ssm_beta.weight"),
            g_a=w.matrix(p + "ssm_g_a.weight"),
            o_norm=w.vector(p + "ssm_norm.weight"),
            o=w.matrix(p + "attn_output.weight"),
        )

    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> KVCache:
        """The latent rows of the MLA layers (a KDA layer has 0 kv heads: no rows) and the
        recurrent state of the KDA layers."""
        s = self.spec
        cache = KVCache.for_spec(s, n_ctx, kv_type or self.kv_type)
        layers = [i for i in range(s.n_layer) if s.is_recurrent(i)]
        cache.state = RecurrentState(layers, s.ssm_conv_kernel, s.ssm_conv_channels, s.ssm_heads, s.ssm_state, s.ssm_state)
        return cache

    def attention(self, i: int, n: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        L = self.layers[i]
        if self.spec.is_recurrent(i):
            return self.kda(i, n, cache)
        t, h = n.shape[0], self.spec.n_head
        heads = self.latent_attention(i, n, cache, start, positions).reshape(t, h, -1)  # [T, H, v]
        gate = sigmoid(L["head_gate"](n))  # [T, H]
        return L["o"]((heads * gate[:, :, None]).reshape(t, -1))

    def kda(self, i: int, n: np.ndarray, cache: KVCache) -> np.ndarray:
        """The projections on every row; the convs and the recurrence per sequence, on its own state."""
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        t, h, d = n.shape[0], s.n_head, s.ssm_state
        mixed = np.concatenate([L["q"](n), L["k"](n), L["v"](n)], axis=1)  # [T, 3·H·d]
        gate_in = (L["f_a"](n) + L["dt_bias"]).reshape(t, h, d) * L["a"][:, None]
        decay = np.exp(np.float32(s.kda_gate_lower_bound) * sigmoid(gate_in)).astype(np.float32)  # [T, H, d], in (0, 1)
        beta = sigmoid(L["beta"](n))  # [T, H]
        o = per_sequence(cache, 0, lambda c, _, *rows: self.scan(i, c, *rows), mixed, decay, beta)  # [T, H, d]
        y = rms_norm(o, L["o_norm"], eps) * sigmoid(L["g_a"](n).reshape(t, h, d))
        return L["o"](y.reshape(t, h * d))

    def scan(self, i: int, cache: KVCache, mixed: np.ndarray, decay: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """One sequence's rows through the short causal convs and the gated delta rule, from and
        into its cache's recurrent state: mixed [T, 3·H·d], decay [T, H, d], beta [T, H] → o [T, H, d]."""
        if cache.state is None:
            raise ValueError("a bailingmoe3 layer needs the cache of Model.new_cache (it holds the recurrent state)")
        s, L, state = self.spec, self.layers[i], cache.state
        t, h, d = mixed.shape[0], s.n_head, s.ssm_state
        inner = h * d
        # The short causal convs over q, k and v's channels, continuing from the previous tokens' inputs.
        state.keep_conv(i, mixed)
        conv = silu_in_place(causal_conv(state.conv[i], mixed, L["conv"]))  # [T, 3·H·d]
        q = l2_normalize(conv[:, :inner].reshape(t, h, d)) * np.float32(1.0 / math.sqrt(d))
        k = l2_normalize(conv[:, inner : 2 * inner].reshape(t, h, d))
        v = conv[:, 2 * inner :].reshape(t, h, d)
        return delta_rule.scan(state, i, q, k, v, beta, decay)  # each key channel decays at its own rate
