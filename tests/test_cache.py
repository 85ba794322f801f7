"""The cache index: pure logic, checked against hand counts and a reference model."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from moe_pipe.shared.cache import LRU, POLICIES, CacheFull, SlotTable, check_budget, make_policy, slots_for_budget
from moe_pipe.shared.errors import ConfigError

MIB = 1 << 20


def get(t: SlotTable, key, nbytes=0):
    """The reader's step for one expert: hit, or admit on a miss."""
    slot = t.lookup(key)
    if slot is None:
        slot, _ = t.admit(key, nbytes)
    return slot


def test_lru_evicts_least_recently_used():
    t = SlotTable(3, "lru")
    assert [t.admit(k) for k in "abc"] == [(0, None), (1, None), (2, None)]
    assert t.lookup("a") == 0  # order now b, c, a
    assert t.admit("d") == (1, "b")  # d takes b's slot
    assert t.lookup("b") is None
    assert t.admit("e") == (2, "c")
    assert t.policy.order() == ["a", "d", "e"]
    assert t.resident() == {"a": 0, "d": 1, "e": 2}
    assert t.key_of(1) == "d" and "c" not in t and len(t) == 3


def test_pinned_slots_are_never_evicted():
    t = SlotTable(3)
    for k in "abc":
        t.admit(k)
    t.pin("a")
    t.pin("b")
    assert t.admit("d") == (2, "c")  # a and b are colder but pinned
    t.pin("d")
    t.pin("a")  # counts: a twice
    with pytest.raises(CacheFull):
        t.admit("e")
    t.unpin("a")
    with pytest.raises(CacheFull):  # a still pinned once
        t.admit("e")
    t.unpin("a")
    assert t.admit("e") == (0, "a")
    assert t.pins("b") == 1 and t.n_pinned == 2


def test_cache_full_changes_nothing():
    t = SlotTable(2)
    t.admit("a", pin=True)
    t.admit("b", pin=True)
    before = (t.resident(), t.stats)
    with pytest.raises(CacheFull, match="all 2 cache slots are pinned"):
        t.admit("c", 10)
    assert (t.resident(), t.stats) == before


def test_pin_errors():
    t = SlotTable(2)
    with pytest.raises(KeyError):
        t.pin("x")
    t.admit("a")
    with pytest.raises(ValueError):
        t.unpin("a")
    with pytest.raises(ValueError):
        t.admit("a")  # already resident


def test_drop_frees_the_slot_without_counting_an_eviction():
    t = SlotTable(2)
    t.admit("a", pin=True)
    t.admit("b")
    with pytest.raises(ValueError):
        t.drop("a")  # pinned
    assert t.drop("b") == 1
    assert "b" not in t and t.admit("c") == (1, None)
    assert t.stats.evictions == 0


def reference_lru(n_slots: int, accesses) -> tuple[int, int, int]:
    """Hand count: a list in recency order, no cleverness."""
    order: list = []
    hits = misses = evictions = 0
    for k in accesses:
        if k in order:
            hits += 1
            order.remove(k)
        else:
            misses += 1
            if len(order) == n_slots:
                order.pop(0)
                evictions += 1
        order.append(k)
    return hits, misses, evictions


