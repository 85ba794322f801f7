"""The cache index: pure logic, checked against hand counts and a reference model."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace

import pytest

from moe_pipe.shared.errors import ConfigError
from moe_pipe.shared.experts.budget import CacheFloor, check_floor, compute_budget, slabs_for_budget
from moe_pipe.shared.experts.cache import CacheFull, SlabTable
from moe_pipe.shared.experts.policies import (
    ARC,
    DEFAULT_POLICY,
    LFU,
    LIVE_POLICIES,
    LRU,
    OFFLINE_POLICIES,
    POLICIES,
    S3FIFO,
    Belady,
    NextUse,
    make_policy,
)

MIB = 1 << 20


def get(t: SlabTable, key, nbytes=0):
    """The reader's step for one expert: hit, or admit on a miss."""
    slab = t.lookup(key)
    if slab is None:
        slab, _ = t.admit(key, nbytes)
    return slab


def test_lru_evicts_least_recently_used():
    t = SlabTable(3, "lru")
    assert [t.admit(k) for k in "abc"] == [(0, None), (1, None), (2, None)]
    assert t.lookup("a") == 0  # order now b, c, a
    assert t.admit("d") == (1, "b")  # d takes b's slab
    assert t.lookup("b") is None
    assert t.admit("e") == (2, "c")
    assert t.policy.order() == ["a", "d", "e"]
    assert t.resident() == {"a": 0, "d": 1, "e": 2}
    assert t.key_of(1) == "d" and "c" not in t and len(t) == 3


def test_pinned_slabs_are_never_evicted():
    t = SlabTable(3)
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
    t = SlabTable(2)
    t.admit("a", pin=True)
    t.admit("b", pin=True)
    before = (t.resident(), t.stats)
    with pytest.raises(CacheFull, match="all 2 cache slabs are pinned"):
        t.admit("c", 10)
    assert (t.resident(), t.stats) == before


def test_pin_errors():
    t = SlabTable(2)
    with pytest.raises(KeyError):
        t.pin("x")
    t.admit("a")
    with pytest.raises(ValueError):
        t.unpin("a")
    with pytest.raises(ValueError):
        t.admit("a")  # already resident


def test_drop_frees_the_slab_without_counting_an_eviction():
    t = SlabTable(2)
    t.admit("a", pin=True)
    t.admit("b")
    with pytest.raises(ValueError):
        t.drop("a")  # pinned
    assert t.drop("b") == 1
    assert "b" not in t and t.admit("c") == (1, None)
    assert t.stats.evictions == 0


def reference_lru(n_slabs: int, accesses) -> tuple[int, int, int]:
    """Hand count: a list in recency order, no cleverness."""
    order: list = []
    hits = misses = evictions = 0
    for k in accesses:
        if k in order:
            hits += 1
            order.remove(k)
        else:
            misses += 1
            if len(order) == n_slabs:
                order.pop(0)
                evictions += 1
        order.append(k)
    return hits, misses, evictions


