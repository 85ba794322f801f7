"""A run's resources at start-up (procs/resources.py): the slab arena's pages all allocated by
the time `Resources.create` returns (on a thread beside the dense read), and a reservation
that fails failing start-up with nothing left behind."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from moe_pipe.procs.resources import Resources
from moe_pipe.shared.config import load_config
from moe_pipe.shared.experts import shm


def _ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if (p := shm.parse_segment_name(n)) and p[0] == os.getpid()}


def _allocated(name: str) -> int:
    return os.stat(shm.SHM_DIR / name).st_blocks * 512


def test_every_slab_page_is_allocated_when_start_up_returns(tiny_model):
    cfg = load_config(None, {"cache.cache_mb": 64})
    with Resources.create(cfg, tiny_model) as res:
        arena = res.slabs.arena
        assert _allocated(arena.name) >= arena.size > 0
    assert not any(t.name.startswith("reserve-slabs") for t in threading.enumerate())


def test_a_slab_reservation_that_fails_fails_start_up_and_leaves_nothing(tiny_model, monkeypatch):
    def no_room(self, length: int | None = None) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.Arena, "reserve", no_room)
    before = _ours()
    cfg = load_config(None, {"cache.cache_mb": 64})
    with pytest.raises(OSError) as err:
        Resources.create(cfg, tiny_model)
    assert err.value.errno == errno.ENOSPC
    assert _ours() == before  # the arenas made before it failed are gone
    assert not any(t.name.startswith("reserve-slabs") for t in threading.enumerate())
