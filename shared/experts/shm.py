"""POSIX shared-memory arenas with one owner: the expert slab cache and the dense set.

The supervisor creates every arena (so a child's crash loses none of them)
and is the only process that unlinks; the reader attaches the slab arena
read-write, compute attaches it read-only. An arena is a file under /dev/shm
opened with os.open + ftruncate + mmap. multiprocessing.shared_memory is not
used: its resource tracker unlinks segments (and warns) when an *attaching*
process exits, which would tear the cache down under a restarted child.

Names carry the owner's pid so that a new supervisor can tell a segment left
by a dead one from a live one:

    /dev/shm/moe-pipe-<owner pid>-<kind>        e.g. moe-pipe-4242-slabs

A slab arena is n_slabs equal slabs and nothing else (no header: the slab
size comes from the model's layout, slab ids cross the wire):

    offset 0          S                 2S                     (n-1)S         nS
           | slab 0 ......... | slab 1 ......... | ... | slab n-1 ....... |
           ^ page-aligned     ^ page-aligned             (S = slab_bytes, a multiple of the I/O alignment)

mmap returns a page-aligned address and S is a multiple of the I/O alignment
(`Layout.align`, itself a multiple of the page size: shared/gguf/alignment.py),
so every slab starts on a page boundary: O_DIRECT reads land in it directly
(their memory alignment, statx's dio_mem_align, is at most a page on Linux).
One expert inside a slab is its parts' aligned reads, one after another
(see directio.read_expert for where the wanted bytes sit).
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..gguf.alignment import PAGE_SIZE
from ..pids import pid_alive

SHM_DIR = Path("/dev/shm")
PAGE = PAGE_SIZE  # the OS page (os.sysconf, once): mapping granularity and madvise ranges
# madvise advice (Linux 5.14+; Python 3.11's mmap does not name them): fault a
# range's pages into this process's page tables now, writable or readable.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Free a shared mapping's pages (a hole punched in the segment): they leave the memory count.
MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)
PREFIX = "moe-pipe-"
_NAME = re.compile(r"^moe-pipe-(?P<pid>\d+)-(?P<kind>[A-Za-z0-9_.-]+)$")
_KIND = re.compile(r"^[A-Za-z0-9_.-]+$")


def segment_name(kind: str, owner_pid: int | None = None) -> str:
    """`moe-pipe-<pid>-<kind>`: the pid is the owner's (default: this process)."""
    if not _KIND.match(kind):
        raise ValueError(f"segment kind {kind!r} may hold only letters, digits, '_', '.', '-'")
    return f"{PREFIX}{os.getpid() if owner_pid is None else int(owner_pid)}-{kind}"


def parse_segment_name(name: str) -> tuple[int, str] | None:
    """(owner pid, kind) of a moe-pipe segment name, None for anything else."""
    m = _NAME.match(name)
    return (int(m["pid"]), m["kind"]) if m else None


