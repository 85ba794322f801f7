"""Make GGUF models in the real format with random weights.

Weights cannot be downloaded here, so tests, demos and benchmarks run on made
models: llama.cpp's tensor names, shapes and metadata for each arch
(docs/models.md), the real quant mix (docs/formats.md § Real files' quant mixes)
with random but *valid* quantized blocks, routers scaled so that routing moves
from token to token like a real model's (see "routers" below), a BPE tokenizer
trained on shared/data/corpus.txt (docs/models.md § Tokenizers) and the
family's chat template. What differs from family to family is the family's
plan part (shared/families/<family>/plan.py, part.PlanPart): this module
plans and writes every family's file from it.

Writing streams: all tensor infos go into the header first, then one tensor
at a time is generated and written, so a 60 GB gpt-oss-120b-shaped file
needs about one tensor of RAM (≤ 0.7 GB). A worker thread generates the next
tensor while the current one is written.

Legend for shapes below (numpy order, last axis = ggml ne0):
V vocab, D n_embd, H q heads, Hk kv heads, d head dim, X experts,
F expert ff width, Fd dense ff width.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, LlamaFileType

from ..errors import UserError
from ..family_registry import by_name
from ..gguf.layout import scale_sidecar
from ..gguf.vocab import Vocab
from ..quant.blocks import block_format, qtype_from_name, random_blocks
from .part import PlanPart, TensorSpec
from .plans import ARCHES, PRESETS, SHAPE_PRESET_ARCH, get_preset, plan_part
from .presets import SHARED_PRESETS, Preset, fit_type

__all__ = ["ARCHES", "PRESETS", "chat_template", "make_model", "plan_tensors", "TensorSpec"]

# Generation chunk: keeps the temporaries of random_blocks small and its
# std calibration per chunk; fixed so files stay byte-identical.
_CHUNK_BYTES = 32 << 20


def make_model(
    arch: str,
    preset: str,
    out: Path | str,
    layers: int | None = None,
    quant: str | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    *,
    experts: str | None = None,
    sparse: bool = False,
    header_only: bool = False,
    mtp: bool = False,
    _overrides: dict | None = None,
    _file_bytes: list[int] | None = None,
) -> Path:
    """Write a random-weight GGUF model of `arch` (a GGUF arch, or a family's own
    name: registry.by_name) shaped like `preset` to `out`.

    * `layers` cuts (or extends) the depth; default = the preset's (real) depth.
      Per-layer rules (more-bits layers, sliding-window pattern) use the cut depth,
      as llama.cpp's quantizer would on a model that deep.
    * `quant` replaces the real quant mix with one type for every weight matrix
      (token_embd, output, attention, dense and expert FFN). Norms, routers,
      biases, sinks and scales stay F32. Rows whose width the type's block can't
      divide get llama.cpp's fallback (Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0,
      Q2_K/Q3_K/IQ4_XS and the i-quants→IQ4_NL); if even that can't hold them it is a UserError.
    * `experts` gives the routed experts' matrices (ffn_*_exps) one type of their own over
      the mix or `quant`, as the low-bit MoE files do (unsloth's UD-IQ2_XXS: IQ2_XXS experts
      beside a K-quant mix elsewhere); general.file_type then names the experts' type.
    * Same arguments → byte-identical file: every tensor's generator is seeded
      from blake2b(seed, tensor name), and the tokenizer training is deterministic.
    * `progress(bytes_done, bytes_total)` is called after each tensor's data is
      written (tensor data bytes, header excluded).
    * `sparse` (tests, dry runs) leaves the tensor data as a hole: zeros, which
      are valid blocks with zero scales. Header, tensor table and file size are
      exact, so a full-depth shape preset can be inspected at no disk cost.
    * `header_only` writes the header and tensor table and no data at all (a few MB for
      any preset): what a forecast reads before the download (shared/hub/shape.py),
      opened with `GGUFFile.from_headers` and the whole file's size (`make_header` returns it).
    * `mtp` adds the NextN/MTP block after the decoder's layers, as llama.cpp's converter
      writes it by default for the families whose checkpoints carry one (qwen35moe;
      shared/gguf/nextn.py): block_count counts it, nextn_predict_layers is 1. Off by
      default: nothing runs it, and the decoder's tensors are the same bytes either way.
    * `_overrides` (tests only) replaces preset fields, e.g. fewer experts or a
      smaller vocab, to check per-expert sizes of a shape preset quickly.

    The file is written to `<out>.part` and renamed when complete.
    """
    arch = _gguf_arch(arch)
    p = _resolve(arch, preset, layers, _overrides)
    override = _parse_quant(quant)
    expert_type = _parse_quant(experts, "--experts")
    vocab = plan_part(arch).vocab(p.vocab_size, p.n_bpe)
    specs = plan_tensors(arch, p, override, expert_type, mtp=mtp)
    total = sum(s.nbytes for s in specs)

    out = output_path(out, arch, preset, layers, quant, seed, experts, mtp)
    part = out.with_name(out.name + ".part")
    _check_writable(out.parent, part)  # a missing folder is made
    free = shutil.disk_usage(out.parent).free
    if not (sparse or header_only) and total > free:
        raise UserError(
            f"{out}: the {arch} {preset} model needs {_size(total)} but only {_size(free)} is free there; use --layers to cut depth"
        )

    w = GGUFWriter(part, arch)
    try:
        _add_metadata(w, arch, preset, p, vocab, override, seed, expert_type, nextn=int(mtp))
        for s in specs:
            w.add_tensor_info(s.name, s.byte_shape, np.dtype(np.uint8), s.nbytes, raw_dtype=s.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if _file_bytes is not None and w.fout is not None:
            _file_bytes.append(_data_end(w.fout[0].tell(), specs, w.data_alignment))
        if header_only:
            specs = []
        elif sparse:
            _leave_data_as_hole(w, specs)
            specs = []
        done = 0
        if progress:
            progress(0, total)
        with ThreadPoolExecutor(max_workers=1) as pool:
            # Generate tensor k+1 while tensor k is being written.
            pending = [pool.submit(_generate, s, seed) for s in specs[:1]]  # the tensor being generated ahead
            for k, s in enumerate(specs):
                data = pending.pop().result()
                if k + 1 < len(specs):
                    pending.append(pool.submit(_generate, specs[k + 1], seed))
                w.write_tensor_data(data)
                done += s.nbytes
                del data
                if progress:
                    progress(done, total)
        w.close()
        os.replace(part, out)
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise
    return out


def output_path(
    out: Path | str,
    arch: str,
    preset: str,
    layers: int | None,
    quant: str | None,
    seed: int,
    experts: str | None = None,
    mtp: bool = False,
) -> Path:
    """The file to write: `out`, or when `out` is a folder (an existing one, or
    a path ending in "/") the default name for these arguments inside it."""
    text = str(out)
    path = Path(out)
    if path.is_dir() or text.endswith(os.sep):
        name = f"{arch}-{preset}" + (f"-L{layers}" if layers else "") + (f"-{quant}" if quant else "")
        name += (f"-exps{experts.upper()}" if experts else "") + ("-mtp" if mtp else "") + f"-seed{seed}.gguf"
        path = path / name
    return path


def _check_writable(folder: Path, part: Path) -> None:
    """The output folder exists (made if need be) and takes a file: one line
    saying which folder is not writable, before any work and before the free
    space check (a pseudo file system like /proc reports 0 bytes free)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        part.open("wb").close()
        part.unlink()
    except OSError as exc:
        raise UserError(f"{folder} is not a writable folder ({exc.strerror or exc}); choose another with -o") from None


