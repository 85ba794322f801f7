"""The hot set (shared/experts/hotset.py) and the reader's warm restart
(procs/reader.py): saved in heat order, read back at the next start behind
every demand read, skipped by --cold, ignored (with a log line) when it is
not this model's or not readable."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from moe_pipe.shared.experts import hotset as hs
from moe_pipe.shared.wire import messages as m

from .readerhelp import Harness, hold_reads_of

ID = ("1024:abc", "2048:def")


def test_a_saved_hot_set_reads_back_whole_and_in_order(tmp_path):
    path = hs.hot_set_path(ID, tmp_path)
    hot = hs.HotSet(ID, 4, 8, ((2, 1), (0, 7), (3, 0)), "tiny", 1.5)
    hs.save_hot_set(path, hot)
    assert hs.load_hot_set(path, ID, 4, 8) == hot
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    assert hs.hot_set_path(ID, tmp_path) == path and hs.hot_set_path(ID[:1], tmp_path) != path


def test_a_save_cut_short_by_kill9_leaves_the_last_whole_file_and_its_temp_is_swept(tmp_path):
    path = hs.hot_set_path(ID, tmp_path)
    hs.save_hot_set(path, hs.HotSet(ID, 4, 8, ((1, 1),)))
    dead = tmp_path / f".{path.name}.999999999.tmp"  # a writer that died mid-write (no such pid)
    dead.write_text('{"format": "moe-pipe hot')
    other = tmp_path / f".{path.name}.{os.getppid()}.tmp"
    other.write_text("")  # a live writer's (another service saving now): kept
    assert hs.load_hot_set(path, ID, 4, 8).experts == ((1, 1),)
    hs.save_hot_set(path, hs.HotSet(ID, 4, 8, ((2, 2),)))
    assert not dead.exists() and other.exists()


@pytest.mark.parametrize(
    "text, why",
    [
        (None, "there is none yet"),
        ("{not json", "not JSON"),
        ('{"format": "something else"}', "not a moe-pipe hot set"),
        ('{"format": "moe-pipe hot set", "version": 9}', "version 9"),
        ('{"format": "moe-pipe hot set", "version": 1, "model": ["1:x"]}', "another model file's"),
        ('{"format": "moe-pipe hot set", "version": 1, "model": %s, "n_layer": 5, "n_expert": 8}', "5-layer, 8-expert"),
        (
            '{"format": "moe-pipe hot set", "version": 1, "model": %s, "n_layer": 4, "n_expert": 8, "experts": [[4, 0]]}',
            "expert 0 of layer 4",
        ),
        (
            '{"format": "moe-pipe hot set", "version": 1, "model": %s, "n_layer": 4, "n_expert": 8, "experts": [[1, true]]}',
            r"not \[layer, expert\]",
        ),
    ],
)
def test_a_hot_set_that_cannot_warm_this_model_says_why(tmp_path, text, why):
    path = tmp_path / "h.json"
    if text is not None:
        path.write_text(text.replace("%s", json.dumps(list(ID))))
    with pytest.raises(hs.Unusable, match=why):
        hs.load_hot_set(path, ID, 4, 8)


def test_heat_ranks_by_recent_uses_and_a_seed_sits_below_one_use():
    heat = hs.Heat(half_life=1000)
    heat.seed([(0, 5), (0, 6), (0, 7)])  # an earlier run's order
    for key in [(1, 1)] * 3 + [(1, 2)] * 2 + [(1, 3)]:
        heat.use(key)
    assert heat.hottest([(0, 7), (1, 3), (0, 5), (1, 1), (0, 6), (1, 2), (2, 0)]) == [
        (1, 1),
        (1, 2),
        (1, 3),
        (0, 5),
        (0, 6),
        (0, 7),
        (2, 0),
    ]
    decaying = hs.Heat(half_life=4)
    for key in [(1, 1)] * 3 + [(1, 3)] * 12:  # three half-lives of (1, 3) alone: it outranks the older favourite
        decaying.use(key)
    assert decaying.hottest([(1, 1), (1, 3)]) == [(1, 3), (1, 1)]
    for _ in range(5000):  # many half-lives: rescaled, still finite and ordered
        decaying.use((2, 2))
    assert decaying.hottest([(1, 3), (2, 2)]) == [(2, 2), (1, 3)] and all(v < 1e300 for v in decaying.counts.values())


def test_the_progress_line_reads_as_the_issue_asks(tmp_path):
    assert hs.WarmProgress("warming", 812, 3071).text() == "warming 812/3,071 experts"
    done = hs.WarmProgress("stopped", 700, 3071, "/x.json", 4.25, "the cache filled first")
    assert done.text() == "warm start: 700/3,071 experts in 4.2 s (the cache filled first)"
    done.write(tmp_path)
    assert hs.read_warm_progress(tmp_path) == done
    (tmp_path / hs.PROGRESS_FILE).write_text("{")
    assert hs.read_warm_progress(tmp_path) is None and hs.read_warm_progress(tmp_path / "none") is None


# -- the reader --------------------------------------------------------------------------


def use(h: Harness, layer: int, experts) -> None:
    """One request's layer through the reader: its misses read, then released."""
    req = h.fetch(layer, experts)
    for _ in experts:
        h.land()
        h.answer()
    h.reader.on_release(m.Release((req,)))


