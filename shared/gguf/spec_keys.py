"""The building blocks a family's GGUF reader (shared/families/<family>/spec.py)
assembles its `ModelSpec` from: typed access to one arch's keys (`Meta`), the
range checks, and the keys several families share (`common_keys`, `rope_keys`,
`moe_routing`, head widths, the sliding window, the logit softcap).

A missing key, or one of the wrong type or out of range, is a GGUFError naming it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from gguf import GGUFValueType

from ..errors import GGUFError
from .reader import FLOAT_TYPES, INT_TYPES, GGUFFile
from .spec import RopeSpec

_SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")


class Meta:
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
        if value is None:  # absent; _raw already refused that when there is no default
            if default is None:
                raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} is missing")
            return int(default)
        if types[0] not in INT_TYPES:
            raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} has type {types[0].name}, expected an integer")
        return int(value)

    def get_float(self, suffix: str, default: float | None = None) -> float:
        value, types = self._raw(suffix, default is None)
        if value is None:  # absent; _raw already refused that when there is no default
            if default is None:
                raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} is missing")
            return float(default)
        if types[0] not in FLOAT_TYPES | INT_TYPES:
            raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} has type {types[0].name}, expected a number")
        if not math.isfinite(value):  # a NaN epsilon or base gives NaN logits, not an error
            raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} is {value}, expected a finite number")
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
        key = self.key(suffix)
        if self.f.has(key) and self.f.meta_type(key)[0] == GGUFValueType.ARRAY:
            elem, n = self.f.meta_type(key)[-1], self.f.meta_len(key)
            ok = elem in INT_TYPES | {GGUFValueType.BOOL} if kind in (int, bool) else elem in FLOAT_TYPES | INT_TYPES
            if not ok or n != n_layer:  # checked before decoding: the array may claim millions of entries
                raise GGUFError(
                    self.f.path, f"metadata key {key!r} must hold {n_layer} {kind.__name__} values, one per layer (has {n} of {elem.name})"
                )
        value, types = self._raw(suffix, default is None)
        if value is None:
            return tuple(kind(default) for _ in range(n_layer))
        if types[0] == GGUFValueType.ARRAY:
            return tuple(kind(v) for v in value)
        ok = types[0] in (INT_TYPES | {GGUFValueType.BOOL} if kind in (int, bool) else FLOAT_TYPES | INT_TYPES)
        if not ok:
            raise GGUFError(self.f.path, f"metadata key {self.key(suffix)!r} has type {types[0].name}, expected {kind.__name__}")
        return tuple(kind(value) for _ in range(n_layer))


def positive(f: GGUFFile, name: str, value: int, limit: int = 1 << 24) -> int:
    if not 0 < value <= limit:
        raise GGUFError(f.path, f"metadata {name} = {value} is out of range (1..{limit})")
    return value


def in_range(f: GGUFFile, name: str, value: float, low: float, high: float) -> float:
    """A float key inside the open interval (low, high): a zero or negative
    epsilon, base or factor is a division by zero or NaN in the forward pass."""
    if not low < value < high:
        raise GGUFError(f.path, f"metadata {name} = {value} is out of range (must be above {low} and below {high})")
    return value


def head_dim(m: Meta, suffix: str, default: int | None = None) -> int:
    """A head width key (attention.key_length, value_length, ...), at most 65536."""
    return positive(m.f, m.key(suffix), m.get_int(suffix, default), 1 << 16)


def sliding_window(m: Meta) -> int:
    """attention.sliding_window; 0 (absent) is no window."""
    window = m.get_int("attention.sliding_window", 0)
    if not 0 <= window <= 1 << 30:
        raise GGUFError(m.f.path, f"metadata {m.key('attention.sliding_window')} = {window} is out of range (0..{1 << 30})")
    return window


def final_logit_softcap(m: Meta) -> float:
    """final_logit_softcapping; 0 (absent) is no cap."""
    cap = m.get_float("final_logit_softcapping", 0.0)
    if cap < 0:  # 0 is "off"; a negative cap flips every logit's sign
        raise GGUFError(m.f.path, f"metadata {m.key('final_logit_softcapping')} = {cap} must not be negative")
    return cap


def vocab_size(f: GGUFFile, arch: str) -> int:
    if f.has(f"{arch}.vocab_size"):
        return positive(f, f"{arch}.vocab_size", Meta(f, arch).get_int("vocab_size"))
    embd = f.tensor("token_embd.weight")
    if len(embd.shape) != 2:
        raise GGUFError(f.path, f"tensor 'token_embd.weight' has shape {list(embd.shape)}, expected [n_vocab, n_embd]")
    return embd.shape[0]


# What shared/model/blocks.py implements: anything else would run as plain
# RoPE, a wrong answer at long positions rather than an error.
_ROPE_SCALINGS = ("none", "yarn")


def rope_keys(m: Meta, head_dim: int) -> RopeSpec:
    scaling = m.get_str("rope.scaling.type", "none")
    if scaling not in _ROPE_SCALINGS:
        raise GGUFError(
            m.f.path, f"metadata {m.key('rope.scaling.type')} = {scaling[:40]!r} is not supported ({', '.join(_ROPE_SCALINGS)})"
        )
    rope = RopeSpec(
        # θ = base^(-2i/d): a base of 1 or less has no positions in it, and YaRN divides by log(base)
        freq_base=in_range(m.f, m.key("rope.freq_base"), m.get_float("rope.freq_base", 10000.0), 1, math.inf),
        dim=m.get_int("rope.dimension_count", head_dim),
        scaling=scaling,
        factor=m.get_float("rope.scaling.factor", 1.0),
        orig_ctx=m.get_int("rope.scaling.original_context_length", 0),
        attn_factor=m.get_float("rope.scaling.attn_factor", 1.0),
        beta_fast=m.get_float("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=m.get_float("rope.scaling.yarn_beta_slow", 1.0),
    )
    if scaling == "yarn":  # YaRN takes logs of the factor, of orig_ctx / beta and of the base
        for key, value in (("factor", rope.factor), ("yarn_beta_fast", rope.beta_fast), ("yarn_beta_slow", rope.beta_slow)):
            in_range(m.f, m.key(f"rope.scaling.{key}"), value, 0, math.inf)
        if not 0 <= rope.orig_ctx <= 1 << 30:
            raise GGUFError(
                m.f.path, f"metadata {m.key('rope.scaling.original_context_length')} = {rope.orig_ctx} is out of range (0..{1 << 30})"
            )
    return rope


# A family's rule for the experts' width when its file has no expert_feed_forward_length:
# (the arch's keys, expert_used_count) -> the width, checked.
ExpertWidthFallback = Callable[[Meta, int], int]


def n_ff_exp(m: Meta, n_used: int, fallback: ExpertWidthFallback | None = None) -> int:
    """The experts' width, expert_feed_forward_length; without that key, the
    family's `fallback` (llama.cpp's rule for its older files), else an error."""
    key = "expert_feed_forward_length"
    if fallback is not None and not m.f.has(m.key(key)):
        return fallback(m, n_used)
    return positive(m.f, m.key(key), m.get_int(key))


def common_keys(
    f: GGUFFile, arch: str, no_attention_kv0: bool = False, ff_exp_fallback: ExpertWidthFallback | None = None
) -> dict[str, Any]:
    """The keys every family shares. `no_attention_kv0`: a layer with 0 kv heads is
    a layer without attention (lfm2moe's short-conv layers), not an error;
    `ff_exp_fallback`: where the experts' width is when the file does not say (`n_ff_exp`)."""
    m = Meta(f, arch)
    n_layer = positive(f, f"{arch}.block_count", m.get_int("block_count"), 1024)
    n_embd = positive(f, f"{arch}.embedding_length", m.get_int("embedding_length"))
    n_head = positive(f, f"{arch}.attention.head_count", m.get_int("attention.head_count"), 4096)
    n_head_kv = m.per_layer("attention.head_count_kv", n_layer, n_head)
    for kv in n_head_kv:
        if no_attention_kv0 and kv == 0:
            continue
        if kv <= 0 or n_head % kv:
            raise GGUFError(f.path, f"attention.head_count_kv {kv} does not divide head_count {n_head}")
    n_expert = positive(f, f"{arch}.expert_count", m.get_int("expert_count"), 4096)
    n_used = m.get_int("expert_used_count")
    if not 0 < n_used <= n_expert:
        raise GGUFError(f.path, f"expert_used_count {n_used} must be between 1 and expert_count {n_expert}")
    return dict(
        arch=arch,
        name=str(f.meta("general.name", _SPLIT_SUFFIX.sub("", f.paths[0].stem))),
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=vocab_size(f, arch),
        n_ctx_train=positive(f, f"{arch}.context_length", m.get_int("context_length", 4096), 1 << 30),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp(m, n_used, ff_exp_fallback),
        rms_eps=in_range(f, f"{arch}.attention.layer_norm_rms_epsilon", m.get_float("attention.layer_norm_rms_epsilon", 1e-6), 0, 1),
    )


def split_nextn(m: Meta, c: dict[str, Any]) -> int:
    """The NextN/MTP layers llama.cpp's converter counts in block_count and puts last
    (`nextn_predict_layers`, shared/gguf/nextn.py): `c` (from `common_keys`) is cut to the
    decoder's layers, the blocks before them; returns how many there are."""
    nextn = m.get_int("nextn_predict_layers", 0)
    if not 0 <= nextn < c["n_layer"]:
        raise GGUFError(m.f.path, f"metadata {m.key('nextn_predict_layers')} = {nextn} is out of range (0..{c['n_layer'] - 1})")
    n = c["n_layer"] - nextn
    c.update(n_layer=n, n_head_kv=c["n_head_kv"][:n])
    return nextn


_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values
# How the model was trained to score an expert group (ModelSpec.expert_group_score). The file
# has no key for it (llama.cpp's converter does not write topk_method, and llama.cpp's graph
# always sums a group's top two), but the gating tells the two published rules apart:
# DeepSeek-V2's group_limited_greedy gates by softmax and scores a group by its best expert;
# V3's noaux_tc (GLM-4.5, LFM2 alike) gates by sigmoid with a correction bias and sums its best two.
_GROUP_SCORE = {"softmax": "max", "sigmoid": "top2"}


def moe_routing(m: Meta, n_layer: int, n_expert: int, norm_default: bool = True) -> dict[str, Any]:
    """The leading dense layers and the routing keys of the DeepSeek-style families
    (ModelSpec fields of the same names), checked: a family reader passes them on."""
    f = m.f
    lead = m.get_int("leading_dense_block_count", 0)
    if not 0 <= lead < n_layer:
        raise GGUFError(f.path, f"metadata {m.key('leading_dense_block_count')} = {lead} is out of range (0..{n_layer - 1})")
    func = m.get_int("expert_gating_func", 1)
    if func not in _GATING:
        raise GGUFError(f.path, f"metadata {m.key('expert_gating_func')} = {func} is not supported (1 softmax, 2 sigmoid)")
    groups = m.get_int("expert_group_count", 1)
    used = m.get_int("expert_group_used_count", groups)
    if groups < 1 or n_expert % groups or not 0 < used <= groups:
        raise GGUFError(
            f.path,
            f"metadata expert_group_count {groups} must divide expert_count {n_expert}, and expert_group_used_count {used} be 1..{groups}",
        )
    key = m.key("expert_weights_norm")
    norm = bool(f.meta(key)) if f.has(key) else norm_default
    scale = m.get_float("expert_weights_scale", 1.0)
    if not 0 < scale < 1e6:
        raise GGUFError(f.path, f"metadata {m.key('expert_weights_scale')} = {scale} is out of range (above 0)")
    return dict(
        n_dense_lead=lead,
        expert_gating=_GATING[func],
        expert_group_score=_GROUP_SCORE[_GATING[func]],
        expert_weights_norm=norm,
        expert_weights_scale=scale,
        expert_groups=groups,
        expert_groups_used=used,
        n_expert_shared=m.get_int("expert_shared_count", 0),
    )
