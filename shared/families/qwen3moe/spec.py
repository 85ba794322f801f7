"""qwen3moe's GGUF part (`SpecPart`, shared/gguf/spec.py): its metadata keys
read into a `ModelSpec` and the tensors each layer needs (docs/models.md § qwen3moe)."""

from __future__ import annotations

from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, rope_keys
from ...gguf.spec_tensors import ATTN, EMBEDDING_AND_FINAL_NORM

TOP_TENSORS = EMBEDDING_AND_FINAL_NORM
ATTENTION_QUERIES = 2  # query-sized arrays a prompt chunk's attention keeps at once (SpecPart)
RECURRENT_ARRAYS = 0  # no recurrent layers (SpecPart)
_LAYER = (*ATTN, "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight")


def read(f: GGUFFile) -> ModelSpec:
    arch = "qwen3moe"
    m, c = Meta(f, arch), common_keys(f, arch)
    hd = head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * c["n_layer"],
        head_dim_v=(head_dim(m, "attention.value_length", hd),) * c["n_layer"],
        n_ff=0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * c["n_layer"],
        tied_output="output.weight" not in f.tensors,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """Every layer alike: attention with q/k norms, the router (its experts are streamed)."""
    return _LAYER


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """None beyond the common shapes."""
    return {}
