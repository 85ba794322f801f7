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
    """Write the tiny `arch` checkpoint into `out_dir` and return it."""
    builders = {"qwen3moe": build_qwen3moe, "gpt-oss": build_gpt_oss, "gemma4": build_gemma4, "qwen35moe": build_qwen35moe}
    return builders[arch](Path(out_dir), seed, **kw)


# --- models -------------------------------------------------------------------------


def build_qwen3moe(out_dir: Path, seed: int = 0) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = _qwen_tokenizer()
    n_tok = len(tok)
    cfg = Qwen3MoeConfig(
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
    return _save(Qwen3MoeForCausalLM, cfg, tok, out_dir, seed)


def build_gpt_oss(out_dir: Path, seed: int = 0) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM

    tok = _harmony_tokenizer()
    cfg = GptOssConfig(
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
    return _save(GptOssForCausalLM, cfg, tok, out_dir, seed)


def gemma4_text_config(vocab_size: int) -> dict:
    return dict(
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


def build_gemma4(out_dir: Path, seed: int = 0, multimodal: bool = True) -> Path:
    """`multimodal`: save as Gemma4ForConditionalGeneration (the published layout, no
    vision/audio towers), else as the text-only Gemma4ForCausalLM."""
    from transformers.models.gemma4 import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    tok = _gemma_tokenizer()
    tc = gemma4_text_config(len(tok))
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
    """n greedy tokens after ids, never stopping early."""
    import torch

    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
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
