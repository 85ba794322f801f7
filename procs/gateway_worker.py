"""The gateway's side of compute: requests as jobs, the queue they wait in,
the link to compute (its sockets and its pid, watched because kill -9 sends
nothing) and the workers that give compute its Generates: one, so one request
at a time, or gateway.parallel of them, one a compute slot (procs/slots.py).

Everything here runs on the gateway's event loop (procs/gateway.py), which
owns the sockets; the request/answer bookkeeping is `ComputeClient`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import cast

import zmq
import zmq.asyncio

from ..shared.pids import pid_alive
from ..shared.serve.http_guard import RETRY_AFTER_S
from ..shared.serve.metrics import Metrics
from ..shared.serve.openai_api import FINISH_REASONS, ApiError
from ..shared.wire import ipc
from ..shared.wire import messages as m
from .compute_client import ComputeClient, failure_text

log = logging.getLogger("moe_pipe.gateway")

POLL_S = 0.25  # how often a wait checks that compute lives and the client is still there
SEND_TIMEOUT_S = 5.0  # a send that cannot be queued this long: compute is wedged


# ------------------------------------------------------------------------ jobs


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    completion_tokens: int
    prompt_cached: int = 0  # prompt tokens reused from compute's KV cache (usage.prompt_tokens_details.cached_tokens)
    timings: dict = field(default_factory=dict)  # compute's Done timings (a slot action's figures)


@dataclass(frozen=True)
class Failed:
    status: int
    message: str
    code: str
    kind: str = "server_error"

    def error(self) -> ApiError:
        return ApiError(self.status, self.message, self.code, self.kind)


Event = str | m.PromptProgress | Finished | Failed


class Job:
    """One request from the queue to its end. The worker writes events (text
    pieces, the prompt's progress when asked for, then one Finished or
    Failed); the handler reads them."""

    def __init__(
        self,
        prompt_tokens: list[int],
        max_tokens: int,
        sampling: dict,
        stop: tuple[str, ...],
        grammar: str = "",
        cache_prompt: bool = True,
        slot: tuple[str, str, int] | None = None,
        progress: bool = False,
        draft: int | None = None,
        id_slot: int | None = None,
    ):
        self.prompt_tokens, self.max_tokens, self.sampling, self.stop = prompt_tokens, max_tokens, sampling, stop
        self.cache_prompt = cache_prompt  # reuse compute's cached prefix (docs/conversations.md)
        self.draft = draft  # speculative decoding's drafts per pass for this request; None = compute.draft (docs/speculative.md)
        self.slot = slot  # (action, path, compute slot): a Slot request for a session instead of a generation
        self.id_slot = id_slot  # the compute slot the request must run in (llama.cpp's id_slot); None: compute picks
        self.grammar = grammar  # response_format's grammar for compute ("" = free text)
        self.events: deque[Event] = deque()
        self.wake = asyncio.Event()
        self.emitted = 0  # characters of text handed out so far: a retry skips them
        self.progress = progress  # the client asked for the prompt's progress (return_progress)
        self.processed = -1  # the last progress handed out: a retry's events count from 0 again, and only growth is shown
        self.cancelled = False  # the client went away
        self.ended = False

    def offer_text(self, attempt_text: str) -> None:
        """The whole text of the current attempt; hand out what is new. Greedy
        (or seeded) output is identical on a retry, so the prefix is known."""
        if len(attempt_text) > self.emitted:
            self._emit(attempt_text[self.emitted :])
            self.emitted = len(attempt_text)

    def offer_progress(self, progress: m.PromptProgress) -> None:
        """The prompt's progress, if the client asked for it; events that do not
        grow `processed` (a retry's prompt starting over) are not handed out."""
        if self.progress and progress.processed > self.processed:
            self.processed = progress.processed
            self._emit(progress)

    def end(self, event: Finished | Failed) -> None:
        if not self.ended:
            self.ended = True
            self._emit(event)

    def _emit(self, event) -> None:
        self.events.append(event)
        self.wake.set()


class RequestQueue:
    """The FIFO of jobs waiting for the worker, bounded: past `size`, 429.
    A job whose client left while it waited is skipped, and does not count."""

    def __init__(self, size: int):
        self.size = size
        self.jobs: deque[Job] = deque()
        self.wake = asyncio.Event()
        self.closed = False

    def offer(self, job: Job) -> None:
        if self.closed:
            raise ApiError(503, "the service is shutting down", "shutting_down", "server_error")
        self.jobs = deque(j for j in self.jobs if not j.cancelled)
        if len(self.jobs) >= self.size:
            raise ApiError(
                429,
                f"{len(self.jobs)} requests are already waiting (queue_size {self.size}); retry later",
                "queue_full",
                "rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.jobs.append(job)
        self.wake.set()

    async def take(self) -> Job:
        while True:
            self.wake.clear()
            while self.jobs:
                job = self.jobs.popleft()
                if not job.cancelled:
                    return job
            await self.wake.wait()

    def waiting(self) -> int:
        return sum(not j.cancelled for j in self.jobs)

    def close(self, failure: Failed) -> None:
        self.closed = True
        while self.jobs:
            self.jobs.popleft().end(failure)


# --------------------------------------------------------------- the compute link


async def wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` passed. Not asyncio.wait_for: on
    3.11 it can swallow a cancel that lands as the event fires, and a worker
    that misses its cancel keeps the process from exiting."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass


@dataclass
class Channel:
    """One request in flight: its frames not yet taken, and the event that says more came."""

    events: deque[str | m.PromptProgress | m.Done] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class ComputeLink:
    """The gateway's end of the requests/tokens links: the sockets and the
    asyncio plumbing around one ComputeClient (procs/compute_client.py, shared
    with `moe-pipe run`), which knows who the compute is (the pid of its last
    Hello) and which frames belong to a request in flight; each request in
    flight has its `Channel` (several with gateway.parallel > 1)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoints: ipc.Endpoints, parallel: int = 1):
        # ipc makes the socket of the context's kind: an asyncio one here
        self.tokens = cast(zmq.asyncio.Socket, ipc.bind(ctx, endpoints, "tokens"))
        self.requests = cast(zmq.asyncio.Socket, ipc.connect(ctx, endpoints, "requests"))
        self.client = ComputeClient(parallel)
        self.channels: dict[int, Channel] = {}  # by req_id
        self.wake = asyncio.Event()  # any frame or Hello

    @property
    def pid(self) -> int | None:
        return self.client.pid

    @property
    def hellos(self) -> int:
        """A new Hello means a (re)started compute."""
        return self.client.hellos

    def ready(self) -> bool:
        return self.client.pid is not None and pid_alive(self.client.pid)

    async def receive_forever(self) -> None:
        while True:
            frame = await self.tokens.recv()
            try:
                msg = m.decode(frame)
            except m.ProtocolError as exc:
                log.warning("dropped a bad frame on the tokens link: %s", exc)
                continue
            event = self.client.accept(msg)
            channel = self.channels.get(getattr(msg, "req_id", 0))
            if event is not None and channel is not None:
                channel.events.append(event)
                channel.wake.set()
            if isinstance(msg, m.Hello):
                self.poke()  # every request in flight looks at whether its compute is still the one
            self.wake.set()

    def poke(self) -> None:
        """Wake every wait now (a client gone, a new compute), not at its next poll."""
        self.wake.set()
        for channel in self.channels.values():
            channel.wake.set()

    async def generate(self, job: Job) -> tuple[int, Channel]:
        """Send the job as a request in flight (with parallel 1, frames of any earlier one are dropped from now on)."""
        if job.slot is not None:
            msg: m.Generate | m.Slot = self.client.slot(*job.slot)
        else:
            msg = self.client.generate(
                job.prompt_tokens,
                job.max_tokens,
                job.sampling,
                job.stop,
                cache_prompt=job.cache_prompt,
                grammar=job.grammar,
                draft=m.DRAFT_FROM_CONFIG if job.draft is None else job.draft,
                slot=m.ANY_SLOT if job.id_slot is None else job.id_slot,
            )
        if self.client.parallel == 1:
            self.channels.clear()
        channel = self.channels[msg.req_id] = Channel()
        await self.send(msg)
        return msg.req_id, channel

    def close(self, req_id: int) -> None:
        """The request is over for the gateway: its late frames are dropped."""
        self.channels.pop(req_id, None)
        self.client.forget(req_id)

    async def cancel(self, req_id: int = 0) -> None:
        await self.send(self.client.cancel(req_id))

    async def send(self, msg: m.Message) -> None:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await self.requests.send(m.encode(msg))

    async def wait(self, timeout_s: float) -> None:
        """Until a frame or Hello arrives, or `timeout_s`. Callers clear `wake`
        before they look at the state, so nothing that arrives is missed."""
        await wait_event(self.wake, timeout_s)


LOST = "lost"  # run_once: the compute died (or restarted) under the request


class Worker:
    """Serves the queue in order, one request on compute at a time; with
    gateway.parallel N, N workers share the queue, one a compute slot."""

    def __init__(self, link: ComputeLink, queue: RequestQueue, restart_wait_s: float, metrics: Metrics, slot: int = 0):
        self.link, self.queue, self.restart_wait_s, self.metrics = link, queue, restart_wait_s, metrics
        self.slot = slot  # its place in /slots (compute picks the slot itself: procs/slots.py)
        self.current: Job | None = None
        self.req_id = 0  # the request in flight on compute
        self.decoded = 0  # Token frames of the current request so far
        self.progress: m.PromptProgress | None = None  # the current request's prompt, as compute last said (GET /slots)

    async def run_forever(self) -> None:
        while True:
            job = await self.queue.take()
            self.current = job
            try:
                await self.serve(job)
            except (TimeoutError, zmq.ZMQError) as exc:
                job.end(Failed(503, f"compute did not take the request ({type(exc).__name__}); retry later", "compute_unavailable"))
            except Exception:  # noqa: BLE001 - a bug fails this request, never the worker
                log.exception("request failed")
                job.end(Failed(500, "internal error in the gateway (see the service log)", "internal"))
            finally:
                self.current = None

    async def serve(self, job: Job) -> None:
        newer_than = 0  # Hello count the compute must pass: any for the first try, a new one for the retry
        for attempt in (1, 2):
            if not await self.wait_for_compute(job, newer_than):
                return
            newer_than, pid = self.link.hellos, self.link.pid
            if await self.run_once(job) != LOST:
                return
            log.warning(
                "compute pid %s was lost during a request%s",
                pid,
                "; resending it to the restarted compute" if attempt == 1 else " again; giving up",
            )
        job.end(Failed(503, "the compute process died twice during this request; retry later", "compute_unavailable"))

    async def wait_for_compute(self, job: Job, newer_than: int) -> bool:
        """Until a live compute newer than `newer_than` Hellos. Before the first
        Hello ever (the model is loading) there is no deadline; after that the
        supervisor's restart gets `restart_wait_s`."""
        loop = asyncio.get_running_loop()
        wait_s = self.restart_wait_s
        deadline = None if self.link.hellos == 0 else loop.time() + wait_s
        while True:
            self.link.wake.clear()
            if job.cancelled:
                return False
            if self.link.hellos > newer_than and self.link.ready():
                return True
            if deadline is not None and loop.time() >= deadline:
                job.end(
                    Failed(503, f"no compute process is running (waited {wait_s:g} s for a restart); retry later", "compute_unavailable")
                )
                return False
            await self.link.wait(POLL_S)

    async def run_once(self, job: Job) -> str | None:
        link = self.link
        pid, hellos = link.pid, link.hellos
        self.req_id, channel = await link.generate(job)
        self.decoded, self.progress = 0, None
        text, cancel_sent = "", False
        try:
            while True:
                channel.wake.clear()
                while channel.events:
                    event = channel.events.popleft()
                    if isinstance(event, m.Done):
                        return self.finish(job, event)
                    if isinstance(event, m.PromptProgress):
                        self.progress = event
                        job.offer_progress(event)
                        continue
                    text += event
                    self.decoded += 1
                    job.offer_text(text)
                if link.hellos != hellos or pid is None or not pid_alive(pid):
                    return LOST
                if job.cancelled and not cancel_sent:
                    # compute ends it with Done(cancelled): mid-prompt within a second, else at its next token
                    await link.cancel(self.req_id)
                    cancel_sent = True
                await wait_event(channel.wake, POLL_S)
        finally:
            link.close(self.req_id)

    def finish(self, job: Job, done: m.Done) -> str | None:
        self.metrics.on_done(done)
        if done.ok:
            reason = FINISH_REASONS.get(done.finish_reason, done.finish_reason or "stop")
            cached = done.timings.get("prompt_cached")
            job.end(Finished(reason, len(done.tokens), int(cached) if isinstance(cached, (int, float)) else 0, dict(done.timings)))
        elif done.code == m.Code.PEER_GONE:  # the reader died; compute exits and is restarted
            return LOST
        elif done.code == m.Code.BAD_ARGUMENT:
            job.end(Failed(400, done.error, done.code, "invalid_request_error"))
        elif done.code == m.Code.BUSY:  # the slots' KV pool had no room for its prompt: it may be sent again
            job.end(Failed(503, done.error, done.code))
        else:
            job.end(Failed(500, failure_text(done), done.code or "internal"))
        return None

    async def abandon(self, failure: Failed) -> None:
        """Shutdown: the running request ends now, and compute stops working on
        it (a gateway restarted alone must not queue behind an orphan)."""
        job = self.current
        if job is not None:
            job.cancelled = True
            job.end(failure)
            try:
                await self.link.cancel(self.req_id)
            except (TimeoutError, zmq.ZMQError):
                pass
