"""The model spec: a GGUF's metadata turned into one frozen record per model.

Per-layer facts (kv heads, head width, sliding window) are stored as tuples
with one entry per layer, so the forward pass never has to ask "is this key a
scalar or an array?". This module holds the record, what the KV cache costs,
and `SpecPart`, what each family's GGUF part (shared/families/<family>/spec.py)
exports: its metadata reader, built from the shared keys of spec_keys.py
(docs/models.md, one section per family), and its tensor table, checked against
the file by spec_tensors.py. model_file.py `read_spec` finds the part by the
file's arch and does both.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Protocol, cast

from .. import family_registry as registry
from ..errors import GGUFError, UserError
from .reader import GGUFFile


@dataclass(frozen=True)
class RopeSpec:
    freq_base: float
    dim: int  # rotated dims per head (n_rot)
    scaling: str = "none"  # none | linear | yarn
    factor: float = 1.0
    orig_ctx: int = 0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    freq_base_swa: float | None = None
    dim_swa: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: tuple[int, ...]  # per layer
    head_dim_v: tuple[int, ...]  # per layer
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int  # dense / always-on MLP width (0 when absent)
    rms_eps: float
    rope: RopeSpec
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]  # per layer: True = sliding-window attention
    final_logit_softcap: float = 0.0
    tied_output: bool = False
    fused_gate_up: bool = False
    expert_bias: bool = False
    # Hybrid models (qwen35moe): per layer, True = a linear-attention (gated
    # delta rule) layer with a recurrent state instead of a KV cache; () = none.
    recurrent_layers: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0  # the short causal conv's width (ssm.conv_kernel)
    ssm_state: int = 0  # key (and value) width of a linear-attention head (ssm.state_size)
    ssm_groups: int = 0  # key heads (ssm.group_count)
    ssm_heads: int = 0  # value heads (ssm.time_step_rank)
    n_ff_shexp: int = 0  # the shared expert's FFN width (0: none)
    # bailingmoe3's Kimi Delta Attention: the bounded forget gate's floor (log decay per step,
    # kda.gate_lower_bound < 0); its heads are ssm_heads of ssm_state, one conv per q, k and v.
    kda_gate_lower_bound: float = 0.0
    # lfm2moe's short-conv layers: a conv over this many channels (n_embd) and no delta rule.
    shortconv_channels: int = 0
    # Layers 0..n_dense_lead-1 have a dense FFN (width n_ff) and no experts
    # (deepseek2, glm4moe, lfm2moe): nothing of theirs is streamed or cached.
    n_dense_lead: int = 0
    # Routing beyond softmax-top-k (model/moe.py gated_group_top_k; read by `moe_routing`).
    expert_gating: str = "softmax"  # softmax | sigmoid (llama.cpp expert_gating_func 1 | 2)
    expert_weights_norm: bool = True  # renormalize the chosen weights to sum 1
    expert_weights_scale: float = 1.0  # routed scaling factor
    expert_groups: int = 1  # expert_group_count
    expert_groups_used: int = 1  # expert_group_used_count
    # How a group is scored when groups limit the choice: "top2" the sum of its two best
    # (V3's noaux_tc, sigmoid gating) or "max" its best (V2's group_limited_greedy, softmax).
    expert_group_score: str = "top2"
    n_expert_shared: int = 0  # always-on shared experts (expert_shared_count)
    # NextN/MTP blocks the file holds after the decoder's n_layer blocks (llama.cpp's converter
    # counts them in block_count; gguf/nextn.py): checked, never run, loaded or streamed.
    n_layer_nextn: int = 0
    # deepseek2's multi-head latent attention: the cache holds one latent head of
    # kv_lora_rank + rope dims per position (head_dim_k; head_dim_v 0: V is K's first
    # kv_lora_rank values); per head, q·k spans head_dim_k_mla dims and V head_dim_v_mla.
    q_lora_rank: int = 0  # 0: a plain attn_q
    kv_lora_rank: int = 0
    head_dim_k_mla: int = 0
    head_dim_v_mla: int = 0
    rope_yarn_log_mul: float = 0.0  # YaRN's mscale_all_dim (the GGUF stores 0.1 × it)
    # Compressed attention (deepseek4): per layer, the positions one cached entry folds (0: none)
    # and the entry's width, kept for the whole context (`kv_entries`); V (head_dim_v) then holds
    # the per-position rows entries are folded from, kept for the last v_windows[i] positions
    # (a ring, as a sliding layer's K; () = K's window: `kv_v_windows`).
    compress_ratios: tuple[int, ...] = ()
    entry_widths: tuple[int, ...] = ()
    v_windows: tuple[int, ...] = ()

    def has_experts(self, i: int) -> bool:
        """Whether layer i has routed experts (the leading dense layers have none)."""
        return i >= self.n_dense_lead

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_dense_lead, self.n_layer))

    def is_recurrent(self, i: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[i]

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of the conv: q and k (groups × state each) and v (heads × state);
        lfm2moe's short conv: B·x, n_embd channels."""
        return self.shortconv_channels or (2 * self.ssm_groups + self.ssm_heads) * self.ssm_state

    @property
    def n_gqa(self) -> tuple[int, ...]:
        return tuple(self.n_head // kv for kv in self.n_head_kv)


# One tensor's expected shape: ("matrix" | "vector", numpy shape, where the shape comes from).
TensorShape = tuple[str, tuple[int, ...], str]
Shapes = dict[str, TensorShape]  # tensor name -> its expected shape


class SpecPart(Protocol):
    """What every family's GGUF part (shared/families/<family>/spec.py) exports.
    model_file.read_spec and the tensor checks (spec_tensors.py) call it for the files whose
    general.architecture is the family's (registry.by_arch)."""

    TOP_TENSORS: tuple[str, ...]
    """The tensors outside the layers that the forward pass reads: the embedding and
    the final norm (spec_tensors.EMBEDDING_AND_FINAL_NORM unless the family names them otherwise)."""

    ATTENTION_QUERIES: int
    """Query-sized arrays (n_head × head_dim_k floats a token) a prompt chunk's attention keeps
    alive at once beside its keys, values and output (`prefill_activation_bytes`): 1 where the
    queries are normed, rotated and biased in place, 2 where the block keeps a copy or a
    query-sized part beside them (a gate, MLA's pieces); tests/test_prefill.py holds each family
    to it."""

    RECURRENT_ARRAYS: int
    """Head-sized arrays (ssm_heads × ssm_state floats a token) a prompt chunk's recurrent layer
    keeps alive at once beside its conv's input and output (`prefill_activation_bytes`): 4 in
    the gated delta net (queries, keys, outputs, gate), more where the layer keeps a decay per
    channel and normalizes in float64 (Kimi Delta Attention), 0 without recurrent layers;
    tests/test_prefill.py holds each family to it."""

    def read(self, f: GGUFFile) -> ModelSpec:
        """The family's metadata keys (prefix: its arch) read into a spec; a key that
        is missing, mistyped or out of range is a GGUFError naming it."""
        ...

    def required_per_layer(self, spec: ModelSpec, i: int) -> tuple[str, ...]:
        """The tensors (without "blk.i.") that layer i's forward pass asks for."""
        ...

    def layer_shapes(self, spec: ModelSpec, i: int) -> Shapes:
        """The shapes of the family's own tensors in layer i, beyond the ones
        spec_tensors.expected_shapes gives every family (where both name a tensor,
        the family's shape wins); {} when the common ones cover the family."""
        ...


def spec_part(f: GGUFFile) -> SpecPart:
    """The GGUF part of the family the file's general.architecture names."""
    part = _part_of(f.arch)
    if part is None:
        raise GGUFError(f.path, f"architecture {f.arch!r} is not supported (supported: {', '.join(registry.ARCHES)})")
    return part


def _part_of(arch: str) -> SpecPart | None:
    """The GGUF part of the family whose arch this is; None for an unsupported one."""
    family = registry.by_arch(arch)
    return None if family is None else cast(SpecPart, family.part("spec"))


# What the KV cache stores per element, as a fraction (numerator, denominator) of bytes:
# f32 and f16 as such; q8_0 as llama.cpp's block of 32 int8 values plus one float16 scale (34 bytes per 32).
# The config's compute.kv_type choices (shared/config.py) are these keys.
KV_TYPE_BYTES: dict[str, tuple[int, int]] = {"f16": (2, 1), "f32": (4, 1), "q8_0": (34, 32)}
Q8_0_BLOCK = 32  # values per q8_0 scale, along the head dimension


def check_kv_type(kv_type: str, head_widths: tuple[int, ...]) -> None:
    """Refuse a KV type the model's heads cannot be stored in: q8_0 needs every
    head width (K and V) to be whole blocks of 32."""
    if kv_type not in KV_TYPE_BYTES:
        raise UserError(f"unknown KV cache type {kv_type!r} (choose from {', '.join(KV_TYPE_BYTES)})")
    odd = sorted({d for d in head_widths if d % Q8_0_BLOCK})
    if kv_type == "q8_0" and odd:
        raise UserError(
            f"--kv-type q8_0 stores blocks of {Q8_0_BLOCK} values per head, but this model's attention heads are "
            f"{', '.join(map(str, odd))} wide (not a multiple of {Q8_0_BLOCK}): use f16 or f32"
        )


# A sliding-window layer keeps its keys and values in a ring of W - 1 + SWA_PROMPT_BLOCK rows, not
# the whole context: a decoded token needs only the W - 1 positions before it, and a prompt goes
# through a sliding layer's attention in blocks of this many tokens (shared/model/blocks.py
# `store_and_attend`), so the ring holds every key a block's queries see without a copy. llama.cpp's
# SWA cache is likewise n_swa + n_ubatch (512 by default). The block's rows are also how far back a
# kept prefix may step (docs/conversations.md § Past the sliding window): regenerating a reply, or a template
# that rewrites the last reply, keeps the conversation when that reply is at most this long.
SWA_PROMPT_BLOCK = 512


def kv_windows(spec: ModelSpec) -> tuple[int, ...]:
    """Per layer, the window W its attention sees (its KV rows are a ring), or 0: the whole context."""
    w, swa = spec.sliding_window, spec.swa_layers
    return tuple(w if w > 0 and i < len(swa) and swa[i] else 0 for i in range(spec.n_layer))


def kv_v_windows(spec: ModelSpec) -> tuple[int, ...]:
    """Per layer, the window its V rows are kept for: K's (`kv_windows`) unless the family keeps
    V for another span (deepseek4's compressor rows: the positions a fold still reads)."""
    return spec.v_windows or kv_windows(spec)


def kv_entries(spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """Per layer, (positions per cached entry, entry width), (0, 0) without entries: a
    compressing layer's entries, one per `ratio` positions over the whole context (deepseek4)."""
    if not spec.compress_ratios:
        return ((0, 0),) * spec.n_layer
    return tuple((r, w) if r else (0, 0) for r, w in zip(spec.compress_ratios, spec.entry_widths))


def kv_rows(window: int, n_ctx: int, block: int = SWA_PROMPT_BLOCK) -> int:
    """Rows one layer's K (and V) keep: `n_ctx`, or with a window a ring of window - 1 + block
    (never more than the context: then nothing wraps)."""
    return min(n_ctx, window - 1 + block) if window > 0 else n_ctx


def kv_cache_bytes(spec: ModelSpec, n_ctx: int, kv_type: str) -> int:
    """Bytes of the K and V caches compute allocates for `n_ctx` positions stored as
    `kv_type` (a sliding-window layer's ring of `kv_rows`, every other layer the whole
    context; V on its own window when the family gives one, `kv_v_windows`), a compressing
    layer's entries (`kv_entries`: one per `ratio` positions), plus a hybrid model's
    recurrent state (`recurrent_state_bytes`)."""
    entries = kv_entries(spec)
    check_kv_type(kv_type, spec.head_dim_k + spec.head_dim_v + tuple(w for _, w in entries))
    num, den = KV_TYPE_BYTES[kv_type]
    layers = zip(spec.n_head_kv, spec.head_dim_k, spec.head_dim_v, kv_windows(spec), kv_v_windows(spec), entries, range(spec.n_layer))
    elements = sum(
        kv_rows(wk, n_ctx) * hk * dk + kv_rows(wv, n_ctx) * hk * dv + (n_ctx // ratio * width if ratio else 0)
        for hk, dk, dv, wk, wv, (ratio, width), i in layers
        if not spec.is_recurrent(i)
    )
    return elements * num // den + recurrent_state_bytes(spec)  # exact: q8_0 heads are whole blocks of 32


def kv_position_bytes(spec: ModelSpec, kv_type: str) -> int:
    """Bytes one position adds to a sequence's cache on the layers that keep the whole
    context (no window, not recurrent): what the slots' KV pool counts a position
    (gateway.kv_pool; rings, compressed entries and a recurrent state are fixed)."""
    num, den = KV_TYPE_BYTES[kv_type]
    layers = zip(spec.n_head_kv, spec.head_dim_k, spec.head_dim_v, kv_windows(spec), kv_v_windows(spec), range(spec.n_layer))
    elements = sum(hk * (dk * (not wk) + dv * (not wv)) for hk, dk, dv, wk, wv, i in layers if not spec.is_recurrent(i))
    return elements * num // den


def kv_pool_bytes(spec: ModelSpec, n_ctx: int, kv_type: str, slots: int, pool: int) -> int:
    """The KV memory of `slots` sequences of up to `n_ctx` positions whose whole-context rows
    hold `pool` positions together (procs/slots.py): each slot's fixed part (`kv_cache_bytes`
    but the whole-context rows), the pool's positions, and per slot a partly filled page at
    the end of each kv head's run of rows (every array's: q8_0 keeps values and scales)."""
    per_position = kv_position_bytes(spec, kv_type)
    fixed = kv_cache_bytes(spec, n_ctx, kv_type) - n_ctx * per_position
    return slots * (fixed + kv_row_runs(spec, kv_type) * mmap.PAGESIZE) + pool * per_position


def kv_row_runs(spec: ModelSpec, kv_type: str) -> int:
    """The runs of whole-context rows a sequence's cache keeps (a kv head's K or V of a layer
    with no window; q8_0 keeps values and scales apart): each ends in a partly filled page."""
    layers = zip(spec.n_head_kv, kv_windows(spec), kv_v_windows(spec), range(spec.n_layer))
    return sum(hk * ((not wk) + (not wv)) for hk, wk, wv, i in layers if not spec.is_recurrent(i)) * (2 if kv_type == "q8_0" else 1)


# A prompt chunk's routed expert outputs (K a token, D floats each) wait for their choice-order
# sum (shared/model/moe.py); from this many bytes of them a layer keeps the experts' hidden
# activations (F floats a row, F < D) and takes the down projections a part of the output's
# columns at a time, each part summed before the next: a 4,096-token chunk of gemma26b-shape
# keeps 88 + 88 MiB where it kept 352.
SPLIT_OUTPUT_BYTES = 64 << 20
# Output columns a part holds: whole tiles of 16 weight rows (shared/quant/_q8.py).
PART_ROWS = 16
# The most (token, choice) rows of one expert a prompt's kernel call takes: an expert more
# tokens route to goes in pieces of this many (shared/model/moe.py _runs_of_rows), so a
# run's own arrays (its rows of the input, the gate and up products, their GLU, the down
# products: at most 2·D + 5·F floats a row) stay a fixed size. One row block of the GEMM.
EXPERT_RUN_ROWS = 256


def expert_output_parts(rows: int, d: int, f: int) -> int:
    """How many parts of the output's columns a chunk's `rows` (tokens × K) expert outputs of
    width d are summed in, for hidden activations of width f: 1 below SPLIT_OUTPUT_BYTES (the
    outputs whole), else about d / f, so that a part's outputs take no more than the hidden
    activations kept for them."""
    if 4 * rows * d < SPLIT_OUTPUT_BYTES or f >= d:
        return 1
    return -(-d // f)


def output_part_columns(d: int, parts: int) -> list[tuple[int, int]]:
    """The column ranges [c0, c1) of `parts` parts of d columns, each whole tiles of PART_ROWS
    but the last."""
    step = -(-d // parts // PART_ROWS) * PART_ROWS if parts > 1 else d
    return [(c, min(d, c + step)) for c in range(0, d, step)]


def expert_scratch_floats(spec: ModelSpec, tokens: int, top_k: int) -> tuple[int, int]:
    """Floats a chunk of `tokens` keeps for its routed experts until their outputs are summed
    (shared/model/moe.py apply_experts): (the outputs' buffer, reused across layers and
    chunks: K·D a token whole, one part's columns when split; the hidden activations held
    for the parts during the FFN, K·F a token when split, else none)."""
    rows, d, f = tokens * top_k, spec.n_embd, spec.n_ff_exp
    parts = expert_output_parts(rows, d, f)
    if parts == 1:
        return rows * d, 0
    c0, c1 = output_part_columns(d, parts)[0]
    return rows * (c1 - c0), rows * f


def prefill_activation_bytes(spec: ModelSpec, tokens: int, top_k: int) -> int:
    """Float32 bytes a prompt chunk of `tokens` keeps alive in one layer of the forward pass
    (shared/model/base.py `prefill`), at the larger of its two phases, beside the layer's
    input (D) and the experts' outputs buffer (`expert_scratch_floats`, kept across layers):

    - attention: its input's norm and the block's output (2·D), and the larger of the
      attention's arrays (the family's ATTENTION_QUERIES query arrays, key, value and output)
      and a linear-attention layer's (its conv input and output, 2·C, and the family's
      RECURRENT_ARRAYS head-sized arrays, each H·d);
    - FFN: the residual sum, the norms and sums it keeps (5·D), the router's logits (E), the
      widest dense or shared FFN's gate, up and product (3·F), the experts' hidden
      activations held for the split outputs, and one run of experts' own arrays (a fixed
      EXPERT_RUN_ROWS rows of 2·D + 5·F).

    The attention block is a function of its own in every family, so its arrays are gone
    before the FFN's exist (tests/test_prefill.py checks the peak of the arrays a chunk
    allocates against this). A chunk is at most this much beside the KV cache; the budget
    leaves it to compute."""
    d, h = spec.n_embd, spec.n_head
    part = _part_of(spec.arch)
    assert part is not None, spec.arch  # a spec was read by its family's part
    queries = part.ATTENTION_QUERIES
    qkvo = max(h * queries * dk + hk * (dk + dv) + h * dv for hk, dk, dv in zip(spec.n_head_kv, spec.head_dim_k, spec.head_dim_v))
    recurrent = 2 * spec.ssm_conv_channels + part.RECURRENT_ARRAYS * spec.ssm_heads * spec.ssm_state if spec.ssm_conv_kernel else 0
    ffn = 3 * max(spec.n_ff_exp, spec.n_ff, spec.n_ff_shexp)
    outputs, hidden = expert_scratch_floats(spec, tokens, top_k)
    attention = 2 * d + max(qkvo, recurrent)
    run = EXPERT_RUN_ROWS * (2 * d + 5 * spec.n_ff_exp)
    mlp = tokens * (5 * d + spec.n_expert + ffn) + hidden + run
    return 4 * (tokens * d + max(tokens * attention, mlp) + outputs)


def recurrent_state_bytes(spec: ModelSpec) -> int:
    """Float32 bytes of one sequence's recurrent state (shared/model/blocks.py
    RecurrentState): per linear-attention layer the conv's last kernel-1 inputs
    and the delta rule's [heads, state, state] matrix; fixed, whatever the context."""
    n_recurrent = sum(spec.is_recurrent(i) for i in range(spec.n_layer))
    if not n_recurrent:
        return 0
    per_layer = (spec.ssm_conv_kernel - 1) * spec.ssm_conv_channels + spec.ssm_heads * spec.ssm_state * spec.ssm_state
    return 4 * per_layer * n_recurrent


def check_rope(f: GGUFFile, spec: ModelSpec) -> None:
    """Rotated dims pair up inside a head: an odd count, or more than the
    heads it rotates are wide, indexes past the head."""
    r = spec.rope
    for key, dim in (("rope.dimension_count", r.dim), ("rope.dimension_count_swa", r.dim_swa)):
        if dim is not None and (dim <= 0 or dim % 2):
            raise GGUFError(f.path, f"metadata {spec.arch}.{key} = {dim} must be even and positive")
    for i, swa in enumerate(spec.swa_layers):
        # gemma4 rotates sliding layers by their own count; the rest use one for every layer
        key, dim = ("rope.dimension_count_swa", r.dim_swa) if swa and r.dim_swa else ("rope.dimension_count", r.dim)
        if dim > spec.head_dim_k[i]:
            raise GGUFError(f.path, f"metadata {spec.arch}.{key} = {dim} is wider than layer {i}'s heads ({spec.head_dim_k[i]})")


def experts_per_token(spec: ModelSpec, chosen: int | None) -> int:
    """The routed experts each token uses: compute.n_expert_used, else the model's own;
    a UserError when the model has fewer experts than that."""
    k = chosen or spec.n_expert_used
    if k > spec.n_expert:
        raise UserError(f"--n-expert-used {k} is out of range: this model has {spec.n_expert} experts per layer")
    return k


def lossy_expert_count(spec: ModelSpec, chosen: int | None) -> str:
    """One warning line when compute.n_expert_used is not the model's own ("" when it is):
    the router then mixes another number of experts than the model was trained with."""
    if not chosen or chosen == spec.n_expert_used:
        return ""
    speed = "faster" if chosen < spec.n_expert_used else "slower"
    return (
        f"warning: --n-expert-used {chosen} differs from the model's own {spec.n_expert_used}: "
        f"LOSSY, {speed} and the outputs change (leave it out for the model's own)"
    )
