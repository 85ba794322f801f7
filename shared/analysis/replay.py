"""Replaying a route trace through the expert cache, exactly as the reader would.

The simulator and the live reader agree because they run the same code: the
`SlabTable` and the `POLICIES` of shared/experts/cache.py, driven in the reader's
order. One trace group is one `TraceFetch`, what compute asks the reader for
in one wire `Fetch` (shared/wire/messages.py):

    decode:  one token at one layer — its top-k rows (turn, step, layer)
    prompt:  one prompt batch at one layer — the batch's rows for that layer,
             deduplicated in order of first use (a batched prefill reads each
             expert once per layer), split into n_slabs-sized fetches as
             compute does when a batch routes to more experts than slabs

    per fetch:  lookup each expert in routing order; a hit is pinned
                admit each miss in routing order, pinned (evicts an unpinned victim)
                unpin everything (the Release)

so nothing is pinned across fetches and the layer being computed is never
evicted by its own misses.

Two ways to count the budget:

    slabs  (the engine)  the arena is equal slabs of the largest expert,
                         page-rounded: n_slabs = budget // slab_bytes
    bytes  (BigMoeOnEdge's published curves)  each expert takes its own size
                         (Qwen3-30B-A3B has 3,059,712 and 2,654,208-byte
                         experts); evict until the newcomer fits

`hit % decode` is over decode lookups only, `hit % cum` over all lookups
(a prompt lookup is one per expert per layer per batch, not per token),
`read MiB` the bytes of every miss at the layer's own expert size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import UserError
from ..experts.cache import CacheFull, SlabTable
from ..experts.policies import OFFLINE_POLICIES, POLICIES, Key, Policy, make_policy
from ..model.trace import DECODE, Trace

MIB = 1 << 20
PAGE = 4096
ACCOUNTING = ("slabs", "bytes")


class ReplayError(UserError):
    """A replay that cannot run: a budget too small, an unknown policy."""


@dataclass(frozen=True)
class TraceFetch:
    """One group of trace rows replayed as one wire Fetch (the module docstring: which rows)."""

    phase: int
    layer: int
    keys: tuple[Key, ...]  # distinct (layer, expert), routing order
    weights: tuple[float, ...] = ()  # decode: each key's router weight (for the drop-cold lever)
    # decode, when recorded: the router's probabilities over all the layer's experts [n_expert]
    # (not in a route trace; bench/bench_policies.py records them on a made model)
    scores: np.ndarray | None = field(default=None, compare=False)


def with_scores(fs: list[TraceFetch], scores) -> list[TraceFetch]:
    """The fetches with router probabilities [n_decode_fetches, n_expert] given to
    the decode fetches, in order; a count mismatch is a ReplayError."""
    scores = np.asarray(scores)
    dec = [i for i, f in enumerate(fs) if f.phase == DECODE]
    if len(dec) != len(scores):
        raise ReplayError(f"{len(scores)} rows of router scores for {len(dec)} decode fetches")
    out = list(fs)
    for i, row in zip(dec, scores):
        out[i] = replace(fs[i], scores=row)
    return out


def fetches(trace: Trace) -> list[TraceFetch]:
    """The trace as the reader sees it: one Fetch per token per layer (decode)
    or per prompt batch per layer, in trace order."""
    n = len(trace)
    if n == 0:
        return []
    # A new group where turn, phase or layer change, or (decode only) the step does.
    change = np.zeros(n, bool)  # [N]
    change[0] = True
    for col in (trace.turn, trace.phase, trace.layer):
        change[1:] |= col[1:] != col[:-1]
    change[1:] |= (trace.step[1:] != trace.step[:-1]) & (trace.phase[1:] == DECODE)
    starts = np.flatnonzero(change).tolist() + [n]
    names = [[(layer, e) for e in range(trace.header.n_expert)] for layer in range(trace.header.n_layer)]
    experts, layers, phases = trace.expert.tolist(), trace.layer.tolist(), trace.phase.tolist()
    weights = trace.weight.tolist()
    out = []
    for a, b in zip(starts, starts[1:]):
        row = names[layers[a]]
        keys = tuple(dict.fromkeys(row[e] for e in experts[a:b]))  # dedup, first-use order
        decode = phases[a] == DECODE and len(keys) == b - a
        out.append(TraceFetch(phases[a], layers[a], keys, tuple(weights[a:b]) if decode else ()))
    return out


def drop_cold_keys(f: TraceFetch, table, fraction: float) -> tuple[Key, ...]:
    """The lever `--drop-cold-experts` (shared/model/levers.py) on one decode
    fetch: keys that are misses with weight below fraction × the even share
    are skipped; at least the heaviest stays. Prompt fetches are exact."""
    if fraction <= 0 or not f.weights:
        return f.keys
    even = sum(f.weights) / len(f.weights)
    keep = tuple(k for k, w in zip(f.keys, f.weights) if w >= fraction * even or k in table)
    return keep or (f.keys[max(range(len(f.keys)), key=f.weights.__getitem__)],)


def split_fetches(fs: list[TraceFetch], n_slabs: int) -> list[TraceFetch]:
    """Fetches no longer than n_slabs (compute's slab-sized groups)."""
    if all(len(f.keys) <= n_slabs for f in fs):
        return fs
    return [TraceFetch(f.phase, f.layer, f.keys[i : i + n_slabs]) for f in fs for i in range(0, len(f.keys), n_slabs)]


# ---------------------------------------------------------------- the tables


class ByteTable:
    """Simulator only: a cache whose budget is bytes, each expert taking its own
    size (evict victims until the newcomer fits). The subset of SlabTable's API
    a replay uses; the same Policy objects drive it."""

    def __init__(self, budget_bytes: int, policy: Policy):
        self.budget_bytes = int(budget_bytes)
        self.policy = policy
        self.used = 0
        self._size: dict[Key, int] = {}
        self._pins: dict[Key, int] = {}

    def lookup(self, key: Key) -> int | None:
        if key in self._size:
            self.policy.on_hit(key)
            return 0
        return None

    def admit(self, key: Key, nbytes: int = 0, *, pin: bool = False) -> tuple[int, Key | None]:
        if nbytes > self.budget_bytes:
            raise CacheFull(f"{key!r} ({nbytes} bytes) is larger than the whole budget")
        evicted = None
        while self.used + nbytes > self.budget_bytes:
            evicted = self.policy.victim(self._evictable)
            if evicted is None:
                raise CacheFull(f"every cached expert is pinned; cannot fit {key!r}")
            if not self._evictable(evicted):
                raise RuntimeError(f"policy {type(self.policy).__name__} chose {evicted!r}, which is not an evictable resident key")
            self.used -= self._size.pop(evicted)
            self.policy.on_evict(evicted)
        self._size[key] = nbytes
        self.used += nbytes
        self.policy.on_admit(key)
        if pin:
            self.pin(key)
        return 0, evicted

    def _evictable(self, key: Key) -> bool:
        return key in self._size and not self._pins.get(key)

    def pin(self, key: Key) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Key) -> None:
        n = self._pins[key]
        if n == 1:
            del self._pins[key]
        else:
            self._pins[key] = n - 1

    def __contains__(self, key: Key) -> bool:
        return key in self._size


