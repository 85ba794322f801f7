"""Populating an arena ahead of its reads: pages mapped, bytes unchanged, a clean stop."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.experts import populate
from moe_pipe.shared.experts.populate import Populator
from moe_pipe.shared.experts.shm import Arena, segment_name

MiB = 1 << 20


def mapped_bytes(arena: Arena) -> int:
    """This process's resident bytes of the arena's mapping (/proc/self/smaps Rss)."""
    start = arena.buf.ctypes.data
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        span = line.split()[0]
        if "-" in span and int(span.split("-")[0], 16) == start:
            rss = next(ln for ln in lines[i + 1 :] if ln.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError("mapping not found in /proc/self/smaps")


@pytest.fixture
def arena():
    a = Arena.create(segment_name("poptest"), 64 * MiB)
    a.reserve()
    yield a
    a.close()
    a.unlink()


def test_populate_maps_every_page_and_changes_no_byte(arena):
    arena.buf[5 * MiB : 5 * MiB + 3] = (7, 8, 9)  # a slab already read into
    reader = Arena.attach(arena.name, readonly=False)
    try:
        assert mapped_bytes(reader) == 0
        p = Populator(reader, what="test").start()
        assert p.wait(30)
        assert p.supported and p.done_bytes == reader.size
        assert mapped_bytes(reader) == reader.size
        assert list(reader.buf[5 * MiB : 5 * MiB + 4]) == [7, 8, 9, 0]
    finally:
        reader.close()


def test_a_read_only_mapping_is_populated_for_reading(arena):
    ro = Arena.attach(arena.name, readonly=True)
    try:
        assert ro.populate(MiB + 1, 10)  # page-rounded outwards
        assert mapped_bytes(ro) == 4096
        with pytest.raises(ValueError):
            ro.buf[0] = 1
    finally:
        ro.close()


def test_a_range_is_populated_and_stop_ends_the_thread(arena, monkeypatch):
    monkeypatch.setattr(populate, "CHUNK_BYTES", MiB)
    p = Populator(arena, start=8 * MiB, end=16 * MiB).start()
    assert p.wait(30) and p.done_bytes == 8 * MiB
    q = Populator(arena)
    q.stop()  # never started: nothing to wait for
    r = Populator(arena).start()
    r.stop()
    assert r.wait(0) and r.done_bytes <= arena.size


def test_a_closed_arena_is_not_populated(arena):
    other = Arena.attach(arena.name, readonly=False)
    other.close()
    assert not other.populate(0, MiB)
    p = Populator(other).start()
    assert p.wait(10) and not p.supported and p.done_bytes == 0


def test_populated_pages_are_the_same_memory_the_owner_writes(arena):
    reader = Arena.attach(arena.name, readonly=False)
    try:
        reader.populate(0, reader.size)
        arena.buf[: 4 * MiB] = np.arange(4 * MiB, dtype=np.uint64).astype(np.uint8)
        assert np.array_equal(reader.buf[: 4 * MiB], arena.buf[: 4 * MiB])
    finally:
        reader.close()
