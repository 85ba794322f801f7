"""A memory cgroup for one benchmark run: made, joined by the run's process
tree, read (peak memory, page cache), removed.

cgroup v1 (a `memory` hierarchy, e.g. /sys/fs/cgroup/memory) and v2 (the
unified /sys/fs/cgroup with the memory controller) both count the page cache
against the limit, which is what emulates a small device: a model file read
through the page cache competes with everything else for the same RAM.

    with MemoryCgroup.create(limit_mb=2048) as cg:      # MemoryLimitError if not permitted
        subprocess.run(cg.wrap(cmd))                     # the child joins, then execs cmd
        cg.peak_bytes(), cg.page_cache_bytes()

A process can only leave a cgroup by joining another, so `wrap` makes the
child join before it execs; the benchmark itself stays outside.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


class MemoryLimitError(UserError):
    """No memory cgroup can be made here (not root, no controller, read-only)."""


@dataclass
class MemoryCgroup:
    path: Path
    version: int  # 1 or 2
    limit_bytes: int | None

    @classmethod
    def create(cls, limit_mb: float | None, name: str | None = None, v1_root: Path = V1_ROOT, v2_root: Path = V2_ROOT) -> MemoryCgroup:
        """A fresh cgroup with `limit_mb` (None: no limit, for accounting only)."""
        name = name or f"moe-pipe-bench-{os.getpid()}-{time.monotonic_ns()}"
        limit = None if limit_mb is None else int(limit_mb * (1 << 20))
        if (v1_root / "memory.limit_in_bytes").exists():
            version, path, limit_file = 1, v1_root / name, "memory.limit_in_bytes"
        elif "memory" in _read(v2_root / "cgroup.controllers").split():
            version, path, limit_file = 2, v2_root / name, "memory.max"
        else:
            raise MemoryLimitError(
                "no memory cgroup controller here (neither cgroup v1's memory hierarchy nor v2's "
                "memory controller is mounted); run without --mem-limit-mb"
            )
        try:
            path.mkdir()
        except OSError as exc:
            raise MemoryLimitError(
                f"cannot create a memory cgroup at {path}: {exc.strerror} (it needs root, or a "
                "delegated cgroup); run without --mem-limit-mb"
            ) from None
        cg = cls(path, version, limit)
        try:
            if limit is not None:
                (path / limit_file).write_text(str(limit))
                if version == 1 and (path / "memory.memsw.limit_in_bytes").exists():
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no escaping into swap
                if version == 2 and (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
        except OSError as exc:
            cg.remove()
            raise MemoryLimitError(f"cannot set the memory limit of {path}: {exc.strerror}") from None
        return cg

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run so that it (and all it starts) is inside this cgroup."""
        return ["sh", "-c", f'echo $$ > "{self.path / "cgroup.procs"}" && exec "$@"', "sh", *cmd]

    def peak_bytes(self) -> int | None:
        """The most memory (page cache included) the group used so far."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        text = _read(self.path / name)
        return int(text) if text.strip().isdigit() else None

    def page_cache_bytes(self) -> int | None:
        """Page cache charged to the group now (v1 `cache`, v2 `file`)."""
        stat = self.stat()
        return stat.get("cache" if self.version == 1 else "file")

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for memory."""
        if self.version == 1:
            return int(self._kv("memory.oom_control").get("oom_kill", 0))
        return int(self._kv("memory.events").get("oom_kill", 0))

    def stat(self) -> dict[str, int]:
        return self._kv("memory.stat")

    def _kv(self, name: str) -> dict[str, int]:
        out = {}
        for line in _read(self.path / name).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1])
        return out

    def remove(self) -> None:
        """Remove the group once its processes are gone (retried briefly: a
        process that just exited may still be counted). Idempotent."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                for pid in _read(self.path / "cgroup.procs").split():
                    try:
                        os.kill(int(pid), 9)  # a straggler of the run: it must not outlive the benchmark
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(0.1)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only), so a run starts cold as on a device."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False