# ---------------------------------------------------------------- one replay


@dataclass(frozen=True)
class Result:
    budget_mb: float
    policy: str
    accounting: str
    n_slabs: int  # slabs, or (bytes accounting) the budget in average-size experts
    hits: tuple[int, int]  # (prompt, decode)
    lookups: tuple[int, int]
    read_bytes: tuple[int, int]
    # (hits, lookups) of the decode's last quarter of fetches: the steady window every speed
    # figure takes (shared/speed.py steady_start), after the cache's warm-up
    steady: tuple[int, int] = (0, 0)

    @property
    def hit_pct_cum(self) -> float:
        return 100.0 * sum(self.hits) / max(1, sum(self.lookups))

    @property
    def hit_pct_decode(self) -> float:
        return 100.0 * self.hits[DECODE] / max(1, self.lookups[DECODE])

    @property
    def hit_pct_steady(self) -> float:
        """Decode hits over the last quarter of the decode: the steady state a long reply reaches."""
        return 100.0 * self.steady[0] / max(1, self.steady[1])

    @property
    def read_mib(self) -> float:
        return sum(self.read_bytes) / MIB

    def row(self) -> dict:
        """The JSON row (`moe-pipe replay --json`)."""
        budget = int(self.budget_mb) if float(self.budget_mb).is_integer() else self.budget_mb
        return {
            "budget_mb": budget,
            "policy": self.policy,
            "hit_pct_cum": round(self.hit_pct_cum, 3),
            "hit_pct_decode": round(self.hit_pct_decode, 3),
            "read_mib": round(self.read_mib, 1),
            "n_slabs": self.n_slabs,
            "accounting": self.accounting,
            "hits": sum(self.hits),
            "lookups": sum(self.lookups),
        }


