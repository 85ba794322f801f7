"""make-model's gpt-oss (gpt-oss-120b, -20b) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them
(docs/models.md § gpt-oss): attention with q/k/v/output biases and sinks,
`post_attention_norm` (the pre-FFN norm), the router with its bias and the
routed experts with theirs; sliding-window attention on even layers and YaRN.
The real files are ggml-org's MXFP4 MoE mix; the vocabulary is o200k_harmony's
layout (gguf/vocab.py `harmony_vocab`).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType

from ...gguf.vocab import Vocab, harmony_vocab
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec
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
        n_ff=256,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-5,
        rope_base=150000.0,
        sliding_window=128,
        yarn_factor=32.0,
        yarn_orig_ctx=4096,
    ),
    "small": Preset(
        "small",
        n_layer=8,
        n_embd=768,
        n_head=12,
        n_head_kv=4,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=768,
        n_ff=768,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-5,
        rope_base=150000.0,
        sliding_window=128,
        yarn_factor=32.0,
        yarn_orig_ctx=4096,
    ),
    "gptoss120b-shape": Preset(  # gpt-oss-120b
        "gptoss120b-shape",
        n_layer=36,
        n_embd=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_expert=128,
        n_expert_used=4,
        n_ff_exp=2880,
        n_ff=2880,
        vocab_size=201088,
        n_bpe=4096,
        context_length=131072,
        rms_eps=1e-5,
        rope_base=150000.0,
        sliding_window=128,
        yarn_factor=32.0,
        yarn_orig_ctx=4096,
    ),
}


class GptOssPlan(PlanPart):
    presets = PRESETS
    # Calibrated on the phone trace (bench/bench_routing.py; docs/benchmarks.md "Synthetic
    # routing"): its hidden state has little context average (its mean direction is ~0.2 of
    # the state, qwen3moe's ~0.9), so routing is near-uniform and the router bias carries
    # static per-expert popularity. LRU decode hit at a 20 % cache, gptoss120b-shape top-2:
    # 77.5 / 74.0 (made model / trace) at 4 layers, 79.0 at 8; without the bias 25.4.
    # Shape presets (4 layers, 64 text tokens): stream_write 0.035 gives 87.5 % at d = 1 of
    # the cross-layer probe (top-4; 42.6 unshaped), and the shaped stream keeps routing
    # steadier, so its bias spread comes down from 0.9 to 0.75 for the LRU hit at a 20 %
    # cache (top-2: 80.9 / 78.1 text / greedy, 77.5 / 81.2 unshaped, trace 74.0).
    router = RouterShape(logit_std=1.0, bias_std=0.9, stream_write=0.035, shaped_bias_std=0.75)
    router_input_norm = "post_attention_norm.weight"
    first_query = ("attn_q.weight", "attn_q.bias")
    mix_name = "MXFP4_MOE"

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, X, Fe, d = f"blk.{i}.", p.n_embd, p.n_expert, p.n_ff_exp, p.head_dim
        qw, kw = p.n_head * d, p.n_head_kv * d
        return [
            F(b + "attn_norm.weight", (D,), "norm"),
            W(b + "attn_q.weight", (qw, D), "attn_q", i),
            W(b + "attn_k.weight", (kw, D), "attn_k", i),
            W(b + "attn_v.weight", (kw, D), "attn_v", i),
            W(b + "attn_output.weight", (D, qw), "attn_output", i),
            F(b + "attn_q.bias", (qw,), "bias"),
            F(b + "attn_k.bias", (kw,), "bias"),
            F(b + "attn_v.bias", (kw,), "bias"),
            F(b + "attn_output.bias", (D,), "bias"),
            F(b + "attn_sinks.weight", (p.n_head,), "sinks"),
            F(b + "post_attention_norm.weight", (D,), "norm"),  # the pre-FFN norm
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            F(b + "ffn_gate_inp.bias", (X,), "router_bias"),
            W(b + "ffn_gate_exps.weight", (X, Fe, D), "ffn_gate_exps", i),
            F(b + "ffn_gate_exps.bias", (X, Fe), "bias"),
            W(b + "ffn_up_exps.weight", (X, Fe, D), "ffn_up_exps", i),
            F(b + "ffn_up_exps.bias", (X, Fe), "bias"),
            W(b + "ffn_down_exps.weight", (X, D, Fe), "ffn_down_exps", i),
            F(b + "ffn_down_exps.bias", (X, D), "bias"),
        ]

    def mix(self, role: str, layer: int, n_layer: int, v_index: int, n_v: int) -> Q:
        """ggml-org's MXFP4 MoE: experts MXFP4, every other weight matrix Q8_0."""
        return Q.MXFP4 if role.endswith("_exps") else Q.Q8_0

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        w.add_sliding_window(p.sliding_window)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(p.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(p.yarn_orig_ctx)
        # gpt-oss's rope_scaling has beta_fast 32 and beta_slow 1 (YaRN's defaults), which llama.cpp's converter writes
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        return harmony_vocab(size, n_bpe)


PLAN = GptOssPlan()
