"""Shared-memory arenas: one owner, attach by name, stale segments found by pid."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from moe_pipe.shared.experts import shm
from moe_pipe.shared.experts.shm import PAGE, Arena, SlabArena, parse_segment_name, segment_name


def _dead_pid() -> int:
    # Above pid_max no process can exist: kill(pid, 0) gives ESRCH.
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


DEAD_PID = _dead_pid()


def _ours() -> set[str]:
    names = set()
    for name in os.listdir(shm.SHM_DIR):
        parsed = parse_segment_name(name)
        if parsed and parsed[0] in (os.getpid(), DEAD_PID):
            names.add(name)
    return names


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test leaves /dev/shm as it found it (for segments this process names)."""
    before = _ours()
    yield
    leaked = _ours() - before
    for name in leaked:  # clean up, then fail: a leak must not outlive the run
        os.unlink(shm.SHM_DIR / name)
    assert not leaked, f"left in /dev/shm: {sorted(leaked)}"


def unique(kind: str = "t", pid: int | None = None) -> str:
    return segment_name(f"{kind}-{uuid.uuid4().hex[:8]}", pid)


def test_segment_name_round_trip():
    name = segment_name("slabs", 4242)
    assert name == "moe-pipe-4242-slabs"
    assert parse_segment_name(name) == (4242, "slabs")
    assert parse_segment_name(segment_name("dense-v2")) == (os.getpid(), "dense-v2")
    assert parse_segment_name("psm_1234") is None
    with pytest.raises(ValueError):
        segment_name("a/b")


def test_create_is_exclusive_private_and_sized():
    name = unique()
    with Arena.create(name, 3 * PAGE + 5) as a:
        st = os.stat(shm.SHM_DIR / name)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 3 * PAGE + 5
        assert a.buf.dtype == np.uint8 and a.buf.size == 3 * PAGE + 5
        assert a.buf.ctypes.data % PAGE == 0
        with pytest.raises(FileExistsError):
            Arena.create(name, PAGE)
    assert not (shm.SHM_DIR / name).exists()


@pytest.mark.parametrize("bad", ["", "a/b", "..", "."])
def test_bad_names_refused(bad):
    with pytest.raises(ValueError):
        Arena.create(bad, PAGE)


@pytest.mark.integration
def test_subprocess_attach_sees_and_writes_the_same_bytes():
    name = unique()
    with Arena.create(name, 2 * PAGE) as a:
        a.buf[:] = np.arange(2 * PAGE, dtype=np.uint32).astype(np.uint8)
        child = textwrap.dedent(f"""
            import hashlib
            from moe_pipe.shared.experts.shm import Arena
            ro = Arena.attach({name!r})
            print(hashlib.sha256(ro.buf.tobytes()).hexdigest())
            ro.close()
            rw = Arena.attach({name!r}, readonly=False)
            rw.buf[7] = 0xAB
            rw.close()
        """)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == hashlib.sha256(np.arange(2 * PAGE, dtype=np.uint32).astype(np.uint8).tobytes()).hexdigest()
        assert a.buf[7] == 0xAB  # the child's write is visible to the owner
        assert "Warning" not in out.stderr and "leaked" not in out.stderr
    # the attaching process's exit did not unlink anything behind the owner's back
    assert not (shm.SHM_DIR / name).exists()


def test_readonly_attach_cannot_write():
    name = unique()
    with Arena.create(name, PAGE) as owner:
        owner.buf[0] = 9
        ro = Arena.attach(name)
        assert ro.readonly and not ro.buf.flags.writeable and ro.buf[0] == 9
        with pytest.raises(ValueError):
            ro.buf[0] = 1
        with pytest.raises(ValueError):  # the mapping itself is PROT_READ: no way back to writable
            ro.buf.setflags(write=True)
        with pytest.raises(PermissionError):
            ro.unlink()  # only the owner unlinks
        ro.close()
        assert owner.buf[0] == 9


def test_unlink_removes_entry_and_is_idempotent():
    name = unique()
    a = Arena.create(name, PAGE)
    view = a.buf
    a.unlink()
    assert not (shm.SHM_DIR / name).exists()
    a.unlink()
    view[0] = 1  # the mapping outlives the name
    with pytest.raises(FileNotFoundError):
        Arena.attach(name)
    del view
    a.close()
    a.close()
    assert a.closed
    with pytest.raises(ValueError):
        _ = a.buf


