"""The model spec: a GGUF's metadata turned into one frozen record per model.

Each supported architecture has a reader here that knows its keys (see
docs/models.md, one section per architecture). Per-layer facts (kv heads, head width,
sliding window) are stored as tuples with one entry per layer, so the forward
pass never has to ask "is this key a scalar or an array?". A missing key or
a key of the wrong type or out of range is a GGUFError naming the key.

`check_tensors` then holds the tensors the forward pass will multiply to the
shapes the metadata implies (and to types the kernels compute on), so a file
whose metadata and tensors disagree fails when it is opened, with the tensor
named, instead of as a numpy error inside a worker process.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType

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
        """Channels of the conv: q and k (groups × state each) and v (heads × state)."""
        return (2 * self.ssm_groups + self.ssm_heads) * self.ssm_state

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


def _positive(f: GGUFFile, name: str, value: int, limit: int = 1 << 24) -> int:
    if not 0 < value <= limit:
        raise GGUFError(f.path, f"metadata {name} = {value} is out of range (1..{limit})")
    return value


def _in_range(f: GGUFFile, name: str, value: float, low: float, high: float) -> float:
    """A float key inside the open interval (low, high): a zero or negative
    epsilon, base or factor is a division by zero or NaN in the forward pass."""
    if not low < value < high:
        raise GGUFError(f.path, f"metadata {name} = {value} is out of range (must be above {low} and below {high})")
    return value


def _vocab_size(f: GGUFFile, arch: str) -> int:
    if f.has(f"{arch}.vocab_size"):
        return _positive(f, f"{arch}.vocab_size", _Meta(f, arch).get_int("vocab_size"))
    embd = f.tensor("token_embd.weight")
    if len(embd.shape) != 2:
        raise GGUFError(f.path, f"tensor 'token_embd.weight' has shape {list(embd.shape)}, expected [n_vocab, n_embd]")
    return embd.shape[0]


# What shared/model/blocks.py implements: anything else would run as plain
# RoPE, a wrong answer at long positions rather than an error.
_ROPE_SCALINGS = ("none", "yarn")


def _rope(m: _Meta, head_dim: int) -> RopeSpec:
    scaling = m.get_str("rope.scaling.type", "none")
    if scaling not in _ROPE_SCALINGS:
        raise GGUFError(
            m.f.path, f"metadata {m.key('rope.scaling.type')} = {scaling[:40]!r} is not supported ({', '.join(_ROPE_SCALINGS)})"
        )
    rope = RopeSpec(
        # θ = base^(-2i/d): a base of 1 or less has no positions in it, and YaRN divides by log(base)
        freq_base=_in_range(m.f, m.key("rope.freq_base"), m.get_float("rope.freq_base", 10000.0), 1, math.inf),
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
            _in_range(m.f, m.key(f"rope.scaling.{key}"), value, 0, math.inf)
        if not 0 <= rope.orig_ctx <= 1 << 30:
            raise GGUFError(
                m.f.path, f"metadata {m.key('rope.scaling.original_context_length')} = {rope.orig_ctx} is out of range (0..{1 << 30})"
            )
    return rope


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
        n_ctx_train=_positive(f, f"{arch}.context_length", m.get_int("context_length", 4096), 1 << 30),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=_positive(f, f"{arch}.expert_feed_forward_length", m.get_int("expert_feed_forward_length")),
        rms_eps=_in_range(f, f"{arch}.attention.layer_norm_rms_epsilon", m.get_float("attention.layer_norm_rms_epsilon", 1e-6), 0, 1),
    )


_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values


def moe_routing(m: _Meta, n_layer: int, n_expert: int, norm_default: bool = True) -> dict[str, Any]:
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


def _qwen3moe(f: GGUFFile) -> ModelSpec:
    arch = "qwen3moe"
    m, c = _Meta(f, arch), _common(f, arch)
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * c["n_layer"],
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * c["n_layer"],
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
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    window = _window(m)
    # gpt-oss alternates: sliding on even layers (llama.cpp swa pattern 2).
    swa = (
        m.per_layer("attention.sliding_window_pattern", n, None, bool)
        if f.has(m.key("attention.sliding_window_pattern"))
        else tuple(i % 2 == 0 and window > 0 for i in range(n))
    )
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
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
    hd_full = _head_dim(m, "attention.key_length")
    hd_swa = _head_dim(m, "attention.key_length_swa", hd_full) if m.get_int("attention.key_length_swa", 0) else hd_full
    hv_full, hv_swa = _head_dim(m, "attention.value_length", hd_full), _head_dim(m, "attention.value_length_swa", hd_swa)
    rope = _rope(m, hd_full)
    base_swa = _in_range(f, m.key("rope.freq_base_swa"), m.get_float("rope.freq_base_swa", 10000.0), 1, math.inf)
    rope = RopeSpec(**{**rope.__dict__, "freq_base_swa": base_swa, "dim_swa": m.get_int("rope.dimension_count_swa", hd_swa)})
    ff = tuple(_positive(f, f"{arch}.feed_forward_length", v) for v in m.per_layer("feed_forward_length", n, None))
    return ModelSpec(
        **c,
        head_dim_k=tuple(hd_swa if s else hd_full for s in swa),
        head_dim_v=tuple(hv_swa if s else hv_full for s in swa),
        n_ff=max(ff),
        rope=rope,
        sliding_window=_window(m),
        swa_layers=swa,
        final_logit_softcap=_softcap(m),
        tied_output="output.weight" not in f.tensors,
        fused_gate_up="blk.0.ffn_gate_up_exps.weight" in f.tensors,
    )


def _qwen35moe(f: GGUFFile) -> ModelSpec:
    arch = "qwen35moe"
    m, c = _Meta(f, arch), _common(f, arch)
    n = c["n_layer"]
    if m.get_int("nextn_predict_layers", 0):
        # llama.cpp counts the MTP block in block_count and skips it; this file's
        # layer numbering would then not be the decoder's: refused, not misread.
        raise GGUFError(f.path, f"metadata {m.key('nextn_predict_layers')} > 0: files with the MTP block are not supported")
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    interval = _positive(f, m.key("full_attention_interval"), m.get_int("full_attention_interval", 4), n)
    # llama.cpp's rule when the file has no per-layer flags: every interval-th layer attends, the rest are recurrent
    recurrent = tuple((i + 1) % interval != 0 for i in range(n))
    state = _positive(f, m.key("ssm.state_size"), m.get_int("ssm.state_size"), 1 << 12)
    groups = _positive(f, m.key("ssm.group_count"), m.get_int("ssm.group_count"), 1 << 12)
    heads = _positive(f, m.key("ssm.time_step_rank"), m.get_int("ssm.time_step_rank"), 1 << 12)
    inner = m.get_int("ssm.inner_size")
    if inner != heads * state or heads % groups:
        raise GGUFError(
            f.path,
            f"linear attention: ssm.inner_size {inner} must be ssm.time_step_rank {heads} × ssm.state_size {state}, "
            f"and the value heads a multiple of ssm.group_count {groups}",
        )
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=_rope(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        recurrent_layers=recurrent,
        ssm_conv_kernel=_positive(f, m.key("ssm.conv_kernel"), m.get_int("ssm.conv_kernel"), 64),
        ssm_state=state,
        ssm_groups=groups,
        ssm_heads=heads,
        n_ff_shexp=_positive(f, m.key("expert_shared_feed_forward_length"), m.get_int("expert_shared_feed_forward_length")),
    )


READERS = {"qwen3moe": _qwen3moe, "gpt-oss": _gpt_oss, "gemma4": _gemma4, "qwen35moe": _qwen35moe}


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
    arch = f.arch
    reader = READERS.get(arch)
    if reader is None:
        raise GGUFError(f.path, f"architecture {arch!r} is not supported (supported: {', '.join(READERS)})")
    spec = reader(f)
    _check_rope(f, spec)
    check_tensors(f, spec)
    return spec


def _head_dim(m: _Meta, suffix: str, default: int | None = None) -> int:
    return _positive(m.f, m.key(suffix), m.get_int(suffix, default), 1 << 16)


def _window(m: _Meta) -> int:
    window = m.get_int("attention.sliding_window", 0)
    if not 0 <= window <= 1 << 30:
        raise GGUFError(m.f.path, f"metadata {m.key('attention.sliding_window')} = {window} is out of range (0..{1 << 30})")
    return window


def _softcap(m: _Meta) -> float:
    cap = m.get_float("final_logit_softcapping", 0.0)
    if cap < 0:  # 0 is "off"; a negative cap flips every logit's sign
        raise GGUFError(m.f.path, f"metadata {m.key('final_logit_softcapping')} = {cap} must not be negative")
    return cap


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


# -- tensors against the metadata ----------------------------------------------

_VECTOR_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
# What each architecture's load_layer (shared/model/<arch>.py) asks for, so a
# missing tensor fails at open rather than when a worker builds the model.
_REQUIRED = ("token_embd.weight", "output_norm.weight")
_ATTN = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_output.weight")
_REQUIRED_PER_LAYER = {
    "qwen3moe": (*_ATTN, "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight"),
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


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """The tensors (without "blk.i.") that layer i's forward pass asks for."""
    if spec.arch == "qwen35moe":
        return _QWEN35_LINEAR if spec.is_recurrent(i) else _QWEN35_ATTN
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
        if spec.arch == "qwen35moe":
            out.update(_qwen35_shapes(spec, i))
    return out


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
    for name in _REQUIRED:
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
