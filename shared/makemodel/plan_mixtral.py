"""make-model's layer plan for Mixtral (GGUF arch `llama` with experts; shared/makemodel/families.py)."""

from __future__ import annotations

from moe_pipe.shared.makemodel.presets import Preset


def layer(p: Preset, i: int, W, F) -> list:
    """Layer i in llama.cpp's file order: attention without biases or q/k norms, the
    router, and the experts stacked per projection (X F D, X F D, X D F)."""
    b, D, X, Fe = f"blk.{i}.", p.n_embd, p.n_expert, p.n_ff_exp
    qw, kw = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    return [
        F(b + "attn_norm.weight", (D,), "norm"),
        W(b + "attn_q.weight", (qw, D), "attn_q", i),
        W(b + "attn_k.weight", (kw, D), "attn_k", i),
        W(b + "attn_v.weight", (kw, D), "attn_v", i),
        W(b + "attn_output.weight", (D, qw), "attn_output", i),
        F(b + "ffn_norm.weight", (D,), "norm"),
        F(b + "ffn_gate_inp.weight", (X, D), "router"),
        W(b + "ffn_gate_exps.weight", (X, Fe, D), "ffn_gate_exps", i),
        W(b + "ffn_up_exps.weight", (X, Fe, D), "ffn_up_exps", i),
        W(b + "ffn_down_exps.weight", (X, D, Fe), "ffn_down_exps", i),
    ]
