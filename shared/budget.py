"""The expert cache budget: how many bytes the slab arena may hold.

    probe_memory()            -> MemoryProbe   what this process tree may still use (reads /proc, /sys)
    compute_budget(...)       -> Budget        pure: probe + cache settings + dense + KV -> bytes
    resolve_budget(cfg, ...)  -> Budget        both, plus the refusal when the floor does not fit

auto = min(host available, every enclosing cgroup's limit - working set)
       - dense set (when resident: dense_weights anon or warm) - KV cache - reserve,
       clamped to cache_ceil_mb.

Why cgroups: psutil's `available` is the host's; inside a memory cgroup (a
container, or the benchmark's emulated 11 GB device) the limit is what the
OOM killer enforces. Limits are hierarchical, so every level from this
process's cgroup up to the hierarchy root is read and the tightest wins.
Working set = usage - inactive file pages, as container runtimes count it:
the page cache counts against the limit but the kernel drops inactive file
pages before it OOM-kills, so counting them as used would starve the budget
right after the model file was written or read.

The reserve (cache.reserve_mb, default 512 MiB) is what the processes need
beside the cache and dense set. Measured on this machine: a compute process
running the tiny model peaks at 180 MiB RSS (numpy + numba kernels + model
code), an interpreter with numpy and pyzmq at 28 MiB, so reader + compute +
telemetry + gateway come to ~300-400 MiB before a real tokenizer (150k vocab)
and activations; 512 MiB covers that with some room. A fixed amount rather
than a percentage: the overhead is per process, not per GiB of RAM, and a
percentage would take 1-2 GiB from a large host for nothing. Lower it with
cache.reserve_mb in a tight cgroup.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

MiB = 1 << 20
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX rounded to a page (9223372036854771712);
# anything this large is no limit.
UNLIMITED = 1 << 62
RESIDENT_DENSE = ("anon", "warm")  # dense policies that keep the dense set in RAM for the whole run


@dataclass(frozen=True)
class CgroupLimit:
    """One level of the cgroup hierarchy that has a memory limit."""

    where: str  # e.g. "cgroup v1 /sys/fs/cgroup/memory/bench"
    limit_bytes: int
    usage_bytes: int
    inactive_file_bytes: int = 0

    @property
    def working_set_bytes(self) -> int:
        return max(0, self.usage_bytes - self.inactive_file_bytes)

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.limit_bytes - self.working_set_bytes)


@dataclass(frozen=True)
class MemoryProbe:
    """What this process tree may still allocate, and where that figure comes from."""

    host_available_bytes: int
    cgroups: tuple[CgroupLimit, ...] = ()

    @property
    def available_bytes(self) -> int:
        return min([self.host_available_bytes] + [c.headroom_bytes for c in self.cgroups])

    def describe(self) -> str:
        tight = min(self.cgroups, key=lambda c: c.headroom_bytes, default=None)
        if tight is not None and tight.headroom_bytes < self.host_available_bytes:
            return (f"{_mib(tight.headroom_bytes)} free in {tight.where} (limit {_mib(tight.limit_bytes)}, "
                    f"working set {_mib(tight.working_set_bytes)}; host available {_mib(self.host_available_bytes)})")
        return f"host available {_mib(self.host_available_bytes)}" + (
            f" (cgroup limit {_mib(tight.limit_bytes)} not tighter)" if tight is not None else "")


@dataclass(frozen=True)
class Budget:
    """The resolved expert cache size; `description` is printed at start-up and recorded in telemetry."""

    bytes: int
    mode: str  # "auto" | "fixed"
    description: str
    available_bytes: int | None = None  # auto only
    dense_bytes: int = 0  # subtracted (0 unless resident)
    kv_bytes: int = 0
    reserve_bytes: int = 0
    ceil_bytes: int = 0
    clamped: bool = False

    @property
    def mb(self) -> float:
        return self.bytes / MiB

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"mb": round(self.mb, 3)}


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.3g} MiB"


# ---------------------------------------------------------------- pure

def compute_budget(cache_mb: float | str, cache_ceil_mb: float, memory: MemoryProbe | None, *, dense_bytes: int,
                   kv_bytes: int, dense_policy: str, reserve_mb: float = 512.0) -> Budget:
    """The budget from its inputs; no I/O. `memory` is only read when cache_mb is "auto"."""
    ceil = int(cache_ceil_mb * MiB)
    if cache_mb != "auto":
        want = int(float(cache_mb) * MiB)
        size = min(want, ceil)
        text = f"cache {_mib(size)}: fixed cache_mb {float(cache_mb):g}" + (
            f", clamped to cache_ceil_mb {cache_ceil_mb:g}" if want > ceil else "")
        return Budget(size, "fixed", text, ceil_bytes=ceil, clamped=want > ceil)
    if memory is None:
        raise ValueError("cache_mb = auto needs a memory probe")
    avail = memory.available_bytes
    dense = dense_bytes if dense_policy in RESIDENT_DENSE else 0
    reserve = int(reserve_mb * MiB)
    free = max(0, avail - dense - kv_bytes - reserve)
    size = min(free, ceil)
    dense_text = f"dense {_mib(dense)} ({dense_policy})" if dense else f"dense not counted ({dense_policy}: file pages)"
    text = (f"cache {_mib(size)}: auto = {memory.describe()} - {dense_text} - KV {_mib(kv_bytes)} "
            f"- reserve {_mib(reserve)} = {_mib(free)}" + (f", clamped to cache_ceil_mb {cache_ceil_mb:g}" if free > ceil else ""))
    return Budget(size, "auto", text, available_bytes=avail, dense_bytes=dense, kv_bytes=kv_bytes,
                  reserve_bytes=reserve, ceil_bytes=ceil, clamped=free > ceil)


def check_floor(budget: Budget, min_bytes: int, where: str = "config") -> None:
    """Refuse a budget below one token's working set, saying what would work."""
    if budget.bytes >= min_bytes:
        return
    need_mb = min_bytes / MiB
    if budget.mode == "fixed":
        fix = (f"set cache_mb >= {need_mb:.4g}" + (f" and cache_ceil_mb >= {need_mb:.4g}" if budget.clamped else ""))
        raise ConfigError(f"{where}: expert cache of {_mib(budget.bytes)} is below one token's working set "
                          f"({need_mb:.4g} MiB: every layer's top-k experts); {fix}")
    if budget.clamped:
        raise ConfigError(f"{where}: cache_ceil_mb {budget.ceil_bytes / MiB:g} is below one token's working set "
                          f"({need_mb:.4g} MiB); raise it")
    short = min_bytes - budget.bytes
    raise ConfigError(f"{where}: not enough memory for the expert cache: {budget.description}, but one token's "
                      f"working set needs {need_mb:.4g} MiB ({short / MiB:.4g} MiB short); raise the memory limit, "
                      f"lower cache.reserve_mb, use dense_weights = \"mmap\", or a smaller top_k")


