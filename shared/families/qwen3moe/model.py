"""Qwen3-MoE (GGUF arch `qwen3moe`; HF Qwen3MoeForCausalLM).

Per layer: x → RMSNorm → q,k,v; per-head RMSNorm on q and k *before* NEOX
RoPE; causal GQA scaled 1/√d; residual. Then RMSNorm → router softmax over
all experts → top-k → renormalize → Σ w·down(silu(gate n) ⊙ up n); residual.
Legend: T tokens, D hidden, H/Hk heads, d head width, E experts.
"""

from __future__ import annotations

import math
from typing import Any

from ...gguf.model_file import ModelFile
from ...model.base import MoEModel
from ...model.blocks import rms_norm, rope_from_spec
from ...model.gqa import gqa, load_gqa
from ...model.moe import apply_experts, swiglu_expert


class Model(MoEModel):
    arch = "qwen3moe"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        self.rope = rope_from_spec(self.spec.rope)
        self.scale = 1.0 / math.sqrt(self.spec.head_dim_k[0])

    def load_layer(self, i: int) -> dict:
        p, w = f"blk.{i}.", self.w
        return dict(
            attn_norm=w.vector(p + "attn_norm.weight"),
            **load_gqa(w, p, qk_norm=True),
            ffn_norm=w.vector(p + "ffn_norm.weight"),
            router=w.matrix(p + "ffn_gate_inp.weight"),
        )

    def layer(self, i, x, cache, start, positions):
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        with self.stage("attention"):
            n = rms_norm(x, L["attn_norm"], eps)  # [T, D]
            h = x + gqa(L, n, s, i, cache, start, positions, self.rope, self.scale)
        with self.stage("router"):
            n2 = rms_norm(h, L["ffn_norm"], eps)
            scores = L["router"](n2)
            routing = self.routed(i, scores)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            return h + apply_experts(n2, routing, self.source, i, swiglu_expert)
