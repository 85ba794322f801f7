"""The supervisor's restart logic as data: guarded state changes, backoff,
FATAL after repeated failed starts, restart policies, dependencies — driven
with fake processes and a fake clock (the real processes: test_service.py)."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moe_pipe.procs import supervisor as sv
from moe_pipe.procs.lifecycle import error_file
from moe_pipe.procs.supervisor import ALLOWED, Child, IllegalTransition, Restarter, State, Supervisor, backoff_delay
from moe_pipe.shared.config import load_config


@dataclass
class FakeProcess:
    """A ChildProcess (procs/children.py) that runs nothing."""

    pid: int
    alive: bool = True
    exitcode: int | None = None
    signals: list[str] = field(default_factory=list)

    def is_alive(self) -> bool:
        return self.alive

    def die(self, code: int) -> None:
        self.alive, self.exitcode = False, code

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.signals.append("SIGTERM")
        self.die(-15)

    def kill(self) -> None:
        self.signals.append("SIGKILL")
        self.die(-9)


class Harness(Restarter):
    """The supervisor's restart logic with a fake process starter (no fork, no
    arenas) and a fake clock."""

    def __init__(self, tmp_path: Path, **sup):
        cfg = load_config(None, {f"supervisor.{k}": v for k, v in sup.items()})
        super().__init__(cfg, Path("model.gguf"), tmp_path, self.fake_start)
        self.next_pid = 100
        self.spawned: list[tuple[str, int]] = []
        self.pids_given: dict[str, dict[str, int]] = {}
        self.now = 0.0

    def fake_start(self, name: str, pids) -> FakeProcess:
        self.next_pid += 1
        self.spawned.append((name, self.next_pid))
        self.pids_given[name] = dict(pids)
        return FakeProcess(self.next_pid)

    def start_all(self, now: float = 0.0) -> None:
        self.now = now
        super().start_all(now)

    def at(self, now: float) -> None:
        self.now = now
        self.tick(now)


def test_every_state_change_is_guarded():
    c = Child("reader", "always")
    with pytest.raises(IllegalTransition):
        c.change(State.RUNNING)  # STOPPED cannot jump to RUNNING
    c.change(State.STARTING)
    c.change(State.RUNNING)
    with pytest.raises(IllegalTransition):
        c.change(State.BACKOFF)  # a running child exits first
    assert c.history == [(State.STOPPED, State.STARTING), (State.STARTING, State.RUNNING)]
    assert set(ALLOWED) == set(State)


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_delay(n, 0.5, 3.0) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_running_after_start_secs(tmp_path):
    h = Harness(tmp_path, start_secs=1.0)
    h.start_all()
    h.at(0.5)
    assert {c.state for c in h.children.values()} == {State.STARTING}
    h.at(1.0)
    assert {c.state for c in h.children.values()} == {State.RUNNING}


def test_repeated_failed_starts_end_fatal_with_the_last_error(tmp_path):
    h = Harness(tmp_path, start_secs=1.0, start_retries=2, backoff_s=1.0, backoff_cap_s=4.0)
    h.start_all()
    reader = h.children["reader"]
    t = 0.0
    for attempt in range(3):
        error_file(tmp_path, "reader").write_text("GGUFError: m.gguf: no such file\n")
        reader.process.die(1)
        t += 0.1
        h.at(t)
        if attempt < 2:
            assert reader.state == State.BACKOFF
            h.at(t + 0.5)  # backoff not over: no new start yet
            assert reader.state == State.BACKOFF
            t += backoff_delay(attempt + 1, 1.0, 4.0)
            h.at(t)
            assert reader.state == State.STARTING
    assert reader.state == State.FATAL
    assert reader.last_error == "GGUFError: m.gguf: no such file" and reader.restarts == 2
    status = {p["name"]: p for p in h.status_rows()}
    assert status["reader"]["state"] == "FATAL" and status["reader"]["pid"] is None


def test_a_crash_soon_after_running_counts_as_a_failed_start(tmp_path):
    h = Harness(tmp_path, start_secs=0.5, start_retries=1, backoff_s=0.2, backoff_cap_s=5.0)
    h.start_all()
    h.at(1.0)
    compute = h.children["compute"]
    assert compute.state == State.RUNNING
    compute.process.die(1)
    h.at(2.0)  # up 2 s < stable_s (max(10 x 0.5, 5) = 5 s): back off
    assert compute.state == State.BACKOFF and compute.retries == 1
    h.at(2.3)
    h.at(3.0)
    assert compute.state == State.RUNNING
    compute.process.die(1)
    h.at(3.5)
    assert compute.state == State.FATAL  # a crash loop ends instead of eating the battery


def test_a_crash_after_a_long_run_restarts_at_once(tmp_path):
    h = Harness(tmp_path, start_secs=0.5, backoff_cap_s=5.0)
    h.start_all()
    h.at(1.0)
    h.at(100.0)
    compute = h.children["compute"]
    old = compute.process.pid
    compute.process.die(-9)
    h.at(100.1)
    assert compute.state == State.STARTING and compute.process.pid != old and compute.restarts == 1
    assert compute.last_error == "compute was killed by SIGKILL"


@pytest.mark.parametrize(
    "policy,code,restarted",
    [("always", 0, True), ("always", 1, True), ("on-failure", 0, False), ("on-failure", -9, True), ("never", -9, False)],
)
def test_restart_policies(tmp_path, policy, code, restarted):
    h = Harness(tmp_path, start_secs=0.5, telemetry_restart=policy)
    h.start_all()
    h.at(1.0)
    h.at(100.0)
    tel = h.children["telemetry"]
    tel.process.die(code)
    h.at(100.1)
    assert (tel.state == State.STARTING) is restarted
    assert tel.state == (State.STARTING if restarted else State.EXITED)


def test_compute_waits_for_its_reader(tmp_path):
    h = Harness(tmp_path, start_secs=0.5, backoff_s=1.0)
    h.start_all()
    h.at(1.0)
    h.at(100.0)
    reader, compute = h.children["reader"], h.children["compute"]
    reader.process.die(-9)
    compute.process.die(1)  # it notices its reader is gone and exits
    h.at(100.1)
    # reader restarts at once (a long run); compute's quick death would restart it too, after its reader
    assert reader.state == State.STARTING
    assert compute.state in (State.STARTING, State.BACKOFF)
    if compute.state == State.STARTING:
        assert h.spawned.index(("reader", reader.process.pid)) < h.spawned.index(("compute", compute.process.pid))


def test_compute_is_given_its_readers_pid(tmp_path):
    h = Harness(tmp_path)
    h.start_all()
    reader_pid = h.children["reader"].process.pid
    assert h.pids_given["compute"]["reader"] == reader_pid
    assert [name for name, _ in h.spawned] == list(Supervisor.ORDER)


@pytest.fixture
def root_logging():
    """Supervisor.start points the root logger at its log file: put it back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        if handler not in handlers:
            handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_a_started_supervisor_answers_on_its_socket_and_leaves_nothing(monkeypatch, root_logging):
    """The real Supervisor.start with a fake starter injected: real arenas,
    runtime dir and control socket; every child started in order; `status`
    and `stop` over the socket; then every child stopped in reverse order
    (SIGTERM: no fake reads a Shutdown) and nothing of the service left."""
    from moe_pipe.shared.makemodel.default_model import default_model_path
    from moe_pipe.shared.serve import service
    from moe_pipe.shared.wire import messages as m

    base = Path(tempfile.mkdtemp(prefix="mpsv", dir="/tmp"))  # short: unix socket paths <= 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    stopped: list[str] = []
    made: dict[str, FakeProcess] = {}
    launches = []

    def fake_start(name: str, pids) -> FakeProcess:
        proc = made[name] = FakeProcess(1000 + len(made))
        proc.terminate = lambda: (stopped.append(name), FakeProcess.terminate(proc))  # type: ignore[method-assign]
        return proc

    def starter(launch):
        launches.append(launch)
        return fake_start

    cfg = load_config(None, {"supervisor.start_secs": 0.1, "gateway.port": 0})  # port 0: nothing to hold (the fake gateway binds none)
    sup = Supervisor.start(cfg, default_model_path(), starter=starter)
    rt = sup.res.rt.path
    assert launches[0].res is sup.res and rt.is_dir() and os.environ[sv.LOG_FILE_ENV] == str(rt / service.LOG_FILE)
    segments = {p.name for p in Path("/dev/shm").glob(f"moe-pipe-{os.getpid()}-*")}
    assert len(segments) >= 2  # slabs and index (and dense)
    loop = threading.Thread(target=sup.run)
    loop.start()
    try:
        info = service.read_service_info(rt)
        assert info is not None and info.pid == os.getpid()
        status = service.control(info, "status")
        assert status.ok
        rows = status.data["processes"]
        assert [(r["name"], r["pid"]) for r in rows] == [(n, made[n].pid) for n in Supervisor.ORDER]
        assert status.data["slabs"] == sup.res.resolved.n_slabs and status.data["runtime_dir"] == str(rt)
        bad = service.control(info, "dance")
        assert not bad.ok and bad.code == m.Code.UNKNOWN_COMMAND and "status, stop" in bad.message
        assert service.control(info, "stop").ok
    finally:
        sup.stop_requested = sup.stop_requested or "test over"
        loop.join(30)
    assert not loop.is_alive()
    assert stopped == list(reversed(Supervisor.ORDER))
    assert all(c.state == State.STOPPED and c.process is None for c in sup.children.values())
    assert not rt.exists() and not any(Path("/dev/shm", name).exists() for name in segments)
    assert sv.LOG_FILE_ENV not in os.environ
    sup.close()  # again: nothing to do, nothing raised
    base.rmdir()  # empty: the runtime dir's base went with it


def test_a_changed_model_file_retries_the_fatal_child_and_what_needs_it(tmp_path):
    """The reader refused a replaced file and went FATAL; compute died with it and
    went FATAL after the original was already back (so with the current file's
    signature). When the watch retries the reader, compute gets its round too."""
    h = Harness(tmp_path, start_secs=0.5, backoff_s=1.0, start_retries=0)
    h.start_all()
    h.at(1.0)
    reader, compute = h.children["reader"], h.children["compute"]
    reader.process.die(1)
    h.at(1.1)
    assert reader.state == State.FATAL
    reader.fatal_model = ("other file",)
    compute.process.die(1)
    h.at(1.2)
    assert compute.state == State.FATAL
    compute.fatal_model = ("original",)
    signature = lambda path: ("original",)  # noqa: E731 - the file as it is now
    h._watch_model(10.0, signature)  # first look: wait for it to settle
    h._watch_model(20.0, signature)
    assert reader.state == State.STARTING
    assert compute.state in (State.STARTING, State.BACKOFF)  # not left FATAL beside a running reader
    h.at(21.0)
    h.at(22.0)
    assert (reader.state, compute.state) == (State.RUNNING, State.RUNNING)
