"""The gateway process: the OpenAI-compatible HTTP API of `moe-pipe up`.

    client ─HTTP/SSE─► handler ─Job─► RequestQueue ─► Worker ─Generate/Cancel─► compute
                          ▲                             │  ◄──Hello/Token/Done──┘
                          └──── job events (text, end) ─┘

One event loop (uvloop) owns every zmq socket of the process (zmq.asyncio),
so no socket is touched by two threads; what would block the loop runs in
threads: tokenizing (chat templates) and the supervisor's status for /metrics
and the web page. The page at / and its event stream are procs/gateway_events.py.

  1. a handler checks the body (the OpenAI wire format is shared/serve/openai_api.py),
     tokenizes the prompt and queues a Job (a full queue: 429);
  2. one Worker takes jobs in arrival order and gives compute ONE Generate at
     a time (gateway.parallel N: N workers, N at a time, one a compute slot:
     procs/slots.py); Token frames become the job's text, which the handler streams
     (SSE) or collects; PromptProgress frames, for a stream that asked
     (`return_progress`), become chunks with llama.cpp's `prompt_progress`;
  3. a client that goes away: Cancel to compute (which stops even mid-prompt
     within a second), the job is dropped;
  4. a compute that dies mid-request (kill -9 sends nothing, so its pid is
     watched): wait for the restarted compute's Hello and resend once, a
     stream skipping the text it already has; a second loss or no compute in
     time: 503;
  5. SIGTERM: stop listening, fail what waits with 503, exit 0.

A hostile or broken client costs bounded time and memory and never holds the
compute: the size and time limits, the connection cap and the loopback
Host/Origin check are shared/serve/http_guard.py, wired in by create_app and serve.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson
import zmq
import zmq.asyncio
from aiohttp import web

from .. import __version__
from ..shared.config import Config
from ..shared.errors import UserError
from ..shared.experts.hotset import read_warm_progress
from ..shared.gguf.model_file import open_model
from ..shared.serve import service
from ..shared.serve.hosts import is_loopback
from ..shared.serve.http_guard import (
    LINGER_S,
    MAX_BODY_BYTES,
    ClientGone,
    HttpLimits,
    LimitedSite,
    loopback_only,
    read_body,
    write_within,
)
from ..shared.serve.metrics import Metrics
from ..shared.serve.openai_api import (
    ApiError,
    ChatOutput,
    CompletionRequest,
    ResponseShape,
    fit_max_tokens,
    parse_body,
    parse_request,
    refuse_unfit_text,
    sse,
    usage_of,
)
from ..shared.text.chat import encode_prompt, render_chat, use_chat_template
from ..shared.text.context import too_long_for_one_request
from ..shared.text.reasoning import framing_for
from ..shared.text.tokenizer import Tokenizer
from ..shared.wire import ipc
from ..shared.wire import messages as m
from .gateway_events import WebView, add_routes, supervisor_status
from .gateway_worker import POLL_S, ComputeLink, Event, Failed, Finished, Job, RequestQueue, Worker, wait_event
from .lifecycle import child_setup
from .run_facts import RunFacts

log = logging.getLogger("moe_pipe.gateway")
DEFAULT_LIMITS = HttpLimits()  # the service's; tests pass shorter ones

PROMPT_TAIL_TOKENS = 32  # where a reply starts (in a think block, a harmony header) is in the prompt's last few tokens
SHUTDOWN_GRACE_S = 5.0  # handlers get this long to answer 503 after SIGTERM


@dataclass(frozen=True)
class ConfigDefaults:
    """What the server fills in for what a request leaves out
    (shared/serve/openai_api.py RequestDefaults), read from the config."""

    config: Config
    model_name: str

    @property
    def ctx_size(self) -> int:
        return self.config.compute.ctx_size

    @property
    def max_tokens(self) -> int:
        return self.config.generate.max_tokens

    @property
    def temperature(self) -> float:
        return self.config.generate.temperature

    @property
    def top_k(self) -> int:
        return self.config.generate.top_k

    @property
    def seed(self) -> int | None:
        return self.config.generate.seed

    @property
    def context_shift(self) -> bool:
        return self.config.generate.context_shift


# ------------------------------------------------------------------ HTTP glue

SLOT_ACTIONS = ("save", "restore", "erase")
MAX_SLOT_NAME = 255  # a file name's limit on Linux


def slot_filename(body: dict) -> str:
    """A slot file's name: bare (no folder, no '..'), as llama.cpp's server requires."""
    name = body.get("filename")
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_SLOT_NAME
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name in (".", "..")
    ):
        shown = name[:40] if isinstance(name, str) else type(name).__name__
        raise ApiError(400, f"'filename' must be a bare file name (no '/', not '..'); got {shown!r}", "invalid_value", param="filename")
    if ".." in name:
        raise ApiError(400, f"'filename' may not contain '..'; got {name[:40]!r}", "invalid_value", param="filename")
    return name


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


def error_response(err: ApiError) -> web.Response:
    resp = json_response(err.body(), err.status, err.headers)
    if err.status in (408, 413):  # the rest of the body is not worth reading: close after LINGER_S
        resp.force_close()
    return resp


def check_wire(job: Job, where: str) -> None:
    """The Generate frame this job becomes must pass compute's decoding, or
    compute drops it and the request would wait forever: encode and decode it
    here once (the frame and array caps of shared/wire/messages.py)."""
    try:
        m.decode(m.encode(m.Generate(0, tuple(job.prompt_tokens), job.max_tokens, job.sampling, job.stop, grammar=job.grammar)))
    except m.ProtocolError:
        raise ApiError(400, too_long_for_one_request(len(job.prompt_tokens)), "context_length_exceeded", param=where) from None


# ---------------------------------------------------------------------- metrics


async def supervisor_processes(runtime_dir: str) -> list[dict] | None:
    """The supervisor's process table, or None (no supervisor, no answer)."""
    status = await supervisor_status(runtime_dir)
    processes = status.get("processes") if status is not None else None
    return processes if isinstance(processes, list) else None


