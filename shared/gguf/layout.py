"""The byte-range map: where every expert lives in the file, and what is dense.

Routed experts are stored stacked, one 3-D tensor per projection per layer
(ggml ne = [in, out, E], numpy (E, out, in)), so expert e of a tensor is the
contiguous slab [base + e·stride, base + (e+1)·stride) with stride = out ×
row_bytes. Biases (gpt-oss) are (E, n) F32 and slice the same way. An
expert's bytes are therefore 2–6 separate extents (gate/up/down or the fused
gate_up/down, plus biases), one per tensor; they are never adjacent.

    shard file:  | header | kv | tensor infos |pad| data section ............ |
    data section:   [dense][gate_exps: e0|e1|…|eE-1][dense][up_exps: …][down…]
                             └ expert 1 of this layer = 1 slab here + 1 in up + 1 in down

The dense set is the complement of the expert tensors inside each shard's
data section (it includes alignment padding between tensors, which costs a
few bytes and saves many small reads). O_DIRECT needs reads aligned to the
machine's I/O alignment (`Layout.align`: the page size or the device's
block, shared/gguf/alignment.py), and tensor starts are only 32-aligned:
`aligned()` gives the rounded superset of an extent and where the wanted
bytes sit inside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import GGUFError
from .alignment import io_alignment
from .nextn import nextn_tensor_names
from .reader import GGUFFile, TensorInfo
from .spec import ModelSpec

_EXPERT_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate_up|gate|up|down)_exps\.(?P<kind>weight|bias)$")
# Read order inside one expert: the order the forward pass needs them.
_PART_ORDER = ("gate_up", "gate", "up", "down")


@dataclass(frozen=True)
class Extent:
    shard: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ExpertPart:
    """One tensor's share of every expert of a layer: expert e = base + e·stride."""

    name: str  # gate | up | down | gate_up, with "_bias" for biases
    tensor: TensorInfo
    shape: tuple[int, ...]  # one expert's numpy shape: (out, in) or (n,) for a bias
    stride: int  # bytes per expert
    # Each expert's second-level scale (an NVFP4 tensor's `.scale` sidecar, one float an expert,
    # which multiplies its products); () when the file has none, or has only its header here.
    scales: tuple[float, ...] = ()

    def extent(self, expert: int) -> Extent:
        return Extent(self.tensor.shard, self.tensor.offset + expert * self.stride, self.stride)


@dataclass(frozen=True)
class LayerExperts:
    layer: int
    parts: tuple[ExpertPart, ...]

    @property
    def expert_bytes(self) -> int:
        return sum(p.stride for p in self.parts)

    def extents(self, expert: int) -> tuple[Extent, ...]:
        return tuple(p.extent(expert) for p in self.parts)

    def part(self, name: str) -> ExpertPart | None:
        return next((p for p in self.parts if p.name == name), None)


