"""`moe-pipe convert` rules for Qwen3.5-MoE (HF model_type `qwen3_5_moe`, the multimodal config
whose text model alone is converted, or `qwen3_5_moe_text` -> GGUF arch `qwen35moe`).

Full attention on every n-th layer, gated linear attention (delta net) elsewhere; RMSNorms
that scale by (1 + w) are stored as 1 + w; the vision tower is not converted. The MTP block
(`mtp.*`, `mtp_num_hidden_layers` layers) is written after the decoder's layers as llama.cpp's
converter (`_Qwen35MtpMixin`) writes it: `mtp.layers.j.*` as block L + j, a full-attention
MoE layer; `mtp.fc` as `nextn.eh_proj`, `mtp.pre_fc_norm_embedding` / `_hidden` as
`nextn.enorm` / `hnorm` and `mtp.norm` as `nextn.shared_head_norm` (each 1 + w, and in every
block); unless `hp["mtp"]` is false (`--no-mtp`) or the checkpoint has none (transformers
drops it when saving). docs/models.md § From Hugging Face names.

Legend (numpy order, last axis = ggml ne0): D hidden, H q heads, Hk kv heads, d head dim,
X experts, Fs shared expert width, G key heads and Hv value heads of the linear attention,
dk their width, C conv channels.
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
    embeddings,
    finish,
    first_row,
    head_matrix,
    qwen_experts,
)
from ...convert.rules import Arch, TokenizerFacts, nested_text_config
from ...convert.source import Checkpoint
from ...errors import UserError


def hparams(cfg: dict) -> dict[str, Any]:
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
    if not any(full):
        # the GGUF's full_attention_interval would be past the last layer, which no reader takes
        raise UserError("config.json: qwen3_5_moe layer_types without a full_attention layer is not supported (the GGUF needs one)")
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
        n_mtp=int(cfg.get("mtp_num_hidden_layers") or 0),
    )
    hp["Fd"] = hp["Fs"]
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
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
    if hp.get("mtp_written"):  # as llama.cpp's converter: only with the block
        w.add_nextn_predict_layers(hp["mtp_written"])


def _tiled(x: np.ndarray, axis: int, groups: int, per_group: int, width: int) -> np.ndarray:
    """Value heads from HF's order, grouped by key head (g0v0, g0v1, ..., g1v0, ...), to
    llama.cpp's tiled order (g0v0, g1v0, ..., g0v1, ...): value head h then reads key head
    h mod groups, so a broadcast replaces the interleaved repeat (this family's forward pass)."""
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


def _plus_one(p: Planner, gg: str, name: str, n: int) -> None:
    """Qwen3.5's RMSNorms scale by (1 + w): the GGUF stores 1 + w."""
    ck, full = p.ck, p.hf(name, (n,))
    p.add(Out(gg, (n,), False, lambda: iter([ck.f32(full) + np.float32(1)])))


def _layer(p: Planner, b: str, h: str, hp: dict[str, Any], full_attention: bool) -> None:
    """Decoder layer `h` (a checkpoint prefix) as GGUF block `b`."""
    D, H, Hk, d, X, Fs = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"], hp["Fs"]
    _plus_one(p, b + "attn_norm.weight", h + "input_layernorm.weight", D)
    if full_attention:
        a = h + "self_attn."
        p.copy(b + "attn_q.weight", a + "q_proj.weight", (2 * H * d, D))  # per head: query rows, then gate rows
        p.copy(b + "attn_k.weight", a + "k_proj.weight", (Hk * d, D))
        p.copy(b + "attn_v.weight", a + "v_proj.weight", (Hk * d, D))
        p.copy(b + "attn_output.weight", a + "o_proj.weight", (D, H * d))
        _plus_one(p, b + "attn_q_norm.weight", a + "q_norm.weight", d)
        _plus_one(p, b + "attn_k_norm.weight", a + "k_norm.weight", d)
    else:
        _qwen35_linear(p, b, h + "linear_attn.", hp)
    _plus_one(p, b + "post_attention_norm.weight", h + "post_attention_layernorm.weight", D)
    m = h + "mlp."
    p.f32(b + "ffn_gate_inp.weight", m + "gate.weight", (X, D))
    qwen_experts(p, b, m + "experts.", hp)
    gate = p.hf(m + "shared_expert_gate.weight", (1, D))
    p.add(Out(b + "ffn_gate_inp_shexp.weight", (D,), False, first_row(p.ck, gate)))  # [1, D] -> [D]
    p.copy(b + "ffn_gate_shexp.weight", m + "shared_expert.gate_proj.weight", (Fs, D))
    p.copy(b + "ffn_up_shexp.weight", m + "shared_expert.up_proj.weight", (Fs, D))
    p.copy(b + "ffn_down_shexp.weight", m + "shared_expert.down_proj.weight", (D, Fs))


def _mtp(p: Planner, hp: dict[str, Any]) -> None:
    """The MTP layers as blocks L.. (module docstring); their fc and norms are shared, so
    every block gets its own copy, as llama.cpp's converter writes them."""
    D = hp["D"]
    for j in range(hp["n_mtp"]):
        b = f"blk.{hp['L'] + j}."
        _layer(p, b, f"layers.{j}.", hp, full_attention=True)
        p.copy(b + "nextn.eh_proj.weight", "fc.weight", (D, 2 * D))  # [embedding; hidden] -> D
        _plus_one(p, b + "nextn.enorm.weight", "pre_fc_norm_embedding.weight", D)
        _plus_one(p, b + "nextn.hnorm.weight", "pre_fc_norm_hidden.weight", D)
        _plus_one(p, b + "nextn.shared_head_norm.weight", "norm.weight", D)


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D = hp["D"]
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in ck else "model."
    p = Planner(ck, prefix)
    embeddings(p, hp)
    _plus_one(p, "output_norm.weight", "norm.weight", D)
    if not hp["tied"]:
        head_matrix(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        _layer(p, f"blk.{i}.", f"layers.{i}.", hp, hp["full"][i])
    ignore = r"^model\.visual\."  # llama.cpp keeps the vision tower in a separate mmproj file
    if hp.get("mtp", True) and hp["n_mtp"] and "mtp.fc.weight" in ck:
        m = Planner(ck, "mtp.")
        _mtp(m, hp)
        p.outs += m.outs
        p.used |= m.used
    else:
        ignore += r"|^mtp\."
    return finish(p, ck, ignore=ignore)


_TEXT = Arch("qwen35moe", hparams, metadata, plan, TokenizerFacts("gpt2", "qwen2", add_bos=False))
ARCHES = {
    "qwen3_5_moe": replace(_TEXT, text_config=nested_text_config("qwen3_5_moe", tie_default=False)),
    "qwen3_5_moe_text": _TEXT,
}
