"""`moe-pipe convert` rules for Ling 3.0 (HF model_type `bailing_hybrid`, architectures
BailingMoeV3ForCausalLM / BailingHybridForCausalLM -> GGUF arch `bailingmoe3`).

Names and keys as llama.cpp's converter writes them (docs/models.md § bailingmoe3):
head_count_kv per layer, 0 on a KDA layer and 1 on an MLA layer (llama.cpp's MQA form
of the latent, as deepseek2); on a KDA layer each of q/k/v keeps its own conv
(`ssm_conv1d_{q,k,v}`, numpy [1, H·d, 1, kernel]), A_log is stored as a = exp(A_log)
(`ssm_a`, [H, 1]: the bounded gate uses only that), dt_bias as `ssm_dt.bias`, f_proj
as `ssm_f_a`, b_proj as `ssm_beta`, g_proj as `ssm_g_a`, o_norm as `ssm_norm`; on an MLA
layer `kv_b_proj` is split into attn_k_b / attn_v_b (deepseek2's rule) and g_proj (one
logit per head) is `attn_gate`.

The MTP block (`num_nextn_predict_layers` layers, saved as `model.layers.{L..}`) follows the
decoder's layers as llama.cpp's converter writes it (conversion/bailingmoe3.py,
`BailingMoeV3Model`, `supports_mtp_export`): each a gated-MLA MoE layer with its shared
experts (`is_full_attention` is true past the decoder, so head_count_kv 1) plus `eh_proj`,
`enorm`, `hnorm` as `nextn.*` and `final_layernorm` as `layer_output_norm` (gguf-py's
tensor_mapping; src/models/bailingmoe3.cpp loads it as the block's shared-head norm),
counted in block_count and `nextn_predict_layers`. `hp["mtp"]` false (`--no-mtp`, llama.cpp's
flag too) leaves it out, and so does a checkpoint without it (transformers ignores those
layers on load and does not save them); the file then has no `nextn_predict_layers`.

The checkpoint names are the published ones, which transformers also saves:
`model.word_embeddings`, `layers.i.attention.*` (`dense` the output projection),
`mlp.gate.expert_bias`, per-expert or fused experts. Where transformers and llama.cpp's
graph would disagree the config is refused by name.
Legend (numpy order): D hidden, H heads, d KDA head width, r kv_lora_rank, X experts,
F expert width, Fs shared experts' width, Fd dense width.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter

from ...convert.plan import Out, Planner, base_hparams, cfg_get, common_meta, dense_ffn, finish, head, qwen_experts
from ...convert.rules import Arch, TokenizerFacts
from ...convert.source import Checkpoint
from ...convert.vocab import as_written
from ...errors import UserError
from ...text.tokenizer import BAILINGMOE2_REGEX
from ..deepseek2.convert import latent_attention

ARCH = "bailingmoe3"


def _layer_kinds(cfg: dict, L: int) -> list[bool]:
    """Per layer, True for MLA (full attention): config layer_types, else transformers'
    rule (every layer_group_size-th layer). The GGUF says it per layer, so any pattern converts."""
    group = int(cfg.get("layer_group_size") or 6)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(L)]
    if len(types) != L or set(types) - {"full_attention", "linear_attention"}:
        raise UserError(f"config.json: layer_types must name full_attention or linear_attention for each of the {L} layers")
    if "full_attention" not in types:
        raise UserError("config.json: bailing_hybrid without a full_attention layer is not supported (llama.cpp needs one)")
    return [t == "full_attention" for t in types]


def _refuse_variants(cfg: dict) -> None:
    """What llama.cpp's bailingmoe3 graph cannot express, by name."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(
            f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported for bailing_hybrid (llama.cpp's graph is SwiGLU)"
        )
    if cfg.get("attention_bias"):
        raise UserError("config.json: attention_bias=true is not supported for bailing_hybrid (llama.cpp's bailingmoe3 has no biases)")
    if cfg.get("kda_safe_gate", True) is False:
        raise UserError("config.json: kda_safe_gate=false is not supported (llama.cpp's bailingmoe3 has only the bounded gate)")
    if cfg.get("no_kda_lora", True) is False:
        raise UserError("config.json: no_kda_lora=false (low-rank KDA gates) is not supported, as in llama.cpp's converter")
    if cfg.get("gated_attention_proj_granularity_type", "head_wise") != "head_wise":
        raise UserError("config.json: gated_attention_proj_granularity_type must be head_wise (llama.cpp gates each head)")
    if cfg.get("score_function", cfg.get("scoring_func", "sigmoid")) != "sigmoid":
        raise UserError("config.json: bailing_hybrid routes by sigmoid scores only")
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        if any(v for v in cfg.get(key) or []):
            raise UserError(f"config.json: {key} (clamped SwiGLU) is not supported: transformers' bailing_hybrid does not clamp")


