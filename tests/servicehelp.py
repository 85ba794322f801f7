"""What the tests of a running `moe-pipe up` share: reading a child's row of
`status --json` and waiting for its state (test_service.py, test_faults.py)."""

from __future__ import annotations

import time


class StatusPolling:
    """Mixed into a test's Service, which provides `status() -> dict` (`status --json`)."""

    wait_timeout_s = 60.0

    def status(self) -> dict:
        raise NotImplementedError

    def proc(self, name: str) -> dict:
        return next(p for p in self.status()["processes"] if p["name"] == name)

    def wait_state(self, name: str, states: set[str], timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (self.wait_timeout_s if timeout is None else timeout)
        while time.monotonic() < deadline:
            p = self.proc(name)
            if p["state"] in states:
                return p
            time.sleep(0.2)
        raise AssertionError(f"{name} never reached {states}: {self.proc(name)}")


def terminate(pid: int | None, timeout_s: float = 60.0) -> None:
    """Stop a service's supervisor that a test started, if it still runs: SIGTERM (it
    releases its memory and segments), SIGKILL after `timeout_s`."""
    import psutil

    if pid is None or not psutil.pid_exists(pid):
        return
    proc = psutil.Process(pid)
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except psutil.TimeoutExpired:
        proc.kill()