def _size(n: int) -> str:
    """Bytes as GB, or MB below 0.1 GB (a tiny model is not "0.0 GB")."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _leave_data_as_hole(w: GGUFWriter, specs: list[TensorSpec]) -> None:
    """Size the file as if every tensor were written, without writing any."""
    if w.fout is None:
        raise RuntimeError("_leave_data_as_hole: the GGUF writer has no open file (call it after the header is written)")
    fout = w.fout[0]
    fout.truncate(_data_end(fout.tell(), specs, w.data_alignment))


def _data_end(header_end: int, specs: list[TensorSpec], alignment: int) -> int:
    """The file's size once every tensor is written after a header ending at `header_end`."""
    return GGUFWriter.ggml_pad(header_end, alignment) + sum(GGUFWriter.ggml_pad(s.nbytes, alignment) for s in specs)


def make_header(arch: str, preset: str, out: Path | str, layers: int | None = None, **kw) -> int:
    """`make_model(..., header_only=True)`: write the header and tensor table of that model to
    `out` (a few MB for any preset); the whole file's size, which the header alone cannot say."""
    sizes: list[int] = []
    make_model(arch, preset, out, layers, header_only=True, _file_bytes=sizes, **kw)
    return sizes[0]


# --- arguments ----------------------------------------------------------------