@pytest.fixture
def hot_path(short_tmp):
    return str(short_tmp / "state" / "hot.json")


def reader_with_hot_set(model, hot_path, **kw) -> Harness:
    return Harness(model, hot_set=hot_path, **kw)


def test_the_hot_set_is_what_the_cache_holds_hottest_first_and_a_restart_reads_it_back(model, hot_path):
    h = reader_with_hot_set(model, hot_path, io_threads=1)
    try:
        use(h, 0, [1, 2, 3])
        h.reader.on_release(m.Release((), touched=((0, 3), (0, 3), (0, 2))))  # hits compute served from the index
        use(h, 2, [4])
        assert h.reader.poll_timeout_ms() is not None  # something to save: the loop wakes for it
        h.reader.save_hot_set(time.monotonic())
        assert h.reader.poll_timeout_ms() is None  # saved, nothing new: an idle reader sleeps
        saved = hs.load_hot_set(hot_path, h.reader.identity, 4, 8)
        # used 3, 2, 1 and 1 times; of the last two the later use is the hotter
        assert saved.experts == ((0, 3), (0, 2), (2, 4), (0, 1)) and saved.name == model.stem
    finally:
        h.close()
    # The next start of the same model: read back, hottest first, without a request.
    h = reader_with_hot_set(model, hot_path, io_threads=2)
    try:
        assert h.reader.warm_keys == list(saved.experts)
        h.reader.warm_start()
        for _ in saved.experts:
            h.land()
        assert all(h.visible(k) for k in saved.experts) and len(h.reader.table) == 4
        for key in saved.experts:
            h.assert_holds(key, h.reader.index.slabs(key[0], [key[1]])[0])
        progress = hs.read_warm_progress(h.res.rt.path)
        assert progress is not None and (progress.state, progress.done, progress.total, progress.source) == ("done", 4, 4, hot_path)
        assert h.reader.table.n_pinned == 0
        # Unused since, the experts keep their order: a save now writes the same list.
        h.reader.save_hot_set(time.monotonic())
        assert hs.load_hot_set(hot_path, h.reader.identity, 4, 8).experts == saved.experts
    finally:
        h.close()


def test_a_warm_read_never_goes_in_front_of_a_demand_read(model, hot_path):
    """Two lanes: the warm start holds one (its read held here), and a request's
    miss is read at once on the other and answered while the warm read still
    runs; the warm start's next read queues behind it."""
    hs.save_hot_set(hot_path, hs.HotSet(_identity(model), 4, 8, ((0, 0), (0, 1), (0, 2))))
    h = reader_with_hot_set(model, hot_path, io_threads=2)
    try:
        entered, release = hold_reads_of(h, (0, 0), fail=False)
        h.reader.warm_start()
        assert entered.wait(10)
        # the window: two warm reads, of which one runs (one lane of two is kept for demand reads)
        assert h.reader.lanes.queued() == ([], [], [(0, 1)])
        req = h.fetch(3, [5, 6])
        h.land()
        h.land()
        assert {(a.req_id, a.expert) for a in (h.answer(), h.answer())} == {(req, 5), (req, 6)}  # while (0, 0) is held
        assert not h.visible((0, 0))
        release.set()
        for _ in range(3):
            h.land()
        assert all(h.visible((0, e)) for e in range(3)) and h.reader.warm.state == "done"
    finally:
        h.close()