async def follow_telemetry(sock: zmq.asyncio.Socket, metrics: Metrics, view: WebView, link: ComputeLink) -> None:
    """Telemetry's feed (the one `tail` reads): counted for /metrics and passed to the web page's browsers."""
    while True:
        frame = await sock.recv()
        try:
            msg = m.decode(frame)
        except m.ProtocolError:
            continue  # a tail-only frame we cannot read is no reason to stop counting
        if isinstance(msg, m.TokenRecord):
            metrics.on_record(msg)
            view.feed.on_record(msg, link.pid)
        elif isinstance(msg, m.PromptProgress):
            view.feed.on_prompt(msg)
        elif isinstance(msg, m.SlotStates):
            metrics.on_slots(msg)
            view.feed.on_slots(msg)


# ------------------------------------------------------------------ the service


def client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


class Gateway:
    """The app's state: the config and the run's facts, tokenizer, queue, worker and links."""

    def __init__(self, config: Config, facts: RunFacts, tokenizer: Tokenizer, http_limits: HttpLimits = DEFAULT_LIMITS):
        self.config, self.facts, self.http_limits, self.tok = config, facts, http_limits, tokenizer
        self.defaults = ConfigDefaults(config, facts.model_name)
        self.framing = framing_for(tokenizer)  # how replies frame reasoning and tool calls (shared/text/reasoning.py)
        self.metrics = Metrics()
        self.queue = RequestQueue(config.gateway.queue_size)
        self.started = int(time.time())
        # One thread: templates render one at a time, and the event loop never does it.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # For refuse_unfit_text; 0.7 s over a 150k vocabulary, so it runs in the pool, ahead of any request.
        self.longest_token: Future[int] = self.tokenize_pool.submit(longest_token_bytes, tokenizer)
        self.site: LimitedSite | None = None  # counts the open connections, for /metrics (set by serve)
        self.ctx: zmq.asyncio.Context | None = None
        self.link: ComputeLink | None = None
        self.workers: list[Worker] = []  # one, or gateway.parallel: one a compute slot
        self.tasks: list[asyncio.Task] = []
        self.web = WebView(self)  # the page at / and its event stream (procs/gateway_events.py)

    # -- lifetime (aiohttp signals) ----------------------------------------------
    async def start(self, app: web.Application) -> None:
        self.ctx = zmq.asyncio.Context()
        ep = ipc.Endpoints(Path(self.facts.runtime_dir))
        n = self.config.gateway.parallel
        self.link = ComputeLink(self.ctx, ep, n)
        self.workers = [Worker(self.link, self.queue, self.http_limits.restart_wait_s, self.metrics, i) for i in range(n)]
        telemetry = cast(zmq.asyncio.Socket, ipc.connect(self.ctx, ep, "telemetry_pub"))
        self.tasks = [
            asyncio.create_task(c)
            for c in (
                self.link.receive_forever(),
                *(w.run_forever() for w in self.workers),
                follow_telemetry(telemetry, self.metrics, self.web, self.link),
                self.web.residency_loop(),
                self.web.status_loop(),
            )
        ]

    async def stop_serving(self, app: web.Application) -> None:
        failure = Failed(503, "the service is shutting down", "shutting_down")
        self.queue.close(failure)
        self.web.close()  # the page's event streams end, so shutdown does not wait on them
        for worker in self.workers:
            await worker.abandon(failure)

    async def close(self, app: web.Application) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=SHUTDOWN_GRACE_S)
        if self.ctx is not None:
            self.ctx.destroy(linger=0)  # closes every socket of ours
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # -- plain endpoints -----------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.link is not None and self.link.ready():
            return json_response({"status": "ok", "version": __version__})
        return json_response({"status": "loading", "version": __version__}, 503)

    def _model(self) -> dict:
        return {"id": self.facts.model_name, "object": "model", "created": self.started, "owned_by": "moe-pipe", "version": __version__}

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["name"] != self.facts.model_name:
            raise ApiError(404, f"the model '{request.match_info['name']}' does not exist", "model_not_found")
        return json_response(self._model())

    async def metrics_text(self, request: web.Request) -> web.Response:
        processes = await supervisor_processes(self.facts.runtime_dir)
        connections = self.site.open if self.site is not None else 0
        warming = read_warm_progress(self.facts.runtime_dir)  # the reader's warm start (a small file in the runtime folder)
        slots = (len(self.workers), sum(w.current is not None for w in self.workers))
        ready = self.link is not None and self.link.ready()
        text = self.metrics.render(ready, self.queue.waiting(), processes, connections, warming, slots)
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- slots: llama.cpp's server API for compute's session ------------------------
    async def slots(self, request: web.Request) -> web.Response:
        """GET /slots: each of the gateway.parallel slots, llama.cpp's shape (docs/api.md § Slots):
        compute's slots, the numbers `id_slot` and the actions take, each with the request it
        serves as compute last said; before compute has said (or with one slot), the workers'."""
        states = self.metrics.slot_states
        if states is None or self.config.gateway.parallel == 1:
            return json_response([self._slot(w, w.slot) for w in self.workers])
        by_request = {w.req_id: w for w in self.workers if w.current is not None and w.current.slot is None}
        return json_response([self._slot(by_request.get(req) if req else None, i) for i, req in enumerate(states.req_ids)])

    def _slot(self, w: Worker | None, id_slot: int) -> dict:
        """Slot id_slot, serving w's request (None, or a worker without a generation: idle)."""
        job = w.current if w is not None else None
        slot: dict[str, object] = {"id": id_slot, "id_task": -1, "n_ctx": self.config.compute.ctx_size, "is_processing": False, "state": 0}
        if w is None or job is None or job.slot is not None:  # llama.cpp's SLOT_STATE: 0 idle, 1 processing
            return {**slot, "n_prompt_tokens": 0, "n_decoded": 0}
        slot.update(id_task=w.req_id, is_processing=True, state=1, n_prompt_tokens=len(job.prompt_tokens))
        slot["n_decoded"] = w.decoded  # text pieces streamed so far: a token each, but for text a stop string held back
        p = w.progress
        if p is not None:  # the prompt as compute last said: the stream's prompt_progress, and how much of it is done
            slot["prompt_progress"] = {"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms}
            slot["phase"] = "prompt" if p.processed < p.total else "decoding"
        else:
            slot["phase"] = "waiting"  # sent to compute, its prompt not begun (another slot's pass, or a restart)
        return slot

    def check_slot(self, id_slot: int) -> int:
        """A compute slot's number, refused with a 400 past the slots there are (gateway.parallel)."""
        n = self.config.gateway.parallel
        if not 0 <= id_slot < n:
            slots = "only slot 0 (gateway.parallel is 1)" if n == 1 else f"slots 0-{n - 1} (gateway.parallel is {n})"
            raise ApiError(400, f"'id_slot' {id_slot} is not a slot of this service: it has {slots}", "invalid_value", param="id_slot")
        return id_slot

    async def slot(self, request: web.Request) -> web.Response:
        """POST /slots/{id}?action=save|restore (body {"filename": NAME}) or
        ?action=erase on compute slot id's session: through the queue like a generation,
        so it never lands in the middle of one (docs/api.md § Slots)."""
        action = request.query.get("action", "")
        if action not in SLOT_ACTIONS:
            raise ApiError(400, f"'action' must be {', '.join(SLOT_ACTIONS)}; got {action!r}", "invalid_value", param="action")
        raw = request.match_info["id"]
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 6):
            raise ApiError(400, f"a slot is a number: got {raw[:20]!r}", "invalid_value", param="id_slot")
        id_slot = self.check_slot(int(raw))
        slot_save_path = self.config.gateway.slot_save_path
        if not slot_save_path:
            raise ApiError(
                501,
                "slot actions are off: start the service with a folder for them (gateway.slot_save_path, --slot-save-path DIR)",
                "not_supported",
                "not_supported_error",
            )
        name, path = "", ""
        if action != "erase":
            name = slot_filename(parse_body(await read_body(request, self.http_limits.body_timeout_s)))
            folder = Path(slot_save_path)
            folder.mkdir(parents=True, exist_ok=True)
            path = str(folder / name)
            if action == "restore" and not Path(path).is_file():
                raise ApiError(404, f"no saved slot named {name!r} in gateway.slot_save_path", "not_found", param="filename")
        job = Job([], 0, {}, (), slot=(action, path, id_slot))
        self.queue.offer(job)
        async for event in self.events(request, job):
            if isinstance(event, Failed):
                return error_response(event.error())
            if isinstance(event, Finished):
                t = event.timings
                ms = {k: t[k] for k in ("save_ms", "restore_ms") if k in t}
                figures = {k: v for k, v in t.items() if k.startswith("n_")}
                return json_response(
                    {"id_slot": id_slot, **({"filename": name} if name else {}), **figures, **({"timings": ms} if ms else {})}
                )
        raise ClientGone()  # not reached: events() ends with an end event or raises

    # -- completions -------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=False)

    async def complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            req = parse_request(parse_body(await read_body(request, self.http_limits.body_timeout_s)), chat, self.defaults)
            id_slot = None if req.id_slot is None else self.check_slot(req.id_slot)
            prompt = await self.tokenize(req)
            job = Job(
                prompt,
                fit_max_tokens(req, len(prompt), self.defaults),
                req.sampling,
                req.stop,
                grammar=req.grammar,
                cache_prompt=req.cache_prompt,
                progress=req.stream and req.return_progress,  # as llama.cpp's server: streams only
                draft=req.draft,
                id_slot=id_slot,
            )
            check_wire(job, "messages" if chat else "prompt")
            self.queue.offer(job)
        except ApiError as err:
            self.count(err.status)
            raise
        except ConnectionError:  # it hung up while sending its body
            self.metrics.requests["cancelled"] += 1
            return web.Response(status=499)
        output = ChatOutput(self.framing, self.tok.decode(prompt[-PROMPT_TAIL_TOKENS:]), bool(req.tools)) if chat else None
        shape = ResponseShape(chat, self.facts.model_name, req.include_usage, output)
        try:
            if req.stream:
                return await self.stream(request, job, shape)
            return await self.collect(request, job, shape)
        except (ClientGone, ConnectionError):
            if not job.ended:  # else it was answered (and counted) in full
                job.cancelled = True  # the worker sends Cancel, or skips the job if it still waits
                if self.link is not None:
                    self.link.poke()  # now, not at its next poll: a Stop ends a prompt within a second
                self.metrics.requests["cancelled"] += 1
            return web.Response(status=499)  # nobody reads it

    async def tokenize(self, req: CompletionRequest) -> list[int]:
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self._tokenize, req)
        except UserError as exc:  # the chat template refused the conversation
            raise ApiError(400, str(exc), "invalid_messages", param="messages") from None

    def _tokenize(self, req: CompletionRequest) -> list[int]:
        """In the tokenize thread: chat_prompt_tokens, with the text checked
        between rendering and encoding (a text that cannot fit is not encoded)."""
        if req.chat:
            text = render_chat(
                self.tok,
                list(req.messages),
                add_generation_prompt=True,
                no_think=self.config.generate.no_think,
                tools=list(req.tools) or None,
                **cast(dict[str, Any], req.template_vars),
            )
        else:
            text = req.prompt
        refuse_unfit_text(text, self.longest_token.result(), self.defaults, "messages" if req.chat else "prompt")
        return encode_prompt(self.tok, text)

    async def events(self, request: web.Request, job: Job) -> AsyncIterator[Event]:
        """The job's events until its end; ClientGone when the client leaves first."""
        while True:
            job.wake.clear()
            while job.events:
                event = job.events.popleft()
                yield event
                if isinstance(event, (Finished, Failed)):
                    return
            if client_gone(request):
                raise ClientGone()
            await wait_event(job.wake, POLL_S)

    async def collect(self, request: web.Request, job: Job, shape: ResponseShape) -> web.Response:
        pieces: list[str] = []
        async for event in self.events(request, job):
            if isinstance(event, str):
                pieces.append(event)
            elif isinstance(event, m.PromptProgress):
                continue  # a whole response has no progress: the job never asks for it
            elif isinstance(event, Failed):
                self.count(event.status)
                return error_response(event.error())
            else:
                self.count(200)
                usage = usage_of(len(job.prompt_tokens), event.completion_tokens, event.prompt_cached)
                resp = json_response(shape.whole("".join(pieces), event.finish_reason, usage, event.timings))
                await self.write(request, resp, None)
                return resp
        raise ClientGone()  # not reached: events() ends with an end event or raises

    async def stream(self, request: web.Request, job: Job, shape: ResponseShape) -> web.StreamResponse:
        """SSE. Headers go out with the first event (text, or the prompt's
        progress when asked for), so a request that fails before any (no
        compute came in time) still gets a real status."""
        resp: web.StreamResponse | None = None
        async for event in self.events(request, job):
            if resp is None:
                if isinstance(event, Failed):
                    self.count(event.status)
                    return error_response(event.error())
                resp = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
                )
                await self.write(request, resp, b"".join(sse(chunk) for chunk in shape.opening()))
            if isinstance(event, str):
                chunks = shape.chunks(event)  # none while the reply splitter holds a partial marker back
                if chunks:
                    await self.write(request, resp, b"".join(sse(chunk) for chunk in chunks))
            elif isinstance(event, m.PromptProgress):
                await self.write(request, resp, sse(shape.progress_chunk(event.total, event.cache, event.processed, event.time_ms)))
            elif isinstance(event, Failed):  # the status is sent: the error becomes an event
                self.count(event.status)
                await self.write(request, resp, sse(event.error().body()))
            else:
                self.count(200)
                closing = [sse(chunk) for chunk in shape.closing(event.finish_reason, event.timings)]
                if shape.include_usage:
                    usage = usage_of(len(job.prompt_tokens), event.completion_tokens, event.prompt_cached)
                    closing.append(sse(shape.usage_chunk(usage)))
                await self.write(request, resp, b"".join(closing) + b"data: [DONE]\n\n")
        if resp is None:
            raise ClientGone()  # not reached: events() ends with an end event or raises
        await self.write(request, resp, None)
        return resp

    async def write(self, request: web.Request, resp: web.StreamResponse, data: bytes | None) -> None:
        await write_within(request, resp, data, self.http_limits.write_timeout_s)

    def count(self, status: int) -> None:
        outcome = {200: "ok", 429: "rejected", 503: "unavailable"}.get(status)
        self.metrics.requests[outcome or ("invalid" if status < 500 else "failed")] += 1


