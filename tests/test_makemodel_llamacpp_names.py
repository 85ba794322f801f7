"""make-model writes the metadata keys and tensor names llama.cpp's converter writes.

For each family, the `<arch>.*` keys and the tensor names below are what llama.cpp's
current convert_hf_to_gguf.py (ggml-org/llama.cpp, read 2026-12: `TextModel.set_gguf_parameters`
and each family's class, named per entry) writes for a checkpoint shaped like the family's
tiny preset; a key comes from the HF config field named beside it. The tensor names are
the converter's mapping of that checkpoint's tensors (gguf-py `tensor_mapping.py`); every
one must also be a name gguf-py's `MODEL_TENSORS` lists for the arch (the installed gguf-py
is llama.cpp's; for an arch it predates, the list in `LOADER_NAMES`, cited there), and a
tensor-name format the installed libllama knows. A made file that lacks a key or a name
llama.cpp writes, or has one it does not, fails (docs/models.md, each family's make-model
paragraph). Every family in the registry has an entry.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

from moe_pipe.shared.family_registry import FAMILIES
from moe_pipe.shared.gguf.reader import GGUFFile
from moe_pipe.shared.makemodel.maker import make_model

# TextModel.set_gguf_parameters, for every family: block_count (num_hidden_layers),
# context_length (max_position_embeddings), embedding_length (hidden_size),
# attention.head_count / head_count_kv, rope.freq_base (rope_theta),
# attention.layer_norm_rms_epsilon (rms_norm_eps | norm_eps), expert_count
# (num_local_experts | num_experts), expert_used_count (num_experts_per_tok | top_k_experts).
_COMMON = {
    "block_count",
    "context_length",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "expert_count",
    "expert_used_count",
}
_FF = {"feed_forward_length"}  # TextModel: intermediate_size, where the config has it
_HEAD_DIM = {"attention.key_length", "attention.value_length"}  # TextModel: head_dim, where the config has it

KEYS: dict[str, set[str]] = {
    # Qwen3MoeModel(Qwen2MoeModel): + expert_feed_forward_length (moe_intermediate_size); Qwen3 configs carry head_dim
    "qwen3moe": _COMMON | _FF | _HEAD_DIM | {"expert_feed_forward_length"},
    # GptOssModel: + attention.sliding_window, expert_feed_forward_length (intermediate_size);
    # TextModel's YaRN branch: rope.scaling.type / factor / original_context_length, yarn_beta_fast / _slow
    "gpt-oss": _COMMON
    | _FF
    | _HEAD_DIM
    | {
        "attention.sliding_window",
        "expert_feed_forward_length",
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scaling.original_context_length",
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
    },
    # Gemma4Model(Gemma3Model): Gemma3 adds attention.sliding_window, final_logit_softcapping; TextModel
    # rope.freq_base_swa (the sliding layers' rope_theta); Gemma4 the _swa head widths, rope dims of both
    # kinds, sliding_window_pattern, shared_kv_layers, embedding_length_per_layer_input, expert_feed_forward_length
    "gemma4": _COMMON
    | _FF
    | _HEAD_DIM
    | {
        "attention.key_length_swa",
        "attention.value_length_swa",
        "rope.dimension_count",
        "rope.dimension_count_swa",
        "rope.freq_base_swa",
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "attention.shared_kv_layers",
        "embedding_length_per_layer_input",
        "final_logit_softcapping",
        "expert_feed_forward_length",
    },
    # Qwen3_5MoeTextModel (_Qwen35MtpMixin, _Qwen35MRopeMixin, Qwen3NextModel, Qwen2MoeModel): no
    # intermediate_size in the config (no feed_forward_length); head_dim; rope.dimension_sections (mrope);
    # expert_feed_forward_length, expert_shared_feed_forward_length; ssm.*, full_attention_interval,
    # rope.dimension_count (head_dim × partial_rotary_factor). nextn_predict_layers only with the MTP block.
    "qwen35moe": _COMMON
    | _HEAD_DIM
    | {
        "rope.dimension_sections",
        "rope.dimension_count",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
        "full_attention_interval",
        "ssm.conv_kernel",
        "ssm.state_size",
        "ssm.group_count",
        "ssm.time_step_rank",
        "ssm.inner_size",
    },
    # LlamaModel (Mixtral): + vocab_size, rope.dimension_count; Mixtral's config has neither
    # head_dim nor moe_intermediate_size (the experts are feed_forward_length wide)
    "llama": _COMMON | _FF | {"vocab_size", "rope.dimension_count"},
    # Glm4MoeModel: head_dim; rope.dimension_count, expert_feed_forward_length, expert_shared_count,
    # leading_dense_block_count, expert_gating_func (sigmoid), expert_weights_scale, expert_weights_norm,
    # nextn_predict_layers; TextModel: expert_group_count / _used_count (n_group, topk_group)
    "glm4moe": _COMMON
    | _FF
    | _HEAD_DIM
    | {
        "rope.dimension_count",
        "expert_feed_forward_length",
        "expert_shared_count",
        "leading_dense_block_count",
        "expert_gating_func",
        "expert_weights_scale",
        "expert_weights_norm",
        "expert_group_count",
        "expert_group_used_count",
        "nextn_predict_layers",
    },
    # LFM2MoeModel: per-layer head_count_kv; + expert_feed_forward_length, leading_dense_block_count,
    # expert_gating_func, vocab_size, shortconv.l_cache; no head_dim in LFM2's config
    "lfm2moe": _COMMON
    | _FF
    | {"expert_feed_forward_length", "leading_dense_block_count", "expert_gating_func", "vocab_size", "shortconv.l_cache"},
    # DeepseekV2Model (V2-Lite's config): vocab_size, kv_lora_rank, key_length (= kv_lora + rope),
    # value_length, key_length_mla, value_length_mla, expert_feed_forward_length, expert_count,
    # expert_shared_count, expert_weights_scale (routed_scaling_factor), rope.dimension_count,
    # leading_dense_block_count; TextModel: expert_group_count / _used_count (n_group, topk_group),
    # expert_gating_func (scoring_func). q_lora_rank only when the config has one (V2-Lite's is null).
    "deepseek2": _COMMON
    | _FF
    | _HEAD_DIM
    | {
        "vocab_size",
        "attention.kv_lora_rank",
        "attention.key_length_mla",
        "attention.value_length_mla",
        "expert_feed_forward_length",
        "expert_shared_count",
        "expert_weights_scale",
        "rope.dimension_count",
        "leading_dense_block_count",
        "expert_group_count",
        "expert_group_used_count",
        "expert_gating_func",
    },
    # Qwen2MoeModel: expert_feed_forward_length, expert_shared_feed_forward_length; Qwen1.5-MoE's config has no head_dim
    "qwen2moe": _COMMON | _FF | {"expert_feed_forward_length", "expert_shared_feed_forward_length"},
    # BailingMoeV3Model (conversion/bailingmoe3.py; read from copies in forks of ggml-org/llama.cpp,
    # zsogitbe/llama.cpp@3733366 and despc/llama.cpp@3f3d889, which agree on these): head_count_kv per
    # layer; vocab_size, ssm.conv_kernel (short_conv_kernel_size), kda.head_dim (head_dim), kda.safe_gate,
    # kda.gate_lower_bound (kda_lower_bound), kv_lora_rank, rope.dimension_count (qk_rope_head_dim),
    # key_length (kv_lora_rank + rope, over TextModel's head_dim), key_length_mla, value_length_mla,
    # expert_feed_forward_length, expert_shared_feed_forward_length, expert_shared_count,
    # leading_dense_block_count, expert_weights_scale, expert_weights_norm; TextModel: feed_forward_length
    # (intermediate_size), value_length (head_dim), expert_group_count / _used_count (n_group, topk_group),
    # expert_gating_func (score_function sigmoid). q_lora_rank only when the config has one (the tiny
    # preset's MLA has none); swiglu_clamp_* only from Ling's expert_swiglu_limit_list;
    # nextn_predict_layers only with the MTP block (num_nextn_predict_layers, which the tiny preset lacks).
    "bailingmoe3": _COMMON
    | _FF
    | _HEAD_DIM
    | {
        "vocab_size",
        "ssm.conv_kernel",
        "kda.head_dim",
        "kda.safe_gate",
        "kda.gate_lower_bound",
        "attention.kv_lora_rank",
        "rope.dimension_count",
        "attention.key_length_mla",
        "attention.value_length_mla",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
        "expert_shared_count",
        "leading_dense_block_count",
        "expert_weights_scale",
        "expert_weights_norm",
        "expert_group_count",
        "expert_group_used_count",
        "expert_gating_func",
    },
    # DeepseekV4Model (ggml-org/llama.cpp conversion/deepseek.py @01a723d), from DeepSeek's own
    # config.json: vocab_size, rope.dimension_count (qk_rope_head_dim), q_lora_rank, output_lora_rank,
    # output_group_count, compress_ratios, compress_rope_freq_base, expert_feed_forward_length,
    # expert_shared_count, expert_weights_scale, hash_layer_count, expert_weights_norm, swiglu_clamp_exp
    # (swiglu_limit), sliding_window, indexer head_count / key_length / top_k, nextn_predict_layers
    # (num_nextn_predict_layers: written although the MTP tensors are skipped), hyper_connection
    # count / sinkhorn_iterations / epsilon; TextModel: head_dim, expert_gating_func (sqrtsoftplus).
    # V4's config has no intermediate_size (no feed_forward_length) and no n_group.
    "deepseek4": _COMMON
    | _HEAD_DIM
    | {
        "vocab_size",
        "rope.dimension_count",
        "attention.q_lora_rank",
        "attention.output_lora_rank",
        "attention.output_group_count",
        "attention.compress_ratios",
        "attention.compress_rope_freq_base",
        "expert_feed_forward_length",
        "expert_shared_count",
        "expert_weights_scale",
        "hash_layer_count",
        "expert_weights_norm",
        "swiglu_clamp_exp",
        "attention.sliding_window",
        "attention.indexer.head_count",
        "attention.indexer.key_length",
        "attention.indexer.top_k",
        "nextn_predict_layers",
        "hyper_connection.count",
        "hyper_connection.sinkhorn_iterations",
        "hyper_connection.epsilon",
        "expert_gating_func",
    },
}

# Where make-model departs on purpose (docs/models.md says why).
DEPARTURES: dict[str, set[str]] = {
    # made files write q_lora_rank 0, so that llama.cpp 0.3.36 loads them cut to any depth (docs/models.md § deepseek2)
    "deepseek2": {"attention.q_lora_rank"},
}

_ATTN = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"}
_EXPERTS = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
_SHEXP = {"ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
_DENSE = {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
_HEAD = {"token_embd.weight", "output_norm.weight", "output.weight"}
_QK_NORM = {"attn_q_norm.weight", "attn_k_norm.weight"}
_QKV_BIAS = {"attn_q.bias", "attn_k.bias", "attn_v.bias"}

# The names the converter writes: outside the layers, and in the layers (blk.N.*), for the tiny
# preset's checkpoint (its kinds of layer together).
TENSORS: dict[str, tuple[set[str], set[str]]] = {
    "qwen3moe": (_HEAD, _ATTN | _QK_NORM | _EXPERTS | {"ffn_norm.weight"}),
    "gpt-oss": (
        _HEAD,
        _ATTN
        | _QKV_BIAS
        | _EXPERTS
        | {"attn_output.bias", "attn_sinks.weight", "post_attention_norm.weight", "ffn_gate_inp.bias"}
        | {"ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"},
    ),
    # the head tied to token_embd; rope_freqs from generate_extra_tensors (the full layers' proportional rope)
    "gemma4": (
        {"token_embd.weight", "output_norm.weight", "rope_freqs.weight"},
        _ATTN
        | _QK_NORM
        | _DENSE
        | {"ffn_gate_inp.weight", "ffn_gate_inp.scale", "ffn_gate_up_exps.weight", "ffn_down_exps.weight", "ffn_down_exps.scale"}
        | {"ffn_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight", "post_ffw_norm_1.weight"}
        | {"pre_ffw_norm_2.weight", "post_ffw_norm_2.weight", "layer_output_scale.weight"},
    ),
    "qwen35moe": (
        _HEAD,
        _ATTN
        | _QK_NORM
        | _EXPERTS
        | _SHEXP
        | {"ffn_gate_inp_shexp.weight", "post_attention_norm.weight", "attn_qkv.weight", "attn_gate.weight"}
        | {"ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight"},
    ),
    "llama": (_HEAD, _ATTN | _EXPERTS | {"ffn_norm.weight"}),
    "glm4moe": (_HEAD, _ATTN | _QKV_BIAS | _EXPERTS | _SHEXP | _DENSE | {"exp_probs_b.bias", "post_attention_norm.weight"}),
    # LFM2: the head tied to token_embd, token_embd_norm the final norm; short-conv layers without attention
    "lfm2moe": (
        {"token_embd.weight", "token_embd_norm.weight"},
        _ATTN
        | _QK_NORM
        | _EXPERTS
        | _DENSE
        | {"exp_probs_b.bias", "ffn_norm.weight", "shortconv.conv.weight", "shortconv.in_proj.weight", "shortconv.out_proj.weight"},
    ),
    "deepseek2": (
        _HEAD,
        {"attn_norm.weight", "attn_q.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight"}
        | {"attn_output.weight", "ffn_norm.weight"}
        | _EXPERTS
        | _SHEXP
        | _DENSE,
    ),
    "qwen2moe": (_HEAD, _ATTN | _QKV_BIAS | _EXPERTS | _SHEXP | {"ffn_gate_inp_shexp.weight", "ffn_norm.weight"}),
    # KDA layers (their own q/k/v convs, a = exp(A_log) as ssm_a, dt_bias as ssm_dt.bias) and gated MLA
    # layers (kv_b_proj split into attn_k_b / attn_v_b, g_proj as attn_gate); a leading dense layer
    "bailingmoe3": (
        _HEAD,
        {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_norm.weight"}
        | {"ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight", "ssm_f_a.weight", "ssm_dt.bias", "ssm_a"}
        | {"ssm_beta.weight", "ssm_g_a.weight", "ssm_norm.weight"}
        | {"attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight", "attn_gate.weight"}
        | _EXPERTS
        | _SHEXP
        | _DENSE
        | {"exp_probs_b.bias"},
    ),
    # DeepseekV4Model._map_tensor_name_deepseek4: the head's hyper-connection; per layer attention, two
    # hyper-connections, a compressing layer's compressor, a CSA layer's indexer, a hash layer's
    # tid2eid table (the others' exp_probs_b), routed and shared experts
    "deepseek4": (
        _HEAD | {"output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight"},
        {"attn_norm.weight", "attn_sinks.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"}
        | {"attn_kv.weight", "attn_kv_a_norm.weight", "attn_output_a.weight", "attn_output_b.weight"}
        | {f"hc_{part}_{t}.weight" for part in ("attn", "ffn") for t in ("fn", "base", "scale")}
        | {f"{c}_compressor_{t}.weight" for c in ("attn", "indexer") for t in ("kv", "gate", "ape", "norm")}
        | {"indexer.proj.weight", "indexer.attn_q_b.weight"}
        | {"ffn_gate_tid2eid.weight", "exp_probs_b.bias", "ffn_norm.weight"}
        | _EXPERTS
        | _SHEXP,
    ),
}

# The names llama.cpp knows for an arch newer than the installed gguf-py (0.19), which has no
# MODEL_TENSORS entry for it.
LOADER_NAMES: dict[str, set[str]] = {
    # gguf-py constants.py MODEL_TENSORS[DEEPSEEK4] with TENSOR_NAMES (ggml-org/llama.cpp @00395eb)
    "deepseek4": {"token_embd", "output_norm", "output", "output_hc_fn", "output_hc_base", "output_hc_scale"}
    | {
        f"blk.{{bid}}.{n}"
        for n in (
            "attn_norm attn_sinks attn_q_a attn_q_b attn_q_a_norm attn_kv attn_kv_a_norm attn_output_a attn_output_b"
            " hc_attn_fn hc_attn_base hc_attn_scale hc_ffn_fn hc_ffn_base hc_ffn_scale"
            " attn_compressor_kv attn_compressor_gate attn_compressor_ape attn_compressor_norm"
            " indexer.proj indexer.attn_q_b indexer_compressor_kv indexer_compressor_gate indexer_compressor_ape"
            " indexer_compressor_norm ffn_gate_inp ffn_gate_tid2eid exp_probs_b ffn_norm ffn_gate_exps ffn_down_exps"
            " ffn_up_exps ffn_gate_shexp ffn_down_shexp ffn_up_shexp nextn.eh_proj nextn.embed_tokens nextn.enorm"
            " nextn.hnorm nextn.shared_head_head nextn.shared_head_norm"
        ).split()
    },
    # the stored ggml-org constants.py has no BAILINGMOE3: the names its loader creates
    # (src/models/bailingmoe3.cpp load_arch_tensors, ggml-org/llama.cpp @38d3906)
    "bailingmoe3": {"token_embd", "output_norm", "output"}
    | {
        f"blk.{{bid}}.{n}"
        for n in (
            "attn_norm ssm_conv1d_q ssm_conv1d_k ssm_conv1d_v attn_q attn_k attn_v ssm_f_a ssm_beta ssm_a ssm_dt"
            " ssm_g_a ssm_norm attn_output attn_q_a attn_q_a_norm attn_q_b attn_kv_a_mqa attn_kv_a_norm attn_k_b"
            " attn_v_b attn_gate ffn_norm ffn_gate ffn_up ffn_down ffn_gate_inp exp_probs_b ffn_gate_exps"
            " ffn_up_exps ffn_down_exps ffn_gate_shexp ffn_up_shexp ffn_down_shexp nextn.eh_proj nextn.enorm"
            " nextn.hnorm layer_output_norm"
        ).split()
    },
}

# Every made file's tokenizer keys (SpecialVocab and the family's set_vocab write more where the
# tokenizer files have them), and by tokenizer.ggml.model the merges and scores: a byte-level BPE
# ("gpt2") has merges, a SentencePiece vocab ("llama") scores, gemma4 both (Gemma4Model.set_vocab:
# LlamaHfVocab's scores, SpecialVocab's merges). Departure: made gemma4 files also write
# tokenizer.ggml.pre ("gemma4"), which llama.cpp's converter leaves out and its loader forces.
_TOKENIZER = {"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
_TOKENIZER |= {"tokenizer.ggml.eos_token_id", "tokenizer.chat_template"}
_MERGES_SCORES = {"gpt2": (True, False), "llama": (False, True), "gemma4": (True, True)}


def test_every_family_has_an_entry():
    """A family added to the registry fails here until its keys and names are listed."""
    arches = {f.arch for f in FAMILIES}
    assert set(KEYS) == arches, f"no KEYS entry for {sorted(arches - set(KEYS))}"
    assert set(TENSORS) == arches, f"no TENSORS entry for {sorted(arches - set(TENSORS))}"


def _llama_cpp_names(arch: str) -> set[str]:
    """The tensor names ("blk.{bid}.attn_q", "token_embd") llama.cpp lists for the arch."""
    gguf_arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == arch), None)
    if gguf_arch is None:
        return LOADER_NAMES[arch]
    return {TENSOR_NAMES[t] for t in MODEL_TENSORS[gguf_arch]}


@lru_cache(maxsize=1)
def _libllama_strings() -> bytes | None:
    """The installed libllama's bytes, whose C strings hold the tensor-name formats it loads."""
    try:
        import llama_cpp
    except ImportError:
        return None
    lib = Path(llama_cpp.__file__).parent / "lib" / "libllama.so"
    return lib.read_bytes() if lib.is_file() else None


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("names")
    return lambda arch: make_model(arch, "tiny", d / f"{arch}.gguf", sparse=True)