@pytest.mark.parametrize("seed", range(5))
def test_counts_match_a_hand_count_on_random_accesses(seed):
    rng = random.Random(seed)
    n_slabs = rng.randint(1, 12)
    keys = [(layer, e) for layer in range(3) for e in range(rng.randint(2, 8))]
    # Skewed, with runs: a working set that drifts, as routing does.
    accesses = [keys[min(len(keys) - 1, int(rng.expovariate(0.3)) + i // 50)] for i in range(600)]
    t = SlabTable(n_slabs)
    for k in accesses:
        get(t, k, nbytes=100)
    hits, misses, evictions = reference_lru(n_slabs, accesses)
    s = t.stats
    assert (s.hits, s.misses, s.evictions) == (hits, misses, evictions)
    assert s.bytes_admitted == 100 * misses and s.lookups == len(accesses)
    assert s.hit_rate == pytest.approx(hits / len(accesses))
    assert len(t) == min(n_slabs, len(set(accesses)))
    # every slab holds a distinct key and the two maps agree
    assert all(t.key_of(slab) == key for key, slab in t.resident().items())


def test_with_pins_a_layer_in_flight_survives_its_own_misses():
    """The reader's pattern: pin each expert of a request until compute releases the layer."""
    rng = random.Random(7)
    t = SlabTable(8)
    for _ in range(200):
        layer = rng.randrange(4)
        request = [(layer, e) for e in rng.sample(range(16), 4)]
        for i, key in enumerate(request):
            slab = t.lookup(key)
            if slab is None:
                slab, evicted = t.admit(key, pin=True)
                assert evicted not in request[:i]  # what this request already holds stays
            else:
                t.pin(key)
        assert all(t.pins(k) == 1 for k in request)
        for key in request:
            t.unpin(key)
    assert t.n_pinned == 0


def test_policies_plug_in_through_the_protocol():
    class FIFO:
        def __init__(self, n_slabs=None):
            self.q = []

        def on_hit(self, key):
            pass

        def on_admit(self, key):
            self.q.append(key)

        def on_evict(self, key):
            self.q.remove(key)

        def victim(self, is_evictable):
            return next((k for k in self.q if is_evictable(k)), None)

    t = SlabTable(2, FIFO())
    t.admit("a")
    t.admit("b")
    t.lookup("a")  # FIFO ignores the hit
    assert t.admit("c") == (0, "a")

    class Bad(FIFO):
        def victim(self, is_evictable):
            return self.q[0]  # ignores pins

    t = SlabTable(1, Bad())
    t.admit("a", pin=True)
    with pytest.raises(RuntimeError, match="not an evictable"):
        t.admit("b")


def test_policy_registry():
    assert POLICIES["lru"] is LRU
    assert isinstance(SlabTable(4, "lru").policy, LRU)
    with pytest.raises(ConfigError, match="allowed: lru"):
        make_policy("mru", 4)


def fake_layout(n_layer=48, top_k=8, slab_bytes=3 * MIB + 4096):
    return SimpleNamespace(
        spec=SimpleNamespace(n_layer=n_layer, moe_layers=tuple(range(n_layer)), n_expert_used=top_k), slab_bytes=slab_bytes
    )


def test_slabs_for_budget():
    assert slabs_for_budget(10 * MIB, 3 * MIB) == 3
    assert slabs_for_budget(0, 4096) == 0
    with pytest.raises(ValueError):
        slabs_for_budget(MIB, 0)


def fixed(mb: float):
    return compute_budget(mb, 1e9, None, dense_bytes=0, kv_bytes=0, dense_policy="mmap")


def test_budget_refusal_names_the_minimum_and_what_it_is_made_of():
    lay = fake_layout()
    floor = CacheFloor.of(lay, top_k=6)
    need = 48 * 6 * lay.slab_bytes
    assert floor.bytes == need
    with pytest.raises(ConfigError) as err:
        check_floor(fixed((need - 1) / MIB), floor, "c.toml")
    msg = str(err.value)
    assert msg.startswith("c.toml: expert cache of 865.12 MiB is below one token's working set of 865.13 MiB")
    assert "48 layers x top-6 experts x 3.00 MiB slabs" in msg and "\n" not in msg
    assert msg.endswith("set cache_mb to at least 865.13")
    assert check_floor(fixed(need / MIB), floor) == 48 * 6
    assert check_floor(fixed((need + lay.slab_bytes - 1) / MIB), floor) == 48 * 6
    with pytest.raises(ConfigError, match="top-8 experts"):
        check_floor(fixed(need / MIB), CacheFloor.of(lay))  # the model's own top_k, 8


def test_budget_minimum_is_rounded_up():
    floor = CacheFloor.of(fake_layout(n_layer=1, top_k=1, slab_bytes=4096 * 3))  # 0.01171875 MiB
    assert floor.mib == 0.02
    with pytest.raises(ConfigError, match=r"working set of 0\.02 MiB.*at least 0\.02$"):
        check_floor(fixed(0), floor)
    assert check_floor(fixed(floor.mib), floor) == 1  # the printed figure suffices


# -- the other policies ------------------------------------------------------------------


def reader_workload(seed: int, n_layer=4, n_expert=12, k=3, tokens=60) -> list[list[tuple[int, int]]]:
    """Fetches as the reader gets them: per token, per layer, k distinct experts
    drawn from a skewed distribution that drifts."""
    rng = random.Random(seed)
    out = []
    for t in range(tokens):
        for layer in range(n_layer):
            weights = [1 / (1 + (e + t // 20 + layer) % n_expert) for e in range(n_expert)]
            picks: list[int] = []
            while len(picks) < k:
                e = rng.choices(range(n_expert), weights)[0]
                if e not in picks:
                    picks.append(e)
            out.append([(layer, e) for e in picks])
    return out


def make(name: str, n_slabs: int, future=None):
    return make_policy(name, n_slabs, future=future if name in OFFLINE_POLICIES else None)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("seed", range(3))
def test_every_policy_respects_pins_in_the_readers_pattern(name, seed):
    """Fetch by fetch, as the reader: hits pinned first, misses admitted pinned,
    a few pins held over into later fetches (a read in flight, a slow release)."""
    fs = reader_workload(seed)
    rng = random.Random(seed)
    t = SlabTable(10, make(name, 10, fs))
    held: list = []
    for fetch in fs:
        missed = [key for key in fetch if t.lookup(key) is None]
        for key in fetch:
            if key not in missed:
                t.pin(key)
        for key in missed:
            _, evicted = t.admit(key, pin=True)
            assert evicted not in fetch and evicted not in held  # SlabTable checks pins too
        for key in fetch:
            if rng.random() < 0.1 and len(held) < 3:
                held.append(key)  # keeps this pin a while
            else:
                t.unpin(key)
        while len(held) > 2 or (held and rng.random() < 0.3):
            t.unpin(held.pop(0))
    s = t.stats
    assert s.lookups == sum(len(f) for f in fs) and 0 < s.hits < s.lookups
    assert len(t) == 10 and all(t.key_of(slab) == key for key, slab in t.resident().items())


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_answers_none_when_all_is_pinned(name):
    keys = [(0, e) for e in range(4)]
    t = SlabTable(4, make(name, 4, [[k] for k in keys] + [[(0, 9)]]))
    for key in keys:
        t.admit(key, pin=True)
    assert t.policy.victim(lambda k: False) is None
    with pytest.raises(CacheFull):
        t.admit((0, 9))
    t.unpin((0, 2))
    assert t.admit((0, 9))[1] == (0, 2)  # the only unpinned key


def test_live_policies_and_the_default():
    assert "belady" in OFFLINE_POLICIES and "belady" not in LIVE_POLICIES
    assert DEFAULT_POLICY in LIVE_POLICIES and set(LIVE_POLICIES) | OFFLINE_POLICIES == set(POLICIES)
    with pytest.raises(ConfigError, match="needs to know the future.*simulator"):
        SlabTable(4, "belady")
    with pytest.raises(ConfigError, match="allowed: lru, lfu"):
        make_policy("belad", 4)


def test_lfu_keeps_the_frequent_key():
    t = SlabTable(3, LFU(3, half_life=1000))
    for key in "abc":
        get(t, key)
    for _ in range(4):
        get(t, "a")
    get(t, "c")  # b and d: once each; b is older
    assert t.admit("d") == (1, "b")
    assert t.admit("e") == (1, "d")  # d (once) goes before c (twice) and a


def test_lfu_decay_forgets_old_favourites():
    t = SlabTable(2, LFU(2, half_life=4))
    for _ in range(6):
        get(t, "old")
    for _ in range(40):  # 10 half-lives of other traffic: "old"'s six uses are worth ~0.006 now
        get(t, "new")
    get(t, "x")  # 2 slabs, both taken: x evicts the lower decayed count
    assert "old" not in t and "new" in t


def test_arc_keeps_the_twice_used_through_a_scan_and_adapts():
    arc, lru = SlabTable(4, ARC(4)), SlabTable(4, "lru")
    for t in (arc, lru):
        for key in ("a", "b", "a", "b"):
            get(t, key)
        for i in range(8):  # a scan of one-time keys
            get(t, f"scan{i}")
    assert "a" in arc and "b" in arc  # in T2: the scan only churns T1
    assert "a" not in lru and "b" not in lru
    p = arc.policy.p
    ghost = next(iter(arc.policy.b1))  # a key the scan lost from T1
    get(arc, ghost)
    assert arc.policy.p > p  # a ghost hit in B1: T1 should have been bigger
    assert ghost in arc.policy.t2


def test_s3fifo_filters_one_hit_wonders_and_remembers_ghosts():
    t = SlabTable(10, S3FIFO(10))
    for key in ("hot1", "hot2"):
        get(t, key)
        get(t, key)  # used again while in S: moves to M on its way out
    for i in range(30):
        get(t, f"once{i}")
    assert "hot1" in t and "hot2" in t
    pol = t.policy
    assert "hot1" in pol.m and "hot2" in pol.m  # the one-hit wonders churn through S
    ghost = next(reversed(pol.g))  # the newest ghost (the oldest may fall off G on the way)
    get(t, ghost)
    assert ghost in pol.m  # back from the ghost queue: straight to main


def test_nextuse_evicts_the_layer_that_waits_longest():
    """3 layers. x = (2, x) was used on token 1, y = (0, y) on token 2; now token 3
    is at layer 1. LRU evicts x (older) though layer 2 comes next; nextuse evicts
    y: layer 0 has passed since y's use, and y was picked on 1 of 3 passes of
    its layer against x's 1 of 2."""
    lru, nu = LRU(), NextUse(8)
    x, y = (2, "x"), (0, "y")
    seen = set()
    for token in ([(0, "a"), (1, "q"), x], [y, (1, "q"), (2, "r")], [(0, "a"), (1, "q")]):
        for key in token:
            for pol in (lru, nu):
                pol.on_hit(key) if key in seen else pol.on_admit(key)
            seen.add(key)
    only_xy = lambda k: k in (x, y)  # noqa: E731
    assert lru.victim(only_xy) == x
    assert nu.victim(only_xy) == y


def test_nextuse_remembers_an_evicted_experts_history():
    nu = NextUse(8, half_life=1000)
    a, b = (0, "a"), (0, "b")
    for _ in range(5):
        nu.on_admit(a) if _ == 0 else nu.on_hit(a)
        nu.on_admit((1, "z")) if _ == 0 else nu.on_hit((1, "z"))  # another layer, so each is a new pass
    nu.on_evict(a)
    nu.on_admit(a)  # back: its five uses still count
    nu.on_admit(b)  # a stranger
    assert nu.victim(lambda k: k in (a, b)) == b


def test_nextuse_refuses_a_key_that_is_not_a_layer_expert_pair():
    nu = NextUse(8)
    with pytest.raises(TypeError, match=r"nextuse keys are \(layer, expert\) pairs, got 'a'"):
        nu.on_admit("a")


class RefNextUse:
    """nextuse the slow way: every resident key's expected wait, from scratch."""

    def __init__(self, half_life: float):
        self.h, self.tick, self.cur, self.pass_no = half_life, 0, None, 0
        self.last_pass, self.bump, self.passes, self.score, self.resident = {}, {}, {}, {}, set()

    def use(self, key):
        self.tick += 1
        layer = key[0]
        if layer != self.cur:
            self.cur, self.pass_no = layer, self.pass_no + 1
            self.last_pass[layer] = self.pass_no
            self.bump[layer] = 2.0 ** (self.tick / self.h)
            self.passes[layer] = self.passes.get(layer, 0.0) + self.bump[layer]
        self.score[key] = self.score.get(key, 0.0) + self.bump[layer]
        self.resident.add(key)

    def wait(self, key) -> float:
        n = max(self.last_pass) + 1
        layer = key[0]
        return (self.last_pass[layer] + n - self.pass_no) / n + self.passes[layer] / self.score[key]


@pytest.mark.parametrize("seed", range(4))
def test_nextuse_victims_match_a_from_scratch_reference(seed):
    fs = reader_workload(seed, n_layer=5, tokens=40)
    rng = random.Random(seed)
    table = SlabTable(12, NextUse(12, half_life=20))
    ref = RefNextUse(half_life=20)
    victims = 0
    for fetch in fs:
        if rng.random() < 0.1:  # a layer skipped now and then: passes need not be regular
            continue
        missed = [key for key in fetch if table.lookup(key) is None]
        for key in fetch:
            if key not in missed:
                ref.use(key)
                table.pin(key)
        for key in missed:
            if len(table) == table.n_slabs:
                evictable = [k for k in ref.resident if not table.pins(k)]
                best = max(ref.wait(k) for k in evictable)
                _, evicted = table.admit(key, pin=True)
                assert ref.wait(evicted) == pytest.approx(best, rel=1e-12), (evicted, best)
                ref.resident.remove(evicted)
                victims += 1
            else:
                table.admit(key, pin=True)
            ref.use(key)
        for key in fetch:
            table.unpin(key)
    assert victims > 50


def brute_force_min_misses(n_slabs: int, seq: list) -> int:
    """Fewest misses over every possible eviction choice (exponential; tiny inputs)."""

    @functools.cache
    def go(i: int, cache: frozenset) -> int:
        if i == len(seq):
            return 0
        k = seq[i]
        if k in cache:
            return go(i + 1, cache)
        if len(cache) < n_slabs:
            return 1 + go(i + 1, cache | {k})
        return 1 + min(go(i + 1, (cache - {v}) | {k}) for v in cache)

    return go(0, frozenset())


@pytest.mark.parametrize("seed", range(8))
def test_belady_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n_slabs = rng.randint(2, 3)
    seq = [rng.choice("abcde") for _ in range(14)]
    t = SlabTable(n_slabs, Belady(n_slabs, [[k] for k in seq]))
    for k in seq:
        get(t, k)
    assert t.stats.misses == brute_force_min_misses(n_slabs, seq)
    lru = SlabTable(n_slabs)
    for k in seq:
        get(lru, k)
    assert t.stats.misses <= lru.stats.misses


def test_belady_with_no_future_left_evicts_the_never_again():
    t = SlabTable(2, Belady(2, [["a"], ["b"], ["c"], ["a"]]))
    get(t, "a")
    get(t, "b")
    assert t.admit("c") == (1, "b")  # b is never used again, a is


@pytest.mark.parametrize("name", sorted(LIVE_POLICIES))
def test_set_usable_retires_free_slabs_then_unpinned_victims_and_hands_them_back(name):
    """The KV cache's loan: a smaller usable size takes free slabs first, then the
    policy's unpinned victims, never a pinned key; admissions never hand out a
    retired slab; a larger size gives the slabs back."""
    t = SlabTable(6, name)
    for e in range(4):
        t.admit((0, e), pin=e == 0)
    retired, evicted = t.set_usable(5)  # two free slabs: one goes, nothing is evicted
    assert (len(retired), evicted, t.n_usable, len(t)) == (1, [], 5, 4)
    retired2, evicted2 = t.set_usable(2)
    assert len(retired2) == 3 and len(evicted2) == 2 and (0, 0) in t and t.n_usable == 2 and len(t) == 2
    assert all(t.key_of(s) is None for s in retired + retired2) and not set(evicted2) & set(t.resident())
    slabs_in_use = set(t.resident().values())
    for e in range(10, 14):  # admissions cycle through the two usable slabs only
        slab, _ = t.admit((1, e))
        assert slab not in retired + retired2
        slabs_in_use.add(slab)
    assert len(slabs_in_use) == 2
    retired3, evicted3 = t.set_usable(1)  # the other key goes; the pinned one stays
    assert len(retired3) == 1 and len(evicted3) == 1 and list(t.resident()) == [(0, 0)] and t.n_usable == 1
    t.unpin((0, 0))
    t.set_usable(6)
    assert t.n_usable == 6 and len({t.admit((2, e))[0] for e in range(5)}) == 5  # every slab is the cache's again
    with pytest.raises(ValueError):
        t.set_usable(0)
    with pytest.raises(ValueError):
        t.set_usable(7)


def test_set_usable_stops_at_pins():
    """Every usable slab pinned: the size stays where pins hold it, and nothing is lost."""
    t = SlabTable(3, "lru")
    for e in range(3):
        t.admit((0, e), pin=True)
    assert t.set_usable(1) == ([], []) and t.n_usable == 3 and len(t) == 3
    t.unpin((0, 1))
    retired, evicted = t.set_usable(1)
    assert evicted == [(0, 1)] and len(retired) == 1 and t.n_usable == 2


@pytest.mark.parametrize("name", sorted(LIVE_POLICIES))
def test_lent_slabs_come_back_holding_what_compute_read_or_empty(name):
    """compute's own reads: `lend` gives free slabs first, then the policy's unpinned
    victims' (never a pinned key's), and fewer when the rest is pinned; a lent slab is
    no key's and never handed out by `admit`; `adopt` puts the expert compute read there
    (a miss with its bytes), `take_back` frees it; a slab not lent is refused either way."""
    t = SlabTable(5, name)
    for e in range(3):
        t.admit((0, e), 100, pin=e == 0)
    slabs, evicted = t.lend(3)  # two free slabs, then one victim: not the pinned (0, 0)
    assert len(slabs) == 3 and len(evicted) == 1 and evicted[0] != (0, 0) and evicted[0] not in t
    assert t.lent == frozenset(slabs) and all(t.key_of(s) is None for s in slabs) and len(t) == 2
    more, evicted = t.lend(5)  # only one slab is not pinned: one more, the rest refused
    assert len(more) == 1 and len(evicted) == 1 and (0, 0) in t
    assert len(t.lent) == 4 and list(t.resident()) == [(0, 0)]  # all but the pinned one lent now
    with pytest.raises(CacheFull):
        t.admit((1, 0))  # nothing free, nothing evictable: lent slabs are not the table's
    a, b, c, d = sorted(t.lent)
    t.adopt((2, 7), a, 300)
    assert t.lookup((2, 7)) == a and t.stats.misses == 4 and t.stats.bytes_admitted == 600 and a not in t.lent
    with pytest.raises(ValueError):
        t.adopt((2, 8), a)  # not lent (any more)
    with pytest.raises(ValueError):
        t.adopt((2, 7), b)  # resident already: the caller takes the slab back instead
    t.take_back([b, c])
    assert t.lent == frozenset({d}) and t.admit((1, 0)) in ((b, None), (c, None))
    with pytest.raises(ValueError):
        t.take_back([b])
    t.take_back([d])
    assert t.lent == frozenset() and len({t.admit((3, e))[0] for e in range(2)}) == 2
