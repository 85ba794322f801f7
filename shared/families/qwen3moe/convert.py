"""`moe-pipe convert` rules for Qwen3-MoE (HF model_type `qwen3_moe` -> GGUF arch `qwen3moe`).

Every layer is MoE: dense layers (`mlp_only_layers`, `decoder_sparse_step`) and shared
experts are refused, as llama.cpp's graph has neither. docs/models.md § From Hugging Face names.

Legend (numpy order, last axis = ggml ne0): D hidden, H q heads, Hk kv heads, d head dim, X experts.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFWriter

from ...convert.plan import (
    Out,
    Planner,
    add_rope_scaling,
    base_hparams,
    cfg_get,
    common_meta,
    embeddings,
    finish,
    head,
    qwen_experts,
)
from ...convert.rules import Arch, TokenizerFacts
from ...convert.source import Checkpoint
from ...errors import UserError


def hparams(cfg: dict) -> dict[str, Any]:
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


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    add_rope_scaling(w, hp["rope"], hp["ctx"])


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
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


ARCHES = {"qwen3_moe": Arch("qwen3moe", hparams, metadata, plan, TokenizerFacts("gpt2", "qwen2", add_bos=False))}
