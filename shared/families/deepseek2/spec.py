"""deepseek2's GGUF part (`SpecPart`, shared/gguf/spec.py): DeepSeek-V2/V3's
metadata keys read into a `ModelSpec` and the tensors each layer needs
(docs/models.md § deepseek2)."""

from __future__ import annotations

from ...errors import GGUFError
from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, moe_routing, positive, rope_keys, split_nextn
from ...gguf.spec_tensors import (
    DENSE_FFN,
    EMBEDDING_AND_FINAL_NORM,
    SHARED_EXPERT,
    dense_ffn_shapes,
    selection_bias_shape,
    shared_expert_shapes,
)

TOP_TENSORS = EMBEDDING_AND_FINAL_NORM
ATTENTION_QUERIES = 2  # query-sized arrays a prompt chunk's attention keeps at once (SpecPart)
RECURRENT_ARRAYS = 0  # no recurrent layers (SpecPart)
# MLA (attn_q, or attn_q_a → norm → attn_q_b), then a dense FFN or router (+ shared experts).
_ATTN = (
    "attn_norm.weight",
    "attn_kv_a_mqa.weight",
    "attn_kv_a_norm.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
    "attn_output.weight",
    "ffn_norm.weight",
)


def read(f: GGUFFile) -> ModelSpec:
    """MLA (llama.cpp's MQA form: one kv head of key_length = kv_lora_rank + rope
    dims, value_length = kv_lora_rank), leading dense layers, shared experts of
    n_ff_exp × expert_shared_count, DeepSeek routing."""
    arch = "deepseek2"
    m, c = Meta(f, arch), common_keys(f, arch)
    # V3's MTP layer, where a converter writes it (llama.cpp's skips it): the blocks after the decoder's
    nextn = split_nextn(m, c)
    n = c["n_layer"]
    if set(c["n_head_kv"]) != {1}:
        raise GGUFError(f.path, f"metadata {m.key('attention.head_count_kv')} must be 1 (MLA caches one latent head)")
    if "blk.0.attn_kv_b.weight" in f.tensors and "blk.0.attn_k_b.weight" not in f.tensors:
        raise GGUFError(f.path, "tensor 'blk.0.attn_kv_b.weight' without attn_k_b/attn_v_b: an MLA file from before the split")
    if not f.has(m.key("attention.key_length_mla")):
        raise GGUFError(f.path, f"metadata key {m.key('attention.key_length_mla')!r} is missing (an MLA file from before the split)")
    kv_lora = head_dim(m, "attention.kv_lora_rank")
    rope = rope_keys(m, 0)
    if head_dim(m, "attention.key_length") != kv_lora + rope.dim or head_dim(m, "attention.value_length") != kv_lora:
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
        n_ff=positive(f, m.key("feed_forward_length"), m.get_int("feed_forward_length")) if lead else 0,
        rope=rope,
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        n_ff_shexp=c["n_ff_exp"] * routing["n_expert_shared"],
        q_lora_rank=m.get_int("attention.q_lora_rank", 0),
        kv_lora_rank=kv_lora,
        head_dim_k_mla=head_dim(m, "attention.key_length_mla"),
        head_dim_v_mla=head_dim(m, "attention.value_length_mla"),
        rope_yarn_log_mul=log_mul,
        n_layer_nextn=nextn,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """MLA with a plain or a low-rank query, then a leading dense layer's FFN, or
    the router and the shared experts."""
    q = ("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight") if spec.q_lora_rank else ("attn_q.weight",)
    if not spec.has_experts(i):
        return (*_ATTN, *q, *DENSE_FFN)
    return (*_ATTN, *q, "ffn_gate_inp.weight", *(SHARED_EXPERT if spec.n_expert_shared else ()))


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """The MLA tensors in layer i (numpy order), and the FFNs: a leading dense
    layer's n_ff-wide FFN, or the shared experts and the optional selection bias
    (V2 has none; V3's is checked when present)."""
    p, d, h, r = f"blk.{i}.", spec.n_embd, spec.n_head, spec.kv_lora_rank
    qk, rope, v, ql = spec.head_dim_k_mla, spec.rope.dim, spec.head_dim_v_mla, spec.q_lora_rank
    nope, heads = qk - rope, f"{h} heads"
    ffn = shared_expert_shapes(spec, i) if spec.has_experts(i) else dense_ffn_shapes(spec, i)
    return {
        **ffn,
        p + "attn_q.weight": ("matrix", (h * qk, d), f"{heads} × {qk} (nope + rope), n_embd {d}"),
        p + "attn_q_a.weight": ("matrix", (ql, d), f"q_lora_rank {ql}, n_embd {d}"),
        p + "attn_q_a_norm.weight": ("vector", (ql,), f"q_lora_rank {ql}"),
        p + "attn_q_b.weight": ("matrix", (h * qk, ql), f"{heads} × {qk}, q_lora_rank {ql}"),
        p + "attn_kv_a_mqa.weight": ("matrix", (r + rope, d), f"kv_lora_rank {r} + {rope} rope dims, n_embd {d}"),
        p + "attn_kv_a_norm.weight": ("vector", (r,), f"kv_lora_rank {r}"),
        p + "attn_k_b.weight": ("matrix", (h, r, nope), f"{heads}, kv_lora_rank {r}, {nope} nope dims"),
        p + "attn_v_b.weight": ("matrix", (h, v, r), f"{heads}, {v} value dims, kv_lora_rank {r}"),
        p + "attn_output.weight": ("matrix", (d, h * v), f"n_embd {d}, {heads} × {v} value dims"),
        **(selection_bias_shape(spec, i) if spec.has_experts(i) else {}),
    }
