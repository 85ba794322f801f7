"""Compute's slots: up to gateway.parallel requests decoded at once (docs/batching.md).

Each request in a slot runs shared/text/generate.py's `generate` as it does
alone (its sampler and seed, stop strings, token limit, prefix reuse against
the slot's own session, context shift) on a thread of its own, against a
`SlotModel` whose passes do not run by themselves: each asks `Steps` for a
place in the next step and waits. The serving loop, on the process's main
thread (which owns every socket), runs a step once every busy slot has asked:

  1. take what came on the requests link: a Generate takes an idle slot (the
     one whose cached ids share the longest prefix with its prompt; when another
     slot, idle or busy, holds a longer one, it takes those KV rows into the
     slot first, by reference: `share_prefix`), a Cancel ends its slot's request, a Slot
     action waits until every slot is idle and acts on its slot's session;
  2. one `forward_batch` over one decode row of every decoding slot (a
     drafting slot's token and its drafts: `SlotModel.verify`) and at
     most one chunk of a prompt (the oldest request's; compute.prefill_chunk
     tokens, else SLOT_PREFILL_CHUNK) through its next few layers (`Pace`: as
     many as take about what the decode rows' own pass takes; about a second's
     when nothing decodes), its hidden state kept for the next step (`Sliced`), so a
     long prompt holds a decoding slot for a few layers of a chunk between
     tokens; each slot gets its logits row and goes on alone;
  3. the slots' Token, PromptProgress and Done frames go out in the order they
     were made; what each slot is doing goes to telemetry (SlotStates, for tails
     and the web page) as a slot changes state and every SLOT_STATES_S between.

The kernels are batch-exact, so a slot's tokens are those of its request
served alone; a slot whose request ends (stop, length, cancel, a failure)
leaves the next step without disturbing the others. Python runs one thread at
a time: a slot thread only samples and decodes text between steps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import zmq

from ..shared import heap
from ..shared.config import SLOT_PREFILL_CHUNK, Config
from ..shared.errors import UserError
from ..shared.model.batch import BatchPart, PromptSlice
from ..shared.model.blocks import KVCache
from ..shared.model.kv_pool import KVPoolFull, Room, Use, make_room
from ..shared.model.session import Session, common_prefix
from ..shared.telemetry import merge_records
from ..shared.text.generate import generate, reuse_align
from ..shared.text.speculate import Drafter, drafter_for
from ..shared.wire import ipc
from ..shared.wire import messages as m
from .compute import GenerationAborted, Interrupts, _next_request, handle_slot, request_figures, request_settings
from .lifecycle import FrontEndWatch
from .metered import MeteredModel
from .warmup import CompileCounter

log = logging.getLogger("moe_pipe.compute")
WAIT_S = 0.02  # the longest a busy loop waits for the slots before it looks at the requests link again
# The longest an arriving request waits for busy slots to ask for their next step, when one of them
# may hold a longer prefix of its prompt than its own slot: a slot's thread only samples between steps.
SHARE_WAIT_S = 0.5
SLOT_STATES_S = 0.25  # SlotStates between state changes: four a second, as a prompt's progress, is live enough to watch
# A prompt chunk's layers a step may take, beside decode rows, this share of the decode rows' own
# pass: a decoding slot then waits about (1 + SLICE_SHARE) times its undisturbed gap between tokens
# while a long prompt is read (issue 32's bound is 2x).
SLICE_SHARE = 0.9
PACE_WEIGHT = 0.3  # the weight of a step's newest wall in Pace's running figures
# With nothing decoding, a step takes about this long of a chunk's layers: a Stop, or a new
# request's first row, waits for the step that is running, not for the chunk's every layer.
ALONE_STEP_S = 1.0


def slot_prefill_chunk(config: Config) -> int:
    """The prompt chunk a step takes: compute.prefill_chunk if set, else SLOT_PREFILL_CHUNK at most."""
    c = config.compute
    return c.prefill_chunk or min(c.prefill_tokens, SLOT_PREFILL_CHUNK)


@dataclass
class Ask:
    """A slot's rows for the next step, and what the step gave back."""

    slot: int
    order: int  # its request's arrival: the oldest prompt's chunk goes first
    tokens: list[int]
    cache: KVCache
    all_logits: bool = False  # a decoded token and its drafts (a verify pass): every row's logits, not the last's
    logits: np.ndarray | None = None
    record: m.TokenRecord | None = None  # the pass's, shared by every row in it
    error: BaseException | None = None
    answered: bool = False


@dataclass
class Slot:
    """One slot: its session (KV cache and ids, kept between requests for prefix reuse) and its request."""

    id: int
    session: Session = field(default_factory=Session)
    req_id: int = 0  # the request it serves, or served last (busy or idle: Steps.busy)
    order: int = 0  # its request's arrival number (the last it served, when idle)
    thread: threading.Thread | None = None
    # its request's progress (SlotStates), written by its thread: the prompt's tokens, of them
    # reused from the cache and done (cache included), and the tokens generated so far
    total: int = 0
    cache: int = 0
    processed: int = 0
    decoded: int = 0
    # while its prompt runs: what posts a PromptProgress (SlotModel._progress), so a chunk
    # sliced by layers reports as it goes, not only once through the last layer
    post_progress: Callable[[int], None] | None = None


