"""Where the sockets live and how they are made: runtime dir, endpoints, links.

    $XDG_RUNTIME_DIR/moe-pipe/        (or /tmp/moe-pipe-<uid>/)   0700, ours
      └─ <pid>/                       one service; pid = the supervisor's   0700
           owner                      "<pid> <process start time>"  (pid-reuse check)
           fetch.sock  ready.sock  telemetry-in.sock  telemetry-pub.sock  control.sock

Every link is declared once in LINKS: which side binds, the socket types, the
high-water mark and whether its sends may drop. Processes ask for a link by
name (`bind(ctx, endpoints, "fetch")`), so the types and options cannot
disagree between the two ends.

    link           binder (type)          connector (type)       sends
    fetch          reader    PULL         compute   PUSH         reliable
    ready          compute   PULL         reader    PUSH         reliable
    telemetry_in   telemetry PULL         compute   PUSH         lossy: NOBLOCK, drop + count
    telemetry_pub  telemetry PUB          tail      SUB          lossy: PUB drops on its own
    control        supervisor ROUTER      cli       DEALER       reliable
    requests       compute   PULL         front end PUSH         reliable (Generate, Cancel, Shutdown)
    tokens         front end PULL         compute   PUSH         reliable (Hello, Token, Done)

A socket belongs to one thread (zmq sockets are not thread-safe): these
helpers take a socket and never keep one. Every socket gets an explicit
LINGER, so closing a context cannot hang on a dead peer, and ZMQ_MAXMSGSIZE,
so a peer sending an oversize frame is disconnected before we allocate it.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

import psutil
import zmq

from ..errors import UserError
from . import messages
from .messages import Message, ProtocolError

# Closing a socket waits at most this long to flush queued frames. Small, so a
# shutdown with a dead peer takes 0.1 s, not forever; long enough that the last
# token record and the run summary usually reach telemetry on a normal exit.
LINGER_MS = 100
# A reliable send that cannot be queued for this long means the peer is dead
# or wedged: raise PeerTimeout instead of blocking the loop forever.
SEND_TIMEOUT_MS = 5_000
# Reliable links never drop; their HWM only bounds memory if a peer stops
# reading. In flight on fetch/ready is at most layers x top_k frames.
RELIABLE_HWM = 10_000
# Telemetry: ~250 bytes a record; 1000 records is seconds to minutes of
# tokens, enough to ride out a telemetry restart, small enough to never matter.
TELEMETRY_HWM = 1_000
# sockaddr_un.sun_path is 108 bytes including the NUL.
_MAX_SOCKET_PATH = 107


class RuntimeDirError(UserError):
    """The runtime directory is missing, not ours, or not private."""


class PeerTimeout(Exception):
    """A reliable send could not be queued in time: the peer is gone or stuck."""


# ---------------------------------------------------------------- runtime dir


def _base_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "moe-pipe"
    return Path("/tmp") / f"moe-pipe-{os.getuid()}"


def _check_private(path: Path) -> None:
    """Ours, a real directory (not a symlink), no access for group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RuntimeDirError(f"{path}: runtime directory does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"{path}: runtime directory is not a directory (a symlink or file is refused)")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"{path}: runtime directory is owned by uid {st.st_uid}, not {os.getuid()}; refusing to use it")
    if st.st_mode & 0o077:
        raise RuntimeDirError(
            f"{path}: runtime directory has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (chmod 700 it or remove it)"
        )


def _start_time(pid: int) -> float | None:
    """When `pid` started; None if it is gone (a zombie is gone: dead, only not yet reaped)."""
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


@dataclass(frozen=True)
class RuntimeDir:
    path: Path
    pid: int

    @classmethod
    def create(cls, base: Path | None = None, pid: int | None = None) -> RuntimeDir:
        """A fresh private dir for the service owned by `pid` (default: us).

        A leftover dir for the same pid whose owner is dead (or was a different
        process that had this pid) is reclaimed; a live one is refused."""
        base = Path(base) if base is not None else _base_dir()
        pid = os.getpid() if pid is None else pid
        for _ in range(3):  # a concurrent remove() may rmdir an empty base between our two mkdirs
            try:
                base.mkdir(mode=0o700, parents=True, exist_ok=True)
                _check_private(base)
                path = base / str(pid)
                if path.exists() or path.is_symlink():
                    existing = cls(path, pid)
                    if existing.is_live():
                        raise RuntimeDirError(f"{path}: a live service (pid {pid}) already uses this runtime directory")
                    existing.remove()
                path.mkdir(mode=0o700)
                break
            except FileNotFoundError:
                continue
        else:
            raise RuntimeDirError(f"{base}: could not create the runtime directory (it kept disappearing)")
        os.chmod(path, 0o700)  # mkdir's mode is masked by umask; be exact
        _check_private(path)
        started = _start_time(pid)
        (path / "owner").write_text(f"{pid} {started if started is not None else 0.0!r}\n")
        return cls(path, pid)

    @classmethod
    def existing(cls, base: Path | None = None) -> list[RuntimeDir]:
        """Every service dir under the base, live or stale, checked private."""
        base = Path(base) if base is not None else _base_dir()
        if not base.exists():
            return []
        _check_private(base)
        return sorted(
            (cls(p, int(p.name)) for p in base.iterdir() if p.name.isdigit()),
            key=lambda d: d.pid,
        )

    @classmethod
    def find_live(cls, base: Path | None = None) -> list[RuntimeDir]:
        """The running services (for down/status/tail to attach to)."""
        return [d for d in cls.existing(base) if d.is_live()]

    @classmethod
    def reclaim_stale(cls, base: Path | None = None) -> list[Path]:
        """Remove the dirs of dead owners; never a live one. Returns what went."""
        gone = []
        for d in cls.existing(base):
            if not d.is_live():
                d.remove()
                gone.append(d.path)
        return gone

    def is_live(self) -> bool:
        """Its owner pid runs and is the same process that created it (a reused
        pid has a different start time)."""
        try:
            pid_text, started_text = (self.path / "owner").read_text().split()
            recorded = float(started_text)
        except (OSError, ValueError):
            # No owner file: a create() died half-way, or not ours. Live only
            # if the pid runs (we cannot tell a reuse; err on not deleting).
            return psutil.pid_exists(self.pid)
        started = _start_time(self.pid)
        return started is not None and abs(started - recorded) < 0.05

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(self.path)

    def remove(self) -> None:
        """Delete the socket files, the owner file and the dir (and the base
        if that leaves it empty). Idempotent."""
        if not (self.path.exists() or self.path.is_symlink()):
            return
        st = os.lstat(self.path)
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
            raise RuntimeDirError(f"{self.path}: not our directory; refusing to delete it")
        shutil.rmtree(self.path, onerror=_ignore_missing)  # rmtree never follows symlinks
        try:
            self.path.parent.rmdir()
        except OSError:
            pass  # not empty (another service), or already gone


def _ignore_missing(func, path, exc_info) -> None:
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


# ------------------------------------------------------------------ endpoints


@dataclass(frozen=True)
class Endpoints:
    """The ipc:// address of every link, from the runtime dir path alone."""

    runtime_dir: Path

    def __post_init__(self) -> None:
        longest = max(len(str(self._file(n))) for n in LINKS)
        if longest > _MAX_SOCKET_PATH:
            raise RuntimeDirError(
                f"{self.runtime_dir}: socket paths would be {longest} bytes, over the {_MAX_SOCKET_PATH}-byte "
                "unix socket limit; set XDG_RUNTIME_DIR to a shorter directory"
            )

    def _file(self, link: str) -> Path:
        return Path(self.runtime_dir) / f"{link.replace('_', '-')}.sock"

    def address(self, link: str) -> str:
        if link not in LINKS:
            raise KeyError(f"unknown link {link!r}; links: {', '.join(LINKS)}")
        return f"ipc://{self._file(link)}"

    def socket_files(self) -> list[Path]:
        return [self._file(n) for n in LINKS]

    # One property per link, for readable call sites.
    fetch = property(lambda self: self.address("fetch"))
    ready = property(lambda self: self.address("ready"))
    telemetry_in = property(lambda self: self.address("telemetry_in"))
    telemetry_pub = property(lambda self: self.address("telemetry_pub"))
    control = property(lambda self: self.address("control"))
    requests = property(lambda self: self.address("requests"))
    tokens = property(lambda self: self.address("tokens"))


# ---------------------------------------------------------------------- links


@dataclass(frozen=True)
class Link:
    bind_type: int
    connect_type: int
    hwm: int
    lossy: bool  # sends must never block the sender; drops are acceptable


LINKS: dict[str, Link] = {
    "fetch": Link(zmq.PULL, zmq.PUSH, RELIABLE_HWM, lossy=False),
    "ready": Link(zmq.PULL, zmq.PUSH, RELIABLE_HWM, lossy=False),
    "telemetry_in": Link(zmq.PULL, zmq.PUSH, TELEMETRY_HWM, lossy=True),
    "telemetry_pub": Link(zmq.PUB, zmq.SUB, TELEMETRY_HWM, lossy=True),
    "control": Link(zmq.ROUTER, zmq.DEALER, RELIABLE_HWM, lossy=False),
    "requests": Link(zmq.PULL, zmq.PUSH, RELIABLE_HWM, lossy=False),  # compute binds; the front end connects
    "tokens": Link(zmq.PULL, zmq.PUSH, RELIABLE_HWM, lossy=False),  # the front end binds; compute connects
}


def _make(ctx: zmq.Context, sock_type: int, link: Link) -> zmq.Socket:
    sock = ctx.socket(sock_type)
    try:
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, link.hwm)
        sock.setsockopt(zmq.RCVHWM, link.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_FRAME_BYTES)
        if sock_type == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bind(ctx: zmq.Context, endpoints: Endpoints, link: str) -> zmq.Socket:
    """The binding end of `link` (the long-lived side: see LINKS)."""
    spec = LINKS[link]
    sock = _make(ctx, spec.bind_type, spec)
    try:
        sock.bind(endpoints.address(link))
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def connect(ctx: zmq.Context, endpoints: Endpoints, link: str) -> zmq.Socket:
    """The connecting end of `link`. Connecting needs no listener yet: frames
    queue (up to the HWM) until the binder appears or comes back."""
    spec = LINKS[link]
    sock = _make(ctx, spec.connect_type, spec)
    try:
        sock.connect(endpoints.address(link))
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


