"""Finding and talking to a running service (`moe-pipe up`).

A service is its runtime dir (`ipc.RuntimeDir`, named by the supervisor's
pid). Beside the sockets it holds two small JSON files, each written whole
(temp file + rename, so a reader never sees half of one):

    service.json   the supervisor's: pid, config file, model, started, log path
    gateway.json   the gateway's, once it listens: host, port, pid

`down`, `status`, `tail` and `chat` find the one live service here and send
control commands (`Command` → `Status`) over its control socket.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.wire import ipc
from moe_pipe.shared.wire import messages as m

SERVICE_FILE = "service.json"
GATEWAY_FILE = "gateway.json"
LOG_FILE = "moe-pipe.log"
CONTROL_TIMEOUT_MS = 5_000


class NoService(UserError):
    """No live service to attach to."""


@dataclass(frozen=True)
class ServiceInfo:
    pid: int
    runtime_dir: str
    config: str  # the TOML file it was started from ("" = none)
    model: str  # the model file
    model_name: str  # the id /v1/models reports
    started: float  # unix time

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


def find_service(base: Path | None = None) -> ServiceInfo:
    """The running service, or a one-line error saying how to start one."""
    found = live_services(base)
    if not found:
        raise NoService("no moe-pipe service is running (start one with `moe-pipe up CONFIG`)")
    if len(found) > 1:
        pids = ", ".join(str(s.pid) for s in found)
        raise NoService(f"{len(found)} moe-pipe services are running (supervisor pids {pids}); stop the extra ones with `kill -TERM PID`")
    return found[0]


def wait_for_service(timeout_s: float | None, base: Path | None = None, poll_s: float = 0.25) -> ServiceInfo:
    """Block until a service runs (None: forever). For a tail started first."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        found = live_services(base)
        if len(found) == 1:
            return found[0]
        if len(found) > 1 or (deadline is not None and time.monotonic() >= deadline):
            return find_service(base)  # raises with the reason
        time.sleep(poll_s)


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
