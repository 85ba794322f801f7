"""The reader's next-layer guesses: read after the demand, never answered,
withdrawn when their layer's request does not want them, promoted when it
does, and free to evict — but never what the request pinned; its warm start;
and the KV cache's loan: a CacheLimit carried out, pages given back, held to
by a restarted reader, undone by a new compute."""

from __future__ import annotations

import os

import pytest

from moe_pipe.procs.children import Launch
from moe_pipe.procs.reader import Reader
from moe_pipe.shared.experts import shm
from moe_pipe.shared.experts.budget import MiB
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.wire import ipc
from moe_pipe.shared.wire import messages as m

from .readerhelp import Harness, hold_reads_of


@pytest.fixture
def h(model):
    """The reader with one lane, so the order of reads is the order of its queues."""
    harness = Harness(model, io_threads=1)
    yield harness
    harness.close()


def test_guesses_wait_behind_the_demand_and_are_not_answered(h):
    entered, release = hold_reads_of(h, (1, 3), fail=False)
    req = h.fetch(1, [3], guesses=[4, 5, 3], guess_layer=2)
    assert entered.wait(10)  # the lane is busy with the demand read
    assert h.reader.lanes.queued() == ([], [(2, 4), (2, 5), (2, 3)], [])
    release.set()
    for _ in range(4):
        h.land()
    ready = h.answer()
    assert (ready.req_id, ready.layer, ready.expert, ready.hit) == (req, 1, 3, False)
    assert ipc.recv(h.ready, 200) is None  # guesses are never answered
    assert all(h.visible(k) for k in [(2, 4), (2, 5), (2, 3)]) and h.reader.guesses_read == 3
    for key in [(2, 4), (2, 5), (2, 3)]:
        h.assert_holds(key, h.reader.index.slabs(key[0], [key[1]])[0])
        assert h.reader.table.pins(key) == 0  # a guess holds no pin once read
    # Their reads are reported with the reader's next answer, once.
    later = h.fetch(0, [7])
    h.land()
    first, second = h.answer(), (h.fetch(0, [6]), h.land(), h.answer())[2]
    assert first.req_id == later and first.guess_bytes == 3 * h.mf.layout.expert_bytes(2) and first.guess_io_ns > 0
    assert (second.guess_bytes, second.guess_io_ns) == (0, 0)


def test_the_next_request_promotes_wanted_guesses_and_withdraws_the_rest(h):
    entered, release = hold_reads_of(h, (1, 3), fail=False)
    first = h.fetch(1, [3], guesses=[4, 5], guess_layer=2)
    assert entered.wait(10)
    free_before = h.reader.n_slabs - len(h.reader.table)
    second = h.fetch(2, [4, 6], released=[first])  # layer 2's real request: 4 was guessed, 5 was not
    assert (2, 5) not in h.reader.table and (2, 5) not in h.reader.inflight and h.reader.guesses_withdrawn == 1
    assert h.reader.n_slabs - len(h.reader.table) == free_before  # 5's slab went to 6
    assert h.reader.lanes.queued() == ([(2, 4), (2, 6)], [], [])  # 4 now waits as demand, first in line
    release.set()
    for _ in range(3):
        h.land()
    answers = {(a.req_id, a.expert): a for a in (h.answer(), h.answer(), h.answer())}
    assert set(answers) == {(first, 3), (second, 4), (second, 6)}
    assert all(isinstance(a, m.Ready) and not a.hit for a in answers.values())
    h.reader.on_release(m.Release((second,)))
    assert not any(h.reader.table.pins(k) for k in h.reader.table.resident())


def test_guesses_evict_but_never_what_the_request_pinned(h):
    n = h.reader.n_slabs
    assert n == 8 and h.mf.spec.n_expert == 8  # the tiny model: 4 layers of 8 experts, 8 slabs at 1.2 MB
    fills = [h.fetch(0, range(6)), h.fetch(1, [0, 1])]  # every slab taken
    for _ in range(n):
        h.land()
    for _ in range(n):
        h.answer()
    # Layer 1's request: its experts 0 and 1 are in use (resident, pinned), 7 is a
    # miss, and it guesses all 8 experts of layer 2 — more than the slabs left.
    req = h.fetch(1, [7], resident=[0, 1], released=fills, guesses=range(8), guess_layer=2)
    assert h.reader.guesses_read == n - 3  # one per unpinned slab; then every slab was pinned
    for _ in range(n - 2):  # the miss, then the guesses
        h.land()
    ready = h.answer()
    assert (ready.req_id, ready.layer, ready.expert) == (req, 1, 7)
    assert all((1, e) in h.reader.table and h.visible((1, e)) for e in (0, 1, 7))
    assert [k for k in h.reader.table.resident() if k[0] == 2] == [(2, e) for e in range(n - 3)]
    assert not any(k[0] == 0 for k in h.reader.table.resident())  # layer 0 (unpinned) was evicted


