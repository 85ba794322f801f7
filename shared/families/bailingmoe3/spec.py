"""bailingmoe3's GGUF part (`SpecPart`, shared/gguf/spec.py): Ling 3.0's metadata
keys read into a `ModelSpec` (Kimi Delta Attention on most layers, gated MLA on
the rest, told apart by a per-layer head_count_kv of 0 or 1) and the tensors each
kind of layer needs (docs/models.md § bailingmoe3)."""

from __future__ import annotations

from ...errors import GGUFError
from ...gguf.reader import GGUFFile
from ...gguf.spec import ModelSpec, Shapes
from ...gguf.spec_keys import Meta, common_keys, head_dim, moe_routing, positive, rope_keys
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
RECURRENT_ARRAYS = 7  # KDA: q, k, v's copy, the decay per channel, the output, its gate and a float64 norm (SpecPart)
_NORMS = ("attn_norm.weight", "ffn_norm.weight")
# Kimi Delta Attention: q/k/v each through its own short conv, the per-channel forget
# gate (f_a, dt bias, a = exp(A_log)), β, the output norm and its sigmoid gate (g_a).
KDA = (
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "ssm_conv1d_q.weight",
    "ssm_conv1d_k.weight",
    "ssm_conv1d_v.weight",
    "ssm_f_a.weight",
    "ssm_dt.bias",
    "ssm_a",
    "ssm_beta.weight",
    "ssm_g_a.weight",
    "ssm_norm.weight",
    "attn_output.weight",
)
# Latent attention as deepseek2's, with a sigmoid gate per head (attn_gate) on its output.
_MLA = ("attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight", "attn_gate.weight", "attn_output.weight")


def read(f: GGUFFile) -> ModelSpec:
    """head_count_kv per layer: 0 is a KDA layer (recurrent), 1 an MLA layer (llama.cpp's
    MQA form: one latent head of key_length = kv_lora_rank + rope dims). Leading dense
    layers, shared experts, DeepSeek-V3 routing; the MTP block is not run."""
    arch = "bailingmoe3"
    m, c = Meta(f, arch), common_keys(f, arch, no_attention_kv0=True)
    # llama.cpp's newer converter counts the MTP block in block_count and puts it last
    nextn = m.get_int("nextn_predict_layers", 0)
    if not 0 <= nextn < c["n_layer"]:
        raise GGUFError(f.path, f"metadata {m.key('nextn_predict_layers')} = {nextn} is out of range (0..{c['n_layer'] - 1})")
    n = c["n_layer"] - nextn
    c.update(n_layer=n, n_head_kv=c["n_head_kv"][:n])
    if set(c["n_head_kv"]) - {0, 1}:
        raise GGUFError(f.path, f"metadata {m.key('attention.head_count_kv')} must be 0 (KDA) or 1 (MLA) per layer")
    if 1 not in c["n_head_kv"]:
        raise GGUFError(f.path, f"metadata {m.key('attention.head_count_kv')}: no MLA layer (a model must attend somewhere)")
    kv_lora = head_dim(m, "attention.kv_lora_rank")
    rope = rope_keys(m, 0)
    if rope.scaling != "none":  # llama.cpp's bailingmoe3 graph scales scores by 1/√d, YaRN's mscale is not in it
        raise GGUFError(f.path, f"metadata {m.key('rope.scaling.type')} = {rope.scaling!r}: bailingmoe3 runs plain RoPE only")
    if head_dim(m, "attention.key_length", kv_lora + rope.dim) != kv_lora + rope.dim:
        raise GGUFError(f.path, "MLA: attention.key_length must be kv_lora_rank + rope.dimension_count")
    if f.has(m.key("kda.safe_gate")) and not f.meta(m.key("kda.safe_gate")):
        raise GGUFError(f.path, f"metadata {m.key('kda.safe_gate')} = false: only the bounded (safe) KDA gate is supported")
    lower = m.get_float("kda.gate_lower_bound")
    if not lower < 0:
        raise GGUFError(f.path, f"metadata {m.key('kda.gate_lower_bound')} = {lower} must be negative")
    kda = head_dim(m, "kda.head_dim")
    for clamp in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        # llama.cpp's converter writes per-layer SwiGLU limits when a config has them; the forward pass has no clamp
        limits = f.meta(m.key(clamp)) if f.has(m.key(clamp)) else 0
        if any(float(v) for v in (limits if isinstance(limits, (list, tuple)) else [limits])):
            raise GGUFError(f.path, f"metadata {m.key(clamp)}: clamped SwiGLU is not supported")
    routing = moe_routing(m, n, c["n_expert"], norm_default=False)
    lead = routing["n_dense_lead"]
    shexp = m.get_int("expert_shared_feed_forward_length", c["n_ff_exp"] * max(1, routing["n_expert_shared"]))
    return ModelSpec(
        **c,
        **routing,
        head_dim_k=(kv_lora + rope.dim,) * n,  # the KDA layers' entries are never used (no KV rows)
        head_dim_v=(0,) * n,  # V is a view of the cached latent
        n_ff=positive(f, m.key("feed_forward_length"), m.get_int("feed_forward_length")) if lead else 0,
        rope=rope,
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        recurrent_layers=tuple(kv == 0 for kv in c["n_head_kv"]),
        ssm_conv_kernel=positive(f, m.key("ssm.conv_kernel"), m.get_int("ssm.conv_kernel"), 64),
        ssm_state=kda,
        ssm_groups=c["n_head"],  # KDA: as many key heads as value heads, one per attention head
        ssm_heads=c["n_head"],
        kda_gate_lower_bound=lower,
        n_ff_shexp=positive(f, m.key("expert_shared_feed_forward_length"), shexp) if routing["n_expert_shared"] else 0,
        q_lora_rank=m.get_int("attention.q_lora_rank", 0),
        kv_lora_rank=kv_lora,
        head_dim_k_mla=head_dim(m, "attention.key_length_mla"),
        head_dim_v_mla=head_dim(m, "attention.value_length_mla"),
        n_layer_nextn=nextn,
    )


