"""Reading experts (and the dense set) from the model file into shared memory.

Every read is the page-rounded superset of one extent (`layout.aligned`),
issued with `os.preadv` on an O_DIRECT fd straight into a page-aligned region
of the destination: no page cache, so the kernel never holds a second copy of
a streamed expert and the cache budget is the only memory experts use.

One expert in its slab (S = slab_bytes; each part read page-rounded, in the
order of `LayerExperts.parts`; `skip` = the part's offset inside its first page):

    slab:  | page-rounded read of part 0 | read of part 1 | ... |  unused  |
           0     ^skip0                  r0   ^skip1              ...      S
                 └ part 0's bytes: Placement.regions[0] = (skip0, length0)

If the filesystem refuses O_DIRECT (EINVAL at open, or at the first read of a
file), that file is read buffered and each read is followed by
POSIX_FADV_DONTNEED over its range, which drops the pages again; this is
reported once (`ExpertFiles.direct` is False, one log line).

Fault injection (off by default): `set_fault_hook(fn)` installs a callable
run before every read as fn(path, offset, length); an OSError it raises
surfaces as a `DiskReadError`, like a real disk fault. A child process gets
the same from the environment: MOE_PIPE_FAULT_READ=N fails this process's
Nth read with EIO, "N+" fails the Nth and every later one (read at import).
"""
from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .layout import PAGE, Extent, LayerExperts, aligned, aligned_bytes
from .model.weights import Expert, expert_from_bytes

log = logging.getLogger(__name__)

DENSE_CHUNK_BYTES = 8 << 20  # large enough to stream at device speed, small enough to report progress
FAULT_ENV = "MOE_PIPE_FAULT_READ"

FaultHook = Callable[[str, int, int], None]


class DiskReadError(OSError):
    """A read of the model file failed (or ended early): names file, range and cause."""

    def __init__(self, path: str, offset: int, length: int, cause: str, err: int = errno.EIO):
        self.path, self.offset, self.length = path, offset, length
        super().__init__(err, f"{path}: read of {length} B at offset {offset} failed: {cause}")


# -- fault injection ---------------------------------------------------------------

def _hook_from_env(value: str | None) -> FaultHook | None:
    if not value or value.strip() in ("", "0"):
        return None
    text = value.strip()
    sticky = text.endswith("+")
    try:
        nth = int(text.rstrip("+"))
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={value!r}: expected N or N+ (fail the Nth read, or the Nth and later)") from None
    counter = itertools.count(1)

    def hook(path: str, offset: int, length: int) -> None:
        k = next(counter)
        if k == nth or (sticky and k > nth):
            raise OSError(errno.EIO, f"injected read fault ({FAULT_ENV}={value}, read {k})")

    return hook


_fault_hook: FaultHook | None = _hook_from_env(os.environ.get(FAULT_ENV))


def set_fault_hook(hook: FaultHook | None) -> FaultHook | None:
    """Install (or with None remove) the read fault hook; returns the previous one."""
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    return previous


# -- destinations ------------------------------------------------------------------

def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, zero-filled uint8 buffer (anonymous mapping) for O_DIRECT reads."""
    mm = mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))
    return np.frombuffer(mm, np.uint8)[:nbytes]


def _as_dest(buf, what: str) -> np.ndarray:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be a contiguous 1-D uint8 buffer, got {arr.dtype} {arr.shape}")
    if not arr.flags.writeable:
        raise ValueError(f"{what} is read-only (attach the arena read-write to fill it)")
    return arr


@dataclass(frozen=True)
class Placement:
    """Where each extent's bytes sit in the destination, in extent order."""

    extents: tuple[Extent, ...]
    regions: tuple[tuple[int, int], ...]  # (offset in destination, length) per extent
    disk_bytes: int  # bytes read from disk (page-rounded reads, cut short at end of file)

    def locate(self, shard: int, offset: int, length: int) -> int:
        """Destination offset of file bytes [offset, offset + length) of `shard`."""
        for e, (at, _n) in zip(self.extents, self.regions):
            if e.shard == shard and e.offset <= offset and offset + length <= e.end:
                return at + (offset - e.offset)
        raise KeyError(f"bytes [{offset}, {offset + length}) of shard {shard} were not read")


