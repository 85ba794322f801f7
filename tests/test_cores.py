"""shared/cores.py: how many compute threads the free cores give."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_pipe.shared import cores


def stat(*cpus: tuple[int, ...]) -> str:
    """A /proc/stat with one line per CPU: user nice system idle iowait irq softirq steal."""
    total = [sum(c[i] for c in cpus) for i in range(8)]
    lines = ["cpu  " + " ".join(map(str, total))] + [f"cpu{k} " + " ".join(map(str, c)) + " 0 0" for k, c in enumerate(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 99"]) + "\n"


def test_busy_ticks_leave_out_idle_iowait_and_nice():
    text = stat((10, 50, 5, 100, 7, 1, 2, 3), (0, 0, 0, 200, 0, 0, 0, 0))
    assert cores.cpu_ticks(text, None) == (10 + 5 + 1 + 2 + 3, 10 + 50 + 5 + 100 + 7 + 1 + 2 + 3 + 200)
    assert cores.cpu_ticks(text, {1}) == (0, 200)


def test_busy_cores_counts_other_processes_not_this_one(monkeypatch):
    # over the window both CPUs tick 100 times; 150 ticks busy = 1.5 cores, of which this
    # process used 0.5 of a core's time
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cores.os, "sysconf", lambda name: 100)
    snaps = iter([stat((0, 0, 0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0, 0)), stat((90, 0, 10, 0, 0, 0, 0, 0), (40, 0, 0, 50, 0, 0, 0, 10))])
    own = iter([1.0, 1.5])
    busy = cores.busy_cores(0.0, read_stat=lambda: next(snaps), own_cpu=lambda: next(own))
    assert busy == pytest.approx(1.5 - 0.5)


@pytest.mark.parametrize("busy, usable, threads", [(0.0, 2, 2), (0.4, 2, 2), (0.6, 2, 1), (1.0, 2, 1), (3.0, 2, 1), (1.2, 4, 3)])
def test_threads_are_the_usable_cores_less_the_busy_ones(monkeypatch, busy, usable, threads):
    monkeypatch.setattr(cores, "usable_cores", lambda: usable)
    got = cores.choose_threads(None, busy=lambda s: busy)
    assert got.threads == threads and got.usable == usable
    assert ("kept busy by other work" in got.reason) == (threads < usable or busy >= 1)


def test_a_set_count_is_kept_and_numba_caps_the_choice(monkeypatch):
    monkeypatch.setattr(cores, "usable_cores", lambda: 8)
    assert cores.choose_threads(3, busy=lambda s: 7.0).threads == 3  # the user's word wins
    assert cores.choose_threads(None, most=2, busy=lambda s: 0.0).threads == 2


def test_a_cgroup_quota_cuts_the_usable_cores(tmp_path):
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "a" / "cpu.max").write_text("150000 100000\n")  # 1.5 cores: two threads may run
    (root / "a" / "b" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert cores.cgroup_cpu_quota(root, proc) == pytest.approx(1.5)
    assert cores.usable_cores(root, proc) <= 2
    proc.write_text("0::/\n")
    assert cores.cgroup_cpu_quota(root, proc) is None


@pytest.mark.integration
def test_a_spinning_neighbour_is_seen_as_a_busy_core():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert cores.busy_cores(0.4) >= 0.5  # the spinner holds at least half a core (others may add)
    finally:
        spin.kill()
        spin.wait()


@pytest.mark.quiet
def test_this_process_own_work_is_not_counted():
    import threading
    import time

    stop = time.perf_counter() + 0.6

    def work() -> None:
        while time.perf_counter() < stop:
            pass

    t = threading.Thread(target=work)
    t.start()
    try:
        alone = cores.busy_cores(0.4)
    finally:
        t.join()
    quiet = Path("/proc/loadavg").read_text().split()[0]
    # our own busy thread is subtracted: what is left is other processes' work
    assert alone < 0.8 or float(quiet) > 1.5


@pytest.mark.integration
def test_an_engines_cpu_counts_the_processes_it_started():
    """engine_cpu(pid) adds the CPU of every process `pid` started (compute's siblings and its
    parent at start-up), where this process's own clock sees none of a child's work."""
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 5: pass"])
    try:
        engine, alone = cores.engine_cpu(os.getpid()), sum(os.times()[:2])
        e0 = engine()
        time.sleep(1.0)  # the child burns a core (at least half of one on two busy cores)
        grew, own_grew = engine() - e0, sum(os.times()[:2]) - alone
    finally:
        burner.kill()
        burner.wait()
    assert grew >= 0.3 and own_grew < 0.2, (grew, own_grew)


def test_the_engine_is_passed_on_to_the_busy_sample(monkeypatch):
    """choose_threads(engine=pid) leaves the engine's own processes out of the busy cores."""
    seen = []
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    monkeypatch.setattr(cores, "engine_cpu", lambda pid: seen.append(pid) or (lambda: 0.0))
    monkeypatch.setattr(cores, "busy_cores", lambda s, own_cpu=None: 0.0 if own_cpu is not None else 1.0)
    assert cores.choose_threads(None, engine=1234).threads == 2 and seen == [1234]
    assert cores.choose_threads(None).threads == 1  # this process alone: the rest counts as other work
