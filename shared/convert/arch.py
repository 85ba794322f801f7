"""Per-architecture rules of `moe-pipe convert`: HF config -> GGUF keys, HF tensors -> GGUF tensors.

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

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType

from moe_pipe.shared.convert.source import Checkpoint
from moe_pipe.shared.errors import UserError


@dataclass(frozen=True)
class Out:
    """One GGUF tensor to write. `parts()` yields float32 slabs along axis 0 whose
    concatenation is the tensor (one per expert for stacked experts), or raw
    bytes shaped (..., row_bytes) when `raw_qtype` is set."""

    name: str
    shape: tuple[int, ...]
    matrix: bool  # a weight matrix: takes --outtype (else kept F32)
    parts: Callable[[], Iterator[np.ndarray]]
    raw_qtype: Q | None = None


class _Planner:
    """Builds `Out`s from checkpoint tensors, checking shapes and recording what was used."""

    def __init__(self, ck: Checkpoint, prefix: str):
        self.ck, self.prefix = ck, prefix
        self.used: set[str] = set()
        self.outs: list[Out] = []

    def hf(self, name: str, shape: tuple[int, ...]) -> str:
        """Check that checkpoint tensor `prefix+name` exists with `shape`; return its full name."""
        full = self.prefix + name
        if full not in self.ck:
            raise UserError(f"{self.ck.dir}: tensor {full} is missing from the checkpoint (expected shape {list(shape)})")
        got = self.ck.shape(full)
        if got != tuple(shape):
            raise UserError(f"{self.ck.dir}: tensor {full} has shape {list(got)}, but config.json implies {list(shape)}")
        self.used.add(full)
        return full

    def copy(self, gg: str, name: str, shape: tuple[int, ...], matrix: bool | None = None) -> None:
        """A tensor stored as GGUF wants it (rows = outputs)."""
        full = self.hf(name, shape)
        self.outs.append(Out(gg, tuple(shape), len(shape) >= 2 if matrix is None else matrix, _slabs(self.ck, full, shape)))

    def add(self, out: Out) -> None:
        self.outs.append(out)

    def f32(self, gg: str, name: str, shape: tuple[int, ...]) -> None:
        self.copy(gg, name, shape, matrix=False)


# --- config helpers -----------------------------------------------------------------


# Rows per slab of a 2-D tensor: bounds the float32 temporaries for a 262144-row
# embedding to ~64 MB instead of ~3 GB. Rows are independent for every outtype.
_SLAB_ELEMS = 16 << 20


def _slabs(ck: Checkpoint, full: str, shape: tuple[int, ...]) -> Callable[[], Iterator[np.ndarray]]:
    """Parts of a tensor stored as GGUF wants it: one per expert (3-D) or row slabs (2-D)."""
    if len(shape) == 3:
        return lambda: (ck.f32(full, e) for e in range(shape[0]))
    if len(shape) == 2:
        step = max(1, _SLAB_ELEMS // max(1, shape[1]))
        return lambda: (ck.f32(full, slice(r, r + step)) for r in range(0, shape[0], step))
    return lambda: iter([ck.f32(full)])


def _expert_rows(ck: Checkpoint, full: str, n_expert: int, rows: slice) -> Callable[[], Iterator[np.ndarray]]:
    """Rows `rows` of every expert of a fused (X, rows, in) tensor, one expert per part."""
    return lambda: (ck.f32(full, (x, rows)) for x in range(n_expert))


def _get(cfg: dict, key: str, default: Any = ..., *alts: str) -> Any:
    for k in (key, *alts):
        if cfg.get(k) is not None:
            return cfg[k]
    if default is ...:
        raise UserError(f"config.json: key {key!r} is missing")
    return default


def _rope(cfg: dict, default_theta: float) -> dict[str, Any]:
    """rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x) as one dict."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp and not any(isinstance(v, dict) for v in rp.values()):
        d = dict(rp)
    else:
        d = dict(cfg.get("rope_scaling") or {})
        d.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    d["rope_type"] = d.get("rope_type") or d.get("type") or "default"
    d.setdefault("rope_theta", default_theta)
    return d


