"""make-model's bailingmoe3 (Ling 3.0) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them
(docs/models.md § bailingmoe3): on every full_attn_interval-th layer deepseek2's
latent attention (kv_b_proj split into attn_k_b / attn_v_b) with a gate per head
(attn_gate); on the others Kimi Delta Attention: q/k/v projections each with its
own short conv ([1, H·d, 1, kernel]), the forget gate (ssm_f_a, ssm_dt.bias,
ssm_a = exp(A_log) as [H, 1]), β, the output gate and norm. The leading dense
layers carry ffn_gate/up/down (n_ff wide), the others the router, its selection
bias, the routed experts and the shared experts. head_count_kv is per layer: 0 on a
KDA layer, 1 on an MLA layer. The vocabulary is a byte-level BPE on llama.cpp's
"bailingmoe2" split with Ling's specials; in the real vocab size <|startoftext|> (bos,
never added), <|endoftext|> (pad) and <|role_end|> (eos) sit at Ling's ids 156891, 156892
and 156895 (a real Ling-3.0 GGUF's header: bos 156891, eos 156895, pad 156892, add_bos and
add_eos false; Ling's tokenizer_config names bos <|startoftext|> and pad <|endoftext|>),
<role> and </role> between them are this plan's choice.
"""

from __future__ import annotations

from gguf import ExpertGatingFuncType, GGUFWriter

from ...gguf.vocab import CONTROL, USER_DEFINED, Vocab, _check_fits, _fill, train_byte_level
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape
from ...text.tokenizer import BAILINGMOE2_REGEX

_SPECIALS = [
    ("<|startoftext|>", CONTROL),
    ("<|endoftext|>", CONTROL),
    ("<role>", USER_DEFINED),
    ("</role>", USER_DEFINED),
    ("<|role_end|>", CONTROL),
    ("<think>", USER_DEFINED),
    ("</think>", USER_DEFINED),
]
_REAL = {"vocab": 157184, "first_special": 156891}


# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
    # MLA on layers 1 and 3, KDA on 0 and 2; layer 0 dense; 16 experts in 4 groups (best 2 kept)
    "tiny": Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=4,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=128,
        n_ff=512,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        full_attn_interval=2,
        ssm_heads=4,
        ssm_groups=4,
        ssm_state=64,
        n_dense_lead=1,
        n_expert_shared=1,
        expert_groups=4,
        expert_groups_used=2,
        expert_weights_scale=2.5,
        kv_lora_rank=128,
        qk_nope_dim=64,
        qk_rope_dim=32,
        n_head_kv=1,
        rms_eps=1e-6,
        rope_base=6e6,
        expert_gating_sigmoid=True,
        ssm_conv_kernel=4,
    ),
    "small": Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=8,
        head_dim=128,
        n_expert=32,
        n_expert_used=6,
        n_ff_exp=512,
        n_ff=2048,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        full_attn_interval=4,
        ssm_heads=8,
        ssm_groups=8,
        ssm_state=128,
        n_dense_lead=1,
        n_expert_shared=1,
        expert_groups=4,
        expert_groups_used=2,
        expert_weights_scale=2.5,
        kv_lora_rank=256,
        qk_nope_dim=128,
        qk_rope_dim=64,
        n_head_kv=1,
        rms_eps=1e-6,
        rope_base=6e6,
        expert_gating_sigmoid=True,
        ssm_conv_kernel=4,
    ),
    # Ling-3.0-tiny (7.9B total, 1.3B active; inclusionAI's config as its GGUF and ports
    # report it): 24 layers (MLA every 4th), 16 heads of 128 (KDA) / 128 nope + 64 rope,
    # values 128, q_lora_rank 256, kv_lora_rank 512; 1 dense layer of 4608; 128 experts
    # top-8 of 512, 1 shared; context 131072. Its groups and scale are not in those
    # reports: flash's 8 groups (best 4) and 2.5 are assumed.
    "ling-3-tiny-shape": Preset(
        "ling-3-tiny-shape",
        n_layer=24,
        n_embd=1536,
        n_head=16,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=512,
        n_ff=4608,
        vocab_size=157184,
        n_bpe=4096,
        context_length=131072,
        full_attn_interval=4,
        ssm_heads=16,
        ssm_groups=16,
        ssm_state=128,
        n_dense_lead=1,
        n_expert_shared=1,
        expert_groups=8,
        expert_groups_used=4,
        expert_weights_scale=2.5,
        kv_lora_rank=512,
        q_lora_rank=256,
        qk_nope_dim=128,
        qk_rope_dim=64,
        n_head_kv=1,
        rms_eps=1e-6,
        rope_base=6e6,
        expert_gating_sigmoid=True,
        ssm_conv_kernel=4,
    ),
    # Ling-3.0-flash (transformers' BailingHybridConfig defaults, llama.cpp's 124B-A5.1B):
    # 42 layers (MLA every 6th), 32 heads of 128 (KDA) / 128 nope + 64 rope, values 128,
    # kv_lora_rank 512, no q_lora; 2 dense layers of 6144; 512 experts top-8 of 768 in 8
    # groups (best 4), 1 shared, scale 2.5. The MTP block the real file may carry is not made.
    "ling-3-flash-shape": Preset(
        "ling-3-flash-shape",
        n_layer=42,
        n_embd=2560,
        n_head=32,
        head_dim=128,
        n_expert=512,
        n_expert_used=8,
        n_ff_exp=768,
        n_ff=6144,
        vocab_size=157184,
        n_bpe=4096,
        context_length=131072,  # a real Ling-3.0 GGUF's header (bailingmoe3.context_length)
        full_attn_interval=6,
        ssm_heads=32,
        ssm_groups=32,
        ssm_state=128,
        n_dense_lead=2,
        n_expert_shared=1,
        expert_groups=8,
        expert_groups_used=4,
        expert_weights_scale=2.5,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        n_head_kv=1,
        rms_eps=1e-6,
        rope_base=6e6,
        expert_gating_sigmoid=True,
        ssm_conv_kernel=4,
    ),
}


