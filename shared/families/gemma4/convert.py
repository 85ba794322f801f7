"""`moe-pipe convert` rules for Gemma 4 MoE (HF model_type `gemma4`, the multimodal config
whose text model alone is converted, or `gemma4_text` -> GGUF arch `gemma4`).

Sliding and full attention layers with their own head widths and RoPE; the full layers'
proportional RoPE is written as `rope_freqs`. docs/models.md § From Hugging Face names.

Legend (numpy order, last axis = ggml ne0): D hidden, H q heads, Hk kv heads, d head dim,
X experts, F expert ff width, Fd dense ff width.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from gguf import GGUFWriter

from ...convert.plan import (
    Out,
    Planner,
    base_hparams,
    cfg_get,
    common_meta,
    dense_ffn,
    embeddings,
    finish,
    head,
)
from ...convert.rules import Arch, TokenizerFacts, nested_text_config
from ...convert.source import Checkpoint
from ...errors import UserError


def hparams(cfg: dict) -> dict[str, Any]:
    if not cfg.get("enable_moe_block"):
        raise UserError(
            "config.json: this Gemma 4 model has no MoE block (enable_moe_block is false); convert handles the MoE variants only"
        )
    if cfg.get("hidden_size_per_layer_input"):
        raise UserError("config.json: Gemma 4 per-layer input embeddings (hidden_size_per_layer_input > 0) are not supported")
    if cfg.get("num_kv_shared_layers"):
        raise UserError("config.json: Gemma 4 shared KV layers (num_kv_shared_layers > 0) are not supported")
    if cfg.get("attention_bias"):
        raise UserError("config.json: attention_bias=true is not supported for gemma4")
    rope_all = cfg.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    }
    rs, rf = rope_all.get("sliding_attention") or {}, rope_all.get("full_attention") or {}
    hp = base_hparams({**cfg, "rope_parameters": rf}, 1e6)
    L = hp["L"]
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(L)]
    if len(types) != L:
        raise UserError(f"config.json: layer_types has {len(types)} entries for {L} layers")
    swa = [t == "sliding_attention" for t in types]
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    # Full layers: head dim and kv heads from per_layer_config (transformers >= 5.x
    # saves it) or global_head_dim / num_global_key_value_heads (the published config).
    # transformers saves in a layer's entry only what differs from the base config (an
    # empty one where global_head_dim is head_dim) and, as it loads, then ignores
    # global_head_dim: a missing value is the base's, not the published default 512.
    own = "per_layer_config" in cfg
    plc = cfg.get("per_layer_config") or {}
    g_d = hp["d"] if own else cfg.get("global_head_dim") or 512
    g_hk = None if own or not k_eq_v else cfg.get("num_global_key_value_heads")
    d_full_set, hk_full_set = set(), set()
    for i in range(L):
        if swa[i]:
            continue
        o = plc.get(str(i)) or plc.get(i) or {}
        d_full_set.add(int(o.get("head_dim") or g_d))
        hk_full_set.add(int(o.get("num_key_value_heads") or g_hk or hp["Hk"]))
    if len(d_full_set) > 1 or len(hk_full_set) > 1:
        raise UserError("config.json: full-attention layers with different head dims or kv heads are not supported")
    d_full = d_full_set.pop() if d_full_set else hp["d"]
    hk_full = hk_full_set.pop() if hk_full_set else hp["Hk"]
    if rs.get("rope_type", "default") != "default":
        raise UserError(f"config.json: sliding-layer rope type {rs.get('rope_type')!r} is not supported for gemma4")
    kind = rf.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise UserError(f"config.json: full-layer rope type {kind!r} is not supported for gemma4")
    p_full = float(rf.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    if rf.get("factor") not in (None, 1, 1.0) and kind != "proportional":
        raise UserError("config.json: full-layer rope factor is only supported with proportional rope")
    hp.update(
        X=int(cfg_get(cfg, "num_experts")),
        K=int(cfg_get(cfg, "top_k_experts")),
        F=int(cfg_get(cfg, "moe_intermediate_size")),
        Fd=int(cfg_get(cfg, "intermediate_size")),
        swa=swa,
        k_eq_v=k_eq_v,
        d_full=d_full,
        hk_full=hk_full,
        Hk_layer=[hp["Hk"] if s else hk_full for s in swa],
        d_layer=[hp["d"] if s else d_full for s in swa],
        window=int(cfg.get("sliding_window") or 0),
        theta_swa=float(rs.get("rope_theta", 10000.0)),
        n_rot_swa=int(hp["d"] * float(rs.get("partial_rotary_factor", 1.0))),
        # HF "proportional": the first floor(p*d/2) frequency pairs rotate (exponent over the
        # full d), divided by `factor`; the rest are identity. ggml: n_rot = d and per-pair
        # freq factors, a huge factor freezing a pair.
        rot_pairs=int(p_full * d_full // 2),
        rope_factor=float(rf.get("factor") or 1.0),
        softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        tied=bool(cfg.get("tie_word_embeddings", True)),
    )
    hp["ctx"] = int(cfg_get(cfg, "max_position_embeddings", 131072))
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_head_count_kv(hp["Hk_layer"])
    w.add_key_length(hp["d_full"])
    w.add_value_length(hp["d_full"])
    w.add_key_length_swa(hp["d"])
    w.add_value_length_swa(hp["d"])
    w.add_rope_dimension_count(hp["d_full"])
    w.add_rope_dimension_count_swa(hp["n_rot_swa"])
    w.add_rope_freq_base_swa(hp["theta_swa"])
    w.add_sliding_window(hp["window"])
    w.add_sliding_window_pattern(hp["swa"])
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)
    if hp["softcap"]:
        w.add_final_logit_softcapping(hp["softcap"])


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, X, F, Fd = hp["D"], hp["H"], hp["X"], hp["F"], hp["Fd"]
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in ck else "model."
    p = Planner(ck, prefix)
    embeddings(p, hp)
    n_pairs = hp["d_full"] // 2
    freqs = np.full(n_pairs, 1e30, np.float32)
    freqs[: hp["rot_pairs"]] = hp["rope_factor"]
    p.add(Out("rope_freqs.weight", (n_pairs,), False, lambda: iter([freqs])))
    head(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        a, d, Hk = h + "self_attn.", hp["d_layer"][i], hp["Hk_layer"][i]
        p.f32(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
        p.copy(b + "attn_q.weight", a + "q_proj.weight", (H * d, D))
        p.copy(b + "attn_k.weight", a + "k_proj.weight", (Hk * d, D))
        if hp["swa"][i] or not hp["k_eq_v"]:  # full k_eq_v layers use K as V: no attn_v
            p.copy(b + "attn_v.weight", a + "v_proj.weight", (Hk * d, D))
        p.copy(b + "attn_output.weight", a + "o_proj.weight", (D, H * d))
        p.f32(b + "attn_q_norm.weight", a + "q_norm.weight", (d,))
        p.f32(b + "attn_k_norm.weight", a + "k_norm.weight", (d,))
        p.f32(b + "post_attention_norm.weight", h + "post_attention_layernorm.weight", (D,))
        p.f32(b + "ffn_norm.weight", h + "pre_feedforward_layernorm.weight", (D,))
        dense_ffn(p, b, h + "mlp.", D, Fd)
        p.f32(b + "post_ffw_norm_1.weight", h + "post_feedforward_layernorm_1.weight", (D,))
        p.f32(b + "pre_ffw_norm_2.weight", h + "pre_feedforward_layernorm_2.weight", (D,))
        p.f32(b + "post_ffw_norm_2.weight", h + "post_feedforward_layernorm_2.weight", (D,))
        p.f32(b + "post_ffw_norm.weight", h + "post_feedforward_layernorm.weight", (D,))
        p.f32(b + "ffn_gate_inp.weight", h + "router.proj.weight", (X, D))
        p.f32(b + "ffn_gate_inp.scale", h + "router.scale", (D,))
        p.copy(b + "ffn_gate_up_exps.weight", h + "experts.gate_up_proj", (X, 2 * F, D))  # gate rows first
        p.copy(b + "ffn_down_exps.weight", h + "experts.down_proj", (X, D, F))
        p.f32(b + "ffn_down_exps.scale", h + "router.per_expert_scale", (X,))
        p.f32(b + "layer_output_scale.weight", h + "layer_scalar", (1,))
    return finish(
        p, ck, ignore=r"model\.(vision_tower|embed_vision|audio_tower|embed_audio|vision_model|multi_modal_projector)\.|lm_head\.weight$"
    )


# llama.cpp's gemma4 converter keeps these visible (USER_DEFINED) so chat parsers see them,
# and forces its own newline pre-split whatever the tokenizer.json says.
_TOKENIZER = TokenizerFacts(
    "gemma4",
    "gemma4",
    add_bos=True,
    pre_fixed=True,
    visible=frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}),
    byte_pieces=True,
    space_prefix=False,
)
_TEXT = Arch("gemma4", hparams, metadata, plan, _TOKENIZER)
ARCHES = {
    "gemma4": replace(_TEXT, text_config=nested_text_config("gemma4", tie_default=True)),
    "gemma4_text": _TEXT,
}
