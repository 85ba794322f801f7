"""make-model's qwen35moe (Qwen3.5-35B-A3B) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them
(docs/models.md § qwen35moe): full attention (gated queries, q/k norms) on
every full_attn_interval-th layer, linear attention (the gated delta rule:
q/k/v through a short conv, its gate, decay and output norm) on the rest;
every layer has the routed experts and a shared expert with a sigmoid gate.
The vocabulary is Qwen's byte-level BPE (gguf/vocab.py `qwen_vocab`).
"""

from __future__ import annotations

from gguf import GGUFWriter

from ...gguf.vocab import Vocab, qwen_vocab
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape
from ...text.tokenizer import QWEN35_REGEX

# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff=256,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-6,
        rope_base=1e7,
        partial_rotary=0.25,
        full_attn_interval=2,
        ssm_groups=2,
        ssm_heads=4,
        ssm_state=64,
        ssm_conv_kernel=4,
        n_ff_shexp=256,
    ),
    "small": Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=8,
        n_head_kv=2,
        head_dim=128,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=512,
        n_ff=512,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=1e7,
        partial_rotary=0.25,
        full_attn_interval=4,
        ssm_groups=4,
        ssm_heads=8,
        ssm_state=128,
        ssm_conv_kernel=4,
        n_ff_shexp=512,
    ),
    "qwen35-35b-shape": Preset(  # Qwen3.5-35B-A3B (and Qwen3.6-35B-A3B)
        "qwen35-35b-shape",
        n_layer=40,
        n_embd=2048,
        n_head=16,
        n_head_kv=2,
        head_dim=256,
        n_expert=256,
        n_expert_used=8,
        n_ff_exp=512,
        n_ff=512,
        vocab_size=248320,
        n_bpe=4096,
        context_length=262144,
        rms_eps=1e-6,
        rope_base=1e7,
        partial_rotary=0.25,
        full_attn_interval=4,
        ssm_groups=16,
        ssm_heads=32,
        ssm_state=128,
        ssm_conv_kernel=4,
        n_ff_shexp=512,
    ),
}


class Qwen35MoePlan(PlanPart):
    presets = PRESETS
    router = RouterShape(logit_std=5.0, depth_exp=0.4)  # not calibrated (no Qwen3.5 trace): qwen3moe's gate sharpness, its stream unshaped
    width_keys = ("expert_feed_forward_length",)  # Qwen3.5-MoE's config has no intermediate_size

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        return self._layer(p, i, W, F, p.is_recurrent(i))

    def nextn_layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        """The MTP block as llama.cpp's converter writes Qwen3.5/3.6's (`mtp.layers.0.*` as a
        full-attention MoE layer; mtp.fc, pre_fc_norm_embedding / _hidden and mtp.norm as
        nextn.eh_proj, enorm / hnorm, shared_head_norm); the embedding and output head are the model's."""
        b, D = f"blk.{i}.nextn.", p.n_embd
        return [
            *self._layer(p, i, W, F, recurrent=False),
            W(b + "eh_proj.weight", (D, 2 * D), "nextn_eh_proj", i),  # [embedding; hidden] → D
            F(b + "enorm.weight", (D,), "norm"),
            F(b + "hnorm.weight", (D,), "norm"),
            F(b + "shared_head_norm.weight", (D,), "norm"),
        ]

    def _layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector, recurrent: bool) -> list[TensorSpec]:
        b, D, X = f"blk.{i}.", p.n_embd, p.n_expert
        st, vh, fs = p.ssm_state, p.ssm_heads, p.n_ff_shexp
        out = [F(b + "attn_norm.weight", (D,), "norm")]
        if recurrent:
            ch = (2 * p.ssm_groups + vh) * st  # the conv's channels: q, k, v
            out += [
                W(b + "attn_qkv.weight", (ch, D), "attn_qkv", i),
                W(b + "attn_gate.weight", (vh * st, D), "attn_gate", i),
                F(b + "ssm_conv1d.weight", (ch, p.ssm_conv_kernel), "conv"),
                F(b + "ssm_dt.bias", (vh,), "bias"),
                F(b + "ssm_a", (vh,), "ssm_a"),
                W(b + "ssm_beta.weight", (vh, D), "ssm_beta", i),
                W(b + "ssm_alpha.weight", (vh, D), "ssm_alpha", i),
                F(b + "ssm_norm.weight", (st,), "norm"),
                W(b + "ssm_out.weight", (D, vh * st), "ssm_out", i),
            ]
        else:
            qw, kw = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
            out += [
                W(b + "attn_q.weight", (2 * qw, D), "attn_q", i),  # per head: query rows, then gate rows
                W(b + "attn_k.weight", (kw, D), "attn_k", i),
                W(b + "attn_v.weight", (kw, D), "attn_v", i),
                W(b + "attn_output.weight", (D, qw), "attn_output", i),
                F(b + "attn_q_norm.weight", (p.head_dim,), "norm"),
                F(b + "attn_k_norm.weight", (p.head_dim,), "norm"),
            ]
        return out + [
            F(b + "post_attention_norm.weight", (D,), "norm"),  # the pre-FFN norm
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            *stacked_experts(W, b, p, i),
            F(b + "ffn_gate_inp_shexp.weight", (D,), "bias"),  # one logit: σ ≈ 0.5 gates the shared expert
            W(b + "ffn_gate_shexp.weight", (fs, D), "ffn_gate_shexp", i),
            W(b + "ffn_up_shexp.weight", (fs, D), "ffn_up_shexp", i),
            W(b + "ffn_down_shexp.weight", (D, fs), "ffn_down_shexp", i),
        ]

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        w.add_rope_dimension_count(int(p.head_dim * p.partial_rotary))
        w.add_rope_dimension_sections([11, 11, 10, 0])  # llama.cpp requires it; text positions make it moot
        w.add_expert_shared_feed_forward_length(p.n_ff_shexp)
        w.add_full_attention_interval(p.full_attn_interval)
        w.add_ssm_conv_kernel(p.ssm_conv_kernel)
        w.add_ssm_state_size(p.ssm_state)
        w.add_ssm_group_count(p.ssm_groups)
        w.add_ssm_time_step_rank(p.ssm_heads)
        w.add_ssm_inner_size(p.ssm_heads * p.ssm_state)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        """Qwen's byte-level BPE and added tokens, as Qwen3's, on the split llama.cpp names
        "qwen35" (qwen2's with combining marks kept inside words), as real Qwen3.5/3.6 files say."""
        return qwen_vocab(size, n_bpe, pre="qwen35", regex=QWEN35_REGEX)


PLAN = Qwen35MoePlan()
