"""A model file opened for use: the GGUF, its spec (read by its family's GGUF
part, its tensors checked against it) and its byte-range map."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .layout import Layout, build_layout
from .nextn import check_nextn
from .reader import GGUFFile
from .spec import ModelSpec, check_rope, spec_part
from .spec_tensors import check_tensors


@dataclass(frozen=True)
class ModelFile:
    gguf: GGUFFile
    spec: ModelSpec
    layout: Layout

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def quant_types(self) -> dict[str, dict[str, int]]:
        """Tensor counts per ggml type, split into expert and dense tensors (the NextN/MTP
        block's, which are neither, not counted)."""
        experts: Counter[str] = Counter()
        dense: Counter[str] = Counter()
        for t in self.gguf.tensors.values():
            if t.name in self.layout.nextn_tensor_names:
                continue
            (experts if t.name in self.layout.expert_tensor_names else dense)[t.qtype.name] += 1
        return {"experts": dict(sorted(experts.items())), "dense": dict(sorted(dense.items()))}


def read_spec(f: GGUFFile) -> ModelSpec:
    """The file's spec from its family's reader (shared/families/<family>/spec.py),
    its tensors checked against it (spec_tensors.py), and its NextN/MTP block's (nextn.py)."""
    part = spec_part(f)
    spec = part.read(f)
    check_rope(f, spec)
    check_tensors(f, spec, part)
    check_nextn(f, spec)
    return spec


def open_model(path: str | os.PathLike, align: int | None = None) -> ModelFile:
    """Open and validate a GGUF model (one file or any shard of a split set).
    `align`: the I/O alignment the parent resolved (a child's config carries
    it); None resolves it from this machine (shared/gguf/alignment.py)."""
    f = GGUFFile(path)
    try:
        spec = read_spec(f)
        return ModelFile(f, spec, build_layout(f, spec, align))
    except BaseException:
        f.close()
        raise


def open_header_model(headers: Sequence[tuple[str | os.PathLike, int]], align: int | None = None) -> ModelFile:
    """A model from its header alone (GGUFFile.from_headers: each shard's first bytes and its
    whole size), validated and mapped as `open_model` does; it has no tensor bytes, so it
    forecasts and inspects but does not run."""
    f = GGUFFile.from_headers([(Path(p), n) for p, n in headers])
    try:
        spec = read_spec(f)
        return ModelFile(f, spec, build_layout(f, spec, align))
    except BaseException:
        f.close()
        raise
