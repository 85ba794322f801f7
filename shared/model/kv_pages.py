"""KV pages held once for several caches: a prompt prefix that slots share by reference
(docs/batching.md § Prompt prefixes shared across slots).

A cache's whole-context rows are private anonymous mappings (shared/model/blocks.py
`_Rows`): pages are taken as positions are first written. To hold one prefix's rows once
for several caches, the whole pages of those rows are copied once into an anonymous memory
file (`memfd_create`), and the file is mapped private and fixed over the same pages of
every cache that holds the prefix, the donor's included: the donor's own copies of those
pages go back to the system as the file's mapping replaces them, so sharing costs no
memory and every further cache that takes the prefix costs none either.

A private mapping reads the file's pages until it writes one; a write first copies that
page into the cache's own memory. So a cache that goes on from the prefix (its last, part
used page), or rewrites it after a truncation, never changes what the others read. Giving
positions back (`map_zeros`) maps fresh anonymous memory over the pages, which read as
zeros again and no longer refer to the file. A file's pages are freed with its last
mapping and its descriptor, which closes when no cache's rows refer to it (`PageFile`
is collected): nothing outlives the process, on any exit path, kill -9 included (a memory
file has no name anywhere).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

# Linux's mmap flag (the same on x86-64 and aarch64); Python's mmap module has no way to
# map at an address, so the fixed mappings go through libc.
MAP_FIXED = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_MAP_FAILED = ctypes.c_void_p(-1).value


def supported() -> bool:
    """Whether this system has memory files (Linux); elsewhere a shared prefix is copied."""
    return hasattr(os, "memfd_create")


def mappings_left() -> int:
    """How many more mappings this process may make for shared prefixes: half of the system's
    limit on a process's mappings (vm.max_map_count) less those it has. Each page file a cache
    maps is a mapping a layer, kv head and array, and splits its own mapping around it; past
    the limit any mmap fails (the expert cache's included), so sharing stops well before."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            have = sum(1 for _ in f)
    except OSError:
        return 0
    return limit // 2 - have


def _map(addr: int, length: int, flags: int, fd: int = -1, offset: int = 0) -> None:
    got = _libc.mmap(addr, length, mmap.PROT_READ | mmap.PROT_WRITE, flags | MAP_FIXED, fd, offset)
    if got == _MAP_FAILED or got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping {length} bytes of KV rows at {addr:#x} failed: {os.strerror(err)}")


def map_file(addr: int, length: int, fd: int, offset: int) -> None:
    """Pages addr..addr+length (page aligned, inside a cache's own mapping) now read the file's
    bytes from `offset`, private: a write copies the page first."""
    _map(addr, length, mmap.MAP_PRIVATE, fd, offset)


def map_zeros(addr: int, length: int) -> None:
    """Pages addr..addr+length (page aligned, inside a cache's own mapping) read as zeros again,
    fresh anonymous memory taken as written: what they held, a file's reference included, is gone."""
    _map(addr, length, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class PageFile:
    """An anonymous memory file that holds one shared prefix's pages of many caches' rows.
    `positions`: how many prefix positions it holds (what the slots' KV pool counts once, however
    many caches map it). The descriptor closes when the object is collected, which is when no
    cache's rows refer to it; the pages then live only as long as a mapping does."""

    def __init__(self, nbytes: int, positions: int):
        self.fd = os.memfd_create("moe-pipe-kv-prefix", os.MFD_CLOEXEC)
        self._close = weakref.finalize(self, os.close, self.fd)
        try:
            os.ftruncate(self.fd, nbytes)
        except OSError:
            self._close()
            raise
        self.nbytes, self.positions = nbytes, positions

    def write(self, offset: int, data: memoryview) -> None:
        """Copy `data` into the file at `offset` (the donor's pages, once)."""
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)
