"""The supervisor's restart logic as data: guarded state changes, backoff,
FATAL after repeated failed starts, restart policies, dependencies — driven
with fake processes and a fake clock (the real processes: test_service.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_pipe.procs import supervisor as sv
from moe_pipe.procs.lifecycle import error_file
from moe_pipe.procs.supervisor import ALLOWED, Child, IllegalTransition, State, Supervisor, backoff_delay
from moe_pipe.shared.config import load_config


@dataclass
class FakeProcess:
    pid: int
    alive: bool = True
    exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.alive

    def die(self, code: int) -> None:
        self.alive, self.exitcode = False, code


class Harness(Supervisor):
    """A Supervisor whose spawns make FakeProcesses (no fork, no arenas)."""

    def __init__(self, tmp_path: Path, **sup):
        cfg = load_config(None, {f"supervisor.{k}": v for k, v in sup.items()})
        super().__init__(cfg, Path("model.gguf"))
        self.res = SimpleNamespace(rt=SimpleNamespace(path=tmp_path))
        self.next_pid = 100
        self.spawned: list[tuple[str, int]] = []

    def _spawn(self, child: Child) -> None:  # the real one minus the process and the arenas
        if any(self.children[n].state not in sv.LIVE for n in child.needs):
            if child.state != State.BACKOFF:
                child.change(State.BACKOFF, "waiting")
            child.backoff_until = 0
            return
        self.next_pid += 1
        child.process = FakeProcess(self.next_pid)
        if child.state != State.STOPPED:
            child.restarts += 1
        child.change(State.STARTING)
        child.started_at = self.now
        self.spawned.append((child.name, self.next_pid))

    def start_all(self, now: float = 0.0) -> None:
        self.now = now
        for name in self.ORDER:
            self._spawn(self.children[name])

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


def test_control_commands(tmp_path):
    h = Harness(tmp_path)
    h.start_all()
    from moe_pipe.shared.wire import messages as m

    bad = h.command(m.Command("dance"))
    assert not bad.ok and bad.code == m.Code.UNKNOWN_COMMAND and "status, stop" in bad.message
    assert h.command(m.Command("stop")).ok and h.stop_requested


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