class Steps:
    """Where the slots' threads and the serving loop meet: a slot asks for its rows
    and waits; the loop waits until every busy slot has asked, runs the pass,
    answers. The frames the slots make wait in `outbox` for the loop to send."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.asks: dict[int, Ask] = {}
        self.busy: set[int] = set()
        self.cancelled: set[int] = set()
        self.outbox: deque[m.Message] = deque()

    def ask(self, slot: int, order: int, tokens: Sequence[int], cache: KVCache, all_logits: bool = False) -> Ask:
        """A slot's thread: its rows in the next step, answered: their last row's logits [V] (with
        `all_logits`, every row's [T, V]), the pass's record."""
        with self.cond:
            if slot in self.cancelled:
                raise GenerationAborted(m.Code.CANCELLED, "cancelled by the front end")
            a = self.asks[slot] = Ask(slot, order, [int(t) for t in tokens], cache, all_logits)
            self.cond.notify_all()
            self.cond.wait_for(lambda: a.answered)
        if a.error is not None:
            raise a.error
        assert a.logits is not None
        return a

    def post(self, msg: m.Message) -> None:
        with self.cond:
            self.outbox.append(msg)
            self.cond.notify_all()

    def join(self, slot: int) -> None:
        with self.cond:
            self.busy.add(slot)
            self.cancelled.discard(slot)

    def leave(self, slot: int) -> None:
        with self.cond:
            self.busy.discard(slot)
            self.cancelled.discard(slot)
            self.cond.notify_all()

    def cancel(self, slot: int) -> None:
        """The slot's request ends at its next ask; one waiting for a step ends now."""
        with self.cond:
            self.cancelled.add(slot)
            a = self.asks.pop(slot, None)
            if a is not None:
                self._answer(a, error=GenerationAborted(m.Code.CANCELLED, "cancelled by the front end"))

    def settle(self, timeout_s: float) -> tuple[set[int], set[int]]:
        """Until every busy slot has asked (or `timeout_s`): the busy slots and, of them, those
        waiting for a step. A waiting slot's thread holds still until the serving loop answers
        it, so its session (its committed positions and their ids) can be read meanwhile."""
        with self.cond:
            self.cond.wait_for(lambda: self.busy <= self.asks.keys(), timeout_s)
            return set(self.busy), self.busy & self.asks.keys()

    def gather(self, timeout_s: float) -> list[Ask]:
        """Until every busy slot has asked (or a frame waits to go out, or `timeout_s`): the asks so far."""
        with self.cond:
            self.cond.wait_for(lambda: self.outbox or (self.busy and self.busy <= self.asks.keys()), timeout_s)
            return list(self.asks.values()) if self.busy and self.busy <= self.asks.keys() else []

    def answer(
        self, a: Ask, logits: np.ndarray | None = None, error: BaseException | None = None, record: m.TokenRecord | None = None
    ) -> None:
        with self.cond:
            if self.asks.get(a.slot) is a:
                del self.asks[a.slot]
                self._answer(a, logits, error, record)

    def _answer(
        self, a: Ask, logits: np.ndarray | None = None, error: BaseException | None = None, record: m.TokenRecord | None = None
    ) -> None:
        a.logits, a.error, a.record, a.answered = logits, error, record, True
        self.cond.notify_all()

    def take_outbox(self) -> list[m.Message]:
        with self.cond:
            out, self.outbox = list(self.outbox), deque()
            return out


def slot_drafter(config: Config, draft: int, n_vocab: int) -> Drafter | None:
    """A slot's drafter for a request that drafts `draft` tokens: the n-gram one (or a benchmark's
    replay) as alone. The MTP block drafts only with one slot: it drafts from the hidden states of
    the model's own passes, which it follows for one session, so in a slot it drafts nothing."""
    source = config.compute.draft_source
    if not draft or (source == "mtp" and not config.compute.draft_replay):
        return None
    return drafter_for(source, config.compute.draft_replay, n_vocab)


def pick_rows(asks: Sequence[Ask]) -> tuple[list[Ask], Ask | None]:
    """A step's rows: every decode step's ask (one row, or a decoded token and its drafts); and
    the oldest request's prompt chunk."""
    chunks = [a for a in asks if len(a.tokens) > 1 and not a.all_logits]
    return [a for a in asks if len(a.tokens) == 1 or a.all_logits], min(chunks, key=lambda a: a.order, default=None)


@dataclass
class Sliced:
    """A prompt chunk on its way through the layers, a few a step (PromptSlice), and the ask it
    answers once through the last. `snap`: a recurrent state as it was before the chunk, put
    back when the request ends part way (the state has folded the chunk into the layers it
    went through, which the session's ids do not say)."""

    ask: Ask
    piece: PromptSlice
    snap: tuple | None
    records: list[m.TokenRecord] = field(default_factory=list)  # the passes it was in

    @classmethod
    def start(cls, ask: Ask) -> Sliced:
        state = ask.cache.state
        return cls(ask, PromptSlice(np.asarray(ask.tokens, np.int64), ask.cache), state.snapshot() if state is not None else None)

    def abandon(self) -> None:
        """The chunk goes no further: the cache as before it (its rows past the count are not counted anyway)."""
        cache = self.ask.cache
        if self.snap is not None and self.piece.next_layer > 0 and cache.state is not None:
            cache.rewind(cache.n, self.snap)


class Pace:
    """How many layers of a prompt's chunk a step takes beside decode rows: as many as fit in
    SLICE_SHARE of the decode rows' own pass, at least one; with no row decoding, as many as fit
    in ALONE_STEP_S (every layer left while a layer's cost is not known yet). Both figures are
    running means of the steps' walls: the decode rows' pass from steps without a chunk (until
    one comes, a first figure from a step with one, by its layers' own clocks: PromptSlice
    inside_s, outside_s), and a layer of the chunk as what a step with it took past that pass.
    The pace follows a chunk whose attention grows with its position, or whose experts come
    cached. How many layers a step takes never changes the output (PromptSlice)."""

    def __init__(self, share: float = SLICE_SHARE, alone_s: float = ALONE_STEP_S):
        self.share, self.alone_s = share, alone_s
        self.decode_s: float | None = None  # the decode rows' pass alone
        self.layer_s: float | None = None  # what one layer of a chunk adds

    def layers(self, decoding: bool, left: int) -> int:
        if not decoding:
            return left if not self.layer_s else max(1, min(left, int(self.alone_s / self.layer_s)))
        if self.decode_s is None or not self.layer_s:
            return 1
        return max(1, min(left, int(self.share * self.decode_s / self.layer_s)))

    def took(self, wall_s: float, decoding: bool, layers: int = 0, inside_s: float = 0.0, outside_s: float = 0.0, rest: int = 0) -> None:
        """A step's wall; with a chunk, its `layers` layers' seconds (`inside_s`) and the `rest`
        layers' the decode rows ran alone (`outside_s`)."""
        if not layers:
            if decoding:
                self.decode_s = _mean(self.decode_s, wall_s)
            return
        if not decoding:
            self.layer_s = _mean(self.layer_s, inside_s / layers)
            return
        if self.decode_s is None and rest:  # prompts back to back: no step of decode rows alone yet
            self.decode_s = wall_s - inside_s + outside_s / rest * layers
        if self.decode_s is not None:
            self.layer_s = _mean(self.layer_s, max(wall_s - self.decode_s, 0.0) / layers)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - PACE_WEIGHT) * old + PACE_WEIGHT * new


