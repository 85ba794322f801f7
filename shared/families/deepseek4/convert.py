"""`moe-pipe convert` rules for DeepSeek-V4 (HF model_type `deepseek_v4` → GGUF `deepseek4`).

Names and keys as llama.cpp's converter writes them (docs/models.md § deepseek4). transformers
saves DeepSeek's own tensor names (`attn.wq_a`, `ffn.experts.{x}.w1`, `hc_attn_fn`, ...)
under `model.` (the head as `head.weight`); DeepSeek's release has the same names without
the prefix (and FP8/FP4 weights, not read here). Per-expert w1/w3/w2 are stacked into
ffn_gate_exps/ffn_up_exps/ffn_down_exps, the hash layers' tid2eid is written as I32. The
hyper-connection, compressor position-bias and sink tensors stay F32 (transformers keeps
them in float32 too).

The MTP block, as llama.cpp's converter (conversion/deepseek.py, `DeepseekV4Model`) has it:
its tensors (`mtp.*`) are skipped, block_count is the decoder's `num_hidden_layers`, and
`nextn_predict_layers` is the config's `num_nextn_predict_layers` when the config has the
key (set_gguf_parameters); `attention.compress_ratios` is DeepSeek's `compress_ratios` as
the config lists it, the MTP's entry (V4-Flash: a last 0) included. A transformers-saved
config has layer_types instead (llama.cpp's converter needs DeepSeek's key): its ratios get
a 0 for each MTP layer, V4-Flash's entry. `--no-mtp` changes nothing here (no block is
written either way, and llama.cpp writes the count without one).

Where transformers and llama.cpp's graph would disagree, the config is refused by name.
Legend (numpy order): D hidden, H heads, d head_dim, X experts, F expert ff width.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from ...convert.plan import Out, Planner, add_rope_scaling, base_hparams, cfg_get, common_meta, finish, stack
from ...convert.rules import Arch, TokenizerFacts
from ...convert.source import Checkpoint
from ...errors import UserError
from .spec import CSA_RATIO, SQRT_SOFTPLUS

_KINDS = {"sliding_attention": 0, "compressed_sparse_attention": CSA_RATIO, "heavily_compressed_attention": None}


def _ratios(cfg: dict, n: int, nextn: int) -> tuple[list[int], list[int]]:
    """Per layer 0 (sliding only), 4 (CSA) or the HCA rate: from layer_types and
    compress_rates (transformers) or compress_ratios (DeepSeek's config); and the list the
    file's `attention.compress_ratios` holds (module docstring: with the MTP's entries)."""
    if cfg.get("layer_types") is None:
        listed = [int(r) for r in cfg_get(cfg, "compress_ratios")]
        ratios, written = listed[:n], listed  # llama.cpp's converter writes the list as the config has it
    else:
        rates = {**{"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, **(cfg.get("compress_rates") or {})}
        if int(rates["compressed_sparse_attention"]) != CSA_RATIO:
            raise UserError(
                f"config.json: compress_rates.compressed_sparse_attention must be {CSA_RATIO} (the GGUF tells CSA layers by it)"
            )
        bad = [t for t in cfg["layer_types"] if t not in _KINDS]
        if bad:
            raise UserError(f"config.json: layer_types entry {bad[0]!r} is not a DeepSeek-V4 layer type ({', '.join(_KINDS)})")
        ratios = [int(rates[t]) if _KINDS[t] is None else int(_KINDS[t] or 0) for t in cfg["layer_types"]][:n]
        written = ratios + [0] * nextn  # the MTP's entry as DeepSeek's config has it (V4-Flash: 0)
    if len(ratios) != n or any(r not in (0, CSA_RATIO) and r <= 1 for r in written):
        raise UserError(f"config.json: compression ratios {written} must be 0, 4 or another ratio above 1 for each of {n} layers")
    return ratios, written


def _hash_layers(cfg: dict, n: int) -> int:
    """How many leading layers route by token id (llama.cpp: layers below hash_layer_count)."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        return min(n, int(cfg.get("num_hash_layers", 3)))
    count = sum(1 for t in types[:n] if t == "hash_moe")
    if list(types[:n]) != ["hash_moe"] * count + ["moe"] * (n - count):
        raise UserError(f"config.json: mlp_layer_types must be hash_moe layers first, then moe (has {types[:n]})")
    return count


