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
from ...model.blocks import rms_norm, rope_from_spec
from ...model.gqa import gqa, load_gqa
from ...model.moe import apply_experts, swiglu_expert


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
            **load_gqa(w, p),
            ffn_norm=w.vector(p + "ffn_norm.weight"),
            router=w.matrix(p + "ffn_gate_inp.weight"),
        )

    def layer(self, i, x, cache, start, positions):
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        with self.stage("attention"):
            n = rms_norm(x, L["attn_norm"], eps)  # [T, D]
            h = x + gqa(L, n, s, i, cache, start, positions, self.rope, self.scale, perm=self.perm)  # q, k in rotate-half order
        with self.stage("router"):
            n2 = rms_norm(h, L["ffn_norm"], eps)
            scores = L["router"](n2)
            routing = self.routed(i, scores)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            return h + apply_experts(n2, routing, self.source, i, swiglu_expert)
