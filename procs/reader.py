"""The reader process: the expert cache's only writer.

It owns the slab table (which slab holds which (layer, expert), the eviction
order, the pins), so it needs no locks. First, in a service, the warm start:
the hot set the last run saved is read into free slabs on the lanes'
background queue, a few reads at a time (docs/architecture.md § Warm
restarts). Loop:

  1. a Fetch from compute (a layer with misses): unpin the fetches compute
     is done with, tell the policy the hits compute served from the index
     since its last message, pin the resident experts compute is using, give
     every miss a slab (evicting an unpinned one) and queue its read; then
     the next-layer guesses, if any, the same way on the lanes' guess queue;
  2. a lane finishes a read: publish the slab in the residency index and
     answer Ready(hit=False) to everyone waiting on that expert (a guess and
     a real fetch may wait on the same read); a warm read starts the next;
  3. a Release (once per token): unpin and touch, as in 1;
  3a. a Spares (once per token, instead of the Release, when compute reads its
     own misses): as 3, then adopt the experts compute read into the slabs lent
     to it and publish them, take back the unused ones, lend up to `want` more
     (evicting for them) and answer SpareSlabs;
  3b. a CacheLimit (between passes, as compute's context grows or starts
     over): hold the cache to that many slabs, evicting unpinned experts and
     giving their slabs' pages back, then answer CacheLimited (after the pins
     in the way are gone, if any are);
  4. every cache.warm_save_s, if anything changed: save the hot set (the
     cached experts, hottest first by the uses of 1 and 3);
  5. Shutdown: save the hot set, stop.

Evictions happen only while handling a Fetch (or a Spares), and compute
waits for that message's answers (Readies, the Guessed of a Fetch with only
guesses, the SpareSlabs) before it looks at the index again: so an expert
compute finds in the index stays put while it uses it, pinned or not. Guesses obey the same rule (they
are admitted while their Fetch is handled, and the Readies of the Fetch's
experts that are cached already go out after them, so no answer comes before
an eviction of that Fetch); a guess still queued when the next Fetch arrives
is withdrawn and its slab freed.

A failed read (a disk error, a file truncated or replaced since start-up)
fails the requests waiting for it with IO_ERROR and leaves its slab free:
the key leaves the slab table, every pin on it goes, and the residency
index never showed it (an entry is published only once a read completed).
The reader stays up (a restart could not read the file either) and keeps
the fault in `reader.io.json` in the runtime dir for `status`; while it
lasts, it checks every FAULT_CHECK_S whether the file the service started
with is whole at its path (`ExpertFiles.recover`, which reopens a file put
back as a new inode) and clears the fault then — not at the next read that
happens to work: with a truncated file the early experts still read fine.

Only the main thread touches sockets: lanes hand finished reads back through
an inproc socket of their own. The slab placement of an expert's parts is a
function of its extents, so Ready carries it for convenience only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import zmq

from ..shared.config import Config
from ..shared.experts.cache import CacheFull, SlabTable
from ..shared.experts.directio import ExpertFiles, describe_os_error
from ..shared.experts.hotset import Heat, HotSet, Unusable, WarmStart, hottest_experts, load_hot_set, save_hot_set
from ..shared.experts.populate import Populator
from ..shared.experts.readlanes import Priority, ReadLanes
from ..shared.experts.residency import ResidencyIndex
from ..shared.experts.shm import SlabArena
from ..shared.gguf.model_file import open_model
from ..shared.wire import ipc
from ..shared.wire import messages as m
from .lifecycle import child_setup
from .run_facts import RunFacts

ExpertKey = tuple[int, int]  # (layer, expert)

log = logging.getLogger("moe_pipe.reader")
FAULT_CHECK_S = 1.0  # while a read fault lasts: how often to look for the file's return
PROGRESS_S = 0.25  # the warm start's progress file is rewritten at most this often (the web page redraws at 1 Hz)
IO_STATUS_FILE = "reader.io.json"


@dataclass
class _Waiter:
    req_id: int
    layer: int


class Reader:
    """The loop's state: the slab table over the slab arena, the read lanes,
    who waits for which read and which fetch pinned what, the experts' heat.
    Settings come from `config` (cache.policy, cache.warm_from, cache.warm_start,
    cache.warm_save_s, io.io_threads, io.populate), the arenas, the model's
    identity and the hot-set file from `facts`."""

    def __init__(self, config: Config, facts: RunFacts, ctx: zmq.Context):
        self.runtime_dir, self.n_slabs = facts.runtime_dir, facts.n_slabs
        self.prompt_lent = facts.prompt_lent_slabs  # held back until compute, warm, lends them (§ The prompt's loan)
        self.populate = config.io.populate
        self.warm_from = str(config.cache.warm_from or "")
        self.mf = open_model(facts.model_path, facts.io_align or None)
        self.layout = self.mf.layout
        self.arena = SlabArena.attach(facts.slab_arena, facts.slab_bytes, readonly=False)
        self.populator: Populator | None = None
        self.files = ExpertFiles(self.mf.gguf.paths, identity=facts.model_identity or None, align=self.layout.align)
        self.io = IoStatus.load(facts.runtime_dir)  # a restarted reader carries the count on
        self.next_check = 0.0
        self.table = SlabTable(facts.n_slabs, config.cache.policy)
        self.index = ResidencyIndex.attach(facts.index_arena, self.layout.spec, writable=True)
        self.index.clear_states()  # the pins and reads of a reader before us died with it
        self.table.on_pinned = self.index.mark_pinned  # the web page's heatmap shows pins (docs/web.md)
        self.restored = self.restore_from_index()
        self.limit_waiting: m.CacheLimit | None = None  # a CacheLimit that pins keep from being carried out yet
        if self.index.usable:  # a reader before us (or start-up, for the prompt's loan) held the cache to this
            self.limit_to(self.index.usable)
        # Slabs are handed out 0, 1, 2, ...: populating front to back stays ahead of the fill.
        self.populate_slabs(0, self.table.n_usable)
        # Heat ranks the experts for the hot set; its half-life is nextmix's long clock (4x the cache in uses).
        self.heat = Heat(max(64, 4 * facts.n_slabs))
        self.hot_set, self.identity, self.model_name = facts.hot_set, tuple(facts.model_identity), facts.model_name
        self.save_every_s = config.cache.warm_save_s
        # Warm reads queued or running at once: the lanes that may run them, and one queued
        # behind so a lane never waits for the loop; a few slabs at most (they are pinned).
        self.warm_window = min(max(1, config.io.io_threads - 1) + 1, max(1, facts.n_slabs // 4))
        self.warm: WarmStart | None = None
        self.warm_keys, self.warm_source = self.plan_warm_start(config)
        self.saved = self.save_version()  # what is on disk already: nothing new to save yet
        self.next_save = time.monotonic() + self.save_every_s
        ep = ipc.Endpoints(Path(facts.runtime_dir))
        self.fetch_in = ipc.bind(ctx, ep, "fetch")
        self.ready_out = ipc.connect(ctx, ep, "ready")
        self.done_addr = f"inproc://reader-done-{os.getpid()}"
        self.done_in = ctx.socket(zmq.PULL)
        self.done_in.setsockopt(zmq.LINGER, 0)
        self.done_in.bind(self.done_addr)
        self.ctx = ctx
        self._lane_sockets = threading.local()
        self.lanes = ReadLanes(config.io.io_threads, self._read_lane)
        self.inflight: dict[tuple[int, int], list[_Waiter]] = {}  # key -> who waits for its bytes
        self.pinned: dict[int, list[tuple[int, int]]] = defaultdict(list)  # req_id -> keys it pinned
        # Demands that found every slab pinned while reads were under way: admitted as those land.
        self.blocked: list[tuple[tuple[int, int], _Waiter]] = []
        self.held_readies: list[tuple[int, ExpertKey, int]] | None = None  # while a Fetch is handled (on_fetch)
        self.guesses_read = self.guesses_withdrawn = 0
        self.guess_io = [0, 0]  # bytes, ns of unasked reads not yet reported to compute

    def restore_from_index(self) -> int:
        """After a restart the slabs still hold what the last reader published:
        take it over, so the cache survives (its eviction order does not)."""
        n = 0
        for key, slab in self.index.entries():
            if 0 <= slab < self.n_slabs and self.table.key_of(slab) is None:
                self.table.restore(key, slab)
                n += 1
            else:  # an entry that cannot be ours (a smaller arena): never serve it
                self.index.clear(key)
        if n:
            log.warning("took over %d cached experts from the previous reader", n)
        return n

    def plan_warm_start(self, config: Config) -> tuple[list[ExpertKey], str]:
        """The experts a warm start reads, hottest first, and where they come
        from: a route trace when cache.warm_from names one, else the service's
        hot set (unless cache.warm_start is off). A hot set that cannot be used
        is logged and the start is cold. Only what is not cached yet (a
        restarted reader took the cache over) and fits in the free slabs."""
        keys: list[ExpertKey] = []
        source = self.warm_from
        if self.warm_from:
            keys = hottest_experts(self.warm_from, self.layout.spec, self.n_slabs)
        elif self.hot_set:
            hot = self.read_hot_set()
            if hot is not None:
                self.heat.seed(hot.experts)  # a restarted reader keeps the order of the experts it took over
                if config.cache.warm_start:
                    keys, source = list(hot.experts), self.hot_set
                else:
                    log.info("cache.warm_start is off (--cold): the hot set of %d experts is not read", len(hot.experts))
        keys = [k for k in keys if k not in self.table][: self.table.n_usable - len(self.table)]
        return keys, source

    def read_hot_set(self) -> HotSet | None:
        spec = self.layout.spec
        try:
            return load_hot_set(self.hot_set, self.identity, spec.n_layer, spec.n_expert)
        except Unusable as exc:
            if os.path.exists(self.hot_set):
                log.warning("hot set %s ignored: %s; the cache starts cold", self.hot_set, exc)
            else:
                log.info("no hot set at %s yet: the cache starts cold", self.hot_set)
            return None

    def on_hello(self, msg: m.Hello) -> None:
        """A compute (re)started: the pins of the one before it will never be
        released, so drop them all; reads in flight still land and publish."""
        if msg.role != "compute":
            return
        for keys in self.pinned.values():
            for key in keys:
                if key in self.table and self.table.pins(key):
                    self.table.unpin(key)
        self.pinned.clear()
        self.blocked.clear()
        for waiters in self.inflight.values():
            waiters.clear()
        self.table.take_back(self.table.lent)  # what it read into them is not in the index: free again
        self.limit_waiting = None
        # Its context is empty: the KV cache's loan is the cache's again; the prompt's waits until it is warm.
        self.limit_to(self.n_slabs - self.prompt_lent)

    # -- 1. fetch ------------------------------------------------------------
    def on_fetch(self, msg: m.Fetch) -> None:
        # The Readies of experts cached already go out once the guesses are admitted: compute
        # reads the index again as soon as its answers are in, and the guesses may evict.
        self.held_readies = []
        try:
            self.admit_fetch(msg)
        finally:
            held, self.held_readies = self.held_readies or [], None
            for req_id, key, slab in held:
                self.send_ready(req_id, key, slab, hit=True, io_ns=0)

    def admit_fetch(self, msg: m.Fetch) -> None:
        """A Fetch's pins, demands and guesses, in that order (the module's step 1)."""
        self.release(msg.released, msg.touched)
        self.withdraw_guesses(keep={(msg.layer, e) for e in msg.experts})
        # Pin what compute is already using before anything can be evicted.
        for e in msg.resident:
            key = (msg.layer, e)
            if self.table.lookup(key) is None or key in self.inflight:
                # Cannot happen while only compute's own fetches evict; fail loudly.
                self.send(m.FetchFailed(msg.req_id, msg.layer, e, m.Code.INTERNAL, f"expert {key} was not resident"))
                continue
            self.table.pin(key)
            self.pinned[msg.req_id].append(key)
            self.heat.use(key)
        for e in msg.experts:
            key = (msg.layer, e)
            if not self.is_expert(key):
                self.send(m.FetchFailed(msg.req_id, msg.layer, e, m.Code.BAD_ARGUMENT, f"no expert {key}"))
                continue
            self.heat.use(key)
            self.demand(key, _Waiter(msg.req_id, msg.layer))
        for e in msg.guesses:
            if not self.guess(msg.guess_layer, e):
                break
        if not msg.experts and msg.guesses:  # compute waits for this before it looks at the index again
            self.send(m.Guessed(msg.req_id, *self.take_guess_io()))

    def demand(self, key, waiter: _Waiter) -> None:
        """compute's request for `key`: Ready at once if cached, else after its read."""
        slab = self.table.lookup(key)
        if slab is not None and key not in self.inflight:
            self.table.pin(key)
            self.pinned[waiter.req_id].append(key)
            if self.held_readies is not None:  # inside a Fetch: answered at its end (on_fetch)
                self.held_readies.append((waiter.req_id, key, slab))
            else:
                self.send_ready(waiter.req_id, key, slab, hit=True, io_ns=0)
        elif key in self.inflight:  # its read is under way (a guess, a warm start's): wait for it, first in line
            self.lanes.promote(key)
            self.table.pin(key)
            self.pinned[waiter.req_id].append(key)
            self.inflight[key].append(waiter)
        else:
            self.start_read(key, waiter)

    def retry_blocked(self) -> None:
        """The demands that found every slab pinned, again, in order, now that a read has
        landed or compute released slabs."""
        blocked, self.blocked = self.blocked, []
        for key, waiter in blocked:
            self.demand(key, waiter)

    def take_guess_io(self) -> tuple[int, int]:
        nbytes, ns = self.guess_io
        self.guess_io = [0, 0]
        return nbytes, ns

    def is_expert(self, key) -> bool:
        return 0 <= key[0] < len(self.layout.layers) and 0 <= key[1] < self.layout.spec.n_expert

    def guess(self, layer: int, expert: int) -> bool:
        """A next-layer guess: read it after the demand, evicting if need be
        (safe here: see the module's docstring). False once nothing can be
        evicted (every slab pinned): the rest of the guesses are skipped."""
        key = (layer, expert)
        if not self.is_expert(key) or key in self.table:
            return True
        try:
            self.start_read(key, None, Priority.GUESS)
        except CacheFull:
            return False
        self.guesses_read += 1
        return True

    def withdraw_guesses(self, keep=frozenset()) -> None:
        """Free the slabs of guesses whose reads have not started: their layer's
        request is here (or the token is over) and did not ask for them."""
        for guess, _slab in self.lanes.withdraw_guesses(keep):
            key = cast(ExpertKey, guess)  # the lanes hold what the reader submitted
            if self.inflight.pop(key, None):
                raise RuntimeError(f"withdrew guess {key} that a request waits for")
            self.index.mark_inflight(key, False)
            self.table.unpin(key)  # the read's own pin
            self.table.drop(key)
            self.guesses_withdrawn += 1

    def start_read(self, key, waiter: _Waiter | None, priority: Priority = Priority.DEMAND) -> None:
        """Admit `key` (evicting if need be) and queue its read. CacheFull when
        every slab is pinned: a waiter is answered FetchFailed, a read nobody waits for raises."""
        try:
            slab, evicted = self.table.admit(key, self.layout.expert_bytes(key[0]), pin=True)
            if evicted is not None:
                self.index.clear(cast(ExpertKey, evicted))  # before its slab is overwritten
        except CacheFull:
            if waiter is not None and self.withdraw_warm_reads():
                return self.start_read(key, waiter, priority)  # a warm read queued gave its slab
            if waiter is None:
                raise
            if self.inflight:  # a read under way holds a slab until it lands (an abandoned request's, a guess): wait for it
                self.blocked.append((key, waiter))
                return
            self.send(m.FetchFailed(waiter.req_id, key[0], key[1], m.Code.INTERNAL, "every cache slab is pinned"))
            return
        if waiter is not None:  # the waiter's own pin, beside the read's
            self.table.pin(key)
            self.pinned[waiter.req_id].append(key)
        self.inflight[key] = [waiter] if waiter else []
        self.index.mark_inflight(key, True)
        self.lanes.submit(key, slab, priority)

    # -- 2. a lane's read ------------------------------------------------------
    def _read_lane(self, key, slab: int) -> None:
        sock = getattr(self._lane_sockets, "sock", None)
        if sock is None:
            sock = self._lane_sockets.sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.done_addr)
        t0 = time.perf_counter_ns()
        try:
            placement = self.files.read_expert(self.layout.expert_extents(*key), self.arena.slab(slab))
            sock.send_pyobj((key, slab, time.perf_counter_ns() - t0, placement.regions, None))
        except Exception as exc:  # noqa: BLE001 - a failed read fails the request, not the reader
            sock.send_pyobj((key, slab, time.perf_counter_ns() - t0, (), describe_os_error(exc)))

    def on_read_done(self, key, slab: int, io_ns: int, regions, error: str | None) -> None:
        waiters = self.inflight.pop(key, [])
        self.index.mark_inflight(key, False)
        warm = self.warm is not None and key in self.warm.reading
        if warm:
            cast(WarmStart, self.warm).reading.discard(key)
        if error is not None:
            self.forget(key)
            self.io.failed(self.runtime_dir, error)
            self.next_check = time.monotonic() + FAULT_CHECK_S
            log.info("read of expert %s failed: %s", key, error)
            for w in waiters:
                self.send(m.FetchFailed(w.req_id, key[0], key[1], m.Code.IO_ERROR, error))
            if warm:
                self.end_warm_start("stopped", "a read failed")
            self.retry_blocked()  # its slab is free again
            return
        self.table.unpin(key)  # the read's own pin; waiters hold theirs
        self.index.publish(key, slab)  # the slab is complete: compute may now find it
        if not waiters:  # a guess (or a warm-start read) nobody asked for yet: reported with the next answer
            self.guess_io[0] += self.layout.expert_bytes(key[0])
            self.guess_io[1] += io_ns
        for i, w in enumerate(waiters):
            self.send(m.Ready(w.req_id, key[0], key[1], slab, tuple(regions), False, io_ns if i == 0 else 0, *self.take_guess_io()))
        if warm:
            plan = cast(WarmStart, self.warm)
            plan.done += 1
            if plan.state == "warming":
                self.feed_warm_start()
            else:  # a read under way when it stopped: the count the progress file says
                self.write_warm_progress(force=True)
        self.retry_blocked()  # the read's own pin is gone: a demand that found every slab pinned may fit now
        self.carry_out_limit()  # and a CacheLimit it was in the way of may be carried out

    def forget(self, key) -> None:
        """A failed read: its slab's bytes are partial, so the key leaves the
        table (its slab is free again) with every pin on it — the read's own
        and its waiters', whose Releases must then not touch a later occupant."""
        for keys in self.pinned.values():
            while key in keys:
                keys.remove(key)
        while self.table.pins(key):
            self.table.unpin(key)
        self.table.drop(key)
        self.index.clear(key)  # it was never published; cleared to be sure

    def check_fault(self) -> None:
        """Is the file the service started with usable again?"""
        self.next_check = time.monotonic() + FAULT_CHECK_S
        problem = self.files.recover()
        if problem is None:
            log.warning("the model file is readable again; the read fault is over")
            self.io.cleared(self.runtime_dir)
        elif problem != self.io.fault:
            self.io.failed(self.runtime_dir, problem, count=False)

    # -- 3. release ---------------------------------------------------------------
    def on_release(self, msg: m.Release) -> None:
        self.release(msg.released, msg.touched)
        self.withdraw_guesses()  # the token is over: its guesses were not asked for
        self.carry_out_limit()

    def release(self, released, touched) -> None:
        """Unpin the slabs of fetches compute is done with, then tell the policy
        about the hits compute served from the index without a message, in
        the order they happened (nothing was evicted since, so the policy
        sees what it would have seen had each been a Fetch)."""
        for req_id in released:
            for key in self.pinned.pop(req_id, []):
                if key in self.table:
                    self.table.unpin(key)
        if self.blocked:  # a blocked demand of a fetch compute left (a Stop) is not read
            gone = set(released)
            self.blocked = [(key, w) for key, w in self.blocked if w.req_id not in gone]
            self.retry_blocked()
        for key in touched:
            if self.table.lookup(key) is not None:  # a hit for the policy and the stats; a key gone since is skipped
                self.heat.use(key)

    # -- 3a. compute's own reads -------------------------------------------------------
    def on_spares(self, msg: m.Spares) -> None:
        """The end of a token whose misses compute read itself into lent slabs: what a Release
        does, then each of those experts into the table and the index (after the token's hits,
        as the policy would have seen them), the unused slabs back, and up to `want` more lent
        (evicting: compute waits for the answer before it reads the index again)."""
        self.release(msg.released, msg.touched)
        self.withdraw_guesses()
        for layer, expert, slab in msg.installed:
            key = (layer, expert)
            if not self.is_expert(key) or slab not in self.table.lent:
                log.warning("compute installed expert %s in slab %d, which is not lent to it: ignored", key, slab)
                continue
            if key in self.table:  # read by us too meanwhile (a warm read): ours stays, compute's slab is free again
                self.table.take_back([slab])
                continue
            self.table.adopt(key, slab, self.layout.expert_bytes(layer))
            self.index.publish(key, slab)
            self.heat.use(key)
        self.table.take_back([s for s in msg.returned if s in self.table.lent])
        slabs: list[int] = []
        if msg.want > 0 and self.limit_waiting is None:
            slabs, evicted = self.table.lend(msg.want)
            for gone in evicted:
                self.index.clear(cast(ExpertKey, gone))
        self.send(m.SpareSlabs(msg.req_id, tuple(slabs)))
        self.retry_blocked()
        self.carry_out_limit()

    # -- 3b. the KV cache's loan ------------------------------------------------------
    def on_cache_limit(self, msg: m.CacheLimit) -> None:
        if self.populator is not None and msg.slabs < self.table.n_usable:  # it would give the pages given back their memory again
            self.populator.stop()
            self.populator = None
        self.limit_waiting = msg
        self.carry_out_limit()

    def carry_out_limit(self) -> None:
        """Hold the cache to the waiting CacheLimit and answer it, once no pin is in the way."""
        msg = self.limit_waiting
        if msg is None:
            return
        if self.limit_to(msg.slabs) <= msg.slabs:
            self.limit_waiting = None
            self.send(m.CacheLimited(msg.req_id, msg.slabs))

    def limit_to(self, n: int) -> int:
        """Hold the cache to at most `n` slabs: evicted experts leave the index before their
        slabs' pages go back to the system. Returns the slabs it holds now (above `n` while
        pins are in the way)."""
        n = max(1, min(n, self.n_slabs))
        before = self.table.n_usable
        retired, evicted = self.table.set_usable(n)
        if n > before:  # a loan given (back) to the cache: its slabs' pages, made ahead of the reads into them
            self.populate_slabs(before, n)
        for key in evicted:
            self.index.clear(cast(ExpertKey, key))
        for slab in retired:
            self.arena.release_slab(slab)
        self.index.usable = 0 if n == self.n_slabs else n
        if retired or evicted:
            log.info("cache held to %d of %d slabs (%d given back, %d experts evicted)", n, self.n_slabs, len(retired), len(evicted))
        return self.table.n_usable

    def populate_slabs(self, first: int, end: int) -> None:
        """Make the pages of slabs [first, end) on a thread (io.populate), ahead of the reads
        into them; a populate still running stops, and what it had left is made by this one
        (one at a time; a CacheLimit below the count stops it before pages are given back)."""
        if not self.populate or end <= first:
            return
        sb = self.arena.slab_bytes
        start = first * sb
        if self.populator is not None:  # one running yet (the start-up's, say): it goes on in the new one
            self.populator.stop()
            if self.populator.supported:
                start = min(start, self.populator.start_at + self.populator.done_bytes)
        self.populator = Populator(self.arena.arena, start=start, end=end * sb, what="slab cache").start()

    # -- sending --------------------------------------------------------------------
    def send_ready(self, req_id: int, key, slab: int, hit: bool, io_ns: int) -> None:
        from ..shared.experts.placement import placement_for

        regions = placement_for(self.layout.expert_extents(*key), self.layout.align).regions
        self.send(m.Ready(req_id, key[0], key[1], slab, regions, hit, io_ns, *self.take_guess_io()))

    def send(self, msg) -> None:
        ipc.send(self.ready_out, msg)

    # -- the warm start ----------------------------------------------------------------
    def warm_start(self) -> None:
        """Fill free slabs with the planned experts (`plan_warm_start`), hottest
        first, through the lanes' background queue: a request's reads go first
        (docs/architecture.md § Warm restarts)."""
        if not self.warm_keys:
            return
        log.info("warm start: reading %d experts, hottest first, from %s", len(self.warm_keys), self.warm_source)
        self.warm = WarmStart(self.warm_keys, self.warm_source, time.monotonic())
        self.feed_warm_start()

    def feed_warm_start(self) -> None:
        """Keep `warm_window` warm reads queued or running: each that lands
        starts the next. Experts a request or a guess brought in meanwhile count
        as warmed; the warm start stops when the free slabs run out (it never
        evicts), and ends when every expert is cached."""
        w = self.warm
        if w is None or w.state != "warming":
            return
        while len(w.reading) < self.warm_window and w.next < len(w.keys):
            key = w.keys[w.next]
            if key in self.table:
                w.next += 1
                w.done += key not in self.inflight  # a guess's read under way is not cached yet
                continue
            if len(self.table) >= self.table.n_usable:
                self.end_warm_start("stopped", "the cache filled first")
                return
            w.next += 1
            self.start_read(key, None, Priority.BACKGROUND)
            w.reading.add(key)
        if w.next >= len(w.keys) and not w.reading:
            w.done = sum(1 for k in w.keys if k in self.table and k not in self.inflight)
            self.end_warm_start("done")
        else:
            self.write_warm_progress()

    def withdraw_warm_reads(self) -> bool:
        """A request needs a slab and every one is pinned: free the slabs of the
        warm reads still queued (their pins are the read's own) and end the warm
        start, the cache being full. False if there were none."""
        gone = self.lanes.withdraw_background()
        for queued, _slab in gone:
            key = cast(ExpertKey, queued)
            if self.inflight.pop(key, None):
                raise RuntimeError(f"withdrew warm read {key} that a request waits for")
            self.index.mark_inflight(key, False)
            self.table.unpin(key)
            self.table.drop(key)
            if self.warm is not None:
                self.warm.reading.discard(key)
        if gone and self.warm is not None and self.warm.state == "warming":
            self.end_warm_start("stopped", "the cache filled first")
        return bool(gone)

    def end_warm_start(self, state: str, note: str = "") -> None:
        w = cast(WarmStart, self.warm)
        w.state, w.note = state, note
        # The policy saw the warmed experts admitted hottest first (an LRU would evict the
        # hottest first): it is shown every cached expert once more, coldest first by heat.
        cached = [cast(ExpertKey, k) for k in self.table.resident() if k not in self.inflight]
        self.table.refresh(reversed(self.heat.hottest(cached)))
        self.write_warm_progress(force=True)
        log.info("%s", w.progress(time.monotonic()).text())

    def write_warm_progress(self, force: bool = False) -> None:
        """warm.json in the runtime folder, for status, tail and the web page (at most every PROGRESS_S)."""
        w, now = self.warm, time.monotonic()
        if w is None or (not force and now - w.written_at < PROGRESS_S and w.written_at):
            return
        w.written_at = now
        try:
            w.progress(now).write(self.runtime_dir)
        except OSError as exc:
            log.warning("cannot write the warm start's progress: %s", exc)

    # -- the hot set ------------------------------------------------------------------
    def save_version(self) -> tuple[int, int, int]:
        """Changes when anything a save would write may have: a use, an admission, the count."""
        return self.heat.uses, self.table.stats.misses, len(self.table)

    def hottest_now(self) -> list[ExpertKey]:
        """The hot set to save: the cached experts (reads under way included),
        hottest first, then a warm start's experts not read yet (its plan's
        order), at most a cache's worth."""
        keys = self.heat.hottest(cast(ExpertKey, k) for k in self.table.resident())
        if self.warm is not None:
            keys += [k for k in self.warm.pending if k not in self.table]
        return keys[: self.n_slabs]

    def save_hot_set(self, now: float) -> None:
        """Write the hot set, if this is a service and anything changed since
        the last save (or since its file was read); never an empty one."""
        self.next_save = now + self.save_every_s
        if not self.hot_set or self.save_version() == self.saved:
            return
        self.saved = self.save_version()
        keys = self.hottest_now()
        if not keys:
            return
        spec = self.layout.spec
        try:
            save_hot_set(self.hot_set, HotSet(self.identity, spec.n_layer, spec.n_expert, tuple(keys), self.model_name, time.time()))
        except OSError as exc:
            log.warning("cannot save the hot set to %s: %s", self.hot_set, exc)

    def poll_timeout_ms(self) -> int | None:
        """Until the next thing the loop must do unasked: a fault check, a save."""
        due = []
        if self.io.fault is not None:
            due.append(self.next_check)
        if self.hot_set and self.save_every_s > 0 and self.save_version() != self.saved:
            due.append(self.next_save)
        return max(0, int((min(due) - time.monotonic()) * 1000)) if due else None

    # -- the loop --------------------------------------------------------------------

    def run(self) -> None:
        self.warm_start()
        poller = zmq.Poller()
        poller.register(self.fetch_in, zmq.POLLIN)
        poller.register(self.done_in, zmq.POLLIN)
        while True:
            # While a read fault lasts, wake up to look for the file's return; save the hot set when due.
            events = poller.poll(self.poll_timeout_ms())
            now = time.monotonic()
            if self.io.fault is not None and now >= self.next_check:
                self.check_fault()
            if self.save_every_s > 0 and now >= self.next_save:
                self.save_hot_set(now)
            for sock, _ in events:
                if sock is self.done_in:
                    self.on_read_done(*self.done_in.recv_pyobj())
                    continue
                try:
                    msg = ipc.recv(self.fetch_in, 0)
                except m.ProtocolError as exc:
                    log.warning("dropped a bad frame: %s", exc)
                    continue
                if isinstance(msg, m.Fetch):
                    self.on_fetch(msg)
                elif isinstance(msg, m.Release):
                    self.on_release(msg)
                elif isinstance(msg, m.CacheLimit):
                    self.on_cache_limit(msg)
                elif isinstance(msg, m.Spares):
                    self.on_spares(msg)
                elif isinstance(msg, m.Hello):
                    self.on_hello(msg)
                elif isinstance(msg, m.Shutdown):
                    self.save_hot_set(time.monotonic())  # `down`: the next `up` starts from what the cache holds now
                    return

    def close(self) -> None:
        if self.populator is not None:
            self.populator.stop()  # before the arena is unmapped under it
        self.lanes.shutdown()
        self.index.close()
        self.files.close()
        self.arena.close()
        self.mf.close()