def hparams(cfg: dict) -> dict[str, Any]:
    mt = "deepseek_v4"
    hp = base_hparams(cfg, 10000.0)
    n, d = hp["L"], hp["d"]
    for key, want in (("hidden_act", "silu"), ("scoring_func", "sqrtsoftplus")):
        if cfg.get(key, want) != want:
            raise UserError(f"config.json: {key} {cfg.get(key)!r} is not supported for {mt} ({want})")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise UserError(f"config.json: {key}=true is not supported for {mt} (llama.cpp's deepseek4 has no such biases)")
    if int(cfg_get(cfg, "num_key_value_heads", 1)) != 1:
        raise UserError(f"config.json: num_key_value_heads must be 1 for {mt} (one shared kv head)")
    if cfg.get("norm_topk_prob", True) is False:
        raise UserError(f"config.json: norm_topk_prob=false is not supported for {mt} (transformers' V4 always renormalizes)")
    limit = float(cfg.get("swiglu_limit", 10.0) or 0.0)
    if limit <= 0:
        raise UserError(f"config.json: swiglu_limit {limit} must be above 0 for {mt} (llama.cpp's deepseek4 needs the clamp)")
    factor = cfg.get("partial_rotary_factor")
    rope_dim = int(cfg["qk_rope_head_dim"]) if cfg.get("qk_rope_head_dim") else int(d * float(factor if factor is not None else 64 / 512))
    rp: dict[str, Any] = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    nested = isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
    # transformers nests {main, compress}; DeepSeek's config has one rope_scaling for the compressing layers
    main: dict[str, Any] = rp["main"] if nested else {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    comp: dict[str, Any] = rp["compress"] if nested else {**rp, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
    comp = {**comp, "rope_type": comp.get("rope_type") or comp.get("type") or "default"}
    if (main.get("rope_type") or "default") != "default":
        raise UserError(
            f"config.json: rope_parameters.main must be the default rope for {mt} (llama.cpp scales only the compressing layers)"
        )
    if comp["rope_type"] not in ("default", "yarn"):
        raise UserError(f"config.json: rope_parameters.compress type {comp['rope_type']!r} is not supported for {mt} (default, yarn)")
    if comp["rope_type"] == "yarn" and float(comp.get("attention_factor", 1.0)) != 1.0:
        raise UserError(f"config.json: {mt} YaRN with attention_factor != 1 is not supported (llama.cpp keeps the rotation unit-sized)")
    # llama.cpp's converter writes nextn_predict_layers only when the config has the key
    nextn = cfg.get("num_nextn_predict_layers")
    if nextn is not None and not 0 <= int(nextn) < n:
        raise UserError(f"config.json: num_nextn_predict_layers {nextn} must be 0..{n - 1}")
    ratios, ratios_written = _ratios(cfg, n, int(nextn or 0))
    hp.update(
        X=int(cfg_get(cfg, "n_routed_experts", ..., "num_local_experts")),
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "moe_intermediate_size")),
        Fd=0,
        shared=int(cfg.get("n_shared_experts", 1) or 0),
        ql=int(cfg_get(cfg, "q_lora_rank")),
        rope_dim=rope_dim,
        theta=float(main.get("rope_theta", 10000.0)),
        comp_theta=float(comp.get("rope_theta", cfg.get("compress_rope_theta", 160000.0))),
        rope=comp,  # the only scaled rope (add_rope_scaling); the main one is plain
        scale=float(cfg.get("routed_scaling_factor") or 1.0),
        limit=limit,
        ratios=ratios,
        ratios_written=ratios_written,
        nextn=None if nextn is None else int(nextn),
        hash=_hash_layers(cfg, n),
        window=int(cfg_get(cfg, "sliding_window")),
        groups=int(cfg_get(cfg, "o_groups")),
        o_rank=int(cfg_get(cfg, "o_lora_rank")),
        ih=int(cfg_get(cfg, "index_n_heads")),
        iw=int(cfg_get(cfg, "index_head_dim")),
        itopk=int(cfg_get(cfg, "index_topk")),
        hc=int(cfg_get(cfg, "hc_mult")),
        hc_iters=int(cfg_get(cfg, "hc_sinkhorn_iters")),
        hc_eps=float(cfg_get(cfg, "hc_eps")),
    )
    if hp["shared"] != 1:
        raise UserError(f"config.json: n_shared_experts {hp['shared']} is not supported for {mt} (one shared expert)")
    if hp["H"] % hp["groups"] or rope_dim % 2 or not 0 < rope_dim <= min(d, hp["iw"]):
        raise UserError(
            f"config.json: o_groups must divide the heads and the rope dims ({rope_dim}) be even and fit head_dim and index_head_dim"
        )
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    a = "deepseek4."
    common_meta(w, hp)
    w.add_vocab_size(hp["V"])
    w.add_head_count_kv(1)
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    w.add_q_lora_rank(hp["ql"])
    w.add_rope_dimension_count(hp["rope_dim"])
    add_rope_scaling(w, hp["rope"], hp["ctx"])
    w.add_uint32(a + "attention.output_lora_rank", hp["o_rank"])
    w.add_uint32(a + "attention.output_group_count", hp["groups"])
    w.add_array(a + "attention.compress_ratios", hp["ratios_written"])  # the MTP's entries too (module docstring)
    w.add_float32(a + "attention.compress_rope_freq_base", hp["comp_theta"])
    w.add_sliding_window(hp["window"])
    w.add_expert_shared_count(hp["shared"])
    w.add_expert_weights_scale(hp["scale"])
    w.add_expert_weights_norm(True)
    w.add_uint32(a + "expert_gating_func", SQRT_SOFTPLUS)  # gguf-py's enum stops at sigmoid: the int llama.cpp reads
    w.add_uint32(a + "hash_layer_count", hp["hash"])
    w.add_array(a + "swiglu_clamp_exp", [hp["limit"]] * hp["L"])
    w.add_uint32(a + "attention.indexer.head_count", hp["ih"])
    w.add_uint32(a + "attention.indexer.key_length", hp["iw"])
    w.add_uint32(a + "attention.indexer.top_k", hp["itopk"])
    w.add_uint32(a + "hyper_connection.count", hp["hc"])
    w.add_uint32(a + "hyper_connection.sinkhorn_iterations", hp["hc_iters"])
    w.add_float32(a + "hyper_connection.epsilon", hp["hc_eps"])
    if hp["nextn"] is not None:  # without the MTP tensors: our reader and llama.cpp's loader count them only when present
        w.add_nextn_predict_layers(hp["nextn"])


