"""`moe-pipe convert` rules for GLM-4.5 / GLM-4.5-Air (HF model_type `glm4_moe` → GGUF `glm4moe`).

Names and keys as llama.cpp's converter writes them (docs/models.md § glm4moe). The
NextN/MTP blocks (`num_nextn_predict_layers`, saved as `model.layers.{L..}`) follow the
decoder's layers as llama.cpp's `Glm4MoeModel` writes them: each a routed layer plus its
`eh_proj`, `enorm`, `hnorm`, `embed_tokens`, `shared_head.head` and `shared_head.norm`
as `nextn.*`, counted in block_count and `nextn_predict_layers`. `hp["mtp"]` false
(`--no-mtp`) leaves them out, and so does a checkpoint without them (transformers does not
save them); the file then says `nextn_predict_layers` 0.

Legend (numpy order, last axis = ggml ne0): V vocab, D hidden, H q heads,
Hk kv heads, d head dim, X experts, F expert ff width, Fd dense ff width.
"""

from __future__ import annotations

from typing import Any

from gguf import ExpertGatingFuncType, GGUFWriter

from ...convert.plan import (
    Out,
    Planner,
    add_rope_scaling,
    base_hparams,
    cfg_get,
    common_meta,
    dense_ffn,
    embeddings,
    finish,
    head,
    qwen_experts,
)
from ...convert.rules import Arch, TokenizerFacts
from ...convert.source import Checkpoint
from ...convert.vocab import as_written
from ...errors import UserError
from ...gguf.vocab import LLAMA3_REGEX


def hparams(cfg: dict) -> dict[str, Any]:
    hp = base_hparams(cfg, 10000.0)
    L, rp = hp["L"], hp["rope"]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"config.json: hidden_act {act!r} is not supported for glm4_moe (llama.cpp's graph is SwiGLU)")
    X = int(cfg_get(cfg, "n_routed_experts", ..., "num_local_experts"))
    groups, used = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups < 1 or X % groups or not 0 < used <= groups:
        raise UserError(f"config.json: n_group {groups} must divide n_routed_experts {X}, and topk_group {used} be 1..{groups}")
    lead = int(cfg_get(cfg, "first_k_dense_replace", 1))  # transformers' default
    if not 0 <= lead < L:
        raise UserError(f"config.json: first_k_dense_replace {lead} must be 0..{L - 1} (at least one layer with experts)")
    shared = int(cfg_get(cfg, "n_shared_experts", 1))
    if shared < 1:
        raise UserError("config.json: n_shared_experts must be at least 1 for glm4_moe (its MoE block always has the shared expert)")
    prf = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    n_rot = int(hp["d"] * prf)
    if n_rot <= 0 or n_rot % 2 or n_rot > hp["d"]:
        raise UserError(f"config.json: partial_rotary_factor {prf} × head_dim {hp['d']} must give an even count of rotated dims")
    hp.update(
        X=X,
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "moe_intermediate_size")),
        Fd=int(cfg_get(cfg, "intermediate_size")),
        shared=shared,
        lead=lead,
        groups=groups,
        groups_used=used,
        scale=float(cfg.get("routed_scaling_factor") or 1.0),
        norm=bool(cfg.get("norm_topk_prob", True)),
        bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        n_rot=n_rot,
        nextn=int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0),
    )
    if not 0 < hp["K"] <= X:
        raise UserError(f"config.json: num_experts_per_tok {hp['K']} must be 1..{X}")
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    w.add_rope_dimension_count(hp["n_rot"])
    add_rope_scaling(w, hp["rope"], hp["ctx"])
    w.add_expert_shared_count(hp["shared"])
    w.add_leading_dense_block_count(hp["lead"])
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hp["scale"])
    w.add_expert_weights_norm(hp["norm"])
    if hp["groups"] > 1:  # llama.cpp reads these for every arch and then routes by groups as transformers does
        w.add_expert_group_count(hp["groups"])
        w.add_expert_group_used_count(hp["groups_used"])
    w.add_nextn_predict_layers(hp.get("mtp_written", 0))  # the blocks written (module docstring)


