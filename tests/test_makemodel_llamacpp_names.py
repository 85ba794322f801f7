"""make-model writes the metadata keys and tensor names llama.cpp's converter writes.

For each family, the `<arch>.*` keys and the tensor names below are what llama.cpp's
current convert_hf_to_gguf.py (ggml-org/llama.cpp, read 2026-12: `TextModel.set_gguf_parameters`
and each family's class, named per entry) writes for a checkpoint shaped like the family's
tiny preset; a key comes from the HF config field named beside it. The tensor names are
the converter's mapping of that checkpoint's tensors (gguf-py `tensor_mapping.py`); every
one must also be a name gguf-py's `MODEL_TENSORS` lists for the arch (the installed gguf-py
is llama.cpp's). A made file that lacks a key or a name llama.cpp writes, or has one it
does not, fails (docs/models.md, each family's make-model paragraph).
"""

from __future__ import annotations

import re

import pytest
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

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
}

# Every made file's tokenizer keys (SpecialVocab and the family's set_vocab write more where the
# tokenizer files have them), and by tokenizer.ggml.model the merges and scores: a byte-level BPE
# ("gpt2") has merges, a SentencePiece vocab ("llama") scores, gemma4 both (Gemma4Model.set_vocab:
# LlamaHfVocab's scores, SpecialVocab's merges). Departure: made gemma4 files also write
# tokenizer.ggml.pre ("gemma4"), which llama.cpp's converter leaves out and its loader forces.
_TOKENIZER = {"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
_TOKENIZER |= {"tokenizer.ggml.eos_token_id", "tokenizer.chat_template"}
_MERGES_SCORES = {"gpt2": (True, False), "llama": (False, True), "gemma4": (True, True)}


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
    gguf_arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[gguf_arch]}
    for n in names:
        base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", n)
        stem = base.rsplit(".", 1)[0] if base.rsplit(".", 1)[-1] in ("weight", "bias", "scale") else base
        assert stem in allowed, f"{n}: not a name gguf-py's MODEL_TENSORS lists for {arch}"