def test_a_demand_for_a_queued_warm_read_promotes_it(model, hot_path):
    hs.save_hot_set(hot_path, hs.HotSet(_identity(model), 4, 8, ((0, 0), (1, 1), (1, 2))))
    h = reader_with_hot_set(model, hot_path, io_threads=1)
    try:
        entered, release = hold_reads_of(h, (0, 0), fail=False)
        h.reader.warm_start()
        assert entered.wait(10)
        h.reader.warm_window = 3  # queue the rest too
        h.reader.feed_warm_start()
        assert h.reader.lanes.queued() == ([], [], [(1, 1), (1, 2)])
        req = h.fetch(1, [2])
        assert h.reader.lanes.queued() == ([(1, 2)], [], [(1, 1)])
        release.set()
        for _ in range(3):
            h.land()
        ready = h.answer()
        assert (ready.req_id, ready.expert, ready.hit) == (req, 2, False) and h.reader.warm.done == 3
    finally:
        h.close()


def test_the_warm_start_stops_when_requests_fill_the_cache_first(model, hot_path):
    """Eight slabs, a hot set of eight: one warm read runs (held here), one is
    queued. A request's seven misses take the six free slabs and the queued
    warm read's (withdrawn: a request never fails for a warm read's slab), and
    the warm start stops."""
    hs.save_hot_set(hot_path, hs.HotSet(_identity(model), 4, 8, tuple((3, e) for e in range(8))))
    h = reader_with_hot_set(model, hot_path, io_threads=1)
    try:
        entered, release = hold_reads_of(h, (3, 0), fail=False)
        h.reader.warm_start()
        assert entered.wait(10) and h.reader.lanes.queued() == ([], [], [(3, 1)])
        req = h.fetch(0, range(7))
        assert (3, 1) not in h.reader.table and h.reader.lanes.queued()[2] == []
        release.set()
        for _ in range(8):
            h.land()
        answers = [h.answer() for _ in range(7)]
        assert all(isinstance(a, m.Ready) for a in answers) and {a.expert for a in answers} == set(range(7))
        w = h.reader.warm
        assert (w.state, w.done, w.note) == ("stopped", 1, "the cache filled first")
        assert hs.read_warm_progress(h.res.rt.path).text().startswith("warm start: 1/8 experts")
        h.reader.on_release(m.Release((req,)))
        assert h.reader.table.n_pinned == 0 and len(h.reader.table) == 8
    finally:
        h.close()


def test_a_save_while_warming_keeps_the_experts_not_read_yet(model, hot_path):
    keys = ((0, 0), (0, 1), (2, 2), (2, 3))
    hs.save_hot_set(hot_path, hs.HotSet(_identity(model), 4, 8, keys))
    h = reader_with_hot_set(model, hot_path, io_threads=1)
    try:
        h.reader.warm_start()
        h.land()  # one read; a `down` now must not shrink the hot set to it
        h.reader.save_hot_set(time.monotonic())
        assert hs.load_hot_set(hot_path, h.reader.identity, 4, 8).experts == keys
    finally:
        h.close()


def test_cold_skips_the_hot_set_and_still_saves_one(model, hot_path, caplog):
    hs.save_hot_set(hot_path, hs.HotSet(_identity(model), 4, 8, ((0, 0), (0, 1))))
    caplog.set_level(logging.INFO, "moe_pipe.reader")
    h = reader_with_hot_set(model, hot_path, **{"cache.warm_start": False})
    try:
        assert h.reader.warm_keys == [] and "--cold" in caplog.text
        h.reader.warm_start()
        assert len(h.reader.table) == 0 and hs.read_warm_progress(h.res.rt.path) is None
        use(h, 1, [5])
        h.reader.save_hot_set(time.monotonic())
        assert hs.load_hot_set(hot_path, h.reader.identity, 4, 8).experts == ((1, 5),)
    finally:
        h.close()