@contextmanager
def context() -> Iterator[zmq.Context]:
    """A zmq context that is destroyed on every exit path. Join the threads
    that own its sockets before leaving the block."""
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=LINGER_MS)


# ------------------------------------------------------------- send / receive


def send(sock: zmq.Socket, msg: Message, timeout_ms: int | None = SEND_TIMEOUT_MS, envelope: tuple[bytes, ...] = ()) -> None:
    """Reliable send: queue `msg` or raise PeerTimeout after `timeout_ms`
    (None: wait forever). `envelope` is a ROUTER's routing frames."""
    frames = [*envelope, messages.encode(msg)]
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
        return
    except zmq.Again:
        pass
    if not sock.poll(timeout_ms, zmq.POLLOUT):
        raise PeerTimeout(f"{type(msg).__name__}: peer did not take it within {timeout_ms} ms")
    sock.send_multipart(frames, flags=zmq.NOBLOCK)


class DroppingSender:
    """Sends that never block: a full queue (slow or dead receiver) drops the
    frame and counts it. For telemetry: compute must never wait for it.

    On a PUSH socket `dropped` counts every frame refused. A PUB socket drops
    internally without telling the sender, so there it stays 0: the tail side
    sees the gap in `step` instead."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.sent = 0
        self.dropped = 0

    def send(self, msg: Message) -> bool:
        frame = messages.encode(msg)
        try:
            self.sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True


# The message classes a receiving loop `expect`s: the message it gets back is
# typed as one of them (overloads for up to five, the most any link takes: telemetry's feed).
_A = TypeVar("_A")
_B = TypeVar("_B")
_C = TypeVar("_C")
_D = TypeVar("_D")
_E = TypeVar("_E")


@overload
def recv(sock: zmq.Socket, timeout_ms: int | None, expect: None = None) -> Message | None: ...
@overload
def recv(sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type[_A]]) -> _A | None: ...
@overload
def recv(sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type[_A], type[_B]]) -> _A | _B | None: ...
@overload
def recv(sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type[_A], type[_B], type[_C]]) -> _A | _B | _C | None: ...
@overload
def recv(sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type[_A], type[_B], type[_C], type[_D]]) -> _A | _B | _C | _D | None: ...
@overload
def recv(
    sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type[_A], type[_B], type[_C], type[_D], type[_E]]
) -> _A | _B | _C | _D | _E | None: ...
def recv(sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type, ...] | None = None) -> Any:  # typed by the overloads
    """The next message, None on timeout (None: wait forever).

    ProtocolError for a frame that does not decode, or is not one of `expect`
    on this link: the caller logs it and goes on (it is already consumed)."""
    envelope, msg = _recv_routed(sock, timeout_ms, expect)
    if envelope:
        raise ProtocolError(f"unexpected {len(envelope)} routing frame(s) before {type(msg).__name__}")
    return msg


@overload
def recv_routed(sock: zmq.Socket, timeout_ms: int | None, expect: None = None) -> tuple[tuple[bytes, ...], Message | None]: ...
@overload
def recv_routed(sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type[_A]]) -> tuple[tuple[bytes, ...], _A | None]: ...
@overload
def recv_routed(
    sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type[_A], type[_B]]
) -> tuple[tuple[bytes, ...], _A | _B | None]: ...
@overload
def recv_routed(
    sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type[_A], type[_B], type[_C]]
) -> tuple[tuple[bytes, ...], _A | _B | _C | None]: ...
def recv_routed(
    sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type, ...] | None = None
) -> tuple[tuple[bytes, ...], Any]:  # typed by the overloads
    """(routing frames, message) for a ROUTER: reply with send(..., envelope=).
    A ProtocolError carries `.envelope` so a bad request can still be answered."""
    return _recv_routed(sock, timeout_ms, expect)


def _recv_routed(sock: zmq.Socket, timeout_ms: int | None, expect: tuple[type, ...] | None) -> tuple[tuple[bytes, ...], Message | None]:
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return (), None
    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
    envelope = tuple(frames[:-1])
    try:
        msg = messages.decode(frames[-1])
        if expect is not None and not isinstance(msg, expect):
            raise ProtocolError(f"unexpected {type(msg).__name__} on this link")
    except ProtocolError as e:
        e.envelope = envelope
        raise
    return envelope, msg
