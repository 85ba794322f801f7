"""`moe-pipe tail`: a real CLI process attached to a fake service.

The fake service is this test process: a runtime dir owned by our pid, a
service.json, and a PUB socket bound where the telemetry process binds its
own. Tails are subprocesses pointed at it through XDG_RUNTIME_DIR.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import zmq

from moe_pipe.cli.tail_cmd import (
    PROMPT_LINE_S,
    SPARK_BLOCKS,
    WAITING_NOTICE,
    LiveOutput,
    RunSoFar,
    TextOutput,
    csv_row,
    format_line,
    format_prompt,
    format_slots,
    sparkline,
)
from moe_pipe.shared.serve.service import ServiceInfo, write_service_info
from moe_pipe.shared.telemetry import CSV_COLUMNS
from moe_pipe.shared.wire import ipc, messages
from moe_pipe.shared.wire.messages import TokenRecord

TIMEOUT_S = 15


def record(step: int, wall_ms: float = 250.0) -> TokenRecord:
    return TokenRecord(
        step=step,
        wall_ms=wall_ms,
        compute_ms=180.5,
        io_ms=90.25,
        read_bytes=3 << 20,
        cache_hit_pct=87.5,
        stall_ms=12.0,
        mgmt_ms=1.5,
        majflt=2,
        cpu_ms=170.0,
        hits=7,
        misses=1,
        prefetch_issued=0,
        prefetch_used=0,
        prefetch_wasted_bytes=0,
        wire_ms=0.2,
        rss_bytes=200 << 20,
        req_id=1,
    )


@pytest.fixture
def xdg():
    # Not tmp_path: pytest's long per-test paths plus moe-pipe/<pid>/telemetry-pub.sock
    # can pass the 107-byte unix socket path limit.
    d = Path(tempfile.mkdtemp(prefix="mpt", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class FakeService:
    """A runtime dir, service.json and the telemetry PUB socket."""

    def __init__(self, xdg: Path):
        self.ctx = zmq.Context()
        self.rt = ipc.RuntimeDir.create(base=xdg / "moe-pipe")
        self.pub = ipc.bind(self.ctx, self.rt.endpoints, "telemetry_pub")
        self.step = 0
        # Written last, as the supervisor does: a tail finds the service only
        # once this exists.
        write_service_info(
            ServiceInfo(
                pid=os.getpid(), runtime_dir=str(self.rt.path), config="", model="fake.gguf", model_name="fake", started=time.time()
            )
        )

    def publish_until(self, done, wall_ms: float = 250.0) -> None:
        """Publish records until done() holds. Slow joiners see nothing sent
        before their SUB connected, so keep sending rather than send once."""
        deadline = time.monotonic() + TIMEOUT_S
        while not done():
            assert time.monotonic() < deadline, "the tail saw no records"
            self.step += 1
            self.pub.send(messages.encode(record(self.step, wall_ms)))
            time.sleep(0.02)

    def close(self) -> None:
        self.pub.close(linger=0)
        self.ctx.term()
        self.rt.remove()


@pytest.fixture
def service(xdg):
    s = FakeService(xdg)
    yield s
    s.close()


class Tail:
    """A `moe-pipe tail` subprocess whose output lines are collected as they come."""

    def __init__(self, xdg: Path, *args: str):
        env = dict(os.environ, XDG_RUNTIME_DIR=str(xdg))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_pipe.cli.main", "tail", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._collect, args=(s, lines), daemon=True)
            for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _collect(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def rows(self) -> list[list[str]]:
        return [line.split(",") for line in self.out[1:]]

    def wait_for(self, cond, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not cond():
            assert self.proc.poll() is None, f"tail exited {self.proc.returncode}: {self.err}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}; stdout {self.out}, stderr {self.err}"
            time.sleep(0.02)

    def finish(self, timeout: float = TIMEOUT_S) -> int:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for t in self._threads:
            t.join(5)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()


# ------------------------------------------------------------------ pure parts


def test_sparkline_scales_from_zero_to_the_max():
    assert sparkline([1, 2, 4, 8]) == "▁▂▄█"
    assert sparkline([5, 5, 5]) == "███"  # steady speed is full height, not noise blown up
    assert sparkline([0, 0]) == "▁▁"
    assert sparkline([]) == ""
    assert set(sparkline([i % 9 for i in range(100)])) <= set(SPARK_BLOCKS)


def test_sparkline_keeps_the_last_width_values():
    line = sparkline(list(range(1, 101)), width=60)
    assert len(line) == 60 and line[-1] == "█"


def test_format_line_shows_the_token():
    line = format_line(record(12, wall_ms=250.0))
    for part in (
        "step    12",
        "4.00 tok/s",
        "wall    250.0 ms",
        "compute    180.5 ms",
        "io     90.2 ms",
        "stall    12.0 ms",
        "hit  87.5 %",
        "read     3.00 MiB",
        "majflt 2",
    ):
        assert part in line, part
    assert "\n" not in line
    assert "0.00 tok/s" in format_line(record(1, wall_ms=0.0))  # no division by zero


def test_csv_row_is_the_schema_columns():
    assert csv_row(record(3)).split(",") == ["3", "250.000", "180.500", "90.250", str(3 << 20), "87.500", "12.000", "1.500", "2", "170.000"]


def test_a_prompt_s_progress_is_one_line():
    p = messages.PromptProgress(3, 3664, 0, 1536, 29_700)
    assert format_prompt(p) == "prompt 1,536 / 3,664 tokens · 41 s left"
    assert format_prompt(messages.PromptProgress(3, 3664, 512, 512, 0)) == "prompt 512 / 3,664 tokens (512 cached)"
    assert (
        format_prompt(messages.PromptProgress(3, 3664, 512, 3664, 125_000))
        == "prompt 3,664 / 3,664 tokens (512 cached) · done in 2 min 5 s"
    )


def test_the_text_output_shows_a_prompt_now_and_then_and_when_it_is_done(capsys):
    clock = type("Clock", (), {"t": 0.0, "__call__": lambda self: self.t})()
    out = TextOutput(clock=clock)
    run = RunSoFar()
    for t, processed in ((0.0, 0), (0.25, 10), (4.9, 200), (5.1, 210), (5.4, 220), (10.2, 400), (10.3, 500)):
        clock.t = t
        out.on_prompt(run, messages.PromptProgress(1, 500, 0, processed, int(t * 1000)))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "prompt 210 / 500 tokens · 7 s left",  # the first line PROMPT_LINE_S after the prompt began
        "prompt 400 / 500 tokens · 3 s left",
        "prompt 500 / 500 tokens · done in 10 s",  # always the closing one
    ]
    assert PROMPT_LINE_S == 5.0
    clock.t = 11.0
    out.on_prompt(run, messages.PromptProgress(2, 30, 0, 0, 0))  # a short prompt: its opening is silent,
    out.on_prompt(run, messages.PromptProgress(2, 30, 0, 30, 40))  # its closing line says it all
    assert capsys.readouterr().out.splitlines() == ["prompt 30 / 30 tokens · done in <1 s"]


def _rendered(live: LiveOutput, run: RunSoFar) -> str:
    """The live table as a 200-column terminal shows it."""
    from io import StringIO

    from rich.console import Console

    text = StringIO()
    Console(file=text, width=200).print(live._render(run))
    return text.getvalue()


def test_the_live_table_shows_the_prompt_until_its_first_token():
    live = LiveOutput("svc")
    try:
        run = RunSoFar()

        def shown() -> str:
            return _rendered(live, run)

        run.prompt = messages.PromptProgress(1, 3664, 0, 1536, 29_700)
        assert "prompt 1,536 / 3,664 tokens · 41 s left" in shown()
        run.add(record(1))  # its first token: the prompt is done
        assert "prompt " not in shown() and "run so far" in shown()
    finally:
        live.close()


def slot_states(*slots: tuple[int, int, int, int, int], held: tuple[int, ...] | None = None, pool: int = 0) -> messages.SlotStates:
    """Compute's slots, each (req_id, total, cache, processed, decoded); `held`: the positions
    each slot's cache holds, of a KV pool of `pool` (0: none said)."""
    req_ids, total, cache, processed, decoded = (tuple(column) for column in zip(*slots))
    return messages.SlotStates(req_ids, total, cache, processed, decoded, held or (0,) * len(slots), pool)


