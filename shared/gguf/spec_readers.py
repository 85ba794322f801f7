"""Each supported architecture's reader of GGUF metadata into a `ModelSpec`
(shared/gguf/spec.py), one function per GGUF arch, registered in `READERS`.
A reader knows its family's keys (docs/models.md, one section per family); a
missing key, or one of the wrong type or out of range, is a GGUFError naming it.
"""

from __future__ import annotations

import math

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.reader import GGUFFile
from moe_pipe.shared.gguf.spec import (
    Meta,
    ModelSpec,
    RopeSpec,
    common_keys,
    in_range,
    moe_routing,
    positive,
    rope_keys,
)


def _head_dim(m: Meta, suffix: str, default: int | None = None) -> int:
    return positive(m.f, m.key(suffix), m.get_int(suffix, default), 1 << 16)


def _window(m: Meta) -> int:
    window = m.get_int("attention.sliding_window", 0)
    if not 0 <= window <= 1 << 30:
        raise GGUFError(m.f.path, f"metadata {m.key('attention.sliding_window')} = {window} is out of range (0..{1 << 30})")
    return window


def _softcap(m: Meta) -> float:
    cap = m.get_float("final_logit_softcapping", 0.0)
    if cap < 0:  # 0 is "off"; a negative cap flips every logit's sign
        raise GGUFError(m.f.path, f"metadata {m.key('final_logit_softcapping')} = {cap} must not be negative")
    return cap


def _qwen3moe(f: GGUFFile) -> ModelSpec:
    arch = "qwen3moe"
    m, c = Meta(f, arch), common_keys(f, arch)
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * c["n_layer"],
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * c["n_layer"],
        n_ff=0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * c["n_layer"],
        tied_output="output.weight" not in f.tensors,
    )


def _gpt_oss(f: GGUFFile) -> ModelSpec:
    arch = "gpt-oss"
    m, c = Meta(f, arch), common_keys(f, arch)
    n = c["n_layer"]
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    window = _window(m)
    # gpt-oss alternates: sliding on even layers (llama.cpp swa pattern 2).
    swa = (
        m.per_layer("attention.sliding_window_pattern", n, None, bool)
        if f.has(m.key("attention.sliding_window_pattern"))
        else tuple(i % 2 == 0 and window > 0 for i in range(n))
    )
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=rope_keys(m, hd),
        sliding_window=window,
        swa_layers=swa,
        tied_output="output.weight" not in f.tensors,
        fused_gate_up="blk.0.ffn_gate_up_exps.weight" in f.tensors,
        expert_bias=True,
    )


def _gemma4(f: GGUFFile) -> ModelSpec:
    arch = "gemma4"
    m, c = Meta(f, arch), common_keys(f, arch)
    n = c["n_layer"]
    swa = m.per_layer("attention.sliding_window_pattern", n, False, bool)
    hd_full = _head_dim(m, "attention.key_length")
    hd_swa = _head_dim(m, "attention.key_length_swa", hd_full) if m.get_int("attention.key_length_swa", 0) else hd_full
    hv_full, hv_swa = _head_dim(m, "attention.value_length", hd_full), _head_dim(m, "attention.value_length_swa", hd_swa)
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
        sliding_window=_window(m),
        swa_layers=swa,
        final_logit_softcap=_softcap(m),
        tied_output="output.weight" not in f.tensors,
        fused_gate_up="blk.0.ffn_gate_up_exps.weight" in f.tensors,
    )


def _qwen35moe(f: GGUFFile) -> ModelSpec:
    arch = "qwen35moe"
    m, c = Meta(f, arch), common_keys(f, arch)
    n = c["n_layer"]
    if m.get_int("nextn_predict_layers", 0):
        # llama.cpp counts the MTP block in block_count and skips it; this file's
        # layer numbering would then not be the decoder's: refused, not misread.
        raise GGUFError(f.path, f"metadata {m.key('nextn_predict_layers')} > 0: files with the MTP block are not supported")
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
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
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
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
    )


