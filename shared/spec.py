"""The model spec: a GGUF's metadata turned into one frozen record per model.

Each supported architecture has a reader here that knows its keys (see
../shared/ARCHITECTURES.md §3). Per-layer facts (kv heads, head width,
sliding window) are stored as tuples with one entry per layer, so the forward
pass never has to ask "is this key a scalar or an array?". A missing key or
a key of the wrong type is a GGUFError naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType

import re

from .errors import GGUFError
from .gguf_file import GGUFFile

_INT_TYPES = {
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
}
_SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


@dataclass(frozen=True)
class RopeSpec:
    freq_base: float
    dim: int  # rotated dims per head (n_rot)
    scaling: str = "none"  # none | linear | yarn
    factor: float = 1.0
    orig_ctx: int = 0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    freq_base_swa: float | None = None
    dim_swa: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: tuple[int, ...]  # per layer
    head_dim_v: tuple[int, ...]  # per layer
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int  # dense / always-on MLP width (0 when absent)
    rms_eps: float
    rope: RopeSpec
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]  # per layer: True = sliding-window attention
    final_logit_softcap: float = 0.0
    tied_output: bool = False
    fused_gate_up: bool = False
    expert_bias: bool = False

    @property
    def n_gqa(self) -> tuple[int, ...]:
        return tuple(self.n_head // kv for kv in self.n_head_kv)


class _Meta:
    """Typed access to one arch's keys, with errors that name the key."""

    def __init__(self, f: GGUFFile, arch: str):
        self.f, self.arch = f, arch

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def _raw(self, suffix: str, required: bool) -> tuple[Any, tuple]:
        key = self.key(suffix)
        if not self.f.has(key):
            if required:
                raise GGUFError(self.f.path, f"metadata key {key!r} is missing")
            return None, ()
        return self.f.meta(key), self.f.meta_type(key)

    def get_int(self, suffix: str, default: int | None = None) -> int:
        value, types = self._raw(suffix, default is None)
        if value is None:
            return int(default)
        if types[0] not in _INT_TYPES:
            raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} has type {types[0].name}, expected an integer")
        return int(value)

    def get_float(self, suffix: str, default: float | None = None) -> float:
        value, types = self._raw(suffix, default is None)
        if value is None:
            return float(default)
        if types[0] not in _FLOAT_TYPES | _INT_TYPES:
            raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} has type {types[0].name}, expected a number")
        return float(value)

    def get_str(self, suffix: str, default: str) -> str:
        value, types = self._raw(suffix, False)
        if value is None:
            return default
        if types[0] != GGUFValueType.STRING:
            raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} has type {types[0].name}, expected a string")
        return value

    def per_layer(self, suffix: str, n_layer: int, default: Any = None, kind=int) -> tuple:
        """A scalar broadcast to every layer, or an array with one entry per layer."""
        value, types = self._raw(suffix, default is None)
        if value is None:
            return tuple(kind(default) for _ in range(n_layer))
        if types[0] == GGUFValueType.ARRAY:
            elem = types[-1]
            ok = elem in _INT_TYPES | {GGUFValueType.BOOL} if kind in (int, bool) else elem in _FLOAT_TYPES | _INT_TYPES
            if not ok or len(value) != n_layer:
                raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} must hold {n_layer} {kind.__name__} values, one per layer (has {len(value)} of {elem.name})")
            return tuple(kind(v) for v in value)
        ok = types[0] in (_INT_TYPES | {GGUFValueType.BOOL} if kind in (int, bool) else _FLOAT_TYPES | _INT_TYPES)
        if not ok:
            raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} has type {types[0].name}, expected {kind.__name__}")
        return tuple(kind(value) for _ in range(n_layer))


def _positive(f: GGUFFile, name: str, value: int, limit: int = 1 << 24) -> int:
    if not 0 < value <= limit:
        raise GGUFError(f.path, f"metadata {name} = {value} is out of range (1..{limit})")
    return value


def _vocab_size(f: GGUFFile, arch: str) -> int:
    if f.has(f"{arch}.vocab_size"):
        return _Meta(f, arch).get_int("vocab_size")
    return f.tensor("token_embd.weight").shape[0]


