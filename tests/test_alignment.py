"""The I/O alignment (shared/gguf/alignment.py): found from the machine,
forced by MOE_PIPE_IO_ALIGN, carried by the layout to every read and slab,
and the streamed pipeline's tokens unchanged at 4, 16 and 64 KiB."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_pipe.shared.experts.directio import ExpertFiles, aligned_buffer
from moe_pipe.shared.experts.placement import placement_for
from moe_pipe.shared.experts.shm import SlabArena, segment_name
from moe_pipe.shared.gguf import alignment
from moe_pipe.shared.gguf.alignment import ENV, PAGE_SIZE, io_alignment
from moe_pipe.shared.gguf.layout import aligned
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model

from .test_pipeline import MiB, nothing_left_behind, run_pipeline, with_reference  # noqa: F401 (an autouse fixture)

KiB = 1 << 10
ALIGNS = [4 * KiB, 16 * KiB, 64 * KiB]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return with_reference(make_model("qwen3moe", "tiny", tmp_path_factory.mktemp("al") / "qwen3moe.gguf"))


def test_machine_alignment_is_the_page_or_the_device_block(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    f = tmp_path / "x"
    f.write_bytes(b"\0" * 10)
    found = io_alignment([f])
    assert found.page == PAGE_SIZE == os.sysconf("SC_PAGE_SIZE")
    assert found.value == max(PAGE_SIZE, found.device or 0)
    assert found.value & (found.value - 1) == 0
    # /dev/shm is tmpfs: no block device under it, the page alone
    assert io_alignment(["/dev/shm"]).device is None and io_alignment(["/dev/shm"]).value == PAGE_SIZE


def test_a_partition_reads_its_whole_disks_block_size(tmp_path, monkeypatch):
    """/sys/dev/block/MAJ:MIN of a partition has no queue/: its parent (the disk) has."""
    disk = tmp_path / "sys" / "block" / "sdz"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "logical_block_size").write_text("16384\n")
    (disk / "sdz1").mkdir()
    real_path = alignment.Path

    def fake_path(text):
        return disk / "sdz1" if str(text).startswith("/sys/dev/block/") else real_path(text)

    monkeypatch.setattr(alignment, "Path", fake_path)
    monkeypatch.setattr(alignment, "_statx_dio", lambda path: None)
    monkeypatch.delenv(ENV, raising=False)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"\0")
    assert alignment.device_alignment(f) == (16384, "sdz logical_block_size")
    assert io_alignment([f]).value == max(16384, PAGE_SIZE)


@pytest.mark.parametrize("bad", ["1000", "abc", "0", "2048", str(3 * PAGE_SIZE)])
def test_a_bad_override_is_one_clear_error(bad, monkeypatch):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(ValueError, match=f"{ENV}=.*power of two that is a multiple of the page size"):
        io_alignment(["/dev/shm"])


@pytest.mark.parametrize("align", ALIGNS)
def test_layout_reads_and_slabs_follow_the_alignment(qwen, align, monkeypatch):
    monkeypatch.setenv(ENV, str(align))
    path = qwen[0]
    with open_model(path) as mf, ExpertFiles(mf.gguf.paths) as ef:
        lay = mf.layout
        assert lay.align == ef.align == align
        assert lay.slab_bytes % align == 0 and lay.slab_bytes >= lay.max_expert_bytes
        buf = aligned_buffer(100, align)
        assert buf.ctypes.data % align == 0 and buf.size == 100
        with SlabArena.create(segment_name("align-test"), 2, lay.slab_bytes) as sa:
            for layer in lay.layers:
                if not layer.parts:
                    continue
                for e in (0, mf.spec.n_expert - 1):
                    ext = layer.extents(e)
                    assert all(aligned(x, align)[0] % align == 0 and aligned(x, align)[1] % align == 0 for x in ext)
                    slab = sa.slab(e % 2)
                    slab[:] = 0xEE
                    pl = ef.read_expert(ext, slab)
                    assert pl.regions == placement_for(ext, align).regions
                    for part, (at, n) in zip(layer.parts, pl.regions):
                        want = np.asarray(mf.gguf.view(part.tensor.name)[e]).reshape(-1).view(np.uint8)
                        assert np.array_equal(slab[at : at + n], want), (layer.layer, e, part.name)


def test_a_child_is_handed_the_parents_alignment(qwen, monkeypatch):
    """The layout built from a passed alignment ignores the machine and the environment."""
    monkeypatch.setenv(ENV, str(16 * KiB))
    with open_model(qwen[0], 64 * KiB) as mf:
        assert mf.layout.align == 64 * KiB and mf.layout.slab_bytes % (64 * KiB) == 0
    with pytest.raises(ValueError, match="not a power of two"):
        open_model(qwen[0], 3000)


@pytest.mark.integration
# 64 KiB in the default tier (the farthest from the default 4 KiB, which tests/test_pipeline.py runs); the others behind -m slow
@pytest.mark.parametrize("align", [pytest.param(a, marks=pytest.mark.slow) if a != 64 * KiB else a for a in ALIGNS])
def test_streamed_tokens_equal_the_reference_at_every_alignment(qwen, align, monkeypatch):
    """Min budget (experts evicted and re-read every token), O_DIRECT where the
    filesystem takes it: the same tokens as the resident reference."""
    monkeypatch.setenv(ENV, str(align))
    path, prompt, reference, _ = qwen
    with open_model(path) as mf:
        min_mb, slab = mf.layout.min_cache_bytes() / MiB, mf.layout.slab_bytes
    tokens, _, resolved = run_pipeline(path, prompt, **{"cache.cache_mb": min_mb + 1e-6, "io.dense_weights": "anon"})
    assert tokens == reference[None]
    assert resolved.io_align == align and resolved.slab_bytes == slab and slab % align == 0