def _gguf_arch(arch: str) -> str:
    """The GGUF arch of the family `arch` names (its arch or its own name)."""
    family = by_name(arch)
    if family is None:
        raise UserError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")
    return family.arch


def _resolve(arch: str, preset: str, layers: int | None, overrides: dict | None) -> Preset:
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = get_preset(arch, preset)
    if p is None:
        pairs = ", ".join(f"{k} goes with --arch {v}" for k, v in SHAPE_PRESET_ARCH.items())
        raise UserError(f"preset {preset} is not made for arch {arch} ({pairs}; tiny and small go with every arch)")
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise UserError(f"--layers must be a whole number ≥ 1, not {layers!r}")
        p = replace(p, n_layer=layers)
    if overrides:
        p = replace(p, **overrides)
    return p


def _parse_quant(quant: str | None, option: str = "--quant") -> Q | None:
    if quant is None:
        return None
    try:
        return qtype_from_name(quant)
    except ValueError as e:
        raise UserError(f"{option}: {e}") from None


# --- the tensor plan ----------------------------------------------------------


def plan_tensors(arch: str, p: Preset, override: Q | None = None, experts: Q | None = None, *, mtp: bool = False) -> list[TensorSpec]:
    """Every tensor of the model in file order, with its type and how to fill it
    (`experts`: the routed experts' matrices' type over the mix or `override`;
    `mtp`: the NextN/MTP block last, make_model)."""
    part = plan_part(arch)
    n_v = _count_attn_v(part, p)
    v_seen = 0

    def W(name: str, shape: tuple[int, ...], role: str, layer: int = 0) -> TensorSpec:
        nonlocal v_seen
        ne0 = shape[-1]
        qtype = override if override is not None else part.mix(role, layer, p.n_layer, v_seen, n_v)
        option = "--quant"
        if experts is not None and role.endswith("_exps"):
            qtype, option = experts, "--experts"
        v_seen += role == "attn_v"  # llama.cpp's mix counts the attn_v tensors in file order
        fitted = fit_type(qtype, ne0)
        bs = block_format(fitted).block_size
        if ne0 % bs:
            raise UserError(
                f"{option} {qtype.name}: tensor {name} has rows {ne0} wide, not a multiple of {bs}; use a 32-block type such as Q8_0 or Q5_0, or F16"
            )
        return TensorSpec(name, shape, fitted, "weight", 1.0 / float(np.sqrt(ne0)))

    def F(name: str, shape: tuple[int, ...], fill: str) -> TensorSpec:
        return TensorSpec(name, shape, Q.F32, fill, _router_std(part, fill, shape[-1], p.n_layer))

    D, V = p.n_embd, p.vocab_size
    specs = [W("token_embd.weight", (V, D), "embd"), *part.head_tensors(p), F(part.final_norm, (D,), "norm")]
    if not part.tied_head:
        specs.append(W("output.weight", (V, D), "output"))
    for i in range(p.n_layer):
        specs += part.layer(p, i, W, F)
    if mtp:
        block = part.nextn_layer(p, p.n_layer, W, F)
        if not block:
            raise UserError(f"--mtp: llama.cpp's converter writes no NextN/MTP block for {arch}")
        specs += block
    return _with_nvfp4_scales(_shape_stream(part, p, specs))