def test_close_with_a_live_view_is_safe():
    name = unique()
    a = Arena.create(name, PAGE)
    view = a.buf[10:20]
    a.close()  # BufferError inside mmap.close is absorbed; the view stays usable
    view[:] = 3
    assert view.sum() == 30
    a.unlink()


def test_slab_arena_slabs_are_page_aligned_and_disjoint():
    name = unique("slabs")
    with SlabArena.create(name, 5, 3 * PAGE) as sa:
        assert sa.n_slabs == 5 and sa.arena.size == 15 * PAGE
        for k in range(5):
            s = sa.slab(k)
            assert s.size == 3 * PAGE and s.ctypes.data % PAGE == 0
            assert s.ctypes.data == sa.arena.buf.ctypes.data + k * 3 * PAGE
            s[:] = k
        ro = SlabArena.attach(name, 3 * PAGE)
        assert [int(ro.slab(k)[0]) for k in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(IndexError):
            ro.slab(5)
        with pytest.raises(ValueError):
            SlabArena.attach(name, 2 * PAGE)  # 15 pages are not whole 2-page slabs
        ro.close()


def test_a_released_slab_gives_its_pages_back_and_reads_zeros():
    """The KV cache's loan: a retired slab's pages leave the segment (its allocated
    blocks drop by exactly the slab), its neighbours keep their bytes, and it is
    whole again once written; a read-only mapping cannot release anything."""
    name = unique("slabs")
    with SlabArena.create(name, 4, 2 * PAGE) as sa:
        sa.arena.buf[:] = 7
        held = lambda: os.stat(shm.SHM_DIR / name).st_blocks * 512  # noqa: E731
        before = held()
        assert before == 8 * PAGE
        assert sa.release_slab(2)
        assert held() == before - 2 * PAGE
        assert not sa.slab(2).any() and (sa.slab(1) == 7).all() and (sa.slab(3) == 7).all()
        sa.slab(2)[:] = 1
        assert held() == before
        ro = SlabArena.attach(name, 2 * PAGE)
        assert not ro.release_slab(1) and held() == before
        ro.close()
        with pytest.raises(IndexError):
            sa.release_slab(4)


@pytest.mark.parametrize("slab_bytes,n", [(1000, 2), (0, 2), (PAGE, 0)])
def test_slab_arena_refuses_bad_geometry(slab_bytes, n):
    with pytest.raises(ValueError):
        SlabArena.create(unique("slabs"), n, slab_bytes)


def test_stale_segments_by_pid():
    dead = unique("stale", DEAD_PID)
    live = unique("live")
    with Arena.create(dead, PAGE) as a_dead, Arena.create(live, PAGE):
        stale = shm.stale_segments()
        assert dead in stale and live not in stale
        a_dead.unlink()
        assert dead not in shm.stale_segments()


def test_reclaim_stale_only_dead_owners(tmp_path, monkeypatch):
    # A private directory stands in for /dev/shm, so no one else's segment is touched.
    names = {"dead": segment_name("slabs", DEAD_PID), "live": segment_name("slabs"), "init": segment_name("dense", 1), "other": "psm_123"}
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    assert shm.reclaim_stale(tmp_path) == [names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")
    # A live pid that started after the segment was made is a reused pid: stale.
    monkeypatch.setattr(shm, "_process_start", lambda pid: 2e10 if pid == 1 else None)
    assert shm.stale_segments(tmp_path) == [names["init"]]


def test_a_segment_made_without_its_pages_has_them_all_once_reserved():
    """Arena.create sizes a segment and Arena.reserve allocates it (start-up runs it on a
    thread, beside the dense read): every page of the segment's file, counted by its blocks."""
    a = Arena.create(segment_name(f"reserve-{uuid.uuid4().hex[:8]}"), 8 * 1024 * 1024)
    try:
        blocks = lambda: os.stat(shm.SHM_DIR / a.name).st_blocks * 512  # noqa: E731
        assert blocks() == 0  # sized, not allocated
        a.reserve()
        assert blocks() >= a.size
    finally:
        a.close()
        a.unlink()
