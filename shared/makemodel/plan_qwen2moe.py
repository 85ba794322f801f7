"""make-model's qwen2moe (Qwen1.5-MoE / Qwen2-MoE) layer plan, metadata and vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them (docs/models.md
§ qwen2moe): attention with q/k/v biases, `ffn_norm`, the router, the routed
experts stacked per projection, and the shared expert with its sigmoid gate
`ffn_gate_inp_shexp` (a [D] vector: one logit per token, F32 like every 1-D tensor
llama.cpp's quantizer sees). The vocabulary is Qwen's byte-level BPE (as qwen3moe's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import GGUFWriter

from moe_pipe.shared.gguf.vocab import Vocab, build_vocab
from moe_pipe.shared.makemodel.presets import Preset


def layer(p: Preset, i: int, W: Callable[..., Any], F: Callable[..., Any]) -> list:
    b, D, X, Fe, fs = f"blk.{i}.", p.n_embd, p.n_expert, p.n_ff_exp, p.n_ff_shexp
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
        W(b + "ffn_gate_exps.weight", (X, Fe, D), "ffn_gate_exps", i),  # X F D
        W(b + "ffn_up_exps.weight", (X, Fe, D), "ffn_up_exps", i),  # X F D
        W(b + "ffn_down_exps.weight", (X, D, Fe), "ffn_down_exps", i),  # X D F
        F(b + "ffn_gate_inp_shexp.weight", (D,), "bias"),  # one logit: σ ≈ 0.5 gates the shared expert
        W(b + "ffn_gate_shexp.weight", (fs, D), "ffn_gate_shexp", i),
        W(b + "ffn_up_shexp.weight", (fs, D), "ffn_up_shexp", i),
        W(b + "ffn_down_shexp.weight", (D, fs), "ffn_down_shexp", i),
    ]


def metadata(w: GGUFWriter, p: Preset) -> None:
    """The qwen2moe keys beyond every family's (maker._add_metadata writes those). No
    expert_weights_norm: Qwen1.5-MoE does not renormalize, nor does llama.cpp's graph."""
    w.add_expert_shared_feed_forward_length(p.n_ff_shexp)


def vocab(size: int, n_bpe: int) -> Vocab:
    """Qwen's byte-level BPE and added tokens (eos <|im_end|>, no BOS), as Qwen1.5's tokenizer has them."""
    return build_vocab("qwen3moe", size, n_bpe)


# make-model presets: tiny, small and the real model's shape (presets.get_preset finds them here)
PRESETS: dict[str, Preset] = {
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
