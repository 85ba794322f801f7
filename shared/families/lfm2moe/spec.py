"""lfm2moe's GGUF part (`SpecPart`, shared/gguf/spec.py): LFM2-MoE's metadata keys
read into a `ModelSpec` and the tensors each layer needs (docs/models.md § lfm2moe)."""

from __future__ import annotations

from ...errors import GGUFError
from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, moe_routing, positive, rope_keys
from ...gguf.spec_tensors import DENSE_FFN, selection_bias_shape

# The final norm keeps llama.cpp's name (LFM2's "embedding_norm", applied after the last layer).
TOP_TENSORS: tuple[str, ...] = ("token_embd.weight", "token_embd_norm.weight")
ATTENTION_QUERIES = 2  # query-sized arrays a prompt chunk's attention keeps at once (SpecPart)
RECURRENT_ARRAYS = 4  # head-sized arrays a prompt chunk's recurrent layer keeps at once (SpecPart)
_CONV = ("shortconv.in_proj.weight", "shortconv.conv.weight", "shortconv.out_proj.weight")
_ATTN = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight")


def read(f: GGUFFile) -> ModelSpec:
    """A layer with 0 kv heads is a short-conv layer (llama.cpp's rule), the rest
    attend; the first leading_dense_block_count layers have a dense FFN."""
    arch = "lfm2moe"
    m, c = Meta(f, arch), common_keys(f, arch, no_attention_kv0=True)
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
        n_ff=positive(f, m.key("feed_forward_length"), m.get_int("feed_forward_length")) if lead else 0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        recurrent_layers=tuple(h == 0 for h in kv),
        ssm_conv_kernel=positive(f, m.key("shortconv.l_cache"), m.get_int("shortconv.l_cache"), 64),
        shortconv_channels=c["n_embd"],
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """A short-conv or attention operator, then a dense FFN or the routed experts' router."""
    op = _CONV if spec.is_recurrent(i) else _ATTN
    return ("attn_norm.weight", *op, "ffn_norm.weight", *(("ffn_gate_inp.weight",) if spec.has_experts(i) else DENSE_FFN))


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """The short conv (in_proj → B, C, x; a depthwise conv of width l_cache), the
    experts' selection bias; and the final norm, a model-wide tensor named here
    because only this family has it (the same entry from every layer)."""
    p, d, k = f"blk.{i}.", spec.n_embd, spec.ssm_conv_kernel
    return {
        "token_embd_norm.weight": ("vector", (d,), f"n_embd {d}"),
        p + "shortconv.in_proj.weight": ("matrix", (3 * d, d), f"3 × n_embd {d} (B, C, x), n_embd {d}"),
        p + "shortconv.conv.weight": ("vector", (d, k), f"n_embd {d} channels × l_cache {k}"),
        p + "shortconv.out_proj.weight": ("matrix", (d, d), f"n_embd {d}, n_embd {d}"),
        **selection_bias_shape(spec, i),
    }