# ---------------------------------------------------------------- probing

def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, names: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    stats = dict(line.split(None, 1) for line in lines if " " in line)
    for name in names:
        if name in stats:
            try:
                return int(stats[name])
            except ValueError:
                pass
    return 0


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(v1 memory path, v2 path) of this process, from /proc/self/cgroup."""
    v1 = v2 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _walk(mount: Path, rel: str):
    """The cgroup's folder and its ancestors up to the mount, tightest first.

    Inside a container the mount's root may already be this cgroup (cgroup
    namespaces), so leading components that do not exist are dropped.
    """
    parts = [p for p in rel.split("/") if p]
    while parts and not (mount.joinpath(*parts)).is_dir():
        parts.pop(0)
    while True:
        yield mount.joinpath(*parts) if parts else mount
        if not parts:
            return
        parts.pop()


def _v1_limits(mount: Path, rel: str) -> list[CgroupLimit]:
    out = []
    for d in _walk(mount, rel):
        limit = _read_int(d / "memory.limit_in_bytes")
        if limit is None or limit >= UNLIMITED:
            continue
        usage = _read_int(d / "memory.usage_in_bytes") or 0
        inactive = _stat_value(d / "memory.stat", ("total_inactive_file", "inactive_file"))
        out.append(CgroupLimit(f"cgroup v1 {d}", limit, usage, inactive))
    return out


def _v2_limits(mount: Path, rel: str) -> list[CgroupLimit]:
    out = []
    for d in _walk(mount, rel):
        # memory.high throttles hard before memory.max kills; the tighter of the two is the limit to plan for.
        limits = [x for x in (_read_int(d / "memory.max"), _read_int(d / "memory.high")) if x is not None and x < UNLIMITED]
        if not limits or d == mount:  # the root cgroup has no memory.max
            continue
        usage = _read_int(d / "memory.current") or 0
        inactive = _stat_value(d / "memory.stat", ("inactive_file",))
        out.append(CgroupLimit(f"cgroup v2 {d}", min(limits), usage, inactive))
    return out


def _host_available() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil is a declared runtime dependency; /proc/meminfo says the same thing
        kib = _stat_value(Path("/proc/meminfo"), ("MemAvailable:",))
        return kib * 1024


def probe_memory(sys_cgroup: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup",
                 host_available_bytes: int | None = None) -> MemoryProbe:
    """Memory this process tree may still use: host available and every enclosing cgroup v1/v2 limit.

    The arguments exist so tests can point it at fake trees; callers use the defaults.
    """
    root = Path(sys_cgroup)
    v1, v2 = _own_cgroups(Path(proc_cgroup))
    limits: list[CgroupLimit] = []
    if v1 is not None and (root / "memory").is_dir():
        limits += _v1_limits(root / "memory", v1)
    if v2 is not None:
        # unified hierarchy at the root (pure v2) or at unified/ (hybrid, as on these machines)
        mount = root if (root / "cgroup.controllers").exists() else root / "unified"
        if mount.is_dir():
            limits += _v2_limits(mount, v2)
    host = _host_available() if host_available_bytes is None else host_available_bytes
    return MemoryProbe(host, tuple(limits))


def resolve_budget(cfg: Any, *, dense_bytes: int, kv_bytes: int, min_bytes: int | None = None,
                   memory: MemoryProbe | None = None) -> Budget:
    """The budget for a loaded Config (`cfg.cache`, `cfg.io.dense_weights`); probes memory when auto.

    With `min_bytes` (Layout.min_cache_bytes(top_k)), a budget below it is a ConfigError with the numbers.
    """
    c = cfg.cache
    if c.cache_mb == "auto" and memory is None:
        memory = probe_memory()
    budget = compute_budget(c.cache_mb, c.cache_ceil_mb, memory, dense_bytes=dense_bytes, kv_bytes=kv_bytes,
                            dense_policy=cfg.io.dense_weights, reserve_mb=c.reserve_mb)
    if min_bytes is not None:
        check_floor(budget, min_bytes, cfg.source or "config")
    return budget


if __name__ == "__main__":
    probe = probe_memory()
    print(probe.describe())
    for c in probe.cgroups:
        print(" ", c)
    print("pid", os.getpid())