# NVFP4's block scales are E4M3, whose smallest normal is 2^-6: llama.cpp's converter keeps a
# tensor's blocks in that range with a second-level scale per tensor (per expert for experts),
# its `.scale` sidecar, and writes the activations' `.input_scale` beside it (NVIDIA's
# checkpoints carry both; llama.cpp's CPU graph multiplies by the first only). A made NVFP4
# tensor's blocks hold its values / NVFP4_SCALE, its sidecar NVFP4_SCALE jittered per expert.
NVFP4_SCALE = 2.0**-6
# The layer tensors whose `.scale` llama.cpp's loader reads (llama-model.cpp's generic pass); an
# NVFP4 tensor elsewhere (the embedding, the head, MLA's per-head k_b/v_b, fused gate_up
# experts) is made with its blocks' own scales and no sidecar, so both engines read one model.
_NVFP4_SIDECAR = re.compile(
    r"^blk\.\d+\.(attn_(q|k|v|output|qkv|gate)|ffn_(gate|down|up)(_shexp|_exps)?|ssm_(in|out|alpha|beta)|nextn\.(eh_proj|shared_head_head))\.weight$"
)


def _with_nvfp4_scales(specs: list[TensorSpec]) -> list[TensorSpec]:
    """Each NVFP4 weight llama.cpp reads a sidecar of followed by its `.scale` and
    `.input_scale`, as llama.cpp's converter writes them."""
    out, names = [], {s.name for s in specs}
    for s in specs:
        if s.qtype != Q.NVFP4 or s.fill != "weight" or not _NVFP4_SIDECAR.match(s.name):
            out.append(s)
            continue
        n = s.shape[0] if "_exps." in s.name else 1  # one an expert, or one for the tensor
        scale = scale_sidecar(s.name)
        if scale in names:  # gemma4's per-expert down scale: llama.cpp's loader cannot tell the two apart either
            raise UserError(f"NVFP4: {s.name}'s scale would be named {scale}, a tensor this family has already; use another type for it")
        out += [
            replace(s, param=s.param / NVFP4_SCALE),
            TensorSpec(scale, (n,), Q.F32, "nvfp4_scale", NVFP4_SCALE),
            TensorSpec(s.name.removesuffix(".weight") + ".input_scale", (n,), Q.F32, "ones"),
        ]
    return out


def _count_attn_v(part: PlanPart, p: Preset) -> int:
    """The attn_v tensors of the file: llama.cpp's quant mix gives the first
    few of them more bits, so the mix needs their count before the plan runs."""
    roles: list[str] = []

    def W(name: str, shape: tuple[int, ...], role: str, layer: int = 0) -> TensorSpec:
        roles.append(role)
        return TensorSpec(name, shape, Q.F32, "weight")

    for i in range(p.n_layer):
        part.layer(p, i, W, lambda name, shape, fill: TensorSpec(name, shape, Q.F32, fill))
    return roles.count("attn_v")