def _glm4moe(f: GGUFFile) -> ModelSpec:
    arch = "glm4moe"
    m, c = Meta(f, arch), common_keys(f, arch)
    # llama.cpp's converter counts the NextN/MTP blocks in block_count and puts them
    # last; the decoder is the blocks before them (llama.cpp skips them too).
    nextn = m.get_int("nextn_predict_layers", 0)
    if not 0 <= nextn < c["n_layer"]:
        raise GGUFError(f.path, f"metadata {m.key('nextn_predict_layers')} = {nextn} is out of range (0..{c['n_layer'] - 1})")
    n = c["n_layer"] - nextn
    c.update(n_layer=n, n_head_kv=c["n_head_kv"][:n])
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    routing = moe_routing(m, n, c["n_expert"], norm_default=False)  # llama.cpp's defaults when the keys are absent
    if not f.has(m.key("expert_gating_func")):
        routing["expert_gating"] = "sigmoid"  # llama.cpp: GLM-4.5 routes by sigmoid unless the file says otherwise
    shared = routing["n_expert_shared"]
    return ModelSpec(
        **c,
        **routing,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
        n_ff=positive(f, m.key("feed_forward_length"), m.get_int("feed_forward_length")) if routing["n_dense_lead"] else 0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
        n_ff_shexp=c["n_ff_exp"] * shared,  # llama.cpp: the shared experts as one FFN of n_ff_exp × count
        n_layer_nextn=nextn,
    )


def _lfm2moe(f: GGUFFile) -> ModelSpec:
    """LFM2-MoE: a layer with 0 kv heads is a short-conv layer (llama.cpp's rule), the
    rest attend; the first leading_dense_block_count layers have a dense FFN."""
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


def _deepseek2(f: GGUFFile) -> ModelSpec:
    """DeepSeek-V2/V3: MLA (llama.cpp's MQA form: one kv head of key_length =
    kv_lora_rank + rope dims, value_length = kv_lora_rank), leading dense layers,
    shared experts of n_ff_exp × expert_shared_count, DeepSeek routing."""
    arch = "deepseek2"
    m, c = Meta(f, arch), common_keys(f, arch)
    n = c["n_layer"]
    if m.get_int("nextn_predict_layers", 0):
        raise GGUFError(f.path, f"metadata {m.key('nextn_predict_layers')} > 0: files with the MTP block are not supported")
    if set(c["n_head_kv"]) != {1}:
        raise GGUFError(f.path, f"metadata {m.key('attention.head_count_kv')} must be 1 (MLA caches one latent head)")
    if "blk.0.attn_kv_b.weight" in f.tensors and "blk.0.attn_k_b.weight" not in f.tensors:
        raise GGUFError(f.path, "tensor 'blk.0.attn_kv_b.weight' without attn_k_b/attn_v_b: an MLA file from before the split")
    if not f.has(m.key("attention.key_length_mla")):
        raise GGUFError(f.path, f"metadata key {m.key('attention.key_length_mla')!r} is missing (an MLA file from before the split)")
    kv_lora = _head_dim(m, "attention.kv_lora_rank")
    rope = rope_keys(m, 0)
    if _head_dim(m, "attention.key_length") != kv_lora + rope.dim or _head_dim(m, "attention.value_length") != kv_lora:
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
        head_dim_k_mla=_head_dim(m, "attention.key_length_mla"),
        head_dim_v_mla=_head_dim(m, "attention.value_length_mla"),
        rope_yarn_log_mul=log_mul,
    )


def _llama(f: GGUFFile) -> ModelSpec:
    """Mixtral: llama.cpp writes it as arch `llama` with experts (docs/models.md § mixtral)."""
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
    c = common_keys(f, arch)
    n = c["n_layer"]
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    if _window(m):  # llama.cpp's llama graph has no sliding window either: a file that asks for one is refused
        raise GGUFError(f.path, f"metadata {m.key('attention.sliding_window')} is set: sliding-window attention is not supported for llama")
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
        n_ff=0,
        rope=rope_keys(m, hd),
        sliding_window=0,
        swa_layers=(False,) * n,
        tied_output="output.weight" not in f.tensors,
    )


def _qwen2moe(f: GGUFFile) -> ModelSpec:
    """Qwen1.5-MoE / Qwen2-MoE: qwen3moe's layout with q/k/v biases, no q/k norm and a
    gated shared expert; the top-k weights are renormalized only when the file says so."""
    arch = "qwen2moe"
    m, c = Meta(f, arch), common_keys(f, arch)
    n = c["n_layer"]
    hd = _head_dim(m, "attention.key_length", c["n_embd"] // c["n_head"])
    norm = m.key("expert_weights_norm")
    shexp = m.key("expert_shared_feed_forward_length")
    return ModelSpec(
        **c,
        head_dim_k=(hd,) * n,
        head_dim_v=(_head_dim(m, "attention.value_length", hd),) * n,
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


READERS = {
    "qwen3moe": _qwen3moe,
    "qwen2moe": _qwen2moe,
    "gpt-oss": _gpt_oss,
    "gemma4": _gemma4,
    "qwen35moe": _qwen35moe,
    "llama": _llama,
    "glm4moe": _glm4moe,
    "lfm2moe": _lfm2moe,
    "deepseek2": _deepseek2,
}
