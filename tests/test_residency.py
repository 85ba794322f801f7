"""The residency index: entries published by the reader, seen by an attached reader of the same segment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_pipe.shared.experts.residency import ResidencyIndex

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
        assert other.slots(1, [4, 5]) == [-1, 7]
        assert sorted(other.entries()) == [((1, 5), 7), ((2, 0), 0)]
        index.clear((1, 5))
        assert other.slots(1, [5]) == [-1]
    finally:
        other.close()


def test_a_closed_index_says_so_and_closes_twice(index):
    index.close()
    index.close()  # idempotent, like the arena under it
    with pytest.raises(ValueError, match=r"residency index '.*' is closed"):
        index.slots(0, [0])
