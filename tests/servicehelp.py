"""What the tests of a running `moe-pipe up` share: reading a child's row of
`status --json`, waiting for its state and for the hit rate to settle (test_service.py,
test_faults.py)."""

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

    def settled_hit_pct(self, timeout: float = 10) -> float:
        """The service's hit rate once compute's token records have all reached the supervisor:
        they follow the reply on their own socket, so a status read right after it may not have
        them yet (a fresh service then says None). Settled: the same token count and rate twice,
        0.2 s apart."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            st = self.status()
            now = (st["tokens"], st["hit_pct"])
            if st["hit_pct"] is not None and now == last:
                return st["hit_pct"]
            last = now
            time.sleep(0.2)
        raise AssertionError(f"the hit rate did not settle in {timeout} s (last: tokens, hit % = {last})")


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
