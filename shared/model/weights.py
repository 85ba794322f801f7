"""Weights as the forward pass sees them: matrices that multiply on their
quantized bytes, small F32 vectors as numpy arrays, and experts per layer.

Where the bytes come from is not this module's business: `Weights` serves
dense tensors from the file mapping, and an `ExpertSource` hands out experts
(from the file here; from the shared-memory cache in the streaming pipeline).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np

from .. import quant
from ..errors import GGUFError
from ..gguf.layout import LayerExperts, scale_sidecar
from ..gguf.model_file import ModelFile

_VECTOR_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class QWeight:
    """A [R, C] matrix held as raw GGUF blocks; multiplies without dequantizing."""

    qtype: quant.QType
    data: np.ndarray  # uint8 [R, row_bytes] (or the native float dtype for F32/F16)
    shape: tuple[int, int]  # (R, C)
    scale: float = 1.0  # the second-level scale of an NVFP4 tensor (its `.scale` sidecar): products × scale
    prep: quant.Prepared = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "prep", quant.prepare(self.qtype, self.data, self.scale))  # checked once, not per call

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [T, C] → [T, R] (x [C] → [R])."""
        if x.ndim == 1:
            return quant.apply(self.prep, x.reshape(1, -1))[0]
        return quant.apply(self.prep, x)

    def rows(self, ids) -> np.ndarray:
        rows = quant.dequantize_rows(self.qtype, self.data, ids)
        if self.scale != 1.0:
            rows *= np.float32(self.scale)
        return rows


def _as_matrix(name: str, qtype, view: np.ndarray, shape: tuple[int, ...], scale: float = 1.0) -> QWeight:
    # math.prod: numpy's costs ~10 µs on a tuple, and the pipeline's cache views an expert's
    # three matrices for every miss (an expert view took ~71 µs with it, ~41 without).
    rows = math.prod(shape[:-1])
    # A plain ndarray view: numpy's memmap subclass costs a Python call per slice.
    data = np.asarray(view).reshape(rows, -1)
    return QWeight(quant.QType(int(qtype)), data, (rows, shape[-1]), scale)


