"""A prompt prefix held once by reference for several KV caches (shared/model/kv_pages.py,
KVCache.share_prefix_from): the same rows as a copy, in memory once however many caches
take it, never changed by what any of them writes after, and let go (memory and descriptor)
when the last cache gives its positions back."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

from moe_pipe.shared.model import kv_pages
from moe_pipe.shared.model.blocks import MAX_PAGE_FILES, SHARE_MIN_POSITIONS, KVCache

pytestmark = pytest.mark.skipif(not kv_pages.supported(), reason="memory files are Linux's")

LAYERS, HK, D, CTX = 3, 4, 128, 4096
BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 1 + 2 / 32}  # a stored value, q8_0's scale included


def _cache(kv_type: str) -> KVCache:
    return KVCache(CTX, (HK,) * LAYERS, (D,) * LAYERS, (D,) * LAYERS, kv_type)


def _fill(cache: KVCache, k: np.ndarray, v: np.ndarray) -> None:
    for layer in range(LAYERS):
        cache.store(layer, k, v)
    cache.advance(k.shape[0])


def _memory(caches) -> int:
    """This process's anonymous memory and the bytes of every page file the caches map: what
    the KV rows take, whichever way each page is held."""
    with open("/proc/self/status") as f:
        anon = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    files = set().union(*(c.page_files() for c in caches))
    return anon + sum(os.fstat(f.fd).st_blocks * 512 for f in files)


def _memfd_open(fd: int) -> bool:
    """Whether descriptor fd is open on one of our page files (not whatever reused its number)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:moe-pipe-kv-prefix")
    except OSError:
        return False


def _same_rows(a: KVCache, b: KVCache, n: int) -> bool:
    return all(
        np.array_equal(x, y)
        for la in range(LAYERS)
        for x, y in ((a.keys(la, 0, n), b.keys(la, 0, n)), (a.values(la, 0, n), b.values(la, 0, n)))
    )


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_a_prefix_taken_by_three_caches_is_in_memory_once_and_reads_as_computed(kv_type):
    rng = np.random.default_rng(3)
    n = 1000
    k, v = (rng.standard_normal((n, HK, D), dtype=np.float32) for _ in range(2))
    donor, alone, takers = _cache(kv_type), _cache(kv_type), [_cache(kv_type) for _ in range(3)]
    _fill(donor, k, v)
    _fill(alone, k, v)
    caches = [donor, alone, *takers]
    prefix_bytes = n * LAYERS * 2 * HK * D * BYTES[kv_type]
    for i, (taker, take) in enumerate(zip(takers, (900, 950, 900))):
        before = _memory(caches)
        taker.share_prefix_from(donor, take)
        grew = _memory(caches) - before
        assert taker.n == take and _same_rows(taker, alone, take)
        # the first take puts the donor's 900 into one file in place of its own pages; the
        # others map it, and copy only what lies past its pages (one part page a head, and
        # the second's 50 positions, fewer than a new file takes)
        copied = (take - 900 + 32) * LAYERS * 2 * HK * D * BYTES[kv_type] + 4 * 4096 * LAYERS * 2 * HK
        assert grew < copied < 0.25 * prefix_bytes, (i, grew, copied)
    files = donor.page_files()
    assert len(files) == 1 and all(t.page_files() == files for t in takers)
    (file,) = files
    assert _memfd_open(file.fd)
    assert file.positions == donor.by_reference == 900 and [t.by_reference for t in takers] == [900, 900, 900]
    assert [t.own for t in takers] == [0, 50, 0] and donor.own == 100


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_what_one_cache_writes_after_the_prefix_never_reaches_the_others(kv_type):
    rng = np.random.default_rng(4)
    k, v = (rng.standard_normal((600, HK, D), dtype=np.float32) for _ in range(2))
    donor, alone, taker = _cache(kv_type), _cache(kv_type), _cache(kv_type)
    _fill(donor, k, v)
    _fill(alone, k, v)
    taker.share_prefix_from(donor, 500)
    other = rng.standard_normal((450, HK, D), dtype=np.float32)
    donor.truncate(50)  # the donor goes back into the prefix and writes other rows over it
    donor.release(50)
    _fill(donor, other, other)
    _fill(taker, other[:60], other[:60])  # the taker goes on from its prefix (its part-used pages)
    assert _same_rows(taker, alone, 500) and _same_rows(donor, alone, 50)
    assert np.array_equal(donor.keys(1, 50, 500), _as_stored(kv_type, other))
    assert np.array_equal(taker.keys(2, 500, 560), _as_stored(kv_type, other[:60]))


