"""The reader's I/O lanes: `n` threads taking reads from two queues.

    demand   reads compute is (or soon will be) waiting for    FIFO, always first
    guess    speculative next-layer reads (prefetch)            FIFO, only when no demand waits

A guess that compute then asks for is promoted to the demand queue; a guess
still queued when its layer's real request arrives and was not asked for is
withdrawn (`withdraw_guesses`), so a wrong guess costs bandwidth only if it
had already started. A read once started always runs to its end (a pread
cannot be taken back). The queues hold keys only; what a read does is the
`work(key, slot)` function each lane calls, outside the lock.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

Key = Hashable


class ReadLanes:
    def __init__(self, n: int, work: Callable[[Key, int], None], name: str = "io-lane"):
        if n < 1:
            raise ValueError(f"a reader needs at least one lane, got {n}")
        self._work = work
        self._cond = threading.Condition()
        self._demand: OrderedDict[Key, int] = OrderedDict()  # key -> slot, oldest first
        self._guess: OrderedDict[Key, int] = OrderedDict()
        self._closed = False
        self._threads = [threading.Thread(target=self._lane, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, key: Key, slot: int, guess: bool = False) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the read lanes are shut down")
            (self._guess if guess else self._demand)[key] = slot
            self._cond.notify()

    def promote(self, key: Key) -> bool:
        """A queued guess is now wanted: move it to the demand queue (its end).
        False if it is not a queued guess (already started, or never one)."""
        with self._cond:
            slot = self._guess.pop(key, None)
            if slot is None:
                return False
            self._demand[key] = slot
            return True

    def withdraw_guesses(self, keep=frozenset()) -> list[tuple[Key, int]]:
        """Take every queued (not started) guess out, except those in `keep`;
        returns the withdrawn (key, slot)s for the caller to free."""
        with self._cond:
            gone = [(k, s) for k, s in self._guess.items() if k not in keep]
            for k, _ in gone:
                del self._guess[k]
            return gone

    def queued(self) -> tuple[list[Key], list[Key]]:
        """(demand, guess) keys waiting for a lane, oldest first (for tests and status)."""
        with self._cond:
            return list(self._demand), list(self._guess)

    def _next(self) -> tuple[Key, int] | None:
        with self._cond:
            while not (self._demand or self._guess or self._closed):
                self._cond.wait()
            if self._demand:
                return self._demand.popitem(last=False)
            if self._guess:
                return self._guess.popitem(last=False)
            return None  # closed and drained of nothing to do

    def _lane(self) -> None:
        while (job := self._next()) is not None:
            self._work(*job)

    def shutdown(self) -> None:
        """Drop what is queued, let the started reads finish, join the lanes."""
        with self._cond:
            self._closed = True
            self._demand.clear()
            self._guess.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join()
