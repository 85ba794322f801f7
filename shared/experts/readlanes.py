"""The reader's I/O lanes: `n` threads taking reads from three queues, in
order of priority:

    DEMAND      reads compute is (or soon will be) waiting for
    GUESS       next-layer guesses (prefetch)
    BACKGROUND  a warm start's reads, filling free slabs

each FIFO; a lane takes from a queue only when those above it are empty.
With two lanes or more, guesses and background reads together run on all
lanes but one: a read once started cannot be taken back, so a lane is always
free (or about to take a demand read) when compute's next miss arrives,
instead of that miss waiting behind guesses that may be wrong or a warm
start's reads. With one lane a demand read waits for at most the one read
under way. A queued guess or background read that compute then asks for is promoted to
the demand queue. Guesses still queued when their layer's real request
arrives without them are withdrawn (`withdraw_guesses`), so a wrong guess
costs bandwidth only if it had already started; background reads are
withdrawn only when a request needs their slabs (`withdraw_background`). A read once started always runs to its end (a pread cannot be
taken back). The queues hold keys only; what a read does is the
`work(key, slab)` function each lane calls, outside the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from enum import IntEnum

Key = Hashable


class Priority(IntEnum):
    DEMAND = 0
    GUESS = 1
    BACKGROUND = 2


class ReadLanes:
    def __init__(self, n: int, work: Callable[[Key, int], None], name: str = "io-lane"):
        if n < 1:
            raise ValueError(f"a reader needs at least one lane, got {n}")
        self._work = work
        self._cond = threading.Condition()
        self._queues: list[OrderedDict[Key, int]] = [OrderedDict() for _ in Priority]  # key -> slab, oldest first
        self._closed = False
        self._max_speculative = max(1, n - 1)  # lanes that may run guesses and background reads at once (one kept for demand)
        self._speculative = 0
        self._threads = [threading.Thread(target=self._lane, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, key: Key, slab: int, priority: Priority = Priority.DEMAND) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the read lanes are shut down")
            self._queues[priority][key] = slab
            self._cond.notify()

    def promote(self, key: Key) -> bool:
        """A queued guess or background read is now wanted: move it to the end
        of the demand queue. False if it is not queued below demand (already
        started, or a demand read)."""
        with self._cond:
            for queue in self._queues[Priority.GUESS :]:
                slab = queue.pop(key, None)
                if slab is not None:
                    self._queues[Priority.DEMAND][key] = slab
                    return True
            return False

    def withdraw_guesses(self, keep=frozenset()) -> list[tuple[Key, int]]:
        """Take every queued (not started) guess out, except those in `keep`;
        returns the withdrawn (key, slab)s for the caller to free."""
        with self._cond:
            guesses = self._queues[Priority.GUESS]
            gone = [(k, s) for k, s in guesses.items() if k not in keep]
            for k, _ in gone:
                del guesses[k]
            return gone

    def withdraw_background(self) -> list[tuple[Key, int]]:
        """Take every queued (not started) background read out; returns their
        (key, slab)s for the caller to free (a request needs the slabs)."""
        with self._cond:
            gone = list(self._queues[Priority.BACKGROUND].items())
            self._queues[Priority.BACKGROUND].clear()
            return gone

    def queued(self) -> tuple[list[Key], ...]:
        """The keys waiting for a lane, per priority (demand, guess, background),
        oldest first (for tests and status)."""
        with self._cond:
            return tuple(list(q) for q in self._queues)

    def _take(self) -> tuple[Key, int, bool] | None:
        """The first read this lane may start (key, slab, is speculative: a guess
        or a background read), or None."""
        for priority, queue in zip(Priority, self._queues):
            if queue and (priority == Priority.DEMAND or self._speculative < self._max_speculative):
                key, slab = queue.popitem(last=False)
                return key, slab, priority != Priority.DEMAND
        return None

    def _next(self) -> tuple[Key, int, bool] | None:
        with self._cond:
            while not self._closed:
                job = self._take()
                if job is not None:
                    self._speculative += job[2]
                    return job
                self._cond.wait()
            return None

    def _lane(self) -> None:
        while (job := self._next()) is not None:
            key, slab, speculative = job
            try:
                self._work(key, slab)
            finally:
                if speculative:
                    with self._cond:
                        self._speculative -= 1
                        self._cond.notify()  # a lane waiting for its turn at a speculative read may go

    def shutdown(self) -> None:
        """Drop what is queued, let the started reads finish, join the lanes."""
        with self._cond:
            self._closed = True
            for queue in self._queues:
                queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join()
