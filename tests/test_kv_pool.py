"""The slots' KV pool (shared/model/kv_pool.py, procs/slots.py; docs/batching.md § The KV pool):
what gives way when the slots' positions do not fit, a cache's pages taken and given back,
and the serving loop keeping to the pool with every reply still its solo reply."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from moe_pipe.shared.model.blocks import KVCache
from moe_pipe.shared.model.kv_pool import Room, Use, make_room
from moe_pipe.shared.wire import messages as m

from .test_slots import _alone, _greedy, _in_process


def test_rows_that_fit_run_and_nothing_gives_way():
    uses = [Use(0, 1, True, 100, 101), Use(1, 2, True, 50, 66), Use(2, 0, False, 30, 30)]
    assert make_room(247, uses) == Room()


def test_idle_caches_give_way_first_the_least_recently_used_first():
    uses = [Use(0, 5, True, 100, 101), Use(1, 3, False, 40, 40), Use(2, 1, False, 30, 30), Use(3, 2, False, 0, 0)]
    assert make_room(141, uses) == Room(evict=(2,))  # 171 - 30: the oldest idle one was enough
    assert make_room(101, uses) == Room(evict=(2, 1))
    assert make_room(100, uses).evict == (2, 1)  # still over: then rows wait (below)


def test_then_the_youngest_requests_rows_wait_and_an_older_one_goes_on():
    uses = [Use(0, 1, True, 100, 101), Use(1, 2, True, 50, 51), Use(2, 3, True, 20, 36)]
    assert make_room(172, uses) == Room(defer=frozenset({2}))  # 188 - 16
    assert make_room(171, uses) == Room(defer=frozenset({2, 1}))


def test_when_no_row_can_run_the_youngest_request_holding_positions_ends():
    # every growing row deferred and still over: the youngest holder (slot 1; slot 2 holds nothing) ends
    uses = [Use(0, 1, True, 100, 101), Use(1, 2, True, 50, 51), Use(2, 3, True, 0, 16)]
    room = make_room(150, uses)
    assert room.end == 1 and room.defer == {0, 1, 2}
    # the oldest never ends: alone it fits a pool of one context
    assert make_room(100, [Use(0, 1, True, 100, 101), Use(1, 2, True, 0, 16)]) == Room()


def _resident_kib(cache: KVCache) -> int:
    """KiB of the cache's own rows the kernel holds in memory: each page's present bit in
    /proc/self/pagemap. The process's RssAnon would also count what else this test worker
    allocates or frees meanwhile (it failed once that way under two workers)."""
    pages = 0
    with open("/proc/self/pagemap", "rb") as f:
        for rows in cache.k + cache.v:
            first, n = rows.data.ctypes.data // mmap.PAGESIZE, -(-rows.data.nbytes // mmap.PAGESIZE)
            f.seek(first * 8)
            pages += int((np.frombuffer(f.read(n * 8), np.uint64) >> np.uint64(63)).sum())
    return pages * mmap.PAGESIZE // 1024


def test_a_cache_takes_pages_as_positions_are_written_and_gives_them_back():
    """A whole-context layer's rows are taken a page at a time as positions are written and
    given back past a position by `release`, as the kernel holds the pages; the positions
    kept read back unchanged."""
    layers, hk, d, n_ctx = 4, 4, 128, 8192  # f16: 8 MiB a layer's K, as many its V
    cache = KVCache(n_ctx, (hk,) * layers, (d,) * layers, (d,) * layers, "f16")
    per_position = 2 * layers * hk * d * 2  # a head's row is 256 bytes: 16 to a page
    assert all(rows.maps[0] is not None for rows in cache.k + cache.v)  # each in a mapping of its own
    assert _resident_kib(cache) == 0
    rng = np.random.default_rng(0)
    written = [rng.standard_normal((4096, hk, d)).astype(np.float32) for _ in range(layers)]
    for i, k in enumerate(written):
        cache.store(i, k, -k)
    cache.advance(4096)
    assert cache.held == 4096
    assert _resident_kib(cache) == 4096 * per_position // 1024  # exactly the rows written
    cache.truncate(1024)
    cache.release(1024)
    assert cache.held == 1024
    assert _resident_kib(cache) == 1024 * per_position // 1024
    for i, k in enumerate(written):
        np.testing.assert_array_equal(cache.keys(i, 0, 1024), k[:1024].transpose(1, 0, 2).astype(np.float16).astype(np.float32))
    with pytest.raises(ValueError, match="holds 1024"):
        cache.release(512)
    cache.truncate(0)
    cache.release(0)
    assert cache.held == 0 and _resident_kib(cache) == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moe_pipe.shared.makemodel.maker import make_model

    return make_model("qwen3moe", "tiny", tmp_path_factory.mktemp("pool") / "qwen3moe.gguf", quant="F32")


def test_slots_keep_to_the_pool_and_each_reply_is_its_solo_reply_or_ends_as_the_pool_says(tiny):
    """Three slots of 256 positions share a pool of 320 while each request needs ~190: the
    oldest gets its solo reply; the others wait for room, and one that cannot get it ends
    (decoding: finish "context", its tokens a prefix of its solo reply; reading its prompt:
    BUSY). The slots never hold more than the pool after a step, and a slot that ended for
    room holds nothing."""
    settings = {"gateway.parallel": 3, "gateway.kv_pool": 320, "compute.prefill_chunk": 16}
    slots, _, start, serve = _in_process(tiny, **settings)
    reqs = [_greedy(k + 1, [(13 * i + 7 * k) % 200 + 5 for i in range(70 + 5 * k)], 120) for k in range(3)]
    held: list[int] = []

    def look() -> None:
        held.append(sum(s.session.cache.held for s in slots.slots if s.session.cache is not None))

    for k, req in enumerate(reqs):
        start(k, req)
    done = serve(lambda d: len(d) == 3, look)
    assert max(held) <= 320 and max(held) > 256  # the pool was used past one context, never past itself
    solo = {r.req_id: _alone(tiny, r) for r in reqs}
    assert done[1].ok and done[1].tokens == solo[1].tokens
    ended = [d for d in done.values() if not (d.ok and d.tokens == solo[d.req_id].tokens)]
    assert ended, "the three together need more than the pool: one gives way"
    for d in ended:
        if d.ok:
            assert d.finish_reason == "context" and d.tokens == solo[d.req_id].tokens[: len(d.tokens)]
        else:
            assert d.code == m.Code.BUSY and "KV pool is full" in d.error
        slot = next(s for s in slots.slots if s.req_id == d.req_id)
        assert slot.session.cache.held == 0 and slot.session.n == 0


def test_an_idle_slots_cache_gives_way_to_a_new_request_and_the_reply_is_unchanged(tiny):
    """Two finished conversations sit in their slots; a third request that needs room empties
    the least recently used one (its memory and its ids), the other keeps its prefix."""
    slots, _, start, serve = _in_process(tiny, **{"gateway.parallel": 3, "gateway.kv_pool": 300, "compute.prefill_chunk": 16})
    first, second = _greedy(1, [5 + i % 90 for i in range(100)], 20), _greedy(2, [9 + i % 80 for i in range(100)], 20)
    start(0, first)
    serve(lambda d: 1 in d)
    start(1, second)
    serve(lambda d: 2 in d)
    assert slots.slots[0].session.cache.held == 119 and slots.slots[1].session.cache.held == 119
    third = _greedy(3, [40 + i % 70 for i in range(120)], 20)
    start(2, third)
    done = serve(lambda d: 3 in d)
    assert done[3].tokens == _alone(tiny, third).tokens
    assert slots.slots[0].session.cache.held == 0 and slots.slots[0].session.n == 0  # the least recently used gave way
    assert slots.slots[1].session.n == 119  # the other kept its conversation


@pytest.mark.integration
def test_a_pool_below_one_context_is_refused_at_start_up_in_one_line():
    import subprocess
    import sys

    from moe_pipe.shared.errors import ConfigError
    from moe_pipe.shared.hub.resolve import load_runnable

    with pytest.raises(ConfigError, match="gateway.kv_pool = 100 is below compute.ctx_size = 4096"):
        load_runnable(None, {"gateway.parallel": 2, "gateway.kv_pool": 100, "compute.ctx_size": 4096})
    load_runnable(None, {"gateway.parallel": 1, "gateway.kv_pool": 100, "compute.ctx_size": 4096})  # one slot: no pool
    run = subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", "up", "--parallel", "2", "--kv-pool", "100", "-c", "4096", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "kv_pool" in run.stderr
