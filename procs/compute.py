"""The compute process: the forward pass and the KV cache.

Loop:
  1. a Generate from the front end: prefill what the prompt does not share
     with the session's KV cache (kept between requests: docs/conversations.md),
     then decode token by token; a Slot saves, restores or erases that session;
  2. per MoE layer the model asks `SlabExperts` for its k experts: the hits
     come from the residency index with no message at all; a layer with
     misses sends one Fetch (naming its hits, to be pinned, and carrying the
     next layer's guesses when prefetch is on), computes its hits, then each
     miss as its Ready lands (overlap) — straight out of the read-only slab
     arena;
  3. per generated token: one Release (the token's fetches are done, and the
     hits the reader has not heard of), text to the front end (Token), a
     TokenRecord to telemetry (never blocking), and at the end Done; while the
     prompt runs, its progress (PromptProgress) to both, and a Cancel is
     looked for after every layer and between experts, so a Stop ends even a
     minutes-long prompt within a second (shared/model/prompt_watch.py);
  4. Shutdown: stop.

A request that fails (a read error, the reader gone) ends with Done(ok=False)
and a code; the process itself keeps serving unless its peer is gone.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import zmq

from ..shared import heap, quant
from ..shared.config import ComputeConfig, Config
from ..shared.cores import choose_threads
from ..shared.errors import UserError
from ..shared.experts.budget import KVLoan, PromptLoan
from ..shared.experts.dense import arena_views, warm_sweep
from ..shared.experts.directio import ModelChanged, model_identity
from ..shared.experts.lentreads import LentReads, lent_slabs
from ..shared.experts.placement import expert_view, placement_for
from ..shared.experts.populate import Populator
from ..shared.experts.residency import ResidencyIndex
from ..shared.experts.shm import Arena, SlabArena
from ..shared.gguf.model_file import open_model
from ..shared.gguf.spec import experts_per_token
from ..shared.model.levers import Levers
from ..shared.model.load import ModelOptions, load_model
from ..shared.model.prompt_watch import PromptProgress, PromptWatch
from ..shared.model.routes import RouteReplay, RouteTracer
from ..shared.model.session import Session, slot_action
from ..shared.model.trace import read_trace
from ..shared.model.weights import Expert
from ..shared.pids import pid_alive
from ..shared.text.generate import GenerationConfig, generate
from ..shared.text.sampling import SamplingParams
from ..shared.text.speculate import drafter_for
from ..shared.text.tokenizer import Tokenizer
from ..shared.wire import ipc
from ..shared.wire import messages as m
from .guess_gate import GuessGate
from .lifecycle import FrontEndWatch, child_setup
from .metered import MeteredModel, RouteCount
from .run_facts import RunFacts
from .warmup import STAGE, CompileCounter, forward_pass, kernel_steps, warm_up

log = logging.getLogger("moe_pipe.compute")
PEER_POLL_MS = 500  # how often a wait for the reader checks that it is still alive


class GenerationAborted(Exception):
    """The request being served ends early with `code` (a read failed, the
    reader died, the front end cancelled it, the service is stopping); the
    process goes on serving unless its peer is gone."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Interrupts:
    """What may arrive on the requests link while a generation runs: a Cancel
    for it (its client went away) or a Shutdown. Checked before every model
    step (a non-blocking poll, microseconds); a Shutdown is remembered so the
    serve loop exits once the request has ended."""

    def __init__(self, requests: zmq.Socket):
        self.requests = requests
        self.req_id = 0
        self.shutdown = False
        self.pending: list[m.Generate | m.Slot] = []  # a front end that did not wait for Done
        self.cancels: deque[int] = deque(maxlen=256)  # Cancels of other requests: slots' (procs/slots.py), or late ones

    def check(self) -> None:
        while True:
            try:
                msg = ipc.recv(self.requests, 0, expect=(m.Cancel, m.Shutdown, m.Generate, m.Slot))
            except m.ProtocolError as exc:
                log.warning("dropped a bad frame: %s", exc)
                continue
            if msg is None:
                return
            if isinstance(msg, (m.Generate, m.Slot)):
                self.pending.append(msg)
            elif isinstance(msg, m.Shutdown):
                self.shutdown = True
                raise GenerationAborted(m.Code.CANCELLED, "the service is shutting down")
            elif msg.req_id == self.req_id:
                raise GenerationAborted(m.Code.CANCELLED, "cancelled by the front end")
            else:
                self.cancels.append(msg.req_id)


