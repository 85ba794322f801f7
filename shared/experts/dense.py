"""The dense set in a shared-memory arena (`dense_weights = "anon"`), and the
buffered sweep of the `warm` policy.

The arena holds each dense extent's page-rounded read, one after another, so
O_DIRECT can read straight into it; a tensor is found inside by offset
arithmetic, and compute builds numpy views there with the same dtype and shape
gguf-py gives for the file mapping:

    file shard:  |hdr|..[dense A ]..[experts ..........][dense B     ]..|
    arena:       [page-rounded A ][page-rounded B       ]
                  └ skip ┘└ A's bytes    └ skip ┘└ B's bytes
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ..gguf.layout import Extent, Layout, aligned_bytes
from ..gguf.reader import GGUFFile, TensorInfo
from .placement import placement_for


def arena_bytes(layout: Layout) -> int:
    """Size of the dense arena: every dense extent read rounded to `layout.align`."""
    return aligned_bytes(layout.dense, layout.align)


def arena_views(f: GGUFFile, layout: Layout, buf: np.ndarray | None) -> Callable[[str], np.ndarray]:
    """`view(name)` over the arena: the same dtype and shape as `f.view(name)`.
    The placement is a pure function of the extents (`placement_for`), so compute
    finds the tensors without being told where the reader put them. A tensor read by
    row (`Layout.row_tensor_names`: the token embedding) is not in the arena: its view is
    the file mapping's, read a page at a time (`GGUFFile.view_by_rows`); with no arena
    (`buf` None, the dense set read through the file mapping) every other view is too."""
    placement = placement_for(layout.dense, layout.align)

    def view(name: str) -> np.ndarray:
        if name in layout.row_tensor_names:
            return f.view_by_rows(name)
        if buf is None:
            return f.view(name)
        t: TensorInfo = f.tensor(name)
        like = f.view(name)  # only for dtype and shape; its bytes are not touched
        off = placement.locate(t.shard, t.offset, t.nbytes)
        return np.ndarray(like.shape, dtype=like.dtype, buffer=buf, offset=off)

    return view


SWEEP_CHUNK = 8 << 20  # sequential reads this large run at the device's streaming rate


def warm_sweep(paths: list, extents: tuple[Extent, ...], chunk: int = SWEEP_CHUNK) -> int:
    """One buffered sequential pass over the dense ranges so their pages are in
    the page cache before the first token (the `warm` policy). Returns bytes read."""
    done = 0
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        buf = bytearray(chunk)
        for e in sorted(extents, key=lambda e: (e.shard, e.offset)):
            fd, pos, end = fds[e.shard], e.offset, e.end
            os.posix_fadvise(fd, pos, e.length, os.POSIX_FADV_SEQUENTIAL)
            while pos < end:
                n = os.preadv(fd, [memoryview(buf)[: min(chunk, end - pos)]], pos)
                if n <= 0:
                    break
                pos += n
                done += n
    finally:
        for fd in fds:
            os.close(fd)
    return done
