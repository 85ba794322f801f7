"""compute's own read lanes: a miss read straight into a slab the reader lent compute.

A miss through the reader crosses two processes twice: compute's Fetch wakes the
reader, which admits the miss (choosing a victim) and hands it to a lane; the lane's
result goes back to the reader's loop, which answers Ready. On two cores each wake runs
on the core compute is using, so a steady token's ~10 misses cost ~0.5 ms of compute's
time each in sends beside ~0.8 ms of hand-offs on top of the read itself
(docs/benchmarks.md § Where a miss's time goes). Here compute reads into a slab it
holds already, on lanes of its own: submitting is a queue put, the answer a queue get,
and the reader hears of the token's reads once, at its end
(docs/architecture.md § compute's own reads).

Each read's result comes back through one queue in the order the reads end:
(key, slab, io_ns, error or None).
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Sequence
from typing import cast

from ..gguf.layout import Layout
from .directio import ExpertFiles, describe_os_error
from .readlanes import Key, ReadLanes
from .shm import SlabArena

ReadResult = tuple[Key, int, int, str | None]

# At most this share of the cache is lent to compute (one slab at least): the slabs lent are not
# the cache's while lent, so the cache is that much smaller. On gptoss120b-shape at file / 5.2
# (290 slabs of 13 MB, ~27 misses a token) 1/16 of it cost 2.5 points of hits and more than
# the reads saved (docs/benchmarks.md § compute's own reads).
MOST_LENT = 1 / 64


def lent_slabs(asked: int, n_slabs: int, per_token: int, every_expert: int) -> int:
    """The slabs compute holds to read its own misses into: io.compute_reads, at most
    MOST_LENT of the `n_slabs` the cache always has (one at least), and never so many that the
    rest would not hold a layer's `per_token` experts; none when the cache holds every one of the
    model's `every_expert` experts (nothing is read twice: a lent slab would only make a miss)."""
    if n_slabs >= every_expert:
        return 0
    return max(0, min(asked, max(1, int(n_slabs * MOST_LENT)), n_slabs - per_token))


class LentReads:
    """`lanes` threads reading experts of `layout` from `paths` into slabs of `arena`."""

    def __init__(
        self, paths: Sequence[str | os.PathLike], layout: Layout, arena: SlabArena, lanes: int, identity: Sequence[str] | None = None
    ):
        self.layout, self.arena = layout, arena
        self.files = ExpertFiles(paths, identity=identity or None, align=layout.align)
        self.results: queue.SimpleQueue[ReadResult] = queue.SimpleQueue()
        self.pending = 0  # reads submitted whose result has not been taken
        self.lanes = ReadLanes(lanes, self._read, name="lent-read")

    def submit(self, key: tuple[int, int], slab: int) -> None:
        self.pending += 1
        self.lanes.submit(key, slab)

    def next_result(self) -> ReadResult:
        """The next read to end (blocks; the GIL is free meanwhile)."""
        result = self.results.get()
        self.pending -= 1
        return result

    def drain(self) -> list[ReadResult]:
        """Wait for every read under way (a pass left early): a slab is reused only once its read is over."""
        return [self.next_result() for _ in range(self.pending)]

    def _read(self, key: Key, slab: int) -> None:
        layer, expert = cast(tuple[int, int], key)  # the lanes hold what submit gave them
        t0 = time.perf_counter_ns()
        try:
            self.files.read_expert(self.layout.expert_extents(layer, expert), self.arena.slab(slab))
            self.results.put((key, slab, time.perf_counter_ns() - t0, None))
        except Exception as exc:  # noqa: BLE001 - a failed read goes to the reader's path, which reports it
            self.results.put((key, slab, time.perf_counter_ns() - t0, describe_os_error(exc)))

    def close(self) -> None:
        self.drain()
        self.lanes.shutdown()
        self.files.close()
