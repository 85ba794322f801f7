"""`moe-pipe up` end to end on the tiny model: the real supervisor, reader,
compute, telemetry and gateway processes, the official openai client, kill -9
of each child and of the supervisor, and nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install '.[test]'")

from moe_pipe.shared.makemodel.default_model import default_model_path  # noqa: E402

from .servicehelp import StatusPolling  # noqa: E402

pytestmark = pytest.mark.integration  # every test starts processes
CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")
MODEL = "moe-pipe-tiny"  # the name configs/tiny.toml gives
FAST = ["--port", "0", "--set", "supervisor.backoff_s=0.2", "--set", "supervisor.start_secs=0.5"]
LONG = 1500  # tokens: a stream long enough to kill something in the middle of it


class Service(StatusPolling):
    """One `up --detach` in a private runtime base (XDG_RUNTIME_DIR)."""

    def __init__(self, *extra: str, model: str = CONFIG):
        self.base = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))  # short: unix socket paths <= 107 bytes
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(self.base), "XDG_STATE_HOME": str(self.base / "state")}
        r = self.cli("up", model, "--detach", *FAST, *extra, timeout=300)
        assert r.returncode == 0, r.stderr
        self.status()  # fills pid, url

    def cli(self, *args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
        r = subprocess.run([*CLI, *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        assert not check or r.returncode == 0, r.stderr
        return r

    def status(self) -> dict:
        r = self.cli("status", "--json")
        assert r.returncode in (0, 1) and r.stdout, r.stderr  # 1: degraded (a process FATAL), still its status
        st = json.loads(r.stdout)
        self.pid, self.url = st["pid"], st["url"]
        return st

    def client(self, **kw):
        # a generous timeout: the 1500-token replies share the two cores with the other test worker
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=600, **kw)

    def close(self) -> None:
        if psutil.pid_exists(getattr(self, "pid", -1)):
            self.cli("down", timeout=120)
        shutil.rmtree(self.base, ignore_errors=True)


def leftovers(pids: set[int]) -> list[str]:
    """Shared-memory segments (their names carry the owner's pid) and live processes of these supervisors."""
    shm = [p.name for p in Path("/dev/shm").glob("moe-pipe-*") if any(f"-{pid}-" in p.name for pid in pids)]
    procs = [f"{p.pid} {p.name()}" for p in psutil.process_iter(["name"]) if p.info["name"].startswith("moe-") and _ppid_in(p, pids)]
    return shm + procs


def _ppid_in(p: psutil.Process, pids: set[int]) -> bool:
    try:
        return p.ppid() in pids
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    assert not psutil.pid_exists(pid), f"pid {pid} did not exit"


@pytest.fixture(scope="module")
def svc():
    default_model_path()  # made once, before any service races to make it
    s = Service()
    yield s
    pid = s.pid
    s.close()
    _wait_gone(pid)
    assert not leftovers({pid})


def chat(client, content: str, max_tokens: int, stream: bool = False, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0, stream=stream, **kw
    )


def reference(prompt: str, n: int, chat_mode: bool = True) -> str:
    r = subprocess.run(
        [*CLI, "run", CONFIG, "-p", prompt, "-n", str(n), "--output-format", "json", *(["--chat"] if chat_mode else [])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["text"]


# -- the API against `run` -------------------------------------------------------


def test_openai_client_streaming_and_not_equals_run(svc):
    client = svc.client()
    want = reference("Once upon a time", 24)
    whole = chat(client, "Once upon a time", 24)
    assert whole.choices[0].message.content == want
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, "Once upon a time", 24, stream=True) if c.choices)
    assert streamed == want
    text = client.completions.create(model=MODEL, prompt="The old mill", max_tokens=12, temperature=0).choices[0].text
    assert text == reference("The old mill", 12, chat_mode=False)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_status_reports_every_process(svc):
    st = svc.status()
    assert [p["name"] for p in st["processes"]] == ["telemetry", "reader", "compute", "gateway"]
    for p in st["processes"]:
        assert p["state"] == "RUNNING" and psutil.pid_exists(p["pid"]) and p["restarts"] >= 0
    assert st["ok"] is True and st["code"] == "ok" and st["budget_bytes"] > 0
    text = svc.cli("status", check=True).stdout
    assert "compute" in text and "RUNNING" in text and svc.url in text


def test_wrong_key_and_malformed_body_are_4xx_and_the_service_survives(svc):
    import urllib.error
    import urllib.request

    def post(body: bytes, headers: dict) -> int:
        req = urllib.request.Request(svc.url + "/v1/chat/completions", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert post(b"{not json", {"Content-Type": "application/json"}) == 400
    assert post(json.dumps({"model": MODEL, "messages": "hi"}).encode(), {"Content-Type": "application/json"}) == 400
    assert chat(svc.client(), "hello", 4).choices[0].finish_reason in ("length", "stop")


def test_api_key_is_required_when_set():
    """--api-key: required by the gateway, and written nowhere but the 0600 file `chat` reads:
    not in a process's command line (the detached service gets it in its environment),
    the log, status or another runtime file."""
    s = Service("--api-key", "sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            chat(s.client(api_key="wrong"), "hi", 4)
        assert chat(s.client(api_key="sekret"), "hi", 4).choices[0].message.content is not None
        sup = psutil.Process(s.pid)
        assert not [p.pid for p in [sup, *sup.children(recursive=True)] if "sekret" in " ".join(p.cmdline())]
        status = s.status()
        assert "sekret" not in json.dumps(status)
        runtime = Path(status["runtime_dir"])
        holders = [p.name for p in runtime.rglob("*") if p.is_file() and not p.is_socket() and b"sekret" in p.read_bytes()]
        assert holders == ["api-key"]
        # down keeps the service's log (the runtime folder goes): it says where, and the key is not in it
        down = s.cli("down", timeout=120, check=True)
        kept = s.base / "state" / "moe-pipe" / "logs" / f"{status['name']}.log"
        assert down.stdout.strip().endswith(f"its log: {kept}") and not runtime.exists()
        assert "gateway" in kept.read_text() and "sekret" not in kept.read_text()
    finally:
        pid = s.pid
        s.close()
        _wait_gone(pid)
        assert not leftovers({pid})


def test_200_bounded_concurrent_requests_are_all_answered(svc):
    client = svc.client()
    answered, errors = [], []

    def worker(k: int) -> None:
        for i in range(20):
            try:
                r = chat(client, f"request {k} {i}", 3, stream=bool(i % 2))
                answered.append(r if not i % 2 else "".join(c.choices[0].delta.content or "" for c in r if c.choices))
            except openai.RateLimitError:
                errors.append("429")  # a full queue is an answer too, but the queue holds 16 here
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(answered) + len(errors) == 200
    assert not [e for e in errors if e != "429"], errors[:3]
    assert len(answered) == 200  # 10 clients never overflow a 16-deep queue


# -- restarts ---------------------------------------------------------------------


# All three behind -m slow: alone it takes ~12 s (55 s from an empty numba cache), but beside
# the other worker's family pipelines it took 213-460 s of the default tier (2026-12-03).
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["compute", "reader", "telemetry"])
def test_kill9_mid_stream_restarts_and_the_request_completes(svc, victim):
    client = svc.client()
    chat(client, "Tell a story", LONG)  # every expert it uses is cached now (the tiny cache holds them all)
    want = chat(client, "Tell a story", LONG).choices[0].message.content
    warm_hit = svc.settled_hit_pct()
    before = svc.proc(victim)
    parts = []
    for i, chunk in enumerate(chat(client, "Tell a story", LONG, stream=True)):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if i == 20:
            os.kill(before["pid"], signal.SIGKILL)
    assert "".join(parts) == want  # retried on the restarted worker where needed: greedy, identical
    after = svc.wait_state(victim, {"RUNNING"})
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1
    assert "SIGKILL" in after["last_error"] or victim != "compute"
    svc.wait_state("compute", {"RUNNING"})
    # The cache survived: the same request again reads nothing new, as before the kill.
    chat(client, "Tell a story", 16)
    assert svc.settled_hit_pct() == pytest.approx(warm_hit, abs=0.01) and warm_hit == 100.0


def test_a_child_that_keeps_dying_ends_fatal_with_its_error():
    default_model_path()
    tmp = Path(tempfile.mkdtemp(prefix="mpm", dir="/tmp"))
    model = tmp / "m.gguf"
    shutil.copy(default_model_path(), model)
    s = Service("--set", "supervisor.start_retries=2", model=str(model))
    try:
        model.rename(tmp / "gone.gguf")  # every restart of the reader now fails at open
        os.kill(s.proc("reader")["pid"], signal.SIGKILL)
        p = s.wait_state("reader", {"FATAL"})
        assert "m.gguf" in p["last_error"] and p["restarts"] == 2  # the kill counts: 2 more tries, then FATAL
        r = s.cli("status")
        assert r.returncode == 1 and "FATAL" in r.stdout and "DEGRADED: reader" in r.stdout  # degraded: exit 1
    finally:
        pid = s.pid
        s.close()
        shutil.rmtree(tmp, ignore_errors=True)
        _wait_gone(pid)
        assert not leftovers({pid})


def test_kill9_of_the_supervisor_is_reclaimed_by_the_next_up():
    """...and the hot set its reader saved while it served (every 0.2 s here) warms the
    next up, which saves its own at `down` (saves only at down: warm_save_s = 0)."""
    s = Service("--set", "cache.warm_save_s=0.2")
    old = s.pid
    children = [p["pid"] for p in s.status()["processes"]]
    assert any(f"-{old}-" in p.name for p in Path("/dev/shm").glob("moe-pipe-*"))  # the segments it owns
    assert chat(s.client(), "hi", 4).choices
    time.sleep(0.6)  # the reader's last save follows the request's last message by 0.2 s at most
    saved = hot_set(s)
    os.kill(old, signal.SIGKILL)
    _wait_gone(old)
    for pid in children:  # they die with their parent (PR_SET_PDEATHSIG)
        _wait_gone(pid)
    assert hot_set(s) == saved and [p.name for p in hot_sets(s)[0].parent.iterdir()] == [hot_sets(s)[0].name]
    # Left for the next up; which one reclaims them is a race with the other
    # test worker's services (any up reclaims every dead owner's segments).
    r = s.cli("up", CONFIG, "--detach", *FAST, "--set", "cache.warm_save_s=0", timeout=300)
    assert r.returncode == 0, r.stderr
    try:
        s.status()  # the new supervisor's pid and url
        assert not leftovers({old}) and not (s.base / "moe-pipe" / str(old)).exists()
        assert wait_warmed(s) == {"state": "done", "done": len(saved), "total": len(saved)}  # before any request
        assert s.status()["hot_set"] == str(hot_sets(s)[0])
        assert chat(s.client(), "hi", 4).choices
        assert s.settled_hit_pct() == 100.0  # what it routes to was read back
        chat(s.client(), "Once upon a time, in a faraway land", 24)  # new experts, not saved before `down`
        assert hot_set(s) == saved
    finally:
        pid = s.pid
        s.cli("down", timeout=120)
        _wait_gone(pid)
        after = hot_set(s) if hot_sets(s) else []
        s.close()
        assert not leftovers({pid, old})
    assert len(after) > len(saved)  # `down` saved what the cache held then


def hot_sets(s: Service) -> list[Path]:
    return sorted((s.base / "state" / "moe-pipe" / "hot").glob("*.json"))


def hot_set(s: Service) -> list[list[int]]:
    """The experts of the service's one hot-set file, hottest first."""
    files = hot_sets(s)
    assert len(files) == 1, files
    return json.loads(files[0].read_text())["experts"]


def wait_warmed(s: Service, timeout: float = 30) -> dict:
    """The warm start's figures once it ended (status `warming`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = s.status()["warming"]
        if w is not None and w["state"] != "warming":
            return {k: w[k] for k in ("state", "done", "total")}
        time.sleep(0.1)
    raise AssertionError(f"the warm start did not end: {s.status()['warming']}")


@pytest.mark.slow  # two more service starts (~20 s); the kill -9 test above covers the same path
def test_down_saves_the_hot_set_and_the_next_up_reads_it_before_any_request():
    s = Service()
    try:
        client = s.client()
        chat(client, "Once upon a time", 8)
        assert hot_sets(s) == []  # saved every 30 s by default: not yet
        pid = s.pid
        assert s.cli("down").returncode == 0
        _wait_gone(pid)
        saved = hot_set(s)
        assert saved and len(saved) == len({tuple(k) for k in saved})
        assert s.cli("up", CONFIG, "--detach", *FAST, timeout=300).returncode == 0
        st = s.status()
        assert st["hot_set"] == str(hot_sets(s)[0])
        assert wait_warmed(s) == {"state": "done", "done": len(saved), "total": len(saved)}  # no request yet
        chat(s.client(), "Once upon a time", 8)
        assert s.settled_hit_pct() == 100.0  # every expert it routes to was read back
        assert "warm start: " in (s.base / "moe-pipe" / str(s.pid) / "moe-pipe.log").read_text()
    finally:
        pid = s.pid
        s.close()
        _wait_gone(pid)
        assert not leftovers({pid})


def test_ctrl_c_of_a_foreground_up_leaves_nothing():
    base = Path(tempfile.mkdtemp(prefix="mpc", dir="/tmp"))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base)}
    p = subprocess.Popen([*CLI, "up", CONFIG, *FAST], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert "serving" in line, line
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 130
        assert not leftovers({p.pid}) and not list((base / "moe-pipe").glob("*"))
    finally:
        if p.poll() is None:
            p.kill()
        shutil.rmtree(base, ignore_errors=True)


def test_down_status_without_a_service_is_one_plain_line(tmp_path):
    """Not an error: down exits 0 (already stopped), status 3 (LSB's "not running"), one line, no "error:"."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    for cmd, code in (("down", 0), ("status", 3), ("down --name x", 0), ("status --port 1", 3)):
        r = subprocess.run([*CLI, *cmd.split()], capture_output=True, text=True, env=env, timeout=60)
        assert (r.returncode, r.stderr) == (code, "") and r.stdout.count("\n") == 1, (cmd, r.stdout, r.stderr)
        assert "no moe-pipe service" in r.stdout and "is running" in r.stdout and "error" not in r.stdout
    r = subprocess.run([*CLI, "status", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert (r.returncode, json.loads(r.stdout)) == (3, {"services": []})


# -- tails ------------------------------------------------------------------------


def test_three_tails_attached_mid_run_see_live_records(svc):
    tails = [
        subprocess.Popen([*CLI, "tail", "--csv"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=svc.env)
        for _ in range(3)
    ]
    try:
        time.sleep(2)  # let them subscribe (PUB/SUB only delivers what comes after)
        chat(svc.client(), "Tell a story", 64)
        for t in tails:
            header = t.stdout.readline().strip().split(",")
            assert header[:3] == ["step", "wall_ms", "compute_ms"]
            rows = [t.stdout.readline().strip().split(",") for _ in range(10)]
            assert all(len(r) == len(header) for r in rows) and int(rows[-1][0]) >= 10
    finally:
        for t in tails:
            t.send_signal(signal.SIGINT)
        for t in tails:
            assert t.wait(30) == 0
    assert svc.proc("telemetry")["state"] == "RUNNING"