# --- routers --------------------------------------------------------------------
#
# A router is W [X, D] (and, gpt-oss, a bias [X]): logits = W·x (+ b) on the
# RMS-normed hidden state x, softmax/top-k on those. The weights are i.i.d.
# Gaussian; what the presets' RouterShape sets is their scale and the bias,
# because in a random model that is what decides how routing moves from
# token to token (measured with bench/bench_routing.py against the phone
# traces, docs/benchmarks.md "Synthetic routing"):
#
# * The hidden state of a random model is mostly two things: the attention's
#   average over the context (it changes little from one token to the next
#   and differs from text to text in nearly every direction, so a fixed W
#   cannot single it out) and the experts' output for this token. A Gaussian
#   W sees them in proportion to their size. In qwen3moe the context average
#   is ~3x the rest, so with unit-spread logits routing freezes per text (LRU
#   hit 95 % where the trace has 74 %) and greedy decoding cycles through a
#   few tokens.
# * The logit scale does not change this layer's top-k, but it changes the
#   gate weights: sharper gates let the top expert's output through nearly
#   whole instead of an average of k that partly cancels, so the token's own
#   signal grows in every later layer and routing turns over as in the trace.
#   The cost is gates sharper than a trained model's (qwen3moe top-1 weight
#   ~0.7, the trace's ~0.3).
# * The context average builds up layer after layer, so a deeper model needs
#   sharper gates for the same turnover: qwen3moe's logit spread is 5 up to
#   8 layers and grows as (n_layer / 8)^0.4 (6.6 at 16, 10.2 at 48), which
#   holds the hit rate at 75-78 % (trace 74 %) at 8, 16 and 48 layers, where
#   a constant 5 drifts to 90 % at 48.
# * gpt-oss's hidden state has little context average (its mean direction
#   is ~0.2 of the state, qwen3moe's ~0.9), so its routing is near-uniform;
#   its router bias carries static per-expert popularity (Gaussian,
#   standardised per layer, so every layer has its own hot experts) and
#   brings the hit rate and the popularity concentration to the trace's.
# * gemma4 has neither lever (no router bias; its expert output is RMS-normed,
#   so gate sharpness does not reach the hidden state): unit-spread logits.
#
# Everything stays plain weight values: llama.cpp computes the same logits.


#
# Cross-layer predictability (shape presets only; presets.RouterShape
# `stream_write`, `first_attn_q`): a trained model's router of layer i+1
# applied to layer i's router input finds ~88 % of layer i+1's experts,
# because each layer adds only a little to a residual stream that carries
# over. In a random model every layer writes as much as the stream already
# holds (the probe of bench/bench_routing.py --cross-layer found 49 % at 8
# layers). Correlating the routers of neighbouring layers would not change
# that: the probe compares one router on two inputs, and what a layer writes
# is random with respect to every router. So the stream is shaped instead:
# layer 0's attention writes it (its context average plus this token's own
# share), every later write is scaled down, and the routers' input norms are
# flat. Layer 0's query scale then sets the share that is this token's own,
# i.e. how fast routing turns over from token to token, which the
# scaled-down later writes cannot.

_STREAM_WRITES = ("attn_output.weight", "attn_output.bias", "ffn_down_exps.weight", "ffn_down_exps.bias")


def _shape_stream(part: PlanPart, p: Preset, specs: list[TensorSpec]) -> list[TensorSpec]:
    """The shape presets' residual stream (see above); other presets' tensors unchanged."""
    shape = part.router
    if p.name in SHARED_PRESETS or not shape.shapes_stream:
        return specs
    if part.router_input_norm is None:
        raise AssertionError(f"stream shaping needs the family's router_input_norm ({type(part).__name__})")
    out = []
    for s in specs:
        parts = s.name.split(".", 2)
        if parts[0] != "blk":
            out.append(s)
            continue
        layer, kind = int(parts[1]), parts[2]
        if kind in _STREAM_WRITES and (layer >= 1 or kind.startswith("ffn_")):
            s = _scaled(s, shape.stream_write)
        elif kind == part.router_input_norm:
            s = replace(s, fill="ones")
        elif kind == "ffn_gate_inp.bias" and shape.shaped_bias_std:
            s = replace(s, param=shape.logit_std_at(p.n_layer) * shape.shaped_bias_std)
        elif layer == 0 and kind in part.first_query:
            s = replace(s, fill="norm_scaled", param=shape.first_attn_q) if s.fill == "norm" else _scaled(s, shape.first_attn_q)
        out.append(s)
    return out


def _scaled(s: TensorSpec, factor: float) -> TensorSpec:
    if s.fill == "weight":
        return replace(s, param=s.param * factor)
    return replace(s, fill="bias_scaled", param=0.02 * factor)  # a bias: "bias" values are 0.02 N(0, 1)


def _router_std(part: PlanPart, fill: str, ne0: int, n_layer: int) -> float:
    """The random values' std for an F32 tensor: routers from the family's RouterShape."""
    shape = part.router
    logit_std = shape.logit_std_at(n_layer)
    if fill == "router":
        return part.router_std(logit_std, ne0)
    if fill == "router_bias":
        return logit_std * shape.bias_std
    return 0.0