def hparams(cfg: dict) -> dict[str, Any]:
    _refuse_variants(cfg)
    hp = base_hparams(cfg, 6e6)
    # transformers writes the context as model_max_length (its alias of max_position_embeddings)
    hp["ctx"] = int(cfg_get(cfg, "max_position_embeddings", 4096, "model_max_length"))
    L, H, rp = hp["L"], hp["H"], hp["rope"]
    if rp["rope_type"] != "default" or float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        # transformers would scale the MLA scores by YaRN's mscale²; llama.cpp's graph does not
        raise UserError(f"config.json: rope type {rp['rope_type']!r} is not supported for bailing_hybrid (default only)")
    # transformers saves its KDA head width as linear_head_dim (head_dim then holds the rope dims); Ling's own config as head_dim
    d = int(cfg.get("linear_head_dim") or cfg_get(cfg, "head_dim"))
    if int(cfg.get("linear_num_heads") or H) != H:
        raise UserError("config.json: linear_num_heads must equal num_attention_heads (llama.cpp's KDA has one head per attention head)")
    X = int(cfg_get(cfg, "num_experts", ..., "num_local_experts", "n_routed_experts"))
    lead = int(cfg.get("first_k_dense_replace") or 0)
    if not 0 <= lead < L:
        raise UserError(f"config.json: first_k_dense_replace {lead} must be below num_hidden_layers {L}")
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types and list(mlp_types) != ["dense" if i < lead else "sparse" for i in range(L)]:
        raise UserError("config.json: mlp_layer_types must be dense for the first first_k_dense_replace layers and sparse after")
    F = int(cfg_get(cfg, "moe_intermediate_size"))
    shared = int(cfg_get(cfg, "num_shared_experts", 0, "n_shared_experts"))
    groups = int(cfg_get(cfg, "n_group", 1, "num_expert_group"))
    hp.update(
        d=d,
        X=X,
        K=int(cfg_get(cfg, "num_experts_per_tok", ..., "num_experts_per_token")),
        F=F,
        Fd=int(cfg_get(cfg, "intermediate_size")),
        Fs=int(cfg.get("moe_shared_expert_intermediate_size") or F) * shared,
        lead=lead,
        shared=shared,
        groups=groups,
        groups_used=int(cfg_get(cfg, "topk_group", groups)),
        norm=bool(cfg_get(cfg, "norm_topk_prob", True, "moe_renormalize")),
        scale=float(cfg.get("routed_scaling_factor") or 1.0),
        mla=_layer_kinds(cfg, L),
        kernel=int(cfg_get(cfg, "short_conv_kernel_size", 4, "linear_conv_kernel_dim")),
        lower=float(cfg_get(cfg, "kda_lower_bound", -5.0)),
        r=int(cfg_get(cfg, "kv_lora_rank")),
        ql=int(cfg.get("q_lora_rank") or 0),
        nope=int(cfg_get(cfg, "qk_nope_head_dim")),
        rope_dim=int(cfg_get(cfg, "qk_rope_head_dim")),
        v=int(cfg_get(cfg, "v_head_dim")),
        n_mtp=int(cfg_get(cfg, "num_nextn_predict_layers", 0, "num_mtp_layers") or 0),
    )
    if not hp["lower"] < 0:
        raise UserError(f"config.json: kda_lower_bound {hp['lower']} must be negative")
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    r, rope = hp["r"], hp["rope_dim"]
    w.add_vocab_size(hp["V"])
    mtp = hp.get("mtp_written", 0)  # the MTP blocks are MLA layers (module docstring)
    w.add_head_count_kv([1 if mla else 0 for mla in hp["mla"]] + [1] * mtp)  # 0: a KDA (recurrent) layer
    w.add_key_length(r + rope)  # MLA as MQA over the latent (llama.cpp's form)
    w.add_value_length(r)
    w.add_key_length_mla(hp["nope"] + rope)
    w.add_value_length_mla(hp["v"])
    w.add_kv_lora_rank(r)
    if hp["ql"]:
        w.add_q_lora_rank(hp["ql"])
    w.add_rope_dimension_count(rope)
    w.add_ssm_conv_kernel(hp["kernel"])
    w.add_kda_head_dim(hp["d"])
    w.add_bool(f"{ARCH}.kda.safe_gate", True)  # gguf-py 0.19 has no writer for these two kda keys
    w.add_float32(f"{ARCH}.kda.gate_lower_bound", hp["lower"])
    w.add_leading_dense_block_count(hp["lead"])
    w.add_expert_shared_feed_forward_length(hp["Fs"])
    w.add_expert_shared_count(hp["shared"])
    w.add_expert_weights_scale(hp["scale"])
    w.add_expert_weights_norm(hp["norm"])
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(hp["groups"])
    w.add_expert_group_used_count(hp["groups_used"])
    if mtp:  # as llama.cpp's converter: only with the block
        w.add_nextn_predict_layers(mtp)


