"""make-model's deepseek2 (DeepSeek-V2 / V2-Lite / V3) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's converter writes them
(docs/models.md § deepseek2): multi-head latent attention with `kv_b_proj`
already split into attn_k_b [H, r, nope] and attn_v_b [H, v, r]; plain attn_q
when q_lora_rank is 0 (V2-Lite), else attn_q_a → norm → attn_q_b; the leading
dense layers carry ffn_gate/up/down (n_ff wide), the others the router, the
routed experts and the shared experts (n_ff_exp × n_expert_shared wide).
Made files have no correction bias (`exp_probs_b`) unless the preset routes
by sigmoid (V3), as llama.cpp's converter writes them. The vocabulary is a
byte-level BPE on "deepseek-llm"'s split with V2's two specials at their real ids.
"""

from __future__ import annotations

import json
from functools import lru_cache

from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType

from ...gguf.vocab import CONTROL, NORMAL, UNUSED, Vocab, corpus_lines
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape
from ...text.tokenizer import DEEPSEEK_LLM_REGEXES

# DeepSeek-V2's two specials, at their real ids (100000, 100001) in a 102400-token vocab.
BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
_REAL = {"vocab": 102400, "first_special": 100000}


@lru_cache(maxsize=4)
def _train(n_bpe: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens by id, merges) of a byte-level BPE trained on the corpus, pre-split by
    "deepseek-llm"'s regexes one after another (each splits the pieces the last one left),
    as llama.cpp runs them. Deterministic, like gguf/vocab.py's train_byte_level."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in DEEPSEEK_LLM_REGEXES]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    model = json.loads(tok.to_str())["model"]
    ids: dict[str, int] = model["vocab"]
    merges = tuple(m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"])
    return tuple(sorted(ids, key=ids.__getitem__)), merges


# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, Preset] = {
    # All three in DeepSeek-V2-Lite's form: q_lora_rank 0 (plain attn_q), one leading dense
    # layer, 2 shared experts, softmax top-k never renormalized, routed scale 1.0. tiny and
    # small have 16 experts, not 8: llama.cpp's quantizer gives 8-expert models other attention types.
    "tiny": Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=1,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=128,
        n_ff=512,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-6,
        rope_base=10000.0,
        n_dense_lead=1,
        n_expert_shared=2,
        kv_lora_rank=128,
        qk_nope_dim=64,
        qk_rope_dim=32,
    ),
    "small": Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=8,
        n_head_kv=1,
        head_dim=128,
        n_expert=32,
        n_expert_used=6,
        n_ff_exp=512,
        n_ff=4096,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=10000.0,
        n_dense_lead=1,
        n_expert_shared=2,
        kv_lora_rank=256,
        qk_nope_dim=128,
        qk_rope_dim=64,
    ),
    # DeepSeek-V2-Lite (and -Chat; deepseek-ai's config.json): 27 layers, layer 0 dense
    # (10944 wide), 64 experts top-6 of 1408, 2 shared, 16 heads of 128 nope + 64 rope
    # (values 128), kv_lora_rank 512, no q_lora, YaRN ×40 over 4096 (mscale_all_dim 0.707).
    "deepseek-v2-lite-shape": Preset(
        "deepseek-v2-lite-shape",
        n_layer=27,
        n_embd=2048,
        n_head=16,
        n_head_kv=1,
        head_dim=128,
        n_expert=64,
        n_expert_used=6,
        n_ff_exp=1408,
        n_ff=10944,
        vocab_size=102400,
        n_bpe=4096,
        context_length=163840,
        rms_eps=1e-6,
        rope_base=10000.0,
        yarn_factor=40.0,
        yarn_orig_ctx=4096,
        yarn_log_mul=0.0707,
        n_dense_lead=1,
        n_expert_shared=2,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
    ),
}


