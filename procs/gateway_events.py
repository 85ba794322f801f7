"""The web page of `moe-pipe up` (docs/web.md): its static files and its one
server-sent-events stream, `GET /events`, in the gateway process.

    telemetry ──PUB──► follow_telemetry ─► Feed.on_record, on_prompt, on_slots ─┐
    residency index (shm, read-only) ─► residency_loop ─────────────────────────┼─► Feed.publish ─► each browser's
    supervisor `status` (control socket) ─► status_loop ────────────────────────┘    bounded queue ─► its handler ─► SSE

The feed never waits on a browser: publish() appends one frame to every
client's queue, a deque of at most CLIENT_QUEUE frames that drops its oldest
when full, and wakes the client's handler, which writes what is queued. A
browser that stops reading costs at most its queue and the socket's buffers;
its handler blocks in write (bounded by gateway.write_timeout_s, then the
connection is dropped) while telemetry and compute go on (the gateway's
telemetry subscription drops too: ipc's PUB never blocks its sender).

The residency and status loops run only while some browser is connected.
The heatmap's pinned and in-flight cells come from the states the reader keeps
beside the index (shared/experts/residency.py): read from shared memory like
the index, never asked of the reader.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import orjson
import zmq
from aiohttp import web

from ..shared.config import Config
from ..shared.errors import UserError
from ..shared.experts.budget import probe_memory
from ..shared.experts.residency import INFLIGHT, PINNED, ResidencyIndex
from ..shared.experts.shm import segment_name
from ..shared.gguf.model_file import open_model
from ..shared.gguf.spec import kv_cache_bytes
from ..shared.serve import service
from ..shared.serve.http_guard import ClientGone, HttpLimits, write_within
from ..shared.wire import messages as m
from .gateway_worker import ComputeLink, RequestQueue, wait_event
from .run_facts import RunFacts


class PageSource(Protocol):
    """What the page reads of the gateway that owns it (procs/gateway.py `Gateway`)."""

    config: Config
    facts: RunFacts
    http_limits: HttpLimits
    queue: RequestQueue
    link: ComputeLink | None


log = logging.getLogger("moe_pipe.gateway")

CLIENT_QUEUE = 256  # frames a browser may fall behind before its oldest are dropped (~100 KB)
HISTORY = 300  # token rows a newly opened page starts its charts with
FIRST_TOKENS = 16  # the "first tokens" panel: the warm-up of each compute
RESIDENCY_S = 0.25  # the heatmap's refresh
STATUS_S = 1.0  # processes and memory
KEEPALIVE_S = 10.0  # a comment line this often: a dead connection is noticed, proxies keep it open
STATUS_TIMEOUT_MS = 1_000
WEB_FILES = {  # name -> content type; nothing else is served
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
# No inline script or style, no eval, nothing from elsewhere; the page may only fetch from its own origin.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def sse_frame(kind: str, data: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data, default=str) + b"\n\n"


def token_row(rec: m.TokenRecord, now: float) -> dict[str, Any]:
    """What the page draws of one TokenRecord (docs/telemetry.md for the columns)."""
    return {
        "t": round(now, 3),
        "step": rec.step,
        "req_id": rec.req_id,
        "wall_ms": round(rec.wall_ms, 3),
        "compute_ms": round(rec.compute_ms, 3),
        "io_ms": round(rec.io_ms, 3),
        "stall_ms": round(rec.stall_ms, 3),
        "read_bytes": rec.read_bytes,
        "hit_pct": round(rec.cache_hit_pct, 2),
        "hits": rec.hits,
        "misses": rec.misses,
        "rss_bytes": rec.rss_bytes,
        "resident_bytes": rec.resident_bytes,
    }


class Client:
    """One browser's queue: bounded, the oldest frame dropped when full."""

    def __init__(self, cap: int):
        self.queue: deque[bytes] = deque(maxlen=cap)
        self.wake = asyncio.Event()
        self.dropped = 0

    def put(self, frame: bytes) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.dropped += 1
        self.queue.append(frame)
        self.wake.set()

    def take(self) -> bytes:
        data = b"".join(self.queue)
        self.queue.clear()
        return data


