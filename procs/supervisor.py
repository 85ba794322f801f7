"""The supervisor of `moe-pipe up`: owns what must outlive a crash (the
runtime dir, the expert cache, the residency index, the dense arena), starts
telemetry, reader, compute and gateway, restarts them supervisord-style, and
answers `status` / `stop` on its control socket.

A child's life is data (`Child.state`), changed only through `Child.change`,
which refuses any move not in ALLOWED:

    STOPPED ──► STARTING ──(up start_secs)──► RUNNING ──(exit)──► EXITED
                   │  ▲                          │                 │
       (exit before│  │(backoff over)            │ stop            │ restart policy
        start_secs)▼  │                          ▼                 ▼
                 BACKOFF ──(start_retries)──► FATAL          STARTING again
    any live state ──stop──► STOPPING ──► STOPPED

A crash soon after a start (within `stable_s`) counts as a failed start even
if the child had reached RUNNING: it backs off, and after start_retries of
them in a row the child is FATAL with its last error in `status`.

FATAL ends the restarts (no crash loop), but a child that failed because the
model file was gone, truncated or replaced could run again once the file is
back: while a child is FATAL the model path is watched, and when its file
differs from what it was at the FATAL (a new inode, size or mtime) and has
stayed unchanged for MODEL_SETTLE_S, the child gets one more round of
start_retries (FATAL -> STARTING). A file that is still wrong ends FATAL
again; one that keeps changing (a download) is waited for, not retried.

Why the arenas live here: a compute that is restarted attaches the dense
arena and the slabs again without reading the disk, and a restarted reader
takes over the experts the residency index says are cached, so the hit rate
carries on. Children die with the supervisor (PR_SET_PDEATHSIG); a supervisor
killed with -9 leaves its segments and runtime dir, which the next `up`
reclaims (their owner pid is dead) — never a live service's.

The restart logic is `Restarter` (no sockets, no arenas); what each child
runs, and the one way to start and stop one, are in procs/children.py.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import zmq

from ..shared.config import Config, SupervisorConfig
from ..shared.errors import PipelineError
from ..shared.experts.hotset import hot_set_path, read_warm_progress
from ..shared.serve import service
from ..shared.wire import ipc
from ..shared.wire import messages as m
from . import reader
from .children import CHILDREN, SERVICE_ORDER, ChildProcess, Launch, ProcessStarter, SpawnStarter, stop_child
from .lifecycle import LOG_FILE_ENV, configure_logging, describe_exit, error_file
from .resources import Resources, run_info

log = logging.getLogger("moe_pipe.supervisor")

TICK_MS = 100  # how often children are checked when no command comes
TERM_GRACE_S = 1.0  # a Shutdown message first; SIGTERM after this
MODEL_CHECK_S = 1.0  # while a child is FATAL: how often the model file is looked at
MODEL_SETTLE_S = 2.0  # a changed model file must stay unchanged this long before a retry


class State(enum.StrEnum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    BACKOFF = "BACKOFF"
    STOPPING = "STOPPING"
    EXITED = "EXITED"
    FATAL = "FATAL"


ALLOWED: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.RUNNING, State.BACKOFF, State.FATAL, State.STOPPING, State.EXITED}),
    State.RUNNING: frozenset({State.EXITED, State.STOPPING}),
    State.BACKOFF: frozenset({State.STARTING, State.FATAL, State.STOPPING}),
    State.EXITED: frozenset({State.STARTING, State.BACKOFF, State.FATAL, State.STOPPING, State.STOPPED}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.FATAL: frozenset({State.STARTING, State.BACKOFF, State.STOPPING, State.STOPPED}),  # the model file changed
}
LIVE = frozenset({State.STARTING, State.RUNNING})


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Child:
    """One supervised process: its policy and its history."""

    name: str
    restart: str  # always | on-failure | never
    needs: tuple[str, ...] = ()  # started only while these are up (compute needs the reader's pid)
    state: State = State.STOPPED
    process: ChildProcess | None = None
    started_at: float = 0.0  # monotonic, of the current start
    restarts: int = 0  # starts after the first
    retries: int = 0  # failed starts in a row
    backoff_until: float = 0.0
    last_exit: str = ""
    last_error: str = ""
    fatal_model: tuple | None = None  # model_signature when it went FATAL
    history: list[tuple[State, State]] = field(default_factory=list)

    def change(self, new: State, why: str = "") -> None:
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state} -> {new} is not allowed")
        log.info("%s: %s -> %s%s", self.name, self.state, new, f" ({why})" if why else "")
        self.history.append((self.state, new))
        self.state = new

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.state in LIVE | {State.STOPPING} else None

    def wants_restart(self, exitcode: int | None) -> bool:
        return self.restart == "always" or (self.restart == "on-failure" and exitcode != 0)


def model_signature(path: Path) -> tuple | None:
    """What tells a model file put back (or changed) from the one that was
    there: (device, inode, size, mtime), or None while there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def backoff_delay(retries: int, base_s: float, cap_s: float) -> float:
    """Delay before start attempt `retries + 1`: base, 2×base, 4×base, ... ≤ cap."""
    return min(base_s * 2 ** max(retries - 1, 0), cap_s)


