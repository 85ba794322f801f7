"""The expert cache index: which slab holds which (layer, expert), and who goes next.

Pure bookkeeping: no sockets, no I/O, no clock. The reader process is its
only writer (so it needs no locks); the slabs themselves live in a
`shm.SlabArena` and slot k here is slab k there.

    lookup(key) ── hit ──► slot           (policy.on_hit)
         └─ None ──► admit(key) ──► (slot, evicted key | None)
                        free slot, else policy.victim(is_evictable) among
                        unpinned slots (policy.on_evict, then on_admit);
                        every slot pinned → CacheFull
    pin/unpin: counts; a slot named by an unfinished request is never evicted.

A miss is counted by `admit`, a hit by `lookup`; the hit rate is therefore
over the experts actually requested. Eviction policies plug in through the
`Policy` protocol and the `POLICIES` registry (name → factory(n_slots)).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

from .errors import ConfigError

Key = Hashable  # (layer, expert) in the engine; anything hashable here
MIB = 1 << 20


class CacheFull(RuntimeError):
    """Every slot is pinned by an unfinished request: nothing can be evicted."""


class Policy(Protocol):
    """An eviction policy: told about every hit, admission and eviction;
    asked for a victim among the keys `is_evictable` accepts (None if none)."""

    def on_hit(self, key: Key) -> None: ...
    def on_admit(self, key: Key) -> None: ...
    def on_evict(self, key: Key) -> None: ...
    def victim(self, is_evictable: Callable[[Key], bool]) -> Key | None: ...


class LRU:
    """Least recently used. O(1) per hit/admit/evict; a victim search skips
    pinned keys from the cold end, so it costs O(1 + pinned keys that are
    colder), at most top_k × layers in flight."""

    def __init__(self, n_slots: int | None = None):
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


POLICIES: dict[str, Callable[[int], Policy]] = {"lru": LRU}


def make_policy(name: str, n_slots: int) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown cache policy {name!r}; allowed: {', '.join(sorted(POLICIES))}") from None
    return factory(n_slots)


@dataclass(frozen=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_admitted: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class SlotTable:
    """key → slot for `n_slots` slots, evicting by `policy` (a Policy or a POLICIES name)."""

    def __init__(self, n_slots: int, policy: Policy | str = "lru"):
        if n_slots <= 0:
            raise ValueError(f"a cache needs at least one slot, got {n_slots}")
        self.n_slots = n_slots
        self.policy: Policy = make_policy(policy, n_slots) if isinstance(policy, str) else policy
        self._slot_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = [None] * n_slots
        self._free: list[int] = list(range(n_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._pins: dict[Key, int] = {}
        self._hits = self._misses = self._evictions = self._bytes = 0

    # -- lookups and admissions -------------------------------------------
    def lookup(self, key: Key) -> int | None:
        """The slot holding `key` (a hit, told to the policy), or None."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._hits += 1
            self.policy.on_hit(key)
        return slot

    def admit(self, key: Key, nbytes: int = 0, *, pin: bool = False) -> tuple[int, Key | None]:
        """A miss: give `key` a slot, evicting the policy's unpinned victim if
        none is free. Returns (slot, evicted key or None). `nbytes` (the bytes
        that will be read into it) feeds the stats; `pin` pins it at once."""
        if key in self._slot_of:
            raise ValueError(f"{key!r} is already resident in slot {self._slot_of[key]}")
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self.policy.victim(self._evictable)
            if evicted is None:
                raise CacheFull(f"all {self.n_slots} cache slots are pinned by unfinished requests; cannot admit {key!r}")
            if evicted not in self._slot_of or self._pins.get(evicted):
                raise RuntimeError(f"policy {type(self.policy).__name__} chose {evicted!r}, which is not an evictable resident key")
            slot = self._remove(evicted)
            self._evictions += 1
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self.policy.on_admit(key)
        self._misses += 1
        self._bytes += nbytes
        if pin:
            self.pin(key)
        return slot, evicted

    def drop(self, key: Key) -> int:
        """Forget `key` (its slab's bytes are bad, e.g. a failed read); frees its slot.
        Not an eviction in the stats. Refused while pinned."""
        if self._pins.get(key):
            raise ValueError(f"{key!r} is pinned {self._pins[key]} time(s); unpin before dropping")
        if key not in self._slot_of:
            raise KeyError(key)
        slot = self._remove(key)
        self._free.append(slot)
        return slot

    def _remove(self, key: Key) -> int:
        slot = self._slot_of.pop(key)
        self._key_of[slot] = None
        self.policy.on_evict(key)
        return slot

    def _evictable(self, key: Key) -> bool:
        return key in self._slot_of and not self._pins.get(key)

    # -- pins ---------------------------------------------------------------
    def pin(self, key: Key) -> None:
        if key not in self._slot_of:
            raise KeyError(f"cannot pin {key!r}: not resident")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Key) -> None:
        n = self._pins.get(key, 0)
        if n <= 0:
            raise ValueError(f"{key!r} is not pinned")
        if n == 1:
            del self._pins[key]
        else:
            self._pins[key] = n - 1

    def pins(self, key: Key) -> int:
        return self._pins.get(key, 0)

    # -- views ----------------------------------------------------------------
    def resident(self) -> dict[Key, int]:
        """key → slot for every cached expert (a copy)."""
        return dict(self._slot_of)

    def key_of(self, slot: int) -> Key | None:
        return self._key_of[slot]

    def __contains__(self, key: Key) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def n_pinned(self) -> int:
        return len(self._pins)

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._hits, self._misses, self._evictions, self._bytes)


# -- budget ---------------------------------------------------------------------

def slots_for_budget(budget_bytes: int, slab_bytes: int) -> int:
    """How many whole slabs fit in the budget (the slab arena is the budget)."""
    if slab_bytes <= 0:
        raise ValueError(f"slab size must be positive, got {slab_bytes}")
    return max(0, int(budget_bytes) // slab_bytes)


def check_budget(budget_bytes: int, layout, top_k: int | None = None) -> int:
    """The slot count for `budget_bytes`, or a ConfigError naming the smallest
    budget that works: one token's working set, every layer's top-k experts.
    Progress alone needs only top_k pinned slabs, but below a token's set LRU
    evicts each expert before the next token can reuse it: every lookup misses."""
    need = layout.min_cache_bytes(top_k)
    if budget_bytes < need:
        k = layout.spec.n_expert_used if top_k is None else top_k
        need_mib = math.ceil(need * 100 / MIB) / 100  # rounded up: the printed figure must suffice
        raise ConfigError(
            f"cache budget {budget_bytes / MIB:.2f} MiB is below one token's working set of {need_mib:.2f} MiB "
            f"({layout.spec.n_layer} layers x top-{k} experts x {layout.slab_bytes / MIB:.2f} MiB slabs); "
            f"set cache_mb to at least {math.ceil(need / MIB)}")
    return slots_for_budget(budget_bytes, layout.slab_bytes)
