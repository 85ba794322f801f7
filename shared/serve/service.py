"""Finding and talking to a running service (`moe-pipe up`).

A service is its runtime dir (`ipc.RuntimeDir`, named by the supervisor's
pid). Beside the sockets it holds two small JSON files, each written whole
(temp file + rename, so a reader never sees half of one):

    service.json   the supervisor's: pid, name, config file, model, started, port
    gateway.json   the gateway's, once it listens: host, port, pid
    api-key        gateway.api_key when one is set (mode 0600), for `chat`

Services are named (`up --name`, default the config file's or the model's
name), a name is unique among the live services of a user, and `down`,
`status`, `tail` and `chat` pick one by `--name` or `--port` — or need
nothing when one runs — and send it control commands (`Command` → `Status`)
over its control socket.

Before anything starts, `up` holds the HTTP port (`hold_port`): a port in
use is one line naming the process that has it, not a gateway that fails
its restarts.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq

from ..errors import UserError
from ..wire import ipc
from ..wire import messages as m

SERVICE_FILE = "service.json"
GATEWAY_FILE = "gateway.json"
LOG_FILE = "moe-pipe.log"
API_KEY_FILE = "api-key"
CONTROL_TIMEOUT_MS = 5_000
NAME_MAX = 32
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class NoService(UserError):
    """No live service to attach to."""


class NothingRunning(NoService):
    """No service at all runs, or none by the name or port asked for: not a mistake for
    `down` (already stopped) nor `status` (it says so), as for systemctl's stop and status."""


@dataclass(frozen=True)
class ServiceInfo:
    pid: int
    runtime_dir: str
    config: str  # the TOML file it was started from ("" = none)
    model: str  # the model file
    model_name: str  # the id /v1/models reports
    started: float  # unix time
    name: str = ""  # the service's name (`up --name`); unique among the live services
    port: int = 0  # the port it was asked for (0: any; gateway.json has the one it got)

    @property
    def log_path(self) -> Path:
        return Path(self.runtime_dir) / LOG_FILE

    @property
    def endpoints(self) -> ipc.Endpoints:
        return ipc.Endpoints(Path(self.runtime_dir))


@dataclass(frozen=True)
class GatewayAddress:
    host: str
    port: int
    pid: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_service_info(info: ServiceInfo) -> None:
    write_json_atomic(Path(info.runtime_dir) / SERVICE_FILE, asdict(info))


def read_service_info(runtime_dir: Path) -> ServiceInfo | None:
    data = _read_json(Path(runtime_dir) / SERVICE_FILE)
    try:
        return ServiceInfo(**data) if data else None
    except TypeError:
        return None


def write_gateway_address(runtime_dir: Path, address: GatewayAddress) -> None:
    write_json_atomic(Path(runtime_dir) / GATEWAY_FILE, asdict(address))


def read_gateway_address(runtime_dir: Path) -> GatewayAddress | None:
    data = _read_json(Path(runtime_dir) / GATEWAY_FILE)
    try:
        return GatewayAddress(**data) if data else None
    except TypeError:
        return None


def live_services(base: Path | None = None) -> list[ServiceInfo]:
    """Every running service whose service.json is written (oldest first)."""
    found = []
    for rt in ipc.RuntimeDir.find_live(base):
        info = read_service_info(rt.path)
        if info is not None:
            found.append(info)
    return found


# ------------------------------------------------------------------------ names


def sanitize_name(text: str) -> str:
    """A service name made from a config or model name: lower case, runs of
    anything but letters, digits, '.', '_' and '-' as one '-', at most NAME_MAX."""
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")[:NAME_MAX].rstrip("-._")
    return name or "moe-pipe"


def default_name(config_source: str, model_name: str) -> str:
    """The name of a service started without --name: its config file's stem
    (configs/tiny.toml: tiny), else its model's name."""
    return sanitize_name(Path(config_source).stem if config_source else model_name)