class DeepSeek2Plan(PlanPart):
    presets = PRESETS
    router = RouterShape(
        logit_std=5.0, depth_exp=0.4
    )  # not calibrated (no DeepSeek trace): softmax gates as qwen3moe's, its sharpness and depth rule

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        b, D, X, Fe, H = f"blk.{i}.", p.n_embd, p.n_expert, p.n_ff_exp, p.n_head
        r, rope, nope, v, ql = p.kv_lora_rank, p.qk_rope_dim, p.qk_nope_dim, p.head_dim, p.q_lora_rank
        qk = nope + rope
        out = [F(b + "attn_norm.weight", (D,), "norm")]
        if ql:
            out += [
                W(b + "attn_q_a.weight", (ql, D), "attn_q_a", i),
                F(b + "attn_q_a_norm.weight", (ql,), "norm"),
                W(b + "attn_q_b.weight", (H * qk, ql), "attn_q_b", i),
            ]
        else:
            out.append(W(b + "attn_q.weight", (H * qk, D), "attn_q", i))
        out += [
            W(b + "attn_kv_a_mqa.weight", (r + rope, D), "attn_kv_a_mqa", i),
            F(b + "attn_kv_a_norm.weight", (r,), "norm"),
            W(b + "attn_k_b.weight", (H, r, nope), "attn_k_b", i),  # H r nope: q_nope absorbed into the latent
            W(b + "attn_v_b.weight", (H, v, r), "attn_v_b", i),  # H v r: the latent back to each head's values
            W(b + "attn_output.weight", (D, H * v), "attn_output", i),
            F(b + "ffn_norm.weight", (D,), "norm"),
        ]
        if i < p.n_dense_lead:
            return out + [
                W(b + "ffn_gate.weight", (p.n_ff, D), "ffn_gate", i),  # Fd D
                W(b + "ffn_up.weight", (p.n_ff, D), "ffn_up", i),  # Fd D
                W(b + "ffn_down.weight", (D, p.n_ff), "ffn_down", i),  # D Fd
            ]
        out.append(F(b + "ffn_gate_inp.weight", (X, D), "router"))
        if p.expert_gating_sigmoid:  # V3: the selection bias (a small random spread, as glm4moe's)
            out.append(F(b + "exp_probs_b.bias", (X,), "bias"))
        out += [
            *stacked_experts(W, b, p, i),
        ]
        if p.n_expert_shared:
            fs = Fe * p.n_expert_shared
            out += [
                W(b + "ffn_gate_shexp.weight", (fs, D), "ffn_gate_shexp", i),
                W(b + "ffn_up_shexp.weight", (fs, D), "ffn_up_shexp", i),
                W(b + "ffn_down_shexp.weight", (D, fs), "ffn_down_shexp", i),
            ]
        return out

    def attention_metadata(self, w: GGUFWriter, p: Preset, nextn: int = 0) -> None:
        """MLA as one cached head: K = the latent and the rope part, V = the latent."""
        w.add_head_count_kv(1)
        w.add_key_length(p.kv_lora_rank + p.qk_rope_dim)
        w.add_value_length(p.kv_lora_rank)

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        """The deepseek2 keys beyond every family's (maker._add_metadata writes those) and
        its attention's (`attention_metadata`)."""
        w.add_vocab_size(p.vocab_size)
        w.add_key_length_mla(p.qk_nope_dim + p.qk_rope_dim)
        w.add_value_length_mla(p.head_dim)
        w.add_kv_lora_rank(p.kv_lora_rank)
        # Written even when 0 (V2-Lite), where llama.cpp's converter writes no key: llama.cpp
        # 0.3.36 reads a file without it as V2-Lite only at 26 or 27 layers, so a made file cut
        # to fewer layers would not load there; with the key it does at any depth.
        w.add_q_lora_rank(p.q_lora_rank)
        w.add_rope_dimension_count(p.qk_rope_dim)
        w.add_leading_dense_block_count(p.n_dense_lead)
        w.add_expert_shared_count(p.n_expert_shared)
        w.add_expert_weights_scale(p.expert_weights_scale)
        if p.expert_gating_sigmoid:  # V3: sigmoid scores renormalized over the chosen (V2: softmax, never renormalized)
            w.add_expert_weights_norm(True)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if p.expert_gating_sigmoid else ExpertGatingFuncType.SOFTMAX)
        w.add_expert_group_count(p.expert_groups)
        w.add_expert_group_used_count(p.expert_groups_used)
        if p.yarn_factor:  # V2-Lite: YaRN, its magnitude term on the score (model.py beside this module)
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(p.yarn_factor)
            w.add_rope_scaling_orig_ctx_len(p.yarn_orig_ctx)
            # V2-Lite's rope_scaling has beta_fast 32 and beta_slow 1, which llama.cpp's converter writes
            w.add_rope_scaling_yarn_beta_fast(32.0)
            w.add_rope_scaling_yarn_beta_slow(1.0)
            w.add_rope_scaling_yarn_log_mul(p.yarn_log_mul)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        """[BPE ... | [PADn] ... | bos, eos | [PADn] ...]: byte-level BPE on "deepseek-llm"'s split;
        the specials at their real ids in the real vocab size, right after the BPE otherwise.
        Every prompt starts with the bos (add_bos_token, as DeepSeek's GGUFs say); a reply ends with eos."""
        bpe, merges = _train(n_bpe)
        at = _REAL["first_special"] if size == _REAL["vocab"] else len(bpe)
        if at + 2 > size:
            raise ValueError(f"deepseek2: vocab size {size} cannot hold {len(bpe)} BPE tokens + 2 specials")
        tokens = [*bpe, *(f"[PAD{i}]" for i in range(len(bpe), at)), BOS, EOS, *(f"[PAD{i}]" for i in range(at + 2, size))]
        types = [NORMAL] * len(bpe) + [UNUSED] * (at - len(bpe)) + [CONTROL, CONTROL] + [UNUSED] * (size - at - 2)
        return Vocab(
            model="gpt2",
            pre="deepseek-llm",
            regex=DEEPSEEK_LLM_REGEXES[1],  # the letters' split only: several regexes run in turn (text/tokenizer.py PRE_SPLITS)
            tokens=tuple(tokens),
            types=tuple(types),
            merges=merges,
            bos=at,
            eos=at + 1,
            pad=at + 1,
            unk=None,
            add_bos=True,
        )


PLAN = DeepSeek2Plan()