class SlabExperts:
    """The pipeline's ExpertSource (shared/model/weights.py): experts from the
    shared-memory cache; it reads ahead on `prefetch` and reports `resident`
    from the residency index."""

    def __init__(
        self,
        facts: RunFacts,
        overlap: bool,
        layout,
        fetch_out: zmq.Socket,
        ready_in: zmq.Socket,
        poll: Callable[[], None] | None = None,
        kv_type: str = "f16",
        top_k: int | None = None,
        lent_reads: int = 0,
        lanes: int = 1,
        paths: Sequence[str | os.PathLike] = (),
    ):
        """`facts`: the arenas and the reader to watch; `overlap`: compute.overlap;
        `poll`: called between experts, may raise GenerationAborted (a Stop mid-prompt);
        `kv_type`: compute.kv_type, what a position of the KV cache takes (the loan);
        `top_k`: compute.n_expert_used, what a prompt pass's activations take (the prompt's loan);
        `lent_reads`: slabs the reader lends this process to read its own misses into, on `lanes`
        threads of its own from the model's `paths` (io.compute_reads; 0: every miss goes to the reader)."""
        self.n_slabs, self.reader_pid, self.overlap, self.layout = facts.n_slabs, facts.reader_pid, overlap, layout
        self.poll = poll or (lambda: None)
        self.arena = SlabArena.attach(facts.slab_arena, facts.slab_bytes, readonly=not lent_reads)
        self.index = ResidencyIndex.attach(facts.index_arena, layout.spec)
        self.fetch_out, self.ready_in = fetch_out, ready_in
        self.next_req = 1
        self.done: list[int] = []  # fetches finished since the last message (their pins go)
        self.touched: list[tuple[int, int]] = []  # hits served from the index since the last message
        self.guess: tuple[int, list[int]] | None = None  # the next layer's guess, sent with this layer's Fetch
        self.unsettled = 0  # a guesses-only Fetch whose Guessed (or a Spares whose SpareSlabs) has not come yet
        self.unsettled_by: type = m.Guessed
        # compute's own reads (docs/architecture.md § compute's own reads): the slabs lent to it, the
        # experts it read into them this token (the reader hears at its end), and those until then by key.
        self.spare_target = lent_reads
        self.spares: list[int] = []
        self.installed: list[tuple[int, int, int]] = []
        self.own: dict[tuple[int, int], int] = {}
        self.lent = LentReads(paths, layout, self.arena, lanes, facts.model_identity) if lent_reads else None
        self.last_layer = layout.spec.n_layer - 1
        self.predicted: dict[int, set[int]] = {}
        self.gate = GuessGate()
        self.views: dict[tuple[int, int], tuple[int, Expert]] = {}  # (layer, expert) -> (slab, views)
        self.layer_bytes = np.array([layout.expert_bytes(i) for i in range(len(layout.layers))], np.int64)
        # The KV cache's loan (docs/architecture.md § The KV cache's loan): the slabs the cache
        # may hold, taken back before the context grows into them.
        self.loan = KVLoan.of(facts.n_slabs, facts.lent_slabs, facts.slab_bytes, layout.spec, kv_type)
        # The prompt's loan (§ The prompt's loan): not the cache's until this process is warm (`lend`).
        self.prompt_loan = PromptLoan(facts.prompt_lent_slabs, facts.slab_bytes, layout.spec, experts_per_token(layout.spec, top_k))
        self.usable = self.n_slabs - self.prompt_loan.lent_slabs
        self.kv_held = self.n_slabs  # what the KV cache's loan leaves the cache: taken back once and kept back
        self.withheld = self.prompt_loan.lent_slabs  # of the prompt's loan, what is not lent (all until warm)
        self.fillers: list[Populator] = []  # the slab arena's populator: stopped before pages are given back
        self.reset_counters()

    def reset_counters(self) -> None:
        self.hits = self.misses = self.read_bytes = self.io_ns = 0
        self.stall_s = self.mgmt_s = self.wire_s = 0.0
        self.messages = 0
        self.prefetch_issued = self.prefetch_used = self.prefetch_wasted_bytes = self.prefetch_paused = 0

    def prefetch(self, layer: int, ids: Sequence[int]) -> None:
        """A guess at the next layer's experts, made before this layer's experts
        are asked for. The ones not cached ride on this layer's Fetch (one
        with no misses is sent for them alone), and compute waits for that
        Fetch's answers before it reads the index again, so the reader may
        evict for them safely. The first MoE layer's guess (from the token's
        embedding) has no earlier layer to ride on: it goes at once, so its
        reads overlap that layer's attention. A layer whose guesses stopped paying
        (`GuessGate`) is not guessed."""
        self._settle()
        if not self.gate.allow(layer):
            self.prefetch_paused += 1
            return
        slabs = self.index.slabs(layer, ids)
        self.guess = (layer, [e for e, s in zip(ids, slabs) if s < 0])
        if layer == self.layout.spec.n_dense_lead and self.guess[1]:  # the first MoE layer
            t0 = time.perf_counter()
            self._send_fetch(layer, [], [])
            self.wire_s += time.perf_counter() - t0

    def _score_prefetch(self, layer: int, ids: list[int]) -> None:
        guess = self.predicted.pop(layer, None)
        if guess:
            used = guess & set(ids)
            self.prefetch_used += len(used)
            self.prefetch_wasted_bytes += (len(guess) - len(used)) * self.layout.expert_bytes(layer)
            self.gate.score(layer, len(guess), len(used))

    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[Expert]:
        ids = list(ids)
        self._score_prefetch(layer, ids)
        # A prompt batch can route to more experts than the cache has slabs (the
        # budget floor is one *token's* working set): fetch in slab-sized groups.
        group = self.held_together
        for start in range(0, len(ids), group):
            yield from self._fetch_group(layer, ids[start : start + group])
        if layer == self.last_layer and self.lent is not None:
            # The pass's experts are done: its Spares goes now, so that the reader's answer
            # (its bookkeeping of the whole token) is ready while the output head runs.
            self.end_step()

    def _fetch_group(self, layer: int, ids: list[int], own: bool = True) -> Iterator[Expert]:
        """`ids`' experts as they are ready; misses read here into lent slabs when `own` and they fit
        (_reads_own), else asked of the reader."""
        self._settle()
        t0 = time.perf_counter()
        slabs = self.index.slabs(layer, ids)  # hits need no round trip
        if self.own:  # read by compute this token: in slabs lent to it, in the index once the token ends
            slabs = [self.own.get((layer, e), s) if s < 0 else s for e, s in zip(ids, slabs)]
        resident = [e for e, s in zip(ids, slabs) if s >= 0]
        missing = [e for e, s in zip(ids, slabs) if s < 0]
        self.hits += len(resident)
        if not missing and not (self.guess and self.guess[1]):
            # all cached and nothing to guess: no message; the reader hears of these hits later
            self.touched.extend((layer, e) for e in resident)
            self.guess = None
            self.mgmt_s += time.perf_counter() - t0
            for e, s in zip(ids, slabs):
                self.poll()  # a Stop between experts: the reader is owed nothing here
                yield self._view(layer, e, s)
            return
        if own and self._reads_own(layer, missing):
            self.touched.extend((layer, e) for e in resident)
            self.mgmt_s += time.perf_counter() - t0
            yield from self._read_own(layer, ids, slabs, missing)
            return
        req = self._send_fetch(layer, missing, [e for e in resident if (layer, e) not in self.own])  # the reader pins what it holds
        self.wire_s += time.perf_counter() - t0

        def ready() -> tuple[int, int]:
            r = self._next_ready(req)
            return r.expert, r.slab

        try:
            yield from self._as_they_land(layer, ids, slabs, len(missing), ready)
        except GenerationAborted as exc:
            if missing and exc.code != m.Code.PEER_GONE:
                self._barrier(layer, missing[0])
            raise
        finally:
            self.done.append(req)  # unpinned by the next message

    def _reads_own(self, layer: int, missing: list[int]) -> bool:
        """Read these misses here: lent slabs for all of them, no guess to send with a Fetch,
        none of them being read by the reader already (a guess, a warm start's read: a Fetch
        waits for that read instead of making a second), and the reader alive (a slab lent by
        a reader that died may be a new reader's)."""
        return (
            self.lent is not None
            and len(missing) <= len(self.spares)
            and not (self.guess and self.guess[1])
            and not self.index.reading(layer, missing)
            and pid_alive(self.reader_pid)
        )

    def _read_own(self, layer: int, ids: list[int], slabs: list[int], missing: list[int]) -> Iterator[Expert]:
        """A layer's misses read by this process into lent slabs, the hits computed meanwhile
        (compute.overlap), each miss as it lands; a miss whose read failed goes to the reader
        (which reports the fault and fails the request, or reads it)."""
        lent = cast(LentReads, self.lent)
        for e in missing:
            lent.submit((layer, e), self.spares.pop())
        failed: list[int] = []

        def read() -> tuple[int, int] | None:
            t0 = time.perf_counter()
            result = lent.next_result()
            self.stall_s += time.perf_counter() - t0  # the flash wait overlap did not hide
            e, slab = self._own_result(result, failed)
            return (e, slab) if slab >= 0 else None

        try:
            yield from self._as_they_land(layer, ids, slabs, len(missing), read)
        finally:
            for result in lent.drain():  # left early: the reads under way end before their slabs are reused
                self._own_result(result, failed)
        for e in failed:
            yield from self._fetch_group(layer, [e], own=False)

    def _as_they_land(
        self, layer: int, ids: list[int], slabs: list[int], n_missing: int, land: Callable[[], tuple[int, int] | None]
    ) -> Iterator[Expert]:
        """The hits (slab >= 0) at once, then each of the `n_missing` misses as `land()` hands
        it over ((expert, slab), None for one whose read failed); without compute.overlap, the
        whole set in routing order once every miss has landed (kept for comparison)."""
        landed: dict[int, int] = {}
        if self.overlap:
            for e, s in zip(ids, slabs):
                if s >= 0:
                    self.poll()
                    yield self._view(layer, e, s)
        for _ in range(n_missing):
            got = land()
            if got is None:
                continue
            landed[got[0]] = got[1]
            if self.overlap:
                self.poll()
                yield self._view(layer, *got)
        if not self.overlap:
            for e, s in zip(ids, slabs):
                if s >= 0 or e in landed:
                    self.poll()
                    yield self._view(layer, e, s if s >= 0 else landed[e])

    def _own_result(self, result, failed: list[int]) -> tuple[int, int]:
        """Count one of this process's reads; (expert, slab), or slab -1 when it failed (its slab is spare again)."""
        (layer, expert), slab, io_ns, error = result
        if error is not None:
            log.info("this process's read of expert %s failed (%s): asking the reader", (layer, expert), error)
            self.spares.append(slab)
            failed.append(expert)
            return expert, -1
        self.misses += 1
        self.io_ns += io_ns
        self.read_bytes += self.layout.expert_bytes(layer)
        self.own[(layer, expert)] = slab
        self.installed.append((layer, expert, slab))
        return expert, slab

    def _send_spares(self, returned: Sequence[int] = ()) -> None:
        """The token's end when this process reads its own misses: a Spares (a Release, its reads, slabs to lend)."""
        req, self.next_req = self.next_req, self.next_req + 1
        want = 0 if returned else self.spare_target - len(self.spares)
        msg = m.Spares(req, want, tuple(self.done), tuple(self.touched), tuple(self.installed), tuple(returned))
        ipc.send(self.fetch_out, msg)
        self.done, self.touched, self.installed = [], [], []
        self.messages += 1
        self.unsettled, self.unsettled_by = req, m.SpareSlabs

    def give_back_spares(self) -> None:
        """Before the cache's size changes: the lent slabs back to the reader (and this
        token's reads into the index), so that every slab is the reader's to hold or give."""
        self._settle()
        if self.spares or self.installed:
            spares, self.spares = self.spares, []
            t0 = time.perf_counter()
            self._send_spares(returned=spares)
            self._settle()
            self.wire_s += time.perf_counter() - t0

    def _send_fetch(self, layer: int, missing: list[int], resident: list[int]) -> int:
        """One Fetch: this layer's misses and hits, what is done and touched since the last message, the guess."""
        req, self.next_req = self.next_req, self.next_req + 1
        ipc.send(
            self.fetch_out, m.Fetch(req, layer, tuple(missing), tuple(resident), tuple(self.done), tuple(self.touched), *self._take_guess())
        )
        self.done, self.touched = [], []
        self.messages += 1
        if not missing:
            self.unsettled, self.unsettled_by = req, m.Guessed  # a Fetch of guesses only: answered by one Guessed
        return req

    def _barrier(self, layer: int, expert: int) -> None:
        """This Fetch is left before all its answers came (a Stop, a failed
        read): the reader may still be admitting its misses, evicting for them,
        while compute's next request reads the index. A Fetch of guesses only,
        of an expert that Fetch admitted (so the guess reads nothing), is
        answered by a Guessed once the reader has handled both, in order, and
        the next index read waits for that Guessed (`_settle`)."""
        req, self.next_req = self.next_req, self.next_req + 1
        ipc.send(self.fetch_out, m.Fetch(req, layer, (), (), tuple(self.done), tuple(self.touched), layer, (expert,)))
        self.done, self.touched = [], []
        self.messages += 1
        self.unsettled, self.unsettled_by = req, m.Guessed

    def abandon(self) -> None:
        """A pass ended half way (a Stop, a failed read): its guess is dropped and
        the reader hears at once which fetches are done (their pins go), unless
        it is the reader that is gone."""
        self.guess = None
        if pid_alive(self.reader_pid):
            try:
                self.end_step()
            except ipc.PeerTimeout:
                pass

    def _settle(self) -> None:
        """Wait for the Guessed of a Fetch that carried only guesses, or the SpareSlabs of a
        Spares: until it comes, the reader may still be evicting for them."""
        if self.unsettled:
            t0 = time.perf_counter()
            req, self.unsettled = self.unsettled, 0
            answer = self._next_answer(req, self.unsettled_by)
            if isinstance(answer, m.SpareSlabs):
                self.spares.extend(answer.slabs)
                self.own.clear()  # in the index now (or the reader's own copy is)
            self.wire_s += time.perf_counter() - t0

    def _take_guess(self) -> tuple[int, tuple[int, ...]]:
        if self.guess is None:
            return 0, ()
        (layer, ids), self.guess = self.guess, None
        if ids:
            self.predicted[layer] = set(ids)
            self.prefetch_issued += len(ids)
        return layer, tuple(ids)

    def room_for(self, positions: int, rows: int = 1) -> None:
        """Before a pass of `rows` rows writes the KV cache up to `positions`: the cache gives
        back the slabs the KV cache lent it that those positions need (and some positions
        ahead, so this is rare; kept back after) and those the pass's activations need of the
        prompt's loan, or has the prompt's loan again when the pass is small; the reader has
        freed the pages given back when this returns."""
        kv = self.kv_held
        if self.loan.lent_slabs and self.loan.slabs_at(positions) < kv:
            kv = self.loan.slabs_at(positions + self.loan.ahead)
        want = kv - self.prompt_loan.slabs_for(rows, self.withheld)
        if want == self.usable:
            return
        if want < self.usable:
            for p in self.fillers:  # a populate running yet would take the given-back pages again
                p.stop()
        self.give_back_spares()
        t0 = time.perf_counter()
        req, self.next_req = self.next_req, self.next_req + 1
        ipc.send(self.fetch_out, m.CacheLimit(req, want))
        self.messages += 1
        self._next_answer(req, m.CacheLimited)
        self.wire_s += time.perf_counter() - t0
        if kv < self.kv_held:
            log.info("the KV cache took back %d of the %d slabs it lent (%d positions)", self.n_slabs - kv, self.loan.lent_slabs, positions)
        self.usable, self.kv_held = want, kv

    @property
    def held_together(self) -> int:
        """A call's experts are fetched, and pinned, a group the cache may hold now at a time
        (less the slabs lent to this process)."""
        return max(1, self.usable - self.spare_target)

    def lend(self) -> None:
        """This process is warm (its kernels compiled): the prompt's loan is the cache's, but
        for what this process's own pages take above their estimate."""
        if not self.prompt_loan.lent_slabs:
            return
        self.withheld = self.prompt_loan.withheld_for(heap.private_bytes())
        if self.withheld:
            log.info("of the prompt's loan, %d slabs stay with this process's own pages (above its estimate)", self.withheld)
        self.room_for(0, 0)

    def end_step(self) -> None:
        """The token is done (or its last layer's experts are): one Release for its fetches and
        the hits the reader has not heard of (none when nothing happened), or, when this process
        read misses itself or holds fewer lent slabs than it keeps, one Spares instead."""
        if self.lent is not None and not self.unsettled and (self.installed or len(self.spares) < self.spare_target):
            t0 = time.perf_counter()
            self._send_spares()  # answered before the next index read (_settle)
            self.wire_s += time.perf_counter() - t0
        elif self.done or self.touched:
            t0 = time.perf_counter()
            ipc.send(self.fetch_out, m.Release(tuple(self.done), tuple(self.touched)))
            self.done, self.touched = [], []
            self.messages += 1
            self.wire_s += time.perf_counter() - t0

    def _next_ready(self, req: int) -> m.Ready:
        t0 = time.perf_counter()
        msg = self._next_answer(req, m.Ready)
        waited = time.perf_counter() - t0
        if msg.hit:
            self.hits += 1
            self.wire_s += waited  # answered at once: messaging latency only
        else:
            self.misses += 1
            self.stall_s += waited  # the flash wait overlap did not hide
            self.io_ns += msg.io_ns
            self.read_bytes += self.layout.expert_bytes(msg.layer)
        return msg

    def _next_answer(self, req: int, want: type):
        """The reader's next answer of type `want` (Ready, Guessed, CacheLimited, SpareSlabs) to request `req`."""
        while True:
            msg = ipc.recv(self.ready_in, PEER_POLL_MS, expect=(m.Ready, m.FetchFailed, m.Guessed, m.CacheLimited, m.SpareSlabs))
            if msg is None:
                if not pid_alive(self.reader_pid):
                    raise GenerationAborted(m.Code.PEER_GONE, "the reader process died")
                continue
            if isinstance(msg, (m.Ready, m.Guessed)):  # reads of guesses that landed unasked: this token's too
                self.read_bytes += msg.guess_bytes
                self.io_ns += msg.guess_io_ns
            if msg.req_id != req:  # a late answer to an abandoned request
                continue
            if isinstance(msg, m.FetchFailed):
                raise GenerationAborted(msg.code, f"expert {msg.expert} of layer {msg.layer}: {msg.error}")
            if isinstance(msg, want):
                return msg

    def resident(self, layer: int, ids: Sequence[int]) -> list[bool]:
        """Which of these experts are cached now (for the lossy levers)."""
        return [s >= 0 for s in self.index.slabs(layer, ids)]

    def resident_bytes(self) -> int:
        """Expert bytes in the cache now, by the residency index (0: not resident; ~10 µs for 48 × 128 entries)."""
        return int(((self.index.table > 0).sum(axis=1) * self.layer_bytes).sum())

    def _view(self, layer: int, expert: int, slab: int) -> Expert:
        """The expert's weights as views into its slab. A view stays valid while
        the expert stays in that slab, so views are kept per (layer, expert)
        and rebuilt only when it has moved to another slab."""
        t0 = time.perf_counter()
        cached = self.views.get((layer, expert))
        if cached is None or cached[0] != slab:
            lay = self.layout.layers[layer]
            view = expert_view(lay, expert, self.arena.slab(slab), placement_for(lay.extents(expert), self.layout.align))
            cached = self.views[(layer, expert)] = (slab, view)
        self.mgmt_s += time.perf_counter() - t0
        return cached[1]