def restart_policies(sup: SupervisorConfig) -> dict[str, str]:
    """Each child's restart policy (always, on-failure, never), from [supervisor]."""
    return {
        "reader": sup.reader_restart,
        "compute": sup.compute_restart,
        "telemetry": sup.telemetry_restart,
        "gateway": sup.gateway_restart,
    }


class Restarter:
    """The children's lives: started through a ProcessStarter (procs/children.py),
    watched at every `tick(now)`, restarted or left FATAL by their policy. No
    sockets, no arenas, no clock of its own: tests drive it with a fake starter
    and a fake clock. `runtime_dir` is where a dead child left its last error."""

    def __init__(
        self,
        cfg: Config,
        model_path: Path,
        runtime_dir: Path,
        starter: ProcessStarter,
        order: tuple[str, ...] = SERVICE_ORDER,
        on_started: Callable[[str], None] | None = None,
    ):
        self.cfg, self.model_path, self.runtime_dir = cfg, Path(model_path), Path(runtime_dir)
        self.starter, self.order = starter, order
        self.on_started = on_started or (lambda name: None)
        policy = restart_policies(cfg.supervisor)
        self.children = {name: Child(name, policy[name], needs=CHILDREN[name].needs) for name in order}
        self._model_seen: tuple[tuple | None, float] = (None, 0.0)  # signature, since when (monotonic)
        self._next_model_check = 0.0

    def start_all(self, now: float) -> None:
        for name in self.order:
            self._spawn(self.children[name], now)

    def _spawn(self, child: Child, now: float) -> None:
        if any(self.children[n].state not in LIVE for n in child.needs):
            # wait for what it needs (BACKOFF with no delay: the next tick tries again)
            if child.state != State.BACKOFF:
                child.change(State.BACKOFF, f"waiting for {', '.join(child.needs)}")
            child.backoff_until = now + TICK_MS / 1000
            return
        pids = {c.name: c.pid for c in self.children.values() if c.pid is not None}
        process = self.starter(child.name, pids)
        if child.state != State.STOPPED:
            child.restarts += 1
        child.process = process
        child.change(State.STARTING, f"restart {child.restarts}" if child.restarts else "")
        child.started_at = now
        self.on_started(child.name)

    # -- watching ------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for name in self.order:
            self._watch(self.children[name], now)
        self._watch_model(now)

    def _watch_model(self, now: float, signature: Callable[[Path], tuple | None] = model_signature) -> None:
        """FATAL children get another round once the model file has changed and settled."""
        fatal = [c for c in self.children.values() if c.state == State.FATAL]
        if not fatal or now < self._next_model_check:
            return
        self._next_model_check = now + MODEL_CHECK_S
        sig = signature(self.model_path)
        if sig != self._model_seen[0]:
            self._model_seen = (sig, now)  # changed (or first look): wait for it to settle
            return
        if sig is None or now - self._model_seen[1] < MODEL_SETTLE_S:
            return
        retry = [c for c in fatal if sig != c.fatal_model]
        # A child that failed only because what it needs died (compute when the reader went FATAL)
        # may have gone FATAL after the file was already back, with the file's current signature:
        # it gets its round with what it needs, or it would stay FATAL beside a running reader.
        retry += [c for c in fatal if c not in retry and any(n in (r.name for r in retry) for n in c.needs)]
        for child in retry:
            log.warning("%s: the model file %s changed since it failed; trying again", child.name, self.model_path)
            child.retries, child.fatal_model = 0, None
        for child in retry:  # needed ones first (order): a dependant waits in BACKOFF until they run
            self._spawn(child, now)  # FATAL -> STARTING (or BACKOFF while what it needs is down)

    def _watch(self, child: Child, now: float) -> None:
        alive = child.process is not None and child.process.is_alive()
        if child.state == State.STARTING:
            if not alive:
                self._exited(child, now)
            elif now - child.started_at >= self.cfg.supervisor.start_secs:
                child.change(State.RUNNING)
        elif child.state == State.RUNNING:
            if not alive:
                self._exited(child, now)
            elif child.retries and now - child.started_at >= self.stable_s:
                child.retries = 0  # it has stayed up: its next crash restarts at once
        elif child.state == State.BACKOFF and now >= child.backoff_until:
            self._spawn(child, now)

    @property
    def stable_s(self) -> float:
        """How long a child must stay up before a crash no longer counts toward
        FATAL. supervisord's start_secs alone lets a child that dies a second
        after every start loop forever (and drain a phone's battery), so a
        crash within this window backs off and counts as a failed start."""
        sup = self.cfg.supervisor
        return max(10 * sup.start_secs, sup.backoff_cap_s)

    def _exited(self, child: Child, now: float) -> None:
        process = child.process
        code = process.exitcode if process is not None else None
        early = child.state == State.STARTING
        quick = early or now - child.started_at < self.stable_s
        child.last_exit = describe_exit(code)
        err = error_file(self.runtime_dir, child.name)
        child.last_error = err.read_text().strip() if err.exists() else f"{child.name} {child.last_exit}"
        log.warning("%s (pid %s) %s: %s", child.name, process.pid if process else None, child.last_exit, child.last_error)
        child.process = None
        child.change(State.EXITED, child.last_exit)
        # A failed start is retried whatever the policy, except "never" (as supervisord).
        if child.restart == "never" or (not early and not child.wants_restart(code)):
            return
        if not quick:
            child.retries = 0
            self._spawn(child, now)
            return
        child.retries += 1
        sup = self.cfg.supervisor
        if child.retries > sup.start_retries:
            child.fatal_model = model_signature(self.model_path)
            child.change(State.FATAL, f"{child.retries} failed starts in a row")
        else:
            child.change(State.BACKOFF, f"retry {child.retries} of {sup.start_retries}")
            child.backoff_until = now + backoff_delay(child.retries, sup.backoff_s, sup.backoff_cap_s)

    # -- stopping and status -----------------------------------------------------------------
    def stop_all(self, links: dict[str, zmq.Socket], why: str) -> None:
        """Every child, in reverse start order (procs/children.py's one way to stop)."""
        for name in reversed(self.order):
            child = self.children[name]
            if child.state in (State.STOPPED, State.STOPPING):
                continue
            child.change(State.STOPPING, why)
            if child.process is not None:
                stop_child(child.process, name, links, why, TERM_GRACE_S, self.cfg.supervisor.stop_wait_s)
            child.process = None
            child.change(State.STOPPED)

    def status_rows(self, now: float | None = None) -> list[dict[str, Any]]:
        """One row per process, in start order: the `processes` of `status`."""
        now = time.monotonic() if now is None else now
        rows = []
        for name in self.order:
            c = self.children[name]
            pid = c.pid
            rows.append(
                {
                    "name": name,
                    "state": str(c.state),
                    "pid": pid,
                    "uptime_s": round(now - c.started_at, 1) if pid else None,
                    "restarts": c.restarts,
                    "last_exit": c.last_exit,
                    "last_error": c.last_error,
                    "rss_bytes": _rss(pid),
                }
            )
        return rows


