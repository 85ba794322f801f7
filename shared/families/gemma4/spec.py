"""gemma4's GGUF part (`SpecPart`, shared/gguf/spec.py): its metadata keys read
into a `ModelSpec` and the tensors each layer needs (docs/models.md § gemma4)."""

from __future__ import annotations

import math

from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, RopeSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, final_logit_softcap, head_dim, in_range, positive, rope_keys, sliding_window
from ...gguf.spec_tensors import ATTN, DENSE_FFN, EMBEDDING_AND_FINAL_NORM

TOP_TENSORS = EMBEDDING_AND_FINAL_NORM
# A prompt chunk's attention norms and rotates its queries in place: one query-sized array.
ATTENTION_QUERIES = 1
RECURRENT_ARRAYS = 0  # no recurrent layers (SpecPart)
_LAYER = (
    *ATTN,
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "post_attention_norm.weight",
    "ffn_norm.weight",
    *DENSE_FFN,
    "post_ffw_norm_1.weight",
    "pre_ffw_norm_2.weight",
    "post_ffw_norm_2.weight",
    "post_ffw_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp.scale",
    "ffn_down_exps.scale",
)


def read(f: GGUFFile) -> ModelSpec:
    arch = "gemma4"
    m, c = Meta(f, arch), common_keys(f, arch)
    n = c["n_layer"]
    swa = m.per_layer("attention.sliding_window_pattern", n, False, bool)
    hd_full = head_dim(m, "attention.key_length")
    hd_swa = head_dim(m, "attention.key_length_swa", hd_full) if m.get_int("attention.key_length_swa", 0) else hd_full
    hv_full, hv_swa = head_dim(m, "attention.value_length", hd_full), head_dim(m, "attention.value_length_swa", hd_swa)
    rope = rope_keys(m, hd_full)
    base_swa = in_range(f, m.key("rope.freq_base_swa"), m.get_float("rope.freq_base_swa", 10000.0), 1, math.inf)
    rope = RopeSpec(**{**rope.__dict__, "freq_base_swa": base_swa, "dim_swa": m.get_int("rope.dimension_count_swa", hd_swa)})
    ff = tuple(positive(f, f"{arch}.feed_forward_length", v) for v in m.per_layer("feed_forward_length", n, None))
    return ModelSpec(
        **c,
        head_dim_k=tuple(hd_swa if s else hd_full for s in swa),
        head_dim_v=tuple(hv_swa if s else hv_full for s in swa),
        n_ff=max(ff),
        rope=rope,
        sliding_window=sliding_window(m),
        swa_layers=swa,
        final_logit_softcap=final_logit_softcap(m),
        tied_output="output.weight" not in f.tensors,
        fused_gate_up="blk.0.ffn_gate_up_exps.weight" in f.tensors,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """Every layer alike: attention with q/k norms, the dense MLP beside the experts,
    their norms, the router with its scales."""
    return _LAYER


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """None beyond the common shapes (the dense MLP's three agree by the common check)."""
    return {}
