"""make-model's gemma4 (Gemma-4-26B-A4B) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them
(docs/models.md § gemma4): sliding-window layers and full-attention layers
(wider heads, fewer kv heads, K used as V, partially rotated by `rope_freqs`),
the always-on dense MLP beside the routed experts (gate and up fused), the
norms around both and the per-layer output scale; the head is tied to
token_embd. The vocabulary is Gemma's SentencePiece-style BPE with its low
special ids (gguf/vocab.py `gemma_vocab`).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from ...gguf.vocab import Vocab, gemma_vocab
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec
from ...makemodel.presets import Preset, RouterShape

# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
    # tiny/small widths of the routed and dense FFN are multiples of 32 but not
    # of 256, like the real 704/2112, so the down projections fall back too.
    "tiny": Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=192,
        n_ff=320,
        vocab_size=2048,
        n_bpe=1500,
        context_length=4096,
        rms_eps=1e-6,
        rope_base=1e6,
        sliding_window=128,
        swa_period=2,
        head_dim_full=128,
        n_head_kv_full=1,
        rope_base_swa=1e4,
        partial_rotary=0.25,
        final_softcap=30.0,
    ),
    "small": Preset(
        "small",
        n_layer=6,
        n_embd=1024,
        n_head=8,
        n_head_kv=4,
        head_dim=128,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=352,
        n_ff=704,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=1e6,
        sliding_window=512,
        swa_period=3,
        head_dim_full=256,
        n_head_kv_full=1,
        rope_base_swa=1e4,
        partial_rotary=0.25,
        final_softcap=30.0,
    ),
    "gemma26b-shape": Preset(  # Gemma-4-26B-A4B
        "gemma26b-shape",
        n_layer=30,
        n_embd=2816,
        n_head=16,
        n_head_kv=8,
        head_dim=256,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=704,
        n_ff=2112,
        vocab_size=262144,
        n_bpe=4096,
        context_length=262144,
        rms_eps=1e-6,
        rope_base=1e6,
        sliding_window=1024,
        swa_period=6,
        head_dim_full=512,
        n_head_kv_full=2,
        rope_base_swa=1e4,
        partial_rotary=0.25,
        final_softcap=30.0,
    ),
}


class Gemma4Plan(PlanPart):
    presets = PRESETS
    # No trace to match: logits of the same order as the others'. Neither lever works here
    # (no router bias; the expert output is RMS-normed, so gate sharpness does not reach
    # the hidden state), and its stream is not shaped: it writes through RMS norms, so its
    # weights' scale never reaches the stream.
    router = RouterShape(logit_std=1.0)
    tied_head = True
    add_space_prefix = False

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, X, Fe = f"blk.{i}.", p.n_embd, p.n_expert, p.n_ff_exp
        swa = p.is_swa(i)
        d = p.head_dim if swa else p.head_dim_full
        hk = p.n_head_kv if swa else p.n_head_kv_full
        qw, kw = p.n_head * d, hk * d
        out = [
            F(b + "attn_norm.weight", (D,), "norm"),
            W(b + "attn_q.weight", (qw, D), "attn_q", i),
            W(b + "attn_k.weight", (kw, D), "attn_k", i),
        ]
        if swa:  # full layers use K as V
            out.append(W(b + "attn_v.weight", (kw, D), "attn_v", i))
        return out + [
            W(b + "attn_output.weight", (D, qw), "attn_output", i),
            F(b + "attn_q_norm.weight", (d,), "norm"),
            F(b + "attn_k_norm.weight", (d,), "norm"),
            F(b + "post_attention_norm.weight", (D,), "norm"),
            F(b + "ffn_norm.weight", (D,), "norm"),
            W(b + "ffn_gate.weight", (p.n_ff, D), "ffn_gate", i),  # Fd D
            W(b + "ffn_up.weight", (p.n_ff, D), "ffn_up", i),  # Fd D
            W(b + "ffn_down.weight", (D, p.n_ff), "ffn_down", i),  # D Fd
            F(b + "post_ffw_norm_1.weight", (D,), "norm"),
            F(b + "pre_ffw_norm_2.weight", (D,), "norm"),
            F(b + "post_ffw_norm_2.weight", (D,), "norm"),
            F(b + "post_ffw_norm.weight", (D,), "norm"),
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            F(b + "ffn_gate_inp.scale", (D,), "scale"),
            W(b + "ffn_gate_up_exps.weight", (X, 2 * Fe, D), "ffn_gate_up_exps", i),  # X 2F D, gate rows first
            W(b + "ffn_down_exps.weight", (X, D, Fe), "ffn_down_exps", i),  # X D F
            F(b + "ffn_down_exps.scale", (X,), "scale"),
            F(b + "layer_output_scale.weight", (1,), "scale"),
        ]

    def head_tensors(self, p: Preset) -> list[TensorSpec]:
        """The "proportional" rope of the full layers: only the first pairs rotate."""
        return [TensorSpec("rope_freqs.weight", (p.head_dim_full // 2,), Q.F32, "rope_freqs", p.partial_rotary)]

    def router_std(self, logit_std: float, ne0: int) -> float:
        """The router divides its RMS-normed input by √D first: the weights carry the spread as is."""
        return logit_std

    def attention_metadata(self, w: GGUFWriter, p: Preset, nextn: int = 0) -> None:
        """Two attentions: the sliding-window layers' (`_swa` keys) and the full layers'."""
        w.add_head_count_kv([int(p.n_head_kv if p.is_swa(i) else p.n_head_kv_full) for i in range(p.n_layer)])
        w.add_key_length(p.head_dim_full)
        w.add_value_length(p.head_dim_full)
        w.add_key_length_swa(p.head_dim)
        w.add_value_length_swa(p.head_dim)
        w.add_rope_dimension_count(p.head_dim_full)
        w.add_rope_dimension_count_swa(p.head_dim)
        w.add_rope_freq_base_swa(p.rope_base_swa)
        w.add_sliding_window(p.sliding_window)
        w.add_sliding_window_pattern([bool(p.is_swa(i)) for i in range(p.n_layer)])
        w.add_shared_kv_layers(0)
        w.add_embedding_length_per_layer_input(0)
        w.add_final_logit_softcapping(p.final_softcap)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        return gemma_vocab(size, n_bpe)


PLAN = Gemma4Plan()
