"""Per-architecture rules of `moe-pipe convert`: HF config -> GGUF keys, HF tensors -> GGUF tensors.

The families of the first round live here; later ones have a module each
(shared/convert/<family>.py) built from the same blocks (shared/convert/plan.py)
and registered in `ARCHES` below.

One `Arch` per supported model_type, each giving (docs/models.md § From Hugging Face names):
* `hparams(config)`: the text config read into a flat dict, with unsupported
  variants rejected as UserErrors naming the config key;
* `metadata(w, hp)`: the `<arch>.*` keys;
* `plan(hp, ck)`: every output tensor in file order, with its shape checked
  against the checkpoint before anything is written.

Legend (numpy order, last axis = ggml ne0): V vocab, D hidden, H q heads,
Hk kv heads, d head dim, X experts, F expert ff width, Fd dense ff width.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from moe_pipe.shared.convert import deepseek2, glm4moe, mixtral
from moe_pipe.shared.convert import lfm2moe as _lfm2moe
from moe_pipe.shared.convert import qwen2moe as _qwen2moe
from moe_pipe.shared.convert.plan import (
    Arch,
    Out,
    Planner,
    add_rope_scaling,
    base_hparams,
    cfg_get,
    common_meta,
    embeddings,
    finish,
    first_row,
    head,
    head_matrix,
    qwen_experts,
)
from moe_pipe.shared.convert.source import Checkpoint
from moe_pipe.shared.errors import UserError

# --- qwen3moe -----------------------------------------------------------------------


def _qwen3_hparams(cfg: dict) -> dict[str, Any]:
    hp = base_hparams(cfg, 10000.0)
    hp.update(
        X=int(cfg_get(cfg, "num_experts", ..., "num_local_experts")),
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "moe_intermediate_size")),
        Fd=int(cfg_get(cfg, "intermediate_size", 0)),
    )
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise UserError(
            "config.json: dense (mlp_only_layers / decoder_sparse_step) layers are not supported for qwen3_moe; every layer must be MoE"
        )
    if cfg.get("shared_expert_intermediate_size"):
        raise UserError("config.json: shared experts are not supported for qwen3_moe")
    if cfg.get("norm_topk_prob") is False:
        # llama.cpp's qwen3moe graph always renormalizes the top-k weights.
        raise UserError("config.json: norm_topk_prob=false is not supported for qwen3moe (llama.cpp always renormalizes the top-k weights)")
    return hp


def _qwen3_meta(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    add_rope_scaling(w, hp["rope"], hp["ctx"])


def _qwen3_plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, Hk, d, X = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"]
    p = Planner(ck, "model.")
    embeddings(p, hp)
    head(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        p.f32(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
        p.copy(b + "attn_q.weight", h + "self_attn.q_proj.weight", (H * d, D))
        p.copy(b + "attn_k.weight", h + "self_attn.k_proj.weight", (Hk * d, D))
        p.copy(b + "attn_v.weight", h + "self_attn.v_proj.weight", (Hk * d, D))
        p.copy(b + "attn_output.weight", h + "self_attn.o_proj.weight", (D, H * d))
        p.f32(b + "attn_q_norm.weight", h + "self_attn.q_norm.weight", (d,))
        p.f32(b + "attn_k_norm.weight", h + "self_attn.k_norm.weight", (d,))
        p.f32(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,))
        p.f32(b + "ffn_gate_inp.weight", h + "mlp.gate.weight", (X, D))
        qwen_experts(p, b, h + "mlp.experts.", hp)
    return finish(p, ck)


# --- gpt-oss ------------------------------------------------------------------------


def _gpt_oss_hparams(cfg: dict) -> dict[str, Any]:
    hp = base_hparams(cfg, 150000.0)
    L = hp["L"]
    hp.update(
        X=int(cfg_get(cfg, "num_local_experts", ..., "num_experts")),
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "intermediate_size")),
        window=int(cfg.get("sliding_window") or 0),
    )
    hp["Fd"] = hp["F"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    if len(types) != L:
        raise UserError(f"config.json: layer_types has {len(types)} entries for {L} layers")
    hp["swa"] = [t == "sliding_attention" for t in types]
    if hp["window"] and hp["swa"] != [i % 2 == 0 for i in range(L)]:
        # llama.cpp hard-codes gpt-oss's alternation (sliding on even layers).
        raise UserError("config.json: gpt-oss layer_types must alternate sliding/full starting with sliding (llama.cpp assumes it)")
    for key, want in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        if key in cfg and cfg[key] is not None and abs(float(cfg[key]) - want) > 1e-6:
            raise UserError(f"config.json: {key}={cfg[key]} is not supported (GGUF gpt-oss assumes {want})")
    return hp


def _gpt_oss_meta(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    if hp["window"]:
        w.add_sliding_window(hp["window"])
    add_rope_scaling(w, hp["rope"], hp["ctx"])


def _mxfp4_repack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 (..., G, 16) nibbles + (..., G) E8M0 scales -> ggml MXFP4 blocks (..., G*17).

    HF packs element 2j in the low nibble and 2j+1 in the high nibble of byte j;
    ggml packs element j low and j+16 high (docs/formats.md § Quant blocks). The E8M0
    exponent byte means the same in both and goes first in each 17-byte block.
    """
    lo, hi = blocks & 0x0F, blocks >> 4
    q = np.empty((*blocks.shape[:-1], 32), np.uint8)  # (..., G, 32) element codes
    q[..., 0::2], q[..., 1::2] = lo, hi
    out = np.empty((*blocks.shape[:-1], 17), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def _gpt_oss_experts(p: Planner, b: str, e: str, hp: dict[str, Any]) -> None:
    ck, D, X, F = p.ck, hp["D"], hp["X"], hp["F"]
    gu_b = p.hf(e + "gate_up_proj_bias", (X, 2 * F))
    dn_b = p.hf(e + "down_proj_bias", (X, D))
    bias_gate = Out(b + "ffn_gate_exps.bias", (X, F), False, lambda: iter([ck.f32(gu_b)[:, 0::2]]))
    bias_up = Out(b + "ffn_up_exps.bias", (X, F), False, lambda: iter([ck.f32(gu_b)[:, 1::2]]))
    bias_down = Out(b + "ffn_down_exps.bias", (X, D), False, lambda: iter([ck.f32(dn_b)]))
    if "model." + e + "gate_up_proj_blocks" in ck:
        # MXFP4 checkpoint: repack losslessly, experts stay MXFP4 whatever --outtype says.
        if D % 32 or F % 32:
            raise UserError(f"{ck.dir}: MXFP4 experts need widths that are multiples of 32 (hidden {D}, intermediate {F})")
        gb = p.hf(e + "gate_up_proj_blocks", (X, 2 * F, D // 32, 16))
        gs = p.hf(e + "gate_up_proj_scales", (X, 2 * F, D // 32))
        db = p.hf(e + "down_proj_blocks", (X, D, F // 32, 16))
        ds = p.hf(e + "down_proj_scales", (X, D, F // 32))
        rep = lambda bl, sc, rows: (_mxfp4_repack(ck.raw(bl)[x, rows], ck.raw(sc)[x, rows]) for x in range(X))  # noqa: E731
        p.add(Out(b + "ffn_gate_exps.weight", (X, F, D), True, lambda: rep(gb, gs, slice(0, None, 2)), Q.MXFP4))
        p.add(bias_gate)
        p.add(Out(b + "ffn_up_exps.weight", (X, F, D), True, lambda: rep(gb, gs, slice(1, None, 2)), Q.MXFP4))
        p.add(bias_up)
        p.add(Out(b + "ffn_down_exps.weight", (X, D, F), True, lambda: rep(db, ds, slice(None)), Q.MXFP4))
        p.add(bias_down)
        return
    # Dequantized checkpoint: gate_up_proj is (X, D, 2F) input-major with gate/up interleaved
    # in its columns (gate even, up odd); GGUF wants (X, F, D) each. down_proj (X, F, D) -> (X, D, F).
    gu = p.hf(e + "gate_up_proj", (X, D, 2 * F))
    dn = p.hf(e + "down_proj", (X, F, D))
    p.add(Out(b + "ffn_gate_exps.weight", (X, F, D), True, lambda: (ck.f32(gu, (x, slice(None), slice(0, None, 2))).T for x in range(X))))
    p.add(bias_gate)
    p.add(Out(b + "ffn_up_exps.weight", (X, F, D), True, lambda: (ck.f32(gu, (x, slice(None), slice(1, None, 2))).T for x in range(X))))
    p.add(bias_up)
    p.add(Out(b + "ffn_down_exps.weight", (X, D, F), True, lambda: (ck.f32(dn, x).T for x in range(X))))
    p.add(bias_down)


def _gpt_oss_plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, Hk, d, X = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"]
    p = Planner(ck, "model.")
    embeddings(p, hp)
    head(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        a = h + "self_attn."
        p.f32(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
        for gg, hf, rows in (("attn_q", "q_proj", H * d), ("attn_k", "k_proj", Hk * d), ("attn_v", "v_proj", Hk * d)):
            p.copy(f"{b}{gg}.weight", f"{a}{hf}.weight", (rows, D))
            p.f32(f"{b}{gg}.bias", f"{a}{hf}.bias", (rows,))
        p.copy(b + "attn_output.weight", a + "o_proj.weight", (D, H * d))
        p.f32(b + "attn_output.bias", a + "o_proj.bias", (D,))
        p.f32(b + "attn_sinks.weight", a + "sinks", (H,))
        p.f32(b + "post_attention_norm.weight", h + "post_attention_layernorm.weight", (D,))  # the pre-FFN norm
        p.f32(b + "ffn_gate_inp.weight", h + "mlp.router.weight", (X, D))
        p.f32(b + "ffn_gate_inp.bias", h + "mlp.router.bias", (X,))
        _gpt_oss_experts(p, b, h + "mlp.experts.", hp)
    return finish(p, ck)


# --- gemma4 -------------------------------------------------------------------------


def _gemma4_hparams(cfg: dict) -> dict[str, Any]:
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
    plc = cfg.get("per_layer_config") or {}
    d_full_set, hk_full_set = set(), set()
    for i in range(L):
        if swa[i]:
            continue
        o = plc.get(str(i)) or plc.get(i) or {}
        d_full_set.add(int(o.get("head_dim") or cfg.get("global_head_dim") or 512))
        g = cfg.get("num_global_key_value_heads") if k_eq_v else None
        hk_full_set.add(int(o.get("num_key_value_heads") or g or hp["Hk"]))
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


def _gemma4_meta(w: GGUFWriter, hp: dict[str, Any]) -> None:
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


def _gemma4_plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
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
        p.copy(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (Fd, D))
        p.copy(b + "ffn_up.weight", h + "mlp.up_proj.weight", (Fd, D))
        p.copy(b + "ffn_down.weight", h + "mlp.down_proj.weight", (D, Fd))
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


# --- qwen35moe -----------------------------------------------------------------------


def _qwen35_hparams(cfg: dict) -> dict[str, Any]:
    hp = base_hparams(cfg, 1e7)
    L, rp = hp["L"], hp["rope"]
    if rp["rope_type"] != "default":
        raise UserError(f"config.json: rope type {rp['rope_type']!r} is not supported for qwen3_5_moe (only the default, mrope)")
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("full_attention_interval") or 4) == 0 else "x" for i in range(L)
    ]
    if len(types) != L:
        raise UserError(f"config.json: layer_types has {len(types)} entries for {L} layers")
    full = [t == "full_attention" for t in types]
    interval = full.index(True) + 1 if any(full) else L + 1
    if full != [(i + 1) % interval == 0 for i in range(L)]:
        # The GGUF says only full_attention_interval (llama.cpp's rule): any other pattern cannot be written.
        raise UserError("config.json: qwen3_5_moe layer_types must put full attention on every n-th layer (full_attention_interval)")
    G, Hv = int(cfg_get(cfg, "linear_num_key_heads")), int(cfg_get(cfg, "linear_num_value_heads"))
    dk, dv = int(cfg_get(cfg, "linear_key_head_dim")), int(cfg_get(cfg, "linear_value_head_dim"))
    if dk != dv or Hv % G:
        raise UserError(
            f"config.json: linear attention needs linear_key_head_dim = linear_value_head_dim ({dk}, {dv}) "
            f"and linear_num_value_heads a multiple of linear_num_key_heads ({Hv}, {G}), as llama.cpp does"
        )
    prf = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    sections = [int(x) for x in (rp.get("mrope_section") or [11, 11, 10])][:4]
    hp.update(
        X=int(cfg_get(cfg, "num_experts")),
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "moe_intermediate_size")),
        Fs=int(cfg_get(cfg, "shared_expert_intermediate_size")),
        interval=interval,
        full=full,
        G=G,
        Hv=Hv,
        dk=dk,
        kernel=int(cfg_get(cfg, "linear_conv_kernel_dim")),
        n_rot=int(hp["d"] * prf),
        sections=sections + [0] * (4 - len(sections)),
    )
    hp["Fd"] = hp["Fs"]
    return hp


def _qwen35_meta(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    w.add_rope_dimension_count(hp["n_rot"])
    w.add_rope_dimension_sections(hp["sections"])  # llama.cpp requires it; text positions make it moot
    w.add_expert_shared_feed_forward_length(hp["Fs"])
    w.add_full_attention_interval(hp["interval"])
    w.add_ssm_conv_kernel(hp["kernel"])
    w.add_ssm_state_size(hp["dk"])
    w.add_ssm_group_count(hp["G"])
    w.add_ssm_time_step_rank(hp["Hv"])
    w.add_ssm_inner_size(hp["Hv"] * hp["dk"])


def _tiled(x: np.ndarray, axis: int, groups: int, per_group: int, width: int) -> np.ndarray:
    """Value heads from HF's order, grouped by key head (g0v0, g0v1, ..., g1v0, ...), to
    llama.cpp's tiled order (g0v0, g1v0, ..., g0v1, ...): value head h then reads key head
    h mod groups, so a broadcast replaces the interleaved repeat (shared/model/qwen35moe.py)."""
    shape = x.shape
    y = x.reshape(*shape[:axis], groups, per_group, width, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(y, axis, axis + 1)).reshape(shape)


def _qwen35_linear(p: Planner, b: str, a: str, hp: dict[str, Any]) -> None:
    ck, D, G, Hv, dk, kernel = p.ck, hp["D"], hp["G"], hp["Hv"], hp["dk"], hp["kernel"]
    r, kd, vd = Hv // G, G * dk, Hv * dk
    C = 2 * kd + vd

    def whole(gg: str, name: str, shape: tuple[int, ...], out_shape: tuple[int, ...], fn, matrix: bool) -> None:
        full = p.hf(name, shape)
        p.add(Out(gg, out_shape, matrix, lambda: iter([np.ascontiguousarray(fn(ck.f32(full)), np.float32)])))

    def qkv_rows(x: np.ndarray) -> np.ndarray:  # only the value rows (channels) move
        return np.concatenate([x[: 2 * kd], _tiled(x[2 * kd :], 0, G, r, dk)])

    whole(b + "attn_qkv.weight", a + "in_proj_qkv.weight", (C, D), (C, D), qkv_rows, True)
    whole(b + "attn_gate.weight", a + "in_proj_z.weight", (vd, D), (vd, D), lambda x: _tiled(x, 0, G, r, dk), True)
    whole(b + "ssm_beta.weight", a + "in_proj_b.weight", (Hv, D), (Hv, D), lambda x: _tiled(x, 0, G, r, 1), True)
    whole(b + "ssm_alpha.weight", a + "in_proj_a.weight", (Hv, D), (Hv, D), lambda x: _tiled(x, 0, G, r, 1), True)
    whole(b + "ssm_conv1d.weight", a + "conv1d.weight", (C, 1, kernel), (C, kernel), lambda x: qkv_rows(x[:, 0]), False)
    whole(b + "ssm_dt.bias", a + "dt_bias", (Hv,), (Hv,), lambda x: _tiled(x, 0, G, r, 1), False)
    whole(b + "ssm_a", a + "A_log", (Hv,), (Hv,), lambda x: -np.exp(_tiled(x, 0, G, r, 1)), False)  # a = -exp(A_log)
    p.f32(b + "ssm_norm.weight", a + "norm.weight", (dk,))  # a plain weight (no 1 + w) in this gated norm
    whole(b + "ssm_out.weight", a + "out_proj.weight", (D, vd), (D, vd), lambda x: _tiled(x, 1, G, r, dk), True)


def _qwen35_plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, Hk, d, X, Fs = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"], hp["Fs"]
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in ck else "model."
    p = Planner(ck, prefix)

    def plus_one(gg: str, name: str, n: int) -> None:  # Qwen3.5's RMSNorms scale by (1 + w): the GGUF stores 1 + w
        full = p.hf(name, (n,))
        p.add(Out(gg, (n,), False, lambda: iter([ck.f32(full) + np.float32(1)])))

    embeddings(p, hp)
    full_norm = p.hf("norm.weight", (D,))
    p.add(Out("output_norm.weight", (D,), False, lambda: iter([ck.f32(full_norm) + np.float32(1)])))
    if not hp["tied"]:
        head_matrix(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        plus_one(b + "attn_norm.weight", h + "input_layernorm.weight", D)
        if hp["full"][i]:
            a = h + "self_attn."
            p.copy(b + "attn_q.weight", a + "q_proj.weight", (2 * H * d, D))  # per head: query rows, then gate rows
            p.copy(b + "attn_k.weight", a + "k_proj.weight", (Hk * d, D))
            p.copy(b + "attn_v.weight", a + "v_proj.weight", (Hk * d, D))
            p.copy(b + "attn_output.weight", a + "o_proj.weight", (D, H * d))
            plus_one(b + "attn_q_norm.weight", a + "q_norm.weight", d)
            plus_one(b + "attn_k_norm.weight", a + "k_norm.weight", d)
        else:
            _qwen35_linear(p, b, h + "linear_attn.", hp)
        plus_one(b + "post_attention_norm.weight", h + "post_attention_layernorm.weight", D)
        m = h + "mlp."
        p.f32(b + "ffn_gate_inp.weight", m + "gate.weight", (X, D))
        qwen_experts(p, b, m + "experts.", hp)
        gate = p.hf(m + "shared_expert_gate.weight", (1, D))
        p.add(Out(b + "ffn_gate_inp_shexp.weight", (D,), False, first_row(ck, gate)))  # [1, D] -> [D]
        p.copy(b + "ffn_gate_shexp.weight", m + "shared_expert.gate_proj.weight", (Fs, D))
        p.copy(b + "ffn_up_shexp.weight", m + "shared_expert.up_proj.weight", (Fs, D))
        p.copy(b + "ffn_down_shexp.weight", m + "shared_expert.down_proj.weight", (D, Fs))
    # The vision tower and the MTP block are not converted (llama.cpp keeps the tower in a separate mmproj file).
    return finish(p, ck, ignore=r"^model\.visual\.|^mtp\.")


# --- shared -------------------------------------------------------------------------

ARCHES: dict[str, Arch] = {
    "qwen3_moe": Arch("qwen3moe", _qwen3_hparams, _qwen3_meta, _qwen3_plan),
    "gpt_oss": Arch("gpt-oss", _gpt_oss_hparams, _gpt_oss_meta, _gpt_oss_plan),
    "gemma4_text": Arch("gemma4", _gemma4_hparams, _gemma4_meta, _gemma4_plan),
    "qwen3_5_moe_text": Arch("qwen35moe", _qwen35_hparams, _qwen35_meta, _qwen35_plan),
    "glm4_moe": Arch("glm4moe", glm4moe.hparams, glm4moe.metadata, glm4moe.plan),
    "deepseek_v2": Arch("deepseek2", deepseek2.hparams_v2, deepseek2.metadata, deepseek2.plan),
    "deepseek_v3": Arch("deepseek2", deepseek2.hparams_v3, deepseek2.metadata, deepseek2.plan),
    "mixtral": Arch("llama", mixtral.hparams, mixtral.metadata, mixtral.plan),
    "lfm2_moe": _lfm2moe.ARCH,
    "qwen2_moe": _qwen2moe.ARCH,
}
SUPPORTED = "qwen3_moe, gpt_oss, gemma4, qwen3_5_moe, glm4_moe, deepseek_v2, deepseek_v3, lfm2_moe, mixtral, qwen2_moe"


def text_config(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(model_type, text config) — Gemma 4's multimodal config nests the text model."""
    mt = config.get("model_type")
    if not isinstance(mt, str):  # absent, or e.g. a list: no architecture's name (and unhashable)
        raise UserError(f"config.json: model_type {mt!r} is not supported; convert handles {SUPPORTED}")
    if mt == "qwen3_5_moe":  # the published multimodal layout: only its text model is converted
        tc = config.get("text_config")
        if not isinstance(tc, dict):
            raise UserError("config.json: model_type qwen3_5_moe without a text_config")
        return "qwen3_5_moe_text", {**tc, "tie_word_embeddings": config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))}
    if mt == "gemma4":
        tc = config.get("text_config")
        if not isinstance(tc, dict):
            raise UserError("config.json: model_type gemma4 without a text_config")
        return "gemma4_text", {**tc, "tie_word_embeddings": config.get("tie_word_embeddings", tc.get("tie_word_embeddings", True))}
    return mt, config