@pytest.mark.parametrize("bad", ["corrupt", "other model"])
def test_a_corrupt_or_other_model_hot_set_is_ignored_with_a_log_line(model, hot_path, caplog, bad):
    if bad == "corrupt":
        os.makedirs(os.path.dirname(hot_path), exist_ok=True)
        with open(hot_path, "w") as f:
            f.write('{"format": "moe-pipe hot set", "version": 1, "model": [')
    else:
        hs.save_hot_set(hot_path, hs.HotSet(("99:feed",), 4, 8, ((0, 0),)))
    caplog.set_level(logging.INFO, "moe_pipe.reader")
    h = reader_with_hot_set(model, hot_path)
    try:
        assert h.reader.warm_keys == []
        line = next(r.getMessage() for r in caplog.records if "ignored" in r.getMessage())
        assert hot_path in line and ("not JSON" if bad == "corrupt" else "another model file's") in line and "starts cold" in line
        # Serving overwrites it with this model's own once something was used.
        use(h, 0, [3])
        h.reader.save_hot_set(time.monotonic())
        assert hs.load_hot_set(hot_path, h.reader.identity, 4, 8).experts == ((0, 3),)
    finally:
        h.close()


def test_a_one_shot_run_keeps_no_hot_set(model, short_tmp):
    h = Harness(model)  # `run`: no hot-set file in its facts
    try:
        use(h, 0, [1])
        h.reader.save_hot_set(time.monotonic())
        assert h.reader.poll_timeout_ms() is None and not list(short_tmp.rglob("*.json"))
    finally:
        h.close()


def _identity(model) -> tuple[str, ...]:
    from moe_pipe.shared.experts.directio import model_identity

    return model_identity([model])


def test_status_shows_the_warm_start_under_its_heading():
    from moe_pipe.cli.status_cmd import format_status

    proc = {
        "name": "reader",
        "state": "RUNNING",
        "pid": 7,
        "uptime_s": 3.0,
        "restarts": 0,
        "rss_bytes": None,
        "last_error": "",
        "last_exit": "",
    }
    d = {"name": "tiny", "pid": 1, "uptime_s": 3.0, "model_name": "m", "model": "m.gguf", "url": "http://x", "budget_bytes": 1 << 20}
    d |= {"slabs": 1, "budget": "b", "tokens": 0, "hit_pct": None, "runtime_dir": "/r", "processes": [proc]}
    assert "warming" not in format_status(d | {"warming": None})
    w = hs.WarmProgress("warming", 812, 3071)
    assert format_status(d | {"warming": {"text": w.text()}}).splitlines()[2] == "warming 812/3,071 experts"


def test_after_a_warm_start_the_policy_keeps_the_hottest_longest(model, hot_path):
    """The warmed experts were admitted hottest first; an LRU would evict the
    hottest first unless shown them again, coldest first. One a request used
    meanwhile is hotter than any only warmed."""
    keys = ((0, 0), (1, 1), (2, 2), (3, 3))
    hs.save_hot_set(hot_path, hs.HotSet(_identity(model), 4, 8, keys))
    h = reader_with_hot_set(model, hot_path, io_threads=1, **{"cache.policy": "lru"})
    try:
        h.reader.warm_start()
        h.land()
        h.fetch(0, [0])  # a request uses the hottest while the rest are read
        h.answer()
        for _ in keys[1:]:
            h.land()
        assert h.reader.warm.state == "done"
        assert h.reader.table.policy.order() == [(3, 3), (2, 2), (1, 1), (0, 0)]  # coldest first: the next victim
        assert h.reader.table.stats.hits == 1  # the refresh counts no hit
    finally:
        h.close()
