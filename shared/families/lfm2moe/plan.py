"""make-model's lfm2moe (LFM2-MoE, Liquid's LFM2-8B-A1B) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them (docs/models.md
§ lfm2moe): a short-conv layer carries `shortconv.in_proj` (B, C, x), the depthwise
`shortconv.conv` kernel (F32: llama.cpp's quantizer never quantizes it) and
`shortconv.out_proj`; an attention layer q/k/v/output with per-head q/k norms; then
`ffn_norm` and a dense FFN (the leading layers) or the router, the experts and
their selection bias `exp_probs_b`. The final norm is `token_embd_norm` and the
head is tied to `token_embd` (maker.py plans both from `final_norm` and `tied_head`).
Which layers attend is `head_count_kv` per layer, 0 for a short-conv layer.
"""

from __future__ import annotations

from gguf import ExpertGatingFuncType, GGUFWriter

from ...gguf.vocab import CONTROL, LLAMA3_REGEX, NORMAL, UNUSED, USER_DEFINED, Vocab, train_byte_level
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape

# LFM2's first ids (the published tokenizer): the ChatML-like markers its template uses.
# The tool-call markers stay visible in text (USER_DEFINED) so a reply's calls can be parsed.
_SPECIALS = (
    ("<|pad|>", CONTROL),
    ("<|startoftext|>", CONTROL),
    ("<|endoftext|>", CONTROL),
    ("<|fim_pre|>", CONTROL),
    ("<|fim_mid|>", CONTROL),
    ("<|fim_suf|>", CONTROL),
    ("<|im_start|>", CONTROL),
    ("<|im_end|>", CONTROL),
    ("<|tool_list_start|>", CONTROL),
    ("<|tool_list_end|>", CONTROL),
    ("<|tool_call_start|>", USER_DEFINED),
    ("<|tool_call_end|>", USER_DEFINED),
    ("<|tool_response_start|>", CONTROL),
    ("<|tool_response_end|>", CONTROL),
)


def dense_lead(p: Preset) -> int:
    """The leading dense layers, leaving at least one routed layer: a shape preset
    cut to fewer layers than the real model's dense lead (lfm2-8b-shape --layers 2)
    still streams experts, and the spec reader requires lead < block_count."""
    return min(p.n_dense_lead, p.n_layer - 1)


# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
    # Heads are n_embd / n_head wide (llama.cpp's lfm2moe has no head-width key).
    # tiny: conv, attention, conv, attention; layer 0 dense.
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
        n_ff=512,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-5,
        rope_base=1e6,
        ssm_conv_kernel=3,
        n_dense_lead=1,
        attn_layers=(1, 3),
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
        n_ff=2048,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-5,
        rope_base=1e6,
        ssm_conv_kernel=3,
        n_dense_lead=2,
        attn_layers=(2, 5),
    ),
    # LFM2-8B-A1B (LiquidAI/LFM2-8B-A1B config.json; transformers' Lfm2MoeConfig defaults agree
    # but for its 32 layers): 24 layers, attention at 2, 6, 10, 14, 18, 21 (the other 18 short
    # convolutions of width 3), layers 0-1 dense (7168 wide), 32 experts of 1792 top-4, tied head.
    "lfm2-8b-shape": Preset(
        "lfm2-8b-shape",
        n_layer=24,
        n_embd=2048,
        n_head=32,
        n_head_kv=8,
        head_dim=64,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=1792,
        n_ff=7168,
        vocab_size=65536,
        n_bpe=4096,
        context_length=128000,
        rms_eps=1e-5,
        rope_base=1e6,
        ssm_conv_kernel=3,
        n_dense_lead=2,
        attn_layers=(2, 6, 10, 14, 18, 21),
    ),
}


