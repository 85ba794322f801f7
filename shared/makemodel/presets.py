"""What every family's made models share: the `Preset` fields, the router
shape, and llama.cpp's Q4_K_M mix with its row-width fallback.

A preset is the hyper-parameters of one made model. Each family's presets are
in its plan part (shared/families/<family>/plan.py): tiny and small, and the
"-shape" presets that copy the real models (docs/models.md) so that their
expert bytes equal the published files' (docs/formats.md § Real files' quant
mixes). The mix functions pick each weight matrix's ggml type the way
llama.cpp's quantizer did for the real file (same section), including its
fallback for rows that K-quants cannot hold (docs/formats.md § Row-width
fallback); a family whose real file differs says so in its plan part's `mix`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q

# The presets every family has, at its own widths; a family's other presets are the real model's shape.
SHARED_PRESETS = ("tiny", "small")


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


# --- routers --------------------------------------------------------------------


@dataclass(frozen=True)
class RouterShape:
    """How make-model fills a family's router (maker.py, "routers"). Each family's
    is its plan part's `router`, beside the measurements it was calibrated on
    (bench/bench_routing.py against the phone traces; docs/benchmarks.md
    "Synthetic routing").

    `logit_std`: spread over experts of a typical token's router logits (the
    weights are Gaussian, scaled for the arch's router input), for a model of
    `ref_layers` layers or fewer; a deeper model's is × (n_layer /
    ref_layers) ** `depth_exp`. `bias_std`: spread of static per-expert logit
    offsets (gpt-oss's router bias): experts that are popular in every text,
    as a trained router has.

    The shape presets only (tiny and small are not shaped): `stream_write`
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


# --- quant mix ----------------------------------------------------------------

# llama.cpp's replacement when ne0 % 256 != 0 (docs/formats.md § Row-width fallback).
# The i-quants (256-weight blocks) take IQ4_NL too (llama-quant.cpp's fallback switch).
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.IQ4_NL, Q.Q3_K: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL} | {
    q: Q.IQ4_NL for q in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
}


def fit_type(qtype: Q, ne0: int) -> Q:
    """`qtype`, or llama.cpp's fallback when a row of `ne0` can't hold its blocks."""
    from ..quant.blocks import block_format

    if ne0 % block_format(qtype).block_size == 0:
        return qtype
    return _FALLBACK.get(qtype, qtype)  # caller checks the result still fits


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M/Q5_K_M "more bits" layers: first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m(role: str, layer: int, n_layer: int, v_index: int, n_v: int, *, tied_head: bool) -> Q:
    """The type of weight matrix `role` in llama.cpp's Q4_K_M mix, before the ne0 fallback
    (qwen3moe: confirmed by load log; the other Q4_K_M families follow the same rules).

    Roles: embd, output, attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up,
    ffn_down, ffn_gate_exps, ffn_up_exps, ffn_gate_up_exps, ffn_down_exps,
    shortconv_in, shortconv_out (lfm2moe: no rule of their own, the mix's Q4_K),
    attn_q_a, attn_q_b, attn_kv_a_mqa, attn_k_b, attn_v_b (deepseek2: none of them is in
    llama.cpp's attn_v class, which only attn_kv_b would join, so all take Q4_K).
    `v_index`/`n_v` count attn_v tensors (gemma4's full layers have none; the
    quantizer counts tensors, not layers). A head tied to token_embd (`tied_head`)
    makes token_embd take the output rule.
    """
    if role == "output" or (role == "embd" and tied_head):
        return Q.Q6_K
    if role == "attn_v":
        return Q.Q6_K if use_more_bits(v_index, n_v) else Q.Q4_K
    if role in ("ffn_down", "ffn_down_exps", "ffn_down_shexp"):
        return Q.Q6_K if use_more_bits(layer, n_layer) else Q.Q4_K
    return Q.Q4_K
