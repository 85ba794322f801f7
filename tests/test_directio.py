"""Reading experts and the dense set into page-aligned shared memory, O_DIRECT and buffered."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from moe_pipe.shared.experts import directio
from moe_pipe.shared.experts.directio import DiskReadError, ExpertFiles, aligned_buffer
from moe_pipe.shared.experts.placement import expert_view, placement_for
from moe_pipe.shared.experts.shm import SlabArena, segment_name
from moe_pipe.shared.gguf.alignment import PAGE_SIZE as PAGE  # ExpertFiles' alignment here (no MOE_PIPE_IO_ALIGN set)
from moe_pipe.shared.gguf.layout import Extent, aligned_bytes
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.model.weights import FileExperts

from .ggufgen import write_qwen_like

REPO_TMP = Path(__file__).resolve().parent.parent / ".pytest-tmp"


def odirect_works(folder: Path) -> bool:
    probe = folder / f"probe-{uuid.uuid4().hex[:8]}"
    probe.write_bytes(b"\0" * PAGE)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [aligned_buffer(PAGE)], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture(scope="module")
def direct_dir(tmp_path_factory):
    """A folder where O_DIRECT works: pytest's tmp if it allows it (not tmpfs
    on older kernels), else one under the repo, removed afterwards."""
    tmp = tmp_path_factory.mktemp("directio")
    if odirect_works(tmp):
        yield tmp
        return
    REPO_TMP.mkdir(exist_ok=True)
    folder = REPO_TMP / f"directio-{os.getpid()}"
    folder.mkdir()
    try:
        if not odirect_works(folder):
            pytest.skip("no folder here accepts O_DIRECT")
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        try:
            REPO_TMP.rmdir()
        except OSError:  # someone else's run still uses it
            pass


@pytest.fixture(scope="module")
def models(direct_dir):
    from moe_pipe.shared.makemodel.maker import make_model

    return {
        "gpt-oss": make_model("gpt-oss", "tiny", direct_dir / "gptoss.gguf"),
        "qwen3moe": make_model("qwen3moe", "tiny", direct_dir / "qwen.gguf"),
        # 64-aligned tensors and Q4_0 strides that are not page multiples
        "align64": write_qwen_like(direct_dir / "a64.gguf", n_layer=2, n_expert=6, n_embd=128, n_ff=96, alignment=64, expert_qtype=QT.Q4_0),
    }


@pytest.fixture
def arena():
    made = []

    def make(n_slabs, slab_bytes):
        made.append(SlabArena.create(segment_name(f"test-dio-{uuid.uuid4().hex[:8]}"), n_slabs, slab_bytes))
        return made[-1]

    yield make
    for a in made:
        a.close()
        a.unlink()


def expected_part(mf, part, e) -> np.ndarray:
    return mf.gguf.view(part.tensor.name)[e].reshape(-1).view(np.uint8)


def check_every_expert(mf, ef, arena) -> int:
    """Read every expert of every layer through a few slabs; compare every part."""
    sa = arena(3, mf.layout.slab_bytes)
    n = 0
    for lay in mf.layout.layers:
        for e in range(mf.spec.n_expert):
            slab = sa.slab(n % sa.n_slabs)
            slab[:] = 0xEE  # stale bytes from the last occupant must not matter
            pl = ef.read_expert(lay.extents(e), slab)
            assert pl.regions == placement_for(lay.extents(e), mf.layout.align).regions  # compute can rebuild it
            assert len(pl.regions) == len(lay.parts)
            assert pl.disk_bytes <= aligned_bytes(lay.extents(e), mf.layout.align)
            for part, (at, length) in zip(lay.parts, pl.regions):
                want = expected_part(mf, part, e)
                assert length == want.size, (lay.layer, e, part.name)
                assert np.array_equal(slab[at : at + length], want), (lay.layer, e, part.name)
            n += 1
    return n


@pytest.mark.parametrize("name", ["gpt-oss", "qwen3moe", "align64"])
def test_every_expert_lands_byte_exact_with_o_direct(models, arena, name):
    with open_model(models[name]) as mf, ExpertFiles(mf.gguf.paths) as ef:
        assert ef.direct and ef.fallback_reason is None  # O_DIRECT really used
        assert check_every_expert(mf, ef, arena) == mf.spec.n_layer * mf.spec.n_expert


@pytest.mark.parametrize("name", ["gpt-oss", "align64"])
def test_forced_buffered_path_gives_identical_bytes(models, arena, name):
    with open_model(models[name]) as mf, ExpertFiles(mf.gguf.paths, direct=False) as ef:
        assert not ef.direct and ef.fallback_reason
        check_every_expert(mf, ef, arena)


def test_open_refusal_falls_back_and_says_so_once(models, arena, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(directio.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="moe_pipe.shared.experts.directio"):
        with open_model(models["qwen3moe"]) as mf, ExpertFiles(mf.gguf.paths * 2) as ef:  # two shards, one report
            assert not ef.direct and "at open" in ef.fallback_reason
            check_every_expert(mf, ef, arena)
    assert len([r for r in caplog.records if "O_DIRECT unavailable" in r.message]) == 1


def test_read_refusal_on_first_read_falls_back(models, arena, caplog):
    calls = []

    def einval_once(path, offset, length):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")

    directio.set_fault_hook(einval_once)
    with caplog.at_level(logging.WARNING, logger="moe_pipe.shared.experts.directio"):
        with open_model(models["gpt-oss"]) as mf, ExpertFiles(mf.gguf.paths) as ef:
            assert ef.direct
            check_every_expert(mf, ef, arena)
            assert not ef.direct and "reads" in ef.fallback_reason
    assert len([r for r in caplog.records if "O_DIRECT unavailable" in r.message]) == 1


def test_einval_after_direct_reads_worked_is_a_disk_error(models, arena):
    with open_model(models["gpt-oss"]) as mf, ExpertFiles(mf.gguf.paths) as ef:
        slab = arena(1, mf.layout.slab_bytes).slab(0)
        ef.read_expert(mf.layout.expert_extents(0, 0), slab)
        directio.set_fault_hook(lambda *a: (_ for _ in ()).throw(OSError(errno.EINVAL, "Invalid argument")))
        with pytest.raises(DiskReadError):
            ef.read_expert(mf.layout.expert_extents(0, 1), slab)
        assert ef.direct


def test_expert_view_multiplies_straight_out_of_a_readonly_slab(models, arena):
    with open_model(models["qwen3moe"]) as mf, ExpertFiles(mf.gguf.paths) as ef:
        sa = arena(2, mf.layout.slab_bytes)
        lay = mf.layout.layers[1]
        pl = ef.read_expert(lay.extents(5), sa.slab(1))
        ro = SlabArena.attach(sa.arena.name, sa.slab_bytes)  # compute's read-only mapping
        try:
            ex = expert_view(lay, 5, ro.slab(1), pl)
            ref = next(FileExperts(mf).experts(1, [5]))
            assert ex.id == 5 and not ex.gate.data.flags.writeable
            assert np.shares_memory(ex.down.data, ro.slab(1))  # no copy
            for name in ("gate", "up", "down"):
                got, want = getattr(ex, name), getattr(ref, name)
                assert got.shape == want.shape and got.qtype == want.qtype
                assert np.array_equal(got.data, want.data)
            x = np.random.default_rng(0).standard_normal(ex.gate.shape[1]).astype(np.float32)
            assert np.array_equal(ex.gate(x), ref.gate(x))
            del ex
        finally:
            ro.close()


def test_expert_view_biases(models, arena):
    with open_model(models["gpt-oss"]) as mf, ExpertFiles(mf.gguf.paths) as ef:
        slab = arena(1, mf.layout.slab_bytes).slab(0)
        lay = mf.layout.layers[2]
        ex = expert_view(lay, 3, slab, ef.read_expert(lay.extents(3), slab))
        ref = next(FileExperts(mf).experts(2, [3]))
        for name in ("gate_bias", "up_bias", "down_bias"):
            assert np.array_equal(getattr(ex, name), getattr(ref, name))
        with pytest.raises(ValueError):
            expert_view(mf.layout.layers[0], 0, slab, ef.read_expert(lay.extents(3)[:2], slab))


def test_bad_slabs_are_refused(models, arena):
    with open_model(models["qwen3moe"]) as mf, ExpertFiles(mf.gguf.paths) as ef:
        ext = mf.layout.expert_extents(0, 0)
        need = aligned_bytes(ext, PAGE)
        with pytest.raises(ValueError, match="too small"):
            ef.read_expert(ext, aligned_buffer(need - PAGE))
        with pytest.raises(ValueError, match="aligned"):
            ef.read_expert(ext, aligned_buffer(need + PAGE)[8:])
        ro = aligned_buffer(need)
        ro.setflags(write=False)
        with pytest.raises(ValueError, match="read-only"):
            ef.read_expert(ext, ro)
        with pytest.raises(ValueError, match="shard"):
            ef.read_expert([Extent(1, 0, 10)], aligned_buffer(PAGE))


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def raw_file(request, direct_dir):
    """A file whose last page is partial: 3 pages + 100 bytes of known data."""
    data = np.random.default_rng(3).integers(0, 256, 3 * PAGE + 100, dtype=np.uint8)
    path = direct_dir / f"raw-{uuid.uuid4().hex[:8]}.bin"
    data.tofile(path)
    with ExpertFiles([path], direct=request.param) as ef:
        yield ef, data
    path.unlink()


@pytest.mark.parametrize("offset,length", [(2 * PAGE + 50, PAGE + 50), (3 * PAGE, 100), (10, 3 * PAGE + 90), (0, 1)])
def test_short_read_at_end_of_file(raw_file, offset, length):
    ef, data = raw_file
    dest = aligned_buffer(aligned_bytes((Extent(0, offset, length),), PAGE))
    pl = ef.read_expert([Extent(0, offset, length)], dest)
    at, n = pl.regions[0]
    assert n == length and np.array_equal(dest[at : at + n], data[offset : offset + length])


def test_extent_past_end_of_file_is_a_disk_error(raw_file):
    ef, _ = raw_file
    with pytest.raises(DiskReadError, match="ends at byte"):
        ef.read_expert([Extent(0, 3 * PAGE, 200)], aligned_buffer(PAGE))


def test_short_read_mid_file_is_resumed(raw_file, monkeypatch):
    ef, data = raw_file
    real, calls = os.preadv, []

    def short_once(fd, bufs, offset):
        r = real(fd, bufs, offset)
        calls.append(offset)
        return min(r, 1000) if len(calls) == 1 else r  # not page-sized: O_DIRECT must re-read from a page

    monkeypatch.setattr(directio.os, "preadv", short_once)
    dest = aligned_buffer(4 * PAGE)
    pl = ef.read_expert([Extent(0, 5, 3 * PAGE)], dest)
    at, n = pl.regions[0]
    assert np.array_equal(dest[at : at + n], data[5 : 5 + 3 * PAGE])
    assert len(calls) == 2 and calls[1] == (0 if ef.direct else 1000)


def test_eintr_is_retried(raw_file):
    ef, data = raw_file
    fired = []

    def interrupt_once(path, offset, length):
        if not fired:
            fired.append(1)
            raise InterruptedError(errno.EINTR, "Interrupted system call")

    directio.set_fault_hook(interrupt_once)
    dest = aligned_buffer(2 * PAGE)
    pl = ef.read_expert([Extent(0, 100, PAGE)], dest)
    assert fired and np.array_equal(dest[pl.regions[0][0] :][:PAGE], data[100 : 100 + PAGE])


def test_fault_hook_fires_as_a_disk_error(models, arena):
    seen = []

    def eio(path, offset, length):
        seen.append((path, offset, length))
        raise OSError(errno.EIO, "Input/output error")

    with open_model(models["gpt-oss"]) as mf, ExpertFiles(mf.gguf.paths) as ef:
        ext = mf.layout.expert_extents(1, 2)
        directio.set_fault_hook(eio)
        with pytest.raises(DiskReadError) as err:
            ef.read_expert(ext, arena(1, mf.layout.slab_bytes).slab(0))
        assert err.value.errno == errno.EIO and str(mf.gguf.path) in str(err.value)
        assert seen == [(str(mf.gguf.path), *directio.aligned(ext[0], PAGE)[:2])]
        directio.set_fault_hook(None)
        ef.read_expert(ext, arena(1, mf.layout.slab_bytes).slab(0))  # off again: reads work


def test_fault_env_parsing():
    assert directio._hook_from_env(None) is None and directio._hook_from_env("0") is None
    once, sticky = directio._hook_from_env("2"), directio._hook_from_env("2+")
    outcomes = []
    for hook in (once, sticky):
        row = []
        for _ in range(4):
            try:
                hook("f", 0, 1)
                row.append("ok")
            except OSError as exc:
                row.append(errno.errorcode[exc.errno])
        outcomes.append(row)
    assert outcomes == [["ok", "EIO", "ok", "ok"], ["ok", "EIO", "EIO", "EIO"]]
    with pytest.raises(ValueError, match=directio.FAULT_ENV):
        directio._hook_from_env("often")


def _outcomes(hook, n: int) -> list[str]:
    row = []
    for _ in range(n):
        try:
            hook("f", 0, 1)
            row.append("ok")
        except OSError as exc:
            row.append(errno.errorcode[exc.errno])
    return row


def test_fault_env_roles_errnos_and_odirect(monkeypatch):
    # In this (the main) process: a spec for another role never fires, "main" does.
    assert directio.current_role() == "main"
    assert _outcomes(directio._hook_from_env("reader:1+"), 3) == ["ok", "ok", "ok"]
    assert _outcomes(directio._hook_from_env("main:EINVAL:2"), 3) == ["ok", "EINVAL", "ok"]
    assert _outcomes(directio._hook_from_env("reader:1+,main:ENOSPC:1"), 2) == ["ENOSPC", "ok"]
    assert directio._hook_from_env("odirect") is None  # no read faults, only the open refusal
    assert directio._refusal_from_env("odirect")() and not directio._refusal_from_env("reader:odirect")()
    assert directio._refusal_from_env("3+") is None
    for bad in ("main:EWHAT:1", "0+", "reader:", "1:2:3:4"):
        with pytest.raises(ValueError, match=directio.FAULT_ENV):
            directio._hook_from_env(bad)


def test_odirect_refusal_hook_falls_back_at_open(models, arena, monkeypatch, caplog):
    monkeypatch.setattr(directio, "_refuse_direct", lambda: True)
    with caplog.at_level(logging.WARNING), open_model(models["qwen3moe"]) as mf, ExpertFiles(mf.gguf.paths) as ef:
        assert not ef.direct and "at open" in ef.fallback_reason
        check_every_expert(mf, ef, arena)


# -- the buffered fallback leaves no page cache behind --------------------------------


def resident_pages(path: Path, offset: int, length: int) -> int:
    """Pages of [offset, offset+length) of `path` in the page cache: mincore on a
    mapping of the range (mapping and mincore fault nothing in)."""
    import ctypes
    import mmap as mmap_mod

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = offset // PAGE * PAGE
    n = -(-(offset + length - start) // PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, n * PAGE, mmap_mod.PROT_READ, mmap_mod.MAP_SHARED, fd, start)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * n)()
            assert libc.mincore(addr, n * PAGE, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, n * PAGE)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # a file just written has dirty pages, which DONTNEED cannot drop
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_buffered_fallback_drops_the_pages_it_read(models, arena, monkeypatch):
    """The O_DIRECT fallback reads through the page cache, then drops what it
    read: a streamed expert must not stay cached twice (page cache + slab)."""
    path = Path(models["qwen3moe"])
    with open_model(path) as mf:
        lay, sa = mf.layout.layers[1], arena(1, mf.layout.slab_bytes)
        ext = lay.extents(3)
        lo, hi = min(e.offset for e in ext), max(e.end for e in ext)

        def cached_after(read) -> int:
            drop_pages(path)
            assert resident_pages(path, lo, hi - lo) == 0  # cold, so what follows is the read's doing
            read()
            return resident_pages(path, lo, hi - lo)

        # The measure can fail: a plain buffered read of the range leaves its pages cached.
        with open(path, "rb") as fh:
            assert cached_after(lambda: os.pread(fh.fileno(), hi - lo, lo)) > 0
        monkeypatch.setattr(directio, "_refuse_direct", lambda: True)  # a filesystem without O_DIRECT
        with ExpertFiles([path]) as ef:
            assert not ef.direct
            assert cached_after(lambda: ef.read_expert(ext, sa.slab(0))) == 0
            for part, (at, n) in zip(lay.parts, placement_for(ext, mf.layout.align).regions):
                assert np.array_equal(sa.slab(0)[at : at + n], expected_part(mf, part, 3))


# -- which file -------------------------------------------------------------------------


def test_file_identity_tells_the_same_file_from_changed_ones(models, tmp_path):
    src = Path(models["gpt-oss"])
    same = tmp_path / "copy.gguf"
    shutil.copy(src, same)
    want = directio.file_identity(src)
    assert directio.file_identity(same) == want and directio.FileIdentity.parse(str(want)) == want
    shorter = tmp_path / "short.gguf"
    shorter.write_bytes(src.read_bytes()[:-PAGE])
    data = bytearray(src.read_bytes())
    data[directio.IDENTITY_HEAD_BYTES // 2] ^= 1  # a header byte
    header = tmp_path / "header.gguf"
    header.write_bytes(data)
    data = bytearray(src.read_bytes())
    data[directio.IDENTITY_HEAD_BYTES :: PAGE] = bytes(b ^ 1 for b in data[directio.IDENTITY_HEAD_BYTES :: PAGE])
    weights = tmp_path / "weights.gguf"  # same header and size, other weights
    weights.write_bytes(data)
    assert src.stat().st_size > directio.IDENTITY_HEAD_BYTES  # so the sampled pages are weights
    assert len({str(directio.file_identity(p)) for p in (src, shorter, header, weights)}) == 4
    # Opened with an identity, a different file is refused; the same one is not.
    with ExpertFiles([same], identity=[str(want)]):
        pass
    with pytest.raises(directio.ModelChanged, match="not the file this service started with"):
        ExpertFiles([weights], identity=[str(want)])
