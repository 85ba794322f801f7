"""The model spec: a GGUF's metadata turned into one frozen record per model.

Per-layer facts (kv heads, head width, sliding window) are stored as tuples
with one entry per layer, so the forward pass never has to ask "is this key a
scalar or an array?". This module holds the record, the typed key access and
the keys every family shares (`common_keys`, `rope_keys`, `moe_routing`), and
what the KV cache costs. Each family's reader is in spec_readers.py (docs/models.md,
one section per family); spec_tensors.py then holds the file's tensors to the
shapes the metadata implies. `read_spec` does all three.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType

from moe_pipe.shared.errors import GGUFError, UserError
from moe_pipe.shared.gguf.reader import FLOAT_TYPES, INT_TYPES, GGUFFile

_SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")


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
    # Hybrid models (qwen35moe): per layer, True = a linear-attention (gated
    # delta rule) layer with a recurrent state instead of a KV cache; () = none.
    recurrent_layers: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0  # the short causal conv's width (ssm.conv_kernel)
    ssm_state: int = 0  # key (and value) width of a linear-attention head (ssm.state_size)
    ssm_groups: int = 0  # key heads (ssm.group_count)
    ssm_heads: int = 0  # value heads (ssm.time_step_rank)
    n_ff_shexp: int = 0  # the shared expert's FFN width (0: none)
    # lfm2moe's short-conv layers: a conv over this many channels (n_embd) and no delta rule.
    shortconv_channels: int = 0
    # Layers 0..n_dense_lead-1 have a dense FFN (width n_ff) and no experts
    # (deepseek2, glm4moe, lfm2moe): nothing of theirs is streamed or cached.
    n_dense_lead: int = 0
    # Routing beyond softmax-top-k (model/moe.py gated_group_top_k; read by `moe_routing`).
    expert_gating: str = "softmax"  # softmax | sigmoid (llama.cpp expert_gating_func 1 | 2)
    expert_weights_norm: bool = True  # renormalize the chosen weights to sum 1
    expert_weights_scale: float = 1.0  # routed scaling factor
    expert_groups: int = 1  # expert_group_count
    expert_groups_used: int = 1  # expert_group_used_count
    n_expert_shared: int = 0  # always-on shared experts (expert_shared_count)
    # NextN/MTP blocks the file holds after the decoder's n_layer blocks (glm4moe:
    # llama.cpp's converter counts them in block_count): never run, loaded or streamed.
    n_layer_nextn: int = 0
    # deepseek2's multi-head latent attention: the cache holds one latent head of
    # kv_lora_rank + rope dims per position (head_dim_k; head_dim_v 0: V is K's first
    # kv_lora_rank values); per head, q·k spans head_dim_k_mla dims and V head_dim_v_mla.
    q_lora_rank: int = 0  # 0: a plain attn_q
    kv_lora_rank: int = 0
    head_dim_k_mla: int = 0
    head_dim_v_mla: int = 0
    rope_yarn_log_mul: float = 0.0  # YaRN's mscale_all_dim (the GGUF stores 0.1 × it)

    def has_experts(self, i: int) -> bool:
        """Whether layer i has routed experts (the leading dense layers have none)."""
        return i >= self.n_dense_lead

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_dense_lead, self.n_layer))

    def is_recurrent(self, i: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[i]

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of the conv: q and k (groups × state each) and v (heads × state);
        lfm2moe's short conv: B·x, n_embd channels."""
        return self.shortconv_channels or (2 * self.ssm_groups + self.ssm_heads) * self.ssm_state

    @property
    def n_gqa(self) -> tuple[int, ...]:
        return tuple(self.n_head // kv for kv in self.n_head_kv)


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


def ff_exp_key(f: GGUFFile, arch: str) -> str:
    """Where the experts' width is: llama.cpp writes Mixtral (arch llama) without
    expert_feed_forward_length, its experts being feed_forward_length wide."""
    if arch == "llama" and not f.has("llama.expert_feed_forward_length"):
        return "feed_forward_length"
    return "expert_feed_forward_length"


def n_ff_exp(m: Meta, n_used: int) -> int:
    """The experts' width. llama.cpp's converter wrote none for qwen2moe before 2024-06
    (the official Qwen1.5-MoE GGUFs): its loader then takes feed_forward_length / expert_used_count."""
    key = ff_exp_key(m.f, m.arch)
    if m.arch == "qwen2moe" and not m.f.has(m.key(key)):
        return positive(m.f, m.key("feed_forward_length"), m.get_int("feed_forward_length") // n_used)
    return positive(m.f, m.key(key), m.get_int(key))


def common_keys(f: GGUFFile, arch: str, no_attention_kv0: bool = False) -> dict[str, Any]:
    """The keys every family shares. `no_attention_kv0`: a layer with 0 kv heads is
    a layer without attention (lfm2moe's short-conv layers), not an error."""
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
        n_ff_exp=n_ff_exp(m, n_used),
        rms_eps=in_range(f, f"{arch}.attention.layer_norm_rms_epsilon", m.get_float("attention.layer_norm_rms_epsilon", 1e-6), 0, 1),
    )


_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values


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
        expert_weights_norm=norm,
        expert_weights_scale=scale,
        expert_groups=groups,
        expert_groups_used=used,
        n_expert_shared=m.get_int("expert_shared_count", 0),
    )


