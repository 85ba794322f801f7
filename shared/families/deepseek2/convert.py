"""`moe-pipe convert` rules for DeepSeek-V2/V3 (HF model_type `deepseek_v2`, `deepseek_v3` → GGUF `deepseek2`).

Names and keys as llama.cpp's converter writes them (docs/models.md § deepseek2):
MLA as one kv head (key_length = kv_lora_rank + rope dims, value_length =
kv_lora_rank, the per-head widths in key_length_mla / value_length_mla), and
`kv_b_proj` split into `attn_k_b` (transposed: [H, r, nope]) and `attn_v_b`
([H, v, r]) for the absorbed attention. The rope part of q and k stays in the
checkpoint's interleaved order (llama.cpp's deepseek2 rotates pairs 2i, 2i+1).
The MTP blocks of V3 (`model.layers.{L..}`) are not converted (llama.cpp skips them too).

Where transformers and llama.cpp's graph would disagree, the config is refused by
name, except V2's group-limited greedy routing (see `hparams_v2`), which moe-pipe
routes as transformers does and llama.cpp does not.
Legend (numpy order): D hidden, H heads, r kv_lora_rank, X experts, F expert ff width, Fd dense ff width.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np
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
from ...errors import UserError

log = logging.getLogger(__name__)


def _hparams(cfg: dict, mt: str, lead_default: int) -> dict[str, Any]:
    hp = base_hparams(cfg, 10000.0)
    rp = hp["rope"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported for {mt} (llama.cpp's graph is SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise UserError(f"config.json: {key}=true is not supported for {mt} (llama.cpp's deepseek2 has no such biases)")
    if cfg.get("rope_interleave") is False:
        raise UserError(f"config.json: rope_interleave=false is not supported for {mt} (llama.cpp's deepseek2 rotates interleaved pairs)")
    kind = rp["rope_type"]
    if kind not in ("default", "yarn"):
        raise UserError(f"config.json: rope type {kind!r} is not supported for {mt} (default, yarn)")
    mscale_all = float(rp.get("mscale_all_dim") or 0.0)
    if kind == "yarn":
        mscale = float(rp.get("mscale") or mscale_all)
        if not mscale_all or mscale != mscale_all:
            # llama.cpp's deepseek2 assumes mscale = mscale_all_dim (the rotation unit-sized);
            # transformers would then scale cos/sin by their ratio: refused rather than differ.
            raise UserError(f"config.json: {mt} YaRN needs mscale_all_dim set and equal to mscale (has {mscale_all}, {mscale})")
        if "original_max_position_embeddings" in rp and int(rp["original_max_position_embeddings"]) * float(rp["factor"]) != hp["ctx"]:
            # transformers then takes the factor from the two lengths, llama.cpp from `factor`
            raise UserError(f"config.json: {mt} YaRN: max_position_embeddings must be factor × original_max_position_embeddings")
    X = int(cfg_get(cfg, "n_routed_experts", ..., "num_local_experts"))
    lead = int(cfg.get("first_k_dense_replace", lead_default) or 0)
    if not 0 <= lead < hp["L"]:
        raise UserError(f"config.json: first_k_dense_replace {lead} must be below num_hidden_layers {hp['L']}")
    hp.update(
        X=X,
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "moe_intermediate_size")),
        Fd=int(cfg_get(cfg, "intermediate_size")),
        lead=lead,
        shared=int(cfg.get("n_shared_experts") or 0),
        r=int(cfg_get(cfg, "kv_lora_rank")),
        ql=int(cfg.get("q_lora_rank") or 0),
        nope=int(cfg_get(cfg, "qk_nope_head_dim")),
        rope_dim=int(cfg_get(cfg, "qk_rope_head_dim")),
        v=int(cfg_get(cfg, "v_head_dim")),
        scale=float(cfg.get("routed_scaling_factor") or 1.0),
        mscale_all=mscale_all,
    )
    return hp


def hparams_v2(cfg: dict) -> dict[str, Any]:
    """DeepSeek-V2 (V2-Lite, V2, V2.5): softmax routing, never renormalized (transformers'
    V2 router ignores norm_topk_prob), no correction bias."""
    hp = _hparams(cfg, "deepseek_v2", 0)
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise UserError(
            f"config.json: scoring_func {cfg['scoring_func']!r} is not supported for deepseek_v2 (transformers' V2 uses softmax)"
        )
    if cfg.get("norm_topk_prob"):
        raise UserError(
            "config.json: norm_topk_prob=true is not supported for deepseek_v2 (transformers' V2 never renormalizes; llama.cpp would)"
        )
    method = cfg.get("topk_method") or "greedy"
    if method == "greedy":
        groups = used = 1  # llama.cpp's converter writes n_group anyway; greedy means no group limit
    elif method == "group_limited_greedy":
        groups, used = int(cfg_get(cfg, "n_group")), int(cfg_get(cfg, "topk_group"))
        # Written as llama.cpp's converter writes it (no key says how a group scores): the
        # softmax gating tells moe-pipe's reader it is V2's rule, a group's best expert
        # (gguf/spec_keys.py _GROUP_SCORE); llama.cpp's graph sums a group's best two.
        log.warning("deepseek_v2 group_limited_greedy: llama.cpp routes this file by a group's top-2 sum, not its best expert as trained")
    else:
        raise UserError(f"config.json: topk_method {method!r} is not supported for deepseek_v2 (greedy, group_limited_greedy)")
    hp.update(gating="softmax", norm=False, groups=groups, groups_used=used, bias=False)
    return hp


def hparams_v3(cfg: dict) -> dict[str, Any]:
    """DeepSeek-V3-style (V3, R1, Moonlight, Kimi-K2 shapes): sigmoid scores, the
    e_score_correction_bias for the choice only, grouped top-k, norm_topk_prob, scale."""
    hp = _hparams(cfg, "deepseek_v3", 3)
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise UserError(
            f"config.json: scoring_func {cfg['scoring_func']!r} is not supported for deepseek_v3 (transformers' V3 uses sigmoid)"
        )
    groups, used = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    hp.update(gating="sigmoid", norm=bool(cfg.get("norm_topk_prob", True)), groups=groups, groups_used=used, bias=True)
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    r, rope = hp["r"], hp["rope_dim"]
    w.add_vocab_size(hp["V"])
    w.add_head_count_kv(1)  # MLA as MQA over the latent (llama.cpp's form)
    w.add_key_length(r + rope)
    w.add_value_length(r)
    w.add_key_length_mla(hp["nope"] + rope)
    w.add_value_length_mla(hp["v"])
    w.add_kv_lora_rank(r)
    if hp["ql"]:
        w.add_q_lora_rank(hp["ql"])
    w.add_leading_dense_block_count(hp["lead"])
    w.add_expert_shared_count(hp["shared"])
    w.add_expert_weights_scale(hp["scale"])
    if hp["norm"]:  # llama.cpp's converter writes it only when true (its default is false)
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if hp["gating"] == "sigmoid" else ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(hp["groups"])
    w.add_expert_group_used_count(hp["groups_used"])
    w.add_rope_dimension_count(rope)
    add_rope_scaling(w, hp["rope"], hp["ctx"])
    if hp["mscale_all"]:
        w.add_rope_scaling_yarn_log_mul(0.1 * hp["mscale_all"])  # llama.cpp's convention: 0.1 × mscale_all_dim


def latent_attention(p: Planner, b: str, a: str, hp: dict[str, Any]) -> None:
    """MLA's query (plain or low-rank) and latent key/value tensors of checkpoint prefix `a`
    into GGUF prefix `b`, `attn_kv_b` split as llama.cpp writes it; the output projection is the caller's."""
    D, H, r, ql = hp["D"], hp["H"], hp["r"], hp["ql"]
    qk = hp["nope"] + hp["rope_dim"]
    if ql:
        p.copy(b + "attn_q_a.weight", a + "q_a_proj.weight", (ql, D))
        p.f32(b + "attn_q_a_norm.weight", a + "q_a_layernorm.weight", (ql,))
        p.copy(b + "attn_q_b.weight", a + "q_b_proj.weight", (H * qk, ql))
    else:
        p.copy(b + "attn_q.weight", a + "q_proj.weight", (H * qk, D))
    p.copy(b + "attn_kv_a_mqa.weight", a + "kv_a_proj_with_mqa.weight", (r + hp["rope_dim"], D))
    p.f32(b + "attn_kv_a_norm.weight", a + "kv_a_layernorm.weight", (r,))
    split_kv_b(p, b, a + "kv_b_proj.weight", hp)


