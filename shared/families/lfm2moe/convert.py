"""`moe-pipe convert` rules for LFM2-MoE (HF `lfm2_moe` -> GGUF `lfm2moe`), as llama.cpp's
converter writes it: the conv layers get 0 kv heads, the final `embedding_norm` is
`token_embd_norm`, the experts' `expert_bias` is `exp_probs_b.bias`. docs/models.md § lfm2moe.

Legend (numpy order): V vocab, D hidden, H q heads, Hk kv heads, d head dim,
X experts, F expert ff width, Fd dense ff width, Lc conv width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    expert_rows,
    finish,
    head_matrix,
    stack,
)
from ...convert.rules import Arch, TokenizerFacts
from ...convert.source import Checkpoint
from ...convert.vocab import as_written
from ...errors import UserError
from ...gguf.vocab import LLAMA3_REGEX


def _layer_types(cfg: dict, n: int) -> list[str]:
    """`layer_types`, or (older configs) `full_attn_idxs`: which layers attend."""
    types = cfg.get("layer_types")
    if types is None:
        idxs = cfg.get("full_attn_idxs")
        if idxs is None:
            raise UserError("config.json: lfm2_moe needs layer_types (or full_attn_idxs) to know which layers attend")
        types = ["full_attention" if i in idxs else "conv" for i in range(n)]
    if len(types) != n:
        raise UserError(f"config.json: layer_types has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in ("full_attention", "conv")})
    if bad:
        raise UserError(f"config.json: layer_types {bad[0]!r} is not supported for lfm2_moe (full_attention or conv)")
    if "full_attention" not in types:
        # The GGUF tells a conv layer by its 0 kv heads: with no attention layer it would
        # hold no kv head count, and no reader (ours, llama.cpp's) could size the heads.
        raise UserError("config.json: lfm2_moe layer_types without a full_attention layer is not supported (the GGUF needs one)")
    return list(types)


def hparams(cfg: dict) -> dict[str, Any]:
    hp = base_hparams(cfg, 1e6)
    D, H, L = hp["D"], hp["H"], hp["L"]
    if hp["d"] * H != D:
        # llama.cpp's lfm2moe has no head-width key: its heads are n_embd / n_head wide.
        raise UserError(f"config.json: head_dim {hp['d']} is not hidden_size / num_attention_heads ({D} / {H}); llama.cpp assumes it")
    if cfg.get("conv_bias"):
        raise UserError("config.json: conv_bias=true is not supported for lfm2_moe (llama.cpp's short conv has no biases)")
    # llama.cpp's lfm2moe graph always renormalizes the chosen weights and never scales them.
    if cfg.get("norm_topk_prob") is False:
        raise UserError("config.json: norm_topk_prob=false is not supported for lfm2_moe (llama.cpp always renormalizes the top-k weights)")
    if float(cfg.get("routed_scaling_factor") or 1.0) != 1.0:
        raise UserError("config.json: routed_scaling_factor other than 1 is not supported for lfm2_moe (llama.cpp does not scale)")
    types = _layer_types(cfg, L)
    lead = int(cfg_get(cfg, "num_dense_layers", 0))
    if not 0 <= lead < L:
        raise UserError(f"config.json: num_dense_layers {lead} must be below num_hidden_layers {L}")
    hp.update(
        X=int(cfg_get(cfg, "num_experts")),
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "moe_intermediate_size")),
        Fd=int(cfg_get(cfg, "intermediate_size")),
        eps=float(cfg_get(cfg, "norm_eps", 1e-5)),
        conv=[t == "conv" for t in types],
        lead=lead,
        Lc=int(cfg_get(cfg, "conv_L_cache", 3)),
        bias=bool(cfg.get("use_expert_bias", True)),
        tied=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
    )
    if hp["Lc"] < 2:
        raise UserError(f"config.json: conv_L_cache {hp['Lc']} must be at least 2")
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_head_count_kv([0 if conv else hp["Hk"] for conv in hp["conv"]])  # 0: a short-conv layer
    w.add_leading_dense_block_count(hp["lead"])
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(hp["V"])
    w.add_shortconv_l_cache(hp["Lc"])
    add_rope_scaling(w, hp["rope"], hp["ctx"])


def _experts(p: Planner, b: str, e: str, hp: dict[str, Any]) -> None:
    """transformers 5's fused `gate_up_proj` (X, 2F, D), gate rows first, and `down_proj`
    (X, D, F); or the published per-expert w1 (gate), w3 (up), w2 (down)."""
    ck, D, X, F = p.ck, hp["D"], hp["X"], hp["F"]
    if p.prefix + e + "gate_up_proj" in ck:
        full = p.hf(e + "gate_up_proj", (X, 2 * F, D))
        p.add(Out(b + "ffn_gate_exps.weight", (X, F, D), True, expert_rows(ck, full, X, slice(0, F))))
        p.add(Out(b + "ffn_up_exps.weight", (X, F, D), True, expert_rows(ck, full, X, slice(F, 2 * F))))
        p.copy(b + "ffn_down_exps.weight", e + "down_proj", (X, D, F))
        return
    stack(p, b + "ffn_gate_exps.weight", [f"{e}{x}.w1.weight" for x in range(X)], (F, D))
    stack(p, b + "ffn_up_exps.weight", [f"{e}{x}.w3.weight" for x in range(X)], (F, D))
    stack(p, b + "ffn_down_exps.weight", [f"{e}{x}.w2.weight" for x in range(X)], (D, F))


def _squeezed(ck: Checkpoint, full: str) -> Callable[[], Iterator[np.ndarray]]:
    """The conv weight [D, 1, L] as [D, L] (llama.cpp's ssm_conv takes a 2-D kernel)."""
    return lambda: iter([ck.f32(full)[:, 0]])


def _zeros(n: int) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: iter([np.zeros(n, np.float32)])


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, Hk, d, X, Fd, Lc = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"], hp["Fd"], hp["Lc"]
    p = Planner(ck, "model.")
    embeddings(p, hp)
    p.f32("token_embd_norm.weight", "embedding_norm.weight", (D,))  # LFM2's final norm, llama.cpp's name
    if not hp["tied"]:
        head_matrix(p, hp, "lm_head.weight")
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        p.f32(b + "attn_norm.weight", h + "operator_norm.weight", (D,))
        if hp["conv"][i]:
            c = h + "conv."
            p.copy(b + "shortconv.in_proj.weight", c + "in_proj.weight", (3 * D, D))
            conv = p.hf(c + "conv.weight", (D, 1, Lc))
            p.add(Out(b + "shortconv.conv.weight", (D, Lc), False, _squeezed(ck, conv)))
            p.copy(b + "shortconv.out_proj.weight", c + "out_proj.weight", (D, D))
        else:
            a = h + "self_attn."
            p.copy(b + "attn_q.weight", a + "q_proj.weight", (H * d, D))
            p.copy(b + "attn_k.weight", a + "k_proj.weight", (Hk * d, D))
            p.copy(b + "attn_v.weight", a + "v_proj.weight", (Hk * d, D))
            p.copy(b + "attn_output.weight", a + "out_proj.weight", (D, H * d))
            p.f32(b + "attn_q_norm.weight", a + "q_layernorm.weight", (d,))
            p.f32(b + "attn_k_norm.weight", a + "k_layernorm.weight", (d,))
        p.f32(b + "ffn_norm.weight", h + "ffn_norm.weight", (D,))
        f = h + "feed_forward."
        if i < hp["lead"]:
            dense_ffn(p, b, f, D, Fd, ("w1", "w3", "w2"))
            continue
        p.f32(b + "ffn_gate_inp.weight", f + "gate.weight", (X, D))
        _experts(p, b, f + "experts.", hp)
        if hp["bias"]:
            p.f32(b + "exp_probs_b.bias", f + "expert_bias", (X,))
        else:  # llama.cpp's lfm2moe requires the tensor: zeros choose as no bias does
            p.add(Out(b + "exp_probs_b.bias", (X,), False, _zeros(X)))
    # A checkpoint saved with use_expert_bias=false may still carry the (unused) zero buffers.
    return finish(p, ck, ignore="" if hp["bias"] else r"\.feed_forward\.expert_bias$")


# LFM2: llama3's split (llama.cpp's "lfm2"), merges as usual, every prompt starting with <|startoftext|>.
_TOKENIZER = TokenizerFacts("gpt2", "lfm2", add_bos=True, known_pre={as_written(LLAMA3_REGEX): "lfm2"})
ARCHES = {"lfm2_moe": Arch("lfm2moe", hparams, metadata, plan, _TOKENIZER)}