def _rope(m: _Meta, head_dim: int) -> RopeSpec:
    scaling = m.get_str("rope.scaling.type", "none")
    return RopeSpec(
        freq_base=m.get_float("rope.freq_base", 10000.0),
        dim=m.get_int("rope.dimension_count", head_dim),
        scaling=scaling,
        factor=m.get_float("rope.scaling.factor", 1.0),
        orig_ctx=m.get_int("rope.scaling.original_context_length", 0),
        attn_factor=m.get_float("rope.scaling.attn_factor", 1.0),
        beta_fast=m.get_float("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=m.get_float("rope.scaling.yarn_beta_slow", 1.0),
    )


def _common(f: GGUFFile, arch: str) -> dict[str, Any]:
    m = _Meta(f, arch)
    n_layer = _positive(f, f"{arch}.block_count", m.get_int("block_count"), 1024)
    n_embd = _positive(f, f"{arch}.embedding_length", m.get_int("embedding_length"))
    n_head = _positive(f, f"{arch}.attention.head_count", m.get_int("attention.head_count"), 4096)
    n_head_kv = m.per_layer("attention.head_count_kv", n_layer, n_head)
    for kv in n_head_kv:
        if kv <= 0 or n_head % kv:
            raise GGUFError(f.path, f"attention.head_count_kv {kv} does not divide head_count {n_head}")
    n_expert = _positive(f, f"{arch}.expert_count", m.get_int("expert_count"), 4096)
    n_used = m.get_int("expert_used_count")
    if not 0 < n_used <= n_expert:
        raise GGUFError(f.path, f"expert_used_count {n_used} must be between 1 and expert_count {n_expert}")
    return dict(
        arch=arch,
        name=str(f.meta("general.name", _SPLIT_SUFFIX.sub("", f.paths[0].stem))),
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=_vocab_size(f, arch),
        n_ctx_train=m.get_int("context_length", 4096),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=_positive(f, f"{arch}.expert_feed_forward_length", m.get_int("expert_feed_forward_length")),
        rms_eps=m.get_float("attention.layer_norm_rms_epsilon", 1e-6),
    )


def _qwen3moe(f: GGUFFile) -> ModelSpec:
    arch = "qwen3moe"
    m, c = _Meta(f, arch), _common(f, arch)
    hd = m.get_int("attention.key_length", c["n_embd"] // c["n_head"])
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * c["n_layer"],
        head_dim_v=(m.get_int("attention.value_length", hd),) * c["n_layer"],
        n_ff=0,
        rope=_rope(m, hd),
        sliding_window=0,
        swa_layers=(False,) * c["n_layer"],
        tied_output="output.weight" not in f.tensors,
    )


def _gpt_oss(f: GGUFFile) -> ModelSpec:
    arch = "gpt-oss"
    m, c = _Meta(f, arch), _common(f, arch)
    n = c["n_layer"]
    hd = m.get_int("attention.key_length", c["n_embd"] // c["n_head"])
    window = m.get_int("attention.sliding_window", 0)
    # gpt-oss alternates: sliding on even layers (llama.cpp swa pattern 2).
    swa = m.per_layer("attention.sliding_window_pattern", n, None, bool) if f.has(m.key("attention.sliding_window_pattern")) else tuple(i % 2 == 0 and window > 0 for i in range(n))
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(m.get_int("attention.value_length", hd),) * n,
        n_ff=0,
        rope=_rope(m, hd),
        sliding_window=window,
        swa_layers=swa,
        tied_output="output.weight" not in f.tensors,
        fused_gate_up="blk.0.ffn_gate_up_exps.weight" in f.tensors,
        expert_bias=True,
    )


def _gemma4(f: GGUFFile) -> ModelSpec:
    arch = "gemma4"
    m, c = _Meta(f, arch), _common(f, arch)
    n = c["n_layer"]
    swa = m.per_layer("attention.sliding_window_pattern", n, False, bool)
    hd_full, hd_swa = m.get_int("attention.key_length"), m.get_int("attention.key_length_swa", 0) or m.get_int("attention.key_length")
    hv_full, hv_swa = m.get_int("attention.value_length", hd_full), m.get_int("attention.value_length_swa", hd_swa)
    rope = _rope(m, hd_full)
    rope = RopeSpec(**{**rope.__dict__, "freq_base_swa": m.get_float("rope.freq_base_swa", 10000.0), "dim_swa": m.get_int("rope.dimension_count_swa", hd_swa)})
    ff = m.per_layer("feed_forward_length", n, None)
    return ModelSpec(
        **c,
        head_dim_k=tuple(hd_swa if s else hd_full for s in swa),
        head_dim_v=tuple(hv_swa if s else hv_full for s in swa),
        n_ff=max(ff),
        rope=rope,
        sliding_window=m.get_int("attention.sliding_window", 0),
        swa_layers=swa,
        final_logit_softcap=m.get_float("final_logit_softcapping", 0.0),
        tied_output="output.weight" not in f.tensors,
        fused_gate_up="blk.0.ffn_gate_up_exps.weight" in f.tensors,
    )


READERS = {"qwen3moe": _qwen3moe, "gpt-oss": _gpt_oss, "gemma4": _gemma4}


def read_spec(f: GGUFFile) -> ModelSpec:
    arch = f.arch
    reader = READERS.get(arch)
    if reader is None:
        raise GGUFError(f.path, f"architecture {arch!r} is not supported (supported: {', '.join(READERS)})")
    return reader(f)