def _dense_view(config: Config, facts: RunFacts, mf):
    """Where compute reads dense tensors, per io.dense_weights."""
    if config.io.dense_weights == "anon":
        arena = Arena.attach(facts.dense_arena, readonly=True)
        return arena, arena_views(mf.gguf, mf.layout, arena.buf)
    if config.io.dense_weights == "warm":
        warm_sweep(mf.gguf.paths, mf.layout.dense)
    return None, arena_views(mf.gguf, mf.layout, None)  # the file mapping, the by-row tensors a page at a time


def model_options(c: ComputeConfig, routes: RouteCount | RouteTracer | None, mf, watch: PromptWatch | None = None) -> ModelOptions:
    """How the model runs, from the [compute] table: prefetch, the lossy levers, route replay, the KV cache's type;
    every routing shown to `routes` (the expert uses counted, the route trace written), stages timed (a
    row's attention_ms) and every layer shown to `watch` (a prompt's progress and Stop)."""
    return ModelOptions(
        prefetch_next=c.prefetch == "next-layer",
        prefetch_prompt=c.prefetch in ("prompt", "next-layer"),
        levers=Levers(c.drop_cold_experts, c.cache_route, c.route_ahead),
        route_observer=routes,
        route_replay=RouteReplay(read_trace(str(c.route_replay)), mf.spec) if c.route_replay else None,
        kv_type=c.kv_type,  # the model's new_cache stores K and V as the config says
        # two clock reads a stage, five stages a layer: ~0.1 ms a token on 48 layers, 0.1 % of a qwen30b-shape token
        stage_timing=True,
        layer_observer=watch.layer_done if watch is not None else None,
    )


