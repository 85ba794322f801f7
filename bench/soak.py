"""Soak: the service answers a bounded stream of requests for a fixed time
while a random child is killed with SIGKILL every few seconds.

    python bench/soak.py [--seconds 180] [--kill-every 3] [--clients 2] [--parallel 1] [--max-tokens 24]
                         [--victims reader,compute,telemetry,gateway] [--cache-mb 1.2]
                         [--check-prompts N] [--seed 0] [--json OUT]

It starts `moe-pipe up configs/tiny.toml --detach` in a private runtime
folder (XDG_RUNTIME_DIR under /tmp, as tests/test_service.py does) on a fixed
free port (a restarted gateway binds it again), with a cache of a quarter of
the experts so the reader is always reading when it is killed, and
`gateway.parallel` --parallel (so with --clients 4 --parallel 4 every client's
request is decoded beside the others', one batched pass a step). Then:

  1. references: each prompt once before any kill (greedy, so every later
     answer must be the same text); the first --check-prompts of them are
     also compared with `moe-pipe run --no-stream --chat` (the resident
     reference path);
  2. the soak: --clients threads send chat completions one after another
     (half of them streamed) until --seconds are up; meanwhile every
     --kill-every seconds (±30 %) one RUNNING child among --victims that has
     been up longer than the supervisor's stable window gets SIGKILL (a child
     killed again inside that window counts as a failed start, and enough of
     those make it FATAL by design: that is a crash loop guard, not what this
     measures);
  3. recovery: once every child is RUNNING again and the gateway answers
     GET /health with 200, each prompt once more;
  4. `moe-pipe down`, then what this service left: shared-memory segments
     named with its pids, processes it started, the runtime folder, a
     listener on the port, and the supervisor's open fds and threads
     (measured after the references and again before down: restarts must
     not accumulate them). Only this service's own pids count (the
     supervisor's and every descendant seen while it ran), so another
     moe-pipe running on the machine meanwhile changes nothing.

A request ends as `ok` (the reference's text), `mismatch` (a different text:
a wrong answer), or an error by kind: `http_503:compute_unavailable`,
`stream_error:...`, `connection:...` (the gateway was killed under it),
`timeout` (no answer within REQUEST_TIMEOUT_S: a hang). The last line sums
them up: `wrong` (mismatches, in the soak, against `run` and after it),
`lost` (requests that got neither an answer nor one of CLEAR_ERRORS: a hang,
a stream cut short, an error that does not say the compute was lost) and
`leaked` (what `down` left, and fds or threads the supervisor gained). The
figures are printed, never judged; tests/test_soak.py makes the assertions.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from moe_pipe.shared.experts.shm import SHM_DIR, parse_segment_name

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
CONFIG = str(REPO / "configs" / "tiny.toml")
MODEL_NAME = "moe-pipe-tiny"
PROMPTS = (
    "Tell a story",
    "The old mill by the river",
    "Once upon a time",
    "Write a poem about the sea",
    "Explain the rain",
    "List three colours",
)
REQUEST_TIMEOUT_S = 120.0  # a request, queueing and one compute retry included; beyond it: a hang
START_SECS, BACKOFF_S, BACKOFF_CAP_S = 0.5, 0.2, 2.0
STABLE_S = max(10 * START_SECS, BACKOFF_CAP_S)  # the supervisor's window: a crash inside it is a failed start
SETTLE_S = 90.0  # after the soak: time for every child to be RUNNING again
HEALTH_WAIT_S = 120.0  # after `up` or a restart: time for the gateway to answer /health with 200
WATCH_EVERY_S = 0.5  # how often the service's process tree is sampled for its pids
# The errors a client can act on, which say what happened: any other ending is a lost request.
CLEAR_ERRORS = (
    "connection:",  # the gateway itself was killed under the request, or is restarting
    "http_503:compute_unavailable",  # compute died twice under it, or did not come back in time
    "stream_error:compute_unavailable",
)


@dataclass
class Report:
    seconds: float
    kill_every_s: float
    clients: int
    parallel: int = 1  # gateway.parallel: requests compute decodes at once
    requests: int = 0
    ok: int = 0
    mismatch: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    final_states: dict[str, str] = field(default_factory=dict)
    reference_checked: int = 0  # prompts whose first answer was compared with `run --no-stream`
    reference_mismatch: list[str] = field(default_factory=list)
    recovered: bool = False  # every prompt answered with its reference after the soak
    recovery_errors: list[str] = field(default_factory=list)
    supervisor_fds: tuple[int, int] = (0, 0)  # after the references, before down
    supervisor_threads: tuple[int, int] = (0, 0)
    supervisor_rss_mib: tuple[float, float] = (0.0, 0.0)
    leaked_shm: list[str] = field(default_factory=list)
    leaked_processes: list[str] = field(default_factory=list)
    leaked_runtime: list[str] = field(default_factory=list)
    leaked_listener: bool = False
    client_fds: tuple[int, int] = (0, 0)  # this process, before and after
    latency_p50_s: float = 0.0
    latency_p95_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)  # up, references, soak, recovery, down
    wall_s: float = 0.0

    @property
    def wrong(self) -> int:
        """Answers that were not the reference's text: in the soak, against `run`, after it."""
        return self.mismatch + len(self.reference_mismatch) + sum(": mismatch: " in e for e in self.recovery_errors)

    @property
    def lost(self) -> int:
        """Requests that got neither an answer nor an error that says what happened (CLEAR_ERRORS)."""
        return sum(n for kind, n in self.errors.items() if not kind.startswith(CLEAR_ERRORS))

    @property
    def leaked(self) -> int:
        """Things the service left behind or piled up: segments, processes, runtime files, the
        listener, fds of this client, and supervisor fds (beyond a restart's pipe) or threads."""
        k = self.leaks
        return (
            len(self.leaked_shm)
            + len(self.leaked_processes)
            + len(self.leaked_runtime)
            + int(self.leaked_listener)
            + max(0, int(k["client_fds"]))  # type: ignore[call-overload]
            + max(0, int(k["supervisor_fds"]) - 2)  # type: ignore[call-overload]  # a restart in progress may hold a pipe
            + max(0, int(k["supervisor_threads"]))  # type: ignore[call-overload]
        )

    @property
    def leaks(self) -> dict[str, object]:
        return {
            "shm": self.leaked_shm,
            "processes": self.leaked_processes,
            "runtime": self.leaked_runtime,
            "listener": self.leaked_listener,
            "supervisor_fds": self.supervisor_fds[1] - self.supervisor_fds[0],
            "supervisor_threads": self.supervisor_threads[1] - self.supervisor_threads[0],
            "client_fds": self.client_fds[1] - self.client_fds[0],
        }


