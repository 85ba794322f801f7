"""make-model's qwen2moe (Qwen1.5-MoE / Qwen2-MoE) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them (docs/models.md
§ qwen2moe): attention with q/k/v biases, `ffn_norm`, the router, the routed
experts stacked per projection, and the shared expert with its sigmoid gate
`ffn_gate_inp_shexp` (a [D] vector: one logit per token, F32 like every 1-D tensor
llama.cpp's quantizer sees). The vocabulary is Qwen's byte-level BPE (as qwen3moe's, gguf/vocab.py `qwen_vocab`).
"""

from __future__ import annotations

from gguf import GGUFWriter

from ...gguf.vocab import Vocab, qwen_vocab
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape

# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
    # q/k/v biases and a shared expert on every layer; tiny and small have 16 and 32 experts
    # (llama.cpp's quantizer gives 8-expert models other attention types) and expert widths
    # that are not whole K-quant rows, so the down projections fall back as the real 1408's do.
    "tiny": Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=128,
        n_ff=256,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-6,
        rope_base=1e6,
        n_ff_shexp=256,
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
        n_ff_exp=352,
        n_ff=1408,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=1e6,
        n_ff_shexp=1408,
    ),
    # Qwen1.5-MoE-A2.7B (Qwen's config.json): 24 layers, D 2048, 16 heads of 128 (16 kv heads),
    # 60 experts top-4 of 1408 (never renormalized), a 5632-wide shared expert, dense width 5632.
    "qwen15-moe-shape": Preset(
        "qwen15-moe-shape",
        n_layer=24,
        n_embd=2048,
        n_head=16,
        n_head_kv=16,
        head_dim=128,
        n_expert=60,
        n_expert_used=4,
        n_ff_exp=1408,
        n_ff=5632,
        vocab_size=151936,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=1e6,
        n_ff_shexp=5632,
    ),
}


class Qwen2MoePlan(PlanPart):
    presets = PRESETS
    # Not calibrated (no Qwen1.5-MoE trace): qwen3moe's softmax sharpness and depth rule, its stream
    # unshaped; the top-k weights are not renormalized, so the routed sum is p-weighted as in the real model.
    router = RouterShape(logit_std=5.0, depth_exp=0.4)

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, X, fs = f"blk.{i}.", p.n_embd, p.n_expert, p.n_ff_shexp
        qw, kw = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
        return [
            F(b + "attn_norm.weight", (D,), "norm"),
            W(b + "attn_q.weight", (qw, D), "attn_q", i),
            F(b + "attn_q.bias", (qw,), "bias"),
            W(b + "attn_k.weight", (kw, D), "attn_k", i),
            F(b + "attn_k.bias", (kw,), "bias"),
            W(b + "attn_v.weight", (kw, D), "attn_v", i),
            F(b + "attn_v.bias", (kw,), "bias"),
            W(b + "attn_output.weight", (D, qw), "attn_output", i),
            F(b + "ffn_norm.weight", (D,), "norm"),
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            *stacked_experts(W, b, p, i),
            F(b + "ffn_gate_inp_shexp.weight", (D,), "bias"),  # one logit: σ ≈ 0.5 gates the shared expert
            W(b + "ffn_gate_shexp.weight", (fs, D), "ffn_gate_shexp", i),
            W(b + "ffn_up_shexp.weight", (fs, D), "ffn_up_shexp", i),
            W(b + "ffn_down_shexp.weight", (D, fs), "ffn_down_shexp", i),
        ]

    head_dim_in_config = False  # Qwen1.5-MoE's config has no head_dim: llama.cpp writes no key_length

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        """The qwen2moe keys beyond every family's (maker._add_metadata writes those). No
        expert_weights_norm: Qwen1.5-MoE does not renormalize, nor does llama.cpp's graph."""
        w.add_expert_shared_feed_forward_length(p.n_ff_shexp)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        """Qwen's byte-level BPE and added tokens (eos <|im_end|>, no BOS), as Qwen1.5's tokenizer has them."""
        return qwen_vocab(size, n_bpe)


PLAN = Qwen2MoePlan()