BUSY = slot_states((7, 40, 0, 40, 35), (9, 3664, 512, 1536, 0), (0, 0, 0, 0, 0))


def test_the_slots_are_a_line_each():
    assert format_slots(BUSY) == ["slot 0 decoding, 35 tokens", "slot 1 prompt 1,536 / 3,664 tokens (512 cached)", "slot 2 idle"]
    assert format_slots(slot_states((3, 10, 0, 10, 1), (4, 9, 0, 0, 0))) == ["slot 0 decoding, 1 token", "slot 1 prompt 0 / 9 tokens"]
    pooled = slot_states((3, 10, 0, 10, 1), (0, 0, 0, 0, 0), held=(11, 4096), pool=14336)
    assert format_slots(pooled) == ["slot 0 decoding, 1 token", "slot 1 idle", "KV pool 4,107 / 14,336 positions"]


def test_the_text_output_shows_the_slots_as_one_changes_state_and_now_and_then_between(capsys):
    clock = type("Clock", (), {"t": 0.0, "__call__": lambda self: self.t})()
    out, run = TextOutput(clock=clock), RunSoFar()
    idle = slot_states((0, 0, 0, 0, 0), (0, 0, 0, 0, 0))
    for t, states in (
        (0.0, slot_states((7, 40, 0, 8, 0), (0, 0, 0, 0, 0))),  # a request came: at once
        (0.3, slot_states((7, 40, 0, 24, 0), (0, 0, 0, 0, 0))),  # its progress within PROMPT_LINE_S: held
        (0.4, slot_states((7, 40, 0, 40, 1), (9, 30, 0, 0, 0))),  # its prompt is done, another came: at once
        (5.5, slot_states((7, 40, 0, 40, 60), (9, 30, 0, 14, 0))),  # PROMPT_LINE_S on: the figures
        (5.7, slot_states((7, 40, 0, 40, 61), (9, 30, 0, 16, 0))),
        (5.8, idle),  # at rest: at once
        (5.9, idle),  # the same again: not
    ):
        clock.t = t
        run.slots = states
        out.on_slots(run)
    assert capsys.readouterr().out.splitlines() == [
        "slots: slot 0 prompt 8 / 40 tokens · slot 1 idle",
        "slots: slot 0 decoding, 1 token · slot 1 prompt 0 / 30 tokens",
        "slots: slot 0 decoding, 60 tokens · slot 1 prompt 14 / 30 tokens",
        "slots: slot 0 idle · slot 1 idle",
    ]