def required_per_layer(spec: ModelSpec, i: int) -> tuple[str, ...]:
    """KDA or gated MLA (plain or low-rank query), then a leading dense layer's FFN,
    or the router, its selection bias and the shared experts."""
    if spec.is_recurrent(i):
        attn = KDA
    else:
        q = ("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight") if spec.q_lora_rank else ("attn_q.weight",)
        attn = (*_MLA, *q)
    if not spec.has_experts(i):
        return (*_NORMS, *attn, *DENSE_FFN)
    return (*_NORMS, *attn, "ffn_gate_inp.weight", "exp_probs_b.bias", *(SHARED_EXPERT if spec.n_expert_shared else ()))


def layer_shapes(spec: ModelSpec, i: int) -> Shapes:
    """A KDA layer's projections (H heads × d wide), convs (numpy [1, H·d, 1, kernel], as
    llama.cpp's converter writes them), gate and norm; or an MLA layer's tensors and head
    gate. Then the FFNs: a leading dense layer's, or the shared experts and selection bias."""
    p, d, h = f"blk.{i}.", spec.n_embd, spec.n_head
    ffn = {**shared_expert_shapes(spec, i), **selection_bias_shape(spec, i)} if spec.has_experts(i) else dense_ffn_shapes(spec, i)
    if spec.is_recurrent(i):
        kd, kernel = spec.ssm_state, spec.ssm_conv_kernel
        inner, heads = h * kd, f"{h} heads × {kd}"
        conv = {p + f"ssm_conv1d_{x}.weight": ("vector", (1, inner, 1, kernel), f"{heads} channels, kernel {kernel}") for x in "qkv"}
        return {
            **ffn,
            **{p + f"attn_{x}.weight": ("matrix", (inner, d), f"{heads}, n_embd {d}") for x in "qkv"},
            **conv,
            p + "ssm_f_a.weight": ("matrix", (inner, d), f"{heads}, n_embd {d}"),
            p + "ssm_dt.bias": ("vector", (inner,), heads),
            p + "ssm_a": ("vector", (h, 1), f"{h} heads"),
            p + "ssm_beta.weight": ("matrix", (h, d), f"{h} heads, n_embd {d}"),
            p + "ssm_g_a.weight": ("matrix", (inner, d), f"{heads}, n_embd {d}"),
            p + "ssm_norm.weight": ("vector", (kd,), f"KDA head width {kd}"),
            p + "attn_output.weight": ("matrix", (d, inner), f"n_embd {d}, {heads}"),
        }
    r, qk, rope, v, ql = spec.kv_lora_rank, spec.head_dim_k_mla, spec.rope.dim, spec.head_dim_v_mla, spec.q_lora_rank
    nope, heads = qk - rope, f"{h} heads"
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
        p + "attn_gate.weight": ("matrix", (h, d), f"{heads}, n_embd {d}"),
        p + "attn_output.weight": ("matrix", (d, h * v), f"n_embd {d}, {heads} × {v} value dims"),
    }
