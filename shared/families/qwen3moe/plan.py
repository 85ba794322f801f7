"""make-model's qwen3moe (Qwen3-30B-A3B) plan: presets, tensors, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them
(docs/models.md § qwen3moe): attention with per-head q/k norms, `ffn_norm`,
the router and the routed experts stacked per projection. The vocabulary is
Qwen's byte-level BPE and added tokens (gguf/vocab.py `qwen_vocab`).
"""

from __future__ import annotations

from ...gguf.vocab import Vocab, qwen_vocab
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape

# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=8,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff=768,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-6,
        rope_base=1e6,
    ),
    "small": Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=512,
        n_ff=3072,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=1e6,
    ),
    "qwen30b-shape": Preset(  # Qwen3-30B-A3B
        "qwen30b-shape",
        n_layer=48,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        n_ff=6144,
        vocab_size=151936,
        n_bpe=4096,
        context_length=40960,
        rms_eps=1e-6,
        rope_base=1e6,
    ),
}


class Qwen3MoePlan(PlanPart):
    presets = PRESETS
    # Calibrated on the phone trace (bench/bench_routing.py; why these levers: maker.py
    # "routers"; figures: docs/benchmarks.md "Synthetic routing"), teacher-forced corpus
    # text at the trace's top-k. LRU decode hit at a cache of 20 % of the experts, made
    # model / trace, qwen30b-shape top-6: 77.5 / 74.1 at 8 layers, 74.9 at 16, 77.5 at 48
    # (the full depth); unit logits gave 95.7 at 8 layers and greedy decoding that cycles
    # through a few tokens. The price: gates sharper than a trained model's (top-1 weight
    # ~0.7, not ~0.3). stream_write and first_attn_q (shape presets only) were fitted on
    # qwen30b-shape cut to 8 layers, 128 text tokens: the cross-layer probe
    # (bench_routing.py --cross-layer) at top-8 to the published 88.6 % at d = 1 (ours
    # 88.6, 84.0 at d = 2, 80.1 at d = 3), keeping the LRU hit at a 20 % cache at 76.6
    # (top-6; 77.5 unshaped, trace 74.1) and the reuse figures near the trace's
    # (docs/benchmarks.md "Cross-layer predictability").
    router = RouterShape(logit_std=5.0, depth_exp=0.4, stream_write=0.035, first_attn_q=0.85)
    router_input_norm = "ffn_norm.weight"
    first_query = ("attn_q_norm.weight",)  # q is RMS-normed: its norm sets the scale

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, X, d = f"blk.{i}.", p.n_embd, p.n_expert, p.head_dim
        qw, kw = p.n_head * d, p.n_head_kv * d
        return [
            F(b + "attn_norm.weight", (D,), "norm"),
            W(b + "attn_q.weight", (qw, D), "attn_q", i),
            W(b + "attn_k.weight", (kw, D), "attn_k", i),
            W(b + "attn_v.weight", (kw, D), "attn_v", i),
            W(b + "attn_output.weight", (D, qw), "attn_output", i),
            F(b + "attn_q_norm.weight", (d,), "norm"),
            F(b + "attn_k_norm.weight", (d,), "norm"),
            F(b + "ffn_norm.weight", (D,), "norm"),
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            *stacked_experts(W, b, p, i),
        ]

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        return qwen_vocab(size, n_bpe)


PLAN = Qwen3MoePlan()