class Supervisor:
    """The service's parent, built whole by `Supervisor.start`: resources,
    sockets and a Restarter whose children are running."""

    ORDER = SERVICE_ORDER  # start order; stop is the reverse

    def __init__(
        self,
        cfg: Config,
        model_path: Path,
        res: Resources,
        ctx: zmq.Context,
        *,
        starter: ProcessStarter,
        config_source: str = "",
    ):
        self.cfg, self.model_path, self.res, self.ctx = cfg, Path(model_path), res, ctx
        self.config_source = config_source
        endpoints = res.rt.endpoints
        self.control = ipc.bind(ctx, endpoints, "control")
        self.telemetry_in = ipc.connect(ctx, endpoints, "telemetry_in")
        self.fetch_out = ipc.connect(ctx, endpoints, "fetch")  # only for the reader's Shutdown: it saves the hot set on it
        self.telemetry_sub = ipc.connect(ctx, endpoints, "telemetry_pub")
        self.restarter = Restarter(cfg, self.model_path, res.rt.path, starter, self.ORDER, on_started=self._on_started)
        self.stop_requested = ""
        self.started_wall = time.time()
        self.load_seconds = 0.0
        self.last_record: m.TokenRecord | None = None
        self.tokens_seen = 0
        self.closed = False
        self.name = ""

    @classmethod
    def start(
        cls,
        cfg: Config,
        model_path: str | os.PathLike,
        *,
        config_source: str = "",
        name: str = "",
        progress: Callable[[str], None] | None = None,
        starter: Callable[[Launch], ProcessStarter] = SpawnStarter,
    ) -> Supervisor:
        """Resources, logging to the runtime dir, the control and telemetry
        sockets, the service file `status`/`down` find, then every child.
        `name` is the service's (default: `service.default_name`). `starter`
        makes the process starter from the launch (tests pass a fake).

        First of all the name must be free and the HTTP port is held
        (`preflight`): either refused is one line, before any memory is
        committed; the port stays held until the gateway is started."""
        t0 = time.perf_counter()
        model_path = Path(model_path)
        name = name or service.default_name(config_source, cfg.model.name or model_path.stem)
        port_socks = preflight(cfg, name)
        try:
            res = Resources.create(cfg, model_path, progress=progress, roles=cls.ORDER)
        except BaseException:
            _close_all(port_socks)
            raise
        os.environ[LOG_FILE_ENV] = str(res.rt.path / service.LOG_FILE)  # children inherit it
        ctx = zmq.Context()
        try:
            sup = cls(
                cfg,
                model_path,
                res,
                ctx,
                starter=starter(
                    Launch(cfg, res, model_path, cfg.model.name or model_path.stem, hot_set=str(hot_set_path(res.resolved.model_identity)))
                ),
                config_source=config_source,
            )
        except BaseException:
            _close_all(port_socks)
            ctx.destroy(linger=0)
            res.close()
            os.environ.pop(LOG_FILE_ENV, None)
            raise
        try:
            configure_logging("supervisor")
            sup.name = name
            if cfg.gateway.api_key:  # for `chat` of the same user; the folder is private, the file 0600
                service.write_api_key(res.rt.path, cfg.gateway.api_key)
            info = service.ServiceInfo(
                os.getpid(), str(res.rt.path), config_source, str(model_path), sup.model_name, sup.started_wall, name, cfg.gateway.port
            )
            with service.names_locked(res.rt.path.parent):  # another `up --name NAME` may have started meanwhile
                service.check_name_free(name, res.rt.path.parent, own_pid=os.getpid())
                service.write_service_info(info)
            _close_all(port_socks)  # the gateway binds it next (SO_REUSEADDR: no wait)
            sup.restarter.start_all(time.monotonic())
            sup.load_seconds = time.perf_counter() - t0
        except BaseException:
            _close_all(port_socks)
            sup.close()
            raise
        return sup

    @property
    def model_name(self) -> str:
        return self.cfg.model.name or self.model_path.stem

    @property
    def children(self) -> dict[str, Child]:
        return self.restarter.children

    def _on_started(self, name: str) -> None:
        if name == "telemetry":  # a new telemetry starts its files from this header
            ipc.DroppingSender(self.telemetry_in).send(run_info(self.cfg, self.res, self.model_path, self.load_seconds))

    # -- the loop --------------------------------------------------------------------
    def run(self, on_listening: Callable[[str], None] | None = None) -> None:
        """Serve until a stop command, a signal (KeyboardInterrupt / SystemExit
        from the CLI's handlers) or every child FATAL; then stop everything.
        `on_listening(url)` is called once, when the gateway first listens.
        A gateway FATAL before it ever listened ends the service with its last
        error: a service with no API is of no use, and `up` (foreground or
        --detach) must say why at once. Once it has listened, a FATAL child
        leaves the service running, degraded (`status` says so)."""
        listened = False
        try:
            while not self.stop_requested:
                self._serve_control(TICK_MS)
                self._drain_telemetry()
                self.restarter.tick(time.monotonic())
                if not listened and (addr := service.read_gateway_address(self.res.rt.path)):
                    listened = True
                    if on_listening is not None:
                        on_listening(addr.url)
                gateway = self.children.get("gateway")
                if not listened and gateway is not None and gateway.state == State.FATAL:
                    raise PipelineError(f"the HTTP API did not start: {gateway.last_error}")
                if all(c.state == State.FATAL for c in self.children.values()):
                    raise PipelineError(
                        f"every process of the service failed to start; see `moe-pipe status` or {self.res.rt.path / service.LOG_FILE}"
                    )
        finally:
            self.close()

    # -- telemetry (for status) ----------------------------------------------------------
    def _drain_telemetry(self) -> None:
        while True:
            try:
                msg = ipc.recv(self.telemetry_sub, 0)
            except m.ProtocolError:
                continue
            if msg is None:
                return
            if isinstance(msg, m.TokenRecord):
                self.last_record = msg
                self.tokens_seen += 1

    # -- control ---------------------------------------------------------------------
    def _serve_control(self, timeout_ms: int) -> None:
        try:
            envelope, msg = ipc.recv_routed(self.control, timeout_ms, expect=(m.Command,))
        except m.ProtocolError as exc:
            envelope = getattr(exc, "envelope", ())
            if envelope:
                ipc.send(self.control, m.Status.failure(m.Code.BAD_MESSAGE, str(exc)), envelope=envelope, timeout_ms=100)
            return
        if not isinstance(msg, m.Command):  # None: no command within timeout_ms
            return
        reply = self.command(msg)
        try:
            ipc.send(self.control, reply, envelope=envelope, timeout_ms=500)
        except ipc.PeerTimeout:
            pass  # the asker went away

    def command(self, cmd: m.Command) -> m.Status:
        if cmd.name == "status":
            return m.Status.success("running", **self.status())
        if cmd.name == "stop":
            self.stop_requested = "moe-pipe down"
            return m.Status.success("stopping")
        return m.Status.failure(m.Code.UNKNOWN_COMMAND, f"unknown command {cmd.name!r}; commands: status, stop")

    def status(self) -> dict[str, Any]:
        procs = self.restarter.status_rows()
        io = reader.read_io_status(str(self.res.rt.path))  # read faults: count, last, the one in force
        for row in procs:
            row["fault"] = io.get("fault") if row["name"] == "reader" else None
        r = self.res.resolved
        addr = service.read_gateway_address(self.res.rt.path)
        rec = self.last_record
        fatal = [p["name"] for p in procs if p["state"] == State.FATAL]
        return {
            "name": self.name,
            # degraded: a process gave up (FATAL); starting: no API yet; ok: serving
            "health": "degraded" if fatal else "ok" if addr else "starting",
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_wall, 1),
            "model": str(self.model_path),
            "model_name": self.model_name,
            "config": self.config_source,
            "runtime_dir": str(self.res.rt.path),
            "url": addr.url if addr else None,
            "budget_bytes": r.n_slabs * r.slab_bytes,
            "budget": r.budget_description,
            "slabs": r.n_slabs,
            "slab_bytes": r.slab_bytes,
            "load_seconds": round(self.load_seconds, 3),
            "tokens": self.tokens_seen,
            "hit_pct": round(rec.cache_hit_pct, 2) if rec else None,
            "rss_bytes": _rss(os.getpid()),
            "processes": procs,
            "io": io,
            "warming": warming_status(self.res.rt.path),
            "hot_set": str(hot_set_path(r.model_identity)),
        }

    # -- stop ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop children in reverse start order (telemetry and the reader asked by a
        Shutdown, so telemetry writes the run summary and the reader the hot set),
        then release everything. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            links = {"telemetry_in": self.telemetry_in, "fetch": self.fetch_out}
            self.restarter.stop_all(links, self.stop_requested or "service stopping")
        finally:
            self.ctx.destroy(linger=0)  # closes every socket of ours
            try:  # the runtime folder goes with the service; its log is what explains a stop
                service.keep_log(self.res.rt.path, self.name)
            except OSError as exc:
                log.warning("could not keep the log: %s", exc)
            self.res.close()
            os.environ.pop(LOG_FILE_ENV, None)


def warming_status(runtime_dir: Path) -> dict[str, Any] | None:
    """The reader's warm start as `status` shows it (docs/cli.md § status), None without one."""
    warm = read_warm_progress(runtime_dir)
    return None if warm is None else {**asdict(warm), "text": warm.text()}


def preflight(cfg: Config, name: str) -> list:
    """What `up` checks before anything starts: the name is free and the HTTP
    port can be had. Returns the sockets that hold the port (close them to
    let it go); a refusal is a one-line UserError (exit 2)."""
    service.check_name_free(name)
    return service.hold_port(cfg.gateway.host, cfg.gateway.port)


def _close_all(socks: list) -> None:
    for sock in socks:
        sock.close()
    socks.clear()


def _rss(pid: int | None) -> int | None:
    if not pid:
        return None
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