def test_the_live_table_shows_a_line_a_slot_in_place_of_the_prompt_s():
    live = LiveOutput("svc")
    try:
        run = RunSoFar()

        def shown() -> str:
            return _rendered(live, run)

        run.add(record(1))
        run.prompt = messages.PromptProgress(9, 3664, 512, 1536, 29_700)
        assert format_prompt(run.prompt) in shown()  # parallel 1: no slots, as before
        run.slots = BUSY  # several slots: their lines say every prompt's progress
        table = shown()
        assert all(line in table for line in format_slots(BUSY)) and format_prompt(run.prompt) not in table
    finally:
        live.close()


def test_the_text_output_shows_the_warm_start_now_and_then_and_when_it_ends(capsys, tmp_path):
    from moe_pipe.cli.tail_cmd import watch_warming
    from moe_pipe.shared.experts.hotset import WarmProgress

    clock = type("Clock", (), {"t": 0.0, "__call__": lambda self: self.t})()
    out, run = TextOutput(clock=clock), RunSoFar()
    assert not watch_warming(run, str(tmp_path))  # no warm start: nothing
    for t, done, state in ((0.0, 12, "warming"), (0.5, 40, "warming"), (0.7, 40, "warming"), (5.5, 812, "warming"), (6.0, 3071, "done")):
        clock.t = t
        WarmProgress(state, done, 3071, "/h.json", t).write(tmp_path)
        if watch_warming(run, str(tmp_path)):
            out.on_warming(run)
    assert capsys.readouterr().out.splitlines() == [
        "warming 12/3,071 experts",
        "warming 812/3,071 experts",  # a line every PROMPT_LINE_S
        "warm start: 3,071/3,071 experts in 6.0 s",  # always the closing one
    ]
    live = LiveOutput("svc")
    try:
        from io import StringIO

        from rich.console import Console

        run.warming = WarmProgress("warming", 812, 3071)
        text = StringIO()
        Console(file=text, width=200).print(live._render(run))
        assert "warming 812/3,071 experts" in text.getvalue()
    finally:
        live.close()