def _layer(p: Planner, i: int, hp: dict[str, Any]) -> None:
    """HF layer i (a decoder layer, or a NextN layer's decoder part) as block i."""
    D, H, Hk, d, X, F, Fd = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"], hp["F"], hp["Fd"]
    Fs = F * hp["shared"]
    b, h = f"blk.{i}.", f"layers.{i}."
    a, m = h + "self_attn.", h + "mlp."
    p.f32(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
    p.copy(b + "attn_q.weight", a + "q_proj.weight", (H * d, D))
    p.copy(b + "attn_k.weight", a + "k_proj.weight", (Hk * d, D))
    p.copy(b + "attn_v.weight", a + "v_proj.weight", (Hk * d, D))
    if hp["bias"]:
        p.f32(b + "attn_q.bias", a + "q_proj.bias", (H * d,))
        p.f32(b + "attn_k.bias", a + "k_proj.bias", (Hk * d,))
        p.f32(b + "attn_v.bias", a + "v_proj.bias", (Hk * d,))
    p.copy(b + "attn_output.weight", a + "o_proj.weight", (D, H * d))
    if hp["qk_norm"]:
        p.f32(b + "attn_q_norm.weight", a + "q_norm.weight", (d,))
        p.f32(b + "attn_k_norm.weight", a + "k_norm.weight", (d,))
    p.f32(b + "post_attention_norm.weight", h + "post_attention_layernorm.weight", (D,))
    if i < hp["lead"]:
        dense_ffn(p, b, m, D, Fd)
        return
    p.f32(b + "ffn_gate_inp.weight", m + "gate.weight", (X, D))
    p.f32(b + "exp_probs_b.bias", m + "gate.e_score_correction_bias", (X,))
    qwen_experts(p, b, m + "experts.", hp)
    p.copy(b + "ffn_gate_shexp.weight", m + "shared_experts.gate_proj.weight", (Fs, D))
    p.copy(b + "ffn_up_shexp.weight", m + "shared_experts.up_proj.weight", (Fs, D))
    p.copy(b + "ffn_down_shexp.weight", m + "shared_experts.down_proj.weight", (D, Fs))


def _nextn(p: Planner, i: int, hp: dict[str, Any]) -> None:
    """NextN layer i: its decoder part, then its own tensors (llama.cpp's tensor_mapping names)."""
    D, V, b, h = hp["D"], hp["V"], f"blk.{i}.nextn.", f"layers.{i}."
    _layer(p, i, hp)
    p.copy(b + "eh_proj.weight", h + "eh_proj.weight", (D, 2 * D))  # [embedding; hidden] -> D
    p.copy(b + "embed_tokens.weight", h + "embed_tokens.weight", (V, D))
    p.f32(b + "enorm.weight", h + "enorm.weight", (D,))
    p.f32(b + "hnorm.weight", h + "hnorm.weight", (D,))
    p.copy(b + "shared_head_head.weight", h + "shared_head.head.weight", (V, D))
    p.f32(b + "shared_head_norm.weight", h + "shared_head.norm.weight", (D,))


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    p = Planner(ck, "model.")
    embeddings(p, hp)
    head(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        _layer(p, i, hp)
    # The NextN/MTP blocks follow the decoder's layers in the checkpoint (module docstring).
    L, nextn = hp["L"], range(hp["L"], hp["L"] + hp["nextn"])
    if hp.get("mtp", True) and nextn and f"model.layers.{L}.eh_proj.weight" in ck:
        for i in nextn:
            _nextn(p, i, hp)
        return finish(p, ck)
    mtp = "|".join(str(i) for i in nextn)
    return finish(p, ck, ignore=rf"^model\.layers\.({mtp})\." if mtp else "")


# GLM-4.5's split is llama3's regex, which llama.cpp calls "glm4" for this arch (no BOS, merges as usual);
# llama.cpp's converter sets bos, eot and eom by text, and its loader then stops on eot and eom too.
_TOKENIZER = TokenizerFacts(
    "gpt2",
    "glm4",
    add_bos=False,
    known_pre={as_written(LLAMA3_REGEX): "glm4"},
    specials={"bos": "[gMASK]", "eot": "<|user|>", "eom": "<|observation|>"},
)
ARCHES = {"glm4_moe": Arch("glm4moe", hparams, metadata, plan, _TOKENIZER)}
