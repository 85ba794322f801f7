"""Qwen1.5-MoE / Qwen2-MoE (GGUF arch `qwen2moe`; HF Qwen2MoeForCausalLM).

Per layer: x → RMSNorm → q, k, v with biases (no q/k norm); NEOX RoPE on all
d dims; causal GQA scaled 1/√d; residual. Then RMSNorm → router softmax over
all experts → top-k, renormalized only when the file says
`expert_weights_norm` (Qwen1.5-MoE and Qwen2-57B-A14B have norm_topk_prob
false, and llama.cpp's graph never renormalizes) → Σ w·down(silu(gate n) ⊙ up n),
plus the always-on shared expert behind a sigmoid gate; residual.
docs/models.md § qwen2moe.
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
from ...model.moe import Routing, apply_experts, gated_shared_expert, load_shared_expert, softmax_then_top_k, swiglu_expert


class Model(MoEModel):
    arch = "qwen2moe"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        self.rope = rope_from_spec(self.spec.rope)
        self.scale = 1.0 / math.sqrt(self.spec.head_dim_k[0])

    def load_layer(self, i: int) -> dict:
        p, w = f"blk.{i}.", self.w
        return dict(
            attn_norm=w.vector(p + "attn_norm.weight"),
            **load_gqa(w, p, biases=True),
            ffn_norm=w.vector(p + "ffn_norm.weight"),
            router=w.matrix(p + "ffn_gate_inp.weight"),
            **load_shared_expert(w, p, self.spec.n_embd),
        )

    def route(self, i: int, scores: np.ndarray) -> Routing:
        """The top k of a softmax, renormalized only where the file says so."""
        return softmax_then_top_k(scores, self.top_k, renormalize=self.spec.expert_weights_norm)

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
            y = apply_experts(n2, routing, self.source, i, swiglu_expert)
        with self.stage("dense_mlp"):  # the shared expert: always on, resident
            shared = gated_shared_expert(L, n2)
        return h + (y + shared)