def _as_stored(kv_type: str, x: np.ndarray) -> np.ndarray:
    c = KVCache(CTX, (HK,), (D,), (D,), kv_type)
    c.store(0, x, x)
    return c.keys(0, 0, x.shape[0])


def test_the_last_cache_to_give_the_prefix_back_frees_its_memory_and_descriptor():
    rng = np.random.default_rng(5)
    k = rng.standard_normal((800, HK, D), dtype=np.float32)
    donor, a, b = _cache("f16"), _cache("f16"), _cache("f16")
    _fill(donor, k, k)
    a.share_prefix_from(donor, 800)
    b.share_prefix_from(donor, 700)
    (file,) = donor.page_files()
    fd, alive = file.fd, weakref.ref(file)
    assert file.positions == 800 and _memfd_open(fd)
    b.truncate(300)
    b.release(300)  # its pages past 300 read zeros again; the rows before it stay the file's
    assert b.page_files() == {file} and b.by_reference == 300 and _same_rows(b, a, 300)
    for c in (donor, a):
        c.truncate(0)
        c.release(0)
    assert b.page_files() == {file}  # still held: b maps it
    b.truncate(100)
    b.release(100)
    del file
    gc.collect()
    assert alive() is not None and _memfd_open(fd) and _same_rows(b, _filled_like(k, 100), 100)
    b.truncate(0)
    b.release(0)
    gc.collect()
    assert alive() is None and not _memfd_open(fd) and not (donor.page_files() | a.page_files() | b.page_files())


def _filled_like(k: np.ndarray, n: int) -> KVCache:
    c = _cache("f16")
    _fill(c, k[:n], k[:n])
    return c


def test_a_prefix_past_the_donor_s_files_goes_into_a_new_one_up_to_the_limit():
    """A donor that went on past the prefix it shared files its next positions away when another
    cache takes more of them (at least SHARE_MIN_POSITIONS more), in up to MAX_PAGE_FILES files;
    after that a taker maps what the files hold and copies the rest."""
    rng = np.random.default_rng(6)
    step = 2 * SHARE_MIN_POSITIONS
    total = step * (MAX_PAGE_FILES + 2)
    k = rng.standard_normal((total, HK, D), dtype=np.float32)
    donor, alone = _cache("f16"), _cache("f16")
    _fill(alone, k, k)
    takers = []
    for i in range(1, MAX_PAGE_FILES + 2):
        _fill(donor, k[(i - 1) * step : i * step], k[(i - 1) * step : i * step])
        taker = _cache("f16")
        taker.share_prefix_from(donor, i * step)
        assert _same_rows(taker, alone, i * step)
        takers.append(taker)
    assert len(donor.page_files()) == MAX_PAGE_FILES
    assert takers[-1].by_reference == donor.by_reference == MAX_PAGE_FILES * step  # the last one copied the rest
    assert takers[1].page_files() < donor.page_files()
    with pytest.raises(ValueError, match="with itself"):
        donor.share_prefix_from(donor, 4)
    few, small = _cache("f16"), _cache("f16")
    _fill(few, k[: SHARE_MIN_POSITIONS - 1], k[: SHARE_MIN_POSITIONS - 1])
    small.share_prefix_from(few, SHARE_MIN_POSITIONS - 1)  # too few positions for a file: copied
    assert not small.page_files() and not few.page_files() and _same_rows(small, alone, SHARE_MIN_POSITIONS - 1)
