"""The reader's lanes: demand reads before guesses before background reads,
promotion, withdrawal."""

from __future__ import annotations

import threading

import pytest

from moe_pipe.shared.experts.readlanes import Priority, ReadLanes


class HeldReads:
    """A lanes' work function that records each read as it starts and holds it until
    `release[key]` is set: the order reads start in, observed one by one."""

    def __init__(self, *keys: str):
        self.started: list = []
        self.release = {k: threading.Event() for k in keys}
        self.cond = threading.Condition()

    def work(self, key, slab) -> None:
        with self.cond:
            self.started.append(key)
            self.cond.notify_all()
        assert self.release[key].wait(10)

    def wait_started(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.started) >= n, 10), self.started


class Recorder:
    """A lane's work: records the order, and holds the first read until `go`."""

    def __init__(self):
        self.order: list = []
        self.started, self.go, self.done = threading.Event(), threading.Event(), threading.Event()
        self.expect = 0

    def work(self, key, slab):
        if not self.order:
            self.started.set()
            assert self.go.wait(10)
        self.order.append((key, slab))
        if len(self.order) == self.expect:
            self.done.set()


def busy_lane(expect: int):
    """One lane, its first read ("d0") held: what is submitted next queues."""
    rec = Recorder()
    rec.expect = expect
    lanes = ReadLanes(1, rec.work)
    lanes.submit("d0", 0)
    assert rec.started.wait(10)
    return lanes, rec


def finish(lanes, rec):
    rec.go.set()
    assert rec.done.wait(10)
    lanes.shutdown()
    return [k for k, _ in rec.order]


def test_demand_reads_go_before_guesses_before_background_each_in_order():
    lanes, rec = busy_lane(6)
    lanes.submit("b1", 5, Priority.BACKGROUND)
    lanes.submit("g1", 1, Priority.GUESS)
    lanes.submit("g2", 2, Priority.GUESS)
    lanes.submit("d1", 3)
    lanes.submit("d2", 4)
    assert lanes.queued() == (["d1", "d2"], ["g1", "g2"], ["b1"])
    assert finish(lanes, rec) == ["d0", "d1", "d2", "g1", "g2", "b1"]
    assert rec.order[1:] == [("d1", 3), ("d2", 4), ("g1", 1), ("g2", 2), ("b1", 5)]  # each with its own slab


def test_a_promoted_guess_or_background_read_joins_the_demand_queue():
    lanes, rec = busy_lane(5)
    lanes.submit("b1", 4, Priority.BACKGROUND)
    lanes.submit("g1", 1, Priority.GUESS)
    lanes.submit("g2", 2, Priority.GUESS)
    lanes.submit("d1", 3)
    assert lanes.promote("g2") and not lanes.promote("g2") and not lanes.promote("d1")
    assert lanes.promote("b1")
    assert finish(lanes, rec) == ["d0", "d1", "g2", "b1", "g1"]


def test_withdrawn_guesses_are_never_read_and_background_reads_stay():
    lanes, rec = busy_lane(2)
    for i, g in enumerate(("g1", "g2", "g3")):
        lanes.submit(g, i, Priority.GUESS)
    lanes.submit("b1", 9, Priority.BACKGROUND)
    assert lanes.withdraw_guesses(keep={"g2"}) == [("g1", 0), ("g3", 2)]
    assert lanes.withdraw_guesses() == [("g2", 1)]
    assert lanes.withdraw_guesses() == []
    assert finish(lanes, rec) == ["d0", "b1"]
    assert not lanes.promote("d0")  # a started read is no guess to promote


def test_shutdown_drops_the_queue_and_joins_the_lanes():
    lanes, rec = busy_lane(99)
    lanes.submit("d1", 1)
    lanes.submit("g1", 1, Priority.GUESS)
    rec.go.set()
    lanes.shutdown()
    assert [k for k, _ in rec.order][0] == "d0" and all(not t.is_alive() for t in lanes._threads)
    with pytest.raises(RuntimeError, match="shut down"):
        lanes.submit("d2", 2)


def test_at_least_one_lane():
    with pytest.raises(ValueError, match="at least one lane"):
        ReadLanes(0, lambda key, slab: None)


def test_guesses_leave_one_lane_for_demand():
    """Two lanes, two guesses queued: only one guess starts, so a demand read
    submitted while it runs starts at once on the other lane, before the
    second guess; that one starts when the first guess is done."""
    held = HeldReads("g1", "g2", "d1")
    started, release, wait_started = held.started, held.release, held.wait_started
    lanes = ReadLanes(2, held.work)
    lanes.submit("g1", 1, Priority.GUESS)
    lanes.submit("g2", 2, Priority.GUESS)
    wait_started(1)
    assert started == ["g1"] and lanes.queued() == ([], ["g2"], [])  # the second lane does not take g2
    lanes.submit("d1", 3)
    wait_started(2)
    assert started == ["g1", "d1"]  # the demand read did not wait for g1
    release["d1"].set()
    release["g1"].set()
    wait_started(3)
    assert started == ["g1", "d1", "g2"]
    release["g2"].set()
    lanes.shutdown()


def test_one_lane_still_reads_guesses():
    done = threading.Event()
    lanes = ReadLanes(1, lambda key, slab: done.set())
    lanes.submit("g1", 1, Priority.GUESS)
    assert done.wait(10)
    lanes.shutdown()


def test_background_reads_share_the_guesses_lanes_and_leave_one_for_demand():
    """Three lanes, a warm start's reads and a guess queued: two of them run
    (all lanes but one), so a demand read submitted meanwhile starts at once;
    the third speculative read waits for one of the first two to end."""
    held = HeldReads("b1", "b2", "g1", "d1")
    started, release, wait_started = held.started, held.release, held.wait_started
    lanes = ReadLanes(3, held.work)
    lanes.submit("b1", 1, Priority.BACKGROUND)
    lanes.submit("b2", 2, Priority.BACKGROUND)
    wait_started(2)
    lanes.submit("g1", 3, Priority.GUESS)
    lanes.submit("d1", 4)
    wait_started(3)
    assert started == ["b1", "b2", "d1"] and lanes.queued() == ([], ["g1"], [])
    release["b1"].set()
    wait_started(4)
    assert started[3] == "g1"  # a guess goes before the warm start's reads
    for e in release.values():
        e.set()
    lanes.shutdown()


def test_queued_background_reads_can_be_withdrawn_and_started_ones_run_on():
    lanes, rec = busy_lane(2)
    lanes.submit("b1", 1, Priority.BACKGROUND)
    lanes.submit("g1", 2, Priority.GUESS)
    lanes.submit("b2", 3, Priority.BACKGROUND)
    assert lanes.withdraw_background() == [("b1", 1), ("b2", 3)] and lanes.withdraw_background() == []
    assert finish(lanes, rec) == ["d0", "g1"]