def split_kv_b(p: Planner, b: str, name: str, hp: dict[str, Any]) -> None:
    """kv_b_proj [H·(nope + v), r] → attn_k_b [H, r, nope] (transposed) and attn_v_b [H, v, r]."""
    ck, H, r, nope, v = p.ck, hp["H"], hp["r"], hp["nope"], hp["v"]
    full = p.hf(name, (H * (nope + v), r))

    def part(keys: bool):
        kv = ck.f32(full).reshape(H, nope + v, r)
        return np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1) if keys else kv[:, nope:])

    p.add(Out(b + "attn_k_b.weight", (H, r, nope), True, lambda: iter([part(True)])))
    p.add(Out(b + "attn_v_b.weight", (H, v, r), True, lambda: iter([part(False)])))


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, X, Fd = hp["D"], hp["H"], hp["X"], hp["Fd"]
    Fs = hp["F"] * hp["shared"]
    p = Planner(ck, "model.")
    embeddings(p, hp)
    head(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        a, m = h + "self_attn.", h + "mlp."
        p.f32(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
        latent_attention(p, b, a, hp)
        p.copy(b + "attn_output.weight", a + "o_proj.weight", (D, H * hp["v"]))
        p.f32(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,))
        if i < hp["lead"]:
            dense_ffn(p, b, m, D, Fd)
            continue
        p.f32(b + "ffn_gate_inp.weight", m + "gate.weight", (X, D))
        if hp["bias"]:
            p.f32(b + "exp_probs_b.bias", m + "gate.e_score_correction_bias", (X,))
        qwen_experts(p, b, m + "experts.", hp)
        if hp["shared"]:
            p.copy(b + "ffn_gate_shexp.weight", m + "shared_experts.gate_proj.weight", (Fs, D))
            p.copy(b + "ffn_up_shexp.weight", m + "shared_experts.up_proj.weight", (Fs, D))
            p.copy(b + "ffn_down_shexp.weight", m + "shared_experts.down_proj.weight", (D, Fs))
    mtp = sorted({int(n.split(".")[2]) for n in ck.names() if n.startswith("model.layers.")} - set(range(hp["L"])))
    ignore = [rf"^model\.layers\.{j}\." for j in mtp]
    if not hp["shared"]:  # transformers saves 0-wide shared experts when n_shared_experts is 0
        ignore.append(r"\.mlp\.shared_experts\.")
    return finish(p, ck, ignore="|".join(ignore))


# DeepSeek prompts start with <｜begin▁of▁sentence｜>. V3, R1, V3.1 ship V3's split (llama.cpp's "deepseek-v3"),
# V2's is "deepseek-llm"; DeepSeek's splits are sequences, whose first regexes tell V2's from V3's.
_V2_TOKENIZER = TokenizerFacts("gpt2", "deepseek-llm", add_bos=True, known_pre={"[\r\n]": "deepseek-llm", r"\p{N}{1,3}": "deepseek-v3"})
ARCHES = {
    "deepseek_v2": Arch("deepseek2", hparams_v2, metadata, plan, _V2_TOKENIZER),
    "deepseek_v3": Arch("deepseek2", hparams_v3, metadata, plan, replace(_V2_TOKENIZER, pre="deepseek-v3")),
}