@dataclass
class IoStatus:
    """The reader's read faults, kept in the runtime dir for `status`:
    how many reads failed, the last error and when, and the fault now in
    force (None once reads work again)."""

    io_errors: int = 0
    last_io_error: str = ""
    last_io_error_at: float = 0.0
    fault: str | None = None

    @classmethod
    def load(cls, runtime_dir: str) -> IoStatus:
        data = read_io_status(runtime_dir)
        return cls(**{k: data[k] for k in ("io_errors", "last_io_error", "last_io_error_at", "fault") if k in data})

    def failed(self, runtime_dir: str, error: str, count: bool = True) -> None:
        if count:
            self.io_errors += 1
            self.last_io_error, self.last_io_error_at = error, time.time()
        self.fault = error
        self._save(runtime_dir)

    def cleared(self, runtime_dir: str) -> None:
        self.fault = None
        self._save(runtime_dir)

    def _save(self, runtime_dir: str) -> None:
        path = os.path.join(runtime_dir, IO_STATUS_FILE)
        tmp = f"{path}.{os.getpid()}"
        try:
            with open(tmp, "w") as fh:
                json.dump(self.__dict__, fh)
            os.replace(tmp, path)  # whole or not at all: status may read it at any moment
        except OSError as exc:
            log.warning("cannot record the read fault in %s: %s", path, exc)


def read_io_status(runtime_dir: str) -> dict:
    """What the reader last recorded about read faults ({} if none)."""
    try:
        with open(os.path.join(runtime_dir, IO_STATUS_FILE)) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def main(config: Config, facts: RunFacts) -> None:
    child_setup("reader")
    with ipc.context() as ctx:
        reader = Reader(config, facts, ctx)
        try:
            reader.run()
        finally:
            reader.close()
