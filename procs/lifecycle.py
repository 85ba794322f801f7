"""What every child process does first, and how the parent watches children."""
from __future__ import annotations

import ctypes
import logging
import signal
import sys

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
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format=f"moe-pipe {role}: %(message)s")


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
