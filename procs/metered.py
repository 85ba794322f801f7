"""The model in the compute process, metered: one TokenRecord per generated
token to telemetry (docs/telemetry.md), and the request's first pass, its
prompt's, watched (shared/model/prompt_watch.py: its progress, a Stop
mid-prompt). A pass that stops half way leaves the session consistent
(`MeteredModel._abandon`)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from ..shared import heap
from ..shared.model.prompt_watch import PromptWatch
from ..shared.model.routes import RouteTracer
from ..shared.telemetry import ResourceMeter
from ..shared.wire import ipc
from ..shared.wire import messages as m

if TYPE_CHECKING:
    from ..shared.model.moe import Routing
    from .compute import Interrupts, SlabExperts


class RouteCount:
    """The model's route observer in compute: counts a pass's expert uses, the (row, expert)
    pairs its routers chose, and hands each routing on to the route tracer, if any. A layer
    asks its expert source once for the distinct experts of all its rows, so the uses beyond
    those lookups are served by another row's: the record's `experts_shared`."""

    def __init__(self, tracer: RouteTracer | None = None):
        self.tracer = tracer
        self.uses = 0

    def __call__(self, layer: int, routing: Routing) -> None:
        self.uses += routing.ids.size  # [T, K]: each row's choices, distinct within a row
        if self.tracer is not None:
            self.tracer(layer, routing)


class MeteredModel:
    """The model, metered: one TokenRecord per generated token to telemetry
    (step 1 = the prefill that produced it, then one decode each); the
    request's first pass, its prompt's, watched (`watch`: progress, Stop)."""

    def __init__(
        self,
        model,
        source: SlabExperts,
        telemetry: ipc.DroppingSender,
        interrupts: Interrupts | None = None,
        tracer: RouteTracer | None = None,
        watch: PromptWatch | None = None,
        routes: RouteCount | None = None,
    ):
        """`tracer`: the route tracer the model was built with (inside its
        `route_observer`), told here where each turn and phase begins; `watch`:
        the model's layer observer (its `layer_observer`), armed for each prompt;
        `routes`: the model's route observer, counting expert uses (none: no
        `experts_shared`)."""
        self.model, self.source, self.telemetry, self.interrupts = model, source, telemetry, interrupts
        self.tracer, self.watch, self.routes = tracer, watch, routes
        self.meter = ResourceMeter()
        self.records: list[m.TokenRecord] = []
        self.total_hits = self.total_misses = 0
        self.req_id = 0
        self._held: m.TokenRecord | None = None  # a verify pass's record, until its kept drafts are known
        self.passes = 0  # batched passes of several slots so far (forward_batch)

    def begin(self, req_id: int = 0) -> None:
        """A new request: its own records and counters, a new turn in the route trace."""
        self.finish()
        self.records, self.total_hits, self.total_misses, self.req_id = [], 0, 0, req_id
        self.meter.delta()
        if self.tracer:
            self.tracer.begin_turn()

    def new_cache(self, n_ctx):
        return self.model.new_cache(n_ctx)

    def prefill(self, tokens, cache, batch=64):
        if self.tracer:
            self.tracer.phase = 0
        # The request's first pass is its prompt's (the uncached part); a later one is a context shift's.
        prompt = self.watch is not None and not self.records
        try:
            return self._step(
                lambda: self.model.prefill(tokens, cache, batch=batch), cache, len(tokens), prompt, rows=min(len(tokens), batch)
            )
        finally:
            # The chunk's arrays the heap kept for its layers (shared/heap.py) go back before the
            # reply's tokens: a dense set read through the file mapping needs those pages.
            heap.give_back()

    def decode_one(self, token, cache):
        if self.tracer:
            self.tracer.phase = 1
        return self._step(lambda: self.model.decode_one(token, cache), cache, 1)

    def verify(self, tokens, cache, redo: int = 0):
        """A decoded token and its drafts in one pass (shared/text/speculate.py): one record, its drafts counted as `drafted`."""
        if self.tracer:
            self.tracer.phase = 1
        return self._step(
            lambda: self.model.verify(tokens, cache, redo), cache, len(tokens), drafted=max(len(tokens) - 1 - redo, 0), rows=len(tokens)
        )

    def drafts_judged(self, drafted: int, kept: int) -> None:
        """The last verify pass's drafts are settled (shared/text/speculate.py): its record goes out with them."""
        if self._held is not None:
            self._send(dataclasses.replace(self._held, accepted=kept))

    def finish(self) -> None:
        """The request is over: a record still held goes out as it is."""
        if self._held is not None:
            self._send(self._held)

    def _send(self, rec: m.TokenRecord) -> None:
        self._held = None
        self.records.append(rec)
        self.telemetry.send(rec)

    def _step(self, fn, cache, n_tokens: int, prompt: bool = False, drafted: int = 0, rows: int = 1):
        self.finish()  # a held record whose drafts were never judged (an interrupted pass)
        if self.interrupts is not None:
            self.interrupts.check()
        self._reset_counters()
        t0 = time.perf_counter()
        # The loans (docs/architecture.md): the KV cache's before the pass writes there, the prompt's
        # before a pass of many rows, and the prompt's back to the cache before a small one.
        self.source.room_for(cache.n + n_tokens, rows)
        try:
            if prompt and self.watch is not None:
                self.watch.begin(cache.n + n_tokens, cache.n, cache)  # the opening event, processed == cached
            out = fn()
        except BaseException:
            self._abandon(cache, prompt)
            raise
        if prompt and self.watch is not None:
            self.watch.end()  # the closing event, processed == total: before any text of this request
        self.source.end_step()
        rec = self._record(time.perf_counter() - t0, n_tokens, drafted)
        if drafted:
            self._held = rec
        else:
            self._send(rec)
        return out

    def forward_batch(self, parts, req_ids, prompt=None, layers: int | None = None) -> tuple[list, m.TokenRecord]:
        """One pass over several slots' rows (procs/slots.py): its logits and one
        TokenRecord for the pass, named after its first request (`req_ids`, one per part,
        then the prompt's), `pass_tokens` its rows. `prompt`, `layers`: a chunk that goes
        through its next `layers` layers beside them (shared/model/batch.py PromptSlice).
        The record goes to telemetry, not to `records`: a pass is no one request's step
        (each slot keeps the records of the passes it was in). A pass that stops half way
        leaves each recurrent state it touched empty."""
        self._reset_counters()
        t0 = time.perf_counter()
        caches = [p.cache for p in parts] + ([prompt.cache] if prompt is not None else [])
        try:
            out = self.model.forward_batch(parts, prompt=prompt, layers=layers)
        except BaseException:
            for c in caches:
                if getattr(c, "state", None) is not None:
                    c.truncate(0)
            self.source.abandon()
            raise
        self.source.end_step()
        self.passes += 1
        self.req_id = req_ids[0]
        rows = sum(len(p.tokens) for p in parts) + (len(prompt.tokens) if prompt is not None else 0)
        rec = dataclasses.replace(self._record(time.perf_counter() - t0, rows, 0), step=self.passes)
        self.telemetry.send(rec)
        return out, rec

    def _reset_counters(self) -> None:
        self.source.reset_counters()
        if self.routes is not None:
            self.routes.uses = 0
        self.model.stage.reset()

    def _record(self, wall: float, n_tokens: int, drafted: int) -> m.TokenRecord:
        s = self.source
        self.total_hits += s.hits
        self.total_misses += s.misses
        lookups = self.total_hits + self.total_misses
        res = self.meter.delta()
        return m.TokenRecord(
            step=len(self.records) + 1,
            wall_ms=wall * 1e3,
            compute_ms=max(wall - s.stall_s - s.mgmt_s - s.wire_s, 0.0) * 1e3,
            io_ms=s.io_ns / 1e6,
            read_bytes=s.read_bytes,
            cache_hit_pct=100.0 * self.total_hits / lookups if lookups else 0.0,
            stall_ms=s.stall_s * 1e3,
            mgmt_ms=s.mgmt_s * 1e3,
            majflt=res.majflt,
            cpu_ms=res.cpu_ms,
            hits=s.hits,
            misses=s.misses,
            prefetch_issued=s.prefetch_issued,
            prefetch_used=s.prefetch_used,
            prefetch_wasted_bytes=s.prefetch_wasted_bytes,
            prefetch_paused=s.prefetch_paused,
            wire_ms=s.wire_s * 1e3,
            messages=s.messages,
            rss_bytes=self.meter.rss_bytes(),
            req_id=self.req_id,
            resident_bytes=s.resident_bytes(),
            attention_ms=self.model.stage.seconds.get("attention", 0.0) * 1e3,
            pass_tokens=n_tokens,
            drafted=drafted,
            # each layer looked up the distinct experts of its rows once: hits + misses
            experts_shared=self.routes.uses - s.hits - s.misses if self.routes is not None else 0,
            cache_slabs=s.usable,
        )

    def _abandon(self, cache, prompt: bool) -> None:
        """A pass that stopped half way (a Stop, a failed read). The KV cache
        counts none of it (shared/model/session.py), but a hybrid model's
        recurrent state was updated in place by the layers that ran: a prompt's
        goes back to its last chunk's end (the watch's copy); any other pass's
        cannot, so the cache starts over, consistent and empty."""
        if prompt and self.watch is not None:
            self.watch.abort()
        elif getattr(cache, "state", None) is not None:
            cache.truncate(0)
        self.source.abandon()
