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


# make-model presets: tiny, small and the real model's shape (presets.get_preset finds them here)
PRESETS: dict[str, Preset] = {
    # --------------------------------------------------------- llama (Mixtral)
    # llama.cpp writes Mixtral as arch llama; its experts are feed_forward_length wide (n_ff = n_ff_exp).
    "tiny": Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=8,
        n_head_kv=2,
        head_dim=32,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff=256,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-5,
        rope_base=1e6,
    ),
    "small": Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=1024,
        n_ff=1024,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-5,
        rope_base=1e6,
    ),
    "mixtral-8x7b-shape": Preset(  # Mixtral-8x7B-v0.1 / Instruct-v0.1
        "mixtral-8x7b-shape",
        n_layer=32,
        n_embd=4096,
        n_head=32,
        n_head_kv=8,
        head_dim=128,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=14336,
        n_ff=14336,
        vocab_size=32000,
        n_bpe=4096,
        context_length=32768,
        rms_eps=1e-5,
        rope_base=1e6,
    ),
}
