"""How many compute threads this machine's free cores give.

    choose_threads(configured)  -> Cores   the count, and why (compute.threads unset: measured)
    engine_cpu(root_pid)        -> ()->s   CPU seconds of an engine's processes (not other work)

The kernels split each product's rows over numba's threads and every call
waits for its slowest thread, so a thread whose core another process holds
stalls every call: on two cores with one held, decode ran at a fraction of
its one-thread speed (issue 33: 3.5 against 1,063 tok/s on the tiny model).
With `compute.threads` unset the count is the cores this process may use
(its CPU affinity and its cgroup's CPU quota) less the cores other work kept
busy over a short sample of /proc/stat, at least one. Low-priority work
(`nice` time: moe-pipe's own page populators run at nice 19) yields its core
and does not count; time the host stole from this VM does. The engine's own
processes are not other work (`engine`: compute passes its parent, `run`'s
process or the service's supervisor): when compute starts they are still
starting too (the dense set read into shared memory keeps a core busy for a
second or two), and counted as other work they took one of two cores' threads
for the whole run. The choice is made once, when compute starts: a job that
starts later is not seen.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

SAMPLE_S = 0.15  # a few scheduler slices of a busy neighbour (15 ticks of a core at 100 Hz); start-up pays it once
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class Cores:
    threads: int  # compute threads to use
    usable: int  # cores this process may run on: affinity, cgroup quota
    busy: float  # cores other processes kept busy over the sample (0 when not sampled)
    reason: str  # one clause for the start-up line and `doctor`

    def line(self) -> str:
        return f"compute threads {self.threads} ({self.reason})"


def usable_cores(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores this process may use: its affinity mask, cut to its cgroup's CPU quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return max(1, min(n, math.ceil(quota))) if quota is not None else max(1, n)


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """Cores' worth of CPU time this process's cgroup v2 (and its ancestors) allow, or None
    when no quota is set (cpu.max "max") or there is no cgroup v2."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rel = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    if rel is None:
        return None
    best: float | None = None
    path = cgroup_root / rel.lstrip("/")
    while True:
        try:
            quota, period = (path / "cpu.max").read_text().split()[:2]
            if quota != "max":
                cores = int(quota) / int(period)
                best = cores if best is None else min(best, cores)
        except (OSError, ValueError):
            pass
        if path == cgroup_root or cgroup_root not in path.parents:
            return best
        path = path.parent


def cpu_ticks(stat: str, cpus: set[int] | None) -> tuple[int, int]:
    """(busy, total) clock ticks of /proc/stat's per-CPU lines for `cpus` (all when None). Busy is
    user + system + irq + softirq + steal: not idle, not iowait, not nice (low-priority work
    yields its core), and guest time is already inside user."""
    busy = total = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in fields[:8]] + [0] * (8 - len(fields[:8]))
        user, nice, system, idle, iowait, irq, softirq, steal = v
        busy += user + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return busy, total


def busy_cores(seconds: float = SAMPLE_S, read_stat=lambda: Path("/proc/stat").read_text(), own_cpu=None) -> float:
    """Cores other processes kept busy over `seconds`: the busy share of this process's CPUs,
    less this process's own CPU time over the same window."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    own = own_cpu or (lambda: sum(os.times()[:2]))
    b0, t0 = cpu_ticks(read_stat(), cpus)
    o0 = own()
    time.sleep(seconds)
    b1, t1 = cpu_ticks(read_stat(), cpus)
    o1 = own()
    n = len(cpus) if cpus is not None else (os.cpu_count() or 1)
    if t1 <= t0:
        return 0.0
    share = (b1 - b0) / (t1 - t0)  # of all n cores
    wall = (t1 - t0) / n / os.sysconf("SC_CLK_TCK")  # the window in seconds, by the kernel's clock
    return max(0.0, share * n - (o1 - o0) / max(wall, 1e-9))


def engine_cpu(root_pid: int) -> Callable[[], float]:
    """A function giving the CPU seconds (user + system) the process `root_pid` and every
    process it started so far have used: busy_cores' `own_cpu` for an engine of several
    processes. The processes are those alive now; one that ends keeps its last figure."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = []
    last: dict[int, float] = {}

    def total() -> float:
        for proc in procs:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            last[proc.pid] = t.user + t.system
        return sum(last.values()) + (0.0 if procs else sum(os.times()[:2]))

    return total


def choose_threads(
    configured: int | None, *, most: int | None = None, sample_s: float = SAMPLE_S, busy=None, engine: int | None = None
) -> Cores:
    """`configured` when set; else the usable cores less the busy ones (a core counts as
    held when other work kept it over half busy), at least 1, at most `most`
    (numba's NUMBA_NUM_THREADS). `engine`: the pid whose process tree is this engine (its
    own work is not other work); by default this process alone."""
    usable = usable_cores()
    if configured:
        return Cores(configured, usable, 0.0, "set with -t / compute.threads")
    if busy is None:
        own = engine_cpu(engine) if engine is not None else None
        held = busy_cores(sample_s, own_cpu=own)
    else:
        held = busy(sample_s)
    n = max(1, usable - round(held))
    if most is not None:
        n = min(n, most)
    if round(held) >= 1:
        why = f"{usable} usable cores, {held:.1f} kept busy by other work when it started; -t N to choose"
    else:
        why = f"the {usable} usable cores, none busy when it started"
    return Cores(n, usable, held, why)