def check_name(text: str) -> str:
    """A name typed after --name, as it is, or a one-line error."""
    if not _NAME_RE.fullmatch(text) or len(text) > NAME_MAX:
        raise UserError(
            f"--name {text!r}: a service name is 1 to {NAME_MAX} letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return text


def service_port(info: ServiceInfo) -> int:
    """The port its API listens on, or the one it was asked for while it starts."""
    addr = read_gateway_address(Path(info.runtime_dir))
    return addr.port if addr is not None else info.port


def describe(info: ServiceInfo) -> str:
    """How errors name a service: tiny (pid 4242, port 8080)."""
    return f"{info.name or '?'} ({_pid_port(info)})"


def _pid_port(info: ServiceInfo) -> str:
    port = service_port(info)
    return f"pid {info.pid}{f', port {port}' if port else ''}"


def select_services(found: list[ServiceInfo], name: str | None, port: int | None) -> list[ServiceInfo]:
    return [s for s in found if (name is None or s.name == name) and (port is None or service_port(s) == port)]


def _which(name: str | None, port: int | None) -> str:
    return " and ".join(w for w in (f"named {name!r}" if name is not None else "", f"on port {port}" if port is not None else "") if w)


def find_service(base: Path | None = None, *, name: str | None = None, port: int | None = None) -> ServiceInfo:
    """The running service `name` (or on `port`), or the only one when neither
    is given; else a one-line error saying which exist or how to start one."""
    found = live_services(base)
    if not found:
        raise NothingRunning("no moe-pipe service is running (start one with `moe-pipe up CONFIG`)")
    chosen = select_services(found, name, port)
    if len(chosen) == 1:
        return chosen[0]
    running = ", ".join(describe(s) for s in found)
    if not chosen:
        raise NothingRunning(f"no moe-pipe service {_which(name, port)} is running; running: {running}")
    raise NoService(f"{len(chosen)} moe-pipe services are running: {running}; pick one with --name NAME")


def wait_for_service(
    timeout_s: float | None, base: Path | None = None, poll_s: float = 0.25, *, name: str | None = None, port: int | None = None
) -> ServiceInfo:
    """Block until the service (by name or port, or any one) runs (None: forever). For a tail started first."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        chosen = select_services(live_services(base), name, port)
        if len(chosen) == 1:
            return chosen[0]
        if len(chosen) > 1 or (deadline is not None and time.monotonic() >= deadline):
            return find_service(base, name=name, port=port)  # raises with the reason
        time.sleep(poll_s)


@contextmanager
def names_locked(base: Path) -> Iterator[None]:
    """Held while a starting service checks that its name is free and writes
    its service.json, so two `up --name X` at once cannot both take X (an
    flock on the runtime base folder, the parent of every service's folder:
    nothing to clean up, released on exit)."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_name_free(name: str, base: Path | None = None, *, own_pid: int | None = None) -> None:
    """A one-line error (exit 2) if a live service other than `own_pid` has this name."""
    for s in live_services(base):
        if s.name == name and s.pid != own_pid:
            raise UserError(
                f"a moe-pipe service named {name!r} is already running ({_pid_port(s)}); "
                f"stop it with `moe-pipe down --name {name}` or give this one another --name"
            )


# ------------------------------------------------------------------------ the port


def port_holder(port: int) -> str | None:
    """Who listens on (or has bound) TCP `port`: "pid N (NAME)", a moe-pipe
    service's description, or None when the process cannot be seen (another
    user's: the kernel shows its socket, not its owner)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    pids = sorted(
        {c.pid for c in conns if c.pid and c.laddr and c.laddr.port == port and c.status in (psutil.CONN_LISTEN, psutil.CONN_NONE)}
    )
    if not pids:
        return None
    for s in live_services():  # one of ours: its gateway, or its supervisor holding the port while it starts
        addr = read_gateway_address(Path(s.runtime_dir))
        if s.pid in pids or (addr is not None and addr.pid in pids):
            return f"the moe-pipe service {describe(s)}"
    try:
        proc_name = psutil.Process(pids[0]).name()
    except psutil.Error:
        proc_name = "?"
    return f"pid {pids[0]} ({proc_name})"


def hold_port(host: str, port: int) -> list[socket.socket]:
    """Bind and listen on `host`:`port` as the gateway will (SO_REUSEADDR, so a
    previous service's TIME_WAIT is no obstacle), and keep the sockets: until
    they are closed no other process can take the port. Port 0 (any free
    port) holds nothing. A port that cannot be had is a one-line UserError
    naming the port and, when it can be seen, the process holding it."""
    if port == 0:
        return []
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    held: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio's create_server: v6 only, the v4 address is its own entry
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
                sock.listen(1)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    holder = port_holder(port)
                    by = f"by {holder}" if holder else "by a process this user cannot see"
                    raise UserError(f"port {port} on {host} is already in use {by}; stop it or choose another port with --port N") from None
                raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held


# ------------------------------------------------------------------------ the API key


def kept_logs_dir() -> Path:
    """Where a stopped service's log is kept: $XDG_STATE_HOME/moe-pipe/logs (default
    ~/.local/state/...), the XDG home for logs that outlive a run; the runtime folder goes."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "moe-pipe" / "logs"


def kept_log_path(name: str) -> Path:
    return kept_logs_dir() / f"{name or 'service'}.log"


def keep_log(runtime_dir: Path, name: str) -> Path | None:
    """Move the service's log out of its runtime folder before the folder is deleted, to
    kept_log_path(name); the one before it stays as NAME.log.1. None when there is no log."""
    log = Path(runtime_dir) / LOG_FILE
    if not log.is_file():
        return None
    dest = kept_log_path(name)
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if dest.exists():
        os.replace(dest, dest.with_name(dest.name + ".1"))
    shutil.move(str(log), dest)  # the runtime folder is often a tmpfs: a copy, then the unlink
    os.chmod(dest, 0o600)
    return dest


def write_api_key(runtime_dir: Path, key: str) -> None:
    """gateway.api_key for `chat` of the same user: mode 0600 from its creation,
    inside the private runtime folder."""
    fd = os.open(Path(runtime_dir) / API_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")


def read_api_key(info: ServiceInfo) -> str | None:
    """The service's API key, if it has one and the file is ours and private (else None)."""
    try:
        fd = os.open(Path(info.runtime_dir) / API_KEY_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None
        return f.read().strip() or None


def wait_for_gateway(info: ServiceInfo, timeout_s: float, poll_s: float = 0.1) -> GatewayAddress:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        addr = read_gateway_address(Path(info.runtime_dir))
        if addr is not None:
            return addr
        if not ipc.RuntimeDir(Path(info.runtime_dir), info.pid).is_live():
            raise NoService(f"the service (pid {info.pid}) stopped before its HTTP gateway listened; see {info.log_path}")
        time.sleep(poll_s)
    raise NoService(f"the service's HTTP gateway did not start within {timeout_s:.0f} s; see {info.log_path}")


def control(info: ServiceInfo, name: str, timeout_ms: int = CONTROL_TIMEOUT_MS, **args) -> m.Status:
    """One control command to the supervisor; its Status reply (ok or not).
    A supervisor that does not answer in time is a NoService error."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ipc.connect(ctx, info.endpoints, "control")
    try:
        ipc.send(sock, m.Command(name, args), timeout_ms=timeout_ms)
        reply = ipc.recv(sock, timeout_ms, expect=(m.Status,))
    except ipc.PeerTimeout:
        reply = None
    finally:
        sock.close(linger=0)
    if reply is None:
        raise NoService(f"the service (pid {info.pid}) did not answer `{name}` within {timeout_ms / 1000:.0f} s")
    return reply