def pick_slot(slots: Sequence[Slot], busy: set[int], prompt: Sequence[int]) -> Slot | None:
    """An idle slot for a prompt, losing no other conversation's positions where it can: of
    the idle slots whose cached ids are all a prefix of the prompt (a conversation's own slot,
    holding its earlier turns, or an empty one), the one holding the most; else the least
    recently used (its cache the least likely to be asked for again). A prefix the prompt
    shares with another slot is copied from there (`Slots.share_prefix`), so a new
    conversation that begins like an old one (the same system prompt) takes an empty or the
    oldest slot rather than overwriting the old conversation's later turns."""
    idle = [s for s in slots if s.id not in busy]

    def rank(s: Slot) -> tuple[bool, int, int, int]:
        held = len(s.session.tokens)
        keeps_all = common_prefix(s.session.tokens, prompt) == held
        return keeps_all, held if keeps_all else 0, -s.order, -s.id

    return max(idle, key=rank, default=None)


def shared_positions(slots: Sequence[Slot]) -> int:
    """Positions of the prompt prefixes the slots' caches hold by reference, each page file once
    however many slots map it (shared/model/kv_pages.py)."""
    files = set()
    for s in slots:
        if s.session.cache is not None:
            files |= s.session.cache.page_files()
    return sum(f.positions for f in files)


def slot_states(slots: Sequence[Slot], busy: set[int], pool: int) -> m.SlotStates:
    """The slots as telemetry shows them: an idle one with nothing but zeros and the positions
    its cache still holds (its conversation, until the pool needs the room), a shared prefix apart."""
    figures = [(s.req_id, s.total, s.cache, s.processed, s.decoded) if s.id in busy else (0, 0, 0, 0, 0) for s in slots]
    req_ids, total, cache, processed, decoded = (tuple(column) for column in zip(*figures))
    held = tuple(s.session.own for s in slots)
    return m.SlotStates(req_ids, total, cache, processed, decoded, held, pool, shared_positions(slots))


