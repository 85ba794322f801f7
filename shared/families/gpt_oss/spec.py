"""gpt-oss's GGUF part (`SpecPart`, shared/gguf/spec.py): its metadata keys read
into a `ModelSpec` and the tensors each layer needs (docs/models.md § gpt-oss)."""

from __future__ import annotations

from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, rope_keys, sliding_window
from ...gguf.spec_tensors import ATTN, EMBEDDING_AND_FINAL_NORM

TOP_TENSORS = EMBEDDING_AND_FINAL_NORM
ATTENTION_QUERIES = 2  # query-sized arrays a prompt chunk's attention keeps at once (SpecPart)
RECURRENT_ARRAYS = 0  # no recurrent layers (SpecPart)
_LAYER = (
    *ATTN,
    "attn_v.weight",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_output.bias",
    "attn_sinks.weight",
    "post_attention_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp.bias",
)


def read(f: GGUFFile) -> ModelSpec:
    arch = "gpt-oss"
    m, c = Meta(f, arch), common_keys(f, arch)
    n = c["n_layer"]
    hd = head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    window = sliding_window(m)
    # gpt-oss alternates: sliding on even layers (llama.cpp swa pattern 2).
    swa = (
        m.per_layer("attention.sliding_window_pattern", n, None, bool)
        if f.has(m.key("attention.sliding_window_pattern"))
        else tuple(i % 2 == 0 and window > 0 for i in range(n))
    )
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=rope_keys(m, hd),
        sliding_window=window,
        swa_layers=swa,
        tied_output="output.weight" not in f.tensors,
        fused_gate_up="blk.0.ffn_gate_up_exps.weight" in f.tensors,
        expert_bias=True,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """Every layer alike: attention with biases and sinks, the router with its bias."""
    return _LAYER


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """None beyond the common shapes."""
    return {}
