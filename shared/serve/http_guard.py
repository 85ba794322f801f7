"""The gateway's guards against its HTTP clients: what a hostile or broken
client may cost, and who may call a gateway bound to loopback.

    accept ─LimitedSite─► past max_connections: Refusal (a canned 503, then closed)
              │
              └─► Counted(aiohttp's handler): first request's headers within idle_timeout_s
                    ─► loopback_only (Host, Origin) ─► read_body (size, body_timeout_s)
                    ─► ... ─► write_within (write_timeout_s) ─► the client

A hostile or broken client costs bounded time and memory and never holds the
compute: bodies over MAX_BODY_BYTES are refused on their Content-Length; a
connection must finish its request headers within idle_timeout_s of opening
(Counted) or of its last answer (aiohttp's keep-alive timer), and its body
within body_timeout_s; a client that reads nothing of its answer for write_timeout_s
is gone (Cancel to compute); past max_connections a new connection gets a
canned 503 (LimitedSite).

No OpenAI semantics (shared/serve/openai_api.py) and no compute link here:
procs/gateway.py wires these into its app and runner.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from .hosts import is_loopback
from .metrics import Metrics
from .openai_api import ApiError

MAX_BODY_BYTES = 4 << 20  # far above any context window's worth of text
# Slow clients (settings defaults; a config key each would be gateway.*):
IDLE_TIMEOUT_S = 15.0  # request headers must arrive this soon after connecting or after the last answer
BODY_TIMEOUT_S = 30.0  # for the whole body: 4 MiB at 140 KB/s, slower than any link to a local service
WRITE_TIMEOUT_S = 30.0  # an answer that cannot be written this long: the client stopped reading
MAX_CONNECTIONS = 256  # open at once; each idle one costs a descriptor and ~10 KB until the idle timeout


@dataclass(frozen=True)
class HttpLimits:
    """How long and how many the HTTP side allows (the figures above), and how long a request waits for a restarted compute. Not config
    keys (docs/api.md § Limits and slow clients): the defaults stand in the
    service; tests shorten them."""

    restart_wait_s: float = 60.0
    max_connections: int = MAX_CONNECTIONS
    idle_timeout_s: float = IDLE_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    write_timeout_s: float = WRITE_TIMEOUT_S


LINGER_S = 2.0  # after an early answer (413, 408), the unread body is drained this long, then the socket closes
REFUSAL_WAIT_S = 1.0  # a refused connection gets its 503, then this long to hang up before we close it
RETRY_AFTER_S = 1


class ClientGone(Exception):
    """The HTTP client closed its connection."""


# ------------------------------------------------------------- body and answer


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    too_large = ApiError(413, f"the request body is over the {MAX_BODY_BYTES >> 20} MiB limit", "body_too_large")
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise too_large  # on the header, before any of it is read
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:  # chunked: no length to check in advance
        raise too_large from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", "body_timeout") from None


async def write_within(request: web.Request, resp: web.StreamResponse, data: bytes | None, timeout_s: float) -> None:
    """Send `data` (None: the end), headers first if not yet sent. Bounded:
    a client that has read nothing for `timeout_s` (its socket buffers are
    full) is gone, so the handler ends and compute gets a Cancel."""
    try:
        async with asyncio.timeout(timeout_s):
            if not resp.prepared:
                await resp.prepare(request)
            if data is None:
                await resp.write_eof()
            elif data:
                await resp.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()  # drop the output it will never read
        raise ClientGone() from None


# ------------------------------------------------------------------- loopback


def _hostname(url: str) -> str:
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


@web.middleware
async def loopback_only(request: web.Request, handler) -> web.StreamResponse:
    """A gateway bound to loopback answers requests made to loopback by local
    programs and local pages only. A web page elsewhere can make the user's
    browser send requests here: with a rebound DNS name (Host is its own
    domain) it could read the answers; from any origin it could make the
    model burn the battery (a text/plain POST needs no CORS preflight).
    Programs send no Origin; browsers always do on a cross-origin POST."""
    host = request.headers.get("Host")
    if host is not None and not is_loopback(_hostname("//" + host)):
        raise ApiError(
            403,
            f"the request was made to '{host[:60]}', not to this machine's loopback address; the "
            "gateway listens on loopback only (a DNS-rebinding guard)",
            "host_not_allowed",
        )
    origin = request.headers.get("Origin")
    if origin is not None and not is_loopback(_hostname(origin)):
        raise ApiError(
            403,
            f"requests from web pages of '{origin[:60]}' are not allowed; only pages served from this "
            "machine (localhost) may call the gateway",
            "origin_not_allowed",
        )
    return await handler(request)


# ------------------------------------------------------------- connection limit


@runtime_checkable
class StreamTransport(Protocol):
    """What Refusal writes through: asyncio's TCP transport and uvloop's both
    have it, but uvloop's do not subclass asyncio.WriteTransport, so this is
    checked by shape."""

    def write(self, data: bytes) -> None: ...
    def write_eof(self) -> None: ...
    def close(self) -> None: ...


class Refusal(asyncio.Protocol):
    """A connection past max_connections: a canned 503, then closed. The
    answer goes out at once and our side shuts; what the client sends is read
    and dropped until it hangs up (at most REFUSAL_WAIT_S), so the answer
    reaches it before the close (closing over unread input sends a reset).
    In a flood, past `limit` refusals waiting so, the next is closed at once."""

    def __init__(self, site: LimitedSite):
        self.site = site
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, StreamTransport):  # create_server gives stream transports only
            raise TypeError(f"Refusal needs a stream transport, got {type(transport).__name__}")
        self.site.metrics.connections_refused += 1
        self.site.refusing += 1
        transport.write(self.site.refusal)
        if self.site.refusing > self.site.limit:
            transport.close()
            return
        transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_WAIT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.site.refusing -= 1
        if self.timer is not None:
            self.timer.cancel()


def refusal_response(limit: int) -> bytes:
    body = orjson.dumps(
        ApiError(503, f"too many open connections (the gateway takes {limit}); retry later", "too_many_connections", "server_error").body()
    )
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Retry-After: %d\r\nConnection: close\r\n\r\n%s" % (len(body), RETRY_AFTER_S, body)
    )


class Counted(asyncio.Protocol):
    """aiohttp's request handler, counted from its creation to its connection's
    end (aiohttp's own list gains a connection only in connection_made, which
    uvloop runs a loop turn after the accept: a burst would pass the cap), and
    closed if its first request's headers are not in within the idle timeout.
    aiohttp's keep-alive timer bounds the headers of later requests; it covers
    the first one only from aiohttp 3.14 on."""

    def __init__(self, inner: asyncio.Protocol, site: LimitedSite):
        self.inner, self.site = inner, site
        self.first_headers: asyncio.TimerHandle | None = None
        self.tail = b""  # the last bytes read, for a blank line split across reads
        site.open += 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.first_headers = asyncio.get_running_loop().call_later(self.site.idle_timeout_s, transport.close)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.first_headers is not None:
            seen = self.tail + data
            if b"\r\n\r\n" in seen:
                self.first_headers.cancel()
                self.first_headers = None
            self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.site.open -= 1
        if self.first_headers is not None:
            self.first_headers.cancel()
        self.inner.connection_lost(exc)


class LimitedSite(web.BaseSite):
    """aiohttp's TCPSite with a cap: a connection past `limit` open ones gets
    a Refusal instead of a request handler, so idle sockets cannot use up the
    process's descriptors (and with them the zmq sockets to compute)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, limit: int, idle_timeout_s: float, metrics: Metrics):
        super().__init__(runner)
        self.host, self.port, self.limit, self.idle_timeout_s, self.metrics = host, port, limit, idle_timeout_s, metrics
        self.refusal = refusal_response(limit)
        self.open = self.refusing = 0

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        handlers = self._runner.server
        assert handlers is not None

        def protocol() -> asyncio.Protocol:
            if self.open >= self.limit:
                return Refusal(self)
            return Counted(handlers(), self)

        self._server = await asyncio.get_running_loop().create_server(protocol, self.host, self.port)