ExpertPlacement = Placement  # the name the reader and compute use for one expert's slab


def placement_for(extents: Iterable[Extent]) -> Placement:
    """Where a read of `extents` puts their bytes: a function of the extents
    alone, so compute can rebuild it from (layer, expert) and only the slab id
    needs to cross the wire. disk_bytes is 0 (nothing read)."""
    extents = tuple(extents)
    regions, at = [], 0
    for e in extents:
        _start, n, skip = aligned(e)
        regions.append((at + skip, e.length))
        at += n
    return Placement(extents, tuple(regions), 0)


# -- the files -------------------------------------------------------------------

class ExpertFiles:
    """The model's shard files, opened for O_DIRECT reads (buffered where refused).

    Safe to share between I/O lanes (threads): preadv carries its own offset.
    `direct=False` forces the buffered path (tests, filesystems that lie).
    """

    def __init__(self, paths: Sequence[str | os.PathLike], *, direct: bool = True):
        self.paths = [os.fspath(p) for p in paths]
        self._fds: list[int] = []
        self._direct: list[bool] = []
        self._proven: list[bool] = []  # a direct read on this file has succeeded
        self._retired: list[int] = []  # direct fds replaced by buffered ones; closed in close()
        self._lock = threading.Lock()
        self.fallback_reason: str | None = None if direct else "buffered reads requested"
        self.sizes: list[int] = []
        try:
            for path in self.paths:
                fd, is_direct = self._open(path, direct)
                self._fds.append(fd)
                self._direct.append(is_direct)
                self._proven.append(False)
                self.sizes.append(os.fstat(fd).st_size)
        except BaseException:
            self.close()
            raise

    def _open(self, path: str, direct: bool) -> tuple[int, bool]:
        if direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._report_fallback(path, "the filesystem refuses O_DIRECT at open")
        return os.open(path, os.O_RDONLY), False

    def _report_fallback(self, path: str, why: str) -> None:
        if self.fallback_reason is None:
            self.fallback_reason = f"{path}: {why}"
            log.warning("O_DIRECT unavailable (%s): reading buffered and dropping pages after each read; "
                        "the page cache may briefly hold streamed experts", self.fallback_reason)

    @property
    def direct(self) -> bool:
        """True while every shard is read with O_DIRECT."""
        return bool(self._direct) and all(self._direct)

    def close(self) -> None:
        for fd in self._fds + self._retired:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds, self._retired = [], []

    def __enter__(self) -> "ExpertFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reads ---------------------------------------------------------------
    def read_expert(self, extents: Iterable[Extent], slab) -> Placement:
        """Read one expert's extents into `slab` (page-aligned, writable); one preadv per part."""
        extents = tuple(extents)
        dest = self._check_dest(extents, slab, "slab")
        return self._read(extents, dest, chunk_bytes=None, progress=None)

    def read_dense(self, extents: Iterable[Extent], dest, *, chunk_bytes: int = DENSE_CHUNK_BYTES,
                   progress: Callable[[int, int], None] | None = None) -> Placement:
        """Read the dense set into `dest` (page-aligned, ≥ aligned_bytes(extents)) in
        sequential `chunk_bytes` reads; progress(bytes_done, bytes_total) after each."""
        if chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise ValueError(f"chunk size {chunk_bytes} is not a positive multiple of {PAGE}")
        extents = tuple(extents)
        arr = self._check_dest(extents, dest, "dense destination")
        return self._read(extents, arr, chunk_bytes=chunk_bytes, progress=progress)

    def _check_dest(self, extents: tuple[Extent, ...], buf, what: str) -> np.ndarray:
        arr = _as_dest(buf, what)
        need = aligned_bytes(extents)
        if need > arr.size:
            raise ValueError(f"{what} of {arr.size} B is too small: these extents need {need} B read page-rounded")
        if arr.ctypes.data % PAGE:
            raise ValueError(f"{what} at address {arr.ctypes.data:#x} is not {PAGE}-aligned, as O_DIRECT needs")
        for e in extents:
            if not 0 <= e.shard < len(self._fds):
                raise ValueError(f"extent {e} names shard {e.shard}, but {len(self._fds)} file(s) are open")
        return arr

    def _read(self, extents: tuple[Extent, ...], dest: np.ndarray, chunk_bytes: int | None,
              progress: Callable[[int, int], None] | None) -> Placement:
        at, disk = 0, 0
        total = aligned_bytes(extents)
        for e in extents:
            start, n, skip = aligned(e)
            need = skip + e.length  # bytes of this read that must arrive; the rest may lie past EOF
            step = chunk_bytes or n
            for c in range(0, n, step):
                m = min(step, n - c)
                disk += self._read_region(e.shard, dest[at + c : at + c + m], start + c, max(0, min(m, need - c)))
                if progress is not None:
                    progress(at + c + m, total)
            at += n
        planned = placement_for(extents)
        return Placement(extents, planned.regions, disk)

    def _read_region(self, shard: int, view: np.ndarray, offset: int, need: int) -> int:
        """Fill `view` from file `shard` at `offset` (both page-aligned); bytes past
        `need` may be missing at end of file. Returns the bytes read."""
        path, got, n = self.paths[shard], 0, view.size
        while got < n:
            fd, is_direct = self._fds[shard], self._direct[shard]
            try:
                if _fault_hook is not None:
                    _fault_hook(path, offset + got, n - got)
                r = os.preadv(fd, [view[got:]], offset + got)
            except InterruptedError:  # PEP 475 retries EINTR itself; this covers a handler that raised it
                continue
            except OSError as exc:
                if exc.errno == errno.EINVAL and is_direct and not self._proven[shard]:
                    self._fall_back(shard, "the filesystem refuses O_DIRECT reads")
                    continue
                raise DiskReadError(path, offset + got, n - got, exc.strerror or str(exc), exc.errno or errno.EIO) from exc
            if r == 0:
                break  # end of file
            if is_direct:
                self._proven[shard] = True
            else:
                os.posix_fadvise(fd, offset + got, r, os.POSIX_FADV_DONTNEED)
            got += r
            if got < n and offset + got >= self.sizes[shard]:
                break  # the file's last, partial page: nothing more to come
            if got < n and got % PAGE and is_direct:
                # A short read mid-file that is not page-sized: O_DIRECT cannot
                # resume at an unaligned offset, so re-read from the page start.
                got -= got % PAGE
        if got < need:
            raise DiskReadError(path, offset, need, f"the file ends at byte {offset + got} (truncated since it was opened?)")
        return got

    def _fall_back(self, shard: int, why: str) -> None:
        with self._lock:
            if not self._direct[shard]:
                return  # another lane switched it first
            fd = os.open(self.paths[shard], os.O_RDONLY)
            # The old fd may be mid-read in another lane: retire it, close at close().
            self._retired.append(self._fds[shard])
            self._fds[shard], self._direct[shard] = fd, False
            self._report_fallback(self.paths[shard], why)


# -- experts as compute sees them -----------------------------------------------------

def expert_view(layer: LayerExperts, expert_id: int, slab, placement: Placement) -> Expert:
    """The expert whose parts `placement` locates in `slab`, as zero-copy views
    (a read-only slab gives read-only weights; kernels only read)."""
    arr = slab if isinstance(slab, np.ndarray) else np.frombuffer(slab, np.uint8)
    if len(placement.regions) != len(layer.parts):
        raise ValueError(f"layer {layer.layer} experts have {len(layer.parts)} parts, placement has {len(placement.regions)}")
    slices = {}
    for part, (at, n) in zip(layer.parts, placement.regions):
        if n != part.stride or at + n > arr.size:
            raise ValueError(f"layer {layer.layer} part {part.name}: placement ({at}, {n}) does not fit a {part.stride} B part in a {arr.size} B slab")
        slices[part.name] = arr[at : at + n]
    return expert_from_bytes(layer, expert_id, slices)