# ------------------------------------------------------------- the real command


@pytest.mark.integration
def test_csv_rows_carry_published_records(xdg, service):
    tail = Tail(xdg, "--csv")
    try:
        service.publish_until(lambda: len(tail.out) >= 4, wall_ms=125.0)
        assert tail.out[0] == ",".join(CSV_COLUMNS)
        rows = tail.rows()
        steps = [int(r[0]) for r in rows]
        assert steps == sorted(steps) and all(1 <= s <= service.step for s in steps)
        assert all(len(r) == len(CSV_COLUMNS) and r[1] == "125.000" for r in rows)
    finally:
        tail.stop()


@pytest.mark.integration
def test_three_tails_at_once_all_see_records(xdg, service):
    tails = [Tail(xdg, "--csv") for _ in range(3)]
    try:
        service.publish_until(lambda: all(len(t.out) >= 3 for t in tails))
        # The same stream: the rows each saw are consecutive records.
        for t in tails:
            steps = [int(r[0]) for r in t.rows()]
            assert steps == list(range(steps[0], steps[0] + len(steps)))
    finally:
        for t in tails:
            t.stop()


@pytest.mark.integration
def test_plain_text_lines_when_not_a_terminal(xdg, service):
    tail = Tail(xdg)
    try:
        service.publish_until(lambda: len(tail.out) >= 2)
        assert all(line.startswith("step ") and "tok/s" in line for line in tail.out)
    finally:
        tail.stop()


@pytest.mark.integration
def test_a_prompt_s_progress_reaches_a_tail_before_its_tokens(xdg, service):
    tail = Tail(xdg)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not tail.out:  # a slow joiner misses what came before it connected: send until seen
            assert time.monotonic() < deadline, f"the tail showed no prompt; stderr {tail.err}"
            service.pub.send(messages.encode(messages.PromptProgress(1, 3664, 0, 3664, 125_000)))
            time.sleep(0.05)
        service.publish_until(lambda: len(tail.out) >= 3)
        assert tail.out[0] == "prompt 3,664 / 3,664 tokens · done in 2 min 5 s"
        assert all(line.startswith("step ") for line in tail.out[1:] if not line.startswith("prompt "))
    finally:
        tail.stop()


@pytest.mark.integration
def test_a_tail_shows_a_service_s_slots(xdg, service):
    tail = Tail(xdg)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(line.startswith("slots: ") for line in tail.out):  # a slow joiner: send until seen
            assert time.monotonic() < deadline, f"the tail showed no slots; stdout {tail.out}, stderr {tail.err}"
            service.pub.send(messages.encode(BUSY))
            time.sleep(0.05)
        assert tail.out[0] == "slots: " + " · ".join(format_slots(BUSY))
    finally:
        tail.stop()


@pytest.mark.integration
def test_a_tail_shows_the_warm_start_from_the_runtime_folder(xdg, service):
    from moe_pipe.shared.experts.hotset import WarmProgress

    tail = Tail(xdg)
    try:
        WarmProgress("warming", 812, 3071).write(service.rt.path)
        tail.wait_for(lambda: "warming 812/3,071 experts" in tail.out, "the warming line")
        WarmProgress("done", 3071, 3071, seconds=9.5).write(service.rt.path)
        tail.wait_for(lambda: "warm start: 3,071/3,071 experts in 9.5 s" in tail.out, "the closing line")
    finally:
        tail.stop()


