"""The building blocks of the families' `moe-pipe convert` rules (shared/families/<family>/convert.py).

`Planner` turns checkpoint tensors into `Out`s (GGUF tensors to write), checking
every name and shape against config.json before anything is written; the
config helpers read the keys every family shares. docs/models.md § From Hugging Face names.

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

from ..errors import UserError
from .source import Checkpoint


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


class Planner:
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
        self.outs.append(Out(gg, tuple(shape), len(shape) >= 2 if matrix is None else matrix, slabs(self.ck, full, shape)))

    def add(self, out: Out) -> None:
        self.outs.append(out)

    def f32(self, gg: str, name: str, shape: tuple[int, ...]) -> None:
        self.copy(gg, name, shape, matrix=False)


# --- config helpers -----------------------------------------------------------------


# Rows per slab of a 2-D tensor: bounds the float32 temporaries for a 262144-row
# embedding to ~64 MB instead of ~3 GB. Rows are independent for every outtype.
_SLAB_ELEMS = 16 << 20


def slabs(ck: Checkpoint, full: str, shape: tuple[int, ...]) -> Callable[[], Iterator[np.ndarray]]:
    """Parts of a tensor stored as GGUF wants it: one per expert (3-D) or row slabs (2-D)."""
    if len(shape) == 3:
        return lambda: (ck.f32(full, e) for e in range(shape[0]))
    if len(shape) == 2:
        step = max(1, _SLAB_ELEMS // max(1, shape[1]))
        return lambda: (ck.f32(full, slice(r, r + step)) for r in range(0, shape[0], step))
    return lambda: iter([ck.f32(full)])


def expert_rows(ck: Checkpoint, full: str, n_expert: int, rows: slice) -> Callable[[], Iterator[np.ndarray]]:
    """Rows `rows` of every expert of a fused (X, rows, in) tensor, one expert per part."""
    return lambda: (ck.f32(full, (x, rows)) for x in range(n_expert))


def cfg_get(cfg: dict, key: str, default: Any = ..., *alts: str) -> Any:
    for k in (key, *alts):
        if cfg.get(k) is not None:
            return cfg[k]
    if default is ...:
        raise UserError(f"config.json: key {key!r} is missing")
    return default


def rope_params(cfg: dict, default_theta: float) -> dict[str, Any]:
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


def add_rope_scaling(w: GGUFWriter, rp: dict[str, Any], ctx: int) -> None:
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


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def mtp_blocks(outs: list[Out], n_layer: int) -> int:
    """How many NextN/MTP blocks `outs` write: the blocks after the decoder's `n_layer`."""
    return len({int(m[1]) for o in outs if (m := _BLOCK.match(o.name)) and int(m[1]) >= n_layer})


