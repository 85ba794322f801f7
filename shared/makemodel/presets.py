"""Model shapes for made models, and the quant mix each real file uses.

A preset is the hyper-parameters of one made model; the three "-shape"
presets copy the real models (docs/models.md) so that their expert bytes
equal the published files' (docs/formats.md § Real files' quant mixes). The
mix functions pick each weight matrix's ggml type the way llama.cpp's
quantizer did for the real file (same section), including its fallback for
rows that K-quants cannot hold (docs/formats.md § Row-width fallback).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q

ARCHES = ("qwen3moe", "gpt-oss", "gemma4", "qwen35moe", "llama", "glm4moe", "lfm2moe", "deepseek2", "qwen2moe")
PRESETS = (
    "tiny",
    "small",
    "qwen30b-shape",
    "gptoss120b-shape",
    "gemma26b-shape",
    "qwen35-35b-shape",
    "mixtral-8x7b-shape",
    "glm45air-shape",
    "lfm2-8b-shape",
    "deepseek-v2-lite-shape",
    "qwen15-moe-shape",
)
SHAPE_PRESET_ARCH = {
    "qwen30b-shape": "qwen3moe",
    "gptoss120b-shape": "gpt-oss",
    "gemma26b-shape": "gemma4",
    "qwen35-35b-shape": "qwen35moe",
    "mixtral-8x7b-shape": "llama",
    "glm45air-shape": "glm4moe",
    "lfm2-8b-shape": "lfm2moe",
    "deepseek-v2-lite-shape": "deepseek2",
    "qwen15-moe-shape": "qwen2moe",
}


@dataclass(frozen=True)
class Preset:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int  # feed_forward_length (gemma4: the always-on dense MLP)
    vocab_size: int
    n_bpe: int  # trained BPE tokens (the rest of the vocab is specials + placeholders)
    context_length: int
    rms_eps: float
    rope_base: float
    # gpt-oss / gemma4 sliding-window attention
    sliding_window: int = 0
    swa_period: int = 0  # gemma4: full attention at layers i % period == period - 1
    # gemma4 full-attention layers
    head_dim_full: int = 0
    n_head_kv_full: int = 0
    rope_base_swa: float = 0.0
    partial_rotary: float = 1.0  # gemma4 full layers rotate this fraction of pairs
    final_softcap: float = 0.0
    # gpt-oss YaRN
    yarn_factor: float = 0.0
    yarn_orig_ctx: int = 0
    # qwen35moe: full attention on every full_attn_interval-th layer, linear attention
    # (gated delta rule) on the rest; its heads, conv and shared expert
    full_attn_interval: int = 0
    ssm_groups: int = 0  # key heads
    ssm_heads: int = 0  # value heads
    ssm_state: int = 0  # key = value head width
    ssm_conv_kernel: int = 0
    n_ff_shexp: int = 0
    # glm4moe: leading dense layers (width n_ff), shared experts (n_ff_exp each),
    # grouped routing, routed scaling, q/k/v biases, per-head q/k norms
    n_dense_lead: int = 0
    n_expert_shared: int = 0
    expert_groups: int = 1
    expert_groups_used: int = 1
    expert_weights_scale: float = 1.0
    attn_bias: bool = False
    qk_norm: bool = False
    # lfm2moe: the attention layers (the others are short convolutions of width ssm_conv_kernel)
    attn_layers: tuple[int, ...] = ()
    # deepseek2: multi-head latent attention (head_dim is the value head width, n_head_kv 1),
    # V3-style sigmoid routing with a selection bias (else V2's softmax, never renormalized),
    # YaRN's magnitude term as the GGUF stores it (0.1 × mscale_all_dim)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    expert_gating_sigmoid: bool = False
    yarn_log_mul: float = 0.0

    def is_recurrent(self, i: int) -> bool:
        """Whether layer i is a linear-attention (qwen35moe) or short-conv (lfm2moe) layer."""
        if self.attn_layers:
            # A depth cut above the first attention layer (lfm2-8b-shape --layers 2) makes its
            # last layer attend: a model must attend somewhere (llama.cpp, the spec reader).
            last_attends = i == self.n_layer - 1 and min(self.attn_layers) >= self.n_layer
            return i not in self.attn_layers and not last_attends
        return bool(self.full_attn_interval) and (i + 1) % self.full_attn_interval != 0

    def is_swa(self, i: int) -> bool:
        """Whether layer i uses sliding-window attention."""
        if self.swa_period:  # gemma4
            return i % self.swa_period != self.swa_period - 1
        return bool(self.sliding_window) and i % 2 == 0  # gpt-oss: even layers


_P = {
    # ------------------------------------------------------------------ qwen3moe
    ("qwen3moe", "tiny"): Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=8,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff=768,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-6,
        rope_base=1e6,
    ),
    ("qwen3moe", "small"): Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=512,
        n_ff=3072,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=1e6,
    ),
    ("qwen3moe", "qwen30b-shape"): Preset(  # Qwen3-30B-A3B
        "qwen30b-shape",
        n_layer=48,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        n_ff=6144,
        vocab_size=151936,
        n_bpe=4096,
        context_length=40960,
        rms_eps=1e-6,
        rope_base=1e6,
    ),
    # ------------------------------------------------------------------- gpt-oss
    ("gpt-oss", "tiny"): Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=8,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff=256,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-5,
        rope_base=150000.0,
        sliding_window=128,
        yarn_factor=32.0,
        yarn_orig_ctx=4096,
    ),
    ("gpt-oss", "small"): Preset(
        "small",
        n_layer=8,
        n_embd=768,
        n_head=12,
        n_head_kv=4,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=768,
        n_ff=768,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-5,
        rope_base=150000.0,
        sliding_window=128,
        yarn_factor=32.0,
        yarn_orig_ctx=4096,
    ),
    ("gpt-oss", "gptoss120b-shape"): Preset(  # gpt-oss-120b
        "gptoss120b-shape",
        n_layer=36,
        n_embd=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_expert=128,
        n_expert_used=4,
        n_ff_exp=2880,
        n_ff=2880,
        vocab_size=201088,
        n_bpe=4096,
        context_length=131072,
        rms_eps=1e-5,
        rope_base=150000.0,
        sliding_window=128,
        yarn_factor=32.0,
        yarn_orig_ctx=4096,
    ),
    # -------------------------------------------------------------------- gemma4
    # tiny/small widths of the routed and dense FFN are multiples of 32 but not
    # of 256, like the real 704/2112, so the down projections fall back too.
    ("gemma4", "tiny"): Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=192,
        n_ff=320,
        vocab_size=2048,
        n_bpe=1500,
        context_length=4096,
        rms_eps=1e-6,
        rope_base=1e6,
        sliding_window=128,
        swa_period=2,
        head_dim_full=128,
        n_head_kv_full=1,
        rope_base_swa=1e4,
        partial_rotary=0.25,
        final_softcap=30.0,
    ),
    ("gemma4", "small"): Preset(
        "small",
        n_layer=6,
        n_embd=1024,
        n_head=8,
        n_head_kv=4,
        head_dim=128,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=352,
        n_ff=704,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=1e6,
        sliding_window=512,
        swa_period=3,
        head_dim_full=256,
        n_head_kv_full=1,
        rope_base_swa=1e4,
        partial_rotary=0.25,
        final_softcap=30.0,
    ),
    ("gemma4", "gemma26b-shape"): Preset(  # Gemma-4-26B-A4B
        "gemma26b-shape",
        n_layer=30,
        n_embd=2816,
        n_head=16,
        n_head_kv=8,
        head_dim=256,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=704,
        n_ff=2112,
        vocab_size=262144,
        n_bpe=4096,
        context_length=262144,
        rms_eps=1e-6,
        rope_base=1e6,
        sliding_window=1024,
        swa_period=6,
        head_dim_full=512,
        n_head_kv_full=2,
        rope_base_swa=1e4,
        partial_rotary=0.25,
        final_softcap=30.0,
    ),
    # ----------------------------------------------------------------- qwen35moe
    ("qwen35moe", "tiny"): Preset(
        "tiny",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff=256,
        vocab_size=2048,
        n_bpe=1600,
        context_length=4096,
        rms_eps=1e-6,
        rope_base=1e7,
        partial_rotary=0.25,
        full_attn_interval=2,
        ssm_groups=2,
        ssm_heads=4,
        ssm_state=64,
        ssm_conv_kernel=4,
        n_ff_shexp=256,
    ),
    ("qwen35moe", "small"): Preset(
        "small",
        n_layer=8,
        n_embd=1024,
        n_head=8,
        n_head_kv=2,
        head_dim=128,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=512,
        n_ff=512,
        vocab_size=8192,
        n_bpe=4096,
        context_length=8192,
        rms_eps=1e-6,
        rope_base=1e7,
        partial_rotary=0.25,
        full_attn_interval=4,
        ssm_groups=4,
        ssm_heads=8,
        ssm_state=128,
        ssm_conv_kernel=4,
        n_ff_shexp=512,
    ),
    ("qwen35moe", "qwen35-35b-shape"): Preset(  # Qwen3.5-35B-A3B (and Qwen3.6-35B-A3B)
        "qwen35-35b-shape",
        n_layer=40,
        n_embd=2048,
        n_head=16,
        n_head_kv=2,
        head_dim=256,
        n_expert=256,
        n_expert_used=8,
        n_ff_exp=512,
        n_ff=512,
        vocab_size=248320,
        n_bpe=4096,
        context_length=262144,
        rms_eps=1e-6,
        rope_base=1e7,
        partial_rotary=0.25,
        full_attn_interval=4,
        ssm_groups=16,
        ssm_heads=32,
        ssm_state=128,
        ssm_conv_kernel=4,
        n_ff_shexp=512,
    ),
}


# ---------------------------------------------------------------------- deepseek2
# All three in DeepSeek-V2-Lite's form: q_lora_rank 0 (plain attn_q), one leading dense
# layer, 2 shared experts, softmax top-k never renormalized, routed scale 1.0. tiny and
# small have 16 experts, not 8: llama.cpp's quantizer gives 8-expert models other attention types.


# ----------------------------------------------------------------------- qwen2moe
# q/k/v biases and a shared expert on every layer; tiny and small have 16 and 32 experts
# (llama.cpp's quantizer gives 8-expert models other attention types) and expert widths
# that are not whole K-quant rows, so the down projections fall back as the real 1408's do.


def get_preset(arch: str, preset: str) -> Preset | None:
    """The first four families' presets are here; each later family's are in its
    plan module (shared/makemodel/plan_<family>.py, registered in families.py)."""
    if (arch, preset) in _P:
        return _P[(arch, preset)]
    from moe_pipe.shared.makemodel.families import FAMILY_PRESETS  # they import Preset from here

    return FAMILY_PRESETS.get(arch, {}).get(preset)


# --- routers --------------------------------------------------------------------


@dataclass(frozen=True)
class RouterShape:
    """How make-model fills an arch's router (makemodel.py, "routers").

    `logit_std`: spread over experts of a typical token's router logits (the
    weights are Gaussian, scaled for the arch's router input), for a model of
    `ref_layers` layers or fewer; a deeper model's is × (n_layer /
    ref_layers) ** `depth_exp`. `bias_std`: spread of static per-expert logit
    offsets (gpt-oss's router bias): experts that are popular in every text,
    as a trained router has.

    The shape presets only (tiny and small stay as they were): `stream_write`
    scales what every layer but layer 0's attention writes into the residual
    stream (attention output of layers ≥ 1, every layer's expert down
    projection and their biases), so the stream a router reads moves little
    from one layer to the next, as a trained model's does (cross-layer
    predictability); `first_attn_q`: layer 0's query scale (its attention's
    sharpness), which sets how much of the stream's content is this token's
    own and so how fast routing turns over from token to token. With these
    the pre-FFN norms (the routers' input) are flat: their random spread
    alone would make a layer's router see a different input from its
    neighbour's. 1.0 and 1.0: the stream as the other presets have it.
    `shaped_bias_std`: `bias_std` for a shaped stream (0: the same), whose
    routing is steadier from token to token.
    """

    logit_std: float
    bias_std: float = 0.0
    depth_exp: float = 0.0
    ref_layers: int = 8
    stream_write: float = 1.0
    first_attn_q: float = 1.0
    shaped_bias_std: float = 0.0

    @property
    def shapes_stream(self) -> bool:
        return (self.stream_write, self.first_attn_q) != (1.0, 1.0)

    def logit_std_at(self, n_layer: int) -> float:
        return self.logit_std * max(1.0, n_layer / self.ref_layers) ** self.depth_exp


# Calibrated on the phone traces (bench/bench_routing.py; why these two
# levers: makemodel.py "routers"; figures: docs/benchmarks.md "Synthetic
# routing"), teacher-forced corpus text at the traces' top-k. LRU decode hit
# at a cache of 20 % of the experts, made model / trace:
#   qwen3moe (qwen30b-shape, top-6): 77.5 / 74.1 at 8 layers, 74.9 at 16,
#     77.5 at 48 (the full depth); unit logits gave 95.7 at 8 layers and
#     greedy decoding that cycles through a few tokens. The price: gates
#     sharper than a trained model's (top-1 weight ~0.7, not ~0.3).
#   gpt-oss (gptoss120b-shape, top-2): 77.5 / 74.0 at 4 layers, 79.0 at 8;
#     without the bias 25.4, near-uniform routing.
#   gemma4: no trace to match; logits of the same order as the others'.
# qwen3moe's stream_write and first_attn_q (shape presets only) were fitted
# on qwen30b-shape cut to 8 layers, 128 text tokens: the cross-layer probe
# (bench_routing.py --cross-layer) at top-8 to the published 88.6 % at
# d = 1 (ours 88.6, 84.0 at d = 2, 80.1 at d = 3), keeping the LRU hit at a
# 20 % cache at 76.6 (top-6; 77.5 before, trace 74.1) and the reuse
# figures near the trace's (docs/benchmarks.md "Cross-layer predictability").
# gpt-oss (gptoss120b-shape, 4 layers, 64 text tokens): stream_write 0.035
# gives 87.5 % at d = 1 (top-4; 42.6 unshaped), and the shaped stream keeps
# routing steadier, so its bias spread comes down from 0.9 to 0.75 for the
# LRU hit at a 20 % cache (top-2: 80.9 / 78.1 text / greedy, 77.5 / 81.2
# before, trace 74.0). gemma4 is not shaped.
ROUTER = {
    "qwen3moe": RouterShape(logit_std=5.0, depth_exp=0.4, stream_write=0.035, first_attn_q=0.85),
    "gpt-oss": RouterShape(logit_std=1.0, bias_std=0.9, stream_write=0.035, shaped_bias_std=0.75),
    "gemma4": RouterShape(logit_std=1.0),
    # Not calibrated (no trace of Qwen3.5): qwen3moe's gate sharpness, its stream unshaped.
    "qwen35moe": RouterShape(logit_std=5.0, depth_exp=0.4),
    # Not calibrated (no Mixtral trace): qwen3moe's gate sharpness, its stream unshaped.
    "llama": RouterShape(logit_std=5.0, depth_exp=0.4),
    # Not calibrated (no GLM trace). Sigmoid gates: logits of unit spread keep the chosen
    # experts' σ in its sensitive range (≈ 0.85-0.95), where the selection bias nudges
    # rather than decides; qwen3moe's 5.0 would saturate σ and leave the choice to the bias.
    "glm4moe": RouterShape(logit_std=1.0),
    # Not calibrated (no LFM2 trace). Sigmoid gates as glm4moe's, unit logit spread. Its stream
    # holds little context average (short convs span 3 tokens; 1 layer in 4 attends), so
    # routing turns over like gpt-oss's rather than freezing: lfm2-8b-shape cut to 8 layers,
    # 40 greedy tokens after corpus text were all distinct, decode LRU hit at a 20 % cache
    # 16-17 % (near-uniform routing) at logit scales 0.5-4 alike.
    "lfm2moe": RouterShape(logit_std=1.0),
    # Not calibrated (no DeepSeek trace): softmax gates as qwen3moe's, its sharpness and depth rule.
    "deepseek2": RouterShape(logit_std=5.0, depth_exp=0.4),
    # Not calibrated (no Qwen1.5-MoE trace): qwen3moe's softmax sharpness and depth rule, its stream
    # unshaped; the top-k weights are not renormalized, so the routed sum is p-weighted as in the real model.
    "qwen2moe": RouterShape(logit_std=5.0, depth_exp=0.4),
}


# --- quant mix ----------------------------------------------------------------

# llama.cpp's replacement when ne0 % 256 != 0 (docs/formats.md § Row-width fallback).
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.IQ4_NL, Q.Q3_K: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL}


def fit_type(qtype: Q, ne0: int) -> Q:
    """`qtype`, or llama.cpp's fallback when a row of `ne0` can't hold its blocks."""
    from moe_pipe.shared.quant.blocks import block_format

    if ne0 % block_format(qtype).block_size == 0:
        return qtype
    return _FALLBACK.get(qtype, qtype)  # caller checks the result still fits


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M/Q5_K_M "more bits" layers: first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def real_mix(arch: str, role: str, layer: int, n_layer: int, v_index: int, n_v: int) -> Q:
    """The type of weight matrix `role` in the real file's quant mix, before the ne0 fallback.

    Roles: embd, output, attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up,
    ffn_down, ffn_gate_exps, ffn_up_exps, ffn_gate_up_exps, ffn_down_exps,
    shortconv_in, shortconv_out (lfm2moe: no rule of their own, the mix's Q4_K),
    attn_q_a, attn_q_b, attn_kv_a_mqa, attn_k_b, attn_v_b (deepseek2: none of them is in
    llama.cpp's attn_v class, which only attn_kv_b would join, so all take Q4_K).
    `v_index`/`n_v` count attn_v tensors (gemma4's full layers have none; the
    quantizer counts tensors, not layers).
    """
    if arch == "gpt-oss":  # ggml-org MXFP4 MoE: experts MXFP4, everything else Q8_0
        return Q.MXFP4 if role.endswith("_exps") else Q.Q8_0
    if arch == "llama" and role in ("attn_k", "attn_v", "attn_output"):
        # llama.cpp's quantizer for an 8-expert model (every llama preset has 8, as Mixtral does):
        # attn_k and attn_v Q8_0 in every mix, attn_output Q5_K in Q4_K_M
        return Q.Q5_K if role == "attn_output" else Q.Q8_0
    # Q4_K_M (qwen3moe: confirmed by load log; gemma4: same rules, tied embd = output rule)
    # gemma4, lfm2moe: the head is tied to token_embd, which takes the output rule
    if role == "output" or (role == "embd" and arch in ("gemma4", "lfm2moe")):
        return Q.Q6_K
    if role == "attn_v":
        return Q.Q6_K if use_more_bits(v_index, n_v) else Q.Q4_K
    if role in ("ffn_down", "ffn_down_exps", "ffn_down_shexp"):
        return Q.Q6_K if use_more_bits(layer, n_layer) else Q.Q4_K
    return Q.Q4_K


MIX_NAME = {
    "qwen3moe": "Q4_K_M",
    "gpt-oss": "MXFP4_MOE",
    "gemma4": "Q4_K_M",
    "qwen35moe": "Q4_K_M",
    "llama": "Q4_K_M",
    "glm4moe": "Q4_K_M",
    "lfm2moe": "Q4_K_M",
    "deepseek2": "Q4_K_M",
    "qwen2moe": "Q4_K_M",
}