@pytest.mark.parametrize("seed", range(5))
def test_counts_match_a_hand_count_on_random_accesses(seed):
    rng = random.Random(seed)
    n_slots = rng.randint(1, 12)
    keys = [(layer, e) for layer in range(3) for e in range(rng.randint(2, 8))]
    # Skewed, with runs: a working set that drifts, as routing does.
    accesses = [keys[min(len(keys) - 1, int(rng.expovariate(0.3)) + i // 50)] for i in range(600)]
    t = SlotTable(n_slots)
    for k in accesses:
        get(t, k, nbytes=100)
    hits, misses, evictions = reference_lru(n_slots, accesses)
    s = t.stats
    assert (s.hits, s.misses, s.evictions) == (hits, misses, evictions)
    assert s.bytes_admitted == 100 * misses and s.lookups == len(accesses)
    assert s.hit_rate == pytest.approx(hits / len(accesses))
    assert len(t) == min(n_slots, len(set(accesses)))
    # every slot holds a distinct key and the two maps agree
    assert all(t.key_of(slot) == key for key, slot in t.resident().items())


def test_with_pins_a_layer_in_flight_survives_its_own_misses():
    """The reader's pattern: pin each expert of a request until compute releases the layer."""
    rng = random.Random(7)
    t = SlotTable(8)
    for _ in range(200):
        layer = rng.randrange(4)
        request = [(layer, e) for e in rng.sample(range(16), 4)]
        for i, key in enumerate(request):
            slot = t.lookup(key)
            if slot is None:
                slot, evicted = t.admit(key, pin=True)
                assert evicted not in request[:i]  # what this request already holds stays
            else:
                t.pin(key)
        assert all(t.pins(k) == 1 for k in request)
        for key in request:
            t.unpin(key)
    assert t.n_pinned == 0


def test_policies_plug_in_through_the_protocol():
    class FIFO:
        def __init__(self, n_slots=None):
            self.q = []

        def on_hit(self, key): pass
        def on_admit(self, key): self.q.append(key)
        def on_evict(self, key): self.q.remove(key)

        def victim(self, is_evictable):
            return next((k for k in self.q if is_evictable(k)), None)

    t = SlotTable(2, FIFO())
    t.admit("a")
    t.admit("b")
    t.lookup("a")  # FIFO ignores the hit
    assert t.admit("c") == (0, "a")

    class Bad(FIFO):
        def victim(self, is_evictable):
            return self.q[0]  # ignores pins

    t = SlotTable(1, Bad())
    t.admit("a", pin=True)
    with pytest.raises(RuntimeError, match="not an evictable"):
        t.admit("b")


def test_policy_registry():
    assert POLICIES["lru"] is LRU
    assert isinstance(SlotTable(4, "lru").policy, LRU)
    with pytest.raises(ConfigError, match="allowed: lru"):
        make_policy("mru", 4)


def fake_layout(n_layer=48, top_k=8, slab_bytes=3 * MIB + 4096):
    spec = SimpleNamespace(n_layer=n_layer, n_expert_used=top_k)
    return SimpleNamespace(spec=spec, slab_bytes=slab_bytes,
                           min_cache_bytes=lambda k=None: n_layer * (top_k if k is None else k) * slab_bytes)


def test_slots_for_budget():
    assert slots_for_budget(10 * MIB, 3 * MIB) == 3
    assert slots_for_budget(0, 4096) == 0
    with pytest.raises(ValueError):
        slots_for_budget(MIB, 0)


def test_budget_refusal_names_the_minimum():
    lay = fake_layout()
    need = 48 * 6 * lay.slab_bytes  # top_k override 6
    with pytest.raises(ConfigError) as err:
        check_budget(need - 1, lay, top_k=6)
    msg = str(err.value)
    assert f"{need / MIB:.2f} MiB" in msg  # 865.12 MiB
    assert "48 layers x top-6" in msg and "\n" not in msg
    assert f"at least {-(-need // MIB)}" in msg
    assert check_budget(need, lay, top_k=6) == 48 * 6
    assert check_budget(need + lay.slab_bytes - 1, lay, top_k=6) == 48 * 6
    with pytest.raises(ConfigError, match=f"{48 * 8 * lay.slab_bytes / MIB:.2f} MiB"):
        check_budget(need, lay)  # default top_k 8


def test_budget_minimum_is_rounded_up():
    lay = fake_layout(n_layer=1, top_k=1, slab_bytes=4096 * 3)  # 0.01171875 MiB
    with pytest.raises(ConfigError, match=r"working set of 0\.02 MiB"):
        check_budget(0, lay)
