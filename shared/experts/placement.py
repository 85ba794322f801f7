"""Slab placement: where a read of an expert's extents puts each part's bytes
in its slab, and the expert as zero-copy views of that slab.

One expert in its slab (S = slab_bytes; each part read rounded to the I/O
alignment `Layout.align`, in the order of `LayerExperts.parts`; `skip` = the
part's offset inside its first aligned block):

    slab:  | page-rounded read of part 0 | read of part 1 | ... |  unused  |
           0     ^skip0                  r0   ^skip1              ...      S
                 └ part 0's bytes: Placement.regions[0] = (skip0, length0)

The placement is a function of the extents and the alignment alone, so the
reader and compute agree on it without sending it (both got the alignment
from the parent's config): only the slab id crosses the wire.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..gguf.layout import Extent, LayerExperts, aligned
from ..model.weights import Expert, expert_from_bytes


@dataclass(frozen=True)
class Placement:
    """Where each extent's bytes sit in the destination, in extent order."""

    extents: tuple[Extent, ...]
    regions: tuple[tuple[int, int], ...]  # (offset in destination, length) per extent
    disk_bytes: int  # bytes read from disk (aligned reads, cut short at end of file)

    def locate(self, shard: int, offset: int, length: int) -> int:
        """Destination offset of file bytes [offset, offset + length) of `shard`."""
        for e, (at, _n) in zip(self.extents, self.regions):
            if e.shard == shard and e.offset <= offset and offset + length <= e.end:
                return at + (offset - e.offset)
        raise KeyError(f"bytes [{offset}, {offset + length}) of shard {shard} were not read")


def placement_for(extents: Iterable[Extent], align: int) -> Placement:
    """Where a read of `extents` rounded to `align` (`Layout.align`) puts their
    bytes: a function of the extents and the alignment alone, so compute can
    rebuild it from (layer, expert) and only the slab id needs to cross the
    wire. disk_bytes is 0 (nothing read)."""
    extents = tuple(extents)
    regions, at = [], 0
    for e in extents:
        _start, n, skip = aligned(e, align)
        regions.append((at + skip, e.length))
        at += n
    return Placement(extents, tuple(regions), 0)


def expert_view(layer: LayerExperts, expert_id: int, slab, placement: Placement) -> Expert:
    """The expert whose parts `placement` locates in `slab`, as zero-copy views
    (a read-only slab gives read-only weights; kernels only read)."""
    arr = slab if isinstance(slab, np.ndarray) else np.frombuffer(slab, np.uint8)
    if len(placement.regions) != len(layer.parts):
        raise ValueError(f"layer {layer.layer} experts have {len(layer.parts)} parts, placement has {len(placement.regions)}")
    slices = {}
    for part, (at, n) in zip(layer.parts, placement.regions):
        if n != part.stride or at + n > arr.size:
            raise ValueError(
                f"layer {layer.layer} part {part.name}: placement ({at}, {n}) does not fit a {part.stride} B part in a {arr.size} B slab"
            )
        slices[part.name] = arr[at : at + n]
    return expert_from_bytes(layer, expert_id, slices)