class Feed:
    """The browsers and what a new one is sent first (history, last snapshots)."""

    def __init__(self, cap: int = CLIENT_QUEUE):
        self.cap = cap
        self.clients: set[Client] = set()
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.first: list[dict] = []  # the first token rows of the compute that runs now
        self.first_of: int | None = None  # that compute's pid
        self.last: dict[str, bytes] = {}  # the latest residency and status frames
        self.closed = False

    def join(self) -> Client:
        client = Client(self.cap)
        self.clients.add(client)
        return client

    def leave(self, client: Client) -> None:
        self.clients.discard(client)

    def publish(self, kind: str, data: Any, keep: bool = False) -> None:
        """To every browser, never waiting: a full queue drops its oldest frame."""
        frame = sse_frame(kind, data)
        if keep:
            self.last[kind] = frame
        for client in self.clients:
            client.put(frame)

    def on_record(self, rec: m.TokenRecord, compute_pid: int | None) -> None:
        row = token_row(rec, time.time())
        if compute_pid != self.first_of:  # a (re)started compute warms up again: its first tokens
            self.first, self.first_of = [], compute_pid
        if len(self.first) < FIRST_TOKENS:
            self.first.append(row)
        self.history.append(row)
        self.publish("token", row)

    def on_prompt(self, p: m.PromptProgress) -> None:
        """A prompt's progress, any client's (the page's own chat also reads its stream's)."""
        self.publish("prompt", {"req_id": p.req_id, "total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms})

    def on_slots(self, states: m.SlotStates) -> None:
        """What compute's slots are doing (gateway.parallel above 1); a page opened later gets the last."""
        self.publish("slots", {"slots": states.rows(), "held": states.pool_held, "pool": states.pool}, keep=True)

    def close(self) -> None:
        """The gateway stops: every stream ends."""
        self.closed = True
        for client in self.clients:
            client.wake.set()


@dataclass(frozen=True)
class PageFacts:
    """What the web page shows of the model: its shape (the heatmap's layers and
    experts, the model's own experts per token) and what its dense weights and KV cache take of the memory."""

    n_layer: int
    n_expert: int
    n_expert_used: int
    dense_bytes: int
    kv_bytes: int | None

    @classmethod
    def read(cls, model_path: str, ctx_size: int, kv_type: str) -> PageFacts:
        with open_model(model_path) as mf:
            spec = mf.spec
            try:
                kv: int | None = kv_cache_bytes(spec, ctx_size, kv_type)
            except (UserError, KeyError):
                kv = None
            return cls(spec.n_layer, spec.n_expert, spec.n_expert_used, mf.layout.dense_bytes, kv)


def memory_limits() -> dict[str, Any]:
    """The machine's RAM and the tightest enclosing cgroup limit (shared/experts/budget.py)."""
    import psutil

    probe = probe_memory()
    tight = min(probe.cgroups, key=lambda c: c.limit_bytes, default=None)
    return {"host_total_bytes": int(psutil.virtual_memory().total), "cgroup_limit_bytes": tight.limit_bytes if tight else None}


class Residency:
    """The residency index, attached read-only once the supervisor's segment is found."""

    def __init__(self, runtime_dir: str, facts: PageFacts):
        self.runtime_dir, self.facts = runtime_dir, facts
        self.index: ResidencyIndex | None = None
        self.prev: np.ndarray | None = None

    def attach(self) -> bool:
        if self.index is not None:
            return True
        info = service.read_service_info(Path(self.runtime_dir))
        if info is None:  # no supervisor (a gateway on its own, as in tests): no index to show
            return False
        try:
            self.index = ResidencyIndex.attach(segment_name("index", info.pid), self.facts)
        except (OSError, ValueError):
            return False
        return True

    def snapshot(self) -> dict[str, Any] | None:
        """Resident, pinned and in-flight cells as bitmasks, and those that landed since the last snapshot."""
        if not self.attach():
            return None
        assert self.index is not None
        now = self.index.table.copy()  # one copy of each: the reader keeps writing
        states = self.index.states.copy()
        resident = now > 0
        pinned = (states & PINNED) != 0  # as the reader's slab table counts them: its in-flight reads hold a pin too
        inflight = (states & INFLIGHT) != 0
        landed = resident & ((self.prev != now) if self.prev is not None else np.zeros_like(resident))
        self.prev = now
        return {
            "layers": self.facts.n_layer,
            "experts": self.facts.n_expert,
            "resident": _bitmask(resident),
            "pinned": _bitmask(pinned),
            "inflight": _bitmask(inflight),
            "landed": _bitmask(landed),
            "count": int(resident.sum()),
            "pinned_count": int(pinned.sum()),
            "inflight_count": int(inflight.sum()),
        }

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
            self.index = None


def _bitmask(cells: np.ndarray) -> str:
    """A bit per cell, layer-major, first cell in the high bit, as base64 (the page's bitAt)."""
    return base64.b64encode(np.packbits(cells, axis=None).tobytes()).decode()


def _static(name: str) -> bytes:
    return resources.files("moe_pipe.shared.serve").joinpath("web", name).read_bytes()


class WebView:
    """The page's handlers and the loops that feed it; the Gateway owns one."""

    def __init__(self, gateway: PageSource):
        self.gw = gateway
        self.feed = Feed()
        self.files = {name: _static(name) for name in WEB_FILES}  # read once: the package does not change under us
        self.facts: PageFacts | None = None
        self.residency: Residency | None = None
        self.limits: dict[str, Any] = {}

    # -- static files ------------------------------------------------------------------
    async def page(self, request: web.Request) -> web.Response:
        name = request.match_info.get("name") or "index.html"
        if name not in WEB_FILES:
            raise web.HTTPNotFound()
        return web.Response(body=self.files[name], headers={**PAGE_HEADERS, "Content-Type": WEB_FILES[name]})

    # -- the event stream --------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        facts = self.facts
        return {
            "model": self.gw.facts.model_name,
            "layers": facts.n_layer if facts else None,
            "experts": facts.n_expert if facts else None,
            # what the run uses and the model's own: the page labels a difference lossy
            "n_expert_used": (self.gw.config.compute.n_expert_used or facts.n_expert_used) if facts else None,
            "n_expert_used_model": facts.n_expert_used if facts else None,
            "config": self.gw.config.to_dict(),  # secrets REDACTED (shared/config.py to_dict)
            "history": list(self.feed.history),
            "first": self.feed.first,
        }

    async def events(self, request: web.Request) -> web.StreamResponse:
        """GET /events: hello (config, history, first tokens), then token,
        residency and status events as they come (docs/web.md § Events)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        client = self.feed.join()
        try:
            client.put(sse_frame("hello", self.hello()))
            for frame in list(self.feed.last.values()):
                client.put(frame)
            while not self.feed.closed:
                if not client.queue:
                    client.wake.clear()
                    await wait_event(client.wake, KEEPALIVE_S)
                    if self.feed.closed:
                        break
                    if not client.queue:
                        client.put(b": keep-alive\n\n")
                if request.transport is None or request.transport.is_closing():
                    break
                await write_within(request, resp, client.take(), self.gw.http_limits.write_timeout_s)
            if resp.prepared:
                await write_within(request, resp, None, self.gw.http_limits.write_timeout_s)
        except (ClientGone, ConnectionError):
            pass
        finally:
            self.feed.leave(client)
        return resp

    # -- the loops (gateway tasks) -----------------------------------------------------
    async def residency_loop(self) -> None:
        loop = asyncio.get_running_loop()
        run, c = self.gw.facts, self.gw.config.compute
        try:
            self.facts = await loop.run_in_executor(None, PageFacts.read, run.model_path, c.ctx_size, c.kv_type)
            self.limits = await loop.run_in_executor(None, memory_limits)
        except (OSError, UserError) as exc:
            log.warning("web view: cannot read the model's shape (%s); no heatmap", exc)
            return
        self.residency = Residency(run.runtime_dir, self.facts)
        last: dict[str, Any] | None = None
        while True:
            await asyncio.sleep(RESIDENCY_S)
            if not self.feed.clients:
                continue
            snap = self.residency.snapshot()
            if snap is not None and (snap != last or "residency" not in self.feed.last):
                self.feed.publish("residency", snap, keep=True)
                last = snap

    async def status_loop(self) -> None:
        while True:
            await asyncio.sleep(STATUS_S)
            if self.feed.clients:
                self.feed.publish("status", await self.status(), keep=True)

    async def status(self) -> dict[str, Any]:
        """The supervisor's `status` (processes, budget; None without one), the gateway's own view, memory."""
        sup = await supervisor_status(self.gw.facts.runtime_dir)
        link, facts = self.gw.link, self.facts
        return {
            "supervisor": sup,
            "compute_ready": bool(link is not None and link.ready()),
            "compute_pid": link.pid if link is not None else None,
            "queue": self.gw.queue.waiting(),
            "memory": {
                **self.limits,
                "dense_bytes": facts.dense_bytes if facts else None,
                "kv_bytes": facts.kv_bytes if facts else None,
            },
            "dropped": sum(c.dropped for c in self.feed.clients),
            "first": self.feed.first,
        }

    def close(self) -> None:
        self.feed.close()
        if self.residency is not None:
            self.residency.close()


async def supervisor_status(runtime_dir: str) -> dict | None:
    """The supervisor's whole `status` data (what `moe-pipe status --json` shows), or None."""
    info = service.read_service_info(Path(runtime_dir))
    if info is None:
        return None
    ask = partial(service.control, info, "status", timeout_ms=STATUS_TIMEOUT_MS)
    try:  # control() blocks: a thread, so the event loop never waits on it
        async with asyncio.timeout(STATUS_TIMEOUT_MS / 1e3 + 0.5):
            status = await asyncio.get_running_loop().run_in_executor(None, ask)
    except (TimeoutError, UserError, zmq.ZMQError, m.ProtocolError, OSError):
        return None
    return dict(status.data) if status.ok else None


def add_routes(app: web.Application, view: WebView) -> None:
    app.router.add_get("/", view.page)
    app.router.add_get("/web/{name}", view.page)
    app.router.add_get("/events", view.events)
