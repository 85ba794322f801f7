"""make-model's deepseek4 (DeepSeek-V4) plan: presets, tensors, metadata, vocabulary.

Tensor names, order and keys as llama.cpp's loader reads them (docs/models.md § deepseek4):
the output head's hyper-connection (output_hc_fn/base/scale) after `output`; per layer
attention (attn_q_a → norm → attn_q_b, attn_kv + norm, sinks, the grouped output
attn_output_a/b), the two hyper-connections, the compressor on a compressing layer and
the indexer on a CSA layer, then the router with a hash layer's I32 token → experts
table or the selection bias, the routed experts and the shared expert.

Layers 0..sliding_lead-1 attend in their window only; after them CSA (ratio 4) and HCA
(`hca_ratio`, llama.cpp loads only 128) alternate, CSA first (DeepSeek-V4-Flash's
compress_ratios). The vocabulary is a byte-level BPE on "deepseek-v3"'s split with
DeepSeek's specials first (BOS 0, EOS 1) and the chat roles after them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType

from ...gguf.vocab import CONTROL, NORMAL, UNUSED, Vocab, corpus_lines
from ...makemodel.part import MakeVector, MakeWeight, PlanPart, TensorSpec, stacked_experts
from ...makemodel.presets import Preset, RouterShape
from ...text.tokenizer import DEEPSEEK_V3_REGEXES
from .spec import CSA_RATIO, SQRT_SOFTPLUS

BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER, ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
SPECIALS = (BOS, EOS, USER, ASSISTANT)


@dataclass(frozen=True)
class V4Preset(Preset):
    """A preset with DeepSeek-V4's own shape beside the shared fields (head_dim is the kv
    head's width, qk_rope_dim its rotated tail, q_lora_rank the query's low rank)."""

    o_groups: int = 1
    o_lora_rank: int = 0
    sliding_lead: int = 0  # leading layers without compression
    hca_ratio: int = 128
    index_heads: int = 0
    index_head_dim: int = 0
    index_top_k: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hash_layers: int = 0
    compress_rope_base: float = 160000.0
    swiglu_limit: float = 10.0
    # the checkpoint's num_nextn_predict_layers (DeepSeek-V4's 1): llama.cpp's converter writes
    # the count and a compress_ratios entry for each MTP layer, but none of their tensors
    mtp_layers: int = 1

    def ratio(self, i: int) -> int:
        """Layer i's compression: 0, then CSA and HCA in turn."""
        if i < self.sliding_lead:
            return 0
        return CSA_RATIO if (i - self.sliding_lead) % 2 == 0 else self.hca_ratio


@lru_cache(maxsize=4)
def _train(n_bpe: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens by id, merges) of a byte-level BPE trained on the corpus, pre-split by
    "deepseek-v3"'s regexes one after another, as llama.cpp runs them."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in DEEPSEEK_V3_REGEXES]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    model = json.loads(tok.to_str())["model"]
    ids: dict[str, int] = model["vocab"]
    merges = tuple(m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"])
    return tuple(sorted(ids, key=ids.__getitem__)), merges


_TINY = dict(
    n_head_kv=1,
    rms_eps=1e-6,
    rope_base=10000.0,
    n_ff=0,
    n_expert_shared=1,
    expert_weights_scale=1.5,
    hc_mult=4,
)

# make-model presets: tiny, small and the real model's shape
PRESETS: dict[str, V4Preset] = {
    # tiny and small: a sliding layer, then CSA and HCA in turn; a window of 8 and an indexer
    # keeping 2 entries, so a prompt of a dozen tokens passes the window and the indexer's top k
    "tiny": V4Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=4,
        head_dim=128,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=128,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        sliding_window=8,
        q_lora_rank=64,
        qk_rope_dim=64,
        o_groups=2,
        o_lora_rank=64,
        sliding_lead=1,
        index_heads=4,
        index_head_dim=64,
        index_top_k=2,
        hash_layers=1,
        **_TINY,  # type: ignore[arg-type]
    ),
    "small": V4Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=8,
        head_dim=256,
        n_expert=32,
        n_expert_used=6,
        n_ff_exp=512,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        sliding_window=32,
        q_lora_rank=256,
        qk_rope_dim=64,
        o_groups=4,
        o_lora_rank=256,
        sliding_lead=2,
        index_heads=8,
        index_head_dim=128,
        index_top_k=16,
        hash_layers=2,
        **_TINY,  # type: ignore[arg-type]
    ),
    # DeepSeek-V4-Flash (deepseek-ai's config.json): 43 layers (two sliding, then CSA/HCA by
    # 4/128), 4096 wide, 64 heads sharing one 512-wide kv head (64 rope dims), q_lora 1024,
    # 8 output groups of 1024, 256 experts top-6 of 2048 + 1 shared, the first 3 hash-routed,
    # a 64-head indexer of 128 keeping 512, window 128, 4 streams, YaRN ×16 over 65536.
    "deepseek-v4-flash-shape": V4Preset(
        "deepseek-v4-flash-shape",
        n_layer=43,
        n_embd=4096,
        n_head=64,
        head_dim=512,
        n_expert=256,
        n_expert_used=6,
        n_ff_exp=2048,
        vocab_size=129280,
        n_bpe=4096,
        context_length=1048576,
        sliding_window=128,
        yarn_factor=16.0,
        yarn_orig_ctx=65536,
        q_lora_rank=1024,
        qk_rope_dim=64,
        o_groups=8,
        o_lora_rank=1024,
        sliding_lead=2,
        index_heads=64,
        index_head_dim=128,
        index_top_k=512,
        hash_layers=3,
        **_TINY,  # type: ignore[arg-type]
    ),
}


