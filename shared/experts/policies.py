"""Eviction policies for the expert cache, pluggable by name.

A policy is told about every hit, admission and eviction of the cache index
(shared/experts/cache.py's SlabTable) and asked for a victim among the keys that are
not pinned. `POLICIES` maps a name to a factory(n_slabs); the live reader and
the simulator (shared/analysis/replay.py) build them through `make_policy`, so both run
the same code. lru, lfu (decayed counts), arc, s3fifo, nextuse (per-layer
aware), nextmix (the default: nextuse with a short and a long clock; it can
also read the router's scores, `on_scores`) and belady, the offline optimum,
which needs the future and so runs only in the simulator. docs/cache-policies.md compares them on real
routing traces.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

import numpy as np

# The names cache.policy accepts and its default belong to the config schema; POLICIES gives each
# a factory (tests/test_cache.py checks that the two agree).
from ..config import DEFAULT_POLICY as DEFAULT_POLICY
from ..config import LIVE_POLICIES as LIVE_POLICIES
from ..errors import ConfigError

Key = Hashable  # (layer, expert) in the engine; anything hashable here


class Policy(Protocol):
    """An eviction policy: told about every hit, admission and eviction;
    asked for a victim among the keys `is_evictable` accepts (None if none)."""

    def on_hit(self, key: Key) -> None: ...
    def on_admit(self, key: Key) -> None: ...
    def on_evict(self, key: Key) -> None: ...
    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None: ...


class ScoredPolicy(Policy, Protocol):
    """A policy that also reads the router: before a decoded token's fetch at
    `layer`, its probabilities over all the layer's experts [n_expert] (the
    unchosen ones too) and the top-k. Optional: callers look for `on_scores`.
    The simulator calls it when it has scores (shared/analysis/replay.py);
    the reader is not sent them yet (docs/cache-policies.md)."""

    def on_scores(self, layer: int, probs, top_k: int) -> None: ...


class LRU:
    """Least recently used. O(1) per hit/admit/evict; a victim search skips
    pinned keys from the cold end, so it costs O(1 + pinned keys that are
    colder), at most top_k × layers in flight."""

    def __init__(self, n_slabs: int | None = None):
        self._order: OrderedDict[Key, None] = OrderedDict()  # coldest first

    def on_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_admit(self, key: Key) -> None:
        self._order[key] = None

    def on_evict(self, key: Key) -> None:
        del self._order[key]

    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None:
        return next((k for k in self._order if is_evictable(k)), None)

    def order(self) -> list[Key]:
        """Keys coldest first (tests, telemetry)."""
        return list(self._order)


class LFU:
    """Least frequently used, decayed: a use at tick t (uses told so far) adds
    2**(t / half_life), which is a use count halved every `half_life` uses —
    without touching any other key, so a heap's order survives between uses.
    Ties go to the least recently used (the heap's second field). A key's
    count starts afresh when it is admitted. O(log n) per use; a victim
    search skips stale heap entries and sets pinned keys aside."""

    def __init__(self, n_slabs: int | None = None, half_life: float | None = None):
        # One cache's worth of uses, measured on the phone traces: it beats LRU
        # on both at 2000-4000 MiB; 2x is better on Qwen and worse than LRU on
        # gpt-oss, 4x falls behind LRU on both (old favourites stay too long).
        self.half_life = float(half_life or max(64, n_slabs or 0))
        self._tick = 0
        self._origin = 0  # tick at which the scores were last rescaled
        self._score: dict[Key, tuple[float, int]] = {}  # key -> (score, tick of last use)
        self._heap: list[tuple[float, int, Key]] = []

    def _use(self, key: Key, fresh: bool) -> None:
        self._tick += 1
        if self._tick - self._origin > 500 * self.half_life:  # keep 2**x finite
            self._rescale()
        bump = 2.0 ** ((self._tick - self._origin) / self.half_life)
        score = bump if fresh else self._score[key][0] + bump
        self._score[key] = (score, self._tick)
        heapq.heappush(self._heap, (score, self._tick, key))
        if len(self._heap) > 4 * len(self._score) + 64:
            self._rebuild()

    def _rescale(self) -> None:
        f = 2.0 ** (-(self._tick - self._origin) / self.half_life)
        self._origin = self._tick
        self._score = {k: (s * f, t) for k, (s, t) in self._score.items()}
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(s, t, k) for k, (s, t) in self._score.items()]
        heapq.heapify(self._heap)

    def on_hit(self, key: Key) -> None:
        self._use(key, fresh=False)

    def on_admit(self, key: Key) -> None:
        self._use(key, fresh=True)

    def on_evict(self, key: Key) -> None:
        del self._score[key]  # its heap entries are stale now

    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None:
        return _heap_victim(self._heap, lambda k, t: self._score.get(k, (0, -1))[1] == t, is_evictable)


def _heap_victim(heap: list, current: Callable[[Key, int], bool], is_evictable) -> Key | None:
    """The first live, evictable key of a lazy-deletion heap of (priority, tick, key):
    stale entries are dropped, pinned ones set aside and put back."""
    return _heap_head(heap, current, is_evictable)[0]


def _heap_head(heap: list, current: Callable[[Key, int], bool], is_evictable) -> tuple[Key | None, bool]:
    """(_heap_victim's key, whether no pinned entry was passed over to find it)."""
    aside, found = [], None
    while heap:
        _, tick, key = heap[0]
        if not current(key, tick):
            heapq.heappop(heap)  # stale
        elif is_evictable(key):
            found = key
            break
        else:
            aside.append(heapq.heappop(heap))
    for entry in aside:
        heapq.heappush(heap, entry)
    return found, not aside


def _first(order: OrderedDict, is_evictable) -> Key | None:
    return next((k for k in order if is_evictable(k)), None)


class ARC:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03): T1 holds keys seen
    once lately, T2 keys seen at least twice; ghost lists B1/B2 remember what
    each lost, and a hit in a ghost moves the target size p of T1 towards
    the list that would have kept it. The protocol names the newcomer only
    after the victim is chosen, so p adapts one miss late, and the
    (|T1| == p and x in B2) tie rule is dropped."""

    def __init__(self, n_slabs: int):
        self.c = max(1, int(n_slabs))
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()  # LRU first
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def on_hit(self, key: Key) -> None:
        (self.t1 if key in self.t1 else self.t2).pop(key)
        self.t2[key] = None

    def on_admit(self, key: Key) -> None:
        if key in self.b1:  # T1 was too small for it
            self.p = min(self.c, self.p + max(len(self.b2) / len(self.b1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # T2 was too small for it
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        # ghosts: |T1| + |B1| <= c and everything <= 2c
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)

    def on_evict(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None

    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None:
        first, second = (self.t1, self.t2) if self.t1 and len(self.t1) > self.p else (self.t2, self.t1)
        k = _first(first, is_evictable)
        return k if k is not None else _first(second, is_evictable)


class S3FIFO:
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO S (10% of the slabs) that
    new keys enter, a main FIFO M, a ghost FIFO G of keys evicted from S.
    Leaving S, a key used again since it came in moves to M, else it is
    evicted (and remembered in G; a G key re-enters straight into M). Leaving
    M, a used key is reinserted with its count (0..3) decremented. Pinned
    keys are skipped in place."""

    def __init__(self, n_slabs: int, small_fraction: float = 0.1):
        self.c = max(1, int(n_slabs))
        self.small = max(1, int(small_fraction * self.c))
        self.s: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self.m: OrderedDict[Key, None] = OrderedDict()
        self.g: OrderedDict[Key, None] = OrderedDict()
        self.freq: dict[Key, int] = {}

    def on_hit(self, key: Key) -> None:
        self.freq[key] = min(3, self.freq[key] + 1)

    def on_admit(self, key: Key) -> None:
        self.freq[key] = 0
        if key in self.g:  # evicted from S lately, wanted again: straight to main
            del self.g[key]
            self.m[key] = None
        else:
            self.s[key] = None

    def on_evict(self, key: Key) -> None:
        del self.freq[key]
        if key in self.s:
            del self.s[key]
            self.g[key] = None
            if len(self.g) > self.c:
                self.g.popitem(last=False)
        else:
            del self.m[key]

    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None:
        # Each pass either returns, moves a key S -> M, or spends one unit of a
        # count in M: it ends within |S| + 3|M| + 2 passes.
        for _ in range(len(self.s) + 3 * len(self.m) + 2):
            from_small = bool(self.s) and (len(self.s) >= self.small or not self.m)
            k = _first(self.s if from_small else self.m, is_evictable)
            if k is None:
                from_small = not from_small
                k = _first(self.s if from_small else self.m, is_evictable)
                if k is None:
                    return None
            if from_small:
                if self.freq[k] == 0:
                    return k
                del self.s[k]  # S -> M
                self.m[k] = None
                self.freq[k] = 0
            else:
                if self.freq[k] == 0:
                    return k
                self.freq[k] -= 1
                self.m.move_to_end(k)
        return None


class Belady:
    """The offline optimum (Belady's MIN): evict the resident key whose next use
    is farthest ahead. Simulator only: it needs `future`, every fetch of the
    run in order (each a sequence of distinct keys). It learns where it is by
    counting each key's uses as it is told them (a hit or an admission is one
    use), so the fetch order within a group does not matter. O(log n) per use."""

    offline = True

    def __init__(self, n_slabs: int, future: Iterable[Iterable[Key]]):
        uses: dict[Key, list[float]] = defaultdict(list)
        for g, keys in enumerate(future):
            for k in keys:
                uses[k].append(g)
        self._uses = {k: v + [math.inf] for k, v in uses.items()}  # fetch indices, then never
        self._seen: dict[Key, int] = defaultdict(int)
        self._next: dict[Key, tuple[float, int]] = {}  # resident key -> (next use, tick)
        self._heap: list[tuple[float, int, Key]] = []  # (-next use, tick, key)
        self._tick = 0

    def _use(self, key: Key) -> None:
        i = self._seen[key] = self._seen[key] + 1
        uses = self._uses.get(key)
        nxt = uses[i] if uses is not None and i < len(uses) else math.inf
        self._tick += 1
        self._next[key] = (nxt, self._tick)
        heapq.heappush(self._heap, (-nxt, self._tick, key))
        if len(self._heap) > 4 * len(self._next) + 64:  # drop stale entries
            self._heap = [(-n, t, k) for k, (n, t) in self._next.items()]
            heapq.heapify(self._heap)

    on_hit = on_admit = _use

    def on_evict(self, key: Key) -> None:
        del self._next[key]

    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None:
        return _heap_victim(self._heap, lambda k, t: self._next.get(k, (0, -1))[1] == t, is_evictable)


def _layer_of(key: Key, policy: str = "nextuse") -> int:
    """The layer of a (layer, expert) key: NextUse ranks by layer, so any other
    key is a caller's bug, reported as such rather than as a bare TypeError."""
    if not isinstance(key, tuple):
        raise TypeError(f"{policy} keys are (layer, expert) pairs, got {key!r}")
    return key[0]


class NextUse:
    """Evict the expert whose next use is expected farthest ahead: Belady's rule
    with the future estimated from the rhythm of an MoE model, whose layers are
    each visited once per token, in order (docs/cache-policies.md). For key
    (L, e): q = its uses, decayed (half-life `half_life` uses), over its layer's
    passes, decayed alike: the chance it is picked on L's next pass; and d(L) =
    layer-steps until L comes round (the layer just computed waits longest).
    Expected wait in tokens: d(L) / n_layer + 1 / q; the largest goes. Counts
    outlive eviction (there are only layers × experts keys).

    Within a layer the victim is the lowest count (a lazy heap per layer). As
    d(L) = L's last pass + n_layer - now, with `now` common to all layers, a
    layer's rank changes only when its own head, pass or count does: a lazy
    heap of layers, re-ranked for those touched since the last victim.
    O(log n) per use and per eviction. Keys must be (layer, expert)."""

    def __init__(self, n_slabs: int, half_life: float | None = None):
        # 2 x the cache in uses, measured on the phone traces at 2000-4000 MiB:
        # 1x-4x are within 1.5 points of each other; 0.5x and 8x lose up to 2.
        self.half_life = float(half_life or max(64, 2 * n_slabs))
        self._tick = 0  # uses told so far
        self._origin = 0  # tick the scores are scaled to (rescaled to keep 2**x finite)
        self._layer = -1  # the layer being computed
        self._pass_no = 0  # passes so far, all layers
        # per layer: the pass number of its last pass, what a use on that pass
        # adds, the decayed count of its passes, a lazy heap of (score, tick, key)
        self._last_pass: list[int] = []
        self._bump: list[float] = []
        self._passes: list[float] = []
        self._heaps: list[list[tuple[float, int, Key]]] = []
        self._score: dict[Key, float] = {}  # decayed uses, resident or not
        self._live: dict[Key, int] = {}  # resident key -> tick of its heap entry
        self._ranks: list[tuple[float, int, int]] = []  # layers: (-wait + now, version, layer)
        self._version: list[int] = []
        self._dirty: set[int] = set()  # layers touched since the last victim: rank again
        self._recheck: set[int] = set()  # layers whose best key was pinned: rank again

    def _use(self, key: Key) -> None:
        layer = _layer_of(key)
        self._tick += 1
        if layer != self._layer:
            self._begin_pass(layer)
        score = self._score[key] = self._score.get(key, 0.0) + self._bump[layer]
        self._live[key] = self._tick
        heap = self._heaps[layer]
        heapq.heappush(heap, (score, self._tick, key))
        if len(heap) > 64 and len(heap) > 4 * len(self._live):  # drop stale entries
            heap[:] = [(self._score[k], t, k) for k, t in self._live.items() if _layer_of(k) == layer]
            heapq.heapify(heap)
        self._dirty.add(layer)

    def _begin_pass(self, layer: int) -> None:
        self._layer = layer
        self._pass_no += 1
        if layer >= len(self._heaps):  # a layer seen for the first time: n_layer grew
            grow = layer + 1 - len(self._heaps)
            self._last_pass.extend([0] * grow)
            self._version.extend([0] * grow)
            self._bump.extend([0.0] * grow)
            self._passes.extend([0.0] * grow)
            self._heaps.extend([] for _ in range(grow))
            self._dirty.update(range(len(self._heaps)))  # every rank is in units of n_layer
        if self._tick - self._origin > 500 * self.half_life:
            self._rescale()
        self._last_pass[layer] = self._pass_no
        self._bump[layer] = 2.0 ** ((self._tick - self._origin) / self.half_life)
        self._passes[layer] += self._bump[layer]

    def _rescale(self) -> None:
        f = 2.0 ** (-(self._tick - self._origin) / self.half_life)
        self._origin = self._tick
        self._score = {k: s * f for k, s in self._score.items()}
        self._bump = [b * f for b in self._bump]
        self._passes = [p * f for p in self._passes]
        for heap in self._heaps:
            heap.clear()
        for k, t in self._live.items():
            self._heaps[_layer_of(k)].append((self._score[k], t, k))
        for heap in self._heaps:
            heapq.heapify(heap)
        self._dirty.update(range(len(self._heaps)))

    on_hit = on_admit = _use

    def on_evict(self, key: Key) -> None:
        del self._live[key]  # its score stays: the key's history
        self._dirty.add(_layer_of(key))

    def _head(self, layer: int, is_evictable) -> tuple[Key | None, bool]:
        """The layer's best evictable key, and whether it is its best key at all
        (False: a pinned key was passed over, so look again next time)."""
        live = self._live
        return _heap_head(self._heaps[layer], lambda k, t: live.get(k) == t, is_evictable)

    def _rank(self, layer: int, key: Key) -> float:
        """The layer's expected wait (for its best victim `key`) plus `now`/n_layer."""
        return (self._last_pass[layer] + len(self._heaps)) / len(self._heaps) + self._passes[layer] / self._score[key]

    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None:
        ranks, version = self._ranks, self._version
        todo, self._dirty = self._dirty | self._recheck, set()
        self._recheck = set()
        for layer in todo:
            self._push_rank(layer, is_evictable)
        if len(ranks) > 4 * len(version) + 64:  # drop stale entries
            ranks[:] = [e for e in ranks if e[1] == version[e[2]]]
            heapq.heapify(ranks)
        while ranks:
            neg, ver, layer = ranks[0]
            if ver != version[layer]:
                heapq.heappop(ranks)
                continue
            key, best = self._head(layer, is_evictable)
            if key is not None and -neg == self._rank(layer, key):
                if not best:
                    self._recheck.add(layer)
                return key
            heapq.heappop(ranks)  # a pin taken since it was ranked: rank it again
            self._push_rank(layer, is_evictable)
        return None

    def _push_rank(self, layer: int, is_evictable) -> None:
        self._version[layer] += 1
        key, best = self._head(layer, is_evictable)
        if not best:  # pinned keys were passed over; they may be free next time
            self._recheck.add(layer)
        if key is not None:
            heapq.heappush(self._ranks, (-self._rank(layer, key), self._version[layer], layer))


class NextMix:
    """`nextuse` with two clocks: Belady's rule with the future estimated from the
    layer rhythm, as NextUse, but a key's chance q of being picked on its
    layer's next pass blends a long memory (uses decayed with a half-life of
    `half_life` uses, over its layer's passes decayed alike) with a short one
    (its picks in the last few passes of its own layer: half-life
    `short_half_life` passes), weight `short_weight` on the short. Routing
    repeats itself from one token to the next more than a long average says,
    and the short clock is counted in the layer's own passes, i.e. tokens
    (docs/cache-policies.md). Expected wait in tokens d(L)/n_layer + 1/q; the
    largest goes. Counts outlive eviction.

    Optionally the router's probabilities (`on_scores`, a decoded token's
    softmax over all of a layer's experts, unchosen ones too) add a third,
    low-noise estimate: their decayed mean, capped k·p, weighted
    `score_weight`. The reader is not sent scores (yet), so live this is
    exactly the two-clock policy; the bench measures it on recorded routing.

    The two clocks decay at different rates, so the order of the keys changes
    between uses and no lazy heap holds it: a victim is a vectorised argmax
    over the resident keys (numpy, O(resident) per eviction: about 40 µs at
    2,000 resident keys, next to a multi-MiB read per miss). Keys must be (layer, expert)."""

    def __init__(
        self,
        n_slabs: int,
        half_life: float | None = None,
        short_half_life: float = 2.0,
        short_weight: float = 0.2,
        score_weight: float = 0.0,
    ):
        # Measured on the phone traces at 2000-4000 MiB (docs/cache-policies.md): with the
        # short clock the long one is best longer than nextuse's 2x (4x the cache in uses).
        self.half_life = float(half_life or max(64, 4 * n_slabs))
        self.short_half_life = float(short_half_life)
        self.short_weight = float(short_weight)
        self.score_weight = float(score_weight)
        self._tick = 0  # uses told so far
        self._origin = 0  # tick the long counts are scaled to
        self._layer = -1  # the layer being computed
        self._pass_no = 0  # passes so far, all layers
        self._bump = 1.0  # what a use adds to a long count on this pass
        # per (layer, expert): long and short counts, router mass, resident; per layer: the
        # counts' normalisers, the short clock's bump, passes, rescale origin, last pass number
        self._long, self._short, self._soft = (np.zeros((0, 0)) for _ in range(3))  # distinct arrays: each is written
        self._res = np.zeros((0, 0), bool)
        self._lnorm, self._snorm, self._pnorm, self._sbump = (np.zeros(0) for _ in range(4))
        self._npass, self._sorigin, self._last_pass, self._lay = (np.zeros(0, np.int64) for _ in range(4))

    _PER_KEY = ("_long", "_short", "_soft", "_res")
    _PER_LAYER = ("_lnorm", "_snorm", "_pnorm", "_sbump", "_npass", "_sorigin", "_last_pass")

    def _grow(self, n_layer: int, n_expert: int) -> None:
        """Size the arrays for keys up to (n_layer-1, n_expert-1), zero-filled."""
        L0, E0 = self._long.shape
        L, E = max(L0, n_layer), max(E0, n_expert)
        for name in self._PER_KEY:
            setattr(self, name, np.pad(getattr(self, name), ((0, L - L0), (0, E - E0))))
        for name in self._PER_LAYER:
            setattr(self, name, np.pad(getattr(self, name), (0, L - L0)))
        self._lay = np.repeat(np.arange(L), E)  # the layer of each flat index

    def _use(self, key: Key) -> None:
        layer = _layer_of(key, "nextmix")
        expert = key[1]  # type: ignore[index]
        if layer >= self._long.shape[0] or expert >= self._long.shape[1]:
            self._grow(layer + 1, expert + 1)
        self._tick += 1
        if layer != self._layer:
            self._begin_pass(layer)
        self._long[layer, expert] += self._bump
        self._short[layer, expert] += self._sbump[layer]
        self._res[layer, expert] = True

    def _begin_pass(self, layer: int) -> None:
        self._layer = layer
        self._pass_no += 1
        self._last_pass[layer] = self._pass_no
        if self._tick - self._origin > 500 * self.half_life:  # keep 2**x finite
            f = 2.0 ** (-(self._tick - self._origin) / self.half_life)
            self._origin = self._tick
            self._long *= f
            self._lnorm *= f
        self._bump = 2.0 ** ((self._tick - self._origin) / self.half_life)
        self._lnorm[layer] += self._bump
        self._npass[layer] += 1
        if self._npass[layer] - self._sorigin[layer] > 500 * self.short_half_life:
            f = 2.0 ** (-(self._npass[layer] - self._sorigin[layer]) / self.short_half_life)
            self._sorigin[layer] = self._npass[layer]
            self._short[layer] *= f
            self._snorm[layer] *= f
        self._sbump[layer] = 2.0 ** ((self._npass[layer] - self._sorigin[layer]) / self.short_half_life)
        self._snorm[layer] += self._sbump[layer]

    on_hit = on_admit = _use

    def on_evict(self, key: Key) -> None:
        self._res[_layer_of(key), key[1]] = False  # type: ignore[index]  # its counts stay: the key's history

    def on_scores(self, layer: int, probs, top_k: int) -> None:
        """The router's probabilities over all of `layer`'s experts for one decoded
        token (before its fetch): their decayed mean, capped k·p, is a third
        estimate of q. Decays per pass at the long clock's rate in passes."""
        probs = np.asarray(probs, np.float64)
        if layer >= self._long.shape[0] or probs.size > self._long.shape[1]:
            self._grow(layer + 1, probs.size)
        g = 2.0 ** (-1.0 / max(1.0, self.half_life / (self._long.shape[0] * top_k)))
        row = self._soft[layer]
        row *= g
        row[: probs.size] += np.minimum(1.0, top_k * probs)
        self._pnorm[layer] = self._pnorm[layer] * g + 1.0

    def waits(self) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices of the resident keys, each one's expected wait in tokens)."""
        idx = np.flatnonzero(self._res)
        lay = self._lay[idx]
        n_layer = self._long.shape[0]
        d = (self._last_pass[lay] + n_layer - self._pass_no) / n_layer  # tokens until the layer comes round
        a = self.short_weight
        q = (1 - a) * self._long.ravel()[idx] / self._lnorm[lay] + a * self._short.ravel()[idx] / self._snorm[lay]
        if self.score_weight:
            pn = self._pnorm[lay]
            soft = self._soft.ravel()[idx] / np.where(pn > 0, pn, 1.0)
            q = np.where(pn > 0, (1 - self.score_weight) * q + self.score_weight * soft, q)
        return idx, d + 1.0 / np.maximum(q, 1e-12)

    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None:
        idx, wait = self.waits()
        n_expert = self._long.shape[1]
        best = int(np.argmax(wait)) if idx.size else -1
        if best >= 0:  # the usual case: the longest wait is not pinned
            key = divmod(int(idx[best]), n_expert)
            if is_evictable(key):
                return key
        for i in idx[np.argsort(-wait, kind="stable")]:  # ties: the lower (layer, expert) first, as argmax
            key = divmod(int(i), n_expert)
            if is_evictable(key):
                return key
        return None


# name -> factory(n_slabs). A factory with `offline = True` also needs
# `future` (every fetch ahead) and exists only in the simulator (shared/analysis/replay.py).
POLICIES: dict[str, Callable[..., Policy]] = {
    "lru": LRU,
    "lfu": LFU,
    "arc": ARC,
    "s3fifo": S3FIFO,
    "nextuse": NextUse,
    "nextmix": NextMix,
    "belady": Belady,
}
OFFLINE_POLICIES = frozenset(name for name, f in POLICIES.items() if getattr(f, "offline", False))


def make_policy(name: str, n_slabs: int, future: Iterable[Iterable[Key]] | None = None) -> Policy:
    """The policy `name` for `n_slabs` slabs; `future` (the fetches ahead) only
    for an offline policy, which cannot run live without it."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown cache policy {name!r}; allowed: {', '.join(LIVE_POLICIES)}") from None
    if name in OFFLINE_POLICIES:
        if future is None:
            raise ConfigError(
                f"cache policy {name!r} needs to know the future: it exists only in the "
                f"simulator (moe-pipe replay); live policies: {', '.join(LIVE_POLICIES)}"
            )
        return factory(n_slabs, future)
    return factory(n_slabs)
