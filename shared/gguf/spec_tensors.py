"""The tensors a model file must hold, checked against its `ModelSpec` when it is
opened: every tensor the forward pass will multiply exists with the shape the
metadata implies and a type the kernels compute on, so a file whose metadata
and tensors disagree fails with the tensor named instead of as a numpy error
inside a worker process.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.reader import GGUFFile
from moe_pipe.shared.gguf.spec import ModelSpec

_VECTOR_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
# What each architecture's load_layer (shared/model/<arch>.py) asks for, so a
# missing tensor fails at open rather than when a worker builds the model.
_REQUIRED = ("token_embd.weight", "output_norm.weight")
# lfm2moe's final norm keeps llama.cpp's name (LFM2's "embedding_norm", applied after the last layer).
_REQUIRED_TOP = {"lfm2moe": ("token_embd.weight", "token_embd_norm.weight")}
_ATTN = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_output.weight")
_REQUIRED_PER_LAYER = {
    "qwen3moe": (*_ATTN, "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight"),
    "llama": (*_ATTN, "attn_v.weight", "ffn_norm.weight", "ffn_gate_inp.weight"),
    "qwen2moe": (
        *_ATTN,
        "attn_v.weight",
        "attn_q.bias",
        "attn_k.bias",
        "attn_v.bias",
        "ffn_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_inp_shexp.weight",
        "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
    ),
    "gpt-oss": (
        *_ATTN,
        "attn_v.weight",
        "attn_q.bias",
        "attn_k.bias",
        "attn_v.bias",
        "attn_output.bias",
        "attn_sinks.weight",
        "post_attention_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_inp.bias",
    ),
    "gemma4": (
        *_ATTN,
        "attn_q_norm.weight",
        "attn_k_norm.weight",
        "post_attention_norm.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
        "post_ffw_norm_1.weight",
        "pre_ffw_norm_2.weight",
        "post_ffw_norm_2.weight",
        "post_ffw_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_inp.scale",
        "ffn_down_exps.scale",
    ),
}
_QWEN35_COMMON = (
    "attn_norm.weight",
    "post_attention_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp_shexp.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
)
# qwen35moe: what a layer needs depends on its kind (full attention or linear attention).
_QWEN35_ATTN = (
    *_QWEN35_COMMON,
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
)
_QWEN35_LINEAR = (
    *_QWEN35_COMMON,
    *(f"{n}.weight" for n in ("attn_qkv", "attn_gate", "ssm_conv1d", "ssm_beta", "ssm_alpha", "ssm_norm", "ssm_out")),
    "ssm_dt.bias",
    "ssm_a",
)
# glm4moe: the leading dense layers have a dense FFN, the others a router with its
# selection bias (and the shared expert when expert_shared_count > 0).
_GLM4_ATTN = (*_ATTN, "attn_v.weight", "post_attention_norm.weight")
_GLM4_DENSE = (*_GLM4_ATTN, "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_GLM4_MOE = (*_GLM4_ATTN, "ffn_gate_inp.weight", "exp_probs_b.bias")
_GLM4_SHARED = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
# deepseek2: MLA (attn_q, or attn_q_a → norm → attn_q_b), then a dense FFN or router (+ shared experts).
_DS2_ATTN: tuple[str, ...] = ("attn_norm.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_k_b.weight")
_DS2_ATTN += ("attn_v_b.weight", "attn_output.weight", "ffn_norm.weight")


def _deepseek2_required(spec: ModelSpec, i: int) -> tuple[str, ...]:
    q = ("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight") if spec.q_lora_rank else ("attn_q.weight",)
    if not spec.has_experts(i):
        return (*_DS2_ATTN, *q, "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    return (*_DS2_ATTN, *q, "ffn_gate_inp.weight", *(_GLM4_SHARED if spec.n_expert_shared else ()))


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """The tensors (without "blk.i.") that layer i's forward pass asks for."""
    if spec.arch == "lfm2moe":  # a short-conv or attention operator, then a dense FFN or the routed experts
        op = _LFM2_CONV if spec.is_recurrent(i) else _LFM2_ATTN
        return ("attn_norm.weight", *op, "ffn_norm.weight", *(("ffn_gate_inp.weight",) if spec.has_experts(i) else _LFM2_DENSE))
    if spec.arch == "qwen35moe":
        return _QWEN35_LINEAR if spec.is_recurrent(i) else _QWEN35_ATTN
    if spec.arch == "deepseek2":
        return _deepseek2_required(spec, i)
    if spec.arch == "glm4moe":
        if not spec.has_experts(i):
            return _GLM4_DENSE
        return _GLM4_MOE + (_GLM4_SHARED if spec.n_expert_shared else ())
    return _REQUIRED_PER_LAYER.get(spec.arch, ())


_NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "post_ffw_norm_1", "pre_ffw_norm_2", "post_ffw_norm_2")


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> ("matrix" | "vector", numpy shape, where the shape comes from)
    for the dense tensors, named the llama.cpp way, whose shape the metadata
    fixes. Absent names are fine here: the architecture asks for what it needs
    and names what is missing."""
    d, v, e, h = spec.n_embd, spec.n_vocab, spec.n_expert, spec.n_head
    out = {
        "token_embd.weight": ("matrix", (v, d), f"n_vocab {v}, n_embd {d}"),
        "output.weight": ("matrix", (v, d), f"n_vocab {v}, n_embd {d}"),
        "output_norm.weight": ("vector", (d,), f"n_embd {d}"),
        "rope_freqs.weight": ("vector", (spec.rope.dim // 2,), f"{spec.rope.dim} rotated dims"),
    }
    for i in range(spec.n_layer):
        p, hk, hv, kv = f"blk.{i}.", spec.head_dim_k[i], spec.head_dim_v[i], spec.n_head_kv[i]
        q, k, vv = f"{h} heads × {hk} key dims", f"{kv} kv heads × {hk} key dims", f"{kv} kv heads × {hv} value dims"
        out.update({p + n + ".weight": ("vector", (d,), f"n_embd {d}") for n in _NORMS})
        out.update(
            {
                p + "attn_q.weight": ("matrix", (h * hk, d), f"{q}, n_embd {d}"),
                p + "attn_k.weight": ("matrix", (kv * hk, d), f"{k}, n_embd {d}"),
                p + "attn_v.weight": ("matrix", (kv * hv, d), f"{vv}, n_embd {d}"),
                p + "attn_output.weight": ("matrix", (d, h * hv), f"n_embd {d}, {h} heads × {hv} value dims"),
                p + "attn_q.bias": ("vector", (h * hk,), q),
                p + "attn_k.bias": ("vector", (kv * hk,), k),
                p + "attn_v.bias": ("vector", (kv * hv,), vv),
                p + "attn_output.bias": ("vector", (d,), f"n_embd {d}"),
                p + "attn_q_norm.weight": ("vector", (hk,), f"{hk} key dims"),
                p + "attn_k_norm.weight": ("vector", (hk,), f"{hk} key dims"),
                p + "attn_sinks.weight": ("vector", (h,), f"{h} heads"),
                p + "ffn_gate_inp.weight": ("matrix", (e, d), f"{e} experts, n_embd {d}"),
                p + "ffn_gate_inp.bias": ("vector", (e,), f"{e} experts"),
                p + "ffn_gate_inp.scale": ("vector", (d,), f"n_embd {d}"),
                p + "ffn_down_exps.scale": ("vector", (e,), f"{e} experts"),
                p + "layer_output_scale.weight": ("vector", (1,), "one scale per layer"),
            }
        )
        if spec.arch == "lfm2moe":
            out.update(_lfm2moe_shapes(spec, i))
        if spec.arch == "qwen35moe":
            out.update(_qwen35_shapes(spec, i))
        if spec.arch == "qwen2moe":  # the shared expert (its gate, [D] or [1, D], is checked when it loads)
            fs, pi = spec.n_ff_shexp, f"blk.{i}."
            out[pi + "ffn_gate_shexp.weight"] = ("matrix", (fs, d), f"shared expert width {fs}, n_embd {d}")
            out[pi + "ffn_up_shexp.weight"] = ("matrix", (fs, d), f"shared expert width {fs}, n_embd {d}")
            out[pi + "ffn_down_shexp.weight"] = ("matrix", (d, fs), f"n_embd {d}, shared expert width {fs}")
        if spec.arch == "glm4moe":
            out.update(_glm4moe_shapes(spec, i))
        if spec.arch == "deepseek2":
            out.update(_deepseek2_shapes(spec, i))
    return out


def _deepseek2_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """deepseek2's MLA tensors in layer i (numpy order), and its FFNs as glm4moe's
    (a leading dense layer's n_ff-wide FFN, or the shared experts)."""
    p, d, h, r = f"blk.{i}.", spec.n_embd, spec.n_head, spec.kv_lora_rank
    qk, rope, v, ql = spec.head_dim_k_mla, spec.rope.dim, spec.head_dim_v_mla, spec.q_lora_rank
    nope, heads = qk - rope, f"{h} heads"
    out = _glm4moe_shapes(spec, i)
    out.pop(p + "exp_probs_b.bias", None)  # optional here (V2 has none); its shape is checked below when present
    out.update(
        {
            p + "attn_q.weight": ("matrix", (h * qk, d), f"{heads} × {qk} (nope + rope), n_embd {d}"),
            p + "attn_q_a.weight": ("matrix", (ql, d), f"q_lora_rank {ql}, n_embd {d}"),
            p + "attn_q_a_norm.weight": ("vector", (ql,), f"q_lora_rank {ql}"),
            p + "attn_q_b.weight": ("matrix", (h * qk, ql), f"{heads} × {qk}, q_lora_rank {ql}"),
            p + "attn_kv_a_mqa.weight": ("matrix", (r + rope, d), f"kv_lora_rank {r} + {rope} rope dims, n_embd {d}"),
            p + "attn_kv_a_norm.weight": ("vector", (r,), f"kv_lora_rank {r}"),
            p + "attn_k_b.weight": ("matrix", (h, r, nope), f"{heads}, kv_lora_rank {r}, {nope} nope dims"),
            p + "attn_v_b.weight": ("matrix", (h, v, r), f"{heads}, {v} value dims, kv_lora_rank {r}"),
            p + "attn_output.weight": ("matrix", (d, h * v), f"n_embd {d}, {heads} × {v} value dims"),
        }
    )
    if spec.has_experts(i):
        out[p + "exp_probs_b.bias"] = ("vector", (spec.n_expert,), f"{spec.n_expert} experts")
    return out


def _glm4moe_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """glm4moe's own tensors in layer i: a leading dense layer's FFN (n_ff wide), or
    the routed layer's selection bias and shared expert (n_ff_exp × expert_shared_count)."""
    p, d, e = f"blk.{i}.", spec.n_embd, spec.n_expert
    if not spec.has_experts(i):
        f = spec.n_ff
        return {
            p + "ffn_gate.weight": ("matrix", (f, d), f"feed_forward_length {f}, n_embd {d}"),
            p + "ffn_up.weight": ("matrix", (f, d), f"feed_forward_length {f}, n_embd {d}"),
            p + "ffn_down.weight": ("matrix", (d, f), f"n_embd {d}, feed_forward_length {f}"),
        }
    fs = spec.n_ff_shexp
    return {
        p + "exp_probs_b.bias": ("vector", (e,), f"{e} experts"),
        p + "ffn_gate_shexp.weight": ("matrix", (fs, d), f"shared expert width {fs}, n_embd {d}"),
        p + "ffn_up_shexp.weight": ("matrix", (fs, d), f"shared expert width {fs}, n_embd {d}"),
        p + "ffn_down_shexp.weight": ("matrix", (d, fs), f"n_embd {d}, shared expert width {fs}"),
    }


_LFM2_CONV = ("shortconv.in_proj.weight", "shortconv.conv.weight", "shortconv.out_proj.weight")
_LFM2_ATTN = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight")
_LFM2_DENSE = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _lfm2moe_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """lfm2moe's own tensors in layer i: the short conv (in_proj → B, C, x; a depthwise
    conv of width l_cache), the experts' selection bias; and the final norm."""
    p, d, e, k = f"blk.{i}.", spec.n_embd, spec.n_expert, spec.ssm_conv_kernel
    return {
        "token_embd_norm.weight": ("vector", (d,), f"n_embd {d}"),
        p + "shortconv.in_proj.weight": ("matrix", (3 * d, d), f"3 × n_embd {d} (B, C, x), n_embd {d}"),
        p + "shortconv.conv.weight": ("vector", (d, k), f"n_embd {d} channels × l_cache {k}"),
        p + "shortconv.out_proj.weight": ("matrix", (d, d), f"n_embd {d}, n_embd {d}"),
        p + "exp_probs_b.bias": ("vector", (e,), f"{e} experts"),
    }


def _qwen35_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """qwen35moe's own tensors in layer i: q carries a gate per head (2 × the
    width), the shared expert, and the linear-attention (ssm_*) tensors."""
    p, d, h, hk = f"blk.{i}.", spec.n_embd, spec.n_head, spec.head_dim_k[i]
    fs, st, vh, ch = spec.n_ff_shexp, spec.ssm_state, spec.ssm_heads, spec.ssm_conv_channels
    out: dict[str, tuple[str, tuple[int, ...], str]] = {
        p + "attn_q.weight": ("matrix", (2 * h * hk, d), f"{h} heads × {hk} key dims × 2 (query and gate), n_embd {d}"),
        p + "ffn_gate_shexp.weight": ("matrix", (fs, d), f"shared expert width {fs}, n_embd {d}"),
        p + "ffn_up_shexp.weight": ("matrix", (fs, d), f"shared expert width {fs}, n_embd {d}"),
        p + "ffn_down_shexp.weight": ("matrix", (d, fs), f"n_embd {d}, shared expert width {fs}"),
    }
    if spec.is_recurrent(i):
        v = f"{vh} value heads × {st}"
        out.update(
            {
                p + "attn_qkv.weight": ("matrix", (ch, d), f"{ch} conv channels, n_embd {d}"),
                p + "attn_gate.weight": ("matrix", (vh * st, d), f"{v}, n_embd {d}"),
                p + "ssm_beta.weight": ("matrix", (vh, d), f"{vh} value heads, n_embd {d}"),
                p + "ssm_alpha.weight": ("matrix", (vh, d), f"{vh} value heads, n_embd {d}"),
                p + "ssm_out.weight": ("matrix", (d, vh * st), f"n_embd {d}, {v}"),
                p + "ssm_conv1d.weight": ("vector", (ch, spec.ssm_conv_kernel), f"{ch} channels × kernel {spec.ssm_conv_kernel}"),
                p + "ssm_dt.bias": ("vector", (vh,), f"{vh} value heads"),
                p + "ssm_a": ("vector", (vh,), f"{vh} value heads"),
                p + "ssm_norm.weight": ("vector", (st,), f"state size {st}"),
            }
        )
    return out


def check_tensors(f: GGUFFile, spec: ModelSpec) -> None:
    """Every dense tensor the forward pass reads has the metadata's shape and a
    type the kernels compute on; the always-on MLP's three matrices agree."""
    from moe_pipe.shared.quant.blocks import FORMATS  # lazy: the quant package brings numba (~0.2 s) with it

    tensors = f.tensors
    for name in _REQUIRED_TOP.get(spec.arch, _REQUIRED):
        f.tensor(name)  # a GGUFError naming it when absent
    for i in range(spec.n_layer):
        for name in required_per_layer(spec, i):
            if f"blk.{i}.{name}" not in tensors:
                raise GGUFError(f.path, f"missing tensor 'blk.{i}.{name}': every {spec.arch} layer needs {name}")
    for name, (kind, shape, basis) in expected_shapes(spec).items():
        t = tensors.get(name)
        if t is None:
            continue
        if t.shape != shape:
            raise GGUFError(
                f.path, f"tensor {name!r} has shape {list(t.shape)} (numpy order), but the metadata implies {list(shape)} ({basis})"
            )
        if kind == "vector" and t.qtype not in _VECTOR_TYPES:
            raise GGUFError(f.path, f"tensor {name!r} is {t.qtype.name}; norms, biases and scales must be F32, F16 or BF16")
        if kind == "matrix" and t.qtype not in FORMATS:
            raise GGUFError(
                f.path,
                f"tensor {name!r} is {t.qtype.name}, which moe-pipe cannot compute on (supported: {', '.join(q.name for q in FORMATS)})",
            )
    for i in range(spec.n_layer):
        gate, up, down = (tensors.get(f"blk.{i}.ffn_{n}.weight") for n in ("gate", "up", "down"))
        if gate is None and up is None and down is None:
            continue
        if gate is None or up is None or down is None:
            raise GGUFError(f.path, f"layer {i} has only some of ffn_gate, ffn_up and ffn_down")
        width = gate.shape[0] if len(gate.shape) == 2 else -1
        if gate.shape != (width, spec.n_embd) or up.shape != gate.shape or down.shape != (spec.n_embd, width):
            raise GGUFError(
                f.path,
                f"layer {i} MLP shapes disagree: ffn_gate {list(gate.shape)}, ffn_up {list(up.shape)}, "
                f"ffn_down {list(down.shape)} (numpy order; n_embd {spec.n_embd})",
            )
        for t in (gate, up, down):
            if t.qtype not in FORMATS:
                raise GGUFError(f.path, f"tensor {t.name!r} is {t.qtype.name}, which moe-pipe cannot compute on")