class Arena:
    """One shared-memory segment mapped into this process.

    `buf` is a uint8 numpy view over the whole mapping (read-only when
    attached read-only: a stray write raises instead of corrupting the cache).
    Only the creator (`owner`) may unlink; close() only unmaps.
    """

    def __init__(self, name: str, size: int, mm: mmap.mmap, *, owner: bool, readonly: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self.readonly = readonly
        self._mm: mmap.mmap | None = mm
        self._buf: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)
        self._unlinked = False

    # -- lifetime ---------------------------------------------------------
    @classmethod
    def create(cls, name: str, size: int) -> Arena:
        """Create a new segment (never reuses one: O_EXCL), mode 0600, sized but with no page
        allocated yet (`reserve` allocates them)."""
        _check_name(name)
        if size <= 0:
            raise ValueError(f"shared-memory arena {name!r}: size must be positive, got {size}")
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the segment; the fd is not needed
        return cls(name, size, mm, owner=True, readonly=False)

    def reserve(self, length: int | None = None) -> None:
        """Allocate every page of the segment (or of its first `length` bytes) now
        (posix_fallocate), so an arena that does not fit in /dev/shm fails here with ENOSPC
        rather than as a SIGBUS in whichever process first touches the missing page. A thread
        may run it beside other start-up work (the call waits in the kernel, which zeroes the
        pages, without the GIL)."""
        size = self.size if length is None else min(self.size, length)
        if size <= 0:
            return
        fd = os.open(SHM_DIR / self.name, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str, readonly: bool = True) -> Arena:
        """Map an existing segment created by another process (or this one)."""
        _check_name(name)
        fd = os.open(SHM_DIR / name, os.O_RDONLY if readonly else os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"shared-memory arena {name!r} is empty (its creator has not sized it yet)")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False, readonly=readonly)

    @property
    def buf(self) -> np.ndarray:
        if self._buf is None:
            raise ValueError(f"shared-memory arena {self.name!r} is closed")
        return self._buf

    @property
    def closed(self) -> bool:
        return self._mm is None

    def populate(self, start: int, length: int) -> bool:
        """Map bytes [start, start + length) into this process now (page-rounded),
        without changing them: writable in a read-write mapping, readable in a
        read-only one. An O_DIRECT read into a page no process has mapped yet
        pays the page's fault inside the read, which halves its rate (measured,
        docs/warmup-analysis.md § Populated slabs); done here, ahead of the
        reads, the fault is off their path. False when the kernel lacks the
        advice (older than 5.14) or the arena is closed: nothing is populated."""
        mm = self._mm
        if mm is None or length <= 0:
            return False
        lo = start - start % PAGE
        hi = min(self.size, -(-(start + length) // PAGE) * PAGE)
        advice = MADV_POPULATE_READ if self.readonly else MADV_POPULATE_WRITE
        try:
            mm.madvise(advice, lo, hi - lo)
        except (OSError, ValueError):  # EINVAL: an older kernel; ValueError: closed under us
            return False
        return True

    def release(self, start: int, length: int) -> bool:
        """Give the pages of bytes [start, start + length) back to the system
        (page-rounded inward): the segment keeps its size, the range reads as
        zeros, and its memory no longer counts for this process tree until
        something writes there again. Writable mappings only. False when the
        kernel refuses (not tmpfs, or the arena is closed): nothing is freed."""
        mm = self._mm
        lo = -(-start // PAGE) * PAGE
        hi = min(self.size, (start + length) // PAGE * PAGE)
        if mm is None or self.readonly or hi <= lo:
            return False
        try:
            mm.madvise(MADV_REMOVE, lo, hi - lo)
        except (OSError, ValueError):
            return False
        return True

    def close(self) -> None:
        """Unmap. Views handed out earlier keep the mapping alive until they go."""
        mm, self._mm, self._buf = self._mm, None, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a numpy view still points in; the GC unmaps later
                pass

    def unlink(self) -> None:
        """Remove the segment's name (owner only; idempotent). Mappings stay valid."""
        if not self.owner:
            raise PermissionError(f"shared-memory arena {self.name!r} is attached, not owned: only its creator unlinks it")
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(SHM_DIR / self.name)
            except FileNotFoundError:
                pass

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        role = "owner" if self.owner else ("read-only" if self.readonly else "read-write")
        return f"Arena({self.name!r}, {self.size} B, {role}{', closed' if self.closed else ''})"


def _check_name(name: str) -> None:
    # A '/' would escape /dev/shm; shm_open names are one path component.
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"shared-memory name {name!r} must be one path component")


@dataclass
class SlabArena:
    """An arena seen as `n_slabs` slabs of `slab_bytes` each (layout in the module docstring)."""

    arena: Arena
    slab_bytes: int

    def __post_init__(self) -> None:
        if self.slab_bytes <= 0 or self.slab_bytes % PAGE:
            raise ValueError(f"slab size {self.slab_bytes} B is not a positive multiple of {PAGE}")
        if self.arena.size % self.slab_bytes:
            raise ValueError(f"arena {self.arena.name!r} holds {self.arena.size} B, not a whole number of {self.slab_bytes} B slabs")

    @classmethod
    def create(cls, name: str, n_slabs: int, slab_bytes: int) -> SlabArena:
        if n_slabs <= 0:
            raise ValueError(f"slab arena {name!r}: needs at least one slab, got {n_slabs}")
        if slab_bytes <= 0 or slab_bytes % PAGE:
            raise ValueError(f"slab size {slab_bytes} B is not a positive multiple of {PAGE}")
        return cls(Arena.create(name, n_slabs * slab_bytes), slab_bytes)

    @classmethod
    def attach(cls, name: str, slab_bytes: int, readonly: bool = True) -> SlabArena:
        arena = Arena.attach(name, readonly=readonly)
        try:
            return cls(arena, slab_bytes)
        except BaseException:
            arena.close()
            raise

    @property
    def n_slabs(self) -> int:
        return self.arena.size // self.slab_bytes

    def release_slab(self, k: int) -> bool:
        """Slab k's pages back to the system (`Arena.release`): a retired slab's memory."""
        if not 0 <= k < self.n_slabs:
            raise IndexError(f"slab {k} out of range 0..{self.n_slabs - 1}")
        return self.arena.release(k * self.slab_bytes, self.slab_bytes)

    def slab(self, k: int) -> np.ndarray:
        """Slab k as a uint8 view [slab_bytes] (read-only if the arena is)."""
        if not 0 <= k < self.n_slabs:
            raise IndexError(f"slab {k} out of range 0..{self.n_slabs - 1}")
        return self.arena.buf[k * self.slab_bytes : (k + 1) * self.slab_bytes]

    def close(self) -> None:
        self.arena.close()

    def unlink(self) -> None:
        self.arena.unlink()

    def __enter__(self) -> SlabArena:
        return self

    def __exit__(self, *exc) -> None:
        self.arena.__exit__(*exc)


# -- stale segments ------------------------------------------------------------


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _process_start(pid: int) -> float | None:
    """Wall-clock start time of `pid` from /proc, None where /proc can't say."""
    boot = _boot_time()
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (starttime, clock ticks after boot); the command name (field 2)
    # may hold spaces and parentheses, so count from the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if boot is None or len(fields) < 20:
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _owner_alive(pid: int, segment_changed: float) -> bool:
    if not pid_alive(pid):
        return False
    # A live pid may be a reuse: a process that started after the segment last
    # changed cannot be the one that created it. In doubt, alive (never reclaim
    # a live owner's memory). The 2 s covers /proc's tick rounding.
    start = _process_start(pid)
    return start is None or start <= segment_changed + 2.0


def stale_segments(shm_dir: Path | str = SHM_DIR) -> list[str]:
    """Names of moe-pipe segments whose owner process is gone."""
    out = []
    for entry in sorted(Path(shm_dir).iterdir()):
        parsed = parse_segment_name(entry.name)
        if parsed is None:
            continue
        try:
            changed = entry.stat().st_ctime
        except FileNotFoundError:  # unlinked while we looked
            continue
        if not _owner_alive(parsed[0], changed):
            out.append(entry.name)
    return out


def reclaim_stale(shm_dir: Path | str = SHM_DIR) -> list[str]:
    """Unlink every stale moe-pipe segment; returns the names removed."""
    removed = []
    for name in stale_segments(shm_dir):
        try:
            os.unlink(Path(shm_dir) / name)
            removed.append(name)
        except FileNotFoundError:  # another supervisor got there first
            pass
    return removed
