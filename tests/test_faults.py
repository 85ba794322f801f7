"""Disk faults: a read error, a model file that shrinks, vanishes or is
replaced while it is used, O_DIRECT refused. Each ends in a clear failure of
the request (or the fallback), never in a half-written slab anyone can see,
and the service recovers once the file is back.

Three levels: the reader driven in this process (deterministic: a fault hook
holds or fails one read while the test looks at the slab table and the
residency index), `moe-pipe run` in a subprocess, and `moe-pipe up` with a
real client. The last two levels start processes: their tests are marked
`integration`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from moe_pipe.procs import supervisor as sup
from moe_pipe.procs.reader import FAULT_CHECK_S, read_io_status
from moe_pipe.shared.config import load_config
from moe_pipe.shared.experts import directio
from moe_pipe.shared.makemodel.default_model import default_model_path
from moe_pipe.shared.wire import messages as m

from .readerhelp import Harness, hold_reads_of
from .servicehelp import StatusPolling

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
CONFIG = str(ROOT / "configs" / "tiny.toml")
MODEL_NAME = "moe-pipe-tiny"
SMALL_CACHE = ["--cache-mb", "1.2"]  # 8 slabs for the tiny model's 32 experts: a request keeps reading
FAST = ["--port", "0", "--set", "supervisor.backoff_s=0.2", "--set", "supervisor.start_secs=0.5"]


def put_back(model: Path, how: str) -> None:
    """The original file back at its path: a copy renamed over it (a new inode),
    or its bytes written into the same inode."""
    src = default_model_path()
    if how == "rename":
        tmp = model.with_suffix(".incoming")
        shutil.copy(src, tmp)
        tmp.rename(model)
    else:
        with open(src, "rb") as fin, open(model, "r+b") as fout:
            shutil.copyfileobj(fin, fout)


def other_weights(path: Path) -> bytes:
    """The file with its header kept and one byte of every later page changed:
    the same shapes with other weights (a re-quantized or fine-tuned copy)."""
    data = bytearray(path.read_bytes())
    data[directio.IDENTITY_HEAD_BYTES :: 4096] = bytes(b ^ 0xFF for b in data[directio.IDENTITY_HEAD_BYTES :: 4096])
    return bytes(data)


def test_a_slab_is_visible_only_once_its_read_completed(harness):
    h, key = harness, (1, 3)
    entered, release = hold_reads_of(h, key, fail=False)
    req = h.fetch(*key[:1], [key[1]])
    assert entered.wait(10)
    # Mid-read: the slab is taken (pinned, in flight) but compute cannot find it.
    assert key in h.reader.table and key in h.reader.inflight and h.reader.table.pins(key) == 2  # the read's + the waiter's
    assert not h.visible(key)
    guessed = h.fetch(key[0], [], guesses=[key[1]], guess_layer=key[0])  # a guess of it starts no second read
    assert list(h.reader.inflight) == [key] and h.answer() == m.Guessed(guessed)
    release.set()
    h.land()
    ready = h.answer()
    assert isinstance(ready, m.Ready) and (ready.req_id, ready.layer, ready.expert, ready.hit) == (req, *key, False)
    assert h.visible(key) and h.reader.index.slabs(key[0], [key[1]]) == [ready.slab]
    h.assert_holds(key, ready.slab)
    h.reader.on_release(m.Release((req,)))
    assert h.reader.table.pins(key) == 0


def test_a_failed_read_fails_its_waiters_and_leaves_the_slab_free(harness):
    h, key, other = harness, (2, 5), (2, 6)
    free_before = h.reader.n_slabs - len(h.reader.table)
    entered, release = hold_reads_of(h, key, fail=True)
    first = h.fetch(key[0], [key[1], other[1]])  # two misses: one fails, one lands
    assert entered.wait(10)
    second = h.fetch(key[0], [key[1]])  # a second request waits on the same read
    release.set()
    h.land()
    h.land()
    answers = {(a.req_id, a.expert): a for a in (h.answer(), h.answer(), h.answer())}
    assert set(answers) == {(first, key[1]), (first, other[1]), (second, key[1])}
    for req in (first, second):
        failed = answers[(req, key[1])]
        assert isinstance(failed, m.FetchFailed) and failed.code == m.Code.IO_ERROR and "Input/output error" in failed.error
    assert isinstance(answers[(first, other[1])], m.Ready)
    # The failed key is gone: no table entry, no pin, no index entry; its slab is free again.
    assert key not in h.reader.table and h.reader.table.pins(key) == 0 and not h.visible(key)
    assert h.reader.n_slabs - len(h.reader.table) == free_before - 1  # only `other` holds a slab
    assert all(key not in keys for keys in h.reader.pinned.values())
    # Releases of both requests are harmless, and `other` (still cached) is unpinned by its own.
    h.reader.on_release(m.Release((first,)))
    h.reader.on_release(m.Release((second,)))
    assert h.reader.table.pins(other) == 0 and h.visible(other)
    # The reader recorded the fault for `status`; the file is whole, so its next look clears it.
    io = read_io_status(h.res.rt.path)
    assert io["io_errors"] == 1 and "Input/output error" in io["last_io_error"] and io["fault"] == io["last_io_error"]
    directio.set_fault_hook(None)
    h.reader.check_fault()
    assert read_io_status(h.res.rt.path)["fault"] is None and read_io_status(h.res.rt.path)["io_errors"] == 1
    again = h.fetch(key[0], [key[1]])
    h.land()
    ready = h.answer()
    assert isinstance(ready, m.Ready) and ready.req_id == again
    h.assert_holds(key, ready.slab)


def miss(h: Harness, key):
    """Fetch `key` (a miss), land its read, return the answer; releases its pins."""
    req = h.fetch(key[0], [key[1]])
    h.land()
    out = h.answer()
    h.reader.on_release(m.Release((req,)))
    return out


def test_a_truncated_file_fails_reads_until_the_same_file_is_back(harness, model):
    h = harness
    os.truncate(model, model.stat().st_size // 2)
    late = (h.mf.spec.n_layer - 1, 7)  # its bytes lie in the cut-off half
    failed = miss(h, late)
    assert isinstance(failed, m.FetchFailed) and failed.code == m.Code.IO_ERROR
    assert str(model) in failed.error and "ends at byte" in failed.error
    assert late not in h.reader.table and not h.visible(late)
    h.reader.check_fault()
    assert "truncated or replaced" in h.reader.io.fault  # still wrong: the fault stays
    # A different file of the same size at the path is never read from.
    impostor = model.with_suffix(".other")
    impostor.write_bytes(other_weights(default_model_path()))
    impostor.rename(model)
    h.reader.check_fault()
    assert "different file" in h.reader.io.fault
    assert isinstance(miss(h, late), m.FetchFailed)
    # The original back (a new inode): the reader reopens it, the fault clears, reads give its bytes.
    put_back(model, "rename")
    h.reader.check_fault()
    assert h.reader.io.fault is None, h.reader.io.fault
    ready = miss(h, late)
    assert isinstance(ready, m.Ready)
    h.assert_holds(late, ready.slab)
    assert read_io_status(h.res.rt.path)["io_errors"] == 2


def test_a_file_cut_and_rewritten_in_place_recovers(harness, model):
    h = harness
    os.truncate(model, 1 << 20)
    late = (h.mf.spec.n_layer - 1, 6)
    assert isinstance(miss(h, late), m.FetchFailed)
    put_back(model, "in-place")  # the same inode the reader holds: its fd reads the bytes again
    h.reader.check_fault()
    assert h.reader.io.fault is None
    ready = miss(h, late)
    assert isinstance(ready, m.Ready)
    h.assert_holds(late, ready.slab)


def test_a_file_unlinked_while_open_is_still_read(harness, model):
    """Unlink (or rename) keeps the inode the reader holds: nothing fails until a restart."""
    h = harness
    model.unlink()
    ready = miss(h, (0, 4))
    assert isinstance(ready, m.Ready)
    h.assert_holds((0, 4), ready.slab)
    assert "gone" in h.reader.files.recover()


# ---------------------------------------------------------------- the supervisor's watch, pure


def test_fatal_children_retry_only_once_the_model_file_changed_and_settled(tmp_path):
    path = tmp_path / "m.gguf"
    spawned = []
    started = lambda name, pids: (spawned.append(name), SimpleNamespace(pid=1, exitcode=None, is_alive=lambda: True))[1]  # noqa: E731
    s = sup.Restarter(load_config(None), path, tmp_path, started)  # the restart logic alone, with a fake starter
    reader = s.children["reader"]
    reader.change(sup.State.STARTING)
    reader.change(sup.State.FATAL)
    reader.fatal_model, reader.retries = None, 4  # it went FATAL while the file was gone
    sigs = iter([None, None, ("d", 1, 10, 1), ("d", 1, 10, 1), ("d", 1, 10, 2), ("d", 1, 10, 2), ("d", 1, 10, 2)])
    look = lambda _p: next(sigs)  # noqa: E731
    for t in (0.0, 1.0):  # still gone: nothing
        s._watch_model(t, look)
    s._watch_model(2.0, look)  # appeared: wait for it to settle
    s._watch_model(3.0, look)  # unchanged for 1 s < MODEL_SETTLE_S
    s._watch_model(4.0, look)  # changed again (still being written)
    s._watch_model(5.0, look)
    assert spawned == []
    s._watch_model(4.0 + sup.MODEL_SETTLE_S, look)  # stable long enough: one more round
    assert spawned == ["reader"] and reader.retries == 0 and reader.state == sup.State.STARTING
    # A child FATAL on the file as it is now gets no retry from the watch.
    compute = s.children["compute"]
    compute.change(sup.State.STARTING)
    compute.change(sup.State.FATAL)
    compute.fatal_model = ("d", 1, 10, 2)
    s._next_model_check = 0.0
    s._model_seen = (("d", 1, 10, 2), 0.0)
    s._watch_model(100.0, lambda _p: ("d", 1, 10, 2))
    assert spawned == ["reader"] and compute.state == sup.State.FATAL


# ---------------------------------------------------------------- moe-pipe run


def run_cli(*args: str, env_extra: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def own_segments(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"moe-pipe-{pid}-*")]


def assert_one_line_failure(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-pipe: error: ") and all(w in last for w in words), last
    return last


def tokens_of(r: subprocess.CompletedProcess) -> list[int]:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["tokens"]


RUN = ["run", CONFIG, "-p", "Once upon a time", "-n", "12", "--output-format", "json", *SMALL_CACHE]


@pytest.mark.integration
def test_run_read_error_fails_in_one_line(model):
    r = run_cli(*RUN, "--set", f"model.path={model}", env_extra={directio.FAULT_ENV: "reader:3"})
    assert_one_line_failure(r, 1, "io_error", str(model), "injected read fault")


@pytest.mark.integration
def test_run_dense_read_error_at_start_fails_in_one_line(model):
    r = run_cli(*RUN, "--set", f"model.path={model}", env_extra={directio.FAULT_ENV: "main:1"})
    assert_one_line_failure(r, 1, "reading the dense set failed", str(model))


@pytest.mark.integration
@pytest.mark.parametrize("fault,where", [("odirect", "at open"), pytest.param("reader:EINVAL:1", "reads", marks=pytest.mark.slow)])  # ~30 s
def test_run_with_o_direct_refused_falls_back_to_the_same_tokens(model, fault, where):
    want = tokens_of(run_cli(*RUN, "--set", f"model.path={model}"))
    r = run_cli(*RUN, "--set", f"model.path={model}", env_extra={directio.FAULT_ENV: fault})
    assert tokens_of(r) == want
    assert f"refuses O_DIRECT {where}" in r.stderr  # the reader says so (once)
    assert r.stderr.count("moe-reader") == 1


@pytest.mark.integration
def test_run_fails_clearly_when_the_model_file_shrinks_mid_run(model):
    proc = subprocess.Popen(
        [
            *CLI,
            "run",
            CONFIG,
            "--set",
            f"model.path={model}",
            "-p",
            "Once upon a time",
            "-n",
            "100000",
            "--ignore-eos",
            "--set",
            "compute.ctx_size=200000",
            *SMALL_CACHE,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _has_child(proc.pid, "moe-compute"):
            time.sleep(0.2)
        time.sleep(2.0)  # generating, reading misses
        os.truncate(model, 1 << 20)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r = subprocess.CompletedProcess(proc.args, proc.returncode, "", err)
    assert_one_line_failure(r, 1, "io_error", str(model), "ends at byte")
    assert not own_segments(proc.pid)


def _has_child(pid: int, name: str) -> bool:
    try:
        return any(c.name() == name for c in psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return False


# ---------------------------------------------------------------- moe-pipe up


class Service(StatusPolling):
    """`moe-pipe up --detach` of the tiny config on a model copy, in a private runtime base."""

    wait_timeout_s = 90.0

    def __init__(self, model: Path, *extra: str, fault: str = ""):
        self.base = model.parent
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(self.base)}
        if fault:
            self.env[directio.FAULT_ENV] = fault
        self.model = model
        self.common = ("--set", f"model.path={model}", *SMALL_CACHE)
        r = self.cli("up", CONFIG, *self.common, "--detach", *FAST, *extra, timeout=300)
        assert r.returncode == 0, r.stderr
        self.pid, self.url = self.status()["pid"], self.status()["url"]

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=self.env, timeout=timeout, cwd=ROOT)

    def status(self) -> dict:
        r = self.cli("status", "--json")
        assert r.returncode in (0, 1) and r.stdout, r.stderr  # 1: degraded (a process FATAL), still its status
        return json.loads(r.stdout)

    def chat(self, prompt: str, n: int = 24) -> tuple[int, str]:
        """(HTTP status, the answer's text or the error message)."""
        body = json.dumps(
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0}
        ).encode()
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=180) as resp:
                return resp.status, json.loads(resp.read())["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]["message"]

    def reference(self, prompt: str, n: int = 24) -> str:
        r = run_cli("run", CONFIG, *self.common, "-p", prompt, "-n", str(n), "--chat", "--no-stream", "--output-format", "json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["text"]

    def close(self) -> None:
        if psutil.pid_exists(self.pid):
            self.cli("down", timeout=120)
        deadline = time.monotonic() + 30
        while psutil.pid_exists(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not own_segments(self.pid), own_segments(self.pid)


@pytest.fixture
def service_on(model):
    made = []

    def make(*extra: str, fault: str = "") -> Service:
        made.append(Service(model, *extra, fault=fault))
        return made[-1]

    yield make
    for s in made:
        s.close()


PROMPT = "Tell a story"


@pytest.mark.slow  # ~20-50 s: kept out of the default tier's 10 minutes
@pytest.mark.integration
def test_service_read_error_fails_that_request_and_the_next_one_succeeds(service_on):
    s = service_on(fault="reader:5")  # the reader's 5th read fails, once
    want = s.reference(PROMPT)
    code, text = s.chat(PROMPT)
    assert code == 500 and "io_error" in text and "injected read fault" in text, text
    st = s.status()
    assert st["io"]["io_errors"] >= 1 and "injected" in st["io"]["last_io_error"]
    assert all(p["state"] == "RUNNING" and p["restarts"] == 0 for p in st["processes"])  # nothing crashed
    assert s.chat(PROMPT) == (200, want)
    # the reader looks at the file again each FAULT_CHECK_S (or at its next read) and clears the fault
    deadline = time.monotonic() + 10 * FAULT_CHECK_S
    while s.status()["io"]["fault"] is not None:
        assert time.monotonic() < deadline, s.status()["io"]
        time.sleep(0.1)


@pytest.mark.slow  # ~20-50 s: kept out of the default tier's 10 minutes
@pytest.mark.integration
def test_service_truncated_file_fails_clearly_and_recovers_when_put_back(service_on, model):
    s = service_on()
    want = s.reference(PROMPT)
    assert s.chat(PROMPT) == (200, want)
    os.truncate(model, model.stat().st_size // 2)
    code, text = s.chat("A different story")  # other experts: misses in the cut-off half
    assert code == 500 and "io_error" in text and "ends at byte" in text, text
    reader = s.proc("reader")
    assert reader["state"] == "RUNNING" and reader["fault"] and s.status()["io"]["fault"]
    put_back(model, "rename")
    deadline = time.monotonic() + 30
    while s.status()["io"]["fault"] is not None and time.monotonic() < deadline:
        time.sleep(0.3)  # the reader looks every FAULT_CHECK_S
    assert s.status()["io"]["fault"] is None
    assert s.chat(PROMPT) == (200, want)


@pytest.mark.slow  # 40-50 s: restarts until FATAL, then back (the default tier's time)
@pytest.mark.integration
def test_service_file_gone_goes_fatal_without_a_crash_loop_and_recovers(service_on, model):
    s = service_on("--set", "supervisor.start_retries=2")
    want = s.reference(PROMPT)
    gone = model.with_suffix(".away")
    model.rename(gone)
    assert s.chat(PROMPT) == (200, want)  # the reader's open file still serves
    os.kill(s.proc("reader")["pid"], signal.SIGKILL)  # ...until it is restarted
    p = s.wait_state("reader", {"FATAL"})
    # start_retries=2: at most the restart after the kill and 2 retries, then it stops
    assert p["restarts"] <= 3 and "no such file" in p["last_error"], p
    time.sleep(3)
    assert s.proc("reader")["restarts"] == p["restarts"]  # FATAL stays FATAL while the file is gone
    assert "no such file" in s.cli("status").stdout  # the plain status shows why
    gone.rename(model)
    s.wait_state("reader", {"RUNNING"}, timeout=60)
    s.wait_state("compute", {"RUNNING"}, timeout=60)
    assert s.chat(PROMPT) == (200, want)


@pytest.mark.slow  # 40-50 s: restarts until FATAL, then back (the default tier's time)
@pytest.mark.integration
def test_service_refuses_a_different_file_put_back(service_on, model):
    s = service_on("--set", "supervisor.start_retries=1")
    other = model.with_suffix(".other")
    other.write_bytes(other_weights(model))
    other.rename(model)
    os.kill(s.proc("reader")["pid"], signal.SIGKILL)  # a restart would open the other file: it must refuse
    p = s.wait_state("reader", {"FATAL"})
    assert "not the file this service started with" in p["last_error"], p
    put_back(model, "rename")  # the original again: the watch restarts it, and compute with it
    s.wait_state("reader", {"RUNNING"}, timeout=60)
    s.wait_state("compute", {"RUNNING"}, timeout=60)
    assert s.chat(PROMPT) == (200, s.reference(PROMPT))
