"""Mixtral (GGUF arch `llama` with experts; HF MixtralForCausalLM).

Per layer: x → RMSNorm → q, k, v (no biases, no q/k norm); RoPE; causal GQA
scaled 1/√d; residual. Then RMSNorm → router softmax over all experts →
top-k → renormalize → Σ w·down(silu(gate n) ⊙ up n); residual.
docs/models.md § mixtral.

RoPE: llama.cpp's `llama` graph rotates adjacent pairs (2i, 2i+1), and its
converter permutes the rows of attn_q and attn_k so that this equals HF's
rotate-half on the checkpoint. Here each head's q and k are gathered back
into rotate-half order (dims 0, 2, 4, … then 1, 3, 5, …) and rotated as NEOX:
the same rotation, and q·k is unchanged by a permutation applied to both, so
the cache holds K in that order.
Legend: T tokens, D hidden, H/Hk heads, d head width, E experts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...gguf.model_file import ModelFile
from ...model.base import MoEModel
from ...model.blocks import attention, rms_norm, rope_from_spec
from ...model.moe import apply_experts, softmax_then_top_k, swiglu_expert


def pairs_to_halves(head_dim: int, n_rot: int) -> np.ndarray:
    """The gather that turns a head in adjacent-pair order (llama.cpp's normal RoPE)
    into rotate-half order: the pairs' first dims, then their second dims, then the
    unrotated rest."""
    return np.concatenate([np.arange(0, n_rot, 2), np.arange(1, n_rot, 2), np.arange(n_rot, head_dim)])


class Model(MoEModel):
    arch = "llama"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        self.rope = rope_from_spec(self.spec.rope)
        self.scale = 1.0 / math.sqrt(self.spec.head_dim_k[0])
        self.perm = pairs_to_halves(self.spec.head_dim_k[0], self.spec.rope.dim)

    def load_layer(self, i: int) -> dict:
        p, w = f"blk.{i}.", self.w
        return dict(
            attn_norm=w.vector(p + "attn_norm.weight"),
            q=w.matrix(p + "attn_q.weight"),
            k=w.matrix(p + "attn_k.weight"),
            v=w.matrix(p + "attn_v.weight"),
            o=w.matrix(p + "attn_output.weight"),
            ffn_norm=w.vector(p + "ffn_norm.weight"),
            router=w.matrix(p + "ffn_gate_inp.weight"),
        )

    def layer(self, i, x, cache, start, positions):
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        t, hd, hk = x.shape[0], s.head_dim_k[i], s.n_head_kv[i]
        with self.stage("attention"):
            n = rms_norm(x, L["attn_norm"], eps)  # [T, D]
            q = L["q"](n).reshape(t, s.n_head, hd)[:, :, self.perm]  # [T, H, d], rotate-half order
            k = L["k"](n).reshape(t, hk, hd)[:, :, self.perm]  # [T, Hk, d]
            v = L["v"](n).reshape(t, hk, s.head_dim_v[i])
            cos, sin = self.rope.tables(positions)
            cache.store(i, self.rope.apply(k, cos, sin), v)
            h = x + L["o"](attention(self.rope.apply(q, cos, sin), cache, i, start, self.scale))
        with self.stage("router"):
            n2 = rms_norm(h, L["ffn_norm"], eps)
            scores = L["router"](n2)
            routing = self.routed(i, softmax_then_top_k(scores, self.top_k), scores)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            return h + apply_experts(n2, routing, self.source, i, swiglu_expert)