def _add_rope_scaling(w: GGUFWriter, rp: dict[str, Any], ctx: int) -> None:
    kind = rp["rope_type"]
    if kind == "default":
        return
    if kind == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))
        return
    if kind == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp.get("original_max_position_embeddings") or ctx))
        if float(rp.get("beta_fast", 32.0)) != 32.0:
            w.add_rope_scaling_yarn_beta_fast(float(rp["beta_fast"]))
        if float(rp.get("beta_slow", 1.0)) != 1.0:
            w.add_rope_scaling_yarn_beta_slow(float(rp["beta_slow"]))
        return
    raise UserError(f"config.json: rope type {kind!r} is not supported by convert (supported: default, linear, yarn)")


def _common_meta(w: GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_context_length(hp["ctx"])
    w.add_embedding_length(hp["D"])
    w.add_block_count(hp["L"])
    w.add_feed_forward_length(hp["Fd"])
    w.add_expert_feed_forward_length(hp["F"])
    w.add_expert_count(hp["X"])
    w.add_expert_used_count(hp["K"])
    w.add_head_count(hp["H"])
    w.add_layer_norm_rms_eps(hp["eps"])
    w.add_rope_freq_base(hp["theta"])


def _base_hparams(cfg: dict, default_theta: float) -> dict[str, Any]:
    D, H = int(_get(cfg, "hidden_size")), int(_get(cfg, "num_attention_heads"))
    rp = _rope(cfg, default_theta)
    return dict(
        D=D,
        H=H,
        L=int(_get(cfg, "num_hidden_layers")),
        Hk=int(_get(cfg, "num_key_value_heads", H)),
        d=int(_get(cfg, "head_dim", D // H)),
        V=int(_get(cfg, "vocab_size")),
        ctx=int(_get(cfg, "max_position_embeddings", 4096)),
        eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        rope=rp,
        theta=float(rp["rope_theta"]),
    )


def _embeddings(p: _Planner, hp: dict[str, Any]) -> None:
    V, D = hp["V"], hp["D"]
    p.copy("token_embd.weight", "embed_tokens.weight", (V, D))


def _head(p: _Planner, hp: dict[str, Any], lm_head: str) -> None:
    p.f32("output_norm.weight", "norm.weight", (hp["D"],))
    if not hp["tied"]:
        _head_matrix(p, hp, lm_head)


def _head_matrix(p: _Planner, hp: dict[str, Any], full: str) -> None:
    """The untied output head `full` (a name without the planner's prefix)."""
    V, D = hp["V"], hp["D"]
    if full not in p.ck:
        raise UserError(f"{p.ck.dir}: tensor {full} is missing (config says tie_word_embeddings=false)")
    shape = p.ck.shape(full)
    if shape != (V, D):
        raise UserError(f"{p.ck.dir}: tensor {full} has shape {list(shape)}, but config.json implies {[V, D]}")
    p.used.add(full)
    p.add(Out("output.weight", (V, D), True, _slabs(p.ck, full, (V, D))))


# --- qwen3moe -----------------------------------------------------------------------


def _qwen3_hparams(cfg: dict) -> dict[str, Any]:
    hp = _base_hparams(cfg, 10000.0)
    hp.update(
        X=int(_get(cfg, "num_experts", ..., "num_local_experts")),
        K=int(_get(cfg, "num_experts_per_tok")),
        F=int(_get(cfg, "moe_intermediate_size")),
        Fd=int(_get(cfg, "intermediate_size", 0)),
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
    _common_meta(w, hp)
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    _add_rope_scaling(w, hp["rope"], hp["ctx"])


def _stack(p: _Planner, gg: str, names: list[str], shape: tuple[int, ...]) -> None:
    """Per-expert 2-D tensors stacked along a new leading axis (X, out, in)."""
    full = [p.hf(n, shape) for n in names]
    ck = p.ck
    p.add(Out(gg, (len(names), *shape), True, lambda: (ck.f32(f) for f in full)))


def _qwen3_plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, Hk, d, X = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"]
    p = _Planner(ck, "model.")
    _embeddings(p, hp)
    _head(p, hp, "lm_head.weight")
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
        _qwen_experts(p, b, h + "mlp.experts.", hp)
    return _finish(p, ck)


def _qwen_experts(p: _Planner, b: str, e: str, hp: dict[str, Any]) -> None:
    """Routed experts of qwen3moe / qwen35moe: transformers 5's fused `gate_up_proj`
    (X, 2F, D), gate rows first, or per-expert Linear weights (as checkpoints store them)."""
    ck, D, X, F = p.ck, hp["D"], hp["X"], hp["F"]
    if p.prefix + e + "gate_up_proj" in ck:
        full = p.hf(e + "gate_up_proj", (X, 2 * F, D))
        p.add(Out(b + "ffn_gate_exps.weight", (X, F, D), True, _expert_rows(ck, full, X, slice(0, F))))
        p.add(Out(b + "ffn_up_exps.weight", (X, F, D), True, _expert_rows(ck, full, X, slice(F, 2 * F))))
        p.copy(b + "ffn_down_exps.weight", e + "down_proj", (X, D, F))
    else:
        _stack(p, b + "ffn_gate_exps.weight", [f"{e}{x}.gate_proj.weight" for x in range(X)], (F, D))  # X F D
        _stack(p, b + "ffn_up_exps.weight", [f"{e}{x}.up_proj.weight" for x in range(X)], (F, D))  # X F D
        _stack(p, b + "ffn_down_exps.weight", [f"{e}{x}.down_proj.weight" for x in range(X)], (D, F))  # X D F


# --- gpt-oss ------------------------------------------------------------------------


def _gpt_oss_hparams(cfg: dict) -> dict[str, Any]:
    hp = _base_hparams(cfg, 150000.0)
    L = hp["L"]
    hp.update(
        X=int(_get(cfg, "num_local_experts", ..., "num_experts")),
        K=int(_get(cfg, "num_experts_per_tok")),
        F=int(_get(cfg, "intermediate_size")),
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
    _common_meta(w, hp)
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    if hp["window"]:
        w.add_sliding_window(hp["window"])
    _add_rope_scaling(w, hp["rope"], hp["ctx"])


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


def _gpt_oss_experts(p: _Planner, b: str, e: str, hp: dict[str, Any]) -> None:
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
    p = _Planner(ck, "model.")
    _embeddings(p, hp)
    _head(p, hp, "lm_head.weight")
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
    return _finish(p, ck)


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
    hp = _base_hparams({**cfg, "rope_parameters": rf}, 1e6)
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
        X=int(_get(cfg, "num_experts")),
        K=int(_get(cfg, "top_k_experts")),
        F=int(_get(cfg, "moe_intermediate_size")),
        Fd=int(_get(cfg, "intermediate_size")),
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
    hp["ctx"] = int(_get(cfg, "max_position_embeddings", 131072))
    return hp


def _gemma4_meta(w: GGUFWriter, hp: dict[str, Any]) -> None:
    _common_meta(w, hp)
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
    p = _Planner(ck, prefix)
    _embeddings(p, hp)
    n_pairs = hp["d_full"] // 2
    freqs = np.full(n_pairs, 1e30, np.float32)
    freqs[: hp["rot_pairs"]] = hp["rope_factor"]
    p.add(Out("rope_freqs.weight", (n_pairs,), False, lambda: iter([freqs])))
    _head(p, hp, "lm_head.weight")
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
    return _finish(
        p, ck, ignore=r"model\.(vision_tower|embed_vision|audio_tower|embed_audio|vision_model|multi_modal_projector)\.|lm_head\.weight$"
    )


# --- qwen35moe -----------------------------------------------------------------------


def _qwen35_hparams(cfg: dict) -> dict[str, Any]:
    hp = _base_hparams(cfg, 1e7)
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
    G, Hv = int(_get(cfg, "linear_num_key_heads")), int(_get(cfg, "linear_num_value_heads"))
    dk, dv = int(_get(cfg, "linear_key_head_dim")), int(_get(cfg, "linear_value_head_dim"))
    if dk != dv or Hv % G:
        raise UserError(
            f"config.json: linear attention needs linear_key_head_dim = linear_value_head_dim ({dk}, {dv}) "
            f"and linear_num_value_heads a multiple of linear_num_key_heads ({Hv}, {G}), as llama.cpp does"
        )
    prf = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    sections = [int(x) for x in (rp.get("mrope_section") or [11, 11, 10])][:4]
    hp.update(
        X=int(_get(cfg, "num_experts")),
        K=int(_get(cfg, "num_experts_per_tok")),
        F=int(_get(cfg, "moe_intermediate_size")),
        Fs=int(_get(cfg, "shared_expert_intermediate_size")),
        interval=interval,
        full=full,
        G=G,
        Hv=Hv,
        dk=dk,
        kernel=int(_get(cfg, "linear_conv_kernel_dim")),
        n_rot=int(hp["d"] * prf),
        sections=sections + [0] * (4 - len(sections)),
    )
    hp["Fd"] = hp["Fs"]
    return hp


def _qwen35_meta(w: GGUFWriter, hp: dict[str, Any]) -> None:
    _common_meta(w, hp)
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


def _qwen35_linear(p: _Planner, b: str, a: str, hp: dict[str, Any]) -> None:
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


def _first_row(ck: Checkpoint, full: str) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: iter([ck.f32(full)[0]])


def _qwen35_plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, Hk, d, X, Fs = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"], hp["Fs"]
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in ck else "model."
    p = _Planner(ck, prefix)

    def plus_one(gg: str, name: str, n: int) -> None:  # Qwen3.5's RMSNorms scale by (1 + w): the GGUF stores 1 + w
        full = p.hf(name, (n,))
        p.add(Out(gg, (n,), False, lambda: iter([ck.f32(full) + np.float32(1)])))

    _embeddings(p, hp)
    full_norm = p.hf("norm.weight", (D,))
    p.add(Out("output_norm.weight", (D,), False, lambda: iter([ck.f32(full_norm) + np.float32(1)])))
    if not hp["tied"]:
        _head_matrix(p, hp, "lm_head.weight")
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
        _qwen_experts(p, b, m + "experts.", hp)
        gate = p.hf(m + "shared_expert_gate.weight", (1, D))
        p.add(Out(b + "ffn_gate_inp_shexp.weight", (D,), False, _first_row(ck, gate)))  # [1, D] -> [D]
        p.copy(b + "ffn_gate_shexp.weight", m + "shared_expert.gate_proj.weight", (Fs, D))
        p.copy(b + "ffn_up_shexp.weight", m + "shared_expert.up_proj.weight", (Fs, D))
        p.copy(b + "ffn_down_shexp.weight", m + "shared_expert.down_proj.weight", (D, Fs))
    # The vision tower and the MTP block are not converted (llama.cpp keeps the tower in a separate mmproj file).
    return _finish(p, ck, ignore=r"^model\.visual\.|^mtp\.")


# --- shared -------------------------------------------------------------------------

# Buffers some checkpoints carry that no GGUF needs.
_ALWAYS_IGNORED = r"\.rotary_emb\.inv_freq$|\.rotary_emb\.|^lm_head\.weight$"


def _finish(p: _Planner, ck: Checkpoint, ignore: str = "") -> list[Out]:
    pat = re.compile(_ALWAYS_IGNORED + (f"|{ignore}" if ignore else ""))
    left = [n for n in ck.names() if n not in p.used and not pat.search(n)]
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise UserError(
            f"{ck.dir}: tensor {left[0]}{more} is not used by convert; the checkpoint has parts this model type does not map (an unsupported variant?)"
        )
    return p.outs


@dataclass(frozen=True)
class Arch:
    gguf_arch: str
    hparams: Callable[[dict], dict[str, Any]]
    metadata: Callable[[GGUFWriter, dict[str, Any]], None]
    plan: Callable[[dict[str, Any], Checkpoint], list[Out]]


ARCHES: dict[str, Arch] = {
    "qwen3_moe": Arch("qwen3moe", _qwen3_hparams, _qwen3_meta, _qwen3_plan),
    "gpt_oss": Arch("gpt-oss", _gpt_oss_hparams, _gpt_oss_meta, _gpt_oss_plan),
    "gemma4_text": Arch("gemma4", _gemma4_hparams, _gemma4_meta, _gemma4_plan),
    "qwen3_5_moe_text": Arch("qwen35moe", _qwen35_hparams, _qwen35_meta, _qwen35_plan),
}
SUPPORTED = "qwen3_moe, gpt_oss, gemma4, qwen3_5_moe"


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
