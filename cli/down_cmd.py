"""`moe-pipe down`: stop the running service (in order, releasing everything)."""

from __future__ import annotations

import argparse
import time

STOP_TIMEOUT_S = 120.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=STOP_TIMEOUT_S, help="seconds to wait for it to stop")


def run(args: argparse.Namespace) -> int:
    import psutil

    from moe_pipe.shared.errors import PipelineError
    from moe_pipe.shared.serve import service

    info = service.find_service()
    reply = service.control(info, "stop")
    if not reply.ok:
        raise PipelineError(f"the service refused to stop ({reply.code}): {reply.message}")
    deadline = time.monotonic() + args.timeout
    while psutil.pid_exists(info.pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(info.pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        if psutil.pid_exists(info.pid):
            raise PipelineError(f"the service (pid {info.pid}) did not stop within {args.timeout:.0f} s")
    print(f"moe-pipe: stopped the service (pid {info.pid})")
    return 0