def serve(config: Config, facts: RunFacts, ctx: zmq.Context) -> None:
    c = config.compute
    quant.one_blas_thread()
    # before this process starts work of its own; its parent's and siblings' start-up is not other work
    cores = choose_threads(c.threads, most=quant.most_threads(), engine=os.getppid())
    quant.set_threads(cores.threads)
    log.info(cores.line())
    ep = ipc.Endpoints(Path(facts.runtime_dir))
    requests = ipc.bind(ctx, ep, "requests")
    tokens_out = ipc.connect(ctx, ep, "tokens")
    fetch_out = ipc.connect(ctx, ep, "fetch")
    ready_in = ipc.bind(ctx, ep, "ready")
    telemetry = ipc.DroppingSender(ipc.connect(ctx, ep, "telemetry_in"))
    mf = open_model(facts.model_path, facts.io_align or None)
    if facts.model_identity and model_identity(mf.gguf.paths) != tuple(facts.model_identity):
        # A restart after the file was replaced: its tokenizer and shapes beside the
        # old file's dense set and cached experts would give wrong answers, quietly.
        mf.close()
        raise ModelChanged(
            facts.model_path,
            "is not the file this service started with (changed or replaced since); put the original back or restart the service",
        )
    dense_arena, view = _dense_view(config, facts, mf)
    interrupts = Interrupts(requests)

    def progress(p: PromptProgress) -> None:  # to the request's client, and to tails through telemetry
        msg = m.PromptProgress(interrupts.req_id, p.total, p.cache, p.processed, p.time_ms)
        ipc.send(tokens_out, msg)
        telemetry.send(msg)

    watch = PromptWatch(mf.spec.n_layer, progress, interrupts.check)
    source = SlabExperts(
        facts,
        c.overlap,
        mf.layout,
        fetch_out,
        ready_in,
        poll=watch.poll,
        kv_type=c.kv_type,
        top_k=c.n_expert_used,
        lent_reads=lent_slabs(
            config.io.compute_reads,
            facts.n_slabs - facts.prompt_lent_slabs,
            experts_per_token(mf.spec, c.n_expert_used),
            len(mf.spec.moe_layers) * mf.spec.n_expert,
        ),
        lanes=config.io.io_threads,
        paths=mf.gguf.paths,
    )
    # First use of a page of either arena is a fault inside a token's compute:
    # take them now, on a thread (the dense set first: every token reads all of it).
    arenas = [(dense_arena, "dense set"), (source.arena.arena, "slab cache")] if config.io.populate else []
    # Of the slab cache, the slabs it holds now: the prompt's loan has no pages until it is lent.
    ends = {"slab cache": source.usable * facts.slab_bytes}
    populators = [Populator(a, end=ends.get(w), what=w).start() for a, w in arenas if a is not None]
    source.fillers = [p for p in populators if p.arena is source.arena.arena]
    route_trace = config.telemetry.route_trace
    tracer = RouteTracer(str(route_trace), mf, c.n_expert_used, source.resident) if route_trace else None
    routes = RouteCount(tracer)
    model = load_model(mf, top_k=c.n_expert_used, experts=source, dense_view=view, options=model_options(c, routes, mf, watch))
    tok = Tokenizer.from_gguf(mf.gguf)
    metered = MeteredModel(model, source, telemetry, interrupts, tracer, watch, routes)
    # The KV cache and the ids it holds, kept between requests (prefix reuse, slots);
    # a session file is bound to the model file's identity.
    session, identity = Session(), tuple(facts.model_identity) or model_identity(mf.gguf.paths)
    # Every kernel compiled (or loaded from numba's cache) before the Hello, so no
    # request's timings include a compile; the front end shows the progress.
    steps = kernel_steps(mf, forward_pass(mf, c.n_expert_used, view, c.kv_type))
    warm = warm_up(steps, lambda i, n, item: ipc.send(tokens_out, m.Progress(STAGE, i, n, item)))
    ipc.send(tokens_out, m.Progress(STAGE, warm.steps, warm.steps, "", warm.seconds, warm.compiled))
    # Compiling takes a few hundred MiB (LLVM) that the heap would otherwise keep: given back
    # before the heap starts keeping a prompt's arrays, and before the prompt's loan is lent.
    heap.give_back()
    log.info(heap.keep_freed_memory())
    late = CompileCounter().__enter__()  # for the life of the process: compiles a request still paid for
    epoch = time.time_ns()
    front_end = FrontEndWatch(tokens_out)
    ipc.send(fetch_out, m.Hello("compute", os.getpid(), epoch))  # the reader drops a dead compute's pins
    source.lend()  # warm: the prompt's loan is the cache's
    ipc.send(tokens_out, m.Hello("compute", os.getpid(), epoch))  # the front end can send requests
    try:
        if config.gateway.parallel > 1:  # several requests at once, one batched pass a step
            from .slots import Slots

            Slots(config, metered, tok, tokens_out, interrupts, front_end, identity, late).serve(facts.reader_pid, epoch)
            return
        while not interrupts.shutdown:
            if front_end.came_back():
                ipc.send(tokens_out, m.Hello("compute", os.getpid(), epoch))  # a restarted gateway missed the first
            msg = interrupts.pending.pop(0) if interrupts.pending else _next_request(requests, facts.reader_pid)
            if isinstance(msg, m.Shutdown):
                return
            if isinstance(msg, m.Slot):
                if msg.action == "restore":  # a restored session's KV cache is written without a pass
                    source.room_for(c.ctx_size)
                ipc.send(tokens_out, handle_slot(msg, session, model, c.ctx_size, identity))
            elif isinstance(msg, m.Generate):
                interrupts.req_id = msg.req_id
                try:
                    handle(msg, metered, tok, config, tokens_out, late, session)
                finally:
                    interrupts.req_id = 0
                    heap.give_back()  # a prompt's freed pages, kept for its layers (shared/heap.py)
    finally:
        front_end.close()
        for p in populators:
            p.stop()
        if tracer:
            tracer.close()
        source.arena.close()
        source.index.close()
        if dense_arena is not None:
            dense_arena.close()
        mf.close()