def _names(ck: Checkpoint) -> tuple[str, str]:
    """(prefix of the body, the head's name): transformers' save or DeepSeek's own."""
    return ("model.", "head.weight") if "model.embed_tokens.weight" in ck else ("", "head.weight")


def _tid2eid(p: Planner, gg: str, name: str, shape: tuple[int, int]) -> None:
    full = p.hf(name, shape)
    ck = p.ck
    p.add(Out(gg, shape, False, lambda: iter([np.ascontiguousarray(ck.raw(full), np.int32).view(np.uint8)]), Q.I32))


def _compressor(p: Planner, b: str, gg: str, hf: str, width: int, ratio: int, D: int, norm: int) -> None:
    p.copy(b + gg + "kv.weight", hf + "wkv.weight", (width, D))
    p.copy(b + gg + "gate.weight", hf + "wgate.weight", (width, D))
    p.f32(b + gg + "ape.weight", hf + "ape", (ratio, width))
    p.f32(b + gg + "norm.weight", hf + "norm.weight", (norm,))


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, d, X, F, V, hc = hp["D"], hp["H"], hp["d"], hp["X"], hp["F"], hp["V"], hp["hc"]
    ql, G, r = hp["ql"], hp["groups"], hp["o_rank"]
    mix = (2 + hc) * hc
    prefix, head_name = _names(ck)
    p = Planner(ck, prefix)
    emb = "embed_tokens.weight" if prefix else "embed.weight"
    p.copy("token_embd.weight", emb, (V, D))
    p.f32("output_norm.weight", "norm.weight", (D,))
    if head_name not in ck or ck.shape(head_name) != (V, D):
        raise UserError(f"{ck.dir}: tensor {head_name} is missing or not [{V}, {D}]")
    p.used.add(head_name)
    p.add(Out("output.weight", (V, D), True, lambda: iter([ck.f32(head_name)])))
    hh = "hc_head." if prefix else "hc_head_"
    p.f32("output_hc_fn.weight", hh + ("hc_fn" if prefix else "fn"), (hc, hc * D))
    p.f32("output_hc_base.weight", hh + ("hc_base" if prefix else "base"), (hc,))
    p.f32("output_hc_scale.weight", hh + ("hc_scale" if prefix else "scale"), (1,))
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        a, f = h + "attn.", h + "ffn."
        ratio = hp["ratios"][i]
        p.f32(b + "attn_norm.weight", h + "attn_norm.weight", (D,))
        p.f32(b + "attn_sinks.weight", a + "attn_sink", (H,))
        p.copy(b + "attn_q_a.weight", a + "wq_a.weight", (ql, D))
        p.f32(b + "attn_q_a_norm.weight", a + "q_norm.weight", (ql,))
        p.copy(b + "attn_q_b.weight", a + "wq_b.weight", (H * d, ql))
        p.copy(b + "attn_kv.weight", a + "wkv.weight", (d, D))
        kv_norm = "norm.weight" if prefix + a + "norm.weight" in ck else "kv_norm.weight"
        p.f32(b + "attn_kv_a_norm.weight", a + kv_norm, (d,))
        p.copy(b + "attn_output_a.weight", a + "wo_a.weight", (G * r, H * d // G))
        p.copy(b + "attn_output_b.weight", a + "wo_b.weight", (D, G * r))
        for part in ("attn", "ffn"):
            p.f32(b + f"hc_{part}_fn.weight", h + f"hc_{part}_fn", (mix, hc * D))
            p.f32(b + f"hc_{part}_base.weight", h + f"hc_{part}_base", (mix,))
            p.f32(b + f"hc_{part}_scale.weight", h + f"hc_{part}_scale", (3,))
        if ratio:
            _compressor(p, b, "attn_compressor_", a + "compressor.", (2 if ratio == CSA_RATIO else 1) * d, ratio, D, d)
        if ratio == CSA_RATIO:
            iw = hp["iw"]
            p.copy(b + "indexer.proj.weight", a + "indexer.weights_proj.weight", (hp["ih"], D))
            p.copy(b + "indexer.attn_q_b.weight", a + "indexer.wq_b.weight", (hp["ih"] * iw, ql))
            _compressor(p, b, "indexer_compressor_", a + "indexer.compressor.", 2 * iw, ratio, D, iw)
        p.f32(b + "ffn_gate_inp.weight", f + "gate.weight", (X, D))
        if i < hp["hash"]:
            _tid2eid(p, b + "ffn_gate_tid2eid.weight", f + "gate.tid2eid", (V, hp["K"]))
        else:
            p.f32(b + "exp_probs_b.bias", f + "gate.bias", (X,))
        p.f32(b + "ffn_norm.weight", h + "ffn_norm.weight", (D,))
        e = f + "experts."
        stack(p, b + "ffn_gate_exps.weight", [f"{e}{x}.w1.weight" for x in range(X)], (F, D))
        stack(p, b + "ffn_down_exps.weight", [f"{e}{x}.w2.weight" for x in range(X)], (D, F))
        stack(p, b + "ffn_up_exps.weight", [f"{e}{x}.w3.weight" for x in range(X)], (F, D))
        s = f + "shared_experts."
        p.copy(b + "ffn_gate_shexp.weight", s + "w1.weight", (F, D))
        p.copy(b + "ffn_down_shexp.weight", s + "w2.weight", (D, F))
        p.copy(b + "ffn_up_shexp.weight", s + "w3.weight", (F, D))
    return finish(p, ck, ignore=r"^(model\.)?mtp\.")  # the MTP block, skipped as llama.cpp's converter does


# DeepSeek-V4's tokenizer is V3's byte-level BPE (llama.cpp's "deepseek-v3" split), a BOS on every prompt.
TOKENIZER = TokenizerFacts("gpt2", "deepseek-v3", add_bos=True, known_pre={"[\r\n]": "deepseek-llm", r"\p{N}{1,3}": "deepseek-v3"})
ARCHES = {"deepseek_v4": Arch("deepseek4", hparams, metadata, plan, TOKENIZER)}