@pytest.mark.parametrize("arch", sorted(KEYS))
def test_made_keys_are_llama_cpps(arch, made):
    with GGUFFile(made(arch)) as f:
        keys = {k.removeprefix(f"{arch}.") for k in f.fields if k.startswith(f"{arch}.")}
        tok = {k for k in f.fields if k.startswith("tokenizer.")}
        model = f.meta("tokenizer.ggml.model")
    want = KEYS[arch] | DEPARTURES.get(arch, set())
    assert keys == want, f"missing {sorted(want - keys)}, not llama.cpp's {sorted(keys - want)}"
    assert _TOKENIZER <= tok, sorted(_TOKENIZER - tok)
    assert ("tokenizer.ggml.merges" in tok, "tokenizer.ggml.scores" in tok) == _MERGES_SCORES[model]


def test_made_yarn_keys_are_llama_cpps(tmp_path):
    """deepseek-v2-lite-shape's YaRN as llama.cpp's converter writes V2-Lite's rope_scaling
    (type yarn, factor, original_max_position_embeddings, beta_fast, beta_slow, and
    DeepseekV2Model's yarn_log_multiplier = 0.1 × mscale_all_dim)."""
    path = make_model("deepseek2", "deepseek-v2-lite-shape", tmp_path / "s.gguf", sparse=True, layers=2, _overrides={"n_expert": 2})
    with GGUFFile(path) as f:
        rope = {k.removeprefix("deepseek2.") for k in f.fields if k.startswith("deepseek2.rope.scaling.")}
    want = {"type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow", "yarn_log_multiplier"}
    assert rope == {f"rope.scaling.{k}" for k in want}


