"""The streaming pipeline against the resident path, and under a memory limit.

    python bench/bench_pipeline.py [--layers 8] [-n 32] [--threads 2] [--io-threads 1]
                                   [--small-cache-mb 600] [--mem-limit-mb 2048] [--model PATH]

On a qwen30b-shape model cut to `--layers` (made once under bench/out/), runs
in the same session:
  1. `--no-stream` (every weight resident, the reference),
  2. the pipeline with a cache that holds every expert,
  3. the pipeline with a small cache (`--small-cache-mb`),
  4. (3) inside a memory cgroup smaller than the model file (`--mem-limit-mb`;
     cgroup v1 at /sys/fs/cgroup/memory or v2; skipped with a reason when not
     permitted), with the page cache dropped first;
  5. (3) with next-layer prefetch (the router's guess);
  6. (3) routed by the phone's Qwen trace, without and with prefetch: under a
     replay the guess is the trace's own next routing, a perfect predictor —
     the ceiling of what prefetch can give this pipeline on this disk.
For each: decode tok/s (steady window), hit %, stall share of wall, overlap
efficiency (wall / max(compute, io) per token, median), messaging + bookkeeping
share, messages to the reader per token, prefetch accuracy, and the reader's
bytes per second of lane time. Figures, not verdicts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)
from bench_reads import expert_bandwidth  # noqa: E402
from bench_vs_llama import TRACES  # noqa: E402

from moe_pipe.shared.analysis.cgroup import MemoryCgroup, MemoryLimitError, drop_page_cache  # noqa: E402

PROMPT = "The old mill by the river had stood there for a hundred years, and every spring"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("-n", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--io-threads", type=int, default=1)
    p.add_argument("--small-cache-mb", type=float, default=600)
    p.add_argument("--mem-limit-mb", type=int, default=2048)
    return p.parse_args(argv)


def ensure_model(args) -> Path:
    return shape_model(args.model, args.layers)


def run(cmd: list[str], cgroup=None) -> dict:
    if cgroup is not None:  # join the cgroup, then exec: the whole process tree is limited
        cmd = cgroup.wrap(cmd)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def csv_figures(path: Path) -> dict:
    from moe_pipe.shared.speed import steady_start
    from moe_pipe.shared.telemetry import read_csv

    _, recs = read_csv(path)
    steady = recs[steady_start(len(recs)) :]
    wall = sum(r.wall_ms for r in steady)
    eff = [r.wall_ms / max(r.compute_ms, r.io_ms, 1e-9) for r in steady]
    decode = recs[1:]  # the prefill's reads overlap a batched matmul: decode is the streaming case
    io = sum(r.io_ms for r in decode)
    return {
        "tok_s": 1000 * len(steady) / wall if wall else 0.0,
        "hit_pct": recs[-1].cache_hit_pct,
        "stall_share": sum(r.stall_ms for r in steady) / wall if wall else 0.0,
        "overlap_eff": statistics.median(eff) if eff else 0.0,
        "msg_share": sum(r.mgmt_ms + r.wire_ms for r in steady) / wall if wall else 0.0,
        "lane_gb_s": sum(r.read_bytes for r in decode) / (io / 1e3) / 1e9 if io else 0.0,
        "mib_per_tok": statistics.mean(r.read_bytes for r in steady) / 2**20 if steady else 0.0,
        "msgs_per_tok": statistics.mean(r.messages for r in steady) if steady else 0.0,
        "prefetch_acc": (sum(r.prefetch_used for r in decode) / issued) if (issued := sum(r.prefetch_issued for r in decode)) else None,
    }


def warm_all_experts(model: Path, args, all_mb: float) -> float:
    """Decode tok/s of a second generation in one pipeline whose cache holds every
    expert and was filled by a first one: the pipeline's cost with no flash I/O."""
    from dataclasses import asdict

    from moe_pipe.procs.pipeline import start_pipeline
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(model) as mf:
        prompt = Tokenizer.from_gguf(mf.gguf).encode(PROMPT)
    cfg = load_config(
        None, {"model.path": str(model), "cache.cache_mb": all_mb, "compute.threads": args.threads, "io.io_threads": args.io_threads}
    )
    with start_pipeline(cfg, model) as pipe:
        for _ in range(3):  # fill the cache with what these prompts route to
            pipe.generate(prompt, asdict(SamplingParams()), args.n, ignore_eos=True)
        done = pipe.generate(prompt, asdict(SamplingParams()), args.n, ignore_eos=True)
    return float(done.timings["predicted_tok_s"]), float(done.timings["final_hit_pct"])