def test_a_cached_demand_is_answered_only_after_the_fetchs_guesses_evicted(h):
    """Compute reads the index again once a Fetch's answers are in: an expert that landed
    between compute's look and the Fetch (a guess) is answered as a hit, and that answer
    must not go out before the same Fetch's guesses have evicted what they evict, or
    compute would find an expert in the index that the reader is about to drop."""
    n = h.reader.n_slabs
    fills = [h.fetch(0, range(6)), h.fetch(1, [0, 1])]  # every slab taken
    for _ in range(n):
        h.land()
    for _ in range(n):
        h.answer()
    seen_at_answer: list[set] = []
    send = h.reader.send

    def watched(msg):
        if isinstance(msg, m.Ready):
            seen_at_answer.append({(0, e) for e in range(8) if h.visible((0, e))})
        send(msg)

    h.reader.send = watched
    # Layer 1's request lists 0 as a miss (compute looked before it landed): a hit here.
    req = h.fetch(1, [0], resident=[1], released=fills, guesses=range(8), guess_layer=2)
    ready = h.answer()
    assert (ready.req_id, ready.layer, ready.expert, ready.hit) == (req, 1, 0, True)
    left = {(0, e) for e in range(8) if h.visible((0, e))}
    assert len(left) < 6  # the guesses evicted layer 0's unpinned experts ...
    assert seen_at_answer == [left]  # ... before the hit was answered


def test_a_fetch_of_guesses_only_is_answered_once_they_are_admitted(h):
    h.fetch(0, [1])
    h.land()
    h.answer()
    req = h.fetch(0, [], resident=[1], released=[1], guesses=[2, 3], guess_layer=1)
    answer = h.answer()
    assert answer == m.Guessed(req)
    assert {(1, 2), (1, 3)} <= set(h.reader.inflight) and h.reader.table.pins((0, 1)) == 1
    h.land()
    h.land()
    assert h.visible((1, 2)) and h.visible((1, 3)) and ipc.recv(h.ready, 200) is None


def test_a_guess_of_an_expert_a_fetch_admitted_reads_nothing_and_is_answered(h):
    """Compute's barrier after a pass stopped mid-Fetch (procs/compute.py
    SlabExperts._barrier): a guesses-only Fetch of one of the stopped Fetch's
    misses, whose read is still under way, starts no read and evicts nothing,
    and its Guessed says the reader has handled both."""
    entered, release = hold_reads_of(h, (1, 3), fail=False)
    stopped = h.fetch(1, [3, 4])
    assert entered.wait(10)
    slabs = dict(h.reader.table.resident())
    queued, guesses = h.reader.lanes.queued(), h.reader.guesses_read
    barrier = h.fetch(1, [], guesses=[3], guess_layer=1)
    assert h.answer() == m.Guessed(barrier)
    assert (h.reader.lanes.queued(), h.reader.guesses_read) == (queued, guesses)
    assert dict(h.reader.table.resident()) == slabs  # nothing admitted, nothing evicted
    release.set()
    h.land()
    h.land()
    assert {(a.req_id, a.expert) for a in (h.answer(), h.answer())} == {(stopped, 3), (stopped, 4)}


def test_a_demand_that_finds_every_slab_pinned_by_reads_under_way_waits_for_them(h):
    """A request stopped mid-Fetch leaves a read under way, holding its slab until it lands;
    the next request asks for as many experts as there are slabs (a prompt's group): the one
    that finds every slab pinned waits for that read rather than failing, and every expert of
    the new request is answered."""
    n = h.reader.n_slabs
    entered, release = hold_reads_of(h, (0, 0), fail=False)
    stopped = h.fetch(0, [0])
    assert entered.wait(10)  # its read is under way, holding its slab
    new = h.fetch(1, range(n), released=[stopped])
    assert len(h.reader.blocked) == 1 and ipc.recv(h.ready, 200) is None  # one waits, none failed
    release.set()
    for _ in range(n + 1):
        h.land()
    answers = [h.answer() for _ in range(n + 1)]  # the stopped read's Ready too, which compute ignores
    mine = sorted(a.expert for a in answers if a.req_id == new)
    assert all(isinstance(a, m.Ready) for a in answers) and mine == list(range(n))
    assert not h.reader.blocked and all(h.visible((1, e)) for e in range(n))


