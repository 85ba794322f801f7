"""The I/O alignment: one machine fact every expert read and slab is rounded to.

    align = max(the OS page size, the O_DIRECT offset alignment of the device holding the model)

The device's need comes from statx's DIO fields (`stx_dio_offset_align`, Linux
6.1+, through libc) where the kernel fills them, else from
/sys/dev/block/MAJ:MIN/queue/logical_block_size of the file's st_dev (a
partition has no queue/ of its own: its parent directory, the whole disk,
does). A filesystem with no block device under it (tmpfs, overlay, NFS)
adds nothing: the page size alone. x86-64 and most phones give 4096; arm64
kernels built with 16 KiB or 64 KiB pages (Apple silicon boards, some
server and Jetson images) give those.

`MOE_PIPE_IO_ALIGN` overrides the result (a power of two and a multiple of
the page size), so tests can run the whole pipeline at 16 or 64 KiB on a
4 KiB machine.

The value is resolved once, by the process that opens the model first (the
supervisor), and travels from there: `Layout.align` carries it, and the
reader's and compute's configs pass it to their own `open_model`, so every
process rounds extents, sizes slabs and places an expert's parts in its slab
the same way (docs/formats.md § Alignment).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "MOE_PIPE_IO_ALIGN"
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")  # the OS page: mmap granularity, madvise ranges
IDENTITY_PAGE = 4096  # not an alignment: the fixed sample size of a file's identity digest (shared/experts/directio.py)

_AT_FDCWD = -100
_STATX_DIOALIGN = 0x2000
_STATX_SIZE = 256
_STX_DIO_MEM_ALIGN_AT = 152  # struct statx: __u32 stx_dio_mem_align, then __u32 stx_dio_offset_align


@dataclass(frozen=True)
class IoAlignment:
    value: int  # what reads, slabs and buffers are rounded to
    page: int  # the OS page size
    device: int | None  # the device's O_DIRECT offset alignment, if found
    source: str  # where `device` (or the override) came from

    def describe(self) -> str:
        if self.source.startswith(ENV):
            return f"{self.value} B ({self.source}; page size {self.page} B)"
        dev = f"device {self.device} B ({self.source})" if self.device else f"no block device found ({self.source})"
        return f"{self.value} B (max of page size {self.page} B, {dev})"


def _statx_dio(path: str) -> int | None:
    """stx_dio_offset_align, or None where libc or the kernel lacks STATX_DIOALIGN."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, buf) != 0:
        return None
    mask = int.from_bytes(buf.raw[0:4], "little")
    offset_align = int.from_bytes(buf.raw[_STX_DIO_MEM_ALIGN_AT + 4 : _STX_DIO_MEM_ALIGN_AT + 8], "little")
    return offset_align if mask & _STATX_DIOALIGN and offset_align > 0 else None  # 0: the file refuses O_DIRECT


def _sysfs_block(path: str) -> tuple[int | None, str]:
    st = os.stat(path)
    node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        real = node.resolve(strict=True)
    except OSError:
        return None, f"st_dev {os.major(st.st_dev)}:{os.minor(st.st_dev)} is no block device"
    for d in (real, real.parent):  # a partition's queue/ is its whole disk's
        try:
            return int((d / "queue" / "logical_block_size").read_text()), f"{d.name} logical_block_size"
        except (OSError, ValueError):
            continue
    return None, f"{real.name} has no logical_block_size"


def device_alignment(path: str | os.PathLike) -> tuple[int | None, str]:
    """(the O_DIRECT offset alignment the file at `path` needs, where it came from)."""
    p = os.fspath(path)
    dio = _statx_dio(p)
    if dio is not None:
        return dio, "statx dio_offset_align"
    return _sysfs_block(p)


def _override(page: int) -> int | None:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < page or value & (value - 1) or value % page:
        raise ValueError(f"{ENV}={text!r}: expected a power of two that is a multiple of the page size ({page} B), e.g. 16384")
    return value


def io_alignment(paths: Sequence[str | os.PathLike]) -> IoAlignment:
    """The alignment for reading the model at `paths` (every shard's device counts)."""
    page = PAGE_SIZE
    forced = _override(page)
    if forced is not None:
        return IoAlignment(forced, page, None, f"{ENV}={forced}")
    found = [device_alignment(p) for p in paths]
    devices = [n for n, _ in found if n]
    device = max(devices) if devices else None
    source = "; ".join(sorted({why for _, why in found})) or "no file"
    return IoAlignment(max([page, *devices]), page, device, source)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align
