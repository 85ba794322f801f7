"""`moe-pipe replay TRACE|NAME --budget-mb N [N ...]`: a route trace (a file, or a shipped one by name) through the cache policies."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace", help="route trace (route_trace v1 CSV, e.g. from --route-trace), or a shipped one by name: qwen, gptoss (the phone traces)"
    )
    p.add_argument("--budget-mb", type=float, nargs="+", required=True, metavar="N", help="cache budgets in MiB to replay at")
    p.add_argument("--policy", nargs="+", default=["all"], metavar="NAME", help="policies to replay (default: all, belady included)")
    p.add_argument(
        "--accounting",
        choices=("slabs", "bytes"),
        default="slabs",
        help="slabs: equal slabs of the largest expert, as the engine; bytes: each expert its own size",
    )
    p.add_argument(
        "--drop-cold-experts",
        type=float,
        default=0.0,
        metavar="F",
        help="LOSSY lever (changes outputs in a real run): skip a decode miss whose router weight is below "
        "F x an even share, as compute.drop_cold_experts (0 to 1); 0 = exact (default)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def shipped_traces() -> dict[str, Path]:
    """The route traces shipped with moe-pipe (shared/data/traces/README.md), by short name: qwen.route.csv is "qwen"."""
    from ..shared.analysis.fit import TRACE_DIR

    return {f.name.removesuffix(".route.csv"): f for f in sorted(TRACE_DIR.glob("*.route.csv"))}


def trace_path(arg: str) -> Path:
    """A trace file: a path that exists, else a shipped trace's name; neither is a one-line error listing the names."""
    from ..shared.errors import UserError

    if Path(arg).exists():
        return Path(arg)
    shipped = shipped_traces()
    if arg in shipped:
        return shipped[arg]
    import difflib

    near = difflib.get_close_matches(arg, shipped, n=1)
    hint = f' (did you mean "{near[0]}"?)' if near else ""
    raise UserError(f"{arg}: no such file, nor a shipped trace's name{hint}; shipped: {', '.join(shipped)}")


def print_table(results, default_policy: str, out=None) -> None:
    """One row per (budget, policy), a blank line between budgets; the count is
    slabs, or average-size experts when the budget is counted in bytes."""
    out = out or sys.stdout  # looked up now: a default bound at import would outlive a redirect
    count = "slabs" if all(r.accounting == "slabs" for r in results) else "≈ experts"
    header = ("budget MiB", count, "policy", "hit % cum", "hit % decode", "read MiB")
    rows = [
        (
            f"{r.budget_mb:g}",
            f"{r.n_slabs}",
            r.policy + (" *" if r.policy == default_policy else ""),
            f"{r.hit_pct_cum:.2f}",
            f"{r.hit_pct_decode:.2f}",
            f"{r.read_mib:,.1f}",
        )
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    align = ("r", "r", "l", "r", "r", "r")

    def line(cells):
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align)).rstrip()

    print(line(header), file=out)
    last_budget = None
    for r, row in zip(results, rows):
        if last_budget is not None and r.budget_mb != last_budget:
            print(file=out)
        last_budget = r.budget_mb
        print(line(row), file=out)


def run(args: argparse.Namespace) -> int:
    from ..shared.analysis.replay import Replayer, policy_names, slab_bytes
    from ..shared.config import Config, apply_overrides
    from ..shared.experts.policies import DEFAULT_POLICY
    from ..shared.model.trace import read_trace

    # the lever's range is the config key's, checked by its schema (one line, exit 2)
    drop_cold = apply_overrides(Config(), {"compute.drop_cold_experts": args.drop_cold_experts}).compute.drop_cold_experts
    names = policy_names(args.policy)  # before reading: a typo fails fast
    trace = read_trace(trace_path(args.trace))
    rp = Replayer(trace, args.accounting)
    for b in args.budget_mb:
        rp.capacity(b)  # every budget checked before the first replay
    results = [rp.run(b, name, drop_cold) for b in args.budget_mb for name in names]
    if args.json:
        print(json.dumps({"default_policy": DEFAULT_POLICY, "rows": [r.row() for r in results]}))
        return 0
    h = trace.header
    unit = (
        f"slabs of {slab_bytes(trace) / (1 << 20):.2f} MiB (the largest expert, page-rounded)"
        if args.accounting == "slabs"
        else "bytes (each expert its own size)"
    )
    print(
        f"{args.trace}: {h.arch}, {h.n_layer} layers, top-{h.n_expert_used} of {h.n_expert} experts, "
        f"{len(trace):,} rows; budget counted in {unit}"
    )
    print_table(results, DEFAULT_POLICY)
    print(
        ("* the default policy. " if DEFAULT_POLICY in names else "")
        + "hit % decode: decode lookups only; read MiB: every miss at its layer's size"
    )
    return 0