def _v4(p: Preset) -> V4Preset:
    if not isinstance(p, V4Preset):
        raise TypeError(f"deepseek4 needs a V4Preset, not {type(p).__name__}")
    return p


class DeepSeek4Plan(PlanPart):
    presets = PRESETS
    width_keys = ("expert_feed_forward_length",)  # V4's config has no intermediate_size
    mix_name = "Q4_K experts, Q8_0 attention, F16 HC"
    # not calibrated (no DeepSeek-V4 trace): sqrt-softplus scores, qwen3moe's spread and depth rule
    router = RouterShape(logit_std=5.0, depth_exp=0.4)

    def head_tensors(self, p: Preset) -> list[TensorSpec]:
        """The output head's hyper-connection; llama.cpp reads it by name, so where it sits in the
        file is free: here, before the final norm."""
        v, D = _v4(p), p.n_embd
        n = v.hc_mult
        return [
            TensorSpec("output_hc_fn.weight", (n, n * D), Q.F32, "weight", 1.0 / (n * D) ** 0.5),
            TensorSpec("output_hc_base.weight", (n,), Q.F32, "bias"),
            TensorSpec("output_hc_scale.weight", (1,), Q.F32, "scale"),
        ]

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        v = _v4(p)
        b, D, H, d, ql, X = f"blk.{i}.", p.n_embd, p.n_head, p.head_dim, p.q_lora_rank, p.n_expert
        G, r, n = v.o_groups, v.o_lora_rank, v.hc_mult
        mix = (2 + n) * n
        out = [
            F(b + "attn_norm.weight", (D,), "norm"),
            F(b + "attn_sinks.weight", (H,), "sinks"),
            W(b + "attn_q_a.weight", (ql, D), "attn_q_a", i),
            F(b + "attn_q_a_norm.weight", (ql,), "norm"),
            W(b + "attn_q_b.weight", (H * d, ql), "attn_q_b", i),
            W(b + "attn_kv.weight", (d, D), "attn_kv", i),
            F(b + "attn_kv_a_norm.weight", (d,), "norm"),
            W(b + "attn_output_a.weight", (G * r, H * d // G), "attn_output", i),
            W(b + "attn_output_b.weight", (D, G * r), "attn_output", i),
        ]
        for part in ("attn", "ffn"):
            out += [
                W(b + f"hc_{part}_fn.weight", (mix, n * D), "hc", i),
                F(b + f"hc_{part}_base.weight", (mix,), "bias"),
                F(b + f"hc_{part}_scale.weight", (3,), "scale"),
            ]
        ratio = v.ratio(i)
        if ratio:
            out += self._compressor(b + "attn_compressor_", (2 if ratio == CSA_RATIO else 1) * d, ratio, d, D, i, W, F)
        if ratio == CSA_RATIO:
            iw = v.index_head_dim
            out += [
                W(b + "indexer.proj.weight", (v.index_heads, D), "indexer", i),
                W(b + "indexer.attn_q_b.weight", (v.index_heads * iw, ql), "indexer", i),
                *self._compressor(b + "indexer_compressor_", 2 * iw, ratio, iw, D, i, W, F),
            ]
        out.append(F(b + "ffn_gate_inp.weight", (X, D), "router"))
        if i < v.hash_layers:
            out.append(TensorSpec(b + "ffn_gate_tid2eid.weight", (p.vocab_size, p.n_expert_used), Q.I32, "expert_ids", float(X)))
        else:
            out.append(F(b + "exp_probs_b.bias", (X,), "bias"))
        Fe = p.n_ff_exp
        return out + [
            F(b + "ffn_norm.weight", (D,), "norm"),
            *stacked_experts(W, b, p, i),
            W(b + "ffn_gate_shexp.weight", (Fe, D), "ffn_gate_shexp", i),
            W(b + "ffn_down_shexp.weight", (D, Fe), "ffn_down_shexp", i),
            W(b + "ffn_up_shexp.weight", (Fe, D), "ffn_up_shexp", i),
        ]

    @staticmethod
    def _compressor(b: str, width: int, ratio: int, norm: int, D: int, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        return [
            W(b + "kv.weight", (width, D), "compressor", i),
            W(b + "gate.weight", (width, D), "compressor", i),
            F(b + "ape.weight", (ratio, width), "bias"),
            F(b + "norm.weight", (norm,), "norm"),
        ]

    def mix(self, role: str, layer: int, n_layer: int, v_index: int, n_v: int) -> Q:
        """The published DeepSeek-V4-Flash q4 file's mix (antirez/deepseek-v4-gguf,
        ...-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-...; from its model
        card, not a load log): routed experts Q4_K; attention projections, the shared expert and
        the output head Q8_0; embedding, hyper-connections, compressors and indexer F16. Its
        router and output hyper-connection are F16 too; ours stay F32."""
        if role.endswith("_exps"):
            return Q.Q4_K
        if role in ("embd", "hc", "compressor", "indexer"):
            return Q.F16
        return Q.Q8_0

    def attention_metadata(self, w: GGUFWriter, p: Preset, nextn: int = 0) -> None:
        """One kv head of head_dim, key and value alike."""
        w.add_head_count_kv(1)
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        """The deepseek4 keys, as llama.cpp's converter writes them (DeepseekV4Model)."""
        v, a = _v4(p), "deepseek4."
        w.add_vocab_size(p.vocab_size)
        w.add_q_lora_rank(p.q_lora_rank)
        w.add_rope_dimension_count(p.qk_rope_dim)
        if p.yarn_factor:  # the compressing layers' rope (llama.cpp scales no other)
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(p.yarn_factor)
            w.add_rope_scaling_orig_ctx_len(p.yarn_orig_ctx)
        w.add_uint32(a + "attention.output_lora_rank", v.o_lora_rank)
        w.add_uint32(a + "attention.output_group_count", v.o_groups)
        # the MTP layers' entries last (0: DeepSeek-V4-Flash's), as DeepSeek's config lists them
        w.add_array(a + "attention.compress_ratios", [v.ratio(i) for i in range(p.n_layer)] + [0] * v.mtp_layers)
        w.add_float32(a + "attention.compress_rope_freq_base", v.compress_rope_base)
        w.add_sliding_window(p.sliding_window)
        w.add_expert_shared_count(p.n_expert_shared)
        w.add_expert_weights_scale(p.expert_weights_scale)
        w.add_expert_weights_norm(True)
        w.add_uint32(a + "expert_gating_func", SQRT_SOFTPLUS)
        w.add_uint32(a + "hash_layer_count", min(v.hash_layers, p.n_layer))
        w.add_array(a + "swiglu_clamp_exp", [v.swiglu_limit] * p.n_layer)
        w.add_uint32(a + "attention.indexer.head_count", v.index_heads)
        w.add_uint32(a + "attention.indexer.key_length", v.index_head_dim)
        w.add_uint32(a + "attention.indexer.top_k", v.index_top_k)
        w.add_uint32(a + "hyper_connection.count", v.hc_mult)
        w.add_uint32(a + "hyper_connection.sinkhorn_iterations", v.hc_sinkhorn_iters)
        w.add_float32(a + "hyper_connection.epsilon", v.hc_eps)
        # as llama.cpp's converter: the count without the block; its loader and shared/families/
        # deepseek4/spec.py count MTP blocks only when blk.{n}.nextn.eh_proj is there
        w.add_nextn_predict_layers(v.mtp_layers)

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        """[bos, eos, <｜User｜>, <｜Assistant｜> | BPE ... | [PADn] ...]: byte-level BPE on
        "deepseek-v3"'s split, DeepSeek's specials first (bos 0, eos 1 as in V3/V4). Every
        prompt starts with the bos; a reply ends with eos."""
        bpe, merges = _train(n_bpe)
        k = len(SPECIALS)
        if k + len(bpe) > size:
            raise ValueError(f"deepseek4: vocab size {size} cannot hold {k} specials + {len(bpe)} BPE tokens")
        tokens = [*SPECIALS, *bpe, *(f"[PAD{i}]" for i in range(k + len(bpe), size))]
        types = [CONTROL] * k + [NORMAL] * len(bpe) + [UNUSED] * (size - k - len(bpe))
        return Vocab(
            model="gpt2",
            pre="deepseek-v3",
            regex=DEEPSEEK_V3_REGEXES[2],  # the words' split only: several regexes run in turn (text/tokenizer.py PRE_SPLITS)
            tokens=tuple(tokens),
            types=tuple(types),
            merges=merges,
            bos=0,
            eos=1,
            pad=1,
            unk=None,
            add_bos=True,
        )


PLAN = DeepSeek4Plan()
