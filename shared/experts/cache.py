"""The expert cache index: which slab holds which (layer, expert), and who goes next.

Pure bookkeeping: no sockets, no I/O, no clock. The reader process is its
only writer (so it needs no locks); the slabs themselves live in a
`shm.SlabArena`, and slab k here is slab k of that arena.

    lookup(key) ── hit ──► slab           (policy.on_hit)
         └─ None ──► admit(key) ──► (slab, evicted key | None)
                        free slab, else policy.victim(is_evictable) among
                        unpinned slabs (policy.on_evict, then on_admit);
                        every slab pinned → CacheFull
    pin/unpin: counts; a slab named by an unfinished request is never evicted.
    set_usable(n): hold at most n slabs (retire free slabs, then evict unpinned
                   victims; or hand retired slabs back): the cache gives the
                   KV cache back the memory it borrowed as the context grows
                   (docs/architecture.md § The KV cache's loan).
    on_pinned(key, bool): told when a key's first pin comes and its last goes
                          (the reader mirrors it into the residency index's states).
    lend(n) / adopt(key, slab) / take_back(slabs): free slabs (evicting unpinned
                   victims) lent to compute, which reads its own misses into them;
                   a lent slab comes back holding the expert compute read (adopt,
                   a miss) or empty (take_back) (docs/architecture.md § compute's own reads).

A miss is counted by `admit`, a hit by `lookup`; the hit rate is therefore
over the experts actually requested. Eviction policies plug in through the
`Policy` protocol (shared/experts/policies.py; docs/cache-policies.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .policies import Key, Policy, make_policy


class CacheFull(RuntimeError):
    """Every slab is pinned by an unfinished request: nothing can be evicted."""


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


class SlabTable:
    """key → slab for `n_slabs` slabs, evicting by `policy` (a Policy or a POLICIES name)."""

    def __init__(self, n_slabs: int, policy: Policy | str = "lru"):
        if n_slabs <= 0:
            raise ValueError(f"a cache needs at least one slab, got {n_slabs}")
        self.n_slabs = n_slabs
        self.policy: Policy = make_policy(policy, n_slabs) if isinstance(policy, str) else policy
        self._slab_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = [None] * n_slabs
        self._free: list[int] = list(range(n_slabs - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._retired: list[int] = []  # slabs out of use (set_usable): neither free nor holding a key
        self._lent: set[int] = set()  # slabs lent to compute (lend): neither free nor holding a key until they come back
        self._pins: dict[Key, int] = {}
        # a key became pinned (True) or unpinned (False); typed Any: it gets the owner's own keys (the reader's (layer, expert))
        self.on_pinned: Callable[[Any, bool], None] | None = None
        self._hits = self._misses = self._evictions = self._bytes = 0

    # -- lookups and admissions -------------------------------------------
    def lookup(self, key: Key) -> int | None:
        """The slab holding `key` (a hit, told to the policy), or None."""
        slab = self._slab_of.get(key)
        if slab is not None:
            self._hits += 1
            self.policy.on_hit(key)
        return slab

    def admit(self, key: Key, nbytes: int = 0, *, pin: bool = False) -> tuple[int, Key | None]:
        """A miss: give `key` a slab, evicting the policy's unpinned victim if
        none is free. Returns (slab, evicted key or None). `nbytes` (the bytes
        that will be read into it) feeds the stats; `pin` pins it at once."""
        if key in self._slab_of:
            raise ValueError(f"{key!r} is already resident in slab {self._slab_of[key]}")
        evicted = None
        if self._free:
            slab = self._free.pop()
        else:
            gone: list[Key] = []
            freed = self._evict(gone)
            if freed is None:
                raise CacheFull(f"all {self.n_slabs} cache slabs are pinned by unfinished requests; cannot admit {key!r}")
            slab, evicted = freed, gone[0]
        self._admit_into(key, slab, nbytes)
        if pin:
            self.pin(key)
        return slab, evicted

    def restore(self, key: Key, slab: int) -> None:
        """Take back an entry a previous owner of the cache left (a restarted
        reader re-reading the residency index): `key` is in `slab` already, so
        nothing is read; the policy sees it as admitted (its order is lost)."""
        if key in self._slab_of or not 0 <= slab < self.n_slabs or self._key_of[slab] is not None:
            raise ValueError(f"cannot restore {key!r} into slab {slab}: taken or out of range")
        self._free.remove(slab)
        self._place(key, slab)

    def refresh(self, keys) -> None:
        """Tell the policy `keys` were used, in this order, without counting hits:
        a warm start's experts, coldest first, so that the policy ranks the
        hottest highest (they were admitted hottest first, which an LRU reads
        the other way round). Keys not resident are skipped."""
        for key in keys:
            if key in self._slab_of:
                self.policy.on_hit(key)

    def drop(self, key: Key) -> int:
        """Forget `key` (its slab's bytes are bad, e.g. a failed read); frees its slab.
        Not an eviction in the stats. Refused while pinned."""
        if self._pins.get(key):
            raise ValueError(f"{key!r} is pinned {self._pins[key]} time(s); unpin before dropping")
        if key not in self._slab_of:
            raise KeyError(key)
        slab = self._remove(key)
        self._free.append(slab)
        return slab

    # -- slabs lent to compute -------------------------------------------------
    def lend(self, n: int) -> tuple[list[int], list[Key]]:
        """Up to `n` slabs for compute to read its own misses into: free ones first, then
        the policy's unpinned victims' (evicted). Fewer when every other slab is pinned.
        Returns (slabs lent, keys evicted)."""
        slabs: list[int] = []
        evicted: list[Key] = []
        while len(slabs) < n:
            slab = self._free.pop() if self._free else self._evict(evicted)
            if slab is None:
                break
            self._lent.add(slab)
            slabs.append(slab)
        return slabs, evicted

    def adopt(self, key: Key, slab: int, nbytes: int = 0) -> None:
        """Lent `slab` comes back holding `key`, which compute read into it: a miss, as
        `admit` counts one. Refused when `key` is resident already (take the slab back)."""
        if slab not in self._lent:
            raise ValueError(f"slab {slab} is not lent")
        if key in self._slab_of:
            raise ValueError(f"{key!r} is already resident in slab {self._slab_of[key]}")
        self._lent.remove(slab)
        self._admit_into(key, slab, nbytes)

    def take_back(self, slabs) -> None:
        """Lent slabs come back empty: free again."""
        for slab in slabs:
            if slab not in self._lent:
                raise ValueError(f"slab {slab} is not lent")
            self._lent.remove(slab)
            self._free.append(slab)

    @property
    def lent(self) -> frozenset[int]:
        return frozenset(self._lent)

    # -- the usable size ------------------------------------------------------
    @property
    def n_usable(self) -> int:
        """Slabs the cache may hold now: n_slabs less those `set_usable` retired."""
        return self.n_slabs - len(self._retired)

    def set_usable(self, n: int) -> tuple[list[int], list[Key]]:
        """Hold at most `n` slabs from now on. Fewer than now: free slabs are
        retired first (the last handed out first), then the policy's unpinned
        victims are evicted and their slabs retired; a pinned slab is never
        taken, so the cache may stay above `n` (`n_usable` says how far it
        got; call again once pins are gone). More than now: retired slabs go
        back to the free list. Returns (slabs newly retired, keys evicted)."""
        if not 1 <= n <= self.n_slabs:
            raise ValueError(f"usable slabs must be 1..{self.n_slabs}, got {n}")
        retired: list[int] = []
        evicted: list[Key] = []
        while self.n_usable < n:
            self._free.append(self._retired.pop())
        while self.n_usable > n:
            if self._free:
                slab = max(self._free)  # the free list's tail is handed out first: keep it
                self._free.remove(slab)
            else:
                freed = self._evict(evicted)
                if freed is None:
                    break
                slab = freed
            self._retired.append(slab)
            retired.append(slab)
        return retired, evicted

    def _evict(self, evicted: list[Key]) -> int | None:
        """Evict the policy's unpinned victim (counted, added to `evicted`): its slab, or None
        when every resident key is pinned."""
        victim = self.policy.victim(self._evictable)
        if victim is None:
            return None
        if victim not in self._slab_of or self._pins.get(victim):
            raise RuntimeError(f"policy {type(self.policy).__name__} chose {victim!r}, which is not an evictable resident key")
        self._evictions += 1
        evicted.append(victim)
        return self._remove(victim)

    def _admit_into(self, key: Key, slab: int, nbytes: int) -> None:
        """`key` now holds `slab`: a miss of `nbytes` read into it."""
        self._place(key, slab)
        self._misses += 1
        self._bytes += nbytes

    def _place(self, key: Key, slab: int) -> None:
        self._slab_of[key] = slab
        self._key_of[slab] = key
        self.policy.on_admit(key)

    def _remove(self, key: Key) -> int:
        slab = self._slab_of.pop(key)
        self._key_of[slab] = None
        self.policy.on_evict(key)
        return slab

    def _evictable(self, key: Key) -> bool:
        return key in self._slab_of and not self._pins.get(key)

    # -- pins ---------------------------------------------------------------
    def pin(self, key: Key) -> None:
        if key not in self._slab_of:
            raise KeyError(f"cannot pin {key!r}: not resident")
        n = self._pins.get(key, 0)
        self._pins[key] = n + 1
        if n == 0 and self.on_pinned is not None:
            self.on_pinned(key, True)

    def unpin(self, key: Key) -> None:
        n = self._pins.get(key, 0)
        if n <= 0:
            raise ValueError(f"{key!r} is not pinned")
        if n == 1:
            del self._pins[key]
            if self.on_pinned is not None:
                self.on_pinned(key, False)
        else:
            self._pins[key] = n - 1

    def pins(self, key: Key) -> int:
        return self._pins.get(key, 0)

    # -- views ----------------------------------------------------------------
    def resident(self) -> dict[Key, int]:
        """key → slab for every cached expert (a copy)."""
        return dict(self._slab_of)

    def key_of(self, slab: int) -> Key | None:
        return self._key_of[slab]

    def __contains__(self, key: Key) -> bool:
        return key in self._slab_of

    def __len__(self) -> int:
        return len(self._slab_of)

    @property
    def n_pinned(self) -> int:
        return len(self._pins)

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._hits, self._misses, self._evictions, self._bytes)