def test_a_blocked_demand_of_a_fetch_compute_left_is_dropped(h):
    """The same, but compute leaves the second request too before the read lands (a
    second Stop): its blocked demand is never read, and nothing stays pinned."""
    n = h.reader.n_slabs
    entered, release = hold_reads_of(h, (0, 0), fail=False)
    stopped = h.fetch(0, [0])
    assert entered.wait(10)
    second = h.fetch(1, range(n), released=[stopped])
    assert len(h.reader.blocked) == 1
    h.reader.on_release(m.Release((second,)))
    assert not h.reader.blocked
    release.set()
    for _ in range(n):  # the stopped read and the second request's n - 1 admitted ones
        h.land()
    assert h.reader.done_in.poll(300) == 0 and (1, n - 1) not in h.reader.table  # the blocked one was never read
    assert not any(h.reader.table.pins(k) for k in h.reader.table.resident())


def test_warm_start_reads_survive_requests_and_go_after_them(h):
    """A warm start fills free slabs in the background, one read at a time on
    one lane: a request's reads go first, and neither a Fetch nor a Release
    withdraws them (only guesses)."""
    entered, release = hold_reads_of(h, (0, 0), fail=False)
    h.reader.warm_keys, h.reader.warm_source = [(0, 0), (1, 1), (1, 2)], "a test"
    h.reader.warm_start()
    assert entered.wait(10)  # the lane holds the first warm read; the next is queued (the window: two)
    req = h.fetch(3, [5])
    h.reader.on_release(m.Release((req,)))
    assert h.reader.lanes.queued() == ([(3, 5)], [], [(1, 1)])
    release.set()
    for _ in range(4):
        h.land()
    assert all(h.visible(k) for k in [(0, 0), (1, 1), (1, 2), (3, 5)]) and h.reader.guesses_withdrawn == 0
    assert h.reader.warm is not None and (h.reader.warm.state, h.reader.warm.done) == ("done", 3)


def _allocated(h) -> int:
    return os.stat(shm.SHM_DIR / h.reader.arena.arena.name).st_blocks * 512


def test_a_cache_limit_evicts_gives_pages_back_and_waits_for_pins(h):
    """CacheLimit: the cache holds to the limit (evicted experts leave the index, the
    retired slabs' pages leave the segment) and answers CacheLimited; a pinned expert
    in the way delays the answer until its fetch is released; a new compute's Hello
    gives the cache its slabs back; a reader started over the same arenas holds to
    the limit before it reads anything."""
    n = h.reader.n_slabs
    assert n >= 4
    if h.reader.populator is not None:
        h.reader.populator.wait(30)
    keys = [(0, e) for e in range(n - 1)]
    req = h.fetch(0, [e for _, e in keys])
    for _ in keys:
        h.land()
    for _ in keys:
        assert h.answer().hit is False
    before = _allocated(h)
    h.reader.on_cache_limit(m.CacheLimit(100, 2))  # every expert is pinned by `req`: nothing can go yet
    assert h.reader.table.n_usable == n - 1 and ipc.recv(h.ready, 200) is None
    h.reader.on_release(m.Release((req,)))  # the pins go: the limit is carried out
    done = h.answer_limit()
    assert (done.req_id, done.slabs) == (100, 2) and h.reader.table.n_usable == 2 and len(h.reader.table) <= 2
    assert sum(h.visible(k) for k in keys) == len(h.reader.table) and h.reader.index.usable == 2
    assert _allocated(h) == before - (n - 2) * h.reader.arena.slab_bytes
    # A reader started over the same arenas (a restart) holds to it before reading anything.
    old = h.reader
    for sock in (old.fetch_in, old.done_in, old.ready_out):
        sock.close(0)
    old.close()
    h.reader = Reader(h.cfg, Launch(h.cfg, h.res, h.res_model, h.res_model.stem).facts({}), h.ctx)
    assert h.reader.table.n_usable == 2 and 0 < len(h.reader.table) <= 2
    h.reader.on_hello(m.Hello("compute", 1234, 1))  # a new compute holds no KV cache: the slabs are the cache's again
    assert h.reader.table.n_usable == n and h.reader.index.usable == 0
    req = h.fetch(1, list(range(n - 1)))
    for _ in range(n - 1):
        h.land()
    assert all(h.answer().hit is False for _ in range(n - 1)) and len(h.reader.table) == n  # two held before, seven read


