"""Mapping an arena's pages into a process ahead of the reads that fill it.

An O_DIRECT read pins its destination pages first; a page this process has
not mapped yet (and, in a segment that was not fallocated, one that does not
exist yet) is faulted in right there, inside the read, one page at a time.
On this machine that halves the fill's rate (bench/bench_fill.py,
docs/warmup-analysis.md § Populated slabs). A `Populator` does the same
faulting on a thread of its own, front to back, before the reads get there:

    arena:  | populated ........ | ← populator | not yet mapped ............ |
            0   ^ reads land here, slab 0, 1, 2, ... (the slot table hands
                  out free slots in ascending order, so the fill front follows)

The kernel does the work (madvise MADV_POPULATE_WRITE / _READ) with the GIL
released, so the thread costs the process nothing but that kernel time,
which the reads would otherwise have paid on their own path. It never
changes a byte: pages already read into stay as they are.
"""

from __future__ import annotations

import logging
import threading
import time

from moe_pipe.shared.experts.shm import Arena

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20  # one madvise: long enough to amortise the call, short enough to stop promptly


class Populator:
    """Populates `arena` [start, end) in CHUNK_BYTES steps on a daemon thread."""

    def __init__(self, arena: Arena, *, start: int = 0, end: int | None = None, what: str = "arena"):
        self.arena = arena
        self.start_at, self.end = start, arena.size if end is None else min(end, arena.size)
        self.what = what
        self.done_bytes = 0
        self.seconds = 0.0
        self.supported = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"populate-{what}", daemon=True)

    def start(self) -> Populator:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        at = self.start_at
        while at < self.end and not self._stop.is_set():
            n = min(CHUNK_BYTES, self.end - at)
            if not self.arena.populate(at, n):
                self.supported = at > self.start_at  # a closed arena after some progress is a stop, not a lack
                break
            at += n
            self.done_bytes = at - self.start_at
        self.seconds = time.perf_counter() - t0
        if not self.supported:
            log.info("%s: the kernel cannot populate pages ahead (MADV_POPULATE needs Linux 5.14+)", self.what)

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once the thread has finished (all populated, stopped or unsupported)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the chunk under way and wait for it (before the arena is unmapped)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
