"""A user's first hour with `moe-pipe up`, with real processes: a port another
process holds, a gateway that cannot start, two services side by side by
name, `status` of a degraded or absent service, and `chat` using the
service's own API key. Each service runs in a private runtime base
(XDG_RUNTIME_DIR) that a fixture empties whatever the test did."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.serve import service

CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")
FAST = ["--set", "supervisor.backoff_s=0.1", "--set", "supervisor.start_secs=0.5"]
QUICK_S = 30  # a refusal comes before anything starts; before the fix `up --detach` waited 600 s


class Base:
    """A private runtime base and the CLI run inside it."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(root)}

    def cli(self, *args: str, timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=self.env, timeout=timeout, input=stdin)

    def up(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.cli("up", CONFIG, "--detach", *FAST, *args, timeout=timeout)

    def services(self) -> list[service.ServiceInfo]:
        return service.live_services(self.root / "moe-pipe")

    def left(self) -> list[str]:
        """What a stopped service would have left: runtime folders, files, shm segments."""
        folder = self.root / "moe-pipe"
        return [str(p) for p in folder.rglob("*")] if folder.exists() else []


def _stop(pid: int) -> None:
    """SIGTERM (the supervisor stops its children in order), then SIGKILL."""
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    except psutil.TimeoutExpired:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


@pytest.fixture
def base():
    """A private runtime base; every service still running in it is stopped at
    the end, pass or fail, and nothing of theirs may be left."""
    from moe_pipe.shared.makemodel.default_model import default_model_path

    default_model_path()  # made once, before any service races to make it
    b = Base(Path(tempfile.mkdtemp(prefix="mpn", dir="/tmp")))  # short: unix socket paths <= 107 bytes
    pids: set[int] = set()
    try:
        yield b
    finally:
        for info in b.services():
            pids.add(info.pid)
            _stop(info.pid)
        shm = [p.name for p in Path("/dev/shm").glob("moe-pipe-*") if any(f"-{pid}-" in p.name for pid in pids)]
        left = b.left()
        shutil.rmtree(b.root, ignore_errors=True)
        assert not shm and not left, f"left behind: {shm + left}"


@pytest.fixture
def holder():
    """Another process listening on a TCP port of 127.0.0.1: (pid, port)."""
    code = "import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\nprint(s.getsockname()[1], flush=True)\ntime.sleep(300)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        yield proc.pid, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def status_keys_documented() -> tuple[set[str], str]:
    """The keys docs/cli.md's `status --json` table names (first column), and its `processes` row."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    section = text[text.index("## status") : text.index("## bench")]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    keys = {k for first, _ in rows for k in re.findall(r"`(\w+)`", first)}
    return keys, next(meaning for first, meaning in rows if first.strip() == "`processes`")


def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.stderr.count("\n") == 1, r.stderr
    return r.stderr.strip()


# -- names, without a process ----------------------------------------------------------


def test_default_names_come_from_the_config_or_the_model_and_are_sanitized():
    assert service.default_name("/x/configs/tiny.toml", "tiny qwen3moe") == "tiny"
    assert service.default_name("", "Qwen3 30B-A3B (Q4_K_M)") == "qwen3-30b-a3b-q4_k_m"
    assert service.default_name("", "  ***  ") == "moe-pipe"
    assert len(service.default_name("", "x" * 100)) == service.NAME_MAX
    assert service.check_name("big.2") == "big.2"
    for bad in ("a b", "-x", "", "x" * 40, "é"):
        with pytest.raises(UserError, match="--name"):
            service.check_name(bad)


# -- a port in use, a gateway that cannot start ------------------------------------------


@pytest.mark.integration
def test_up_on_a_port_another_process_holds_fails_at_once_naming_it(base, holder):
    pid, port = holder
    for detach in (True, False):  # --detach, and the foreground
        args = ["up", CONFIG, "--port", str(port), *FAST] + (["--detach"] if detach else [])
        r = base.cli(*args, timeout=QUICK_S)
        line = one_line(r)
        assert r.returncode == 2 and f"port {port}" in line and f"pid {pid}" in line, line
        assert "--port" in line and "Traceback" not in r.stderr
        assert not base.services() and not base.left()


@pytest.mark.integration
def test_a_gateway_that_cannot_start_ends_up_detach_with_its_error(base):
    # Only the gateway imports uvloop: a sitecustomize that hides it fails the gateway alone, at every start.
    site = base.root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['uvloop'] = None  # the gateway's import fails\n")
    base.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), base.env.get("PYTHONPATH")]))
    r = base.up("--port", "0", "--set", "supervisor.start_retries=1", timeout=QUICK_S)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "the HTTP API did not start" in last and "uvloop" in last, r.stderr
    assert "Traceback" not in r.stderr  # the child's traceback is in its log, not on the terminal
    shutil.rmtree(site)
    assert not base.services() and not base.left()


# -- two services by name ----------------------------------------------------------------


@pytest.mark.integration
def test_two_services_by_name_status_lists_both_and_down_picks_one(base):
    assert base.up("--port", "0", "--name", "one").returncode == 0
    r = base.up("--port", "0", "--name", "one", timeout=QUICK_S)
    assert r.returncode == 2 and "named 'one' is already running" in one_line(r)
    r = base.up("--port", "0", "--name", "two")
    assert r.returncode == 0 and "down --name two" in r.stdout, r.stderr
    one, two = sorted(base.services(), key=lambda s: s.name)
    assert (one.name, two.name) == ("one", "two")

    st = base.cli("status", "--json")
    assert st.returncode == 0, st.stderr
    listed = json.loads(st.stdout)["services"]
    assert [(s["name"], s["pid"], s["health"]) for s in listed] == [("one", one.pid, "ok"), ("two", two.pid, "ok")]
    plain = base.cli("status")
    assert plain.returncode == 0 and "'one'" in plain.stdout and "'two'" in plain.stdout
    documented, process_row = status_keys_documented()
    assert set(listed[0]) - {"ok", "code", "message"} == documented  # docs/cli.md § status lists what it prints
    assert all(f"`{k}`" in process_row for k in listed[0]["processes"][0])
    port_two = service.service_port(two)
    assert json.loads(base.cli("status", "--json", "--port", str(port_two)).stdout)["name"] == "two"

    for cmd in (["down"], ["tail", "--wait", "1"], ["chat"]):  # several and no name: which exist, one line
        r = base.cli(*cmd, timeout=QUICK_S, stdin="")
        line = one_line(r)
        assert r.returncode == 2 and "one (pid" in line and "two (pid" in line and "--name" in line, (cmd, line)
    r = base.cli("down", "--name", "nope")  # already stopped: no error, the ones running named
    assert r.returncode == 0 and r.stdout.startswith("moe-pipe: nothing to stop: no moe-pipe service named 'nope'"), r.stdout

    tail = subprocess.Popen(
        [*CLI, "tail", "--csv", "--name", "two"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=base.env
    )
    try:
        r = base.cli("down", "--name", "one")
        assert r.returncode == 0 and "'one'" in r.stdout, r.stderr
        assert [s.name for s in base.services()] == ["two"]
        r = base.cli("down")  # the only one left: no name needed
        assert r.returncode == 0 and "'two'" in r.stdout, r.stderr
        assert tail.wait(30) == 0 and "service stopped" in tail.stderr.read()  # it watched two, not one
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()

    r = base.cli("status", "--json")
    assert r.returncode == 3 and json.loads(r.stdout) == {"services": []} and r.stderr == ""


# -- degraded; the API key -------------------------------------------------------------------


@pytest.mark.integration
def test_status_of_a_service_with_a_fatal_process_is_degraded_and_non_zero(base, short_tmp, tiny_model):
    model = short_tmp / "m.gguf"
    shutil.copy(tiny_model, model)
    assert base.up("--port", "0", "--set", "supervisor.start_retries=0", "--set", f"model.path={model}").returncode == 0
    (info,) = base.services()
    st = json.loads(base.cli("status", "--json").stdout)
    assert st["health"] == "ok" and st["name"] == "tiny"
    model.rename(short_tmp / "gone.gguf")  # the reader's next start fails at open
    os.kill(next(p["pid"] for p in st["processes"] if p["name"] == "reader"), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        r = base.cli("status", "--json")
        st = json.loads(r.stdout)
        if st["health"] != "ok" or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.returncode == 1 and st["health"] == "degraded", st
    plain = base.cli("status")
    assert plain.returncode == 1 and "DEGRADED: reader" in plain.stdout and "m.gguf" in plain.stdout


@pytest.mark.integration
def test_chat_uses_the_services_own_api_key_and_never_shows_it(base):
    key = "sk-planted-7f3a9c"
    assert base.up("--port", "0", "--set", f"gateway.api_key={key}").returncode == 0
    (info,) = base.services()
    key_file = Path(info.runtime_dir) / service.API_KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and key_file.stat().st_uid == os.getuid()
    r = base.cli("chat", "-n", "4", stdin="hi\n", timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr  # without the key: 401, exit 2
    assert key not in r.stdout + r.stderr
    r = base.cli("chat", "-n", "4", "--api-key", "wrong", stdin="hi\n", timeout=120)
    assert r.returncode != 0 and key not in r.stdout + r.stderr  # a key typed wins over the service's


def test_a_stopped_services_log_is_kept_and_the_one_before_it_too(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for text in ("first run\n", "second run\n"):
        rt = tmp_path / "rt"
        rt.mkdir()
        (rt / service.LOG_FILE).write_text(text)
        kept = service.keep_log(rt, "tiny")
        assert kept == tmp_path / "state" / "moe-pipe" / "logs" / "tiny.log" and not (rt / service.LOG_FILE).exists()
        rt.rmdir()
    assert kept.read_text() == "second run\n" and kept.with_name("tiny.log.1").read_text() == "first run\n"
    assert oct(kept.stat().st_mode & 0o777) == "0o600"
    assert service.keep_log(tmp_path, "tiny") is None  # no log: nothing to keep
