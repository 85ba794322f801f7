"""Tiny random Hugging Face checkpoints of each supported arch, saved like the real ones.

Used by tests/test_convert.py and reusable by numerical oracle tests: each
builder writes `config.json`, `model.safetensors` (float32) and a real
tokenizer (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`)
that `transformers.AutoTokenizer` loads, then returns the folder.

Tokenizers are BPEs trained with HF `tokenizers` on shared/data/corpus.txt in
each arch's style (docs/models.md § Tokenizers): Qwen2 regex + GPT-2 byte map and the
Qwen added tokens; o200k regex + the harmony specials; Gemma-4 SPM-style BPE
over "▁"-spaced text with <0xXX> byte fallback, the real low special ids and
a <bos> post-processor.

Widths are multiples of 32 (so q8_0 applies everywhere) and everything is
tiny: hidden 64, 2-4 layers, 8 experts top-2, vocab ~600-900.
Norm weights, router scales and per-expert scales are randomized because
they init to ones and would hide layout mistakes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ARCHES = ("qwen3moe", "gpt-oss", "gemma4")

# Prompts shared by the tokenizer and greedy-prediction checks.
SAMPLES = (
    "The river ran past 12 old mills, and the miller's daughter counted 345 boats.",
    "Hello world! It's a fine day; isn't it?\n\nNew paragraph:   spaced  words.",
    "Numbers 2024 and 7 and 98765; symbols #@! and tabs\there.",
)


def build(arch: str, out_dir: Path, seed: int = 0, **kw) -> Path:
    """Write the tiny checkpoint of `arch` (a family's name; gpt-oss also by its GGUF arch) into `out_dir` and return it."""
    builders = {"qwen3moe": build_qwen3moe, "gpt-oss": build_gpt_oss, "gemma4": build_gemma4, "qwen35moe": build_qwen35moe}
    builders["gpt_oss"] = build_gpt_oss
    builders["glm4moe"] = build_glm4moe
    builders["lfm2moe"] = build_lfm2moe
    builders["deepseek2"] = build_deepseek2
    builders["mixtral"] = build_mixtral
    builders["qwen2moe"] = build_qwen2moe
    builders["bailingmoe3"] = build_bailingmoe3
    builders["deepseek4"] = build_deepseek4
    return builders[arch](Path(out_dir), seed, **kw)


# --- models -------------------------------------------------------------------------


def build_qwen3moe(out_dir: Path, seed: int = 0, **kw) -> Path:
    """`kw` overrides any config key."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = _qwen_tokenizer()
    n_tok = len(tok)
    cfg = dict(
        vocab_size=_round_up(n_tok, 64),  # real Qwen pads the embedding past the tokenizer too
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=512,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        initializer_range=0.08,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return _save(Qwen3MoeForCausalLM, Qwen3MoeConfig(**(cfg | kw)), tok, out_dir, seed)


def build_gpt_oss(out_dir: Path, seed: int = 0, **kw) -> Path:
    """`kw` overrides any config key."""
    from transformers import GptOssConfig, GptOssForCausalLM

    tok = _harmony_tokenizer()
    cfg = dict(
        vocab_size=_round_up(len(tok), 64),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        # Like the real 131072/4096 x32 setup, scaled down. truncate=True: a GGUF's YaRN
        # rounds the ramp ends (llama.cpp's meaning; the real HF config says false).
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": True,
            "original_max_position_embeddings": 64,
        },
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        attention_bias=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        initializer_range=0.08,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return _save(GptOssForCausalLM, GptOssConfig(**(cfg | kw)), tok, out_dir, seed)


def gemma4_text_config(vocab_size: int, **kw) -> dict:
    """`kw` overrides any key."""
    cfg = dict(
        vocab_size=vocab_size,
        vocab_size_per_layer_input=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        top_k_experts=2,
        enable_moe_block=True,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.08,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return cfg | kw


def build_gemma4(out_dir: Path, seed: int = 0, multimodal: bool = True, **kw) -> Path:
    """`multimodal`: save as Gemma4ForConditionalGeneration (the published layout, no
    vision/audio towers), else as the text-only Gemma4ForCausalLM; `kw` overrides any text config key."""
    from transformers.models.gemma4 import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    tok = _gemma_tokenizer()
    tc = gemma4_text_config(len(tok), **kw)
    if multimodal:
        cfg = Gemma4Config(text_config=tc, vision_config=None, audio_config=None, tie_word_embeddings=True)
        return _save(Gemma4ForConditionalGeneration, cfg, tok, out_dir, seed)
    return _save(Gemma4ForCausalLM, Gemma4TextConfig(**tc), tok, out_dir, seed)


def qwen35moe_text_config(vocab_size: int, eos: int | None = None, pad: int | None = None, **kw) -> dict:
    """Linear attention on layers 0 and 2, full on 1 and 3 (interval 2); 2 key heads
    for 4 value heads, so the converter's value-head reorder is exercised."""
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.08,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    cfg.update(kw)
    return cfg


def build_qwen35moe(out_dir: Path, seed: int = 0, multimodal: bool = False, **kw) -> Path:
    """`multimodal`: saved as Qwen3_5MoeForConditionalGeneration (the published layout,
    with a one-block vision tower the converter must skip), else as Qwen3_5MoeForCausalLM."""
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    tok = _qwen_tokenizer("qwen35moe")
    tc = qwen35moe_text_config(_round_up(len(tok), 64), tok.eos_token_id, tok.pad_token_id, **kw)
    if multimodal:
        vc = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4, num_position_embeddings=16)
        cfg = Qwen3_5MoeConfig(text_config=tc, vision_config=vc, tie_word_embeddings=False)
        _save(Qwen3_5MoeForConditionalGeneration, cfg, tok, out_dir, seed)
    else:
        _save(Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**tc), tok, out_dir, seed)
    _tame(out_dir)
    return out_dir


