"""`moe-pipe bench MODEL|CONFIG`: the generation protocol through moe-pipe
(and llama.cpp with --vs), cold, optionally under a memory limit; CSVs, a
summary table (text and markdown) and plots in --out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..shared.config_flags import add_override_arguments

    p.add_argument("model", nargs="?", default=None, help="a GGUF file, a TOML config or a catalog name; default: the embedded tiny model")
    p.add_argument("-n", type=int, default=64, help="decode tokens per run (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="runs per engine; medians are reported (default 3)")
    p.add_argument("-p", "--prompt", default=None, help="the prompt every run decodes after (default: the benchmark's fixed prompt)")
    p.add_argument(
        "--mem-limit-mb",
        type=float,
        default=None,
        help="run every engine inside a memory cgroup with this limit (page cache counts): a small device",
    )
    p.add_argument(
        "--vs",
        choices=("llama.cpp",),
        action="append",
        default=[],
        help="also run the same file through llama.cpp (llama-cpp-python): mmap loading without weight "
        "repacking at the machine's readahead and at 128 KiB, and its default loading once",
    )
    p.add_argument("--out", default="bench-out", help="folder for the CSVs, summary.{json,md} and plots (default bench-out)")
    p.add_argument("--cooldown", type=float, default=3.0, help="seconds between runs (default 3)")
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=900.0,
        help="stop a llama.cpp run after this many seconds and record what it did (default 900)",
    )
    add_override_arguments(p, tables=("cache", "io", "compute"))


def run(args: argparse.Namespace) -> int:
    from ..shared.analysis.benchmark import BenchPlan, run_bench, summary_markdown
    from ..shared.config_flags import overrides_from_args
    from ..shared.errors import UserError
    from ..shared.hub.resolve import model_file
    from .run_cmd import load_run_config

    if args.n < 1 or args.repeat < 1:
        raise UserError("-n and --repeat must be at least 1")
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt is empty")
    if args.mem_limit_mb is not None and args.mem_limit_mb <= 0:
        raise UserError(f"--mem-limit-mb {args.mem_limit_mb:g}: must be positive")
    cfg = load_run_config(args)
    overrides = overrides_from_args(args)
    replay = overrides.pop("compute.route_replay", None) or cfg.compute.route_replay
    threads = overrides.pop("compute.threads", None) or cfg.compute.threads or 0
    # With a config, `run` gets the config and every override (model.path too); with a model file, the file.
    run_args = tuple(a for k, v in overrides.items() if cfg.source or k != "model.path" for a in ("--set", f"{k}={_toml(v)}"))
    plan = BenchPlan(
        model_file(cfg),
        run_target=cfg.source or "",
        n=args.n,
        repeat=args.repeat,
        threads=int(threads),
        mem_limit_mb=args.mem_limit_mb,
        route_replay=str(Path(replay).resolve()) if replay else None,
        vs=tuple(args.vs),
        out=Path(args.out),
        cooldown_s=args.cooldown,
        peer_timeout_s=args.peer_timeout,
        run_args=run_args,
        **({"prompt": args.prompt} if args.prompt is not None else {}),
    )
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    from ..shared.analysis.forecast import forecast
    from ..shared.gguf.model_file import open_model
    from ..shared.progress import StatusLine

    with StatusLine() as status, open_model(plan.model) as mf:  # live: the forecast takes seconds
        status.update("forecasting (moe-pipe doctor) ...")
        fc = forecast(mf, cfg, mem_limit_mb=args.mem_limit_mb, seconds=3.0, on_stage=lambda t: status.update(f"forecasting: {t}"))
    say(
        f"    forecast: {fc['tok_s']} tok/s ({fc['bottleneck']}-bound), hit {fc['hit_pct']} %"
        if fc["fits"]
        else f"    forecast: does not fit ({fc['refusal']})"
    )
    summary = run_bench(plan, say, forecast=fc)
    print(summary_markdown(summary))
    print(
        f"written to {plan.out}/: summary.md, summary.json, per-run CSVs"
        + (", per-token.png, hit-rate.png" if (plan.out / "per-token.png").exists() else " (no plots: pip install matplotlib)")
    )
    return 0


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