# -- the service ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, cache_mb: float, parallel: int = 1):
        # Every process of this service, as (pid, start time): the leak check
        # looks for these only. Sampled until the supervisor is gone; status()
        # adds the children it reports (one that lived less than a sample).
        self.pids: dict[int, float] = {}
        self._watch_stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_tree, daemon=True)
        self.base = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))  # short: unix socket paths <= 107 bytes
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(self.base)}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = ["--cache-mb", str(cache_mb)]
        r = self.cli(
            "up",
            CONFIG,
            "--detach",
            "--port",
            str(self.port),
            *self.settings,
            "--parallel",  # `up`'s alone: `run` (the references) serves one request
            str(parallel),
            "--set",
            f"supervisor.start_secs={START_SECS}",
            "--set",
            f"supervisor.backoff_s={BACKOFF_S}",
            "--set",
            f"supervisor.backoff_cap_s={BACKOFF_CAP_S}",
            timeout=300,
        )
        if r.returncode != 0:
            shutil.rmtree(self.base, ignore_errors=True)
            raise SystemExit(f"soak: moe-pipe up failed: {r.stderr.strip()}")
        self.pid = self.status()["pid"]
        self._remember(self.pid)
        self._watch.start()

    def _remember(self, pid: int, parent: int | None = None) -> None:
        try:
            p = psutil.Process(pid)
            if parent is None or p.ppid() == parent:  # a pid status reported may be reused already
                self.pids.setdefault(pid, p.create_time())
        except psutil.Error:
            pass  # gone already: nothing of it can be left

    def _watch_tree(self) -> None:
        while not self._watch_stop.is_set():
            try:
                for child in psutil.Process(self.pid).children(recursive=True):
                    self._remember(child.pid)
            except psutil.Error:
                return  # the supervisor is gone
            self._watch_stop.wait(WATCH_EVERY_S)

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=self.env, timeout=timeout, cwd=REPO)

    def status(self) -> dict:
        r = self.cli("status", "--json")
        if r.returncode != 0:
            raise RuntimeError(f"status failed: {r.stderr.strip() or r.stdout.strip()}")
        st = json.loads(r.stdout)
        for p in st.get("processes", []):
            if p.get("pid"):
                self._remember(p["pid"], parent=st["pid"])
        return st

    def wait_health(self, timeout_s: float, ready: bool = True) -> str | None:
        """Wait until the gateway answers GET /health: with 200 (compute is
        linked), or with any HTTP status when not `ready` (it listens). None
        once it does; else why not, after `timeout_s`. A RUNNING gateway has
        not necessarily bound its port yet: requests sent then are refused."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return None
            except urllib.error.HTTPError as e:
                if not ready:
                    return None
                last = f"HTTP {e.code}"
            except OSError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                return f"GET /health after {timeout_s:g} s: {last}"
            time.sleep(0.2)

    def wait_all_running(self, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        states = {}
        while time.monotonic() < deadline:
            states = {p["name"]: p["state"] for p in self.status()["processes"]}
            if all(s == "RUNNING" for s in states.values()):
                break
            time.sleep(0.3)
        return states

    def down(self) -> None:
        self.cli("down", timeout=120)
        deadline = time.monotonic() + 60
        while psutil.pid_exists(self.pid) and time.monotonic() < deadline:
            try:
                if psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)
        self._watch_stop.set()
        self._watch.join(10)

    def alive(self) -> list[str]:
        """This service's processes still running ("pid name"): the same pid
        with the same start time (a reused pid is someone else's)."""
        out = []
        for pid, started in sorted(self.pids.items()):
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {p.name()}")
            except psutil.Error:
                pass
        return out

    def segments(self) -> list[str]:
        """Shared-memory segments named with one of this service's pids
        (shared/experts/shm.py segment_name: moe-pipe-<owner pid>-<kind>)."""
        names = []
        for entry in SHM_DIR.iterdir() if SHM_DIR.exists() else ():
            parsed = parse_segment_name(entry.name)
            if parsed and parsed[0] in self.pids:
                names.append(entry.name)
        return sorted(names)


def reference_run(prompt: str, max_tokens: int, settings: list[str]) -> str:
    r = subprocess.run(
        [*CLI, "run", CONFIG, *settings, "-p", prompt, "-n", str(max_tokens), "--chat", "--no-stream", "--output-format", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    if r.returncode != 0:
        raise SystemExit(f"soak: the reference run failed: {r.stderr.strip()}")
    return json.loads(r.stdout)["text"]


# -- one request ----------------------------------------------------------------------


def ask(url: str, prompt: str, max_tokens: int, stream: bool) -> tuple[str, str]:
    """("ok", text) or (error kind, message)."""
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
    ).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            if not stream:
                return "ok", json.loads(resp.read())["choices"][0]["message"]["content"]
            return read_stream(resp)
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read())["error"]
            return f"http_{e.code}:{err.get('code')}", str(err.get("message"))
        except (ValueError, KeyError, TypeError, OSError, http.client.HTTPException):
            return f"http_{e.code}", str(e)
    except TimeoutError as e:
        return "timeout", str(e)
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return "timeout", str(reason)
        return f"connection:{type(reason).__name__}", str(reason)
    except (ConnectionError, http.client.HTTPException) as e:
        return f"connection:{type(e).__name__}", str(e)


def read_stream(resp) -> tuple[str, str]:
    text = []
    try:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return "ok", "".join(text)
            event = json.loads(data)
            if "error" in event:
                return f"stream_error:{event['error'].get('code')}", str(event["error"].get("message"))
            for choice in event.get("choices", []):
                text.append((choice.get("delta") or {}).get("content") or "")
    except TimeoutError as e:
        return "timeout", str(e)
    except (ConnectionError, http.client.HTTPException) as e:
        return f"connection:{type(e).__name__}", str(e)
    return "connection:incomplete_stream", "the stream ended without [DONE]"


# -- the soak ---------------------------------------------------------------------------


def snapshot(pid: int) -> tuple[int, int, float]:
    p = psutil.Process(pid)
    return p.num_fds(), p.num_threads(), p.memory_info().rss / 2**20


def own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak(args) -> Report:
    rep = Report(args.seconds, args.kill_every, args.clients, args.parallel)
    fds0 = own_fds()
    t_start = time.monotonic()
    marks = [t_start]

    def phase(name: str) -> None:
        marks.append(time.monotonic())
        rep.phases_s[name] = round(marks[-1] - marks[-2], 1)

    svc = Service(args.cache_mb, args.parallel)
    phase("up")
    try:
        # 1. references, before any kill (`up --detach` returns once the port
        # listens; compute may still be loading)
        why = svc.wait_health(HEALTH_WAIT_S)
        if why:
            raise SystemExit(f"soak: the service never became ready: {why}")
        refs = {}
        for prompt in PROMPTS:
            kind, text = ask(svc.url, prompt, args.max_tokens, stream=False)
            if kind != "ok":
                raise SystemExit(f"soak: the service did not answer before the soak: {kind}: {text}")
            refs[prompt] = text
        for prompt in PROMPTS[: args.check_prompts]:
            rep.reference_checked += 1
            if reference_run(prompt, args.max_tokens, svc.settings) != refs[prompt]:
                rep.reference_mismatch.append(prompt)
        fds, threads, rss = snapshot(svc.pid)
        phase("references")

        # 2. the soak
        stop = threading.Event()
        lock = threading.Lock()
        latencies: list[float] = []
        errors: Counter[str] = Counter()
        kills: Counter[str] = Counter()
        rng = random.Random(args.seed)

        def client(k: int) -> None:
            crng = random.Random(args.seed * 1000 + k)
            while not stop.is_set():
                prompt = crng.choice(PROMPTS)
                t0 = time.monotonic()
                kind, text = ask(svc.url, prompt, args.max_tokens, stream=crng.random() < 0.5)
                dt = time.monotonic() - t0
                with lock:
                    rep.requests += 1
                    if kind == "ok" and text == refs[prompt]:
                        rep.ok += 1
                        latencies.append(dt)
                    elif kind == "ok":
                        rep.mismatch += 1
                        rep.error_examples.setdefault("mismatch", f"{prompt!r}: {text[:120]!r}")
                    else:
                        errors[kind] += 1
                        rep.error_examples.setdefault(kind, text[:300])
                if kind.startswith("connection:"):
                    time.sleep(0.5)  # the gateway is restarting: do not spin on a refused port

        def killer() -> None:
            while not stop.wait(args.kill_every * rng.uniform(0.7, 1.3)):
                try:
                    procs = svc.status()["processes"]
                except (RuntimeError, ValueError, subprocess.TimeoutExpired):
                    continue
                ready = [
                    p
                    for p in procs
                    if p["name"] in args.victims and p["state"] == "RUNNING" and (p["uptime_s"] or 0) > STABLE_S and p["pid"]
                ]
                if not ready:
                    kills["skipped (none up long enough)"] += 1
                    continue
                victim = rng.choice(ready)
                try:
                    os.kill(victim["pid"], signal.SIGKILL)
                    kills[victim["name"]] += 1
                except ProcessLookupError:
                    pass

        threads_ = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
        threads_.append(threading.Thread(target=killer, daemon=True))
        for t in threads_:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads_:
            t.join(REQUEST_TIMEOUT_S + 30)
        rep.errors, rep.kills = dict(errors), dict(kills)
        if latencies:
            latencies.sort()
            rep.latency_p50_s = round(latencies[len(latencies) // 2], 3)
            rep.latency_p95_s = round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.95))], 3)

        phase("soak")

        # 3. recovery
        settle_end = time.monotonic() + SETTLE_S
        rep.final_states = svc.wait_all_running(SETTLE_S)
        why = svc.wait_health(max(5.0, settle_end - time.monotonic()))  # RUNNING is not yet listening
        if why:
            rep.recovery_errors.append(why)
        for prompt in PROMPTS:
            kind, text = ask(svc.url, prompt, args.max_tokens, stream=False)
            if kind != "ok" or text != refs[prompt]:
                rep.recovery_errors.append(f"{prompt!r}: {'mismatch' if kind == 'ok' else kind}: {text[:200]}")
            if kind == "timeout":
                break  # a hung service: one wait is enough to say so
        rep.recovered = not rep.recovery_errors
        st = svc.status()
        rep.restarts = {p["name"]: p["restarts"] for p in st["processes"]}
        fds1, threads1, rss1 = snapshot(svc.pid)
        rep.supervisor_fds, rep.supervisor_threads = (fds, fds1), (threads, threads1)
        rep.supervisor_rss_mib = (round(rss, 1), round(rss1, 1))
        phase("recovery")
    finally:
        # 4. down, then what is left
        svc.down()
        phase("down")
        deadline = time.monotonic() + 10  # a child killed last may still be exiting
        while svc.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        rep.leaked_processes = svc.alive()
        rep.leaked_shm = svc.segments()
        rep.leaked_runtime = sorted(str(p) for p in (svc.base / "moe-pipe").glob("*")) if (svc.base / "moe-pipe").exists() else []
        rep.leaked_listener = any(
            c.laddr and c.laddr.port == svc.port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp")
        )
        shutil.rmtree(svc.base, ignore_errors=True)
        rep.client_fds = (fds0, own_fds())
        rep.wall_s = round(time.monotonic() - t_start, 1)
    return rep


