"""What every child process does first, and how processes watch each other:
the parent its children (exit codes, last error lines), a child its peers
(`FrontEndWatch`; whether a peer runs: shared/pids.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import zmq

from ..shared.config import Config
from ..shared.errors import UserError
from .run_facts import RunFacts

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def process_name(role: str) -> str:
    """The name `ps -o comm` and psutil show for a child (15 bytes at most)."""
    return f"moe-{role}"[:15]


def child_setup(role: str) -> None:
    """Ctrl-C goes to the whole terminal process group: children ignore it and
    let the parent stop them in order. If the parent dies (even by kill -9),
    the kernel kills the children, so no orphan keeps the arenas mapped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(process_name(role).encode()))
    except (OSError, AttributeError):  # not Linux: the parent's watchdog still ends us
        pass
    configure_logging(role)


# A service's processes log to its runtime dir as well as to stderr: the
# supervisor sets this before it spawns anyone (children inherit it).
LOG_FILE_ENV = "MOE_PIPE_LOG_FILE"
LOG_LEVEL_ENV = "MOE_PIPE_LOG_LEVEL"


def configure_logging(role: str) -> None:
    """Every line tagged with the process's name and pid; to stderr and, in a
    service, to its log file (lines are appended whole: O_APPEND)."""
    fmt = logging.Formatter(f"%(asctime)s {process_name(role)}[%(process)d] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    path = os.environ.get(LOG_FILE_ENV)
    if path:
        handlers.append(logging.FileHandler(path, mode="a", encoding="utf-8", delay=True))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(os.environ.get(LOG_LEVEL_ENV, "WARNING" if not path else "INFO"))


def error_file(runtime_dir: str | os.PathLike, role: str) -> Path:
    """Where a child leaves the one line saying why it died (for `status`)."""
    return Path(runtime_dir) / f"{role}.last-error"


def run_child(role: str, main: Callable[[Config, RunFacts], None], config: Config, facts: RunFacts) -> None:
    """A supervised child's entry: run `main(config, facts)`; an exception's last line
    is kept for the supervisor's status and logged — a UserError (a port in
    use, a missing model file: already one line that says what to do) as that
    line alone, anything else (a bug) with its traceback."""
    try:
        main(config, facts)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        line = f"{type(exc).__name__}: {exc}".splitlines()[0][:500] if str(exc) else type(exc).__name__
        try:
            error_file(facts.runtime_dir, role).write_text(line + "\n")
        except OSError:
            pass
        log = logging.getLogger(f"moe_pipe.{role}")
        if isinstance(exc, UserError):
            log.error("%s failed: %s", role, exc)
        else:
            log.exception("%s failed: %s", role, line)
        sys.exit(1)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class FrontEndWatch:
    """Notices the front end that binds the tokens link coming back after it
    went away (a gateway killed and restarted alone). The new one never saw
    this process's Hello and, without one, takes the model for still loading
    and holds every request; so compute says Hello again (when idle: the
    request it was serving belonged to the dead one). Without it one gateway
    kill leaves the service answering nothing until compute itself restarts
    (bench/soak.py kills gateways and waits for answers). Only a connect after a disconnect counts: the
    first connect is answered by the first Hello, already queued."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.lost = False

    def came_back(self) -> bool:
        from zmq.utils.monitor import recv_monitor_message

        back = False
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return back
            if event == zmq.EVENT_DISCONNECTED:
                self.lost = True
            elif event == zmq.EVENT_CONNECTED and self.lost:
                self.lost, back = False, True

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