def _next_request(requests: zmq.Socket, reader_pid: int) -> m.Generate | m.Slot | m.Shutdown | None:
    """The next request; while idle, also notice a dead reader and end this
    process (its supervisor restarts both; a later request would only fail)."""
    try:
        msg = ipc.recv(requests, PEER_POLL_MS, expect=(m.Generate, m.Slot, m.Shutdown, m.Cancel))
    except m.ProtocolError as exc:
        log.warning("dropped a bad frame: %s", exc)
        return None
    if msg is None and not pid_alive(reader_pid):
        raise GenerationAborted(m.Code.PEER_GONE, "the reader process died")
    return msg if isinstance(msg, (m.Generate, m.Slot, m.Shutdown)) else None  # a Cancel for a request already done


def handle_slot(req: m.Slot, session: Session, model, ctx_size: int, identity: tuple[str, ...]) -> m.Done:
    """Save, restore or erase the session (compute.ctx_size bounds a restored one); a refused file is the request's fault."""
    try:
        return m.Done(req.req_id, True, timings=dict(slot_action(session, req.action, req.path, model, ctx_size, identity)))
    except UserError as exc:
        return m.Done(req.req_id, False, code=m.Code.BAD_ARGUMENT, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug fails this request, and the session is not trusted after it
        log.exception("slot %s failed", req.action)
        session.reset()
        return m.Done(req.req_id, False, code=m.Code.INTERNAL, error=f"{type(exc).__name__}: {exc}")


def request_settings(req: m.Generate, config: Config, tok):
    """The request's sampling, its GenerationConfig and its grammar's constraint (None: free text);
    UserError or TypeError for settings that are its fault."""
    params = SamplingParams(**cast(dict[str, Any], req.sampling))  # values checked by SamplingParams itself
    gen_cfg = GenerationConfig(
        max_tokens=req.max_tokens,
        stop=tuple(req.stop),
        n_ctx=config.compute.ctx_size,
        prefill_batch=config.compute.prefill_tokens,
        ignore_eos=req.ignore_eos,
        cache_prompt=req.cache_prompt,
        context_shift=config.generate.context_shift,
        n_keep=config.generate.n_keep,
        draft=config.compute.draft if req.draft == m.DRAFT_FROM_CONFIG else req.draft,
        draft_adapt=config.compute.draft_adapt,
    )
    constraint = None
    if req.grammar:  # response_format: llguidance loads only in a compute that serves one
        from ..shared.text.constrain import constraint_for

        constraint = constraint_for(tok, req.grammar)
    return params, gen_cfg, constraint


def request_figures(records: Sequence[m.TokenRecord]) -> dict[str, m.Scalar]:
    """A request's Done figures summarised from its token records (docs/telemetry.md § Run summary),
    but load_seconds and budget_mib: those are the front end's to know (procs/pipeline.py)."""
    from ..shared.telemetry import ResourceMeter, summarize

    if not records:
        return {}
    summary = summarize(records, 0.0, 0, None, ResourceMeter.peak_rss_bytes())
    return {k: v for k, v in m.as_dict(summary).items() if k not in ("load_seconds", "budget_mib")}


def handle(
    req: m.Generate,
    metered: MeteredModel,
    tok,
    config: Config,
    out: zmq.Socket,
    late: CompileCounter | None = None,
    session: Session | None = None,
) -> None:
    try:
        params, gen_cfg, constraint = request_settings(req, config, tok)
    except (UserError, TypeError) as exc:  # a setting it lacks or of the wrong kind: the request's fault, not this process's
        ipc.send(out, m.Done(req.req_id, False, code=m.Code.BAD_ARGUMENT, error=f"bad request: {exc}"))
        return

    def on_text(text: str) -> None:
        ipc.send(out, m.Token(req.req_id, text))

    compiles = late.count if late else 0
    metered.begin(req.req_id)
    try:
        session = session if session is not None else Session()
        source = config.compute.draft_source if gen_cfg.draft else "none"  # the MTP block loads only for a request that drafts
        drafter = drafter_for(
            source,
            config.compute.draft_replay,
            metered.model.spec.n_vocab,
            metered.model,
            session,
            gen_cfg.n_ctx,
            config.compute.draft_vocab,
        )
        result = generate(
            metered, tok, list(req.prompt_tokens), params, gen_cfg, on_text=on_text, session=session, constraint=constraint, drafter=drafter
        )
    except GenerationAborted as exc:
        ipc.send(out, m.Done(req.req_id, False, code=str(exc.code), error=str(exc)))
        if exc.code == m.Code.PEER_GONE:
            raise
        return
    except UserError as exc:  # the request's own fault (a prompt over the context, bad sampling values)
        ipc.send(out, m.Done(req.req_id, False, code=m.Code.BAD_ARGUMENT, error=str(exc)))
        return
    except Exception as exc:  # noqa: BLE001 - a bad request fails that request
        log.exception("generation failed")
        if session is not None:
            session.reset()  # a bug's leftovers are not reused
        ipc.send(out, m.Done(req.req_id, False, code=m.Code.INTERNAL, error=f"{type(exc).__name__}: {exc}"))
        return
    metered.finish()
    timings = {**result.timings, **request_figures(metered.records), "late_compiles": (late.count if late else 0) - compiles}
    ipc.send(
        out,
        m.Done(
            req.req_id,
            True,
            result.finish_reason,
            tuple(result.tokens),
            {k: v for k, v in timings.items() if isinstance(v, (int, float, str, bool))},
        ),
    )


def main(config: Config, facts: RunFacts) -> None:
    child_setup("compute")
    with ipc.context() as ctx:
        serve(config, facts, ctx)