def _either(p: Planner, names: tuple[str, ...]) -> str:
    """The first of `names` the checkpoint has (the published and the re-saved spellings)."""
    return next((n for n in names if p.prefix + n in p.ck), names[0])


def _conv(p: Planner, gg: str, name: str, inner: int, kernel: int) -> None:
    ck = p.ck
    found = p.prefix + name in ck and len(ck.shape(p.prefix + name)) == 3
    full = p.hf(name, (inner, 1, kernel) if found else (inner, kernel))
    p.add(Out(gg, (1, inner, 1, kernel), False, lambda: iter([ck.f32(full).reshape(1, inner, 1, kernel)])))


def _kda(p: Planner, b: str, a: str, hp: dict[str, Any]) -> None:
    ck, D, H, d, kernel = p.ck, hp["D"], hp["H"], hp["d"], hp["kernel"]
    inner = H * d
    for x in "qkv":
        p.copy(b + f"attn_{x}.weight", a + f"{x}_proj.weight", (inner, D))
    for x in "qkv":  # [H·d, 1, kernel] (or [H·d, kernel]) -> [1, H·d, 1, kernel], llama.cpp's layout
        _conv(p, b + f"ssm_conv1d_{x}.weight", a + f"{x}_conv1d.weight", inner, kernel)
    p.copy(b + "ssm_f_a.weight", a + "f_proj.weight", (inner, D))
    p.f32(b + "ssm_dt.bias", a + "dt_bias", (inner,))
    a_log = p.hf(a + "A_log", (H,))
    p.add(Out(b + "ssm_a", (H, 1), False, lambda: iter([np.exp(ck.f32(a_log)).reshape(H, 1)])))  # a = exp(A_log)
    p.copy(b + "ssm_beta.weight", a + "b_proj.weight", (H, D))
    p.copy(b + "ssm_g_a.weight", a + "g_proj.weight", (inner, D))
    p.f32(b + "ssm_norm.weight", a + "o_norm.weight", (d,))
    p.copy(b + "attn_output.weight", _either(p, (a + "dense.weight", a + "o_proj.weight")), (D, inner))


