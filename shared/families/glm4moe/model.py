"""GLM-4.5 / GLM-4.5-Air (GGUF arch `glm4moe`; HF Glm4MoeForCausalLM). docs/models.md § glm4moe.

Per layer: x += attn(RMSNorm(x)); x += ffn(RMSNorm(x)) with
- attention: GQA, q/k/v projections with optional biases (`attention_bias`), an
  optional per-head RMSNorm on q and k (`use_qk_norm`), NEOX RoPE on the first
  `rope.dimension_count` dims of each head (partial rotary; the rest pass
  through), scaled 1/√d, no output bias;
- ffn: the first `leading_dense_block_count` layers a dense SwiGLU FFN
  (`ffn_gate/up/down`, width n_ff); the others the routed experts plus the
  always-on shared expert (resident), summed as routed + shared.
Routing (model/moe.py gated_group_top_k): p = σ(logits); experts chosen on
p + `exp_probs_b` among the best `expert_group_used_count` of
`expert_group_count` groups; weights the unbiased p, renormalized when
`expert_weights_norm`, times `expert_weights_scale`.
The NextN/MTP blocks a file may hold after the decoder's layers are not loaded
(llama.cpp does not run them by default either; spec.n_layer_nextn).
Legend: T tokens, D hidden, H/Hk heads, d head width, E experts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...gguf.model_file import ModelFile
from ...model.base import PREFETCH_MIN_P, MoEModel, guess_rows
from ...model.blocks import attention, rms_norm, rope_from_spec, swiglu
from ...model.moe import Routing, apply_experts, route_as_spec, swiglu_expert


class Model(MoEModel):
    arch = "glm4moe"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        self.rope = rope_from_spec(self.spec.rope)
        self.scale = 1.0 / math.sqrt(self.spec.head_dim_k[0])

    def load_layer(self, i: int) -> dict:
        p, w, s = f"blk.{i}.", self.w, self.spec
        L: dict[str, Any] = dict(
            attn_norm=w.vector(p + "attn_norm.weight"),
            q=w.matrix(p + "attn_q.weight"),
            k=w.matrix(p + "attn_k.weight"),
            v=w.matrix(p + "attn_v.weight"),
            o=w.matrix(p + "attn_output.weight"),
            ffn_norm=w.vector(p + "post_attention_norm.weight"),  # the pre-FFN norm, despite the name
        )
        for key in ("q", "k", "v"):  # attention_bias: all three or none in the HF model; each optional here, as in llama.cpp
            if w.has(f"{p}attn_{key}.bias"):
                L[f"{key}_b"] = w.vector(f"{p}attn_{key}.bias")
        for key in ("q_norm", "k_norm"):  # use_qk_norm (GLM-4.5 355B); absent in GLM-4.5-Air
            if w.has(f"{p}attn_{key}.weight"):
                L[key] = w.vector(f"{p}attn_{key}.weight")
        if not s.has_experts(i):
            L.update(gate=w.matrix(p + "ffn_gate.weight"), up=w.matrix(p + "ffn_up.weight"), down=w.matrix(p + "ffn_down.weight"))
            return L
        L.update(router=w.matrix(p + "ffn_gate_inp.weight"), probs_b=w.vector(p + "exp_probs_b.bias"))
        if s.n_expert_shared:
            L.update(
                sh_gate=w.matrix(p + "ffn_gate_shexp.weight"),
                sh_up=w.matrix(p + "ffn_up_shexp.weight"),
                sh_down=w.matrix(p + "ffn_down_shexp.weight"),
            )
        return L

    def route(self, i: int, scores: np.ndarray) -> Routing:
        """Sigmoid scores, the selection bias and the expert groups (route_as_spec)."""
        return route_as_spec(self.spec, scores, self.top_k, self.layers[i]["probs_b"])

    def layer(self, i, x, cache, start, positions):
        L, eps = self.layers[i], self.spec.rms_eps
        with self.stage("attention"):
            h = x + self.attend(i, rms_norm(x, L["attn_norm"], eps), cache, start, positions)
        n2 = rms_norm(h, L["ffn_norm"], eps)
        if not self.spec.has_experts(i):  # a leading dense layer: nothing routed, nothing streamed
            self.hint_next_layer(i, n2)  # the first routed layer is guessed from here
            with self.stage("dense_mlp"):
                return h + L["down"](swiglu(L["gate"](n2), L["up"](n2)))
        with self.stage("router"):
            scores = L["router"](n2)
            routing = self.routed(i, scores)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            y = apply_experts(n2, routing, self.source, i, swiglu_expert)
        if "sh_down" in L:
            with self.stage("dense_mlp"):  # the shared expert: always on, resident
                y = y + L["sh_down"](swiglu(L["sh_gate"](n2), L["sh_up"](n2)))
        return h + y

    def attend(self, i: int, n: np.ndarray, cache, start: int, positions: np.ndarray) -> np.ndarray:
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        t, hd, hk = n.shape[0], s.head_dim_k[i], s.n_head_kv[i]
        q, k, v = L["q"](n), L["k"](n), L["v"](n)
        if "q_b" in L:  # in the projections' own arrays: one query array alive
            q += L["q_b"]
        if "k_b" in L:
            k += L["k_b"]
        if "v_b" in L:
            v += L["v_b"]
        q, k = q.reshape(t, s.n_head, hd), k.reshape(t, hk, hd)
        if "q_norm" in L:
            q = rms_norm(q, L["q_norm"], eps)
        if "k_norm" in L:
            k = rms_norm(k, L["k_norm"], eps)
        cos, sin = self.rope.tables(positions)
        cache.store(i, self.rope.apply(k, cos, sin, in_place=True), v.reshape(t, hk, s.head_dim_v[i]))
        q = self.rope.apply(q, cos, sin, in_place=True)  # this function's own array: one query array alive
        return L["o"](attention(q, cache, i, start, self.scale))

    def guess_layer(self, j: int, router_input: np.ndarray) -> None:
        """Next-layer prefetch by this family's own routing (sigmoid, selection bias,
        groups): the experts it would choose whose share of the chosen weight is at
        least PREFETCH_MIN_P. A leading dense layer has nothing to guess."""
        if not self.spec.has_experts(j):
            return
        if self.route_replay is not None:
            super().guess_layer(j, router_input)
            return
        r = self.route(j, self.layers[j]["router"](guess_rows(router_input)))
        share = r.weights / np.maximum(r.weights.sum(axis=-1, keepdims=True), np.float32(1e-20))
        best: dict[int, float] = {}
        for row_ids, row_share in zip(r.ids.tolist(), share.tolist()):
            for e, p in zip(row_ids, row_share):
                if p >= PREFETCH_MIN_P and p > best.get(e, 0.0):
                    best[e] = p
        self.source.prefetch(j, sorted(best, key=best.__getitem__, reverse=True))