def print_report(rep: Report) -> None:
    print(
        f"soak: {rep.seconds:g} s, a SIGKILL every ~{rep.kill_every_s:g} s, {rep.clients} clients, parallel {rep.parallel} "
        f"({rep.wall_s:g} s in all: " + ", ".join(f"{k} {v:g} s" for k, v in rep.phases_s.items()) + ")"
    )
    print(f"  requests {rep.requests}: ok {rep.ok} (the reference's text), mismatch {rep.mismatch}, errors {sum(rep.errors.values())}")
    for kind, n in sorted(rep.errors.items(), key=lambda kv: -kv[1]):
        print(f"    {n:5d}  {kind}  e.g. {rep.error_examples.get(kind, '')[:110]}")
    print(f"  latency of ok requests: p50 {rep.latency_p50_s} s, p95 {rep.latency_p95_s} s")
    print(f"  kills: {sum(v for k, v in rep.kills.items() if not k.startswith('skipped'))} {dict(sorted(rep.kills.items()))}")
    print(f"  restarts: {sum(rep.restarts.values())} {rep.restarts}; final states {rep.final_states}")
    print(
        f"  references: {rep.reference_checked} checked against run --no-stream, mismatches {rep.reference_mismatch}; "
        f"recovered after the soak: {rep.recovered} {rep.recovery_errors[:2]}"
    )
    print(
        f"  supervisor: fds {rep.supervisor_fds[0]} -> {rep.supervisor_fds[1]}, threads {rep.supervisor_threads[0]} -> "
        f"{rep.supervisor_threads[1]}, RSS {rep.supervisor_rss_mib[0]} -> {rep.supervisor_rss_mib[1]} MiB"
    )
    print(
        f"  left after down: shm {rep.leaked_shm}, processes {rep.leaked_processes}, runtime {rep.leaked_runtime}, "
        f"listener {rep.leaked_listener}; this client's fds {rep.client_fds[0]} -> {rep.client_fds[1]}"
    )
    print(f"  wrong {rep.wrong}, lost {rep.lost}, leaked {rep.leaked}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=180.0, help="how long requests are sent and children killed")
    p.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between two SIGKILLs")
    p.add_argument("--clients", type=int, default=2, help="concurrent clients, each one request at a time")
    p.add_argument("--parallel", type=int, default=1, help="gateway.parallel: requests compute decodes at once (up --parallel N)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument(
        "--victims",
        default="reader,compute,telemetry,gateway",
        type=lambda s: tuple(v for v in s.split(",") if v),
        help="children that may be killed",
    )
    p.add_argument("--cache-mb", type=float, default=1.2, help="expert cache (1.2 MiB: a quarter of the tiny model's experts)")
    p.add_argument(
        "--check-prompts", type=int, default=len(PROMPTS), help="prompts whose first answer is compared with `moe-pipe run --no-stream`"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT (- for stdout, then no table)")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel: {args.parallel} is not a number of slots (1 or more)")
    bad = set(args.victims) - {"reader", "compute", "telemetry", "gateway"}
    if bad:
        p.error(f"--victims: unknown {sorted(bad)}; choose from reader, compute, telemetry, gateway")
    rep = soak(args)
    data = asdict(rep) | {"leaks": rep.leaks, "wrong": rep.wrong, "lost": rep.lost, "leaked": rep.leaked}
    if args.json == "-":
        print(json.dumps(data, indent=1))
        return 0
    print_report(rep)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
