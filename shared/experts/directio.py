"""Reading experts (and the dense set) from the model file into shared memory.

Every read is the superset of one extent rounded to the I/O alignment
(`layout.aligned`, `Layout.align`: the page size or the device's block,
whichever is larger; shared/gguf/alignment.py), issued with `os.preadv` on an
O_DIRECT fd straight into a page-aligned region of the destination: no page
cache, so the kernel never holds a second copy of a streamed expert and the
cache budget is the only memory experts use.

Where a read puts each part of an expert in its slab is `placement.py`'s.

If the filesystem refuses O_DIRECT (EINVAL at open, or at the first read of a
file), that file is read buffered and each read is followed by
POSIX_FADV_DONTNEED over its range, which drops the pages again; this is
reported once (`ExpertFiles.direct` is False, one log line).

A file that changes under a running service (truncated, replaced, gone)
is told apart from the one the service started with by its `FileIdentity`
(size and a digest of its header and of pages spread over it): the reader
keeps failing reads with a clear error until `ExpertFiles.recover()` finds
the same file back at the path, and never reads a different file's bytes
into a cache whose other slabs and dense set came from the first one.

Fault injection, a test hook, off in production: `set_fault_hook(fn)`
installs a callable run before every read as fn(path, offset, length); an
OSError it raises surfaces as a `DiskReadError`, like a real disk fault.
Child processes get faults from the environment, read here once at import:

    MOE_PIPE_FAULT_READ = SPEC[,SPEC...]
      [ROLE:][ERRNO:]N    fail this process's Nth read (counted from 1) with ERRNO (default EIO)
      [ROLE:][ERRNO:]N+   ... the Nth and every later read
      [ROLE:]odirect      refuse every O_DIRECT open with EINVAL (a filesystem without it)
      ROLE                reader, compute, ... (the child's role) or main (the parent): only
                          that process's reads count; no ROLE = every process
      e.g. "reader:3", "reader:EINVAL:1" (O_DIRECT refused at the first read), "odirect"
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import mmap
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..gguf.alignment import IDENTITY_PAGE, PAGE_SIZE, io_alignment, round_up
from ..gguf.layout import Extent, aligned, aligned_bytes
from .placement import Placement, placement_for

log = logging.getLogger(__name__)

DENSE_CHUNK_BYTES = 8 << 20  # large enough to stream at device speed, small enough to report progress
FAULT_ENV = "MOE_PIPE_FAULT_READ"

FaultHook = Callable[[str, int, int], None]


class DiskReadError(OSError):
    """A read of the model file failed (or ended early): names file, range and cause."""

    def __init__(self, path: str, offset: int, length: int, cause: str, err: int = errno.EIO):
        self.path, self.offset, self.length = path, offset, length
        super().__init__(err, f"{path}: read of {length} B at offset {offset} failed: {cause}")


def describe_os_error(exc: BaseException) -> str:
    """One line for a failed read or open: the file and the cause, without
    Python's "[Errno 5]" decoration (DiskReadError's text names both)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename and str(exc.filename) not in exc.strerror else exc.strerror
    return f"{type(exc).__name__}: {exc}"


# -- fault injection (a test hook) ---------------------------------------------------


def current_role() -> str:
    """This process's role as the fault hook names it: a child's (its
    multiprocessing name is moe-pipe-<role>), or main for the parent."""
    name = multiprocessing.current_process().name
    return "main" if name == "MainProcess" else name.removeprefix("moe-pipe-")


@dataclass(frozen=True)
class _FaultSpec:
    role: str | None  # None = every process
    err: int = errno.EIO
    nth: int = 0  # 0 = not a read fault (odirect)
    sticky: bool = False
    refuse_direct: bool = False


def _parse_fault(value: str) -> list[_FaultSpec]:
    specs = []
    for text in (t.strip() for t in value.split(",")):
        if not text or text == "0":
            continue
        parts = text.split(":")
        role = None
        if parts[0].islower() and parts[0] != "odirect":  # a role; errno names are upper case
            role = parts.pop(0)
        try:
            if parts == ["odirect"]:
                specs.append(_FaultSpec(role, errno.EINVAL, refuse_direct=True))
                continue
            err = errno.EIO
            if len(parts) == 2:
                err = getattr(errno, parts.pop(0))
            (count,) = parts
            nth = int(count.rstrip("+"))
            if nth <= 0:
                raise ValueError
        except (ValueError, AttributeError):
            raise ValueError(
                f"{FAULT_ENV}={value!r}: expected [ROLE:][ERRNO:]N[+] or [ROLE:]odirect "
                "(fail the Nth read, or the Nth and later; refuse O_DIRECT)"
            ) from None
        specs.append(_FaultSpec(role, err, nth, count.endswith("+")))
    return specs


