"""compute's own read lanes (shared/experts/lentreads.py): how many slabs are lent, and reads that
land in their slabs byte for byte, in the order they end, or fail with their cause."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from moe_pipe.shared.experts import directio
from moe_pipe.shared.experts.lentreads import LentReads, lent_slabs
from moe_pipe.shared.experts.placement import placement_for
from moe_pipe.shared.experts.shm import SlabArena, segment_name
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.default_model import default_model_path


def test_lent_slabs_are_a_64th_of_the_cache_at_most_one_at_least_and_none_when_it_holds_everything():
    assert lent_slabs(32, 3300, 8, 6144) == 32  # qwen30b-shape at 11 GB: the asked count
    assert lent_slabs(32, 290, 4, 2048) == 4  # gptoss120b-shape at file / 5.2: a 64th
    assert lent_slabs(32, 20, 8, 64) == 1  # a small cache: one slab
    assert lent_slabs(32, 9, 8, 64) == 1 and lent_slabs(32, 8, 8, 64) == 0  # the rest holds a layer's experts
    assert lent_slabs(32, 64, 8, 64) == 0  # every expert cached: nothing is ever read
    assert lent_slabs(0, 3300, 8, 6144) == 0  # io.compute_reads 0: off


@pytest.fixture
def lanes():
    with open_model(default_model_path()) as mf:
        arena = SlabArena.create(segment_name("lent-test"), 4, mf.layout.slab_bytes)
        lent = LentReads(mf.gguf.paths, mf.layout, arena, 2)
        try:
            yield mf, arena, lent
        finally:
            lent.close()
            arena.close()
            arena.unlink()
            directio.set_fault_hook(None)


def test_reads_land_in_their_slabs_as_the_file_holds_them(lanes):
    mf, arena, lent = lanes
    layer = mf.spec.moe_layers[-1]
    keys = [(layer, 0), (layer, mf.spec.n_expert - 1), (mf.spec.moe_layers[0], 1)]
    for slab, key in enumerate(keys):
        arena.slab(slab)[:] = 0xEE
        lent.submit(key, slab)
    results = [lent.next_result() for _ in keys]
    assert lent.pending == 0 and sorted((k, s) for k, s, _, _ in results) == sorted((k, s) for s, k in enumerate(keys))
    assert all(err is None and ns > 0 for _, _, ns, err in results)
    for slab, (layer, e) in enumerate(keys):
        lay = mf.layout.layers[layer]
        for part, (at, n) in zip(lay.parts, placement_for(lay.extents(e), mf.layout.align).regions):
            want = np.asarray(mf.gguf.view(part.tensor.name)[e]).reshape(-1).view(np.uint8)
            assert np.array_equal(arena.slab(slab)[at : at + n], want), (layer, e, part.name)


def test_a_failed_read_comes_back_with_its_cause_and_drain_waits_for_every_read(lanes):
    mf, _, lent = lanes

    def hook(path, offset, length):
        raise OSError(errno.EIO, "Input/output error (test)")

    directio.set_fault_hook(hook)
    layer = mf.spec.moe_layers[0]
    lent.submit((layer, 0), 0)
    lent.submit((layer, 1), 1)
    results = lent.drain()
    assert lent.pending == 0 and len(results) == 2
    assert all(err is not None and "Input/output error" in err for _, _, _, err in results)
