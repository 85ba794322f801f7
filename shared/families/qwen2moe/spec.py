"""qwen2moe's GGUF part (`SpecPart`, shared/gguf/spec.py): Qwen1.5-MoE / Qwen2-MoE's
metadata keys read into a `ModelSpec` and the tensors each layer needs
(docs/models.md § qwen2moe)."""

from __future__ import annotations

from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, positive, rope_keys
from ...gguf.spec_tensors import ATTN, EMBEDDING_AND_FINAL_NORM, SHARED_EXPERT, shared_expert_shapes

TOP_TENSORS = EMBEDDING_AND_FINAL_NORM
ATTENTION_QUERIES = 2  # query-sized arrays a prompt chunk's attention keeps at once (SpecPart)
RECURRENT_ARRAYS = 0  # no recurrent layers (SpecPart)
_LAYER = (
    *ATTN,
    "attn_v.weight",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "ffn_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp_shexp.weight",
    *SHARED_EXPERT,
)


def _experts_split_ffn(m: Meta, n_used: int) -> int:
    """llama.cpp's converter wrote no expert_feed_forward_length before 2024-06 (the
    official Qwen1.5-MoE GGUFs): its loader then takes feed_forward_length / expert_used_count."""
    return positive(m.f, m.key("feed_forward_length"), m.get_int("feed_forward_length") // n_used)


def read(f: GGUFFile) -> ModelSpec:
    """qwen3moe's layout with q/k/v biases, no q/k norm and a gated shared expert;
    the top-k weights are renormalized only when the file says so."""
    arch = "qwen2moe"
    m, c = Meta(f, arch), common_keys(f, arch, ff_exp_fallback=_experts_split_ffn)
    n = c["n_layer"]
    hd = head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    norm = m.key("expert_weights_norm")
    shexp = m.key("expert_shared_feed_forward_length")
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        # llama.cpp's loader: without the key (files before 2024-06) the shared expert is feed_forward_length wide
        n_ff_shexp=positive(f, shexp, m.get_int("expert_shared_feed_forward_length" if f.has(shexp) else "feed_forward_length")),
        # llama.cpp's qwen2moe graph never renormalizes (Qwen1.5-MoE's norm_topk_prob is false); moe-pipe convert
        # writes the key true for a checkpoint that renormalizes, which llama.cpp then runs without
        expert_weights_norm=bool(f.meta(norm)) if f.has(norm) else False,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """Every layer alike: attention with q/k/v biases, the router, the shared expert and its gate."""
    return _LAYER


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """The shared expert (n_ff_shexp wide)."""
    return shared_expert_shapes(spec, i)
