"""Mapping an arena's pages into a process ahead of the reads that fill it.

An O_DIRECT read pins its destination pages first; a page this process has
not mapped yet (and, in a segment that was not fallocated, one that does not
exist yet) is faulted in right there, inside the read, one page at a time.
On this machine that halves the fill's rate (bench/bench_fill.py,
docs/warmup-analysis.md § Populated slabs). A `Populator` does the same
faulting on a thread of its own, front to back, before the reads get there:

    arena:  | populated ........ | ← populator | not yet mapped ............ |
            0   ^ reads land here, slab 0, 1, 2, ... (the slab table hands
                  out free slabs in ascending order, so the fill front follows)

The kernel does the work (madvise MADV_POPULATE_WRITE / _READ) with the GIL
released, so the thread costs the process nothing but that kernel time,
which the reads would otherwise have paid on their own path; it runs at the
lowest priority so that time comes from cores compute leaves idle. It never
changes a byte: pages already read into stay as they are.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from .shm import Arena

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20  # one madvise: long enough to amortise the call, short enough to stop promptly


def _yield_to_compute() -> None:
    """Lower this thread's priority to the least (nice 19; Linux takes a thread id).

    Compute's kernels run on every core in lock-step, so a populate chunk
    holding a core stalls each parallel call until the scheduler switches. At
    nice 19 the populate takes the time compute leaves idle (while the dense
    set loads, while the kernel warm-up runs on one thread, while a token waits
    for its reads) and gives a core back at once. Measured at full depth
    (qwen30b-shape, 48 layers, file / 1.6, 256 tokens, medians of 2 fresh-copy
    runs, the kernel warm-up on one thread in both; docs/warmup-analysis.md
    § Populated slabs): first token 5.19 s and tokens 2-50 229 ms at nice 19,
    5.59 s and 307 ms at equal priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: populate at the process's priority
        pass


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
        _yield_to_compute()
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