@dataclass(frozen=True)
class Expert:
    """One routed expert's weights: gate/up (or fused gate_up, gate rows first),
    down, and the biases of the architectures that have them (gpt-oss)."""

    id: int
    down: QWeight
    gate: QWeight | None = None
    up: QWeight | None = None
    gate_up: QWeight | None = None
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    gate_up_bias: np.ndarray | None = None  # [2F], gate's first: ffn_gate_up_exps.bias
    down_bias: np.ndarray | None = None

    def gate_and_up(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """gate·x and up·x, biases added, [n, F] each, from whichever layout
        the file stores: the layout check (shared/gguf/layout.py) lets any
        architecture's file have either, so every architecture reads both."""
        if self.gate_up is not None:
            gu = self.gate_up(x)  # [n, 2F]
            if self.gate_up_bias is not None:
                gu += self.gate_up_bias
            f = gu.shape[1] // 2
            return gu[:, :f], gu[:, f:]
        if self.gate is None or self.up is None:
            raise ValueError(f"expert {self.id} has neither gate_up nor gate and up weights")
        g, u = self.gate(x), self.up(x)
        if self.gate_bias is not None:
            g += self.gate_bias
        if self.up_bias is not None:
            u += self.up_bias
        return g, u


_EXPERT_PARTS = frozenset(f.name for f in fields(Expert)) - {"id"}


class ExpertSource(Protocol):
    """Where a model's routed experts come from: the one plug-in point between
    the forward pass and storage. `FileExperts` reads the file mapping (the
    resident reference); the pipeline's compute process plugs in its
    shared-memory slab cache (procs/compute.py `SlabExperts`). A source
    implements all three methods; one that never reads on demand answers
    `resident` with all True and ignores `prefetch`."""

    # How many experts of one `experts` call stay usable together: the first this many
    # yielded may be kept and multiplied after later ones have come (a prompt takes the
    # experts in memory several a kernel call: shared/model/moe.py). A cache smaller than
    # a layer's experts reuses the slab of an expert already given for a later one.
    # Read only: the slab cache's changes as its loans are taken back and lent again.
    @property
    def held_together(self) -> int: ...

    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[Expert]:
        """Yield each requested expert of `layer` exactly once, in the order
        they become usable (the MoE block sums in choice order, so the order
        never changes the result)."""
        ...

    def resident(self, layer: int, ids: Sequence[int]) -> list[bool]:
        """For each of `ids`, whether that expert of `layer` is in memory now
        (asking for it costs no read). Read by the lossy levers
        (shared/model/levers.py) and by route traces; changes nothing."""
        ...

    def prefetch(self, layer: int, ids: Sequence[int]) -> None:
        """A guess, made while layer-1 computes, at the experts the next
        `experts(layer, ...)` call will ask for, best first, so their reads can
        start early. A hint: it may be ignored and outputs never depend on it."""
        ...


def expert_from_bytes(layer: LayerExperts, expert_id: int, slices: dict[str, np.ndarray]) -> Expert:
    """Build an Expert from each part's bytes (uint8, one expert's share)."""
    matrices: dict[str, QWeight] = {}
    biases: dict[str, np.ndarray] = {}
    for part in layer.parts:
        raw = slices[part.name]
        if part.name.endswith("_bias"):
            biases[part.name] = raw.view(np.float32)
        else:
            scale = part.scales[expert_id] if part.scales else 1.0
            matrices[part.name] = _as_matrix(part.tensor.name, part.tensor.qtype, raw.view(np.uint8), part.shape, scale)
    # Every part the layout accepts (shared/gguf/layout.py) has a field here;
    # one it learns later must get a field too, not be dropped without a word.
    unknown = (matrices.keys() | biases.keys()) - _EXPERT_PARTS
    if unknown:
        raise ValueError(f"layer {layer.layer}: expert parts {sorted(unknown)} have no Expert field")
    return Expert(
        expert_id,
        matrices["down"],
        gate=matrices.get("gate"),
        up=matrices.get("up"),
        gate_up=matrices.get("gate_up"),
        gate_bias=biases.get("gate_bias"),
        up_bias=biases.get("up_bias"),
        gate_up_bias=biases.get("gate_up_bias"),
        down_bias=biases.get("down_bias"),
    )


class FileExperts:
    """Every expert read straight from the file mapping: all weights resident,
    so nothing to prefetch (an ExpertSource)."""

    held_together = sys.maxsize  # views of the file mapping: every one stays usable

    def __init__(self, mf: ModelFile, layers: Sequence[LayerExperts] | None = None):
        """`layers`: the layers it serves, by default the decoder's (the layout's); the
        NextN/MTP drafter passes its block's (shared/gguf/layout.py nextn_layer_experts)."""
        self._mf = mf
        self._layers = {lay.layer: lay for lay in (mf.layout.layers if layers is None else layers)}
        self._experts: dict[tuple[int, int], Expert] = {}  # views only: built once, kept

    def _slice(self, part, expert_id: int) -> np.ndarray:
        view = np.asarray(self._mf.gguf.view(part.tensor.name))  # [E, ...] native or uint8 rows
        return view[expert_id].reshape(-1).view(np.uint8)

    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[Expert]:
        lay = self._layers[layer]
        for e in ids:
            key = (layer, int(e))
            expert = self._experts.get(key)
            if expert is None:
                expert = self._experts[key] = expert_from_bytes(lay, key[1], {p.name: self._slice(p, key[1]) for p in lay.parts})
            yield expert

    def resident(self, layer: int, ids: Sequence[int]) -> list[bool]:
        return [True] * len(ids)  # the file mapping holds them all: the levers change nothing here

    def prefetch(self, layer: int, ids: Sequence[int]) -> None:
        """Nothing to read ahead: every expert is already mapped."""


class Weights:
    """Dense tensors by GGUF name: matrices as QWeight, vectors as float32 arrays.

    `view(name)` gives a tensor's bytes as gguf-py shapes them; by default the
    file mapping, or (dense_weights = anon) the same array inside the dense
    shared-memory arena.
    """

    def __init__(self, mf: ModelFile, view: Callable[[str], np.ndarray] | None = None):
        self.mf = mf
        self.view = view or mf.gguf.view
        self._matrices: dict[str, QWeight] = {}
        self._vectors: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self.mf.gguf.tensors

    def matrix(self, name: str) -> QWeight:
        w = self._matrices.get(name)
        if w is None:
            t = self.mf.gguf.tensor(name)
            if len(t.shape) != 2:
                raise GGUFError(self.mf.gguf.path, f"tensor {name!r} should be a matrix, has shape {list(t.shape)}")
            try:
                quant.block_format(t.qtype)
            except ValueError as exc:
                raise GGUFError(self.mf.gguf.path, f"tensor {name!r}: {exc}") from None
            w = self._matrices[name] = _as_matrix(name, t.qtype, self.view(name), t.shape, self.scale_of(name))
        return w

    def scale_of(self, name: str) -> float:
        """An NVFP4 weight tensor's second-level scale (`scale_sidecar`), 1 when the file has
        none. Other types have none: a family's own tensor may have the sidecar's name (gemma4's
        router `ffn_gate_inp.scale` is its input's scale, a vector; llama.cpp's loader has the
        same clash, and its converter writes the sidecar for NVFP4 tensors only)."""
        sidecar = scale_sidecar(name)
        if self.mf.gguf.tensor(name).qtype != quant.QType.NVFP4 or not self.has(sidecar):
            return 1.0
        v = self.vector(sidecar)
        if v.size != 1:
            raise GGUFError(self.mf.gguf.path, f"tensor {sidecar!r} should hold one scale, has shape {list(v.shape)}")
        return float(v.reshape(-1)[0])

    def vector(self, name: str) -> np.ndarray:
        v = self._vectors.get(name)
        if v is None:
            t = self.mf.gguf.tensor(name)
            if t.qtype.name not in _VECTOR_TYPES:
                raise GGUFError(self.mf.gguf.path, f"tensor {name!r} is {t.qtype.name}; norms, biases and scales must be F32/F16/BF16")
            raw = np.asarray(self.view(name))
            if t.qtype.name == "BF16":
                raw = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            v = self._vectors[name] = np.ascontiguousarray(raw, dtype=np.float32).reshape(t.shape)
        return v

    def optional_vector(self, name: str) -> np.ndarray | None:
        return self.vector(name) if self.has(name) else None