def slab_bytes(trace: Trace) -> int:
    """The engine's slab for this model, as near as a trace tells: the largest
    expert, page-rounded (the engine rounds each part; a trace has no parts)."""
    return -(-trace.header.max_expert_bytes // PAGE) * PAGE


def run_fetches(
    fs: Sequence[TraceFetch], table, expert_bytes: Sequence[int], drop_cold: float = 0.0
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Drive `table` (SlabTable or ByteTable) through the fetches in the reader's
    order; returns (prompt, decode) hits, lookups and bytes read, and (hits, lookups)
    of the decode's last quarter of fetches (Result.steady)."""
    from ..speed import steady_start

    hits, looks, read = [0, 0], [0, 0], [0, 0]
    n_decode = sum(1 for f in fs if f.phase == DECODE)
    steady_from, seen, steady = steady_start(n_decode), 0, [0, 0]
    lookup, admit, pin, unpin = table.lookup, table.admit, table.pin, table.unpin
    on_scores = getattr(table.policy, "on_scores", None)  # a policy that reads the router (NextMix)
    for f in fs:
        nbytes = expert_bytes[f.layer]
        if on_scores is not None and f.scores is not None:
            on_scores(f.layer, f.scores, len(f.keys))  # routed before it is fetched
        missed = []
        keys = drop_cold_keys(f, table, drop_cold) if drop_cold else f.keys
        for key in keys:  # 1. the resident ones, refreshed and pinned first
            if lookup(key) is None:
                missed.append(key)
            else:
                pin(key)
        for key in missed:  # 2. the misses, each admitted pinned
            admit(key, nbytes, pin=True)
        for key in keys:  # 3. the Release
            unpin(key)
        hits[f.phase] += len(keys) - len(missed)
        looks[f.phase] += len(keys)
        read[f.phase] += nbytes * len(missed)
        if f.phase == DECODE:
            if seen >= steady_from:
                steady[0] += len(keys) - len(missed)
                steady[1] += len(keys)
            seen += 1
    return (hits[0], hits[1]), (looks[0], looks[1]), (read[0], read[1]), (steady[0], steady[1])


class Replayer:
    """One trace, many (budget, policy) replays: the fetch list and the
    future (for offline policies) are computed once."""

    def __init__(self, trace: Trace, accounting: str = "slabs", scores=None):
        """`scores`: the router's probabilities [decode fetches, n_expert], for a
        policy with `on_scores` (a route trace does not hold them)."""
        if accounting not in ACCOUNTING:
            raise ReplayError(f"unknown accounting {accounting!r}; allowed: {', '.join(ACCOUNTING)}")
        self.trace, self.accounting = trace, accounting
        self.expert_bytes = trace.header.expert_bytes
        fs = fetches(trace)
        self._fetches = {0: fs if scores is None else with_scores(fs, scores)}  # n_slabs -> fetches split to that size (0: unsplit)

    def fetches_for(self, n_slabs: int) -> list[TraceFetch]:
        fs = self._fetches[0]
        if all(len(f.keys) <= n_slabs for f in fs):
            return fs
        if n_slabs not in self._fetches:
            self._fetches[n_slabs] = split_fetches(fs, n_slabs)
        return self._fetches[n_slabs]

    def capacity(self, budget_mb: float) -> int:
        """Slabs (or, bytes accounting, average-size experts) the budget holds;
        a ReplayError below one layer's top-k (a fetch must fit pinned)."""
        h = self.trace.header
        if not (isinstance(budget_mb, (int, float)) and math.isfinite(budget_mb) and budget_mb > 0):
            raise ReplayError(f"a cache budget must be a positive number of MiB, got {budget_mb!r}")
        budget = int(budget_mb * MIB)
        if self.accounting == "slabs":
            n, need = budget // slab_bytes(self.trace), h.n_expert_used
            what = f"{n} slab(s) of {slab_bytes(self.trace) / MIB:.2f} MiB"
            ok = n >= need
        else:
            moe_layers = max(1, sum(1 for b in h.expert_bytes if b))  # leading dense layers hold no experts
            n = int(budget // (sum(h.expert_bytes) / moe_layers))
            what = f"{budget / MIB:.2f} MiB"
            ok = budget >= h.n_expert_used * h.max_expert_bytes
        if not ok:
            least = math.ceil(h.n_expert_used * (slab_bytes(self.trace) if self.accounting == "slabs" else h.max_expert_bytes) / MIB)
            raise ReplayError(
                f"{self.trace.path}: a budget of {budget_mb:g} MiB holds {what}, fewer than one "
                f"layer's top-{h.n_expert_used} experts; use --budget-mb {least} or more"
            )
        return n

    def run(self, budget_mb: float, policy: str | tuple[str, Callable[[int], Policy]], drop_cold: float = 0.0) -> Result:
        """One replay; `policy` is a POLICIES name or (label, factory(n_slabs)) for a
        variant outside the registry (the bench's)."""
        n = self.capacity(budget_mb)
        # The longest fetch that always fits pinned: n slabs, or that many of the largest experts.
        fits = n if self.accounting == "slabs" else int(budget_mb * MIB) // self.trace.header.max_expert_bytes
        fs = self.fetches_for(fits)
        if isinstance(policy, tuple):
            policy, factory = policy
            pol = factory(n)
        else:
            pol = make_policy(policy, n, future=[f.keys for f in fs] if policy in OFFLINE_POLICIES else None)
        table = SlabTable(n, pol) if self.accounting == "slabs" else ByteTable(int(budget_mb * MIB), pol)
        hits, looks, read, steady = run_fetches(fs, table, self.expert_bytes, drop_cold)
        return Result(budget_mb, policy, self.accounting, n, hits, looks, read, steady)


def policy_names(spec: Iterable[str] | None) -> list[str]:
    """Names from the command line: NAME ... or `all` (None: all)."""
    names = list(spec or ["all"])
    if "all" in names:
        return list(POLICIES)
    for name in names:
        if name not in POLICIES:
            raise ReplayError(f"unknown cache policy {name!r}; allowed: all, {', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def sweep(
    trace: Trace,
    budgets_mb: Iterable[float],
    policies: Iterable[str] | None = None,
    accounting: str = "slabs",
    progress: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Every budget × every policy, budget-major."""
    rp = Replayer(trace, accounting)
    names = policy_names(policies)
    out = []
    for b in budgets_mb:
        for name in names:
            r = rp.run(b, name)
            out.append(r)
            if progress:
                progress(r)
    return out