def common_meta(w: GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_context_length(hp["ctx"])
    w.add_embedding_length(hp["D"])
    w.add_block_count(hp["L"] + hp.get("mtp_written", 0))  # llama.cpp's converter counts the NextN/MTP blocks
    w.add_feed_forward_length(hp["Fd"])
    w.add_expert_feed_forward_length(hp["F"])
    w.add_expert_count(hp["X"])
    w.add_expert_used_count(hp["K"])
    w.add_head_count(hp["H"])
    w.add_layer_norm_rms_eps(hp["eps"])
    w.add_rope_freq_base(hp["theta"])


def base_hparams(cfg: dict, default_theta: float) -> dict[str, Any]:
    D, H = int(cfg_get(cfg, "hidden_size")), int(cfg_get(cfg, "num_attention_heads"))
    rp = rope_params(cfg, default_theta)
    return dict(
        D=D,
        H=H,
        L=int(cfg_get(cfg, "num_hidden_layers")),
        Hk=int(cfg_get(cfg, "num_key_value_heads", H)),
        d=int(cfg_get(cfg, "head_dim", D // H)),
        V=int(cfg_get(cfg, "vocab_size")),
        ctx=int(cfg_get(cfg, "max_position_embeddings", 4096)),
        eps=float(cfg_get(cfg, "rms_norm_eps", 1e-6)),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        rope=rp,
        theta=float(rp["rope_theta"]),
    )


def embeddings(p: Planner, hp: dict[str, Any]) -> None:
    V, D = hp["V"], hp["D"]
    p.copy("token_embd.weight", "embed_tokens.weight", (V, D))


def head(p: Planner, hp: dict[str, Any], lm_head: str) -> None:
    p.f32("output_norm.weight", "norm.weight", (hp["D"],))
    if not hp["tied"]:
        head_matrix(p, hp, lm_head)


def head_matrix(p: Planner, hp: dict[str, Any], full: str) -> None:
    """The untied output head `full` (a name without the planner's prefix)."""
    V, D = hp["V"], hp["D"]
    if full not in p.ck:
        raise UserError(f"{p.ck.dir}: tensor {full} is missing (config says tie_word_embeddings=false)")
    shape = p.ck.shape(full)
    if shape != (V, D):
        raise UserError(f"{p.ck.dir}: tensor {full} has shape {list(shape)}, but config.json implies {[V, D]}")
    p.used.add(full)
    p.add(Out("output.weight", (V, D), True, slabs(p.ck, full, (V, D))))


def stack(p: Planner, gg: str, names: list[str], shape: tuple[int, ...]) -> None:
    """Per-expert 2-D tensors stacked along a new leading axis (X, out, in)."""
    full = [p.hf(n, shape) for n in names]
    ck = p.ck
    p.add(Out(gg, (len(names), *shape), True, lambda: (ck.f32(f) for f in full)))


def dense_ffn(p: Planner, b: str, m: str, D: int, F: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """A dense gated FFN (a model's leading dense layers, Gemma 4's FFN beside its experts): its
    gate, up and down Linear weights under `m` as ffn_gate and ffn_up (F, D), ffn_down (D, F)."""
    gate, up, down = names
    p.copy(b + "ffn_gate.weight", f"{m}{gate}.weight", (F, D))
    p.copy(b + "ffn_up.weight", f"{m}{up}.weight", (F, D))
    p.copy(b + "ffn_down.weight", f"{m}{down}.weight", (D, F))


def qwen_experts(p: Planner, b: str, e: str, hp: dict[str, Any]) -> None:
    """Routed experts stored as Qwen's MoE checkpoints store them (and most others since):
    transformers 5's fused `gate_up_proj` (X, 2F, D), gate rows first, or per-expert
    `gate_proj`/`up_proj`/`down_proj` Linear weights."""
    ck, D, X, F = p.ck, hp["D"], hp["X"], hp["F"]
    if p.prefix + e + "gate_up_proj" in ck:
        full = p.hf(e + "gate_up_proj", (X, 2 * F, D))
        p.add(Out(b + "ffn_gate_exps.weight", (X, F, D), True, expert_rows(ck, full, X, slice(0, F))))
        p.add(Out(b + "ffn_up_exps.weight", (X, F, D), True, expert_rows(ck, full, X, slice(F, 2 * F))))
        p.copy(b + "ffn_down_exps.weight", e + "down_proj", (X, D, F))
    else:
        stack(p, b + "ffn_gate_exps.weight", [f"{e}{x}.gate_proj.weight" for x in range(X)], (F, D))  # X F D
        stack(p, b + "ffn_up_exps.weight", [f"{e}{x}.up_proj.weight" for x in range(X)], (F, D))  # X F D
        stack(p, b + "ffn_down_exps.weight", [f"{e}{x}.down_proj.weight" for x in range(X)], (D, F))  # X D F


def first_row(ck: Checkpoint, full: str) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: iter([ck.f32(full)[0]])


# Buffers some checkpoints carry that no GGUF needs.
_ALWAYS_IGNORED = r"\.rotary_emb\.inv_freq$|\.rotary_emb\.|^lm_head\.weight$"


def finish(p: Planner, ck: Checkpoint, ignore: str = "") -> list[Out]:
    pat = re.compile(_ALWAYS_IGNORED + (f"|{ignore}" if ignore else ""))
    left = [n for n in ck.names() if n not in p.used and not pat.search(n)]
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise UserError(
            f"{ck.dir}: tensor {left[0]}{more} is not used by convert; the checkpoint has parts this model type does not map (an unsupported variant?)"
        )
    return p.outs
