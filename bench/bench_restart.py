"""The first reply after `down`/`up`: with the hot set the last run saved (warm) against an empty cache (cold).

    python3 bench/bench_restart.py MODEL.gguf --limit-mb 11059 [-n 128] [--repeat 2]
        [--config configs/qwen30b.toml] [-t 2] [--wait-warm] [--prompt TEXT]

Each repeat serves MODEL twice, each time from a fresh copy of it (this VM's
host keeps blocks read before, so only never-read blocks are cold; a copy
has the model's identity, so the hot set carries over) with the page cache
dropped, inside a memory cgroup of --limit-mb:

  cold   `up --cold`, one greedy reply of -n tokens, `down` (which saves the hot set)
  warm   `up` (reads that hot set back in the background), the same reply at
         once — as a user's first request after a restart — or, with
         --wait-warm, once the warm start has ended; `down`

Figures per run from the service's per-token CSV (telemetry.csv): first
token, tokens 2-50, last quarter and whole (bench/_protocol.py
reply_figures), and for warm runs the warm start's experts and seconds from
`status` at the reply's end. The service's state (its hot set, its kept
log) lives in a private XDG_STATE_HOME under --out, never the user's.

Needs root (cgroup, drop_caches) and free disk for one more copy of MODEL.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _protocol import cold_run_parser, fresh_copy, read_rows, reply_figures  # bench/ is the script's folder

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
NAME = "bench-restart"
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
START_TIMEOUT_S = 1800.0  # a full-depth start reads the dense set and compiles kernels


def serve_once(args, model: Path, out: Path, env: dict, warm: bool) -> dict:
    """One `up` in the cgroup, one reply, `down`; the run's figures."""
    from moe_pipe.shared.analysis.cgroup import MemoryCgroup, drop_page_cache

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    csv = out / "tokens.csv"
    cmd = [*CLI, "up", args.config, "--name", NAME, "--port", "0", "-t", str(args.threads),
           "--set", f"model.path={model}", "--csv", str(csv), *([] if warm else ["--cold"])]  # fmt: skip
    drop_page_cache()
    cg = MemoryCgroup.create(args.limit_mb)
    log = open(out / "up.log", "w")
    proc = subprocess.Popen(cg.wrap(cmd), stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        url = wait_serving(proc)
        if warm and args.wait_warm:
            wait_warm_end(env)
        t0 = time.perf_counter()
        body = {"prompt": args.prompt, "max_tokens": args.n, "temperature": 0}
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=24 * 3600) as resp:
            reply = json.loads(resp.read())
        wall_s = time.perf_counter() - t0
        warming = status(env).get("warming") or {}
    finally:
        subprocess.run([*CLI, "down", "--name", NAME, "--timeout", "600"], env=env, capture_output=True)
        proc.wait(600)
        log.close()
        peak = (cg.peak_bytes() or 0) / 2**20
        cg.remove()
    rows = read_rows(csv)
    fig = reply_figures([r["wall_ms"] for r in rows])
    fig |= {"request_s": wall_s, "tokens_api": reply["usage"]["completion_tokens"], "hit_last": rows[-1]["cache_hit_pct"]}
    fig |= {"warm_done": warming.get("done", 0), "warm_total": warming.get("total", 0), "warm_s": warming.get("seconds", 0.0)}
    fig["peak_mib"] = peak
    return fig


def wait_serving(proc: subprocess.Popen) -> str:
    """The URL from `moe-pipe: serving MODEL at URL as 'NAME' ...` once the API listens."""
    deadline = time.monotonic() + START_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_restart: the service exited ({proc.wait()}); see up.log")
        if line.startswith("moe-pipe: serving"):
            return line.split(" at ", 1)[1].split()[0]
    raise SystemExit("bench_restart: the service did not start in time")


def status(env: dict) -> dict:
    r = subprocess.run([*CLI, "status", "--json", "--name", NAME], env=env, capture_output=True, text=True)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {}


def wait_warm_end(env: dict) -> None:
    while (status(env).get("warming") or {}).get("state") == "warming":
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = cold_run_parser(__doc__.splitlines()[0])
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--wait-warm", action="store_true", help="send the warm run's request once the warm start has ended")
    ap.add_argument("--out", type=Path, default=OUT / "restart")
    args = ap.parse_args(argv)
    env = {**os.environ, "XDG_STATE_HOME": str(args.out / "state")}
    shutil.rmtree(args.out / "state", ignore_errors=True)  # no hot set before the first cold run
    copy = args.model.with_name(args.model.stem + "-restart-copy.gguf")
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for r in range(args.repeat):
        for label in ("cold", "warm"):  # the warm run needs the cold run's hot set
            took = fresh_copy(args.model, copy)
            print(f"[{label} {r + 1}] fresh copy in {took:.0f} s", file=sys.stderr)
            try:
                f = serve_once(args, copy, args.out / f"{label}-{r + 1}", env, warm=label == "warm")
            finally:
                copy.unlink(missing_ok=True)
            runs[label].append(f)
            print(f"[{label} {r + 1}] " + ", ".join(f"{k} {v:.3g}" for k, v in f.items()), file=sys.stderr)
    report(runs, args)
    return 0


def report(runs: dict[str, list[dict]], args) -> None:
    cols = ("first_s", "fill_ms", "steady_tps", "whole_tps", "tokens", "hit_last", "warm_done", "warm_s", "peak_mib")
    heads = (
        "first token s",
        "tokens 2-50 ms",
        "last quarter tok/s",
        "whole tok/s",
        "tokens",
        "hit %",
        "warmed experts",
        "warm start s",
        "peak MiB",
    )
    when = "after the warm start ended" if args.wait_warm else "at once after `up`"
    print(
        f"\n{args.model.name}, limit {args.limit_mb:g} MiB, {args.n} tokens, -t {args.threads}, request {when}, medians of {args.repeat}:\n"
    )
    print("| start | " + " | ".join(heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    for label, rows in runs.items():
        print(f"| {label} | " + " | ".join(f"{statistics.median(x[c] for x in rows):.2f}" for c in cols) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
