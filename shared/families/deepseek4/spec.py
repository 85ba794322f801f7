"""deepseek4's GGUF part (`SpecPart`, shared/gguf/spec.py): DeepSeek-V4's metadata keys read
into a `ModelSpec`, its own facts (`V4Facts`: compression, hyper-connections, indexer, hash
routing) and the tensors each layer needs (docs/models.md § deepseek4).

The KV cache is compact, as llama.cpp's: every layer keeps the normalized and rotated keys
(one head of head_dim; the value is the key) of its sliding window only, a ring (K); a
compressing layer keeps its entries, each folded once as its window completes (head_dim
wide, plus the indexer's key of index_head_dim on a CSA layer), and of the rows its
compressors fold (V: the compressor's kv and gate projections, 2·head_dim each on a CSA
layer, head_dim on an HCA one, and on a CSA layer the indexer's, 2·index_head_dim each)
only the positions a fold still reads, a ring of its own window (`V4Facts.rows_window`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGUFValueType

from ...errors import GGUFError
from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, in_range, positive, rope_keys
from ...gguf.spec_tensors import EMBEDDING_AND_FINAL_NORM, SHARED_EXPERT

ARCH = "deepseek4"
CSA_RATIO = 4  # a layer compressing by 4 is compressed sparse attention (overlapping windows + indexer)
SQRT_SOFTPLUS = 4  # llama.cpp's expert_gating_func for sqrt(softplus(logits)) scores (LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS)
TOP_TENSORS = (*EMBEDDING_AND_FINAL_NORM, "output.weight", "output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight")
ATTENTION_QUERIES = 2  # query-sized arrays a prompt chunk's attention keeps at once (SpecPart)
RECURRENT_ARRAYS = 0  # no recurrent layers (SpecPart)
_LAYER = (
    "attn_norm.weight",
    "attn_sinks.weight",
    "attn_q_a.weight",
    "attn_q_a_norm.weight",
    "attn_q_b.weight",
    "attn_kv.weight",
    "attn_kv_a_norm.weight",
    "attn_output_a.weight",
    "attn_output_b.weight",
    "hc_attn_fn.weight",
    "hc_attn_base.weight",
    "hc_attn_scale.weight",
    "hc_ffn_fn.weight",
    "hc_ffn_base.weight",
    "hc_ffn_scale.weight",
    "ffn_norm.weight",
    "ffn_gate_inp.weight",
    *SHARED_EXPERT,
)
_COMPRESSOR = ("attn_compressor_kv.weight", "attn_compressor_gate.weight", "attn_compressor_ape.weight", "attn_compressor_norm.weight")
_INDEXER = (
    "indexer.proj.weight",
    "indexer.attn_q_b.weight",
    "indexer_compressor_kv.weight",
    "indexer_compressor_gate.weight",
    "indexer_compressor_ape.weight",
    "indexer_compressor_norm.weight",
)


@dataclass(frozen=True)
class V4Facts:
    """What DeepSeek-V4's forward pass needs beyond the shared `ModelSpec`."""

    head_dim: int  # the one kv head's width (= each query head's); the last rope dims rotate
    q_lora_rank: int
    o_groups: int  # the grouped output projection: heads in o_groups groups ...
    o_lora_rank: int  # ... each projected to o_lora_rank
    compress_ratios: tuple[int, ...]  # per layer: 0 sliding only, 4 CSA, else HCA
    compress_rope_base: float  # the compressing layers' (and their compressors') rope base
    hc_mult: int  # residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: int  # layers 0..hash_layers-1 choose experts by token id (ffn_gate_tid2eid)
    index_heads: int
    index_head_dim: int
    index_top_k: int
    swiglu_limit: float  # the experts' (and the shared expert's) clamp; 0 = none
    window: int  # the raw keys' sliding window

    def comp_width(self, i: int) -> int:
        """Per position, the compressor's kv (and gate) width on layer i: 0 when it has none."""
        r = self.compress_ratios[i]
        return 0 if r == 0 else (2 if r == CSA_RATIO else 1) * self.head_dim

    def entry_width(self, i: int) -> int:
        """A cached entry's width on layer i: the compressed key, and on a CSA layer the indexer's key beside it."""
        r = self.compress_ratios[i]
        return 0 if r == 0 else self.head_dim + (self.index_head_dim if r == CSA_RATIO else 0)

    def rows_window(self, i: int) -> int:
        """How many positions of compressor rows a fold on layer i reads, ending at its window's
        last: the window's own (HCA) and, as CSA's entry m also folds window m−1's first halves,
        the window before it (CSA); 0 on a sliding layer."""
        r = self.compress_ratios[i]
        return 2 * r if r == CSA_RATIO else r

    def state_width(self, i: int) -> int:
        """Per position, the compressor rows layer i caches beside its key (kv and gate, and the indexer's)."""
        r = self.compress_ratios[i]
        return 0 if r == 0 else 2 * self.comp_width(i) + (4 * self.index_head_dim if r == CSA_RATIO else 0)