# ------------------------------------------------------------------ middlewares


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """Every error in OpenAI's shape, aiohttp's own (404 route, 405) included."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", None, kind, headers=headers))
    except Exception:  # noqa: BLE001 - a bug fails this request with a 500, the server keeps going
        log.exception("%s %s failed", request.method, request.path)
        return error_response(ApiError(500, "internal error in the gateway (see the service log)", "internal", "server_error"))


def require_key(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        # a slot action writes files, the event stream shows the config and the engine: keyed too; the page itself is not (it asks)
        if request.path in ("/v1", "/events") or request.path.startswith(("/v1/", "/slots")):
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):  # constant time: the key cannot be guessed byte by byte
                raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "invalid_api_key")
        return await handler(request)

    return check_key


# ------------------------------------------------------------------ entry points

GATEWAY = web.AppKey("gateway", Gateway)


def load_tokenizer(model_path: str) -> Tokenizer:
    with open_model(model_path) as mf:
        return Tokenizer.from_gguf(mf.gguf)


def longest_token_bytes(tok: Tokenizer) -> int:
    return max((len(tok.token_bytes(i)) for i in range(tok.n_vocab)), default=1)


async def create_app(
    config: Config, facts: RunFacts, tokenizer: Tokenizer | None = None, http_limits: HttpLimits = DEFAULT_LIMITS
) -> web.Application:
    """The HTTP app; its background tasks start with it and stop at cleanup."""
    tok = use_chat_template(tokenizer or load_tokenizer(facts.model_path), config.generate.chat_template)
    gateway = Gateway(config, facts, tok, http_limits)
    g = config.gateway
    middlewares = [errors_as_json] + ([loopback_only] if is_loopback(g.host) else []) + ([require_key(g.api_key)] if g.api_key else [])
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/v1/models/{name}", gateway.model)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.metrics_text)
    app.router.add_post("/slots/{id}", gateway.slot)
    app.router.add_get("/slots", gateway.slots)
    add_routes(app, gateway.web)
    app.on_startup.append(gateway.start)
    app.on_shutdown.append(gateway.stop_serving)  # after the listener closes, before handlers are awaited
    app.on_cleanup.append(gateway.close)
    app[GATEWAY] = gateway
    return app


async def serve(config: Config, facts: RunFacts, http_limits: HttpLimits) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # child_setup ignores SIGINT: the supervisor stops us in order
            loop.add_signal_handler(sig, stop.set)
    app = await create_app(config, facts, http_limits=http_limits)
    g, limits = config.gateway, http_limits
    # keepalive_timeout: aiohttp arms it after each answer (3.14: also when a connection opens) and closes
    # the connection if no whole request (headers) has come by then: the idle and slow-headers timeout.
    runner = web.AppRunner(
        app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S, keepalive_timeout=limits.idle_timeout_s, lingering_time=LINGER_S
    )
    await runner.setup()
    address_file = Path(facts.runtime_dir) / service.GATEWAY_FILE
    try:
        site = app[GATEWAY].site = LimitedSite(runner, g.host, g.port, limits.max_connections, limits.idle_timeout_s, app[GATEWAY].metrics)
        try:
            await site.start()
        except OSError as exc:
            raise UserError(f"gateway: cannot listen on {g.host}:{g.port}: {exc.strerror or exc}") from None
        host, port = runner.addresses[0][:2]
        address = service.GatewayAddress(host, port, os.getpid())
        service.write_gateway_address(Path(facts.runtime_dir), address)
        log.info("listening on %s", address.url)
        await stop.wait()
        log.info("stopping; %d waiting request(s) get 503", app[GATEWAY].queue.waiting())
    finally:
        await runner.cleanup()
        ours = service.read_gateway_address(Path(facts.runtime_dir))
        if ours is not None and ours.pid == os.getpid():  # a stale address would send clients to nobody
            address_file.unlink(missing_ok=True)


def main(config: Config, facts: RunFacts, http_limits: HttpLimits = DEFAULT_LIMITS) -> None:
    """The gateway child of `moe-pipe up`. A port in use or an unreadable
    model is a UserError with one line that says so (the supervisor shows it)."""
    child_setup("gateway")
    import uvloop

    uvloop.run(serve(config, facts, http_limits))