@pytest.mark.parametrize("arch", sorted(TENSORS))
def test_made_tensor_names_are_llama_cpps(arch, made):
    with GGUFFile(made(arch)) as f:
        names = set(f.tensors)
        n_layer = f.meta(f"{arch}.block_count")
    top = {n for n in names if not n.startswith("blk.")}
    per_layer = {re.sub(r"^blk\.\d+\.", "", n) for n in names if n.startswith("blk.")}
    want_top, want_layer = TENSORS[arch]
    assert top == want_top, f"missing {sorted(want_top - top)}, not llama.cpp's {sorted(top - want_top)}"
    assert per_layer == want_layer, f"missing {sorted(want_layer - per_layer)}, not llama.cpp's {sorted(per_layer - want_layer)}"
    assert {int(n.split(".")[1]) for n in names if n.startswith("blk.")} == set(range(n_layer))
    allowed, lib = _llama_cpp_names(arch), _libllama_strings()
    for n in names:
        base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", n)
        stem = base.rsplit(".", 1)[0] if base.rsplit(".", 1)[-1] in ("weight", "bias", "scale") else base
        assert stem in allowed, f"{n}: not a name llama.cpp lists for {arch}"
        if lib is not None:  # the C string the loader formats the name from (the linker may share its tail)
            assert stem.replace("{bid}", "%d").encode() + b"\0" in lib, f"{n}: libllama has no format {stem!r}"
