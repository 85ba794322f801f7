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


def _ff_exp_key(f: GGUFFile, arch: str) -> str:
    """Where the experts' width is: llama.cpp writes Mixtral (arch llama) without
    expert_feed_forward_length, its experts being feed_forward_length wide."""
    if arch == "llama" and not f.has("llama.expert_feed_forward_length"):
        return "feed_forward_length"
    return "expert_feed_forward_length"


def _n_ff_exp(m: _Meta, n_used: int) -> int:
    """The experts' width. llama.cpp's converter wrote none for qwen2moe before 2024-06
    (the official Qwen1.5-MoE GGUFs): its loader then takes feed_forward_length / expert_used_count."""
    key = _ff_exp_key(m.f, m.arch)
    if m.arch == "qwen2moe" and not m.f.has(m.key(key)):
        return _positive(m.f, m.key("feed_forward_length"), m.get_int("feed_forward_length") // n_used)
    return _positive(m.f, m.key(key), m.get_int(key))


def _common(f: GGUFFile, arch: str, no_attention_kv0: bool = False) -> dict[str, Any]:
    """The keys every family shares. `no_attention_kv0`: a layer with 0 kv heads is
    a layer without attention (lfm2moe's short-conv layers), not an error."""
    m = _Meta(f, arch)
    n_layer = _positive(f, f"{arch}.block_count", m.get_int("block_count"), 1024)
    n_embd = _positive(f, f"{arch}.embedding_length", m.get_int("embedding_length"))
    n_head = _positive(f, f"{arch}.attention.head_count", m.get_int("attention.head_count"), 4096)
    n_head_kv = m.per_layer("attention.head_count_kv", n_layer, n_head)
    for kv in n_head_kv:
        if no_attention_kv0 and kv == 0:
            continue
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
        n_ff_exp=_n_ff_exp(m, n_used),
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


def _glm4moe(f: GGUFFile) -> ModelSpec:
    arch = "glm4moe"
    m, c = _Meta(f, arch), _common(f, arch)
    # llama.cpp's converter counts the NextN/MTP blocks in block_count and puts them
    # last; the decoder is the blocks before them (llama.cpp skips them too).
    nextn = m.get_int("nextn_predict_layers", 0)
    if not 0 <= nextn < c["n_layer"]:
        raise GGUFError(f.path, f"metadata {m.key('nextn_predict_layers')} = {nextn} is out of range (0..{c['n_layer'] - 1})")
    n = c["n_layer"] - nextn
    c.update(n_layer=n, n_head_kv=c["n_head_kv"][:n])
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    routing = moe_routing(m, n, c["n_expert"], norm_default=False)  # llama.cpp's defaults when the keys are absent
    if not f.has(m.key("expert_gating_func")):
        routing["expert_gating"] = "sigmoid"  # llama.cpp: GLM-4.5 routes by sigmoid unless the file says otherwise
    shared = routing["n_expert_shared"]
    return ModelSpec(
        **c,
        **routing,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
        n_ff=_positive(f, m.key("feed_forward_length"), m.get_int("feed_forward_length")) if routing["n_dense_lead"] else 0,
        rope=_rope(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        n_ff_shexp=c["n_ff_exp"] * shared,  # llama.cpp: the shared experts as one FFN of n_ff_exp × count
        n_layer_nextn=nextn,
    )


def _lfm2moe(f: GGUFFile) -> ModelSpec:
    """LFM2-MoE: a layer with 0 kv heads is a short-conv layer (llama.cpp's rule), the
    rest attend; the first leading_dense_block_count layers have a dense FFN."""
    arch = "lfm2moe"
    m, c = _Meta(f, arch), _common(f, arch, no_attention_kv0=True)
    n, kv = c["n_layer"], c["n_head_kv"]
    attn_kv = {h for h in kv if h}
    if len(attn_kv) != 1:
        raise GGUFError(
            f.path, f"metadata {m.key('attention.head_count_kv')} must give every attention layer one nonzero count (has {sorted(set(kv))})"
        )
    hd = c["n_embd"] // c["n_head"]
    routing = moe_routing(m, n, c["n_expert"])
    lead = routing["n_dense_lead"]
    return ModelSpec(
        **{**c, "n_head_kv": (attn_kv.pop(),) * n},  # a conv layer's 0 lives on as recurrent_layers: it gets no K/V rows
        **routing,
        head_dim_k=(hd,) * n,
        head_dim_v=(hd,) * n,
        n_ff=_positive(f, m.key("feed_forward_length"), m.get_int("feed_forward_length")) if lead else 0,
        rope=_rope(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        recurrent_layers=tuple(h == 0 for h in kv),
        ssm_conv_kernel=_positive(f, m.key("shortconv.l_cache"), m.get_int("shortconv.l_cache"), 64),
        shortconv_channels=c["n_embd"],
    )


def _deepseek2(f: GGUFFile) -> ModelSpec:
    """DeepSeek-V2/V3: MLA (llama.cpp's MQA form: one kv head of key_length =
    kv_lora_rank + rope dims, value_length = kv_lora_rank), leading dense layers,
    shared experts of n_ff_exp × expert_shared_count, DeepSeek routing."""
    arch = "deepseek2"
    m, c = _Meta(f, arch), _common(f, arch)
    n = c["n_layer"]
    if m.get_int("nextn_predict_layers", 0):
        raise GGUFError(f.path, f"metadata {m.key('nextn_predict_layers')} > 0: files with the MTP block are not supported")
    if set(c["n_head_kv"]) != {1}:
        raise GGUFError(f.path, f"metadata {m.key('attention.head_count_kv')} must be 1 (MLA caches one latent head)")
    if "blk.0.attn_kv_b.weight" in f.tensors and "blk.0.attn_k_b.weight" not in f.tensors:
        raise GGUFError(f.path, "tensor 'blk.0.attn_kv_b.weight' without attn_k_b/attn_v_b: an MLA file from before the split")
    if not f.has(m.key("attention.key_length_mla")):
        raise GGUFError(f.path, f"metadata key {m.key('attention.key_length_mla')!r} is missing (an MLA file from before the split)")
    kv_lora = _head_dim(m, "attention.kv_lora_rank")
    rope = _rope(m, 0)
    if _head_dim(m, "attention.key_length") != kv_lora + rope.dim or _head_dim(m, "attention.value_length") != kv_lora:
        raise GGUFError(f.path, "MLA: attention.key_length must be kv_lora_rank + rope.dimension_count and value_length kv_lora_rank")
    log_mul = m.get_float("rope.scaling.yarn_log_multiplier", 0.0) / 0.1  # llama.cpp's converter stores 0.1 × mscale_all_dim
    if rope.scaling == "yarn" and not log_mul:
        raise GGUFError(f.path, f"metadata {m.key('rope.scaling.yarn_log_multiplier')} is missing: deepseek2 YaRN needs it")
    routing = moe_routing(m, n, c["n_expert"], norm_default=False)  # llama.cpp's default: no renormalization
    lead = routing["n_dense_lead"]
    return ModelSpec(
        **c,
        **routing,
        head_dim_k=(kv_lora + rope.dim,) * n,
        head_dim_v=(0,) * n,  # V is a view of the cached latent: nothing more is stored
        n_ff=_positive(f, m.key("feed_forward_length"), m.get_int("feed_forward_length")) if lead else 0,
        rope=rope,
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        n_ff_shexp=c["n_ff_exp"] * routing["n_expert_shared"],
        q_lora_rank=m.get_int("attention.q_lora_rank", 0),
        kv_lora_rank=kv_lora,
        head_dim_k_mla=_head_dim(m, "attention.key_length_mla"),
        head_dim_v_mla=_head_dim(m, "attention.value_length_mla"),
        rope_yarn_log_mul=log_mul,
    )


def _llama(f: GGUFFile) -> ModelSpec:
    """Mixtral: llama.cpp writes it as arch `llama` with experts (docs/models.md § mixtral)."""
    arch = "llama"
    m = _Meta(f, arch)
    if m.get_int("expert_count", 0) == 0:
        raise GGUFError(f.path, "is a dense Llama (llama.expert_count is 0 or absent): moe-pipe runs Mixture-of-Experts models only")
    if "blk.0.ffn_gate.0.weight" in f.tensors or "blk.0.ffn_down.0.weight" in f.tensors:
        raise GGUFError(
            f.path,
            "stores each expert as its own tensor (blk.N.ffn_gate.E.weight, llama.cpp's layout before 2024-04): "
            "not supported; re-convert the model with a current llama.cpp or moe-pipe convert",
        )
    c = _common(f, arch)
    n = c["n_layer"]
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    if _window(m):  # llama.cpp's llama graph has no sliding window either: a file that asks for one is refused
        raise GGUFError(f.path, f"metadata {m.key('attention.sliding_window')} is set: sliding-window attention is not supported for llama")
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=_rope(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
    )


def _qwen2moe(f: GGUFFile) -> ModelSpec:
    """Qwen1.5-MoE / Qwen2-MoE: qwen3moe's layout with q/k/v biases, no q/k norm and a
    gated shared expert; the top-k weights are renormalized only when the file says so."""
    arch = "qwen2moe"
    m, c = _Meta(f, arch), _common(f, arch)
    n = c["n_layer"]
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    norm = m.key("expert_weights_norm")
    shexp = m.key("expert_shared_feed_forward_length")
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=_rope(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        # llama.cpp's loader: without the key (files before 2024-06) the shared expert is feed_forward_length wide
        n_ff_shexp=_positive(f, shexp, m.get_int("expert_shared_feed_forward_length" if f.has(shexp) else "feed_forward_length")),
        # llama.cpp's qwen2moe graph never renormalizes (Qwen1.5-MoE's norm_topk_prob is false); moe-pipe convert
        # writes the key true for a checkpoint that renormalizes, which llama.cpp then runs without
        expert_weights_norm=bool(f.meta(norm)) if f.has(norm) else False,
    )


READERS = {
    "qwen3moe": _qwen3moe,
    "qwen2moe": _qwen2moe,
    "gpt-oss": _gpt_oss,
    "gemma4": _gemma4,
    "qwen35moe": _qwen35moe,
    "llama": _llama,
    "glm4moe": _glm4moe,
    "lfm2moe": _lfm2moe,
    "deepseek2": _deepseek2,
}


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
