"""The residency index: entries published by the reader, seen by an attached
reader of the same segment; and the pin / in-flight states beside it, as the
reader keeps them and the web page's heatmap reads them (docs/web.md)."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest

from moe_pipe.shared.experts.residency import INFLIGHT, PINNED, ResidencyIndex
from moe_pipe.shared.wire import messages as m

from .readerhelp import hold_reads_of

SPEC = SimpleNamespace(n_layer=3, n_expert=8)


@pytest.fixture
def index():
    idx = ResidencyIndex.create(SPEC)
    yield idx
    idx.close()
    idx.unlink()


def test_published_entries_are_seen_through_another_mapping(index):
    index.publish((1, 5), 7)
    index.publish((2, 0), 0)
    other = ResidencyIndex.attach(index.name, SPEC)
    try:
        assert other.slabs(1, [4, 5]) == [-1, 7]
        assert sorted(other.entries()) == [((1, 5), 7), ((2, 0), 0)]
        index.clear((1, 5))
        assert other.slabs(1, [5]) == [-1]
    finally:
        other.close()


def test_a_closed_index_says_so_and_closes_twice(index):
    index.close()
    index.close()  # idempotent, like the arena under it
    with pytest.raises(ValueError, match=r"residency index '.*' is closed"):
        index.slabs(0, [0])


def test_states_sit_beside_the_table_and_leave_it_alone(index):
    index.publish((1, 5), 7)
    index.mark_pinned((1, 5), True)
    index.mark_inflight((2, 3), True)
    index.mark_pinned((2, 3), True)
    other = ResidencyIndex.attach(index.name, SPEC)
    try:
        # what compute reads is unchanged by the states: the same slabs, the same entries
        assert other.slabs(1, [5]) == [7] and other.slabs(2, [3]) == [-1] and other.entries() == [((1, 5), 7)]
        assert other.states[1, 5] == PINNED and other.states[2, 3] == PINNED | INFLIGHT and other.states.sum() == PINNED * 2 + INFLIGHT
        index.mark_inflight((2, 3), False)
        index.mark_pinned((1, 5), False)
        assert other.states[2, 3] == PINNED and other.states[1, 5] == 0
        index.clear_states()  # a new reader: no pins, no reads
        assert not other.states.any() and other.entries() == [((1, 5), 7)]
    finally:
        other.close()


def heatmap(h):
    """What the gateway would send the page now: its snapshot of the reader's index and states."""
    from moe_pipe.procs import gateway_events as ge

    spec = h.mf.spec
    view = ge.Residency("", ge.PageFacts(spec.n_layer, spec.n_expert, spec.n_expert_used, 0, None))
    view.index = ResidencyIndex.attach(h.reader.index.name, spec)  # as attach() finds it through the supervisor
    try:
        snap = view.snapshot()
    finally:
        view.close()
    assert snap is not None
    cells = {
        k: np.unpackbits(np.frombuffer(base64.b64decode(snap[k]), np.uint8))[: spec.n_layer * spec.n_expert]
        for k in ("resident", "pinned", "inflight")
    }
    assert (snap["count"], snap["pinned_count"], snap["inflight_count"]) == tuple(
        int(cells[k].sum()) for k in ("resident", "pinned", "inflight")
    )
    return snap, {k: {divmod(int(i), spec.n_expert) for i in np.flatnonzero(v)} for k, v in cells.items()}


def test_the_heatmap_shows_what_the_reader_pins_and_reads(harness):
    """The reader with one read held in flight: the gateway's frame shows that
    read, the reader's own count of pinned experts, and the index's resident
    ones — at each step of a fetch, its answers, the next fetch and the Release."""
    h = harness
    reader = h.reader

    def agrees() -> dict[str, set]:
        snap, cells = heatmap(h)
        assert snap["count"] == int((reader.index.table > 0).sum())
        assert snap["pinned_count"] == reader.table.n_pinned and cells["pinned"] == {
            k for k in reader.table.resident() if reader.table.pins(k)
        }
        assert cells["inflight"] == set(reader.inflight)
        return cells

    assert agrees() == {"resident": set(), "pinned": set(), "inflight": set()}
    entered, release = hold_reads_of(h, (1, 3), fail=False)
    first = h.fetch(1, [3, 5])
    assert entered.wait(10)
    h.land()  # (1, 5): the other lane's
    assert h.answer().expert == 5
    cells = agrees()
    assert cells == {"resident": {(1, 5)}, "pinned": {(1, 3), (1, 5)}, "inflight": {(1, 3)}}  # 3's read is held
    release.set()
    h.land()
    assert h.answer().expert == 3
    assert agrees() == {"resident": {(1, 3), (1, 5)}, "pinned": {(1, 3), (1, 5)}, "inflight": set()}  # compute still uses both
    second = h.fetch(2, [0], resident=[], released=[first])  # done with layer 1
    h.land()
    h.answer()
    assert agrees() == {"resident": {(1, 3), (1, 5), (2, 0)}, "pinned": {(2, 0)}, "inflight": set()}
    reader.on_release(m.Release(released=(second,)))
    assert agrees()["pinned"] == set() and reader.table.n_pinned == 0


def test_a_failed_read_leaves_no_state_behind(harness):
    h = harness
    entered, release = hold_reads_of(h, (0, 2), fail=True)
    h.fetch(0, [2])
    assert entered.wait(10)
    assert h.reader.index.states[0, 2] == PINNED | INFLIGHT
    release.set()
    h.land()
    assert isinstance(h.answer(), m.FetchFailed)
    assert not h.reader.index.states.any() and h.reader.table.n_pinned == 0