def _phases(states: m.SlotStates) -> list[tuple[object, object]]:
    return [(r["req_id"], r["state"]) for r in states.rows()]


class SlotModel:
    """generate()'s model for one slot's request: every pass is a place in the next shared step.
    Its first prefill is the prompt's (a later one is a context shift's): its progress goes
    out as PromptProgress frames, one as it opens and one after each chunk.

    `records` are the request's token records, as MeteredModel keeps them alone: one per
    prefill or decode, made of the records of the passes its rows were in (a prefill's
    chunks merged), its own step, req_id and rows; every other figure is the passes',
    shared with the other rows in them (docs/batching.md § Slots in compute)."""

    def __init__(self, steps: Steps, slot: Slot, model, req_id: int):
        self.steps, self.slot, self.model, self.req_id = steps, slot, model, req_id
        self.prompted = False
        self.records: list[m.TokenRecord] = []

    def new_cache(self, n_ctx: int) -> KVCache:
        return self.model.new_cache(n_ctx)

    def prefill(self, tokens, cache: KVCache, batch: int = 64) -> np.ndarray:
        """A prompt in chunks of `batch`, one a step, as `model.prefill` splits it alone."""
        tokens = [int(t) for t in tokens]
        progress = None if self.prompted else self._progress(cache.n, cache.n + len(tokens))
        self.prompted = True
        passes: list[m.TokenRecord | None] = []  # the chunks' records (their logits but the last are not kept)
        last = None
        self.slot.post_progress = progress
        try:
            for s in range(0, len(tokens), batch):
                last = self.steps.ask(self.slot.id, self.slot.order, tokens[s : s + batch], cache)
                passes.append(last.record)
                if progress is not None:
                    self.slot.processed = cache.n
                    progress(cache.n)
        finally:
            self.slot.post_progress = None
        if last is None:
            raise ValueError("forward needs at least one token")
        return self._keep(last, passes, len(tokens))

    def _progress(self, cached: int, total: int):
        """Post the prompt's opening PromptProgress; returns what posts the next ones."""
        t0 = time.monotonic()
        self.slot.total, self.slot.cache, self.slot.processed = total, cached, cached

        def post(processed: int) -> None:
            self.steps.post(m.PromptProgress(self.req_id, total, cached, processed, round((time.monotonic() - t0) * 1e3)))

        post(cached)
        return post

    def decode_one(self, token: int, cache: KVCache) -> np.ndarray:
        a = self.steps.ask(self.slot.id, self.slot.order, [token], cache)
        return self._keep(a, [a.record], 1)

    def verify(self, tokens, cache: KVCache, redo: int = 0) -> np.ndarray:
        """A decoded token and its drafts (after `redo` rows a rollback runs again) as the slot's
        rows of the next step: every row's logits [T, V], as `MoEModel.verify` gives them alone
        (the kernels are batch-exact; Session.verify has set the cache's `rows_alone` and the
        recurrent state's mark, which the pass reads from the cache). One record, its drafts
        counted as `drafted` (MeteredModel.verify's)."""
        a = self.steps.ask(self.slot.id, self.slot.order, [int(t) for t in tokens], cache, all_logits=True)
        logits = self._keep(a, [a.record], len(tokens))
        if a.record is not None:
            self.records[-1] = replace(self.records[-1], drafted=max(len(tokens) - 1 - redo, 0))
        return logits

    def drafts_judged(self, drafted: int, kept: int) -> None:
        """The last verify pass's drafts are settled: its record says how many were kept, and the
        slot has that many more tokens (shared/text/speculate.py)."""
        if self.records and self.records[-1].drafted:
            self.records[-1] = replace(self.records[-1], accepted=kept)
        self.slot.decoded += kept

    def _keep(self, last: Ask, passes: list[m.TokenRecord | None], rows: int) -> np.ndarray:
        """The last answer's logits; the request's record of the passes behind them, its next token's."""
        kept = [r for r in passes if r is not None]
        if kept:
            self.records.append(merge_records(kept, step=len(self.records) + 1, req_id=self.req_id, pass_tokens=rows))
        self.slot.decoded += 1  # each prefill or decode gives the request its next token
        assert last.logits is not None
        return last.logits


