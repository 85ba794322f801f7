"""The residency index: which slab holds each (layer, expert), published by
the reader in shared memory so that compute finds cache hits without a round
trip.

    index arena:  int32 [n_layer, n_expert]   0 = not resident, s + 1 = in slab s

The reader is the only writer. It publishes an entry only when the slab's
bytes are complete, and clears it before the slab is given to another expert.
Compute reads the entries of one layer, computes the resident experts at once
and lists them in its Fetch (`resident`) so the reader pins them before it
admits anything; only misses get a Ready. This is safe because slabs are
evicted only while the reader handles compute's own fetches, in order — a
prefetch never evicts (it only fills free slabs).
"""

from __future__ import annotations

import numpy as np

from moe_pipe.shared.experts.shm import Arena, segment_name


class ResidencyIndex:
    def __init__(self, arena: Arena, n_layer: int, n_expert: int):
        self.arena = arena
        self._table: np.ndarray | None = arena.buf[: 4 * n_layer * n_expert].view(np.int32).reshape(n_layer, n_expert)

    @property
    def table(self) -> np.ndarray:
        """The index itself, int32 [n_layer, n_expert] (see the module docstring)."""
        if self._table is None:
            raise ValueError(f"residency index {self.arena.name!r} is closed")
        return self._table

    @staticmethod
    def nbytes(spec) -> int:
        return max(4 * spec.n_layer * spec.n_expert, 4096)

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

    def publish(self, key: tuple[int, int], slot: int) -> None:
        self.table[key] = slot + 1

    def clear(self, key: tuple[int, int]) -> None:
        self.table[key] = 0

    def slots(self, layer: int, experts) -> list[int]:
        """Slab of each expert of `layer`, or -1 where it is not resident."""
        row = self.table[layer]
        return [int(row[e]) - 1 for e in experts]

    def entries(self) -> list[tuple[tuple[int, int], int]]:
        """((layer, expert), slot) of every published entry: what a restarted
        reader takes over (each slab's bytes were complete when published)."""
        layers, experts = np.nonzero(self.table)
        return [((int(l), int(e)), int(self.table[l, e]) - 1) for l, e in zip(layers, experts)]

    def close(self) -> None:
        self._table = None  # drop our view first: the arena unmaps only once no view points in
        self.arena.close()

    def unlink(self) -> None:
        self.arena.unlink()
