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