def _hook_from_env(value: str | None) -> FaultHook | None:
    """The read hook MOE_PIPE_FAULT_READ asks for (None: no read faults).
    Reads are counted per process, and only in the process the spec names."""
    specs = [s for s in _parse_fault(value or "") if s.nth]
    if not specs:
        return None
    counter = itertools.count(1)
    lock = threading.Lock()  # lanes read concurrently: each read gets its own number

    def hook(path: str, offset: int, length: int) -> None:
        role = current_role()
        mine = [s for s in specs if s.role in (None, role)]
        if not mine:
            return
        with lock:
            k = next(counter)
        for s in mine:
            if k == s.nth or (s.sticky and k > s.nth):
                raise OSError(s.err, f"injected read fault ({FAULT_ENV}={value}, read {k} of {role})")

    return hook


def _refusal_from_env(value: str | None) -> Callable[[], bool] | None:
    specs = [s for s in _parse_fault(value or "") if s.refuse_direct]
    if not specs:
        return None
    return lambda: any(s.role in (None, current_role()) for s in specs)


_fault_hook: FaultHook | None = _hook_from_env(os.environ.get(FAULT_ENV))
_refuse_direct: Callable[[], bool] | None = _refusal_from_env(os.environ.get(FAULT_ENV))


def set_fault_hook(hook: FaultHook | None) -> FaultHook | None:
    """Install (or with None remove) the read fault hook; returns the previous one."""
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    return previous


# -- which file ------------------------------------------------------------------------

IDENTITY_HEAD_BYTES = 1 << 20  # the GGUF header and tensor infos: every offset the layout relies on
IDENTITY_SAMPLES = 16  # pages spread over the rest: a same-shaped file with other weights differs here


class ModelChanged(OSError):
    """The file at a model path is no longer the one this run started with."""

    def __init__(self, path: str, why: str):
        self.path = path
        super().__init__(errno.ESTALE, f"{path}: {why}")


@dataclass(frozen=True)
class FileIdentity:
    """Which file a shard is: its size and a digest of its head and of pages
    spread over it. Cheap (1 MiB + 16 pages read), and enough to tell the
    same file put back (a copy, a rename) from a different or partial one
    without hashing gigabytes. Not an integrity check: a few bytes changed
    in pages it does not sample go unseen."""

    size: int
    digest: str

    def __str__(self) -> str:
        return f"{self.size}:{self.digest}"

    @classmethod
    def parse(cls, text: str) -> FileIdentity:
        size, digest = text.split(":", 1)
        return cls(int(size), digest)


