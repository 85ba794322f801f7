"""A scripted chat through the gateway, with prompt reuse on and off.

    python bench/bench_chat.py [--model FILE | --layers 8] [--turns 6] [--max-tokens 48]
                               [--cache-mb 1024] [-t THREADS] [--order off,on] [--json OUT]

What a user of a chat front end feels on turn N is the time to the first
token, and without reuse it grows with the conversation: every turn the
engine prefills every earlier turn again (and, on a model larger than RAM,
reads their experts again). For each mode this starts its own service
(`moe-pipe up configs/qwen30b.toml --detach`, the qwen30b-shape model cut to
`--layers`, a private runtime folder, the expert cache at `--cache-mb`), holds
one conversation of `--turns` scripted user turns (greedy, streamed, each
reply kept in the history as the front end would), and stops it. Reuse "off"
sends `cache_prompt: false` with every request; "on" leaves the default.

Per turn it prints the time to the first streamed text, the prompt's tokens,
how many of them came from the kept KV cache (`usage.prompt_tokens_details.
cached_tokens`) and so how many were computed, and the MiB of experts read
(`moe_pipe_read_bytes_total` from /metrics, before and after). Then, in the
same service (reuse on), the cost of JSON-constrained sampling: the same
request with and without a `response_format` JSON schema, per generated token.
The figures are printed, never judged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import shape_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
CONFIG = "configs/qwen30b.toml"
REQUEST_TIMEOUT_S = 600.0
METRICS_SETTLE_S = 0.5  # telemetry reaches the gateway's counters a moment after the reply

USER_TURNS = (
    "I am planning a week of hiking in the mountains in early autumn. What should I pack for cold nights, "
    "changing weather and long days on rocky trails?",
    "Thanks. How heavy should the whole pack be, and which of those things could I leave at home to save weight?",
    "What is a good way to plan daily distances if some days climb more than a thousand metres?",
    "How do I filter and carry water when the streams above the tree line may be dry by September?",
    "If the weather turns bad on the fourth day, how should I decide between waiting it out and walking down?",
    "Please sum up the whole plan in a short checklist I can print and keep in the top pocket of the pack.",
    "One more question: what should I eat on the long climbing days so that I keep my energy up?",
    "And how should I look after my feet and knees over a whole week on rocky ground?",
)

# A schema with a bounded reply, as an agent's structured answer would be.
SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"type": "string", "enum": ["go", "wait", "turn back"]},
        "reason": {"type": "string", "maxLength": 80},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["verdict", "reason", "confidence"],
    "additionalProperties": False,
}


@dataclass
class Turn:
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    read_mib: float

    @property
    def computed(self) -> int:
        return self.prompt_tokens - (self.cached_tokens or 0)


@dataclass
class ModeReport:
    mode: str
    turns: list[Turn] = field(default_factory=list)


class Service:
    """One `moe-pipe up --detach` in a private runtime folder, stopped on exit."""

    def __init__(self, model: Path, cache_mb: float, port: int, threads: int):
        self.base = Path(tempfile.mkdtemp(prefix="mpc", dir="/tmp"))  # short: unix socket paths <= 107 bytes
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(self.base)}
        self.url = f"http://127.0.0.1:{port}"
        settings = ["--set", f"model.path={model}", "--cache-mb", str(cache_mb), "--port", str(port), "--threads", str(threads)]
        r = self.cli("up", CONFIG, "--detach", *settings, timeout=900)
        if r.returncode != 0:
            shutil.rmtree(self.base, ignore_errors=True)
            raise SystemExit(f"bench_chat: moe-pipe up failed: {r.stderr.strip()}")

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=self.env, timeout=timeout, cwd=REPO)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.cli("down", timeout=120)
        shutil.rmtree(self.base, ignore_errors=True)

    def model_id(self) -> str:
        if not hasattr(self, "_model_id"):
            with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as resp:
                self._model_id = json.loads(resp.read())["data"][0]["id"]
        return self._model_id

    def read_bytes(self) -> float:
        time.sleep(METRICS_SETTLE_S)
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("moe_pipe_read_bytes_total"):
                    return float(line.split()[-1])
        return 0.0

    def chat(self, messages: list[dict], max_tokens: int, **extra) -> tuple[str, float, float, dict]:
        """One streamed chat completion: (text, time to first text, total time, usage)."""
        body = {
            "model": self.model_id(),
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        ttft, pieces, usage = None, [], {}
        try:
            resp = urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S)
        except urllib.error.HTTPError as e:
            raise SystemExit(f"bench_chat: HTTP {e.code}: {e.read().decode(errors='replace').strip()}") from None
        with resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise SystemExit(f"bench_chat: the stream failed: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if text:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        pieces.append(delta.get("content") or "")
        total = time.perf_counter() - t0
        return "".join(pieces), ttft if ttft is not None else total, total, usage


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def converse(svc: Service, mode: str, turns: int, max_tokens: int) -> ModeReport:
    report = ModeReport(mode)
    messages: list[dict] = [{"role": "system", "content": "You are a careful, practical mountain guide."}]
    extra = {"cache_prompt": False} if mode == "off" else {}
    for n in range(turns):
        messages.append({"role": "user", "content": USER_TURNS[n % len(USER_TURNS)]})
        before = svc.read_bytes()
        text, ttft, total, usage = svc.chat(messages, max_tokens, **extra)
        read_mib = (svc.read_bytes() - before) / 2**20
        messages.append({"role": "assistant", "content": text})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        turn = Turn(n + 1, ttft, total, usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", 0), read_mib)
        report.turns.append(turn)
        print(
            f"[{mode}] turn {turn.turn}: first text {ttft:.2f} s, prompt {turn.prompt_tokens} tokens "
            f"({turn.computed} computed), {read_mib:.0f} MiB read, {turn.completion_tokens} generated in {total:.2f} s",
            file=sys.stderr,
        )
    return report


def constrained_cost(svc: Service, max_tokens: int, repeat: int) -> dict:
    """ms per generated token with and without a JSON schema on the same prompt (medians)."""
    messages = [{"role": "user", "content": "The forecast says storms from noon. Should we start the climb? Answer as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "decision", "schema": SCHEMA, "strict": True}}
    out: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for _ in range(repeat):
        for kind, extra in (("plain", {}), ("json_schema", {"response_format": fmt})):
            _, ttft, total, usage = svc.chat(messages, max_tokens, **extra)
            n = usage.get("completion_tokens", 0)
            if n > 1:
                out[kind].append((total - ttft) / (n - 1) * 1e3)
    med = {k: sorted(v)[len(v) // 2] if v else float("nan") for k, v in out.items()}
    return {"ms_per_token": med, "overhead": med["json_schema"] / med["plain"] - 1 if med["plain"] else float("nan")}


def print_table(reports: list[ModeReport]) -> None:
    print(f"\n{'turn':>4}  " + "  ".join(f"{r.mode + ' first s':>11}{'computed':>9}{'MiB':>7}" for r in reports))
    for i in range(len(reports[0].turns)):
        cells = []
        for r in reports:
            t = r.turns[i]
            cells.append(f"{t.ttft_s:>11.2f}{t.computed:>9}{t.read_mib:>7.0f}")
        print(f"{i + 1:>4}  " + "  ".join(cells))
    by = {r.mode: r for r in reports}
    if "on" in by and "off" in by:
        on, off = by["on"].turns[-1], by["off"].turns[-1]
        print(
            f"\nlast turn with reuse: {on.computed} of {on.prompt_tokens} prompt tokens computed "
            f"({on.computed / max(on.prompt_tokens, 1):.0%}), first text {off.ttft_s / max(on.ttft_s, 1e-9):.2f}x sooner than without"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF (default: the qwen30b-shape model cut to --layers, made on first use)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cache-mb", type=float, default=1024, help="expert cache size for both modes")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="compute threads (default: every core)")
    p.add_argument("--order", default="off,on", help="modes in the order they run (each starts its own service)")
    p.add_argument("--constrained-repeat", type=int, default=3, help="requests per kind for the JSON-schema cost (0: skip)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.order.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        p.error(f"--order takes on and off, comma-separated, not {args.order!r}")
    model = shape_model(args.model, args.layers)
    reports, cost = [], None
    for mode in modes:
        with Service(model, args.cache_mb, free_port(), args.threads) as svc:
            reports.append(converse(svc, mode, args.turns, args.max_tokens))
            if mode == "on" and args.constrained_repeat:
                cost = constrained_cost(svc, args.max_tokens, args.constrained_repeat)
    print(f"\n{model.name}, expert cache {args.cache_mb:g} MiB, {args.turns} turns of up to {args.max_tokens} tokens, greedy")
    print_table(reports)
    if cost:
        ms = cost["ms_per_token"]
        print(
            f"JSON schema: {ms['json_schema']:.1f} ms a token against {ms['plain']:.1f} unconstrained "
            f"({cost['overhead']:+.1%}, medians of {args.constrained_repeat})"
        )
    if args.json:
        data = {"model": model.name, "cache_mb": args.cache_mb, "modes": [asdict(r) for r in reports], "constrained": cost}
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