def test_the_prompts_loan_waits_for_a_warm_compute_and_comes_back_with_a_new_one(model):
    """The prompt's loan (cache.lend_prompt): start-up allocates and populates only the slabs
    the cache holds without it, and the reader holds to them until compute lends the rest (a
    CacheLimit above the count: the slabs are the cache's, their pages made); a new compute's
    Hello holds the cache to them again, as it warms up."""
    with open_model(model) as mf:
        slab = mf.layout.slab_bytes
    over = {"cache.cache_ceil_mb": 10 * slab / MiB, "cache.reserve_mb": 0, "cache.lend_kv": False, "compute.ctx_size": 1024}
    h = Harness(model, cache_mb="auto", io_threads=1, **over)
    try:
        n, lent = h.reader.n_slabs, h.reader.prompt_lent
        assert lent > 0 and n == 10 + lent
        assert h.reader.table.n_usable == n - lent and h.reader.index.usable == n - lent
        if h.reader.populator is not None:
            h.reader.populator.wait(30)
        assert _allocated(h) == (n - lent) * slab  # the lent slabs have no pages yet
        h.reader.on_cache_limit(m.CacheLimit(7, n))  # compute is warm: the loan is the cache's
        assert h.answer_limit().slabs == n and h.reader.table.n_usable == n and h.reader.index.usable == 0
        if h.reader.populator is not None:
            h.reader.populator.wait(30)
            assert _allocated(h) == n * slab
        h.reader.on_hello(m.Hello("compute", 1234, 1))  # a new compute warms up: the loan waits for it again
        assert h.reader.table.n_usable == n - lent and _allocated(h) == (n - lent) * slab
    finally:
        h.close()


def test_a_spares_adopts_what_compute_read_gives_the_rest_back_and_lends_more(h):
    """compute's own reads: a Spares lends slabs (free first, then evicting, the evicted gone
    from the index at once), adopts and publishes the experts compute read into lent slabs
    after the token's hits, frees a lent slab whose expert the reader holds already (a
    read of both) and the ones given back; a new compute's Hello frees whatever was lent."""
    n = h.reader.n_slabs
    assert n >= 6
    req = h.fetch(0, list(range(n)))
    for _ in range(n):
        h.land()
    for _ in range(n):
        h.answer()
    h.reader.on_release(m.Release((req,)))
    h.reader.on_spares(m.Spares(1, 3))
    lent = h.answer_spares().slabs
    assert len(lent) == 3 and h.reader.table.lent == frozenset(lent) and len(h.reader.table) == n - 3
    assert sum(h.visible((0, e)) for e in range(n)) == n - 3  # the evicted left the index
    # compute reads expert (1, 2) into a lent slab itself; (1, 3) too, which the reader also read on a Fetch
    h.reader.files.read_expert(h.mf.layout.expert_extents(1, 2), h.reader.arena.slab(lent[0]))
    req = h.fetch(1, [3])
    h.land()
    assert h.answer().hit is False
    installed = ((1, 2, lent[0]), (1, 3, lent[1]))
    h.reader.on_spares(m.Spares(2, 2, released=(req,), touched=((0, 0),), installed=installed, returned=(lent[2],)))
    more = h.answer_spares().slabs
    assert h.visible((1, 2)) and h.reader.table.lookup((1, 2)) == lent[0]
    h.assert_holds((1, 2), lent[0])
    assert h.reader.table.lookup((1, 3)) not in (None, lent[1])  # the reader's own copy stays
    assert len(more) == 2 and h.reader.table.lent == frozenset(more) and lent[0] not in more
    assert h.reader.table.stats.misses == n + 2  # the n, the Fetch's (1, 3) and compute's (1, 2)
    h.reader.on_hello(m.Hello("compute", 1234, 1))
    free = n - len(h.reader.table)
    assert h.reader.table.lent == frozenset() and all(h.reader.table.admit((2, e))[1] is None for e in range(free))
