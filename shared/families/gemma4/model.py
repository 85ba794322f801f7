"""Gemma-4 MoE (GGUF arch `gemma4`; HF Gemma4ForConditionalGeneration text model).

Embeddings × √D. Per layer: RMSNorm → q (per-head norm, RoPE), k (per-head
norm, RoPE), v (per-head RMSNorm without weight; full layers have no attn_v
and use the raw k projection); attention scale 1.0; sliding layers: 256-dim
heads, θ 1e4, window; full layers: 512-dim heads, θ 1e6, only the first pairs
rotate (rope_freqs). Output projection → post_attention_norm → residual.
FFN: an always-on GELU-tanh MLP on ffn_norm(h) (→ post_ffw_norm_1) plus the
routed experts on pre_ffw_norm_2(h) (→ post_ffw_norm_2), routed from
RMSNorm_noweight(h)·scale/√D; sum → post_ffw_norm → residual → × layer scalar.
Output head tied to the embeddings; logits soft-capped. The KV cache keeps a
sliding layer's window as a ring, a full layer's whole context (`new_cache`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...gguf.model_file import ModelFile
from ...model.base import MoEModel
from ...model.blocks import Rope, gelu_tanh, plain_inv_freq, rms_norm, store_and_attend
from ...model.fused import norm_rope
from ...model.moe import GLU_EXPERTS, Routing, apply_experts, softmax_then_top_k
from ...model.weights import Expert


def gelu_expert(e: Expert, x: np.ndarray) -> np.ndarray:
    g, u = e.gate_and_up(x)  # [n, F] each
    return e.down(gelu_glu(g, u))


def gelu_glu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return gelu_tanh(g) * u


GLU_EXPERTS[gelu_expert] = gelu_glu  # a decode step takes a layer's experts at once (shared/model/moe.py)


class Model(MoEModel):
    arch = "gemma4"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        r = self.spec.rope
        factors = self.w.optional_vector("rope_freqs.weight")
        self.rope_full = Rope(plain_inv_freq(r.freq_base, r.dim, factors))
        self.rope_swa = Rope(plain_inv_freq(r.freq_base_swa or 1e4, r.dim_swa or r.dim))
        self.embed_scale = np.float32(np.sqrt(np.float32(self.spec.n_embd)))
        self.router_scale = np.float32(self.spec.n_embd**-0.5)

    def load_layer(self, i: int) -> dict:
        p, w = f"blk.{i}.", self.w
        v = w.matrix(p + "attn_v.weight") if w.has(p + "attn_v.weight") else None
        return dict(
            attn_norm=w.vector(p + "attn_norm.weight"),
            q=w.matrix(p + "attn_q.weight"),
            k=w.matrix(p + "attn_k.weight"),
            v=v,
            o=w.matrix(p + "attn_output.weight"),
            q_norm=w.vector(p + "attn_q_norm.weight"),
            k_norm=w.vector(p + "attn_k_norm.weight"),
            post_attn_norm=w.vector(p + "post_attention_norm.weight"),
            ffn_norm=w.vector(p + "ffn_norm.weight"),
            gate=w.matrix(p + "ffn_gate.weight"),
            up=w.matrix(p + "ffn_up.weight"),
            down=w.matrix(p + "ffn_down.weight"),
            post_ffw_norm_1=w.vector(p + "post_ffw_norm_1.weight"),
            pre_ffw_norm_2=w.vector(p + "pre_ffw_norm_2.weight"),
            post_ffw_norm_2=w.vector(p + "post_ffw_norm_2.weight"),
            post_ffw_norm=w.vector(p + "post_ffw_norm.weight"),
            router=w.matrix(p + "ffn_gate_inp.weight"),
            router_in_scale=w.vector(p + "ffn_gate_inp.scale"),
            expert_scale=w.vector(p + "ffn_down_exps.scale"),
            out_scale=w.vector(p + "layer_output_scale.weight") if w.has(p + "layer_output_scale.weight") else np.ones(1, np.float32),
        )

    def embed(self, tokens):
        return self.embd.rows(tokens) * self.embed_scale

    def router_input(self, i, h):  # as in layer(): the router has its own scale, not the FFN's norm
        return rms_norm(h, None, self.spec.rms_eps) * self.layers[i]["router_in_scale"] * self.router_scale

    def logits(self, x):
        z = super().logits(x)
        cap = self.spec.final_logit_softcap
        return np.float32(cap) * np.tanh(z / np.float32(cap)) if cap else z

    def route(self, i: int, scores: np.ndarray) -> Routing:
        """The top k of a softmax, renormalized, each weight × its expert's per-layer scale."""
        r = softmax_then_top_k(scores, self.top_k)
        return Routing(r.ids, r.weights * self.layers[i]["expert_scale"][r.ids])

    def layer(self, i, x, cache, start, positions):
        L, eps = self.layers[i], self.spec.rms_eps
        with self.stage("attention"):
            h = x + self.attention(i, x, cache, start, positions)
        with self.stage("dense_mlp"):  # always on
            n1 = rms_norm(h, L["ffn_norm"], eps)
            m1 = rms_norm(L["down"](gelu_tanh(L["gate"](n1)) * L["up"](n1)), L["post_ffw_norm_1"], eps)
        with self.stage("router"):
            r = rms_norm(h, None, eps) * L["router_in_scale"] * self.router_scale
            scores = L["router"](r)
            routing = self.routed(i, scores)
            self.hint_next_layer(i, r)
            del r, scores  # a prompt chunk's arrays: none kept past its use (prefill_activation_bytes)
        with self.stage("experts"):
            m2 = apply_experts(rms_norm(h, L["pre_ffw_norm_2"], eps), routing, self.source, i, gelu_expert)
            m2 = rms_norm(m2, L["post_ffw_norm_2"], eps)
        m1 += m2  # in place: the same sums as m1 + m2, without another [T, D] array
        del m2
        f = rms_norm(m1, L["post_ffw_norm"], eps)
        del m1
        f += h  # h + f
        f *= L["out_scale"]
        return f

    def attention(self, i, x, cache, start, positions):
        """The attention block's output, post-norm, before the residual add. Its own function so
        its temporaries (a full layer's [T, H, 512] queries and output: 256 MiB for a
        4,096-token chunk) are gone before the FFNs run, which the chunk's activation budget
        assumes (shared/gguf/spec.py prefill_activation_bytes); q's and k's norms and rotation
        are one pass in the projections' own arrays (fused.norm_rope)."""
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        t, hd, hk = x.shape[0], s.head_dim_k[i], s.n_head_kv[i]
        sliding = s.swa_layers[i]
        rope = self.rope_swa if sliding else self.rope_full
        cos, sin = rope.tables(positions)
        half = rope.inv_freq.shape[0]
        n = rms_norm(x, L["attn_norm"], eps)
        k = L["k"](n).reshape(t, hk, hd)
        v = rms_norm(L["v"](n).reshape(t, hk, s.head_dim_v[i]) if L["v"] is not None else k, None, eps)  # full layers: V = K
        k = norm_rope(k, L["k_norm"], eps, cos, sin, half, out=k)  # in place: v above is its own array
        q = L["q"](n).reshape(t, s.n_head, hd)
        del n
        q = norm_rope(q, L["q_norm"], eps, cos, sin, half, out=q)  # [T, H, d], the projection's own array
        window = s.sliding_window if sliding else 0
        a = store_and_attend(q, k, v, cache, i, start, 1.0, window)
        del q
        return rms_norm(L["o"](a), L["post_attn_norm"], eps)
