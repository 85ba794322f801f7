"""LFM2-MoE (GGUF arch `lfm2moe`; HF Lfm2MoeForCausalLM, Liquid's LFM2-8B-A1B).

A hybrid: the layers whose `attention.head_count_kv` is 0 are short
convolutions with a small per-sequence conv state instead of a KV cache; the
others are GQA attention. The first `leading_dense_block_count` layers have a
dense SwiGLU FFN; the rest route each token to k experts by sigmoid scores,
chosen on score + `exp_probs_b` (selection only), weighted by the unbiased
scores renormalized. docs/models.md § lfm2moe.

Short conv, per layer (state: the last L-1 inputs of the conv, [L-1, D]):
B, C, x = split₃(`shortconv.in_proj`·n); u = B ⊙ x;
conv_t = Σ_j w[:, j] ⊙ u_{t-L+1+j} (the state supplies the inputs before this batch);
out = `shortconv.out_proj`·(C ⊙ conv).
Attention: per-head RMSNorm on q and k, NEOX RoPE on the whole head, GQA scaled 1/√d.
The final norm is `token_embd_norm` (LFM2's `embedding_norm`, applied after the last layer).
Legend: T tokens, D hidden, H/Hk heads, d head width, L conv width.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...gguf.model_file import ModelFile
from ...model.base import MoEModel
from ...model.blocks import KVCache, RecurrentState, causal_conv, per_sequence, rms_norm, rope_from_spec, swiglu
from ...model.gqa import gqa, load_gqa
from ...model.moe import Routing, apply_experts, route_as_spec, swiglu_expert


class Model(MoEModel):
    arch = "lfm2moe"
    output_norm_name = "token_embd_norm.weight"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        self.rope = rope_from_spec(self.spec.rope)
        self.scale = 1.0 / math.sqrt(self.spec.head_dim_k[0])

    def load_layer(self, i: int) -> dict:
        p, w, s = f"blk.{i}.", self.w, self.spec
        L: dict[str, Any] = dict(attn_norm=w.vector(p + "attn_norm.weight"), ffn_norm=w.vector(p + "ffn_norm.weight"))
        if s.is_recurrent(i):
            L.update(
                in_proj=w.matrix(p + "shortconv.in_proj.weight"),
                conv=np.ascontiguousarray(w.vector(p + "shortconv.conv.weight").T),  # [L, D]
                out_proj=w.matrix(p + "shortconv.out_proj.weight"),
            )
        else:
            L.update(load_gqa(w, p, qk_norm=True))
        if s.has_experts(i):
            L.update(router=w.matrix(p + "ffn_gate_inp.weight"), exp_probs_b=w.optional_vector(p + "exp_probs_b.bias"))
        else:
            L.update(gate=w.matrix(p + "ffn_gate.weight"), up=w.matrix(p + "ffn_up.weight"), down=w.matrix(p + "ffn_down.weight"))
        return L

    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> KVCache:
        """KV rows for the attention layers only, and the conv state of the others
        (a RecurrentState with no delta-rule heads)."""
        s = self.spec
        hk = tuple(0 if s.is_recurrent(i) else h for i, h in enumerate(s.n_head_kv))
        cache = KVCache(n_ctx, hk, s.head_dim_k, s.head_dim_v, kv_type or self.kv_type)
        layers = [i for i in range(s.n_layer) if s.is_recurrent(i)]
        cache.state = RecurrentState(layers, s.ssm_conv_kernel, s.ssm_conv_channels, 0, 0, 0)
        return cache

    def guess_layer(self, j: int, router_input: np.ndarray) -> None:
        if self.spec.has_experts(j):  # a leading dense layer has nothing to fetch
            super().guess_layer(j, router_input)

    def route(self, i: int, scores: np.ndarray) -> Routing:
        """The file's scoring function and its selection bias (route_as_spec)."""
        return route_as_spec(self.spec, scores, self.top_k, self.layers[i]["exp_probs_b"])

    def layer(self, i, x, cache, start, positions):
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        with self.stage("attention"):
            n = rms_norm(x, L["attn_norm"], eps)  # [T, D]
            if s.is_recurrent(i):
                a = self.short_conv(i, n, cache)
            else:
                a = self.full_attention(i, n, cache, start, positions)
            h = x + a
        n2 = rms_norm(h, L["ffn_norm"], eps)
        if not s.has_experts(i):
            with self.stage("dense_mlp"):
                return h + L["down"](swiglu(L["gate"](n2), L["up"](n2)))
        with self.stage("router"):
            scores = L["router"](n2)
            routing = self.routed(i, scores)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            return h + apply_experts(n2, routing, self.source, i, swiglu_expert)

    def full_attention(self, i: int, n: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        return gqa(self.layers[i], n, self.spec, i, cache, start, positions, self.rope, self.scale)

    def short_conv(self, i: int, n: np.ndarray, cache: KVCache) -> np.ndarray:
        """The projections on every row; the conv per sequence, on its own state."""
        L, d = self.layers[i], self.spec.n_embd
        bcx = L["in_proj"](n)  # [T, 3D]: B, C, x
        u = bcx[:, :d] * bcx[:, 2 * d :]  # B ⊙ x, the conv's input
        conv = per_sequence(cache, 0, lambda c, _, u: self.conv(i, c, u), u)  # [T, D]
        return L["out_proj"](bcx[:, d : 2 * d] * conv)

    def conv(self, i: int, cache: KVCache, u: np.ndarray) -> np.ndarray:
        """One sequence's conv inputs u [T, D] through the short causal conv, continuing from
        and into its cache's conv state: [T, D]."""
        if cache.state is None:
            raise ValueError("an lfm2moe layer needs the cache of Model.new_cache (it holds the conv state)")
        cache.state.keep_conv(i, u)
        return causal_conv(cache.state.conv[i], u, self.layers[i]["conv"])  # w [L, D]: the previous inputs first