def aligned(extent: Extent, align: int) -> tuple[int, int, int]:
    """(start, length, skip): the `align`-rounded read that covers `extent`;
    the wanted bytes are [skip, skip + extent.length) of what it returns."""
    start = extent.offset // align * align
    end = -(-extent.end // align) * align
    return start, end - start, extent.offset - start


def aligned_bytes(extents: tuple[Extent, ...], align: int) -> int:
    """Bytes a slab needs to hold `extents` read `align`-rounded, one after another."""
    return sum(aligned(e, align)[1] for e in extents)


@dataclass(frozen=True)
class Layout:
    spec: ModelSpec
    layers: tuple[LayerExperts, ...]
    dense: tuple[Extent, ...]  # merged, sorted by (shard, offset)
    dense_bytes: int  # exact bytes of the non-expert tensors
    expert_tensor_names: frozenset[str]
    align: int  # the I/O alignment every read and slab is rounded to (shared/gguf/alignment.py)
    # The NextN/MTP block's tensors (shared/gguf/nextn.py): in the file, in neither the dense set nor the experts.
    nextn_tensor_names: frozenset[str] = frozenset()
    nextn_bytes: int = 0
    # Tensors read a few rows a token from the file (`by_row_tensors`): not in the dense set either.
    row_tensor_names: frozenset[str] = frozenset()
    row_bytes: int = 0

    def expert_extents(self, layer: int, expert: int) -> tuple[Extent, ...]:
        if not 0 <= expert < self.spec.n_expert:
            raise IndexError(f"expert {expert} out of range 0..{self.spec.n_expert - 1}")
        return self.layers[layer].extents(expert)

    def expert_bytes(self, layer: int) -> int:
        return self.layers[layer].expert_bytes

    @property
    def max_expert_bytes(self) -> int:
        return max(l.expert_bytes for l in self.layers)

    @property
    def total_expert_bytes(self) -> int:
        return sum(l.expert_bytes for l in self.layers) * self.spec.n_expert

    def routed_bytes_per_token(self, top_k: int | None = None) -> int:
        k = self.spec.n_expert_used if top_k is None else top_k
        return sum(l.expert_bytes for l in self.layers) * k

    @property
    def slab_bytes(self) -> int:
        """The cache slab size: the largest `align`-rounded expert in the file (a multiple of `align`)."""
        return max(aligned_bytes(l.extents(e), self.align) for l in self.layers if l.parts for e in range(self.spec.n_expert))

    def min_cache_bytes(self, top_k: int | None = None) -> int:
        """One token's working set: every MoE layer's top-k experts, in slabs."""
        k = self.spec.n_expert_used if top_k is None else top_k
        return len(self.spec.moe_layers) * k * self.slab_bytes


def _expected_shape(spec: ModelSpec, proj: str, kind: str) -> tuple[int, ...]:
    ff, d = spec.n_ff_exp, spec.n_embd
    out_in = {"gate": (ff, d), "up": (ff, d), "gate_up": (2 * ff, d), "down": (d, ff)}[proj]
    return out_in if kind == "weight" else out_in[:1]


def _expert_part(f: GGUFFile, spec: ModelSpec, t: TensorInfo, proj: str, kind: str) -> ExpertPart:
    from ..quant.blocks import FORMATS  # lazy: the quant package brings numba with it

    want = _expected_shape(spec, proj, kind)
    if len(t.shape) != len(want) + 1 or t.shape[0] != spec.n_expert:
        raise GGUFError(f.path, f"tensor {t.name!r} has shape {list(t.shape)} (numpy order) but the model has {spec.n_expert} experts")
    if t.shape[1:] != want:
        raise GGUFError(f.path, f"tensor {t.name!r} has per-expert shape {list(t.shape[1:])}, expected {list(want)} from the metadata")
    # Checked here, not when the expert is first routed: there it would fail
    # inside the compute process, again after every restart.
    if kind == "bias" and t.qtype != GGMLQuantizationType.F32:
        raise GGUFError(f.path, f"tensor {t.name!r} is {t.qtype.name}; expert biases must be F32")
    if t.qtype not in FORMATS:
        raise GGUFError(
            f.path,
            f"tensor {t.name!r} is {t.qtype.name}, which moe-pipe cannot compute on (supported: {', '.join(q.name for q in FORMATS)})",
        )
    stride = t.nbytes // spec.n_expert
    name = proj if kind == "weight" else f"{proj}_bias"
    return ExpertPart(name, t, t.shape[1:], stride, _expert_scales(f, spec, t) if kind == "weight" else ())


def scale_sidecar(name: str) -> str:
    """The name of an NVFP4 weight tensor's second-level scale (`blk.0.attn_q.weight` →
    `blk.0.attn_q.scale`), as llama.cpp's converter writes it: one float, or one an expert
    for a routed experts' tensor, that multiplies the products."""
    return name.removesuffix(".weight") + ".scale"


def _expert_scales(f: GGUFFile, spec: ModelSpec, t: TensorInfo) -> tuple[float, ...]:
    """The experts' second-level scales of NVFP4 tensor t from its `.scale` sidecar ([n_expert]
    F32, as llama.cpp's converter writes it), () without one or for another type (whose
    `.scale` would be a family's own tensor). Read here, once: a few bytes every process that
    views an expert needs."""
    sidecar = scale_sidecar(t.name)
    s = f.tensors.get(sidecar)
    if s is None or t.qtype != GGMLQuantizationType.NVFP4:
        return ()
    if s.qtype != GGMLQuantizationType.F32 or tuple(s.shape) != (spec.n_expert,):
        raise GGUFError(f.path, f"tensor {sidecar!r} is {s.qtype.name} {list(s.shape)}; expert scales must be F32 [{spec.n_expert}]")
    if f.header_only:
        return ()
    return tuple(float(v) for v in np.asarray(f.view(sidecar), np.float32).reshape(-1))


# The token embedding: a token reads its one row, so a table of vocabulary × width (167 MiB on
# qwen30b-shape, ~600 on gpt-oss-120b's 201k vocabulary in Q8_0) kept whole in RAM holds
# memory the expert cache would turn into hits. Untied only: a tied one is also the output
# head, which every token reads whole.
EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"


def by_row_tensors(f: GGUFFile, spec: ModelSpec) -> frozenset[str]:
    """Tensors the model reads a few rows at a time, read from the file as their rows are
    used rather than kept in the dense set: the token embedding when the output head is its own."""
    untied = OUTPUT in f.tensors and not spec.tied_output  # the head the model takes (shared/model/base.py)
    return frozenset({EMBEDDING}) if EMBEDDING in f.tensors and untied else frozenset()


def unused_tensors(f: GGUFFile, spec: ModelSpec) -> frozenset[str]:
    """Tensors of the blocks after the decoder's layers that the file counts in block_count
    but nothing runs (the NextN/MTP block, shared/gguf/nextn.py, as llama.cpp by default): never read."""
    return nextn_tensor_names(f, spec)


def _layer_parts(f: GGUFFile, spec: ModelSpec) -> tuple[list[list[ExpertPart]], set[str]]:
    parts: list[list[ExpertPart]] = [[] for _ in range(spec.n_layer)]
    names: set[str] = set()
    skip = unused_tensors(f, spec)
    for t in f.tensors.values():
        m = _EXPERT_TENSOR.match(t.name)
        if not m or t.name in skip:
            continue
        layer = int(m["layer"])
        if layer >= spec.n_layer:
            raise GGUFError(f.path, f"tensor {t.name!r} is in layer {layer} but the model has {spec.n_layer} layers")
        part = _expert_part(f, spec, t, m["proj"], m["kind"])
        twin = next((p for p in parts[layer] if p.name == part.name), None)
        if twin is not None:  # "blk.1." and "blk.01." are both layer 1: one would shadow the other's bytes
            raise GGUFError(f.path, f"tensors {twin.tensor.name!r} and {t.name!r} are both layer {layer}'s {part.name} experts")
        parts[layer].append(part)
        names.add(t.name)
    return parts, names


def nextn_layer_experts(f: GGUFFile, spec: ModelSpec) -> tuple[LayerExperts, ...]:
    """The routed experts of the NextN/MTP blocks (shared/gguf/nextn.py), mapped and checked
    as build_layout maps the decoder's: for the drafter that runs them through the file
    mapping (shared/model/mtp.py); the layout itself leaves them out."""
    out = []
    for j in range(spec.n_layer, spec.n_layer + spec.n_layer_nextn):
        parts = [
            _expert_part(f, spec, t, m["proj"], m["kind"])
            for t in f.tensors.values()
            if (m := _EXPERT_TENSOR.match(t.name)) and int(m["layer"]) == j
        ]
        _check_complete(f, spec, j, parts)
        out.append(LayerExperts(j, tuple(sorted(parts, key=_sort_key))))
    return tuple(out)


def _check_complete(f: GGUFFile, spec: ModelSpec, layer: int, parts: list[ExpertPart]) -> None:
    have = {p.name for p in parts}
    if not ({"gate", "up", "down"} <= have or {"gate_up", "down"} <= have):
        raise GGUFError(f.path, f"layer {layer} lacks expert tensors: has {sorted(have) or 'none'}, needs gate+up+down or gate_up+down")
    if "gate_up" in have and ("gate" in have or "up" in have):
        raise GGUFError(f.path, f"layer {layer} has both fused gate_up and separate gate/up expert tensors")
    # Biases go with the architecture: a missing one is a None in the expert
    # arithmetic, an extra one bytes read for nothing and a model not computed as trained.
    biases = {n for n in have if n.endswith("_bias")}
    wanted = {f"{n}_bias" for n in have - biases} if spec.expert_bias else set()
    if biases != wanted:
        problem = (
            f"lacks {sorted(wanted - biases)}" if wanted - biases else f"has {sorted(biases - wanted)}, which {spec.arch} does not use"
        )
        raise GGUFError(f.path, f"layer {layer} expert biases: {problem}")


def _sort_key(p: ExpertPart) -> tuple[int, int]:
    base = p.name.removesuffix("_bias")
    return _PART_ORDER.index(base), int(p.name.endswith("_bias"))


def _dense_extents(f: GGUFFile, expert_names: set[str]) -> tuple[Extent, ...]:
    out: list[Extent] = []
    for shard in range(len(f.paths)):
        experts = sorted((t for t in f.tensors.values() if t.shard == shard and t.name in expert_names), key=lambda t: t.offset)
        cursor, end = f.data_start(shard), f.file_sizes[shard]
        for t in experts:
            if t.offset > cursor:
                out.append(Extent(shard, cursor, t.offset - cursor))
            cursor = max(cursor, t.end)
        if end > cursor:
            out.append(Extent(shard, cursor, end - cursor))
    return tuple(out)


def build_layout(f: GGUFFile, spec: ModelSpec, align: int | None = None) -> Layout:
    """The byte-range map. `align`: the I/O alignment another process resolved
    (a child passes its parent's); None resolves it here, from this machine."""
    if align is None:
        align = io_alignment(f.paths).value
    elif align <= 0 or align & (align - 1):
        raise ValueError(f"I/O alignment {align} is not a power of two")
    parts, names = _layer_parts(f, spec)
    layers = []
    for i, layer_parts in enumerate(parts):
        if not spec.has_experts(i):  # a leading dense layer: nothing to stream
            if layer_parts:
                raise GGUFError(
                    f.path, f"layer {i} is a dense layer (leading_dense_block_count {spec.n_dense_lead}) but has expert tensors"
                )
            layers.append(LayerExperts(i, ()))
            continue
        _check_complete(f, spec, i, layer_parts)
        layers.append(LayerExperts(i, tuple(sorted(layer_parts, key=_sort_key))))
    unused = unused_tensors(f, spec)  # neither streamed nor in the dense set
    rows = by_row_tensors(f, spec)  # read by row from the file
    outside = names | unused | rows  # every tensor not in the dense set
    dense_bytes = sum(t.nbytes for t in f.tensors.values() if t.name not in outside)
    nextn_bytes = sum(f.tensors[n].nbytes for n in unused)
    row_bytes = sum(f.tensors[n].nbytes for n in rows)
    extents = _dense_extents(f, outside)
    return Layout(spec, tuple(layers), extents, dense_bytes, frozenset(names), align, unused, nextn_bytes, rows, row_bytes)
