"""`moe-pipe status [--json]`: the running service's processes (state, pid,
uptime, restarts, last exit, RSS), budget and hit rate."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the control reply as JSON")


def run(args: argparse.Namespace) -> int:
    from moe_pipe.shared.serve import service

    reply = service.control(service.find_service(), "status")
    if args.json:
        print(json.dumps(reply.to_dict(), indent=1))
        return 0 if reply.ok else 1
    if not reply.ok:
        print(f"moe-pipe: status failed ({reply.code}): {reply.message}")
        return 1
    print(format_status(reply.data))
    return 0


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def format_status(d: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    hit = "-" if d.get("hit_pct") is None else f"{d['hit_pct']:.1f} %"
    head = (
        f"moe-pipe service pid {d['pid']}, up {d['uptime_s']:.0f} s — {d['model_name']} ({d['model']})\n"
        f"API {d.get('url') or '(starting)'}; expert cache {_mib(d['budget_bytes'])} = {d['slots']} slabs "
        f"({d['budget']}); {d['tokens']} tokens, hit {hit}; logs {d['runtime_dir']}/moe-pipe.log"
    )
    table = Table(box=None, pad_edge=False)
    for col in ("process", "state", "pid", "uptime", "restarts", "rss", "last exit"):
        table.add_column(col)
    for p in d["processes"]:
        last = p["last_error"] or p["last_exit"] or ""
        table.add_row(
            p["name"],
            p["state"],
            str(p["pid"] or "-"),
            "-" if p["uptime_s"] is None else f"{p['uptime_s']:.0f} s",
            str(p["restarts"]),
            _mib(p["rss_bytes"]),
            last,
        )
    console = Console(width=140, record=True, file=open("/dev/null", "w"))
    console.print(head)
    console.print(table)
    return console.export_text().rstrip()
