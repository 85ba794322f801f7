"""glm4moe's GGUF part (`SpecPart`, shared/gguf/spec.py): GLM-4.5's metadata keys
read into a `ModelSpec` and the tensors each layer needs (docs/models.md § glm4moe)."""

from __future__ import annotations

from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, moe_routing, positive, rope_keys, split_nextn
from ...gguf.spec_tensors import (
    ATTN,
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
# The leading dense layers have a dense FFN, the others a router with its
# selection bias (and the shared expert when expert_shared_count > 0).
_ATTN = (*ATTN, "attn_v.weight", "post_attention_norm.weight")
_DENSE = (*_ATTN, *DENSE_FFN)
_MOE = (*_ATTN, "ffn_gate_inp.weight", "exp_probs_b.bias")


def read(f: GGUFFile) -> ModelSpec:
    arch = "glm4moe"
    m, c = Meta(f, arch), common_keys(f, arch)
    nextn = split_nextn(m, c)  # the decoder is the blocks before the NextN/MTP ones
    n = c["n_layer"]
    hd = head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    routing = moe_routing(m, n, c["n_expert"], norm_default=False)  # llama.cpp's defaults when the keys are absent
    if not f.has(m.key("expert_gating_func")):
        routing["expert_gating"] = "sigmoid"  # llama.cpp: GLM-4.5 routes by sigmoid unless the file says otherwise
    shared = routing["n_expert_shared"]
    return ModelSpec(
        **c,
        **routing,
        head_dim_k=(hd,) * n,
        head_dim_v=(head_dim(m, "attention.value_length", hd),) * n,
        n_ff=positive(f, m.key("feed_forward_length"), m.get_int("feed_forward_length")) if routing["n_dense_lead"] else 0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        n_ff_shexp=c["n_ff_exp"] * shared,  # llama.cpp: the shared experts as one FFN of n_ff_exp × count
        n_layer_nextn=nextn,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """Attention with q/k/v biases, then a leading dense layer's FFN or the router
    with its selection bias and the shared expert."""
    if not spec.has_experts(i):
        return _DENSE
    return _MOE + (SHARED_EXPERT if spec.n_expert_shared else ())


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """A leading dense layer's FFN (n_ff wide), or the routed layer's selection
    bias and shared expert (n_ff_exp × expert_shared_count)."""
    if not spec.has_experts(i):
        return dense_ffn_shapes(spec, i)
    return {**selection_bias_shape(spec, i), **shared_expert_shapes(spec, i)}
