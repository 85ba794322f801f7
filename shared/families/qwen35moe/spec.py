"""qwen35moe's GGUF part (`SpecPart`, shared/gguf/spec.py): Qwen3.5-MoE's metadata
keys read into a `ModelSpec` (gated full attention every few layers, Gated DeltaNet
linear attention between them) and the tensors each kind of layer needs
(docs/models.md § qwen35moe)."""

from __future__ import annotations

from ...errors import GGUFError
from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, positive, rope_keys, split_nextn
from ...gguf.spec_tensors import EMBEDDING_AND_FINAL_NORM, SHARED_EXPERT, shared_expert_shapes

TOP_TENSORS = EMBEDDING_AND_FINAL_NORM
ATTENTION_QUERIES = 2  # query-sized arrays a prompt chunk's attention keeps at once (SpecPart)
RECURRENT_ARRAYS = 4  # head-sized arrays a prompt chunk's recurrent layer keeps at once (SpecPart)
_COMMON = ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", *SHARED_EXPERT)
# What a layer needs depends on its kind (full attention or linear attention).
_ATTN = (
    *_COMMON,
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
)
_LINEAR = (
    *_COMMON,
    *(f"{n}.weight" for n in ("attn_qkv", "attn_gate", "ssm_conv1d", "ssm_beta", "ssm_alpha", "ssm_norm", "ssm_out")),
    "ssm_dt.bias",
    "ssm_a",
)


def read(f: GGUFFile) -> ModelSpec:
    arch = "qwen35moe"
    m, c = Meta(f, arch), common_keys(f, arch)
    nextn = split_nextn(m, c)  # Qwen3.5/3.6's MTP block: one full-attention MoE layer after the decoder's
    n = c["n_layer"]
    hd = head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    interval = positive(f, m.key("full_attention_interval"), m.get_int("full_attention_interval", 4), n)
    # llama.cpp's rule when the file has no per-layer flags: every interval-th layer attends, the rest are recurrent
    recurrent = tuple((i + 1) % interval != 0 for i in range(n))
    state = positive(f, m.key("ssm.state_size"), m.get_int("ssm.state_size"), 1 << 12)
    groups = positive(f, m.key("ssm.group_count"), m.get_int("ssm.group_count"), 1 << 12)
    heads = positive(f, m.key("ssm.time_step_rank"), m.get_int("ssm.time_step_rank"), 1 << 12)
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
        head_dim_v=(head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        recurrent_layers=recurrent,
        ssm_conv_kernel=positive(f, m.key("ssm.conv_kernel"), m.get_int("ssm.conv_kernel"), 64),
        ssm_state=state,
        ssm_groups=groups,
        ssm_heads=heads,
        n_ff_shexp=positive(f, m.key("expert_shared_feed_forward_length"), m.get_int("expert_shared_feed_forward_length")),
        n_layer_nextn=nextn,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """A linear-attention layer's delta-rule tensors, or a full-attention layer's
    gated attention; both with the router and the gated shared expert."""
    return _LINEAR if spec.is_recurrent(i) else _ATTN


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """q carries a gate per head (2 × the width), the shared expert, and in a
    linear-attention layer the ssm_* tensors."""
    p, d, h, hk = f"blk.{i}.", spec.n_embd, spec.n_head, spec.head_dim_k[i]
    st, vh, ch = spec.ssm_state, spec.ssm_heads, spec.ssm_conv_channels
    out: Shapes = {
        p + "attn_q.weight": ("matrix", (2 * h * hk, d), f"{h} heads × {hk} key dims × 2 (query and gate), n_embd {d}"),
        **shared_expert_shapes(spec, i),
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