def glm4moe_config(vocab_size: int, **kw) -> dict:
    """GLM-4.5-Air's structure, tiny: 1 leading dense layer, 16 experts in 4 groups
    (the best 2 groups kept), sigmoid routing with a correction bias (randomized by
    _save), a shared expert, q/k/v biases, partial rotary 0.5, no qk-norm; `kw`
    varies it (first_k_dense_replace, use_qk_norm, n_group, ...)."""
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        attention_bias=True,
        use_qk_norm=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.08,
        num_nextn_predict_layers=1,
    )
    cfg.update(kw)
    return cfg


def build_glm4moe(out_dir: Path, seed: int = 0, **kw) -> Path:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    tok = _glm4_tokenizer()
    cfg = Glm4MoeConfig(**glm4moe_config(_round_up(len(tok), 64), **kw))
    return _save(Glm4MoeForCausalLM, cfg, tok, out_dir, seed)


def deepseek_config(vocab_size: int, v3: bool = True, **kw) -> dict:
    """DeepSeek's structure, tiny: MLA (kv_lora 64, rope 32, nope 32, v 32), 4 heads,
    16 experts top-4 with a shared expert; V3: sigmoid + correction bias, 4 groups
    (best 2 kept), 1 leading dense layer, q_lora 48. V2: softmax, greedy, no q_lora."""
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        q_lora_rank=48 if v3 else None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1 if v3 else 0,
        routed_scaling_factor=1.5 if v3 else 1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.08,
    )
    if v3:
        cfg.update(n_group=4, topk_group=2, norm_topk_prob=True)
    else:
        cfg.update(topk_method="greedy", norm_topk_prob=False)
    cfg.update(kw)
    return cfg


