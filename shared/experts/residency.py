"""The residency index: which slab holds each (layer, expert), published by
the reader in shared memory so that compute finds cache hits without a round
trip; beside it, what the reader is doing with each expert, for the web page.

    index arena:  table   int32 [n_layer, n_expert]   0 = not resident, s + 1 = in slab s
                  states  uint8 [n_layer, n_expert]   PINNED | INFLIGHT bits (after the table)
                  usable  int64, 8-aligned after them  slabs the cache may hold; 0 = all

`states` mirrors the reader's slab table: PINNED while the key has any pin
(a request using it, or its own read), INFLIGHT while its read is under way.
Compute never reads it; the gateway copies it a few times a second
(procs/gateway_events.py). One byte store per change, by the one writer, so
the reader never waits on a reader of it; a copy may mix two moments, which a
picture refreshed four times a second can afford.

The reader is the only writer. It publishes an entry only when the slab's
bytes are complete, and clears it before the slab is given to another expert.
Compute reads the entries of one layer, computes the resident experts at once
and lists them in its Fetch (`resident`) so the reader pins them before it
admits anything; only misses get a Ready. This is safe because slabs are
evicted only while the reader handles compute's own fetches, in order (a
next-layer guess is admitted while its Fetch is handled too; a warm start
only fills free slabs): docs/architecture.md § Wire protocol.
"""

from __future__ import annotations

import numpy as np

from .shm import Arena, segment_name

PINNED = 1  # states bit: the reader's slab table holds a pin on the key
INFLIGHT = 2  # states bit: the key's read is under way (its slab is not complete yet)


def _usable_at(n_layer: int, n_expert: int) -> int:
    return -(-5 * n_layer * n_expert // 8) * 8


class ResidencyIndex:
    def __init__(self, arena: Arena, n_layer: int, n_expert: int):
        self.arena = arena
        cells = n_layer * n_expert
        self._table: np.ndarray | None = arena.buf[: 4 * cells].view(np.int32).reshape(n_layer, n_expert)
        self._states: np.ndarray | None = arena.buf[4 * cells : 5 * cells].reshape(n_layer, n_expert)
        at = _usable_at(n_layer, n_expert)
        self._usable: np.ndarray | None = arena.buf[at : at + 8].view(np.int64)

    @property
    def table(self) -> np.ndarray:
        """The index itself, int32 [n_layer, n_expert] (see the module docstring)."""
        if self._table is None:
            raise ValueError(f"residency index {self.arena.name!r} is closed")
        return self._table

    @property
    def states(self) -> np.ndarray:
        """The reader's PINNED / INFLIGHT bits, uint8 [n_layer, n_expert] (see the module docstring)."""
        if self._states is None:
            raise ValueError(f"residency index {self.arena.name!r} is closed")
        return self._states

    @property
    def usable(self) -> int:
        """The slabs the reader holds the cache to (0: all of them): what the KV cache
        has taken back of the memory it lent (docs/architecture.md § The KV cache's
        loan). Kept here so that a restarted reader holds to it before it reads anything."""
        if self._usable is None:
            raise ValueError(f"residency index {self.arena.name!r} is closed")
        return int(self._usable[0])

    @usable.setter
    def usable(self, n: int) -> None:
        if self._usable is None:
            raise ValueError(f"residency index {self.arena.name!r} is closed")
        self._usable[0] = n

    @staticmethod
    def nbytes(spec) -> int:
        return max(_usable_at(spec.n_layer, spec.n_expert) + 8, 4096)

    @classmethod
    def create(cls, spec) -> ResidencyIndex:
        arena = Arena.create(segment_name("index"), cls.nbytes(spec))
        return cls(arena, spec.n_layer, spec.n_expert)

    @classmethod
    def attach(cls, name: str, spec, writable: bool = False) -> ResidencyIndex:
        return cls(Arena.attach(name, readonly=not writable), spec.n_layer, spec.n_expert)

    @property
    def name(self) -> str:
        return self.arena.name

    def publish(self, key: tuple[int, int], slab: int) -> None:
        self.table[key] = slab + 1

    def clear(self, key: tuple[int, int]) -> None:
        self.table[key] = 0

    def mark_pinned(self, key: tuple[int, int], on: bool) -> None:
        self._mark(key, PINNED, on)

    def mark_inflight(self, key: tuple[int, int], on: bool) -> None:
        self._mark(key, INFLIGHT, on)

    def _mark(self, key: tuple[int, int], bit: int, on: bool) -> None:
        states = self.states
        states[key] = (states[key] | bit) if on else (states[key] & (0xFF ^ bit))

    def clear_states(self) -> None:
        """Forget every pin and read: a new reader starts with none (the last one's died with it)."""
        self.states[:] = 0

    def slabs(self, layer: int, experts) -> list[int]:
        """Slab of each expert of `layer`, or -1 where it is not resident."""
        row = self.table[layer]
        return [int(row[e]) - 1 for e in experts]

    def reading(self, layer: int, experts) -> bool:
        """Is any of these experts of `layer` being read by the reader now (INFLIGHT)?"""
        row = self.states[layer]
        return any(row[e] & INFLIGHT for e in experts)

    def entries(self) -> list[tuple[tuple[int, int], int]]:
        """((layer, expert), slab) of every published entry: what a restarted
        reader takes over (each slab's bytes were complete when published)."""
        layers, experts = np.nonzero(self.table)
        return [((int(l), int(e)), int(self.table[l, e]) - 1) for l, e in zip(layers, experts)]

    def close(self) -> None:
        self._table = self._states = self._usable = None  # drop our views first: the arena unmaps only once no view points in
        self.arena.close()

    def unlink(self) -> None:
        self.arena.unlink()
