"""Weights as the forward pass sees them: matrices that multiply on their
quantized bytes, small F32 vectors as numpy arrays, and experts per layer.

Where the bytes come from is not this module's business: `Weights` serves
dense tensors from the file mapping, and an `ExpertSource` hands out experts
(from the file here; from the shared-memory cache in the streaming pipeline).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from moe_pipe.shared import quant
from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.layout import LayerExperts
from moe_pipe.shared.gguf.model_file import ModelFile

_VECTOR_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class QWeight:
    """A [R, C] matrix held as raw GGUF blocks; multiplies without dequantizing."""

    qtype: quant.QType
    data: np.ndarray  # uint8 [R, row_bytes] (or the native float dtype for F32/F16)
    shape: tuple[int, int]  # (R, C)
    prep: quant.Prepared = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "prep", quant.prepare(self.qtype, self.data))  # checked once, not per call

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [T, C] → [T, R] (x [C] → [R])."""
        if x.ndim == 1:
            return quant.apply(self.prep, x.reshape(1, -1))[0]
        return quant.apply(self.prep, x)

    def rows(self, ids) -> np.ndarray:
        return quant.dequantize_rows(self.qtype, self.data, ids)


def _as_matrix(name: str, qtype, view: np.ndarray, shape: tuple[int, ...]) -> QWeight:
    rows = int(np.prod(shape[:-1]))
    # A plain ndarray view: numpy's memmap subclass costs a Python call per slice.
    data = np.asarray(view).reshape(rows, -1)
    return QWeight(quant.QType(int(qtype)), data, (rows, shape[-1]))


@dataclass(frozen=True)
class Expert:
    """One routed expert's weights: gate/up (or fused gate_up), down, optional biases."""

    id: int
    down: QWeight
    gate: QWeight | None = None
    up: QWeight | None = None
    gate_up: QWeight | None = None
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None


class ExpertSource(Protocol):
    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[Expert]:
        """Yield each requested expert once, in the order they become usable."""


def expert_from_bytes(layer: LayerExperts, expert_id: int, slices: dict[str, np.ndarray]) -> Expert:
    """Build an Expert from each part's bytes (uint8, one expert's share)."""
    fields: dict[str, object] = {}
    for part in layer.parts:
        raw = slices[part.name]
        if part.name.endswith("_bias"):
            fields[part.name] = raw.view(np.float32)
        else:
            fields[part.name] = _as_matrix(part.tensor.name, part.tensor.qtype, raw.view(np.uint8), part.shape)
    return Expert(expert_id, **fields)


class FileExperts:
    """Every expert read straight from the file mapping (all weights resident)."""

    def __init__(self, mf: ModelFile):
        self._mf = mf
        self._experts: dict[tuple[int, int], Expert] = {}  # views only: built once, kept

    def _slice(self, part, expert_id: int) -> np.ndarray:
        view = np.asarray(self._mf.gguf.view(part.tensor.name))  # [E, ...] native or uint8 rows
        return view[expert_id].reshape(-1).view(np.uint8)

    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[Expert]:
        lay = self._mf.layout.layers[layer]
        for e in ids:
            key = (layer, int(e))
            expert = self._experts.get(key)
            if expert is None:
                expert = self._experts[key] = expert_from_bytes(lay, key[1], {p.name: self._slice(p, key[1]) for p in lay.parts})
            yield expert


class Weights:
    """Dense tensors by GGUF name: matrices as QWeight, vectors as float32 arrays.

    `view(name)` gives a tensor's bytes as gguf-py shapes them; by default the
    file mapping, or (dense_weights = anon) the same array inside the dense
    shared-memory arena.
    """

    def __init__(self, mf: ModelFile, view: Callable[[str], np.ndarray] | None = None):
        self.mf = mf
        self.view = view or mf.gguf.view
        self._cache: dict[str, object] = {}

    def has(self, name: str) -> bool:
        return name in self.mf.gguf.tensors

    def matrix(self, name: str) -> QWeight:
        w = self._cache.get(name)
        if w is None:
            t = self.mf.gguf.tensor(name)
            if len(t.shape) != 2:
                raise GGUFError(self.mf.gguf.path, f"tensor {name!r} should be a matrix, has shape {list(t.shape)}")
            try:
                quant.block_format(t.qtype)
            except ValueError as exc:
                raise GGUFError(self.mf.gguf.path, f"tensor {name!r}: {exc}") from None
            w = self._cache[name] = _as_matrix(name, t.qtype, self.view(name), t.shape)
        return w

    def vector(self, name: str) -> np.ndarray:
        v = self._cache.get(name)
        if v is None:
            t = self.mf.gguf.tensor(name)
            if t.qtype.name not in _VECTOR_TYPES:
                raise GGUFError(self.mf.gguf.path, f"tensor {name!r} is {t.qtype.name}; norms, biases and scales must be F32/F16/BF16")
            raw = np.asarray(self.view(name))
            if t.qtype.name == "BF16":
                raw = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            v = self._cache[name] = np.ascontiguousarray(raw, dtype=np.float32).reshape(t.shape)
        return v

    def optional_vector(self, name: str) -> np.ndarray | None:
        return self.vector(name) if self.has(name) else None
