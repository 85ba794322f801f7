"""make-model's glm4moe (GLM-4.5 / GLM-4.5-Air) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them
(docs/models.md § glm4moe): the leading dense layers carry ffn_gate/up/down,
the others the router, its selection bias (`exp_probs_b`), the routed experts
and the shared expert. Made files hold no NextN/MTP block (the decoder's
layers only; moe-pipe never loads it, llama.cpp does not run it by default).
The vocabulary is GLM-4.5's byte-level BPE and added tokens (gguf/vocab.py
`glm4_vocab`).
"""

from __future__ import annotations

from gguf import ExpertGatingFuncType, GGUFWriter

from ...gguf.vocab import Vocab, glm4_vocab
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape

# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
    # tiny and small: one leading dense layer, grouped routing (2 of 4 groups), biases on, qk-norm off (as in Air)
    "tiny": Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=8,
        n_head_kv=2,
        head_dim=32,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=128,
        n_ff=512,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-5,
        rope_base=1e6,
        partial_rotary=0.5,
        n_dense_lead=1,
        n_expert_shared=1,
        expert_groups=4,
        expert_groups_used=2,
        attn_bias=True,
    ),
    "small": Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=256,
        n_ff=2048,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-5,
        rope_base=1e6,
        partial_rotary=0.5,
        n_dense_lead=1,
        n_expert_shared=1,
        expert_groups=4,
        expert_groups_used=2,
        attn_bias=True,
    ),
    # GLM-4.5-Air (zai-org/GLM-4.5-Air config.json; transformers' Glm4MoeConfig defaults agree):
    # 46 decoder layers (+1 NextN block not made), layer 0 dense, 128 experts top-8, 1 shared,
    # no expert groups, routed scaling 1.0, q/k/v biases, no qk-norm, half the head rotated.
    "glm45air-shape": Preset(
        "glm45air-shape",
        n_layer=46,
        n_embd=4096,
        n_head=96,
        n_head_kv=8,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=1408,
        n_ff=10944,
        vocab_size=151552,
        n_bpe=4096,
        context_length=131072,
        rms_eps=1e-5,
        rope_base=1e6,
        partial_rotary=0.5,
        n_dense_lead=1,
        n_expert_shared=1,
        attn_bias=True,
    ),
}


class Glm4MoePlan(PlanPart):
    presets = PRESETS
    # Not calibrated (no GLM trace). Sigmoid gates: logits of unit spread keep the chosen
    # experts' σ in its sensitive range (≈ 0.85-0.95), where the selection bias nudges
    # rather than decides; qwen3moe's 5.0 would saturate σ and leave the choice to the bias.
    router = RouterShape(logit_std=1.0)
    nextn_key_always = True  # llama.cpp's converter writes nextn_predict_layers, 0 included

    def nextn_layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        """GLM-4.5's NextN layer as llama.cpp's converter writes it: HF `model.layers.{L}` (a
        routed layer) with its own eh_proj, enorm / hnorm, embed_tokens and shared_head.head / norm."""
        b, D, V = f"blk.{i}.nextn.", p.n_embd, p.vocab_size
        return [
            *self.layer(p, i, W, F),
            W(b + "eh_proj.weight", (D, 2 * D), "nextn_eh_proj", i),  # [embedding; hidden] → D
            W(b + "embed_tokens.weight", (V, D), "embd", i),
            F(b + "enorm.weight", (D,), "norm"),
            F(b + "hnorm.weight", (D,), "norm"),
            W(b + "shared_head_head.weight", (V, D), "output", i),
            F(b + "shared_head_norm.weight", (D,), "norm"),
        ]

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, X, Fe, d = f"blk.{i}.", p.n_embd, p.n_expert, p.n_ff_exp, p.head_dim
        qw, kw = p.n_head * d, p.n_head_kv * d
        out = [
            F(b + "attn_norm.weight", (D,), "norm"),
            W(b + "attn_q.weight", (qw, D), "attn_q", i),
            W(b + "attn_k.weight", (kw, D), "attn_k", i),
            W(b + "attn_v.weight", (kw, D), "attn_v", i),
        ]
        if p.attn_bias:
            out += [F(b + "attn_q.bias", (qw,), "bias"), F(b + "attn_k.bias", (kw,), "bias"), F(b + "attn_v.bias", (kw,), "bias")]
        out.append(W(b + "attn_output.weight", (D, qw), "attn_output", i))
        if p.qk_norm:
            out += [F(b + "attn_q_norm.weight", (d,), "norm"), F(b + "attn_k_norm.weight", (d,), "norm")]
        out.append(F(b + "post_attention_norm.weight", (D,), "norm"))  # the pre-FFN norm
        if i < p.n_dense_lead:
            return out + [
                W(b + "ffn_gate.weight", (p.n_ff, D), "ffn_gate", i),  # Fd D
                W(b + "ffn_up.weight", (p.n_ff, D), "ffn_up", i),  # Fd D
                W(b + "ffn_down.weight", (D, p.n_ff), "ffn_down", i),  # D Fd
            ]
        fs = Fe * p.n_expert_shared
        return out + [
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            # The selection bias: trained ones spread the load; a small random spread
            # (bias fill, 0.02) nudges which experts win without deciding it.
            F(b + "exp_probs_b.bias", (X,), "bias"),
            *stacked_experts(W, b, p, i),
            W(b + "ffn_gate_shexp.weight", (fs, D), "ffn_gate_shexp", i),
            W(b + "ffn_up_shexp.weight", (fs, D), "ffn_up_shexp", i),
            W(b + "ffn_down_shexp.weight", (D, fs), "ffn_down_shexp", i),
        ]

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        """The glm4moe keys beyond every family's (maker._add_metadata writes those)."""
        w.add_rope_dimension_count(int(p.head_dim * p.partial_rotary))
        w.add_expert_shared_count(p.n_expert_shared)
        w.add_leading_dense_block_count(p.n_dense_lead)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(p.expert_weights_scale)
        w.add_expert_weights_norm(True)
        w.add_expert_group_count(p.expert_groups)  # GLM-4.5's config has n_group (1), so llama.cpp writes it
        w.add_expert_group_used_count(p.expert_groups_used)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        return glm4_vocab(size, n_bpe)


PLAN = Glm4MoePlan()