# What the KV cache stores per element, as a fraction (numerator, denominator) of bytes:
# f32 and f16 as such; q8_0 as llama.cpp's block of 32 int8 values plus one float16 scale (34 bytes per 32).
# The config's compute.kv_type choices (shared/config.py) are these keys.
KV_TYPE_BYTES: dict[str, tuple[int, int]] = {"f16": (2, 1), "f32": (4, 1), "q8_0": (34, 32)}
Q8_0_BLOCK = 32  # values per q8_0 scale, along the head dimension


def check_kv_type(kv_type: str, head_widths: tuple[int, ...]) -> None:
    """Refuse a KV type the model's heads cannot be stored in: q8_0 needs every
    head width (K and V) to be whole blocks of 32."""
    if kv_type not in KV_TYPE_BYTES:
        raise UserError(f"unknown KV cache type {kv_type!r} (choose from {', '.join(KV_TYPE_BYTES)})")
    odd = sorted({d for d in head_widths if d % Q8_0_BLOCK})
    if kv_type == "q8_0" and odd:
        raise UserError(
            f"--kv-type q8_0 stores blocks of {Q8_0_BLOCK} values per head, but this model's attention heads are "
            f"{', '.join(map(str, odd))} wide (not a multiple of {Q8_0_BLOCK}): use f16 or f32"
        )


def kv_cache_bytes(spec: ModelSpec, n_ctx: int, kv_type: str) -> int:
    """Bytes of the K and V caches compute allocates for `n_ctx` positions stored as
    `kv_type`, plus a hybrid model's recurrent state (`recurrent_state_bytes`)."""
    check_kv_type(kv_type, spec.head_dim_k + spec.head_dim_v)
    num, den = KV_TYPE_BYTES[kv_type]
    layers = zip(spec.n_head_kv, spec.head_dim_k, spec.head_dim_v, range(spec.n_layer))
    elements = n_ctx * sum(hk * (dk + dv) for hk, dk, dv, i in layers if not spec.is_recurrent(i))
    return elements * num // den + recurrent_state_bytes(spec)  # exact: q8_0 heads are whole blocks of 32


def recurrent_state_bytes(spec: ModelSpec) -> int:
    """Float32 bytes of one sequence's recurrent state (shared/model/blocks.py
    RecurrentState): per linear-attention layer the conv's last kernel-1 inputs
    and the delta rule's [heads, state, state] matrix; fixed, whatever the context."""
    n_recurrent = sum(spec.is_recurrent(i) for i in range(spec.n_layer))
    if not n_recurrent:
        return 0
    per_layer = (spec.ssm_conv_kernel - 1) * spec.ssm_conv_channels + spec.ssm_heads * spec.ssm_state * spec.ssm_state
    return 4 * per_layer * n_recurrent


def read_spec(f: GGUFFile) -> ModelSpec:
    """The file's spec from its architecture's reader (spec_readers.py), its tensors
    checked against it (spec_tensors.py)."""
    from moe_pipe.shared.gguf.spec_readers import READERS
    from moe_pipe.shared.gguf.spec_tensors import check_tensors

    arch = f.arch
    reader = READERS.get(arch)
    if reader is None:
        raise GGUFError(f.path, f"architecture {arch!r} is not supported (supported: {', '.join(READERS)})")
    spec = reader(f)
    _check_rope(f, spec)
    check_tensors(f, spec)
    return spec


def _check_rope(f: GGUFFile, spec: ModelSpec) -> None:
    """Rotated dims pair up inside a head: an odd count, or more than the
    heads it rotates are wide, indexes past the head."""
    r = spec.rope
    for key, dim in (("rope.dimension_count", r.dim), ("rope.dimension_count_swa", r.dim_swa)):
        if dim is not None and (dim <= 0 or dim % 2):
            raise GGUFError(f.path, f"metadata {spec.arch}.{key} = {dim} must be even and positive")
    for i, swa in enumerate(spec.swa_layers):
        # gemma4 rotates sliding layers by their own count; the rest use one for every layer
        key, dim = ("rope.dimension_count_swa", r.dim_swa) if swa and r.dim_swa else ("rope.dimension_count", r.dim)
        if dim > spec.head_dim_k[i]:
            raise GGUFError(f.path, f"metadata {spec.arch}.{key} = {dim} is wider than layer {i}'s heads ({spec.head_dim_k[i]})")