@pytest.mark.integration
def test_a_tail_started_first_waits_then_attaches(xdg):
    tail = Tail(xdg, "--csv")
    service = None
    try:
        tail.wait_for(lambda: WAITING_NOTICE in tail.err, "the waiting notice")
        time.sleep(0.3)
        assert tail.proc.poll() is None and tail.out == []
        service = FakeService(xdg)
        service.publish_until(lambda: len(tail.out) >= 2)
        assert tail.out[0] == ",".join(CSV_COLUMNS)
        assert tail.err.count(WAITING_NOTICE) == 1
    finally:
        tail.stop()
        if service:
            service.close()


@pytest.mark.integration
def test_wait_gives_up_with_one_error_line(xdg):
    tail = Tail(xdg, "--csv", "--wait", "0.5")
    assert tail.finish() == 2
    assert tail.out == []
    errors = [line for line in tail.err if line.startswith("moe-pipe: error:")]
    assert len(errors) == 1 and "no moe-pipe service is running" in errors[0]
    assert tail.err == [WAITING_NOTICE, errors[0]]  # the notice, then the error: no traceback


@pytest.mark.integration
def test_exits_0_when_the_service_goes_away(xdg, service):
    tail = Tail(xdg, "--csv")
    try:
        service.publish_until(lambda: len(tail.out) >= 2)
        service.rt.remove()
        assert tail.finish(timeout=5) == 0
        assert tail.err[-1] == "service stopped"
    finally:
        tail.stop()


@pytest.mark.integration
def test_ctrl_c_detaches_with_exit_0(xdg, service):
    tail = Tail(xdg, "--csv")
    try:
        service.publish_until(lambda: len(tail.out) >= 2)
        tail.proc.send_signal(signal.SIGINT)
        assert tail.finish(timeout=5) == 0
        assert not any("Traceback" in line for line in tail.err)
        # The service did not notice: another tail still gets records.
        other = Tail(xdg, "--csv")
        try:
            service.publish_until(lambda: len(other.out) >= 2)
        finally:
            other.stop()
    finally:
        tail.stop()


@pytest.mark.integration
def test_closed_pipe_ends_quietly(xdg, service):
    # `moe-pipe tail --csv | head -3`: the reader goes away, the tail leaves without a traceback.
    env = dict(os.environ, XDG_RUNTIME_DIR=str(xdg))
    proc = subprocess.Popen(
        f"{sys.executable} -m moe_pipe.cli.main tail --csv | head -3",
        shell=True,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        service.publish_until(lambda: proc.poll() is not None)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.splitlines()[0] == ",".join(CSV_COLUMNS) and len(out.splitlines()) == 3
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_a_tail_attached_after_the_start_shows_the_services_budget_and_load(monkeypatch):
    """The RunInfo went out when the service started, before the tail subscribed: the
    budget and load time come from the service's status (they read 0.0 MiB and 0.00 s)."""
    from moe_pipe.cli import tail_cmd
    from moe_pipe.shared.serve import service as svc
    from moe_pipe.shared.telemetry import format_summary

    info = ServiceInfo(os.getpid(), "/nonexistent", "", "tiny", "tiny", time.time())
    status = messages.Status.success(budget_bytes=64 << 20, load_seconds=1.25)
    monkeypatch.setattr(svc, "control", lambda i, name, **kw: status if kw["timeout_ms"] <= 1000 else None)
    run = tail_cmd.RunSoFar(fetch_info=lambda: tail_cmd.service_run_info(info))
    run.add(record(0))
    text = format_summary(run.summary())
    assert "budget 64.0 MiB" in text and "load 1.25 s" in text

    def silent(i, name, **kw):
        raise svc.NoService("does not answer")

    monkeypatch.setattr(svc, "control", silent)
    assert tail_cmd.service_run_info(info) is None