# --- tensor data ----------------------------------------------------------------


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """A generator that depends only on (seed, tensor name) — stable across runs and processes."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=16).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


def _generate(s: TensorSpec, seed: int) -> np.ndarray:
    """The tensor's bytes as uint8 shaped `s.byte_shape`."""
    rng = tensor_rng(seed, s.name)
    n = int(np.prod(s.shape))
    if s.fill == "expert_ids":  # deepseek4's hash routing: each token's k distinct experts of param
        rows, k = s.shape
        n_expert = int(s.param)
        step = rng.integers(1, max(1, n_expert // k) + 1, rows)  # (k - 1)·step < n_expert: distinct
        ids = (rng.integers(0, n_expert, rows)[:, None] + np.arange(k)[None, :] * step[:, None]) % n_expert
        return np.ascontiguousarray(ids, np.int32).view(np.uint8).reshape(s.byte_shape)
    if s.fill == "weight":
        fmt = block_format(s.qtype)
        buf = np.empty(s.nbytes, np.uint8)
        per_chunk = max(1, _CHUNK_BYTES // fmt.type_size)  # blocks
        n_blocks = n // fmt.block_size
        for b0 in range(0, n_blocks, per_chunk):
            nb = min(per_chunk, n_blocks - b0)
            buf[b0 * fmt.type_size : (b0 + nb) * fmt.type_size] = random_blocks(s.qtype, nb * fmt.block_size, rng, s.param).reshape(-1)
        return buf.reshape(s.byte_shape)
    if s.fill == "rope_freqs":  # gemma4 "proportional" rope: only the first pairs rotate
        x = np.full(n, 1e30, np.float32)
        x[: int(round(n * s.param))] = 1.0
    elif s.fill in ("norm", "scale"):
        x = 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
    elif s.fill == "norm_scaled":
        x = np.float32(s.param) * (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32))
    elif s.fill == "ones":
        x = np.ones(n, np.float32)
    elif s.fill == "router":
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(s.param)
    elif s.fill == "router_bias":  # standardised: each layer gets exactly the preset's spread
        z = rng.standard_normal(n)
        x = ((z - z.mean()) / max(float(z.std()), 1e-12) * s.param).astype(np.float32)
    elif s.fill == "bias":
        x = 0.02 * rng.standard_normal(n, dtype=np.float32)
    elif s.fill == "bias_scaled":
        x = np.float32(s.param) * rng.standard_normal(n, dtype=np.float32)
    elif s.fill == "sinks":
        x = rng.standard_normal(n, dtype=np.float32)
    elif s.fill == "conv":  # qwen35moe's short conv: a few taps of order 1/√kernel
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(1.0 / np.sqrt(s.shape[-1]))
    elif s.fill == "nvfp4_scale":  # a second-level scale: the blocks' factor, ±30 % an expert
        x = np.float32(s.param) * rng.uniform(0.7, 1.3, n).astype(np.float32)
    elif s.fill == "ssm_a":  # a = -exp(A_log) < 0: per-head decay rates, as trained models spread them
        x = -rng.uniform(0.5, 4.0, n).astype(np.float32)
    else:
        raise AssertionError(s.fill)
    return np.ascontiguousarray(x, np.float32).view(np.uint8).reshape(s.byte_shape)


# --- metadata -------------------------------------------------------------------

_FILE_TYPE = {
    Q.F32: "ALL_F32",
    Q.F16: "MOSTLY_F16",
    Q.BF16: "MOSTLY_BF16",
    Q.Q4_0: "MOSTLY_Q4_0",
    Q.Q4_1: "MOSTLY_Q4_1",
    Q.Q5_0: "MOSTLY_Q5_0",
    Q.Q5_1: "MOSTLY_Q5_1",
    Q.Q8_0: "MOSTLY_Q8_0",
    Q.Q2_K: "MOSTLY_Q2_K",
    Q.Q3_K: "MOSTLY_Q3_K_S",
    Q.Q4_K: "MOSTLY_Q4_K_S",
    Q.Q5_K: "MOSTLY_Q5_K_S",
    Q.Q6_K: "MOSTLY_Q6_K",
    Q.IQ4_NL: "MOSTLY_IQ4_NL",
    Q.IQ4_XS: "MOSTLY_IQ4_XS",
    Q.MXFP4: "MOSTLY_MXFP4_MOE",
    Q.NVFP4: "MOSTLY_NVFP4",
    Q.IQ2_XXS: "MOSTLY_IQ2_XXS",
    Q.IQ2_XS: "MOSTLY_IQ2_XS",
    Q.IQ2_S: "MOSTLY_IQ2_S",
    Q.IQ3_XXS: "MOSTLY_IQ3_XXS",
    Q.IQ3_S: "MOSTLY_IQ3_S",
    Q.IQ1_S: "MOSTLY_IQ1_S",
    Q.IQ1_M: "MOSTLY_IQ1_M",
}


def chat_template(arch: str) -> str:
    """The chat template made models of this family carry (its plan part's)."""
    return plan_part(arch).chat_template()


def _add_metadata(
    w: GGUFWriter,
    arch: str,
    preset: str,
    p: Preset,
    v: Vocab,
    override: Q | None,
    seed: int,
    experts: Q | None = None,
    nextn: int = 0,
) -> None:
    part = plan_part(arch)
    mix = override.name if override is not None else part.mix_name
    w.add_name(f"moe-pipe made {arch} {preset}")
    exps = f", experts {experts.name}" if experts is not None else ""
    w.add_description(f"random weights (seed {seed}), not a trained model; made by moe-pipe make-model, quant {mix}{exps}")
    named = _FILE_TYPE.get(override) if override is not None else None
    ftype = "MOSTLY_Q4_K_M" if mix == "Q4_K_M" else "MOSTLY_MXFP4_MOE" if mix == "MXFP4_MOE" else named
    if experts is not None:  # the experts are most of the file: llama.cpp's file type names theirs (unsloth's UD files do)
        ftype = _FILE_TYPE.get(experts)
    if ftype:
        w.add_file_type(int(LlamaFileType[ftype]))
    w.add_quantization_version(2)

    w.add_context_length(p.context_length)
    w.add_embedding_length(p.n_embd)
    w.add_block_count(p.n_layer + nextn)  # llama.cpp's converter counts the NextN/MTP block in it
    if "feed_forward_length" in part.width_keys:
        w.add_feed_forward_length(p.n_ff)
    if "expert_feed_forward_length" in part.width_keys:
        w.add_expert_feed_forward_length(p.n_ff_exp)
    w.add_expert_count(p.n_expert)
    w.add_expert_used_count(p.n_expert_used)
    w.add_head_count(p.n_head)
    w.add_layer_norm_rms_eps(p.rms_eps)
    w.add_rope_freq_base(p.rope_base)
    part.attention_metadata(w, p, nextn)
    part.metadata(w, p)
    if nextn or part.nextn_key_always:
        w.add_nextn_predict_layers(nextn)

    w.add_tokenizer_model(v.model)
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(list(v.tokens))
    w.add_token_types([int(t) for t in v.types])
    if v.merges:  # a SentencePiece (llama) vocab has scores instead
        w.add_token_merges(list(v.merges))
    if v.scores:
        w.add_token_scores(list(v.scores))
    w.add_bos_token_id(v.bos)
    w.add_eos_token_id(v.eos)
    w.add_pad_token_id(v.pad)
    if v.unk is not None:
        w.add_unk_token_id(v.unk)
    if v.eot is not None:  # glm4moe: llama.cpp ends generation on these too
        w.add_eot_token_id(v.eot)
    if v.eom is not None:
        w.add_eom_token_id(v.eom)
    w.add_add_bos_token(v.add_bos)
    if v.add_eos is not None:
        w.add_add_eos_token(v.add_eos)
    if part.add_space_prefix is not None:
        w.add_add_space_prefix(part.add_space_prefix)
    w.add_chat_template(part.chat_template())
