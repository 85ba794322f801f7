"""gpt-oss (GGUF arch `gpt-oss`; HF GptOssForCausalLM).

Per layer: RMSNorm → q,k,v with biases → NEOX YaRN RoPE → causal GQA scaled
1/√d with a per-head sink logit, a 128-token window on sliding layers →
output projection + bias; residual. Then RMSNorm (`post_attention_norm` is
the pre-FFN norm) → router logits + bias → top-k logits → softmax over those →
Σ w·(down(clamped SwiGLU) + b); residual. The KV cache keeps a sliding layer's
window as a ring, a full layer's whole context (`new_cache`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...gguf.model_file import ModelFile
from ...model.base import MoEModel
from ...model.blocks import rms_norm, rope_from_spec, sigmoid, store_and_attend
from ...model.moe import GLU_EXPERTS, Routing, apply_experts, top_k_then_softmax
from ...model.weights import Expert

SWIGLU_LIMIT = np.float32(7.0)
SWIGLU_ALPHA = np.float32(1.702)


def clamped_swiglu_expert(e: Expert, x: np.ndarray) -> np.ndarray:
    y = e.down(clamped_swiglu(*e.gate_and_up(x)))  # [n, F] each, biases added
    if e.down_bias is not None:  # always there: the layout check requires gpt-oss's expert biases
        y += e.down_bias
    return y


def clamped_swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g = np.minimum(g, SWIGLU_LIMIT)
    u = np.clip(u, -SWIGLU_LIMIT, SWIGLU_LIMIT)
    return g * sigmoid(SWIGLU_ALPHA * g) * (u + np.float32(1.0))


GLU_EXPERTS[clamped_swiglu_expert] = clamped_swiglu  # a decode step takes a layer's experts at once (shared/model/moe.py)


class Model(MoEModel):
    arch = "gpt-oss"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        self.rope = rope_from_spec(self.spec.rope)
        self.scale = 1.0 / math.sqrt(self.spec.head_dim_k[0])

    def load_layer(self, i: int) -> dict:
        p, w = f"blk.{i}.", self.w
        return dict(
            attn_norm=w.vector(p + "attn_norm.weight"),
            q=w.matrix(p + "attn_q.weight"),
            q_b=w.vector(p + "attn_q.bias"),
            k=w.matrix(p + "attn_k.weight"),
            k_b=w.vector(p + "attn_k.bias"),
            v=w.matrix(p + "attn_v.weight"),
            v_b=w.vector(p + "attn_v.bias"),
            o=w.matrix(p + "attn_output.weight"),
            o_b=w.vector(p + "attn_output.bias"),
            sinks=w.vector(p + "attn_sinks.weight"),
            ffn_norm=w.vector(p + "post_attention_norm.weight"),
            router=w.matrix(p + "ffn_gate_inp.weight"),
            router_b=w.vector(p + "ffn_gate_inp.bias"),
        )

    def route(self, i: int, scores: np.ndarray) -> Routing:
        """The top k of the logits, then a softmax over those k."""
        return top_k_then_softmax(scores, self.top_k)

    def layer(self, i, x, cache, start, positions):
        L, eps = self.layers[i], self.spec.rms_eps
        with self.stage("attention"):
            h = x + self.attention(i, x, cache, start, positions) + L["o_b"]
        with self.stage("router"):
            n2 = rms_norm(h, L["ffn_norm"], eps)
            scores = L["router"](n2) + L["router_b"]
            routing = self.routed(i, scores)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            return h + apply_experts(n2, routing, self.source, i, clamped_swiglu_expert)

    def attention(self, i, x, cache, start, positions):
        """The attention block's output projection (its bias is added in `layer`, in the
        model's order). Its own function so its temporaries are gone before the experts run,
        which the chunk's activation budget assumes (shared/gguf/spec.py prefill_activation_bytes)."""
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        t, hd, hk = x.shape[0], s.head_dim_k[i], s.n_head_kv[i]
        n = rms_norm(x, L["attn_norm"], eps)
        # each projection's bias added and its rotation done in its own array: one query array alive
        q, k, v = L["q"](n), L["k"](n), L["v"](n)
        del n
        q += L["q_b"]
        k += L["k_b"]
        v += L["v_b"]
        q, k, v = q.reshape(t, s.n_head, hd), k.reshape(t, hk, hd), v.reshape(t, hk, s.head_dim_v[i])  # [T, H, d]
        cos, sin = self.rope.tables(positions)
        window = s.sliding_window if s.swa_layers[i] else 0
        q, k = self.rope.apply(q, cos, sin, in_place=True), self.rope.apply(k, cos, sin, in_place=True)
        a = store_and_attend(q, k, v, cache, i, start, self.scale, window, L["sinks"])
        del q
        return L["o"](a)
