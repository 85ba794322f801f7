"""The slots' KV pool: how many context positions several sequences' caches hold together
(docs/batching.md § The KV pool).

A slot's cache takes memory page by page as its positions are first written (its
whole-context rows are anonymous mappings: shared/model/blocks.py `_Rows`), and gives
it back with `KVCache.release`. A prompt prefix that several slots share is held once,
by reference (shared/model/kv_pages.py), and counted once. The pool is a count of positions, gateway.kv_pool
(shared/config.py `Config.kv_pool_tokens`); the budget reserves it rather than a whole
context a slot. Before each step the serving loop (procs/slots.py) asks `make_room`
whether the step's rows fit and, when they do not, what gives way:

1. idle slots' caches, the least recently used first (their conversations lose
   their prefix reuse, as a slot another request takes does);
2. then rows that wait for a later step, the youngest request's first (an older
   request goes on and, ending, frees its positions);
3. and when no row could go on at all, the youngest busy request that holds
   positions ends: a decoding one as at a full context (finish "context"), one still
   reading its prompt with an error (`KVPoolFull`). Its positions go back to the pool.

A pool of at least one context (shared/config.py `check_kv_pool`) always lets the
oldest request go on alone, so every step but such an ending runs a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class KVPoolFull(Exception):
    """The slots' KV pool has no room for a request's next positions, and nothing else gives way."""


@dataclass(frozen=True)
class Use:
    """One slot's positions, as the pool counts them before a step."""

    slot: int
    order: int  # its request's arrival (an idle slot's: the last it served): the older first
    busy: bool
    held: int  # positions whose rows are in memory of its own (a prefix held by reference is counted once, apart)
    wants: int  # what it holds once the step's rows for it have run (`held` when it has none)


@dataclass(frozen=True)
class Room:
    """What gives way for a step: idle slots whose caches are emptied, slots whose rows wait
    for a later step, and the busy slot whose request ends (None: none)."""

    evict: tuple[int, ...] = ()
    defer: frozenset[int] = frozenset()
    end: int | None = None


def make_room(capacity: int, uses: Sequence[Use], shared: int = 0) -> Room:
    """What gives way so that the slots' positions after a step fit `capacity` (the module
    docstring's order): idle caches, least recently used first; then the youngest requests'
    rows; and when no row could run at all, the youngest busy request holding positions.
    `shared`: positions of prompt prefixes held once by reference for several slots (each
    use's `held` is its own positions without them). An emptied cache is counted as giving
    back its own positions only: a prefix it shared stays while another slot holds it."""
    total = shared + sum(max(u.held, u.wants) for u in uses)
    evict: list[int] = []
    for u in sorted((u for u in uses if not u.busy and u.held), key=lambda u: u.order):
        if total <= capacity:
            break
        evict.append(u.slot)
        total -= u.held
    defer: set[int] = set()
    growing = [u for u in uses if u.busy and u.wants > u.held]
    for u in sorted(growing, key=lambda u: -u.order):
        if total <= capacity:
            break
        defer.add(u.slot)
        total -= u.wants - u.held
    stuck = total > capacity or (bool(growing) and len(defer) == len(growing))
    if not stuck:
        return Room(tuple(evict), frozenset(defer))
    # The youngest request that holds positions gives them back (one holding none would free
    # nothing: it waits); never the oldest, which alone fits a pool of one context.
    busy = sorted((u for u in uses if u.busy), key=lambda u: u.order)
    holders = [u for u in busy[1:] if u.held]
    if not holders:  # a pool below one context (check_kv_pool refuses it): the rows go on over it
        return Room(tuple(evict))
    return Room(tuple(evict), frozenset(defer), holders[-1].slot)
