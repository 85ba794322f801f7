"""Mixtral's GGUF part (`SpecPart`, shared/gguf/spec.py): llama.cpp writes it as
arch `llama` with experts; its metadata keys read into a `ModelSpec` and the
tensors each layer needs (docs/models.md § mixtral)."""

from __future__ import annotations

from ...errors import GGUFError
from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, positive, rope_keys, sliding_window
from ...gguf.spec_tensors import ATTN, EMBEDDING_AND_FINAL_NORM

TOP_TENSORS = EMBEDDING_AND_FINAL_NORM
ATTENTION_QUERIES = 2  # query-sized arrays a prompt chunk's attention keeps at once (SpecPart)
RECURRENT_ARRAYS = 0  # no recurrent layers (SpecPart)
_LAYER = (*ATTN, "attn_v.weight", "ffn_norm.weight", "ffn_gate_inp.weight")


def _experts_as_wide_as_ffn(m: Meta, n_used: int) -> int:
    """llama.cpp writes Mixtral without expert_feed_forward_length, its experts
    being feed_forward_length wide."""
    return positive(m.f, m.key("feed_forward_length"), m.get_int("feed_forward_length"))


def read(f: GGUFFile) -> ModelSpec:
    arch = "llama"
    m = Meta(f, arch)
    if m.get_int("expert_count", 0) == 0:
        raise GGUFError(f.path, "is a dense Llama (llama.expert_count is 0 or absent): moe-pipe runs Mixture-of-Experts models only")
    if "blk.0.ffn_gate.0.weight" in f.tensors or "blk.0.ffn_down.0.weight" in f.tensors:
        raise GGUFError(
            f.path,
            "stores each expert as its own tensor (blk.N.ffn_gate.E.weight, llama.cpp's layout before 2024-04): "
            "not supported; re-convert the model with a current llama.cpp or moe-pipe convert",
        )
    c = common_keys(f, arch, ff_exp_fallback=_experts_as_wide_as_ffn)
    n = c["n_layer"]
    hd = head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    if sliding_window(m):  # llama.cpp's llama graph has no sliding window either: a file that asks for one is refused
        raise GGUFError(f.path, f"metadata {m.key('attention.sliding_window')} is set: sliding-window attention is not supported for llama")
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """Every layer alike: plain attention (no biases, no q/k norms), the router."""
    return _LAYER


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """None beyond the common shapes."""
    return {}