def build_deepseek2(out_dir: Path, seed: int = 0, v3: bool = True, **kw) -> Path:
    """Saved as DeepseekV3ForCausalLM (`v3`) or DeepseekV2ForCausalLM; both convert to deepseek2."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = _qwen_tokenizer()
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    cfg = deepseek_config(_round_up(len(tok), 64), v3, **special, **kw)
    if v3:
        return _save(DeepseekV3ForCausalLM, DeepseekV3Config(**cfg), tok, out_dir, seed)
    return _save(DeepseekV2ForCausalLM, DeepseekV2Config(**cfg), tok, out_dir, seed)


def bailingmoe3_config(vocab_size: int, **kw) -> dict:
    """Ling 3.0's structure, tiny: KDA on layers 0 and 2, gated MLA on 1 and 3 (group of 2);
    KDA heads of 16 (transformers saves them only as wide as the rope dims: its config
    re-reads head_dim as the KDA width), MLA kv_lora 64, nope 32, rope 16, v 32; layer 0
    dense; 16 experts in 4 groups (best 2 kept) top-4, sigmoid + correction bias, a shared
    expert, scale 2.5."""
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        short_conv_kernel_size=4,
        layer_group_size=2,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_local_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_mtp_layers=0,
        rope_theta=6e6,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.08,
    )
    cfg.update(kw)
    return cfg


def build_bailingmoe3(out_dir: Path, seed: int = 0, **kw) -> Path:
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    tok = _qwen_tokenizer()
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    cfg = BailingHybridConfig(**bailingmoe3_config(_round_up(len(tok), 64), **special, **kw))
    return _save(BailingHybridForCausalLM, cfg, tok, out_dir, seed)


def deepseek4_config(vocab_size: int, **kw) -> dict:
    """DeepSeek-V4's structure, tiny: 4 layers (sliding, CSA, HCA, CSA), a window of 8, CSA
    by 4 with an 8-head indexer (64 wide) keeping 3 entries, HCA by 8 (`hca_rate`; llama.cpp
    loads only 128), 4 hyper-connection streams, one 128-wide kv head with 64 rope dims (llama.cpp
    0.3.36 fails an assert at 64 wide with 32 rope dims), 2 output groups,
    8 experts top-2 plus one shared, the first layer hash-routed. A prompt of a few dozen
    tokens passes the window, the indexer's top k and both ratios."""
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        partial_rotary_factor=0.5,
        q_lora_rank=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": kw.pop("hca_rate", 8)},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        sliding_window=8,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=3,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        swiglu_limit=10.0,
        rope_theta=10000.0,
        compress_rope_theta=40000.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.08,
    )
    cfg.update(kw)
    return cfg


def build_deepseek4(out_dir: Path, seed: int = 0, **kw) -> Path:
    """Saved as DeepseekV4ForCausalLM (DeepSeek's own tensor names under `model.`)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    tok = _qwen_tokenizer()
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    cfg = DeepseekV4Config(**deepseek4_config(_round_up(len(tok), 64), **special, **kw))

    def randomized(c):
        # What inits to constants would hide layout mistakes: the hash table (zeros: every token
        # on expert 0), the hyper-connection bases and scales, the compressors' position bias.
        model = DeepseekV4ForCausalLM(c)
        g = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if name.endswith("tid2eid"):
                    t.copy_(
                        torch.stack([torch.randperm(c.n_routed_experts, generator=g)[: c.num_experts_per_tok] for _ in range(t.shape[0])])
                    )
                elif name.endswith((".base", "hc_base", "position_bias")):
                    t.copy_(0.3 * torch.randn(t.shape, generator=g))
                elif name.endswith((".scale", "hc_scale")):
                    t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))
        return model

    return _save(randomized, cfg, tok, out_dir, seed)


def _tame(out_dir: Path) -> None:
    """Qwen3.5's RMSNorms scale by (1 + w) (its gated norm by w): _save's randomized
    1 + 0.2·N weights would double every layer's scale, and the random model would
    become chaotic enough that q8_0 rounding alone (in llama.cpp too) moves its logits
    by tens of percent more. Make them 0.2·N, i.e. scales of 1 + 0.2·N, like the others'."""
    from safetensors.numpy import load_file, save_file

    path = out_dir / "model.safetensors"
    sd = load_file(path)
    for name, t in sd.items():
        if name.endswith("norm.weight") and "visual" not in name and not name.endswith("linear_attn.norm.weight"):
            sd[name] = t - 1.0
    save_file(sd, str(path), metadata={"format": "pt"})


