"""Whole replies from a cold start, per token, for A/B variants of moe-pipe.

    python3 bench/bench_cold.py MODEL.gguf --limit-mb 11059 [-n 128] [--repeat 2]
        [--variant NAME=FLAGS ...] [--config configs/qwen30b.toml] [-t 2]

A reply begins cold, and this VM's host keeps blocks that were read before
(a re-read runs ~1.6x faster), so a run is cold only on bytes no earlier run
read. Each run here therefore reads its own fresh copy of MODEL (written
before the page cache is dropped, removed after), and the variants take
turns, the order alternating between repeats, so neither always runs first.
Every run is one `moe-pipe bench --repeat 1` inside the memory limit; its
per-token CSV gives, per run (medians over repeats in the table):

  first token      the prompt's pass: its reads into an empty cache, and compute
  tokens 2-50      the cache fill: mean wall per token and the disk bytes per
                   second of wall time
  last quarter     steady state: mean tok/s over the last quarter of the reply
  whole            tokens / total wall, first token included: what a user waits

Needs root (cgroup, drop_caches) and free disk for one more copy of MODEL.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from _protocol import (  # bench/ is the script's folder
    clean_up_on_term,
    cold_run_parser,
    fresh_copy,
    io_lanes,
    lane_gbps,
    read_rows,
    run_info,
)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def figures(rows: list[dict], lanes: int) -> dict:
    walls = [r["wall_ms"] for r in rows]
    fill = rows[1:50]
    tail = walls[-max(1, len(walls) // 4) :]
    return {
        "first_s": walls[0] / 1e3,
        "first_gb": rows[0]["read_bytes"] / 1e9,
        "first_read_gbps": lane_gbps(rows[:1], lanes),
        "fill_ms": statistics.mean(r["wall_ms"] for r in fill),
        "fill_gbps": sum(r["read_bytes"] for r in fill) / sum(r["wall_ms"] for r in fill) / 1e6,
        "fill_read_gbps": lane_gbps(fill, lanes),
        "steady_tps": 1e3 / statistics.mean(tail),
        "steady_hit": rows[-1]["cache_hit_pct"],
        "whole_tps": len(walls) / (sum(walls) / 1e3),
    }


def main(argv: list[str] | None = None) -> int:
    clean_up_on_term()
    ap = cold_run_parser(__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], help='NAME=FLAGS, e.g. "populated=--populate"')
    ap.add_argument("--out", type=Path, default=OUT / "cold")
    ap.add_argument("--report-only", action="store_true", help="tabulate the runs already in --out, run nothing")
    args, extra = ap.parse_known_args(argv)
    variants = [v.split("=", 1) for v in args.variant] or [["default", ""]]
    if args.report_only:
        runs = {name: [figures(read_rows(d / "moe-pipe-1.csv"), io_lanes(run_info(d / "moe-pipe-1.jsonl")))
                       for d in sorted(args.out.glob(f"{name}-*"))] for name, _ in variants}  # fmt: skip
        report(runs, args)
        return 0
    copy = args.model.with_name(args.model.stem + "-cold-copy.gguf")
    runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for r in range(args.repeat):
        order = variants if r % 2 == 0 else variants[::-1]
        for name, flags in order:
            out = args.out / f"{name}-{r + 1}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "moe_pipe.cli.main", "bench", args.config, "--set", f"model.path={copy}",
                   "-n", str(args.n), "--repeat", "1", "--mem-limit-mb", str(args.limit_mb), "-t", str(args.threads),
                   "--out", str(out), *flags.split(), *extra]  # fmt: skip
            try:  # the copy inside: one cut short by a kill goes too
                took = fresh_copy(args.model, copy)
                print(f"[{name} {r + 1}] fresh copy in {took:.0f} s; {' '.join(cmd[2:])}", file=sys.stderr)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            finally:
                copy.unlink(missing_ok=True)
            f = figures(read_rows(out / "moe-pipe-1.csv"), io_lanes(run_info(out / "moe-pipe-1.jsonl")))
            runs[name].append(f)
            print(f"[{name} {r + 1}] " + ", ".join(f"{k} {v:.3g}" for k, v in f.items()), file=sys.stderr)
    report(runs, args)
    return 0


def report(runs: dict[str, list[dict]], args) -> None:
    cols = ("first_s", "first_gb", "first_read_gbps", "fill_ms", "fill_gbps", "fill_read_gbps", "steady_tps", "steady_hit", "whole_tps")
    heads = ("first token s", "its GB", "its reads GB/s", "tokens 2-50 ms", "their GB/s of wall", "their reads GB/s",
             "last quarter tok/s", "hit %", "whole tok/s")  # fmt: skip
    print(f"\n{args.model.name}, limit {args.limit_mb:g} MiB, {args.n} tokens, -t {args.threads}, medians of {args.repeat} cold runs:\n")
    print("| variant | " + " | ".join(heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    for name, rows in runs.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(x[c] for x in rows):.2f}" for c in cols) + " |")
    print("\n(reads GB/s: disk bytes over the time a lane was reading; GB/s of wall: over the tokens' wall time)")


if __name__ == "__main__":
    raise SystemExit(main())