def decoder_layers(f: GGUFFile) -> tuple[int, int]:
    """(decoder blocks, MTP blocks after them), as llama.cpp's loader counts them: block_count
    includes `nextn_predict_layers` MTP blocks only when the first one's tensors are there
    (llama.cpp's converter writes the key from the config but skips the MTP tensors)."""
    m, n_all = Meta(f, ARCH), common_keys(f, ARCH)["n_layer"]
    nextn = m.get_int("nextn_predict_layers", 0)
    if not 0 <= nextn < n_all:
        raise GGUFError(f.path, f"metadata {m.key('nextn_predict_layers')} = {nextn} is out of range (0..{n_all - 1})")
    if nextn and f"blk.{n_all - nextn}.nextn.eh_proj.weight" not in f.tensors:
        nextn = 0
    return n_all - nextn, nextn


def _ints(f: GGUFFile, m: Meta, suffix: str, n: int) -> tuple[int, ...]:
    """A per-layer integer array of at least n entries (DeepSeek's compress_ratios has one for
    the MTP block too), its first n."""
    key = m.key(suffix)
    if not f.has(key) or f.meta_type(key)[0] != GGUFValueType.ARRAY or f.meta_len(key) < n:
        raise GGUFError(f.path, f"metadata key {key!r} must be an array of at least {n} integers, one per layer")
    return tuple(int(v) for v in list(f.meta(key))[:n])


def facts(f: GGUFFile) -> V4Facts:
    """DeepSeek-V4's own keys, checked (llama.cpp's loader reads the same ones)."""
    m, c = Meta(f, ARCH), common_keys(f, ARCH)
    n, _ = decoder_layers(f)
    hd = head_dim(m, "attention.key_length")
    ratios = _ints(f, m, "attention.compress_ratios", n)
    for r in ratios:
        if r not in (0, CSA_RATIO) and not 1 < r <= 1 << 16:
            raise GGUFError(
                f.path, f"metadata {m.key('attention.compress_ratios')} holds {r}: DeepSeek-V4 compresses by 0, 4 or another ratio > 1"
            )
    groups = positive(f, m.key("attention.output_group_count"), m.get_int("attention.output_group_count"), 4096)
    if c["n_head"] % groups:
        raise GGUFError(f.path, f"metadata {m.key('attention.output_group_count')} = {groups} does not divide head_count {c['n_head']}")
    hc = positive(f, m.key("hyper_connection.count"), m.get_int("hyper_connection.count"), 64)
    clamp = m.per_layer("swiglu_clamp_exp", c["n_layer"], 0.0, float)[:n]
    if len(set(clamp)) > 1:
        raise GGUFError(f.path, f"metadata {m.key('swiglu_clamp_exp')}: one clamp for every layer is supported, has {sorted(set(clamp))}")
    csa = CSA_RATIO in ratios
    return V4Facts(
        head_dim=hd,
        q_lora_rank=positive(f, m.key("attention.q_lora_rank"), m.get_int("attention.q_lora_rank")),
        o_groups=groups,
        o_lora_rank=positive(f, m.key("attention.output_lora_rank"), m.get_int("attention.output_lora_rank")),
        compress_ratios=ratios,
        compress_rope_base=in_range(
            f, m.key("attention.compress_rope_freq_base"), m.get_float("attention.compress_rope_freq_base"), 1, 1e12
        ),
        hc_mult=hc,
        hc_sinkhorn_iters=positive(
            f, m.key("hyper_connection.sinkhorn_iterations"), m.get_int("hyper_connection.sinkhorn_iterations"), 1000
        ),
        hc_eps=in_range(f, m.key("hyper_connection.epsilon"), m.get_float("hyper_connection.epsilon"), 0, 1),
        hash_layers=min(n, m.get_int("hash_layer_count", 0)),
        index_heads=positive(f, m.key("attention.indexer.head_count"), m.get_int("attention.indexer.head_count")) if csa else 0,
        index_head_dim=head_dim(m, "attention.indexer.key_length") if csa else 0,
        index_top_k=positive(f, m.key("attention.indexer.top_k"), m.get_int("attention.indexer.top_k")) if csa else 0,
        swiglu_limit=clamp[0] if clamp else 0.0,
        window=positive(f, m.key("attention.sliding_window"), m.get_int("attention.sliding_window")),
    )