def _mla(p: Planner, b: str, a: str, hp: dict[str, Any]) -> None:
    D, H = hp["D"], hp["H"]
    latent_attention(p, b, a, hp)
    p.copy(b + "attn_gate.weight", a + "g_proj.weight", (H, D))
    p.copy(b + "attn_output.weight", _either(p, (a + "dense.weight", a + "o_proj.weight")), (D, H * hp["v"]))


def _layer(p: Planner, i: int, hp: dict[str, Any], mla: bool) -> None:
    """HF layer i (a decoder layer, or an MTP layer's decoder part) as block i."""
    D, X, Fd, Fs = hp["D"], hp["X"], hp["Fd"], hp["Fs"]
    b, h = f"blk.{i}.", f"layers.{i}."
    a, m = h + "attention.", h + "mlp."
    p.f32(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
    (_mla if mla else _kda)(p, b, a, hp)
    p.f32(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,))
    if i < hp["lead"]:
        dense_ffn(p, b, m, D, Fd)
        return
    p.f32(b + "ffn_gate_inp.weight", m + "gate.weight", (X, D))
    p.f32(b + "exp_probs_b.bias", _either(p, (m + "gate.expert_bias", m + "gate.e_score_correction_bias")), (X,))
    qwen_experts(p, b, m + "experts.", hp)
    if hp["shared"]:
        p.copy(b + "ffn_gate_shexp.weight", m + "shared_experts.gate_proj.weight", (Fs, D))
        p.copy(b + "ffn_up_shexp.weight", m + "shared_experts.up_proj.weight", (Fs, D))
        p.copy(b + "ffn_down_shexp.weight", m + "shared_experts.down_proj.weight", (D, Fs))


def _mtp(p: Planner, i: int, hp: dict[str, Any]) -> None:
    """MTP layer i: a gated-MLA MoE layer, then its own tensors (module docstring)."""
    D, b, h = hp["D"], f"blk.{i}.", f"layers.{i}."
    _layer(p, i, hp, mla=True)
    p.copy(b + "nextn.eh_proj.weight", h + "eh_proj.weight", (D, 2 * D))  # [embedding; hidden] -> D
    p.f32(b + "nextn.enorm.weight", h + "enorm.weight", (D,))
    p.f32(b + "nextn.hnorm.weight", h + "hnorm.weight", (D,))
    p.f32(b + "layer_output_norm.weight", h + "final_layernorm.weight", (D,))  # gguf-py: bailingmoe2's final_layernorm


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    p = Planner(ck, "model.")
    p.copy("token_embd.weight", "word_embeddings.weight", (hp["V"], hp["D"]))
    head(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        _layer(p, i, hp, hp["mla"][i])
    L, n_mtp = hp["L"], hp["n_mtp"]
    written = bool(hp.get("mtp", True) and n_mtp and f"model.layers.{L}.eh_proj.weight" in ck)
    for i in range(L, L + n_mtp) if written else ():
        _mtp(p, i, hp)
    # layers past the ones written (the MTP block with --no-mtp, or not counted by the config) are left out
    layers = {int(n.split(".")[2]) for n in ck.names() if n.startswith("model.layers.")}
    ignore = [rf"^model\.layers\.{j}\." for j in sorted(layers) if j >= L + (n_mtp if written else 0)]
    if not hp["shared"]:  # transformers saves 0-wide shared experts when there are none
        ignore.append(r"\.mlp\.shared_experts\.")
    return finish(p, ck, ignore="|".join(ignore))


# Ling 2.0's tokenizer, which Ling 3.0 keeps: llama.cpp names its split "bailingmoe2".
TOKENIZER = TokenizerFacts("gpt2", "bailingmoe2", add_bos=False, known_pre={as_written(BAILINGMOE2_REGEX): "bailingmoe2"})
ARCHES = {"bailing_hybrid": Arch(ARCH, hparams, metadata, plan, TOKENIZER)}