class Slots:
    """Compute's serving loop with gateway.parallel slots (the module docstring)."""

    def __init__(
        self,
        config: Config,
        metered: MeteredModel,
        tok,
        out: zmq.Socket,
        interrupts: Interrupts,
        front_end: FrontEndWatch,
        identity: tuple[str, ...],
        late: CompileCounter | None = None,
    ):
        """`late`: the process's count of kernels compiled while requests ran (a Done's late_compiles)."""
        self.config, self.metered, self.tok, self.out = config, metered, tok, out
        self.interrupts, self.front_end, self.identity, self.late = interrupts, front_end, identity, late
        self.slots = [Slot(i) for i in range(config.gateway.parallel)]
        self.steps = Steps()
        self.arrivals = 0
        self.peer_gone: GenerationAborted | None = None
        self.states: m.SlotStates | None = None  # the last SlotStates sent, and when
        self.states_at = -math.inf
        self.sliced: Sliced | None = None  # the prompt chunk on its way through the layers
        self.pace = Pace()
        self.pool = config.kv_pool_tokens  # positions the slots' caches hold together (shared/model/kv_pool.py)
        self.pool_ended: set[int] = set()  # slots whose request the pool ended (end_for_room): emptied as it leaves
        self.stepped = False  # a step ran since the heap last gave its free pages back (shared/heap.py)
        if config.compute.drafts_from_block:
            log.warning("--draft-source mtp drafts only with one slot: with --parallel %d requests draft nothing", len(self.slots))

    def serve(self, reader_pid: int, epoch: int) -> None:
        import os

        try:
            while not self.interrupts.shutdown and self.peer_gone is None:
                if self.front_end.came_back():
                    ipc.send(self.out, m.Hello("compute", os.getpid(), epoch))
                self.receive(reader_pid)  # 1.
                self.admit()
                self.flush()
                asks = self.steps.gather(WAIT_S) if self.steps.busy else []
                if asks:
                    self.step(asks)  # 2.
                    self.stepped = True
                self.flush()  # 3.
        finally:
            self.stop()
        if self.peer_gone is not None:
            raise self.peer_gone

    # -- 1. the requests link ---------------------------------------------------------
    def receive(self, reader_pid: int) -> None:
        """New frames; while nothing runs, a blocking wait that also notices a dead reader."""
        try:
            self.interrupts.check()
        except GenerationAborted:  # a Shutdown: `serve` stops at its next look
            return
        if not self.steps.busy and not self.interrupts.pending:
            self.flush()  # a slot's last frames (it posts its Done before it leaves), not held while this waits
            if self.stepped:  # idle after work: the prompts' freed pages, kept for their layers (shared/heap.py)
                heap.give_back()
                self.stepped = False
            msg = _next_request(self.interrupts.requests, reader_pid)
            if isinstance(msg, m.Shutdown):
                self.interrupts.shutdown = True
            elif msg is not None:
                self.interrupts.pending.append(msg)
        while self.interrupts.cancels:
            self.cancel(self.interrupts.cancels.popleft())

    def busy(self) -> set[int]:
        with self.steps.cond:
            return set(self.steps.busy)

    def cancel(self, req_id: int) -> None:
        busy = self.busy()
        for s in self.slots:
            if s.req_id == req_id and s.id in busy:
                if self.sliced is not None and self.sliced.ask.slot == s.id:
                    self.drop_slice()  # before the slot's thread wakes to its error and may touch its session
                self.steps.cancel(s.id)
        for msg in list(self.interrupts.pending):
            if isinstance(msg, m.Generate) and msg.req_id == req_id:  # cancelled before a slot took it
                self.interrupts.pending.remove(msg)
                ipc.send(self.out, m.Done(req_id, False, code=m.Code.CANCELLED, error="cancelled by the front end"))

    def admit(self) -> None:
        """Waiting requests into slots, in arrival order: a request pinned to a busy slot (llama.cpp's
        id_slot) waits for it while those after it go on; a Slot action waits until every slot is
        idle, and the requests after it wait for it."""
        pending = self.interrupts.pending
        for msg in list(pending):
            if isinstance(msg, m.Slot):
                if self.busy():
                    return
                pending.remove(msg)
                ipc.send(self.out, self.act_on_slot(msg))
                continue
            if msg.slot >= len(self.slots) and msg.slot != m.ANY_SLOT:
                pending.remove(msg)  # the gateway checks the range: another front end's request
                ipc.send(self.out, self.no_slot(msg))
                continue
            if msg.slot == m.ANY_SLOT:
                slot = pick_slot(self.slots, self.busy(), msg.prompt_tokens)
                if slot is None:
                    return  # no slot is idle: a pinned request after it could not run either
            elif msg.slot in self.busy():
                continue
            else:
                slot = self.slots[msg.slot]
            pending.remove(msg)
            self.start(slot, msg, self.share_prefix(slot, msg))

    def no_slot(self, msg: m.Generate | m.Slot) -> m.Done:
        """The answer to a request or action naming a slot compute does not have."""
        return m.Done(msg.req_id, False, code=m.Code.BAD_ARGUMENT, error=f"no slot {msg.slot}: compute has {len(self.slots)}")

    def act_on_slot(self, msg: m.Slot) -> m.Done:
        """Save, restore or erase a slot's session (every slot idle)."""
        if msg.slot >= len(self.slots):
            return self.no_slot(msg)
        slot = self.slots[msg.slot]
        self.room_for(slot, self.config.compute.ctx_size)  # a restore may fill its context
        return handle_slot(msg, slot.session, self.metered.model, self.config.compute.ctx_size, self.identity)

    def share_prefix(self, slot: Slot, req: m.Generate) -> int:
        """Before `slot` starts `req`: when another slot's session (idle, or busy and waiting for
        a step: only its committed positions) can give the prompt a longer prefix than `slot`'s own
        reuse would, copy that prefix's KV rows and ids into `slot`'s session (Session.share_from),
        so generate's prefix reuse keeps them. The positions copied (0: none). The rules of a slot's
        own reuse decide what another slot can give (Session.reusable): a ring only while it holds
        the window before the prefix's end, a recurrent state only when it holds exactly the prefix,
        a q8_0 cache whole prefill chunks (docs/batching.md § Prompt prefixes shared across slots)."""
        if not req.cache_prompt:
            return 0
        prompt, chunk = req.prompt_tokens, slot_prefill_chunk(self.config)

        def reusable(s: Slot) -> int:
            return s.session.reusable(prompt, True, reuse_align(s.session, chunk))

        own = reusable(slot)
        busy = self.busy()
        waiting: set[int] = set()
        # A busy slot's thread changes its session between steps: read only those waiting for one,
        # and wait for them only when one might give more (this first look is not relied on).
        if any(common_prefix(s.session.tokens, prompt) > own for s in self.slots if s.id in busy):
            busy, waiting = self.steps.settle(SHARE_WAIT_S)
        # A slot whose chunk is part way through the layers has a recurrent state that folded
        # more than its session counts: it gives nothing until the chunk is through.
        midway = self.sliced.ask.slot if self.sliced is not None and self.sliced.ask.cache.state is not None else None
        donors = [
            s
            for s in self.slots
            if s is not slot and s.id != midway and s.session.cache is not None and (s.id not in busy or s.id in waiting)
        ]
        n, best = max(((reusable(s), s) for s in donors), key=lambda d: d[0], default=(0, None))
        if best is None or best.session.cache is None or n <= own:
            return 0
        if not self.room_for(slot, n, keep=best.id, by_reference=best.session.cache.shareable(n)):
            return 0
        try:
            slot.session.share_from(best.session, n, self.metered.model, self.config.compute.ctx_size)
        except Exception:  # noqa: BLE001 - a bug: the request computes its prompt, the process goes on
            log.exception("sharing a prefix from slot %d into slot %d failed", best.id, slot.id)
            slot.session.reset()
            return 0
        log.debug("slot %d: %d prompt positions from slot %d", slot.id, n, best.id)
        return n

    def start(self, slot: Slot, req: m.Generate, shared: int = 0) -> None:
        self.arrivals += 1
        slot.req_id, slot.order = req.req_id, self.arrivals
        slot.total, slot.cache, slot.processed, slot.decoded = len(req.prompt_tokens), 0, 0, 0
        self.steps.join(slot.id)
        slot.thread = threading.Thread(target=self.run, args=(slot, req, shared), name=f"slot-{slot.id}", daemon=True)
        slot.thread.start()

    # -- a slot's thread ----------------------------------------------------------------
    def run(self, slot: Slot, req: m.Generate, shared: int = 0) -> None:
        """The request, as compute.handle serves it alone; its frames go to the outbox.
        `shared`: its prompt positions copied from another slot (`share_prefix`)."""
        post = self.steps.post
        compiles = self.late.count if self.late else 0
        try:
            try:
                params, gen_cfg, constraint = request_settings(req, self.config, self.tok)
                gen_cfg = replace(gen_cfg, prefill_batch=slot_prefill_chunk(self.config))
                drafter = slot_drafter(self.config, gen_cfg.draft, self.metered.model.spec.n_vocab)
            except (UserError, TypeError) as exc:
                post(m.Done(req.req_id, False, code=m.Code.BAD_ARGUMENT, error=f"bad request: {exc}"))
                return
            model = SlotModel(self.steps, slot, self.metered.model, req.req_id)
            result = generate(
                model,
                self.tok,
                list(req.prompt_tokens),
                params,
                gen_cfg,
                on_text=lambda text: post(m.Token(req.req_id, text)),
                session=slot.session,
                constraint=constraint,
                drafter=drafter,
            )
            late = (self.late.count if self.late else 0) - compiles  # any slot's pass compiling is in this request's time too
            figures = {**result.timings, **request_figures(model.records), "late_compiles": late, "id_slot": slot.id}
            timings: dict[str, m.Scalar] = {k: v for k, v in figures.items() if isinstance(v, (int, float, str, bool))}
            timings["prompt_shared"] = min(shared, int(result.timings.get("prompt_cached", 0)))  # of prompt_cached
            post(m.Done(req.req_id, True, result.finish_reason, tuple(result.tokens), timings))
        except GenerationAborted as exc:
            post(m.Done(req.req_id, False, code=str(exc.code), error=str(exc)))
        except KVPoolFull as exc:  # its prompt found no room: the request may be sent again
            post(m.Done(req.req_id, False, code=m.Code.BUSY, error=str(exc)))
        except UserError as exc:
            post(m.Done(req.req_id, False, code=m.Code.BAD_ARGUMENT, error=str(exc)))
        except Exception as exc:  # noqa: BLE001 - a bad request fails that request
            log.exception("generation in slot %d failed", slot.id)
            slot.session.reset()  # a bug's leftovers are not reused
            post(m.Done(req.req_id, False, code=m.Code.INTERNAL, error=f"{type(exc).__name__}: {exc}"))
        finally:
            if slot.id in self.pool_ended:  # its positions go back to the pool before the slot is idle
                self.pool_ended.discard(slot.id)
                self.evict(slot)
            self.steps.leave(slot.id)

    # -- the KV pool (shared/model/kv_pool.py) ---------------------------------------------
    def held(self, slot: Slot, trim: bool) -> int:
        """The positions `slot`'s cache keeps in memory of its own (a prefix held by reference is
        counted apart: `shared_positions`); with `trim`, once the rows past its count (a truncated
        conversation's) are given back. Only a slot whose thread holds still may be trimmed: an
        idle one, or a busy one waiting for a step."""
        cache = slot.session.cache
        if (
            cache is not None and trim and not (self.sliced is not None and self.sliced.ask.slot == slot.id)
        ):  # a chunk's rows wait past the count
            cache.release(cache.n)
        return slot.session.own

    def evict(self, slot: Slot) -> None:
        """A slot's conversation is forgotten and its cache's memory given back to the pool (an
        idle slot's, or one whose thread is ending)."""
        log.debug("KV pool: slot %d gives back %d positions", slot.id, self.held(slot, False))
        slot.session.reset()
        if slot.session.cache is not None:
            slot.session.cache.release(0)

    def make_room(self, uses: list[Use]) -> Room:
        """`make_room` over the slots' uses, its idle caches emptied."""
        room = make_room(self.pool, uses, shared_positions(self.slots))
        for i in room.evict:
            self.evict(self.slots[i])
        return room

    def room_for(self, slot: Slot, n: int, keep: int | None = None, by_reference: int = 0) -> bool:
        """Room in the pool for an idle `slot` to hold n positions, `by_reference` of them a prefix
        it shares (in memory once already), made by emptying other idle slots (the least recently
        used first; never `keep`, a donor); whether there is."""
        if len(self.slots) == 1:
            return True
        busy = self.busy()
        uses = []
        for s in self.slots:
            idle = s.id not in busy
            held = self.held(s, trim=idle)
            if s is slot:
                uses.append(Use(s.id, s.order, True, held, max(held, n - by_reference)))
            else:
                uses.append(Use(s.id, s.order, not idle or s.id == keep, held, held))
        room = self.make_room(uses)
        return slot.id not in room.defer and room.end is None

    def fit_pool(self, asks: list[Ask]) -> list[Ask]:
        """The asks of a step that the KV pool has room for (shared/model/kv_pool.py `make_room`):
        idle slots' caches emptied, the youngest requests' rows left for a later step, and when
        no row could run, the youngest request ended (`end_for_room`). Only the step's own chunk
        (the one on its way, else the oldest) stays among the asks: another is not counted."""
        rows, chunk = pick_rows(asks)
        sl = self.sliced
        if sl is not None and self.steps.asks.get(sl.ask.slot) is sl.ask:
            chunk = sl.ask
        running = rows + ([chunk] if chunk is not None else [])
        if len(self.slots) == 1:
            return running
        wants = {a.slot: a.cache.n + len(a.tokens) for a in running}
        busy = self.busy()
        uses = []
        for s in self.slots:
            held = self.held(s, trim=True)  # every busy slot waits for this step
            uses.append(Use(s.id, s.order, s.id in busy, held, max(held, wants.get(s.id, held))))
        room = self.make_room(uses)
        if room.defer:
            log.debug("KV pool: slots %s wait for room", sorted(room.defer))
        if room.end is not None:
            self.end_for_room(room.end)
        return [a for a in running if a.slot not in room.defer and a.slot != room.end]

    def end_for_room(self, i: int) -> None:
        """The youngest request ends so the others can go on (the pool is full and none could):
        decoding, as at a full context; reading its prompt, with a BUSY error."""
        if self.sliced is not None and self.sliced.ask.slot == i:
            self.drop_slice()
        a = self.steps.asks.get(i)
        log.warning(
            "KV pool: %d positions are full; request %d in slot %d ends to let the older ones go on", self.pool, self.slots[i].req_id, i
        )
        if a is not None:
            self.pool_ended.add(i)
            why = (
                f"the slots' KV pool is full ({self.pool:,} positions shared by {len(self.slots)} slots, gateway.kv_pool): "
                "older requests hold it; send it again later, or raise --kv-pool or lower --parallel"
            )
            self.steps.answer(a, error=KVPoolFull(why))

    # -- 2. a step ------------------------------------------------------------------------
    def step(self, asks: list[Ask]) -> None:
        """One pass over the step's rows and, beside them, the next layers of a prompt's chunk
        (`Sliced`, `Pace`); each ask gets its logits row, or the pass's failure. A chunk's ask is
        answered once the chunk is through the last layer, with the record of its passes."""
        asks = self.fit_pool(asks)
        if not asks:
            return
        rows, chunk = pick_rows(asks)
        sl = self.sliced
        if sl is not None and self.steps.asks.get(sl.ask.slot) is not sl.ask:  # its request ended meanwhile
            self.drop_slice()
            sl = None
        if sl is None and chunk is not None:
            sl = self.sliced = Sliced.start(chunk)
        req_ids = [self.slots[a.slot].req_id for a in rows] + ([self.slots[sl.ask.slot].req_id] if sl is not None else [])
        parts = [BatchPart(a.tokens, a.cache, a.all_logits) for a in rows]
        layers = self.pace.layers(bool(rows), self.metered.model.spec.n_layer - sl.piece.next_layer) if sl is not None else 0
        t0 = time.perf_counter()
        try:
            logits, record = self.metered.forward_batch(parts, req_ids, prompt=sl.piece if sl is not None else None, layers=layers)
        except Exception as exc:  # noqa: BLE001 - a failed pass fails its requests, the process goes on
            if isinstance(exc, GenerationAborted) and exc.code == m.Code.PEER_GONE:
                self.peer_gone = exc
            elif not isinstance(exc, GenerationAborted):
                log.exception("a batched pass failed")
            for a in rows + ([sl.ask] if sl is not None else []):
                self.steps.answer(a, error=exc)
            self.sliced = None  # its recurrent state is emptied (MeteredModel.forward_batch): nothing to put back
            return
        if sl is not None:
            rest = self.metered.model.spec.n_layer - layers if rows else 0
            self.pace.took(time.perf_counter() - t0, bool(rows), layers, sl.piece.inside_s, sl.piece.outside_s, rest)
        else:
            self.pace.took(time.perf_counter() - t0, bool(rows))
        for a, row in zip(rows, logits):
            self.steps.answer(a, logits=row if a.all_logits else row[-1], record=record)
        if sl is not None:
            self.chunk_went_on(sl, record)

    def chunk_went_on(self, sl: Sliced, record: m.TokenRecord) -> None:
        """After a step with the chunk in it: its slot's progress through the layers; its ask
        answered once it is through the last one."""
        sl.records.append(record)
        slot, piece, cache = self.slots[sl.ask.slot], sl.piece, sl.ask.cache
        if not piece.done:
            processed = cache.n + len(piece.tokens) * piece.next_layer // self.metered.model.spec.n_layer
            moved, slot.processed = processed > slot.processed, processed
            if moved and slot.post_progress is not None:  # the stream hears of it too, a layer slice at a time
                slot.post_progress(processed)
            return
        self.sliced = None
        heap.give_back()  # the chunk's arrays, kept for its layers (shared/heap.py), not through the replies
        assert piece.logits is not None
        merged = merge_records(sl.records, step=record.step, req_id=record.req_id, pass_tokens=record.pass_tokens)
        self.steps.answer(sl.ask, logits=piece.logits[-1], record=merged)

    def drop_slice(self) -> None:
        """The chunk on its way stops where it is (its request ended): its cache as before it."""
        if self.sliced is not None:
            sl, self.sliced = self.sliced, None
            sl.abandon()

    # -- 3. frames out ----------------------------------------------------------------------
    def flush(self) -> None:
        for msg in self.steps.take_outbox():
            ipc.send(self.out, msg)
            if isinstance(msg, m.PromptProgress):
                self.metered.telemetry.send(msg)  # tails show it too
        self.report_states()

    def report_states(self, clock=time.monotonic) -> None:
        """What each slot is doing, to telemetry: at once when a slot changes state (idle,
        prompt, decoding), else at most every SLOT_STATES_S while its figures move."""
        states = slot_states(self.slots, self.busy(), self.pool)
        if states == self.states:
            return
        now = clock()
        if self.states is not None and _phases(states) == _phases(self.states) and now - self.states_at < SLOT_STATES_S:
            return
        self.states, self.states_at = states, now
        self.metered.telemetry.send(states)

    def stop(self) -> None:
        """Shutdown or a dead reader: every slot's request ends, its Done goes out."""
        code = self.peer_gone.code if self.peer_gone is not None else m.Code.CANCELLED
        why = str(self.peer_gone) if self.peer_gone is not None else "the service is shutting down"
        self.drop_slice()
        for i in self.busy():
            self.steps.cancel(i)
        with self.steps.cond:  # a slot asking after this fails at once
            for a in list(self.steps.asks.values()):
                self.steps.answer(a, error=GenerationAborted(code, why))
        for s in self.slots:
            if s.thread is not None:
                s.thread.join(timeout=5.0)
        self.flush()
