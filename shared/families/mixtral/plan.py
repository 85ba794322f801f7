"""make-model's mixtral (Mixtral-8x7B, GGUF arch `llama` with experts) plan: presets, tensors, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them
(docs/models.md § mixtral): attention without biases or q/k norms, `ffn_norm`,
the router and the experts stacked per projection; llama.cpp writes Mixtral as
arch llama, its experts feed_forward_length wide. The vocabulary is
Llama/Mistral's SentencePiece layout (gguf/vocab.py `llama_vocab`).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from ...gguf.vocab import Vocab, llama_vocab
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape

# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
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


class MixtralPlan(PlanPart):
    presets = PRESETS
    router = RouterShape(logit_std=5.0, depth_exp=0.4)  # not calibrated (no Mixtral trace): qwen3moe's gate sharpness, its stream unshaped
    # llama.cpp's LlamaModel: Mixtral's config has neither moe_intermediate_size nor head_dim
    width_keys = ("feed_forward_length",)
    head_dim_in_config = False

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        """What llama.cpp's LlamaModel adds to every family's keys: vocab_size, and the
        rotated dims (head_dim, or n_embd / n_head)."""
        w.add_vocab_size(p.vocab_size)
        w.add_rope_dimension_count(p.head_dim)

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        """Layer i in llama.cpp's file order: attention without biases or q/k norms, the
        router, and the experts stacked per projection (X F D, X F D, X D F)."""
        b, D, X = f"blk.{i}.", p.n_embd, p.n_expert
        qw, kw = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
        return [
            F(b + "attn_norm.weight", (D,), "norm"),
            W(b + "attn_q.weight", (qw, D), "attn_q", i),
            W(b + "attn_k.weight", (kw, D), "attn_k", i),
            W(b + "attn_v.weight", (kw, D), "attn_v", i),
            W(b + "attn_output.weight", (D, qw), "attn_output", i),
            F(b + "ffn_norm.weight", (D,), "norm"),
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            *stacked_experts(W, b, p, i),
        ]

    def mix(self, role: str, layer: int, n_layer: int, v_index: int, n_v: int) -> Q:
        """llama.cpp's quantizer for an 8-expert model (every preset here has 8, as Mixtral
        does): attn_k and attn_v Q8_0 in every mix, attn_output Q5_K in Q4_K_M."""
        if role in ("attn_k", "attn_v"):
            return Q.Q8_0
        if role == "attn_output":
            return Q.Q5_K
        return super().mix(role, layer, n_layer, v_index, n_v)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        return llama_vocab(size, n_bpe)


PLAN = MixtralPlan()