def gpt_oss_mxfp4_pair(f32_dir: Path, mx_dir: Path, twin_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """From the tiny gpt-oss checkpoint, write an MXFP4 one (experts as random HF-layout
    `*_blocks`/`*_scales`, as the published checkpoints store them) and its dequantized
    twin (experts = transformers' own dequantization of those blocks)."""
    import json
    import shutil

    import numpy as np
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(seed)
    sd = load_file(f32_dir / "model.safetensors")
    mx, twin = dict(sd), dict(sd)
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        x, d_in, d_out = sd[name].shape  # HF dequantized layout: (X, in, out)
        blocks = rng.integers(0, 256, (x, d_out, d_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 130, (x, d_out, d_in // 32), dtype=np.uint8)  # 2^-5 .. 2^2
        del mx[name]
        mx[name + "_blocks"], mx[name + "_scales"] = blocks, scales
        deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
        twin[name] = np.ascontiguousarray(deq.numpy())
    for d, tensors in ((mx_dir, mx), (twin_dir, twin)):
        shutil.copytree(f32_dir, d, dirs_exist_ok=True)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((f32_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (mx_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return mx_dir, twin_dir


def load_model(hf_dir: Path):
    """The converted checkpoint as an eval-mode float32 causal LM with eager attention."""
    import json

    import transformers

    cls = json.loads((Path(hf_dir) / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, cls).from_pretrained(hf_dir, dtype="float32", attn_implementation="eager")
    return model.eval()


def hf_logits(ref, ids) -> np.ndarray:
    """The transformers model's logits [T, V] for one sequence of ids."""
    import torch

    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(ref, ids, n: int) -> list[int]:
    """n greedy tokens after ids, never stopping early. The attention mask is explicit: without
    one, generate masks every prompt token equal to pad_token_id (id 0, "!" in the byte-level
    test vocabularies)."""
    import torch

    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]), attention_mask=mask, max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


_RANDOMIZED = ("norm", "layer_scalar", "router.scale", "per_expert_scale")


def _save(model_cls, cfg, tok, out_dir: Path, seed: int) -> Path:
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(("bias", "sinks")):  # gpt-oss: zero-init biases and sinks would hide mix-ups
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif any(k in name for k in _RANDOMIZED) and t.dtype.is_floating_point:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
                if "gemma4" in type(model).__module__ and name.endswith(("q_norm.weight", "k_norm.weight")):
                    # Gemma-4 attends with scale 1.0 on RMS-normed q and k: unit norm weights
                    # give scores of ±head_dim and a one-hot softmax that any rounding flips.
                    t.mul_(0.3)
            elif name.endswith("router.proj.weight"):
                # Gemma-4 scales the router input by 1/sqrt(hidden): at init the logits are
                # ~0.1 apart and routing is a coin toss that any rounding flips. Trained
                # routers are decisive; give the tiny model margins like theirs.
                t.mul_(8.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


# --- tokenizers ---------------------------------------------------------------------

# The contraction group as real Qwen/OpenAI tokenizer.json files spell it.
_QWEN_HF_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


# GLM-4.5's split as its tokenizer.json spells it (llama3's, digits in groups of 1-3).
_GLM4_HF_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _byte_level(regex_train: str, regex_hf: str, n_bpe: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from moe_pipe.shared.gguf.vocab import train_byte_level

    tokens, merges = train_byte_level(regex_train, n_bpe)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex_hf), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _add(tok, text: str, special: bool) -> None:
    from tokenizers import AddedToken

    t = AddedToken(text, special=special, normalized=False)
    (tok.add_special_tokens if special else tok.add_tokens)([t])


def _wrap(tok, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def _qwen_tokenizer(arch: str = "qwen3moe"):
    from moe_pipe.shared.gguf.vocab import _QWEN_ADDED, QWEN2_REGEX
    from moe_pipe.shared.makemodel.maker import chat_template

    tok = _byte_level(QWEN2_REGEX, _QWEN_HF_REGEX, 600)
    for t in _QWEN_ADDED:  # <|...|> are special; <think>, <tool_call> ... are plain added tokens, as in Qwen3
        _add(tok, t, t.startswith("<|"))
    return _wrap(tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template(arch))


def _glm4_tokenizer():
    from moe_pipe.shared.gguf.vocab import _GLM4_ADDED, LLAMA3_REGEX

    tok = _byte_level(LLAMA3_REGEX, _GLM4_HF_REGEX, 600)
    for t in _GLM4_ADDED:
        _add(tok, t, True)  # GLM-4.5's tokenizer.json marks every added token special
    return _wrap(tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def _harmony_tokenizer():
    from moe_pipe.shared.gguf.vocab import _HARMONY, O200K_REGEX
    from moe_pipe.shared.makemodel.maker import chat_template

    tok = _byte_level(O200K_REGEX, O200K_REGEX, 600)
    at = tok.get_vocab_size()
    for k, t in enumerate(_HARMONY):
        _add(tok, t or f"<|reserved_{at + k}|>", True)
    return _wrap(
        tok, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>", chat_template=chat_template("gpt-oss")
    )


def _gemma_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    from moe_pipe.shared.gguf.vocab import (
        _GEMMA_N_LOW,
        _GEMMA_SPECIAL,
        CONTROL,
        GEMMA4_REGEX,
        SPACE,
        UNKNOWN,
        USER_DEFINED,
        train_spm_style,
    )
    from moe_pipe.shared.makemodel.maker import chat_template

    pieces, merges = train_spm_style(500)
    tokens = [(_GEMMA_SPECIAL.get(i) or (f"<unused{i}>", 0))[0] for i in range(_GEMMA_N_LOW)]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    seen = set(tokens)
    tokens += [p for p in pieces if p not in seen]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
            byte_fallback=True,
            unk_token="<unk>",
            fuse_unk=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(GEMMA4_REGEX), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    for _, (text, typ) in sorted(_GEMMA_SPECIAL.items()):
        if typ in (CONTROL, USER_DEFINED, UNKNOWN):
            _add(tok, text, True)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)])
    return _wrap(tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", chat_template=chat_template("gemma4"))


# --- lfm2moe ------------------------------------------------------------------------


def lfm2moe_config(vocab_size: int, **kw) -> dict:
    """conv, attention, conv, attention, conv: layer 0 dense (num_dense_layers 1), the
    rest MoE with the expert bias; 4 heads over 2 kv heads of 16."""
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
        use_expert_bias=True,
        layer_types=["conv", "full_attention", "conv", "full_attention", "conv"],
        max_position_embeddings=512,
        norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=7,
        pad_token_id=0,
    )
    cfg.update(kw)
    return cfg


def build_lfm2moe(out_dir: Path, seed: int = 0, **kw) -> Path:
    """A tiny Lfm2MoeForCausalLM; its expert bias (zeros at init) randomized so the
    selection-only bias is exercised (_save randomizes "bias" names)."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    tok = _lfm2_tokenizer()
    return _save(Lfm2MoeForCausalLM, Lfm2MoeConfig(**lfm2moe_config(_round_up(len(tok), 64), **kw)), tok, out_dir, seed)


def fuse_lfm2moe_experts(hf_dir: Path) -> None:
    """Rewrite a saved lfm2moe checkpoint's per-expert w1 (gate), w3 (up), w2 (down)
    tensors as transformers 5's fused `gate_up_proj` (X, 2F, D), gate rows first, and
    `down_proj` (X, D, F): the same weights in its in-memory layout."""
    import json

    from safetensors.numpy import load_file, save_file

    path = hf_dir / "model.safetensors"
    sd = load_file(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    for i in range(cfg["num_dense_layers"], cfg["num_hidden_layers"]):
        e = f"model.layers.{i}.feed_forward.experts."
        per = [[sd.pop(f"{e}{x}.{w}.weight") for w in ("w1", "w3", "w2")] for x in range(cfg["num_experts"])]
        sd[e + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u, _ in per])
        sd[e + "down_proj"] = np.stack([d for _, _, d in per])
    save_file(sd, str(path), metadata={"format": "pt"})


# LFM2's tokenizer.json split: llama3's (1-3 digit groups), contractions spelled case-insensitively.
_LFM2_HF_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# LFM2's first ids: <|pad|> 0, <|startoftext|> 1, <|endoftext|> 2, ..., <|im_start|> 6, <|im_end|> 7.
LFM2_SPECIALS = ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>", "<|im_start|>", "<|im_end|>")


def _lfm2_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    from moe_pipe.shared.gguf.vocab import train_byte_level
    from moe_pipe.shared.makemodel.maker import chat_template
    from moe_pipe.shared.text.tokenizer import LLAMA3_REGEX

    bpe, merges = train_byte_level(LLAMA3_REGEX, 600)
    tokens = list(LFM2_SPECIALS) + [t for t in bpe if t not in LFM2_SPECIALS]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LFM2_HF_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for t in LFM2_SPECIALS:
        _add(tok, t, True)
    tok.post_processor = processors.TemplateProcessing(single="<|startoftext|> $A", special_tokens=[("<|startoftext|>", 1)])
    return _wrap(tok, bos_token="<|startoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>", chat_template=chat_template("lfm2moe"))


# --- mixtral ------------------------------------------------------------------------


def build_mixtral(
    out_dir: Path, seed: int = 0, experts: int = 4, used: int = 2, per_expert: bool = False, byte_level: bool = False, **kw
) -> Path:
    """Tiny Mixtral: GQA (4 heads, 2 kv), head_dim 32 ≠ hidden/heads, `used` of `experts`
    experts, a SentencePiece tokenizer (`byte_level`: a Llama-3-style byte-level BPE).
    `per_expert`: rewrite the experts as the published checkpoints store them
    (block_sparse_moe.experts.N.w1/w3/w2). `kw` overrides any config key."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tok = _llama3_tokenizer() if byte_level else _spm_tokenizer()
    cfg = dict(
        vocab_size=_round_up(len(tok), 64),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=experts,
        num_experts_per_tok=used,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=512,
        sliding_window=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.08,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    _save(MixtralForCausalLM, MixtralConfig(**(cfg | kw)), tok, out_dir, seed)
    if per_expert:
        from safetensors.numpy import load_file, save_file

        sd = load_file(out_dir / "model.safetensors")
        out = {}
        for name, t in sd.items():
            if ".mlp.experts.gate_up_proj" in name:
                m = name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
                f = t.shape[1] // 2
                for x in range(t.shape[0]):
                    out[f"{m}{x}.w1.weight"], out[f"{m}{x}.w3.weight"] = t[x, :f], t[x, f:]
            elif ".mlp.experts.down_proj" in name:
                m = name.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
                for x in range(t.shape[0]):
                    out[f"{m}{x}.w2.weight"] = t[x]
            else:
                out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
        save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _spm_tokenizer():
    """A Llama/Mistral-style tokenizer.json as transformers converts a tokenizer.model:
    BPE with byte fallback whose merges are every split of every piece ranked by its
    score (shared/gguf/vocab.py spm_merges), "▁" prepended and for spaces, <s> added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    from moe_pipe.shared.gguf.vocab import SPACE, llama_vocab, spm_merges
    from moe_pipe.shared.makemodel.maker import chat_template

    v = llama_vocab(900, 600)
    n = max(i for i, ty in enumerate(v.types) if ty != 5) + 1  # drop the unused tail
    tokens, types, scores = list(v.tokens[:n]), list(v.types[:n]), list(v.scores[:n])
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=spm_merges(tokens, scores, types),
            byte_fallback=True,
            unk_token="<unk>",
            fuse_unk=True,
        )
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    for t in ("<unk>", "<s>", "</s>"):
        _add(tok, t, True)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return _wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=chat_template("llama"))


def _llama3_tokenizer():
    """A Llama-3-style tokenizer.json: byte-level BPE on llama3's split with
    ignore_merges (a piece that is a whole vocabulary entry is one token), its
    <|begin_of_text|> added before every text, <|end_of_text|> and <|eot_id|>."""
    from tokenizers import processors

    from moe_pipe.shared.gguf.vocab import LLAMA3_REGEX

    tok = _byte_level(LLAMA3_REGEX, _GLM4_HF_REGEX, 600)
    model = tok.model
    model.ignore_merges = True
    tok.model = model
    for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        _add(tok, t, True)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    return _wrap(tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


# --- qwen2moe -----------------------------------------------------------------------


def build_qwen2moe(out_dir: Path, seed: int = 0, norm_topk_prob: bool = False, fused: bool = False, **kw) -> Path:
    """Tiny Qwen1.5-MoE: q/k/v biases, GQA (4 heads, 2 kv), 8 experts top-2 (`kw` overrides any
    config key), a shared expert wider than the routed ones behind its sigmoid gate,
    `norm_topk_prob` as given (Qwen1.5-MoE: false). transformers saves the experts one by one
    (the published layout); `fused` rewrites them as its in-memory `gate_up_proj`/`down_proj`."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = _qwen_tokenizer("qwen2moe")
    cfg = dict(
        vocab_size=_round_up(len(tok), 64),
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.08,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg.update(kw)
    _save(Qwen2MoeForCausalLM, Qwen2MoeConfig(**cfg), tok, out_dir, seed)
    if fused:
        from safetensors.numpy import load_file, save_file

        sd = load_file(out_dir / "model.safetensors")
        out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
        for i in range(cfg["num_hidden_layers"]):
            e = f"model.layers.{i}.mlp.experts."
            xs = range(cfg["num_experts"])
            out[e + "gate_up_proj"] = np.stack([np.concatenate([sd[f"{e}{x}.gate_proj.weight"], sd[f"{e}{x}.up_proj.weight"]]) for x in xs])
            out[e + "down_proj"] = np.stack([sd[f"{e}{x}.down_proj.weight"] for x in xs])
        save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def with_mtp_block(src: Path, dst: Path, family: str, seed: int = 0) -> Path:
    """A copy of the tiny `family` checkpoint (qwen35moe text-only, glm4moe, bailingmoe3) with
    the one NextN/MTP layer the published checkpoints carry and transformers does not save,
    named as they name it: Qwen3.5's `mtp.layers.0.*` (a full-attention MoE layer; its decoder
    layer 3's tensors, perturbed) and `mtp.fc` [D, 2D], `mtp.pre_fc_norm_embedding` /
    `_hidden`, `mtp.norm` (stored as w of a 1 + w norm); GLM-4.5's `model.layers.{L}.*`
    (a routed layer, layer L-1's perturbed) with `eh_proj`, `enorm`, `hnorm`,
    `embed_tokens`, `shared_head.head` and `shared_head.norm`; Ling 3.0's `model.layers.{L}.*`
    (a gated-MLA MoE layer, the last MLA layer's perturbed) with `eh_proj`, `enorm`, `hnorm`
    and `final_layernorm` (the names llama.cpp's converter maps: gguf-py's tensor_mapping).
    Written to `mtp.safetensors` beside the model's; the config names the layer count."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    sd = load_file(dst / "model.safetensors")
    rng = np.random.default_rng(seed)
    L, D = cfg["num_hidden_layers"], cfg["hidden_size"]

    def near(t: np.ndarray) -> np.ndarray:
        return (t + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)

    def rand(*shape: int, mean: float = 0.0, std: float = 0.08) -> np.ndarray:
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    if family == "qwen35moe":
        src_layer, out = f"model.layers.{L - 1}.", {}
        for name, t in sd.items():
            if name.startswith(src_layer):
                out["mtp.layers.0." + name[len(src_layer) :]] = near(t)
        out |= {"mtp.fc.weight": rand(D, 2 * D), "mtp.norm.weight": rand(D, std=0.2)}
        out |= {f"mtp.pre_fc_norm_{k}.weight": rand(D, std=0.2) for k in ("embedding", "hidden")}
        cfg["mtp_num_hidden_layers"] = 1
    elif family == "glm4moe":
        src_layer, new, out = f"model.layers.{L - 1}.", f"model.layers.{L}.", {}
        for name, t in sd.items():
            if name.startswith(src_layer):
                out[new + name[len(src_layer) :]] = near(t)
        out |= {new + "eh_proj.weight": rand(D, 2 * D), new + "embed_tokens.weight": near(sd["model.embed_tokens.weight"])}
        out |= {new + "shared_head.head.weight": near(sd["lm_head.weight"])}
        out |= {new + f"{k}.weight": rand(D, mean=1.0, std=0.2) for k in ("enorm", "hnorm", "shared_head.norm")}
        cfg["num_nextn_predict_layers"] = 1
    elif family == "bailingmoe3":
        mla = max(i for i in range(L) if f"model.layers.{i}.attention.kv_b_proj.weight" in sd)
        src_layer, new, out = f"model.layers.{mla}.", f"model.layers.{L}.", {}
        for name, t in sd.items():
            if name.startswith(src_layer):
                out[new + name[len(src_layer) :]] = near(t)
        out |= {new + "eh_proj.weight": rand(D, 2 * D)}
        out |= {new + f"{k}.weight": rand(D, mean=1.0, std=0.2) for k in ("enorm", "hnorm", "final_layernorm")}
        cfg["num_nextn_predict_layers"] = 1
    else:
        raise ValueError(f"no MTP layout for {family}")
    save_file(out, str(dst / "mtp.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
