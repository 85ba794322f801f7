"""The soak: `moe-pipe up` on the tiny model answers a bounded stream of
requests while a random child is killed with SIGKILL every few seconds
(bench/soak.py does the work and prints the figures; the assertions are
here). Afterwards every request has an answer or a clear error, every
completed greedy answer is the reference's text, the service answers again,
and nothing is left: shared memory, processes, the runtime folder, the
listener, and no fds or threads piled up in the supervisor.

The soaks are behind -m slow (the short one too: it must first pass 10 runs
out of 10 beside another moe-pipe on a busy machine before it joins the
default tier), the one with four slots too; the gateway test runs in the
default tier."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SOAK = [sys.executable, str(ROOT / "bench" / "soak.py")]


def soak_module():
    """bench/soak.py as a module (bench/ is no package)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import soak
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return soak


def run_soak(*args: str, timeout: float) -> dict:
    r = subprocess.run([*SOAK, *args, "--json", "-"], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def check(rep: dict) -> None:
    summary = {k: rep[k] for k in ("requests", "ok", "mismatch", "errors", "kills", "restarts", "leaks")}
    assert rep["requests"] == rep["ok"] + rep["mismatch"] + sum(rep["errors"].values()), summary
    # Every completed greedy answer is the reference's text; none hung.
    assert rep["mismatch"] == 0, rep["error_examples"].get("mismatch")
    assert rep["reference_checked"] >= 1 and rep["reference_mismatch"] == [], rep["reference_mismatch"]
    assert "timeout" not in rep["errors"], rep["error_examples"].get("timeout")
    # Every failure is one a client can act on, and says what happened.
    unclear = {k: rep["error_examples"].get(k) for k in rep["errors"] if not k.startswith(soak_module().CLEAR_ERRORS)}
    assert not unclear, unclear
    assert rep["lost"] == 0 and rep["wrong"] == 0 and rep["leaked"] == 0, summary  # the soak's own last line
    assert all(rep["error_examples"].get(k) for k in rep["errors"])
    # It was a soak: children died and came back, and requests got through meanwhile.
    killed = sum(n for k, n in rep["kills"].items() if not k.startswith("skipped"))
    assert killed >= 2 and sum(rep["restarts"].values()) >= killed, summary
    assert rep["ok"] > 0 and rep["recovered"], rep["recovery_errors"]
    assert set(rep["final_states"].values()) == {"RUNNING"}, rep["final_states"]
    # Nothing left behind, nothing piled up.
    leaks = rep["leaks"]
    assert leaks["shm"] == [] and leaks["processes"] == [] and leaks["runtime"] == [] and not leaks["listener"], leaks
    assert leaks["client_fds"] == 0 and leaks["supervisor_threads"] <= 0, leaks
    assert leaks["supervisor_fds"] <= 2, leaks  # a restart in progress may hold a pipe; restarts must not add up


@pytest.mark.slow
def test_short_soak_with_kills_loses_nothing_and_leaks_nothing():
    check(run_soak("--seconds", "12", "--kill-every", "2", "--check-prompts", "1", timeout=600))


@pytest.mark.slow
def test_soak_of_four_clients_on_four_slots_with_kills_loses_nothing_and_leaks_nothing():
    """Every client's request decoded beside the others' (gateway.parallel 4): each greedy
    answer still the reference's text, through compute kills with four streams in flight."""
    rep = run_soak("--seconds", "30", "--kill-every", "3", "--clients", "4", "--parallel", "4", "--check-prompts", "1", timeout=900)
    assert rep["parallel"] == 4 and rep["clients"] == 4
    check(rep)


@pytest.mark.slow
def test_three_minute_soak_with_kills_loses_nothing_and_leaks_nothing():
    check(run_soak("--seconds", "180", "--kill-every", "3", timeout=1800))


def test_a_gateway_killed_alone_gets_a_compute_again(tmp_path):
    """A restarted gateway must learn that compute is up: it missed compute's
    Hello, and used to hold every request as if the model were still loading."""
    soak = soak_module()
    svc = soak.Service(cache_mb=1.2)
    try:
        assert svc.wait_health(soak.HEALTH_WAIT_S) is None
        assert soak.ask(svc.url, "hi", 4, stream=False)[0] == "ok"
        gateway = next(p for p in svc.status()["processes"] if p["name"] == "gateway")
        os.kill(gateway["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            p = next(p for p in svc.status()["processes"] if p["name"] == "gateway")
            if p["state"] == "RUNNING" and p["pid"] != gateway["pid"]:
                break
            time.sleep(0.2)
        # Until the new gateway listens (a 503 "loading" counts): then it must answer, not wait for a Hello.
        why = svc.wait_health(30, ready=False)
        assert why is None, f"the restarted gateway never listened: {why}"
        old = soak.REQUEST_TIMEOUT_S
        soak.REQUEST_TIMEOUT_S = 30.0
        try:
            kind, text = soak.ask(svc.url, "hi", 4, stream=False)
        finally:
            soak.REQUEST_TIMEOUT_S = old
        assert kind == "ok", (kind, text)
    finally:
        svc.down()
        shutil.rmtree(svc.base, ignore_errors=True)