def file_identity(path: str | os.PathLike) -> FileIdentity:
    """The identity of the file at `path` (for one already open as fd, pass
    `held(fd)`: the same inode, even if unlinked). Read buffered, and the
    pages dropped again, like the O_DIRECT fallback."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h = hashlib.sha256(size.to_bytes(8, "little"))
        ranges = [(0, min(size, IDENTITY_HEAD_BYTES))]
        if size > IDENTITY_HEAD_BYTES:
            step = (size - IDENTITY_HEAD_BYTES) // IDENTITY_SAMPLES
            # a fixed sample size, not the machine's alignment: the identity string must compare equal everywhere
            ranges += [((IDENTITY_HEAD_BYTES + k * step) // IDENTITY_PAGE * IDENTITY_PAGE, IDENTITY_PAGE) for k in range(IDENTITY_SAMPLES)]
        for at, n in ranges:
            h.update(os.pread(fd, n, at))
            os.posix_fadvise(fd, at, n, os.POSIX_FADV_DONTNEED)  # only what this read brought in
        return FileIdentity(size, h.hexdigest()[:32])
    finally:
        os.close(fd)


def held(fd: int) -> str:
    """A path that opens the inode `fd` holds (an O_DIRECT fd cannot be read
    into Python bytes, and the file's name may point elsewhere by now)."""
    return f"/proc/self/fd/{fd}"


def model_identity(paths: Sequence[str | os.PathLike]) -> tuple[str, ...]:
    """Every shard's identity, as strings (they travel in a child's config)."""
    return tuple(str(file_identity(p)) for p in paths)


# -- destinations ------------------------------------------------------------------


def aligned_buffer(nbytes: int, align: int = PAGE_SIZE) -> np.ndarray:
    """A zero-filled uint8 buffer (anonymous mapping) for O_DIRECT reads whose
    address is a multiple of `align` (mmap gives a page; a larger alignment
    maps that much more and starts inside it)."""
    size = round_up(max(nbytes, 1), align)
    mm = mmap.mmap(-1, size + max(0, align - PAGE_SIZE))
    arr = np.frombuffer(mm, np.uint8)
    at = -arr.ctypes.data % align
    return arr[at : at + nbytes]


def _as_dest(buf, what: str) -> np.ndarray:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be a contiguous 1-D uint8 buffer, got {arr.dtype} {arr.shape}")
    if not arr.flags.writeable:
        raise ValueError(f"{what} is read-only (attach the arena read-write to fill it)")
    return arr


# -- the files -------------------------------------------------------------------


class ExpertFiles:
    """The model's shard files, opened for O_DIRECT reads (buffered where refused).

    Safe to share between I/O lanes (threads): preadv carries its own offset.
    `direct=False` forces the buffered path (tests, filesystems that lie).
    `align`: the I/O alignment reads are rounded to (`Layout.align` of the
    model these files are; None resolves it from this machine).
    `identity` (from `model_identity`, taken when the run started) makes the
    open refuse a file that is no longer that one (`ModelChanged`), and lets
    `recover()` take the file back once it is at its path again.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        direct: bool = True,
        identity: Sequence[str] | None = None,
        align: int | None = None,
    ):
        self.paths = [os.fspath(p) for p in paths]
        self.align = io_alignment(self.paths).value if align is None else align
        # Where the buffer must start: O_DIRECT's memory alignment (statx dio_mem_align) is at
        # most a page, and an arena's slabs are only as aligned as its mmap'd base (a page).
        self.mem_align = min(self.align, PAGE_SIZE)
        self._fds: list[int] = []
        self._direct: list[bool] = []
        self._proven: list[bool] = []  # a direct read on this file has succeeded
        self._retired: list[int] = []  # direct fds replaced by buffered ones; closed in close()
        self._lock = threading.Lock()
        self._want_direct = direct
        self.fallback_reason: str | None = None if direct else "buffered reads requested"
        self.sizes: list[int] = []
        self.identity = [FileIdentity.parse(t) for t in identity] if identity else None
        if self.identity is not None and len(self.identity) != len(self.paths):
            raise ValueError(f"{len(self.identity)} identities for {len(self.paths)} model file(s)")
        try:
            for k, path in enumerate(self.paths):
                fd, is_direct = self._open(path, direct)
                self._fds.append(fd)
                self._direct.append(is_direct)
                self._proven.append(False)
                self.sizes.append(os.fstat(fd).st_size)
                if self.identity is not None and file_identity(held(fd)) != self.identity[k]:
                    raise ModelChanged(
                        path,
                        "is not the file this service started with (changed or replaced "
                        "since); put the original back or restart the service",
                    )
        except BaseException:
            self.close()
            raise

    def _open(self, path: str, direct: bool) -> tuple[int, bool]:
        if direct:
            try:
                if _refuse_direct is not None and _refuse_direct():
                    raise OSError(errno.EINVAL, f"O_DIRECT refused by {FAULT_ENV}")
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._report_fallback(path, "the filesystem refuses O_DIRECT at open")
        return os.open(path, os.O_RDONLY), False

    def recover(self) -> str | None:
        """After a failed read: is every shard at its path the file this run
        started with? A shard whose path now names another inode holding that
        same file (put back by a copy or a rename) is reopened. Returns None
        when all are usable again, else one line saying what is wrong.
        Needs the identity the files were opened with."""
        if self.identity is None:
            return None
        for k, path in enumerate(self.paths):
            try:
                problem = self._recover_shard(k, path, self.identity[k])
            except OSError as exc:  # the check's own reads failed: the disk is still unwell
                problem = f"{path}: {exc.strerror or exc}"
            if problem:
                return problem
        return None

    def _recover_shard(self, k: int, path: str, want: FileIdentity) -> str | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return f"{path}: no such file (the model file is gone)"
        if st.st_size != want.size:
            return f"{path}: {st.st_size} B, not the {want.size} B it had when the service started (truncated or replaced)"
        cur = os.fstat(self._fds[k])
        if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
            return None if file_identity(held(self._fds[k])) == want else f"{path}: its contents changed since the service started"
        fd, is_direct = self._open(path, self._want_direct)
        try:
            same = file_identity(held(fd)) == want
        except BaseException:
            os.close(fd)
            raise
        if not same:
            os.close(fd)
            return f"{path}: a different file is at this path now (not the one the service started with)"
        with self._lock:
            # the old fd may be mid-read in another lane: retire it, close at close()
            self._retired.append(self._fds[k])
            self._fds[k], self._direct[k], self._proven[k] = fd, is_direct, False
            self.sizes[k] = want.size
        log.warning("%s is back: reopened it", path)
        return None

    def _report_fallback(self, path: str, why: str) -> None:
        if self.fallback_reason is None:
            self.fallback_reason = f"{path}: {why}"
            log.warning(
                "O_DIRECT unavailable (%s): reading buffered and dropping pages after each read; "
                "the page cache may briefly hold streamed experts",
                self.fallback_reason,
            )

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

    def __enter__(self) -> ExpertFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reads ---------------------------------------------------------------
    def read_expert(self, extents: Iterable[Extent], slab) -> Placement:
        """Read one expert's extents into `slab` (page-aligned, writable); one preadv per part,
        each rounded to `self.align`."""
        extents = tuple(extents)
        dest = self._check_dest(extents, slab, "slab")
        return self._read(extents, dest, chunk_bytes=None, progress=None)

    def read_dense(
        self, extents: Iterable[Extent], dest, *, chunk_bytes: int = DENSE_CHUNK_BYTES, progress: Callable[[int, int], None] | None = None
    ) -> Placement:
        """Read the dense set into `dest` (page-aligned, ≥ aligned_bytes(extents, align)) in
        sequential `chunk_bytes` reads; progress(bytes_done, bytes_total) after each."""
        if chunk_bytes <= 0 or chunk_bytes % self.align:
            raise ValueError(f"chunk size {chunk_bytes} is not a positive multiple of the I/O alignment {self.align}")
        extents = tuple(extents)
        arr = self._check_dest(extents, dest, "dense destination")
        return self._read(extents, arr, chunk_bytes=chunk_bytes, progress=progress)

    def _check_dest(self, extents: tuple[Extent, ...], buf, what: str) -> np.ndarray:
        arr = _as_dest(buf, what)
        need = aligned_bytes(extents, self.align)
        if need > arr.size:
            raise ValueError(f"{what} of {arr.size} B is too small: these extents need {need} B read {self.align}-aligned")
        if arr.ctypes.data % self.mem_align:
            raise ValueError(f"{what} at address {arr.ctypes.data:#x} is not {self.mem_align}-aligned, as O_DIRECT needs")
        for e in extents:
            if not 0 <= e.shard < len(self._fds):
                raise ValueError(f"extent {e} names shard {e.shard}, but {len(self._fds)} file(s) are open")
        return arr

    def _read(
        self, extents: tuple[Extent, ...], dest: np.ndarray, chunk_bytes: int | None, progress: Callable[[int, int], None] | None
    ) -> Placement:
        at, disk = 0, 0
        total = aligned_bytes(extents, self.align)
        for e in extents:
            start, n, skip = aligned(e, self.align)
            need = skip + e.length  # bytes of this read that must arrive; the rest may lie past EOF
            step = chunk_bytes or n
            for c in range(0, n, step):
                m = min(step, n - c)
                disk += self._read_region(e.shard, dest[at + c : at + c + m], start + c, max(0, min(m, need - c)))
                if progress is not None:
                    progress(at + c + m, total)
            at += n
        planned = placement_for(extents, self.align)
        return Placement(extents, planned.regions, disk)

    def _read_region(self, shard: int, view: np.ndarray, offset: int, need: int) -> int:
        """Fill `view` from file `shard` at `offset` (both aligned); bytes past
        `need` may be missing at end of file. Returns the bytes read."""
        path, got, n = self.paths[shard], 0, view.size
        while got < n:
            fd, is_direct = self._fds[shard], self._direct[shard]
            try:
                if _fault_hook is not None:
                    _fault_hook(path, offset + got, n - got)
                r = os.preadv(fd, [view[got:].data], offset + got)  # .data: a memoryview (numpy's stubs know no buffer protocol on 3.11)
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
            if got < n and got % self.align and is_direct:
                # A short read mid-file that is not a whole number of aligned blocks: O_DIRECT
                # cannot resume at an unaligned offset, so re-read from the block's start.
                got -= got % self.align
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
