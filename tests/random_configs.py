"""Random tiny configs of every family, drawn from a seed: the shapes and switches each
family's transformers class and our converter both take, as keyword overrides of its
builder in tests/hfmodels.py.

`draw(family, seed)` is one family's draw: a plain dict from `random.Random`, the same
dict for the same seed on any machine. What stays fixed in a draw is fixed for a reason
said beside it: the converter refuses the other value by name (llama.cpp's graph has no
such variant), or transformers itself cannot run it.

Every model stays tiny (hidden 32-96, 1-6 layers, 2-16 experts, a few hundred K
parameters), so building, converting and comparing one takes seconds.
tests/test_random_configs.py runs them (docs/models.md § Checked against the references).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

Draw = dict[str, Any]


def _heads(r: random.Random, kv: bool = True) -> Draw:
    """Query heads, kv heads dividing them, and a head width free of hidden / heads."""
    h = r.choice((2, 4, 8))
    out: Draw = dict(num_attention_heads=h, head_dim=r.choice((16, 32, 64)))
    if kv:
        out["num_key_value_heads"] = r.choice([k for k in (1, 2, 4, 8) if h % k == 0])
    return out


def _experts(r: random.Random, most: int = 16) -> tuple[int, int]:
    """(experts, experts per token)."""
    x = r.randint(2, most)
    return x, r.randint(1, min(4, x))


def _groups(r: random.Random, x: int, k: int) -> tuple[int, int]:
    """(n_group, topk_group): groups dividing the experts, the kept ones holding at least k
    experts. Kept groups with fewer than k experts leave transformers picking among the
    masked-out (zero-scored) ones, an order no real config relies on; and a group holds two
    experts at least, as transformers scores one by its best two (a group of one fails there)."""
    options = [(g, t) for g in (1, 2, 4, 8) if x % g == 0 and (g == 1 or x // g >= 2) for t in range(1, g + 1) if t * (x // g) >= k]
    return r.choice(options)


def _theta(r: random.Random) -> float:
    return r.choice((1e4, 1e5, 1e6))


def qwen3moe(r: random.Random) -> Draw:
    x, k = _experts(r)
    return dict(
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=r.randint(1, 3),
        **_heads(r),
        num_experts=x,
        num_experts_per_tok=k,
        moe_intermediate_size=r.choice((16, 32, 48, 64)),
        # norm_topk_prob stays true and every layer MoE: the converter refuses the others
        # (llama.cpp's qwen3moe always renormalizes and has no dense layers)
        rope_parameters={"rope_type": "default", "rope_theta": _theta(r)},
        rms_norm_eps=r.choice((1e-6, 1e-5)),
        tie_word_embeddings=r.random() < 0.3,
    )


def gpt_oss(r: random.Random) -> Draw:
    x, k = _experts(r)
    n = r.randint(1, 4)
    factor, original = r.choice((1.0, 2.0, 4.0)), r.choice((32, 64))
    return dict(
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=n,
        **_heads(r),
        num_local_experts=x,
        num_experts_per_tok=k,
        intermediate_size=r.choice((32, 48, 64)),
        sliding_window=r.randint(2, 8),
        # sliding on even layers, full on odd: llama.cpp hard-codes it and the converter refuses others
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": r.choice((1e4, 150000.0)),
            "factor": factor,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": True,  # a GGUF's YaRN rounds the ramp ends (docs/models.md § Shared blocks, YaRN)
            "original_max_position_embeddings": original,
        },
        max_position_embeddings=int(factor * original),
    )


def gemma4(r: random.Random) -> Draw:
    x, k = _experts(r)
    n = r.randint(1, 4)
    heads = _heads(r)
    h = heads["num_attention_heads"]
    return dict(
        multimodal=r.random() < 0.5,
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=n,
        **heads,
        global_head_dim=r.choice((32, 64, 128)),
        attention_k_eq_v=r.random() < 0.5,
        num_global_key_value_heads=r.choice([g for g in (1, 2, 4) if h % g == 0]),
        # the last layer full: transformers forces it (and warns) otherwise
        layer_types=[r.choice(("sliding_attention", "full_attention")) for _ in range(n - 1)] + ["full_attention"],
        sliding_window=r.randint(2, 8),
        num_experts=x,
        top_k_experts=k,
        moe_intermediate_size=r.choice((16, 32, 48)),
        intermediate_size=r.choice((32, 64, 96)),
        final_logit_softcapping=r.choice((None, 10.0, 30.0)),
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": _theta(r)},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": r.choice((0.25, 0.5, 1.0)), "rope_theta": 1e6},
        },
    )


def qwen35moe(r: random.Random) -> Draw:
    x, k = _experts(r)
    n = r.randint(2, 4)
    # full attention on every `every`-th layer: the GGUF says only full_attention_interval
    every = r.randint(1, n)
    heads = _heads(r)
    prf = r.choice((0.25, 0.5))
    pairs = int(heads["head_dim"] * prf) // 2
    t = r.randint(1, pairs - 2) if pairs > 2 else 1
    hh = r.randint(1, pairs - t - 1) if pairs - t > 1 else 0
    g = r.choice((1, 2))
    dk = r.choice((16, 32))
    return dict(
        multimodal=r.random() < 0.3,
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=n,
        **heads,
        layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)],
        linear_conv_kernel_dim=r.choice((2, 3, 4)),
        linear_num_key_heads=g,
        linear_num_value_heads=g * r.choice((1, 2)),  # a multiple of the key heads, as llama.cpp needs
        linear_key_head_dim=dk,
        linear_value_head_dim=dk,  # equal widths, as llama.cpp needs
        num_experts=x,
        num_experts_per_tok=k,
        moe_intermediate_size=r.choice((16, 32, 64)),
        shared_expert_intermediate_size=r.choice((32, 64, 96)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": _theta(r),
            "partial_rotary_factor": prf,
            "mrope_section": [t, hh, pairs - t - hh],
            "mrope_interleaved": True,
        },
    )


def glm4moe(r: random.Random) -> Draw:
    x, k = _experts(r)
    n = r.randint(1, 4)
    groups, kept = _groups(r, x, k)
    return dict(
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=n,
        first_k_dense_replace=r.randint(0, n - 1),  # at least one MoE layer
        **_heads(r),
        n_routed_experts=x,
        num_experts_per_tok=k,
        n_group=groups,
        topk_group=kept,
        n_shared_experts=r.choice((1, 2)),  # its MoE block always has the shared expert
        moe_intermediate_size=r.choice((16, 32, 48)),
        intermediate_size=r.choice((64, 96, 160)),
        norm_topk_prob=r.random() < 0.5,
        routed_scaling_factor=r.choice((1.0, 1.5, 2.5)),
        attention_bias=r.random() < 0.5,
        use_qk_norm=r.random() < 0.5,
        rope_parameters={"rope_type": "default", "rope_theta": _theta(r), "partial_rotary_factor": r.choice((0.25, 0.5, 1.0))},
        num_nextn_predict_layers=0,
    )


def deepseek2(r: random.Random) -> Draw:
    v3 = r.random() < 0.6
    x, k = _experts(r)
    n = r.randint(1, 4)
    out: Draw = dict(
        v3=v3,
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=n,
        first_k_dense_replace=r.randint(0, n - 1),
        num_attention_heads=(h := r.choice((2, 4, 8))),
        num_key_value_heads=h,
        kv_lora_rank=r.choice((16, 32, 64)),
        q_lora_rank=r.choice((None, 16, 48)),
        qk_nope_head_dim=r.choice((16, 32)),
        qk_rope_head_dim=r.choice((8, 16, 32)),
        v_head_dim=r.choice((16, 32)),
        n_routed_experts=x,
        num_experts_per_tok=k,
        n_shared_experts=r.choice((0, 1, 2)),
        moe_intermediate_size=r.choice((16, 32, 48)),
        intermediate_size=r.choice((64, 96, 160)),
        routed_scaling_factor=r.choice((1.0, 1.5, 2.5)),
    )
    groups, kept = _groups(r, x, k)
    if v3:
        out.update(n_group=groups, topk_group=kept, norm_topk_prob=r.random() < 0.5)
        if r.random() < 0.3:  # YaRN as DeepSeek ships it: mscale = mscale_all_dim, context = factor × original
            factor, original = r.choice((2.0, 4.0)), r.choice((32, 64))
            m = r.choice((0.707, 1.0))
            out["rope_parameters"] = dict(
                rope_type="yarn",
                rope_theta=_theta(r),
                factor=factor,
                original_max_position_embeddings=original,
                mscale=m,
                mscale_all_dim=m,
                beta_fast=32.0,
                beta_slow=1.0,
            )
            out["max_position_embeddings"] = int(factor * original)
        else:
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": _theta(r)}
    else:
        # V2 never renormalizes (the converter refuses norm_topk_prob there); greedy or by groups
        out.update(norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": _theta(r)})
        if groups > 1 and r.random() < 0.5:
            out.update(topk_method="group_limited_greedy", n_group=groups, topk_group=kept)
        else:
            out.update(topk_method="greedy")
    return out


def bailingmoe3(r: random.Random) -> Draw:
    x, k = _experts(r)
    n = r.randint(2, 6)
    groups, kept = _groups(r, x, k)
    rope = r.choice((8, 16, 32))
    types = [r.choice(("linear_attention", "full_attention")) for _ in range(n)]
    types[r.randrange(n)] = "full_attention"  # llama.cpp needs one MLA layer (the converter refuses none)
    return dict(
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=n,
        layer_types=types,
        first_k_dense_replace=(lead := r.randint(0, n - 1)),
        mlp_layer_types=["dense" if i < lead else "sparse" for i in range(n)],
        num_attention_heads=(h := r.choice((2, 4, 8))),
        num_key_value_heads=h,
        # transformers re-reads head_dim as the KDA head width and sizes it as the rope dims
        head_dim=rope,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=r.choice((16, 32)),
        v_head_dim=r.choice((16, 32)),
        kv_lora_rank=r.choice((16, 32, 64)),
        q_lora_rank=r.choice((None, 16, 48)),
        short_conv_kernel_size=r.choice((2, 3, 4)),
        num_local_experts=x,
        num_experts_per_tok=k,
        n_group=groups,
        topk_group=kept,
        n_shared_experts=r.choice((0, 1, 2)),
        moe_intermediate_size=r.choice((16, 32, 48)),
        intermediate_size=r.choice((64, 96, 160)),
        norm_topk_prob=r.random() < 0.5,
        routed_scaling_factor=r.choice((1.0, 2.5)),
        rope_theta=r.choice((1e4, 6e6)),
    )


def deepseek4(r: random.Random) -> Draw:
    x, k = _experts(r, 8)
    n = r.randint(2, 4)
    kinds = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
    head_dim = r.choice((64, 128))
    index_dim = r.choice((32, 64))
    h = r.choice((2, 4, 8))
    hashed = r.randint(0, n - 1)  # leading hash-routed layers
    return dict(
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=n,
        layer_types=[r.choice(kinds) for _ in range(n)],
        hca_rate=r.choice((8, 16)),  # the prompts (up to 21 tokens, then the greedy ones) pass one such block or two
        mlp_layer_types=["hash_moe" if i < hashed else "moe" for i in range(n)],
        num_attention_heads=h,
        head_dim=head_dim,
        # rope dims even and within head_dim and index_head_dim (the converter's rule)
        partial_rotary_factor=r.choice([f for f in (0.25, 0.5) if head_dim * f <= index_dim]),
        q_lora_rank=r.choice((32, 64)),
        o_groups=r.choice([g for g in (1, 2, 4) if h % g == 0]),
        o_lora_rank=r.choice((16, 32)),
        n_routed_experts=x,
        num_experts_per_tok=k,
        moe_intermediate_size=r.choice((16, 32)),
        routed_scaling_factor=r.choice((1.0, 1.5)),
        sliding_window=r.choice((4, 8, 16)),
        index_n_heads=r.choice((4, 8)),
        index_head_dim=index_dim,
        index_topk=r.randint(2, 4),
        hc_mult=r.choice((2, 4)),
        rope_theta=_theta(r),
    )


def lfm2moe(r: random.Random) -> Draw:
    x, k = _experts(r)
    n = r.randint(2, 5)
    h = r.choice((2, 4, 8))
    types = [r.choice(("conv", "full_attention")) for _ in range(n)]
    types[r.randrange(n)] = "full_attention"  # one at least: the converter refuses none (the GGUF could not say the kv heads)
    return dict(
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=n,
        layer_types=types,
        num_dense_layers=r.randint(0, n - 1),
        num_attention_heads=h,  # head_dim is hidden / heads: llama.cpp assumes it
        num_key_value_heads=r.choice([g for g in (1, 2, 4, 8) if h % g == 0]),
        conv_L_cache=r.choice((2, 3, 4)),
        num_experts=x,
        num_experts_per_tok=k,
        use_expert_bias=r.random() < 0.5,
        # norm_topk_prob stays true and routed_scaling_factor 1: the converter refuses others
        moe_intermediate_size=r.choice((16, 32, 48)),
        intermediate_size=r.choice((64, 96, 128)),
        rope_parameters={"rope_type": "default", "rope_theta": _theta(r)},
        tie_word_embeddings=r.random() < 0.7,
    )


def mixtral(r: random.Random) -> Draw:
    x, k = _experts(r)
    return dict(
        experts=x,
        used=k,
        per_expert=r.random() < 0.5,
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=r.randint(1, 3),
        **_heads(r),
        intermediate_size=r.choice((32, 64, 96)),
        rope_parameters={"rope_type": "default", "rope_theta": _theta(r)},
    )


def qwen2moe(r: random.Random) -> Draw:
    x, k = _experts(r)
    heads = _heads(r)
    del heads["head_dim"]  # Qwen2-MoE's head width is hidden / heads
    return dict(
        hidden_size=r.choice((32, 64, 96)),
        num_hidden_layers=r.randint(1, 3),
        **heads,
        num_experts=x,
        num_experts_per_tok=k,
        norm_topk_prob=r.random() < 0.5,
        fused=r.random() < 0.5,
        qkv_bias=r.random() < 0.7,
        moe_intermediate_size=r.choice((16, 32, 64)),
        # a shared expert always, every layer MoE: llama.cpp's qwen2moe graph has no other form
        shared_expert_intermediate_size=r.choice((32, 64, 96)),
        rope_parameters={"rope_type": "default", "rope_theta": _theta(r)},
    )


DRAWS: dict[str, Callable[[random.Random], Draw]] = {
    "qwen3moe": qwen3moe,
    "gpt_oss": gpt_oss,
    "gemma4": gemma4,
    "qwen35moe": qwen35moe,
    "mixtral": mixtral,
    "glm4moe": glm4moe,
    "lfm2moe": lfm2moe,
    "deepseek2": deepseek2,
    "qwen2moe": qwen2moe,
    "bailingmoe3": bailingmoe3,
    "deepseek4": deepseek4,
}


def draw(family: str, seed: int) -> Draw:
    """The family's random config for `seed`: the same on every machine and Python."""
    return DRAWS[family](random.Random(f"{family}:{seed}"))
