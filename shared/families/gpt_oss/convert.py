"""`moe-pipe convert` rules for gpt-oss (HF model_type `gpt_oss` -> GGUF arch `gpt-oss`).

Attention with biases and sinks, sliding window on even layers; the experts of an
MXFP4 checkpoint are repacked losslessly and stay MXFP4 whatever --outtype says,
those of a dequantized one are split from the interleaved `gate_up_proj`.
docs/models.md § From Hugging Face names; docs/formats.md § MXFP4 from Hugging Face checkpoints.

Legend (numpy order, last axis = ggml ne0): D hidden, H q heads, Hk kv heads, d head dim,
X experts, F expert ff width, G 32-wide blocks of a row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
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
)
from ...convert.rules import Arch, TokenizerFacts
from ...convert.source import Checkpoint
from ...errors import UserError


def hparams(cfg: dict) -> dict[str, Any]:
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


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
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


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
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


ARCHES = {"gpt_oss": Arch("gpt-oss", hparams, metadata, plan, TokenizerFacts("gpt2", "gpt-4o", add_bos=False))}