class Lfm2MoePlan(PlanPart):
    presets = PRESETS
    # Not calibrated (no LFM2 trace). Sigmoid gates as glm4moe's, unit logit spread. Its stream
    # holds little context average (short convs span 3 tokens; 1 layer in 4 attends), so
    # routing turns over like gpt-oss's rather than freezing: lfm2-8b-shape cut to 8 layers,
    # 40 greedy tokens after corpus text were all distinct, decode LRU hit at a 20 % cache
    # 16-17 % (near-uniform routing) at logit scales 0.5-4 alike.
    router = RouterShape(logit_std=1.0)
    final_norm = "token_embd_norm.weight"
    tied_head = True

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, X, d = f"blk.{i}.", p.n_embd, p.n_expert, p.head_dim
        out = [F(b + "attn_norm.weight", (D,), "norm")]
        if p.is_recurrent(i):
            out += [
                W(b + "shortconv.in_proj.weight", (3 * D, D), "shortconv_in", i),  # 3D D: B, C, x
                F(b + "shortconv.conv.weight", (D, p.ssm_conv_kernel), "conv"),  # D L
                W(b + "shortconv.out_proj.weight", (D, D), "shortconv_out", i),
            ]
        else:
            qw, kw = p.n_head * d, p.n_head_kv * d
            out += [
                W(b + "attn_q.weight", (qw, D), "attn_q", i),
                W(b + "attn_k.weight", (kw, D), "attn_k", i),
                W(b + "attn_v.weight", (kw, D), "attn_v", i),
                W(b + "attn_output.weight", (D, qw), "attn_output", i),
                F(b + "attn_q_norm.weight", (d,), "norm"),
                F(b + "attn_k_norm.weight", (d,), "norm"),
            ]
        out.append(F(b + "ffn_norm.weight", (D,), "norm"))
        if i < dense_lead(p):
            return out + [
                W(b + "ffn_gate.weight", (p.n_ff, D), "ffn_gate", i),  # Fd D
                W(b + "ffn_up.weight", (p.n_ff, D), "ffn_up", i),  # Fd D
                W(b + "ffn_down.weight", (D, p.n_ff), "ffn_down", i),  # D Fd
            ]
        return out + [
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            *stacked_experts(W, b, p, i),
            # The selection bias: a trained one spreads the load; a small random spread
            # (bias fill, 0.02) nudges which experts win without deciding it.
            F(b + "exp_probs_b.bias", (X,), "bias"),
        ]

    head_dim_in_config = False  # LFM2's config has no head_dim: llama.cpp writes no key_length

    def head_count_kv(self, p: Preset, nextn: int = 0) -> list[int]:
        """llama.cpp's per-layer kv heads: 0 marks a short-conv layer."""
        return [0 if p.is_recurrent(i) else p.n_head_kv for i in range(p.n_layer)]

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        """The lfm2moe keys beyond every family's (maker._add_metadata writes those), as
        moe-pipe convert writes them; llama.cpp always renormalizes the top-k
        weights and never scales them, so no expert_weights_* keys."""
        w.add_leading_dense_block_count(dense_lead(p))
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_vocab_size(p.vocab_size)
        w.add_shortconv_l_cache(p.ssm_conv_kernel)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        """[14 specials at LFM2's ids | BPE ... | <|reserved_n|> ...]: byte-level BPE on
        llama3's split, which llama.cpp calls "lfm2"; every prompt starts with
        <|startoftext|> (id 1), a reply ends with <|im_end|> (id 7)."""
        bpe, merges = train_byte_level(LLAMA3_REGEX, n_bpe)
        names = {t for t, _ in _SPECIALS}
        tokens = [t for t, _ in _SPECIALS] + [t for t in bpe if t not in names]
        types = [typ for _, typ in _SPECIALS] + [NORMAL] * (len(tokens) - len(_SPECIALS))
        if len(tokens) > size:
            raise ValueError(
                f"lfm2moe: vocab size {size} cannot hold {len(tokens) - len(_SPECIALS)} BPE tokens + {len(_SPECIALS)} specials"
            )
        tokens += [f"<|reserved_{i}|>" for i in range(len(tokens), size)]
        types += [UNUSED] * (size - len(types))
        return Vocab(
            model="gpt2",
            pre="lfm2",
            regex=LLAMA3_REGEX,
            tokens=tuple(tokens),
            types=tuple(types),
            merges=merges,
            bos=1,
            eos=7,
            pad=0,
            unk=None,
            add_bos=True,
        )


PLAN = Lfm2MoePlan()