def read(f: GGUFFile) -> ModelSpec:
    """One kv head (key = value) of head_dim per position in every layer's sliding window,
    the compressor rows (`V4Facts.state_width`) a fold still reads (`rows_window`) and each
    compressing layer's entries (`entry_width`, one per ratio positions); sqrt-softplus
    routing (the model computes it: `expert_gating` stays the neutral default)."""
    m, c = Meta(f, ARCH), common_keys(f, ARCH)
    n, nextn = decoder_layers(f)
    c.update(n_layer=n, n_head_kv=c["n_head_kv"][:n])
    if set(c["n_head_kv"]) != {1}:
        raise GGUFError(f.path, f"metadata {m.key('attention.head_count_kv')} must be 1 (DeepSeek-V4 shares one kv head)")
    if m.get_int("expert_gating_func", SQRT_SOFTPLUS) != SQRT_SOFTPLUS:
        raise GGUFError(f.path, f"metadata {m.key('expert_gating_func')} must be {SQRT_SOFTPLUS} (sqrt-softplus): DeepSeek-V4 routes by it")
    v4 = facts(f)
    rope = rope_keys(m, v4.head_dim)
    if rope.dim > v4.head_dim or rope.dim % 2 or (v4.index_head_dim and rope.dim > v4.index_head_dim):
        raise GGUFError(f.path, f"metadata {m.key('rope.dimension_count')} = {rope.dim} must be even and fit the heads")
    shared = m.get_int("expert_shared_count", 0)
    return ModelSpec(
        **c,
        head_dim_k=(v4.head_dim,) * n,
        head_dim_v=tuple(v4.state_width(i) for i in range(n)),
        n_ff=0,
        rope=rope,
        sliding_window=v4.window,
        swa_layers=(True,) * n,  # every layer's raw keys: a ring of its window
        compress_ratios=v4.compress_ratios,
        entry_widths=tuple(v4.entry_width(i) for i in range(n)),
        v_windows=tuple(v4.rows_window(i) for i in range(n)),
        tied_output=False,
        n_ff_shexp=c["n_ff_exp"] * shared,
        n_expert_shared=shared,
        expert_weights_norm=bool(f.meta(m.key("expert_weights_norm"))) if f.has(m.key("expert_weights_norm")) else False,
        expert_weights_scale=m.get_float("expert_weights_scale", 1.0),
        q_lora_rank=v4.q_lora_rank,
        n_layer_nextn=nextn,  # never run, loaded or streamed
    )


def layer_kind(spec: ModelSpec, i: int) -> str:
    """ "sliding", "hca" or "csa": what layer i's cached rows say (`V4Facts.state_width`)."""
    hd, extra = spec.head_dim_k[i], spec.head_dim_v[i]
    return "sliding" if extra == 0 else "hca" if extra == 2 * hd else "csa"


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """Every layer: attention, hyper-connections, router and shared expert; a compressing
    layer its compressor, a CSA layer its indexer. (A hash layer's token → experts table or
    another layer's selection bias is asked for as the layer loads: which layers hash is a
    V4 fact, not the spec's.)"""
    kind = layer_kind(spec, i)
    return (*_LAYER, *(_COMPRESSOR if kind != "sliding" else ()), *(_INDEXER if kind == "csa" else ()))


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """The attention tensors whose shapes the spec fixes (numpy order); the grouped output
    projection, the hyper-connections and the compressors are checked as the layer loads."""
    p, d, h, hd, ql = f"blk.{i}.", spec.n_embd, spec.n_head, spec.head_dim_k[i], spec.q_lora_rank
    return {
        p + "attn_q_a.weight": ("matrix", (ql, d), f"q_lora_rank {ql}, n_embd {d}"),
        p + "attn_q_a_norm.weight": ("vector", (ql,), f"q_lora_rank {ql}"),
        p + "attn_q_b.weight": ("matrix", (h * hd, ql), f"{h} heads × {hd}, q_lora_rank {ql}"),
        p + "attn_kv.weight": ("matrix", (hd, d), f"head_dim {hd}, n_embd {d}"),
        p + "attn_kv_a_norm.weight": ("vector", (hd,), f"head_dim {hd}"),
        p + "attn_sinks.weight": ("vector", (h,), f"{h} heads"),
    }
