"""The tensors a model file must hold, checked against its `ModelSpec` when it is
opened: every tensor the forward pass will multiply exists with the shape the
metadata implies and a type the kernels compute on, so a file whose metadata
and tensors disagree fails with the tensor named instead of as a numpy error
inside a worker process.

Each family's part (shared/families/<family>/spec.py, `SpecPart`) names the
tensors its layers need and the shapes of its own; this module holds what
several families share: the common shapes, the name tuples and shape blocks
the parts are built from, and the check itself.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

from ..errors import GGUFError
from .reader import GGUFFile
from .spec import ModelSpec, Shapes, SpecPart

_VECTOR_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})

# What a family's load_layer (shared/families/<family>/model.py) asks for, so a
# missing tensor fails at open rather than when a worker builds the model.
EMBEDDING_AND_FINAL_NORM: tuple[str, ...] = ("token_embd.weight", "output_norm.weight")
ATTN = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_output.weight")
DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
SHARED_EXPERT = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")

_NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "post_ffw_norm_1", "pre_ffw_norm_2", "post_ffw_norm_2")


def expected_shapes(spec: ModelSpec, part: SpecPart) -> Shapes:
    """name -> ("matrix" | "vector", numpy shape, where the shape comes from)
    for the dense tensors, named the llama.cpp way, whose shape the metadata
    fixes: the ones every family shares, then each layer's family tensors
    (`part.layer_shapes`). Absent names are fine here: the architecture asks for
    what it needs and names what is missing."""
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
        out.update(part.layer_shapes(spec, i))
    return out


def dense_ffn_shapes(spec: ModelSpec, i: int) -> Shapes:
    """A leading dense layer's FFN in layer i: n_ff (feed_forward_length) wide."""
    p, d, f = f"blk.{i}.", spec.n_embd, spec.n_ff
    return {
        p + "ffn_gate.weight": ("matrix", (f, d), f"feed_forward_length {f}, n_embd {d}"),
        p + "ffn_up.weight": ("matrix", (f, d), f"feed_forward_length {f}, n_embd {d}"),
        p + "ffn_down.weight": ("matrix", (d, f), f"n_embd {d}, feed_forward_length {f}"),
    }


def shared_expert_shapes(spec: ModelSpec, i: int) -> Shapes:
    """The shared expert in layer i (SHARED_EXPERT): n_ff_shexp wide. A gate of
    its own (ffn_gate_inp_shexp, [D] or [1, D]) is checked when it loads."""
    p, d, fs = f"blk.{i}.", spec.n_embd, spec.n_ff_shexp
    return {
        p + "ffn_gate_shexp.weight": ("matrix", (fs, d), f"shared expert width {fs}, n_embd {d}"),
        p + "ffn_up_shexp.weight": ("matrix", (fs, d), f"shared expert width {fs}, n_embd {d}"),
        p + "ffn_down_shexp.weight": ("matrix", (d, fs), f"n_embd {d}, shared expert width {fs}"),
    }


def selection_bias_shape(spec: ModelSpec, i: int) -> Shapes:
    """The router's expert-selection bias in layer i (exp_probs_b): one per expert."""
    e = spec.n_expert
    return {f"blk.{i}.exp_probs_b.bias": ("vector", (e,), f"{e} experts")}


def check_tensors(f: GGUFFile, spec: ModelSpec, part: SpecPart) -> None:
    """Every tensor the family's part requires exists; every dense tensor the
    forward pass reads has the metadata's shape and a type the kernels compute
    on; the always-on MLP's three matrices agree."""
    from ..quant.blocks import FORMATS  # lazy: the quant package brings numba (~0.2 s) with it

    tensors = f.tensors
    for name in part.TOP_TENSORS:
        f.tensor(name)  # a GGUFError naming it when absent
    for i in range(spec.n_layer):
        for name in part.required_per_layer(spec, i):
            if f"blk.{i}.{name}" not in tensors:
                raise GGUFError(f.path, f"missing tensor 'blk.{i}.{name}': every {spec.arch} layer needs {name}")
    for name, (kind, shape, basis) in expected_shapes(spec, part).items():
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
