"""`moe-pipe convert` rules for Qwen1.5-MoE / Qwen2-MoE (HF model_type `qwen2_moe` -> GGUF arch `qwen2moe`).

llama.cpp's names and keys: q/k/v with biases (NEOX RoPE, so no row permutation),
`post_attention_layernorm` → `ffn_norm`, `mlp.gate` → `ffn_gate_inp`, the routed
experts stacked into `ffn_*_exps` (transformers 5's fused `gate_up_proj`, or the
published per-expert `mlp.experts.N.*_proj`), `mlp.shared_expert.*` →
`ffn_*_shexp` and `mlp.shared_expert_gate` ([1, D]) → `ffn_gate_inp_shexp` ([D]).
`norm_topk_prob` goes into `expert_weights_norm` (llama.cpp's graph does not read
it and never renormalizes: docs/models.md § qwen2moe). Dense layers in between
(`decoder_sparse_step`, `mlp_only_layers`) and sliding-window layers are refused:
llama.cpp's qwen2moe graph has neither, and no released model uses them.

Legend (numpy order): D hidden, H q heads, Hk kv heads, d head dim, X experts,
F expert ff width, Fs shared expert width, Fd dense ff width.
"""

from __future__ import annotations

from typing import Any

import numpy as np
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
    first_row,
    head,
    qwen_experts,
)
from ...convert.rules import Arch, TokenizerFacts
from ...convert.source import Checkpoint
from ...errors import UserError


def hparams(cfg: dict) -> dict[str, Any]:
    hp = base_hparams(cfg, 10000.0)
    L = hp["L"]
    hp.update(
        X=int(cfg_get(cfg, "num_experts")),
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "moe_intermediate_size")),
        Fs=int(cfg_get(cfg, "shared_expert_intermediate_size", 0)),
        Fd=int(cfg_get(cfg, "intermediate_size", 0)),
        norm=bool(cfg.get("norm_topk_prob", False)),
        bias=bool(cfg.get("qkv_bias", True)),  # transformers 4 always had the biases; 5 names the switch
    )
    sparse = [
        i for i in range(L) if i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % int(cfg.get("decoder_sparse_step") or 1) == 0
    ]
    if len(sparse) != L:
        raise UserError(
            f"config.json: qwen2_moe with dense layers (mlp_only_layers / decoder_sparse_step: {L - len(sparse)} of {L} layers) "
            "is not supported; llama.cpp's qwen2moe graph makes every layer MoE"
        )
    if not hp["Fs"]:
        raise UserError(
            "config.json: qwen2_moe without a shared expert (shared_expert_intermediate_size 0) is not supported by llama.cpp's graph"
        )
    types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or "sliding_attention" in types:
        raise UserError(
            "config.json: sliding-window layers (use_sliding_window) are not supported for qwen2_moe (llama.cpp attends to everything)"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"config.json: hidden_act {act!r} is not supported for qwen2_moe (SwiGLU with SiLU only)")
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    w.add_expert_shared_feed_forward_length(hp["Fs"])
    w.add_expert_weights_norm(hp["norm"])
    add_rope_scaling(w, hp["rope"], hp["ctx"])


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, Hk, d, X, Fs = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"], hp["Fs"]
    p = Planner(ck, "model.")

    def bias(gg: str, name: str, n: int) -> None:
        if hp["bias"]:
            p.f32(gg, name, (n,))
        else:  # llama.cpp's graph requires the biases: zeros are the same attention
            p.add(Out(gg, (n,), False, lambda: iter([np.zeros(n, np.float32)])))

    embeddings(p, hp)
    head(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        a, m = h + "self_attn.", h + "mlp."
        p.f32(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
        p.copy(b + "attn_q.weight", a + "q_proj.weight", (H * d, D))
        bias(b + "attn_q.bias", a + "q_proj.bias", H * d)
        p.copy(b + "attn_k.weight", a + "k_proj.weight", (Hk * d, D))
        bias(b + "attn_k.bias", a + "k_proj.bias", Hk * d)
        p.copy(b + "attn_v.weight", a + "v_proj.weight", (Hk * d, D))
        bias(b + "attn_v.bias", a + "v_proj.bias", Hk * d)
        p.copy(b + "attn_output.weight", a + "o_proj.weight", (D, H * d))
        p.f32(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,))
        p.f32(b + "ffn_gate_inp.weight", m + "gate.weight", (X, D))
        qwen_experts(p, b, m + "experts.", hp)
        gate = p.hf(m + "shared_expert_gate.weight", (1, D))
        p.add(Out(b + "ffn_gate_inp_shexp.weight", (D,), False, first_row(ck, gate)))  # [1, D] -> [D]
        p.copy(b + "ffn_gate_shexp.weight", m + "shared_expert.gate_proj.weight", (Fs, D))
        p.copy(b + "ffn_up_shexp.weight", m + "shared_expert.up_proj.weight", (Fs, D))
        p.copy(b + "ffn_down_shexp.weight", m + "shared_expert.down_proj.weight", (D, Fs))
    return finish(p, ck)


ARCHES = {"qwen2_moe": Arch("qwen2moe", hparams, metadata, plan, TokenizerFacts("gpt2", "qwen2", add_bos=False))}  # Qwen1.5: no BOS