class BailingMoe3Plan(PlanPart):
    presets = PRESETS
    router = RouterShape(logit_std=5.0, depth_exp=0.4)  # not calibrated (no Ling trace): deepseek2's

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        return self._block(p, i, W, F, mla=not p.is_recurrent(i))

    def nextn_layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        """Ling's MTP layer as llama.cpp's converter writes it (shared/families/bailingmoe3/convert.py:
        a gated-MLA MoE layer, then eh_proj, enorm and hnorm as nextn.*, and its
        final_layernorm as layer_output_norm); the embedding and the output head are the model's."""
        b, D = f"blk.{i}.", p.n_embd
        return [
            *self._block(p, i, W, F, mla=True),
            W(b + "nextn.eh_proj.weight", (D, 2 * D), "nextn_eh_proj", i),  # [embedding; hidden] → D
            F(b + "nextn.enorm.weight", (D,), "norm"),
            F(b + "nextn.hnorm.weight", (D,), "norm"),
            F(b + "layer_output_norm.weight", (D,), "norm"),
        ]

    def _block(self, p: Preset, i: int, W: MakeWeight, F: MakeVector, mla: bool) -> list[TensorSpec]:
        b, D, X = f"blk.{i}.", p.n_embd, p.n_expert
        out = [F(b + "attn_norm.weight", (D,), "norm")]
        out += self._mla(p, i, W, F) if mla else self._kda(p, i, W, F)
        out.append(F(b + "ffn_norm.weight", (D,), "norm"))
        if i < p.n_dense_lead:
            return out + [
                W(b + "ffn_gate.weight", (p.n_ff, D), "ffn_gate", i),  # Fd D
                W(b + "ffn_up.weight", (p.n_ff, D), "ffn_up", i),  # Fd D
                W(b + "ffn_down.weight", (D, p.n_ff), "ffn_down", i),  # D Fd
            ]
        fs = p.n_ff_exp * p.n_expert_shared
        return out + [
            F(b + "ffn_gate_inp.weight", (X, D), "router"),
            F(b + "exp_probs_b.bias", (X,), "bias"),
            *stacked_experts(W, b, p, i),
            W(b + "ffn_gate_shexp.weight", (fs, D), "ffn_gate_shexp", i),
            W(b + "ffn_up_shexp.weight", (fs, D), "ffn_up_shexp", i),
            W(b + "ffn_down_shexp.weight", (D, fs), "ffn_down_shexp", i),
        ]

    def _kda(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, H, d = f"blk.{i}.", p.n_embd, p.n_head, p.ssm_state
        inner = H * d
        return [
            W(b + "attn_q.weight", (inner, D), "attn_q", i),
            W(b + "attn_k.weight", (inner, D), "attn_k", i),
            W(b + "attn_v.weight", (inner, D), "attn_v", i),
            *(F(b + f"ssm_conv1d_{x}.weight", (1, inner, 1, p.ssm_conv_kernel), "conv") for x in "qkv"),
            W(b + "ssm_f_a.weight", (inner, D), "ssm_f_a", i),
            F(b + "ssm_dt.bias", (inner,), "bias"),
            F(b + "ssm_a", (H, 1), "scale"),  # a = exp(A_log) > 0 per head
            W(b + "ssm_beta.weight", (H, D), "ssm_beta", i),
            W(b + "ssm_g_a.weight", (inner, D), "ssm_g_a", i),
            F(b + "ssm_norm.weight", (d,), "norm"),
            W(b + "attn_output.weight", (D, inner), "attn_output", i),
        ]

    def _mla(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, H = f"blk.{i}.", p.n_embd, p.n_head
        r, rope, nope, v, ql = p.kv_lora_rank, p.qk_rope_dim, p.qk_nope_dim, p.head_dim, p.q_lora_rank
        qk = nope + rope
        if ql:
            q = [
                W(b + "attn_q_a.weight", (ql, D), "attn_q_a", i),
                F(b + "attn_q_a_norm.weight", (ql,), "norm"),
                W(b + "attn_q_b.weight", (H * qk, ql), "attn_q_b", i),
            ]
        else:
            q = [W(b + "attn_q.weight", (H * qk, D), "attn_q", i)]
        return q + [
            W(b + "attn_kv_a_mqa.weight", (r + rope, D), "attn_kv_a_mqa", i),
            F(b + "attn_kv_a_norm.weight", (r,), "norm"),
            W(b + "attn_k_b.weight", (H, r, nope), "attn_k_b", i),  # H r nope: q_nope absorbed into the latent
            W(b + "attn_v_b.weight", (H, v, r), "attn_v_b", i),  # H v r: the latent back to each head's values
            W(b + "attn_gate.weight", (H, D), "attn_gate", i),  # one sigmoid gate per head
            W(b + "attn_output.weight", (D, H * v), "attn_output", i),
        ]

    def head_count_kv(self, p: Preset, nextn: int = 0) -> list[int]:
        """0 on a KDA layer (no KV cache), 1 on an MLA layer (the latent as one head); the MTP
        blocks are MLA layers."""
        return [0 if p.is_recurrent(i) else 1 for i in range(p.n_layer)] + [1] * nextn

    def attention_metadata(self, w: GGUFWriter, p: Preset, nextn: int = 0) -> None:
        """MLA as one cached head: K = the latent and the rope part, V = the latent."""
        w.add_head_count_kv(self.head_count_kv(p, nextn))
        w.add_key_length(p.kv_lora_rank + p.qk_rope_dim)
        w.add_value_length(p.kv_lora_rank)

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        """The bailingmoe3 keys beyond every family's and its attention's."""
        arch = "bailingmoe3"
        w.add_vocab_size(p.vocab_size)
        w.add_key_length_mla(p.qk_nope_dim + p.qk_rope_dim)
        w.add_value_length_mla(p.head_dim)
        w.add_kv_lora_rank(p.kv_lora_rank)
        if p.q_lora_rank:
            w.add_q_lora_rank(p.q_lora_rank)
        w.add_rope_dimension_count(p.qk_rope_dim)
        w.add_ssm_conv_kernel(p.ssm_conv_kernel)
        w.add_kda_head_dim(p.ssm_state)
        w.add_bool(f"{arch}.kda.safe_gate", True)
        w.add_float32(f"{arch}.kda.gate_lower_bound", -5.0)
        w.add_leading_dense_block_count(p.n_dense_lead)
        w.add_expert_shared_feed_forward_length(p.n_ff_exp * p.n_expert_shared)
        w.add_expert_shared_count(p.n_expert_shared)
        w.add_expert_weights_scale(p.expert_weights_scale)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(p.expert_groups)
        w.add_expert_group_used_count(p.expert_groups_used)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        """[BPE ... | [PADn] ... | Ling's specials | [PADn] ...]: byte-level BPE on llama.cpp's
        "bailingmoe2" split; the specials at Ling's ids in the real vocab size, right after
        the BPE otherwise. Replies end with <|role_end|>; prompts get no BOS."""
        bpe, merges = train_byte_level(BAILINGMOE2_REGEX, n_bpe)
        _check_fits("bailingmoe3", size, len(bpe), len(_SPECIALS))
        at = _REAL["first_special"] if size == _REAL["vocab"] else len(bpe)
        tokens, types = _fill(size, bpe, _SPECIALS, at, lambda i: f"[PAD{i}]")
        return Vocab(
            model="gpt2",
            pre="bailingmoe2",
            regex=BAILINGMOE2_REGEX,
            tokens=tuple(tokens),
            types=tuple(types),
            merges=merges,
            bos=at,
            eos=at + 4,
            pad=at + 1,
            unk=None,
            add_bos=False,
            add_eos=False,
        )


PLAN = BailingMoe3Plan()