def main(argv=None) -> int:
    args = parse(argv)
    model = ensure_model(args)
    base = [
        sys.executable,
        "-m",
        "moe_pipe.cli.main",
        "run",
        str(model),
        "-p",
        PROMPT,
        "-n",
        str(args.n),
        "-t",
        str(args.threads),
        "--output-format",
        "json",
        "--io-threads",
        str(args.io_threads),
        "--ignore-eos",
    ]
    from moe_pipe.shared.gguf.model_file import open_model

    with open_model(model) as mf:
        all_mb = mf.spec.n_layer * mf.spec.n_expert * mf.layout.slab_bytes / 2**20 + 1
        size_mb = mf.gguf.file_bytes / 2**20
    print(
        f"model {model.name}: {size_mb:,.0f} MiB; all experts {all_mb:,.0f} MiB; n={args.n}, threads {args.threads}, io lanes {args.io_threads}"
    )
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    ref = run(base + ["--no-stream"])
    rows.append(("--no-stream (resident)", ref["timings"]["predicted_tok_s"], None, ref["tokens"]))
    small = ["--cache-mb", str(args.small_cache_mb)]
    replay = ["--route-replay", str(TRACES / "qwen.route.csv")]
    for label, extra, cg in [
        ("pipeline, cache = all experts", ["--cache-mb", str(all_mb)], None),
        (f"pipeline, cache {args.small_cache_mb:.0f} MiB", small, None),
        ("limited", small, "cgroup"),
        (f"pipeline, cache {args.small_cache_mb:.0f} MiB, prefetch", small + ["--prefetch", "next-layer"], None),
        (f"  trace-routed, cache {args.small_cache_mb:.0f} MiB", small + replay, None),
        (
            f"  trace-routed, cache {args.small_cache_mb:.0f} MiB, prefetch (perfect guess)",
            small + replay + ["--prefetch", "next-layer"],
            None,
        ),
    ]:
        csv = tmp / f"{len(rows)}.csv"
        cgroup = None
        if cg:
            try:
                cgroup = MemoryCgroup.create(args.mem_limit_mb)
            except MemoryLimitError as exc:
                print(f"(memory-limited run skipped: {exc})")
                continue
            label = f"pipeline, cache {args.small_cache_mb:.0f} MiB, cgroup v{cgroup.version} {args.mem_limit_mb} MiB" + (
                "" if drop_page_cache() else " (page cache not dropped)"
            )
        try:
            out = run(base + extra + ["--csv", str(csv)], cgroup)
        finally:
            if cgroup is not None:
                cgroup.remove()
        rows.append((label, out["timings"]["predicted_tok_s"], csv_figures(csv), out["tokens"]))
    warm_tok_s, warm_hit = warm_all_experts(model, args, all_mb)
    direct_gb_s = expert_bandwidth(model)
    ref_tok_s = rows[0][1]
    print(
        f"\n{'run':<72}{'tok/s':>7}{'×ref':>6}{'hit%':>7}{'stall':>7}{'wall/max(c,io)':>15}{'msg+mgmt':>9}"
        f"{'msgs':>6}{'guess ok':>9}{'MiB/tok':>9}{'lane GB/s':>10}  same tokens"
    )
    for label, tok_s, f, tokens in rows:
        same = "yes" if tokens == rows[0][3] else ("NO" if "trace-routed" not in label else "(other routing)")
        if f is None:
            print(f"{label:<72}{tok_s:>7.2f}{1.0:>6.2f}{'':>7}{'':>7}{'':>15}{'':>9}{'':>6}{'':>9}{'':>9}{'':>10}  (reference)")
            continue
        acc = f"{f['prefetch_acc'] * 100:.0f} %" if f["prefetch_acc"] is not None else ""
        print(
            f"{label:<72}{tok_s:>7.2f}{tok_s / ref_tok_s:>6.2f}{f['hit_pct']:>7.1f}{f['stall_share'] * 100:>6.1f}%"
            f"{f['overlap_eff']:>15.2f}{f['msg_share'] * 100:>8.1f}%{f['msgs_per_tok']:>6.1f}{acc:>9}{f['mib_per_tok']:>9.1f}"
            f"{f['lane_gb_s']:>10.2f}  {same}"
        )
    print(
        f"\npipeline, cache = all experts, warm (4th generation in one pipeline, hit {warm_hit:.1f} %): "
        f"{warm_tok_s:.2f} tok/s = {warm_tok_s / ref_tok_s:.2f} × --no-stream"
    )
    lanes = [f["lane_gb_s"] for _l, _t, f, _k in rows if f and f["lane_gb_s"]]
    if lanes and direct_gb_s:
        print(
            f"reader lane {min(lanes):.2f}–{max(lanes):.2f} GB/s while decoding = {min(lanes) / direct_gb_s:.2f}–"
            f"{max(lanes) / direct_gb_s:.2f} × this disk's O_DIRECT at the expert size measured now ({direct_gb_s:.2f} GB/s, one lane)"
        )
    print("tok/s from each run's own timings (all decode tokens); the other columns from its per-token CSV (steady window).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
