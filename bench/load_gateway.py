"""Load on the gateway: N concurrent streaming clients for a fixed time.

    python bench/load_gateway.py [--clients 8] [--seconds 60] [--max-tokens 16] [--warmup-s 5]
                                 [--config configs/tiny.toml | --url http://HOST:PORT] [--json OUT]

Without --url it starts `moe-pipe up CONFIG --detach --port 0` in a private
runtime folder (XDG_RUNTIME_DIR under /tmp, as tests/test_service.py does) and
stops it afterwards; with --url it loads that gateway, and finds the service's
processes through `moe-pipe status --json` when it can.

Each client sends one streamed chat completion after another (greedy, its own
prompt, `stream_options.include_usage`), reads the stream to `[DONE]` and
notes the time to the first text and to the end. A request counts as
answered (200 and a whole stream), refused (429 or 503 with OpenAI's error
body: the queue or the connection limit said no) or an error, by kind
(`http_500:internal`, `stream_error:compute_unavailable`, `connection:...`,
`timeout`, `incomplete_stream`). Requests begun before the time is up are
waited for. It prints counts, latency percentiles (time to first token,
total), completion tokens per second over the whole run, and the RSS of the
gateway, the supervisor and each other child after the warm-up and at the
end, with the largest value seen in between (sampled every second): a flat
line is the point. The figures are printed, never judged: the slow test
tests/test_gateway_load.py makes the assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
REQUEST_TIMEOUT_S = 300.0  # one request, queueing included; a hang shows up as "timeout"


@dataclass
class Outcome:
    kind: str  # "answered", "refused" or the error kind
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int = 0


@dataclass
class Report:
    url: str
    clients: int
    seconds: float
    max_tokens: int
    wall_s: float = 0.0
    requests: int = 0
    answered: int = 0
    refused: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft_ms: dict[str, float] = field(default_factory=dict)
    total_ms: dict[str, float] = field(default_factory=dict)
    completion_tokens: int = 0
    tokens_per_s: float = 0.0
    rss_mb: dict[str, dict[str, float]] = field(default_factory=dict)  # process -> start, end, peak, growth
    gateway_outcomes: dict[str, float] = field(default_factory=dict)  # moe_pipe_requests_total from /metrics


# ------------------------------------------------------------------ the service


class Service:
    """`moe-pipe up CONFIG --detach` in a private runtime folder; `up_args` go to `up` too,
    and `wrap` may put its command inside something (a memory cgroup: bench/bench_parallel.py)."""

    def __init__(self, config: str, *up_args: str, wrap=lambda cmd: cmd, up_timeout_s: float = 300):
        self.base = Path(tempfile.mkdtemp(prefix="mpl", dir="/tmp"))  # short: unix socket paths <= 107 bytes
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(self.base)}
        up = [*CLI, "up", config, "--detach", "--port", "0", *up_args]
        r = subprocess.run(wrap(up), capture_output=True, text=True, env=self.env, timeout=up_timeout_s)
        if r.returncode != 0:
            shutil.rmtree(self.base, ignore_errors=True)
            raise SystemExit(f"load_gateway: moe-pipe up failed: {r.stderr.strip()}")

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=self.env, timeout=timeout)

    def stop(self) -> None:
        self.cli("down", timeout=120)
        shutil.rmtree(self.base, ignore_errors=True)


def service_status(env: dict | None = None) -> dict | None:
    r = subprocess.run([*CLI, "status", "--json"], capture_output=True, text=True, env=env, timeout=60)
    try:
        return json.loads(r.stdout) if r.returncode == 0 else None
    except ValueError:
        return None


def process_pids(status: dict | None) -> dict[str, int]:
    if not status:
        return {}
    pids = {"supervisor": status["pid"]}
    pids.update({p["name"]: p["pid"] for p in status.get("processes", []) if p.get("pid")})
    return pids


class RssWatch:
    """RSS of each process: after the warm-up, at the end, and the peak between."""

    def __init__(self, pids: dict[str, int]):
        import psutil

        self.procs = {}
        for name, pid in pids.items():
            try:
                self.procs[name] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                pass
        self.start: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def sample(self) -> dict[str, int]:
        import psutil

        now = {}
        for name, proc in self.procs.items():
            try:
                now[name] = proc.memory_info().rss
            except psutil.NoSuchProcess:  # restarted: the figure would compare two processes
                continue
            self.peak[name] = max(self.peak.get(name, 0), now[name])
        return now

    def mark_start(self) -> None:
        self.start = self.sample()
        self.peak = dict(self.start)

    def result(self) -> dict[str, dict[str, float]]:
        end = self.sample()
        mb = 1 / 2**20
        return {
            name: {
                "start": self.start[name] * mb,
                "end": end[name] * mb,
                "peak": self.peak[name] * mb,
                "growth": (end[name] - self.start[name]) * mb,
            }
            for name in self.start
            if name in end
        }


# ------------------------------------------------------------------ the clients


async def one_request(session, url: str, model: str, prompt: str, max_tokens: int) -> Outcome:
    import aiohttp

    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    try:
                        code = (await resp.json(content_type=None))["error"]["code"]
                    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                        code = "no_error_body"
                    refused = resp.status in (429, 503) and code in ("queue_full", "too_many_connections")
                    return Outcome("refused" if refused else f"http_{resp.status}:{code}")
                tokens, done, finished = 0, False, False
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        return Outcome(f"stream_error:{event['error'].get('code')}")
                    for choice in event.get("choices") or []:
                        if ttft is None and choice.get("delta", {}).get("content"):
                            ttft = time.perf_counter() - t0
                        finished = finished or choice.get("finish_reason") is not None
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                if not (done and finished):
                    return Outcome("incomplete_stream")
                return Outcome("answered", ttft, time.perf_counter() - t0, tokens)
    except TimeoutError:
        return Outcome("timeout")
    except (aiohttp.ClientError, ConnectionError) as exc:
        return Outcome(f"connection:{type(exc).__name__}")


async def client(k: int, session, url: str, model: str, max_tokens: int, deadline: float, out: list) -> None:
    i = 0
    while time.monotonic() < deadline:
        prompt = f"Client {k}, request {i}: tell a short story about the number {k * 1000 + i}."
        outcome = await one_request(session, url, model, prompt, max_tokens)
        out.append(outcome)
        i += 1
        if outcome.kind == "refused":
            await asyncio.sleep(1.0)  # Retry-After


async def load(url: str, clients: int, seconds: float, max_tokens: int, warmup_s: float, rss: RssWatch) -> tuple[list[Outcome], float, str]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=clients + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        # warm-up: the same load, not counted, so that one-time growth (first
        # requests, allocator arenas) is not taken for a leak
        if warmup_s > 0:
            await asyncio.gather(*(client(k, session, url, model, max_tokens, time.monotonic() + warmup_s, []) for k in range(clients)))
        rss.mark_start()
        outcomes: list[Outcome] = []
        t0 = time.monotonic()
        deadline = t0 + seconds

        async def sampler():
            while True:
                await asyncio.sleep(1.0)
                rss.sample()

        watch = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(client(k, session, url, model, max_tokens, deadline, outcomes) for k in range(clients)))
        finally:
            watch.cancel()
        wall = time.monotonic() - t0
        async with session.get(url + "/metrics") as resp:
            metrics = await resp.text()
    return outcomes, wall, metrics


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": qs[49] * 1e3, "p90": qs[89] * 1e3, "p99": qs[98] * 1e3, "max": max(values) * 1e3}


def request_outcomes(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("moe_pipe_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


def run(
    url: str | None = None,
    clients: int = 8,
    seconds: float = 60.0,
    max_tokens: int = 16,
    warmup_s: float = 5.0,
    config: str = str(REPO / "configs" / "tiny.toml"),
) -> Report:
    service = Service(config) if url is None else None
    try:
        status = service_status(service.env if service else None)
        if service is not None:
            if not status or not status.get("url"):
                raise SystemExit(f"load_gateway: the service started but `moe-pipe status` shows no API: {status}")
            url = status["url"]
        elif status is not None and status.get("url") != url:
            status = None  # some other service: its processes are not the ones under load
        rss = RssWatch(process_pids(status))
        outcomes, wall, metrics = asyncio.run(load(url, clients, seconds, max_tokens, warmup_s, rss))
        report = Report(url, clients, seconds, max_tokens, wall_s=wall, requests=len(outcomes))
        report.rss_mb = rss.result()
    finally:
        if service is not None:
            service.stop()
    kinds = Counter(o.kind for o in outcomes)
    report.answered, report.refused = kinds.pop("answered", 0), kinds.pop("refused", 0)
    report.errors = dict(kinds)
    done = [o for o in outcomes if o.kind == "answered"]
    report.ttft_ms = percentiles([o.ttft_s for o in done if o.ttft_s is not None])
    report.total_ms = percentiles([o.total_s for o in done])
    report.completion_tokens = sum(o.tokens for o in done)
    report.tokens_per_s = report.completion_tokens / wall if wall else 0.0
    report.gateway_outcomes = request_outcomes(metrics)
    return report


def format_report(r: Report) -> str:
    def pct(d: dict) -> str:
        return "  ".join(f"{k} {v:,.0f}" for k, v in d.items()) or "-"

    lines = [
        f"gateway {r.url}: {r.clients} streaming clients for {r.wall_s:.1f} s, max_tokens {r.max_tokens}",
        f"requests {r.requests}: answered {r.answered}, refused (429/503) {r.refused}, errors "
        + (", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "0"),
        f"time to first token ms: {pct(r.ttft_ms)}",
        f"total ms:               {pct(r.total_ms)}",
        f"completion tokens {r.completion_tokens:,} = {r.tokens_per_s:.1f} tok/s over the run",
        "gateway's own count: " + (", ".join(f"{k} {v:g}" for k, v in sorted(r.gateway_outcomes.items())) or "-"),
    ]
    if r.rss_mb:
        lines.append("RSS MiB (after warm-up -> end, peak):")
        lines += [
            f"  {name:<10} {v['start']:8.1f} -> {v['end']:8.1f} ({v['growth']:+.1f}), peak {v['peak']:.1f}" for name, v in r.rss_mb.items()
        ]
    else:
        lines.append("RSS: the service's processes are unknown (--url of a service `moe-pipe status` does not see)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="load this gateway instead of starting `moe-pipe up`")
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.toml"), help="config for `moe-pipe up`")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0, help="load time after the warm-up")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--warmup-s", type=float, default=5.0, help="load before the RSS baseline is taken")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    report = run(args.url, args.clients, args.seconds, args.max_tokens, args.warmup_s, args.config)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
