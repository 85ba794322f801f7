"""`moe-pipe down [--name NAME | --port P]`: stop a running service (in order,
releasing everything); the name is needed only when several run. Nothing
running is no error: one line, exit 0 (as `systemctl stop` of a stopped unit)."""

from __future__ import annotations

import argparse
import time

STOP_TIMEOUT_S = 120.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .status_cmd import add_selector_arguments

    p.add_argument("--timeout", type=float, default=STOP_TIMEOUT_S, help="seconds to wait for it to stop")
    add_selector_arguments(p, "the service to stop")


def run(args: argparse.Namespace) -> int:
    import psutil

    from ..shared.errors import PipelineError
    from ..shared.serve import service

    try:
        info = service.find_service(name=args.name, port=args.port)
    except service.NothingRunning as exc:  # already stopped: what down is for, as `systemctl stop`
        print(f"moe-pipe: nothing to stop: {exc}")
        return 0
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
    kept = service.kept_log_path(info.name)
    log = f"; its log: {kept}" if kept.is_file() else ""
    print(f"moe-pipe: stopped the service {info.name or '?'!r} (pid {info.pid}){log}")
    return 0
