"""Whether a process runs, asked by pid: the owner checks of shared-memory segments and
temporary files, and a child's watch on its peers."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs. A zombie does not: a kill -9'd child not yet reaped
    still answers kill(0), so its /proc state is read too."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone since the kill(0)
        return False
