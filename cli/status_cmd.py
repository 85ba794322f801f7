"""`moe-pipe status [--json] [--name NAME | --port P]`: the running services'
processes (state, pid, uptime, restarts, last exit, RSS), budget and hit rate.
Every service without --name/--port; exit 1 if one is degraded (a process
FATAL) or does not answer; none running is no error: one plain line, exit 3
(LSB's and systemctl's "not running"), so a script can tell it from both."""

from __future__ import annotations

import argparse
import json
import sys

NOT_RUNNING = 3  # exit code: LSB init scripts' and `systemctl status`'s "program is not running"


def add_selector_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """--name and --port: which running service a command means (status,
    down, tail, chat); needed only when several run."""
    p.add_argument("--name", default=None, metavar="NAME", help=f"{what}: the one `up` named so (`up --name`, or its default)")
    p.add_argument("--port", type=int, default=None, metavar="P", help=f"{what}: the one whose HTTP API is on port P")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    add_selector_arguments(p, "show only this service")


def run(args: argparse.Namespace) -> int:
    from ..shared.serve import service

    try:
        if args.name is not None or args.port is not None:
            infos = [service.find_service(name=args.name, port=args.port)]
        else:
            infos = service.live_services()
            if not infos:
                raise service.NothingRunning("no moe-pipe service is running (start one with `moe-pipe up CONFIG`)")
    except service.NothingRunning as exc:
        # still JSON for scripts; the exit code says what the plain line says
        print(json.dumps({"services": []}) if args.json else f"moe-pipe: {exc}")
        return NOT_RUNNING
    code, shown = 0, []
    for info in infos:
        try:
            reply = service.control(info, "status")
        except service.NoService as exc:  # one that does not answer: say so, show the others
            print(f"moe-pipe: {info.name or info.pid}: {exc}", file=sys.stderr)
            code = 1
            continue
        data = reply.to_dict()
        data.setdefault("name", info.name)
        if not reply.ok:
            print(f"moe-pipe: {info.name or info.pid}: status failed ({reply.code}): {reply.message}", file=sys.stderr)
            code = 1
        elif data.get("health") == "degraded":
            code = 1
        shown.append(data)
    if args.json:
        # One service: its object (as always); none or several answering: {"services": [...]}.
        print(json.dumps(shown[0] if len(infos) == 1 and shown else {"services": shown}, indent=1))
    else:
        print("\n\n".join(format_status(d) for d in shown if d["ok"]))
    return code


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def format_status(d: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    hit = "-" if d.get("hit_pct") is None else f"{d['hit_pct']:.1f} %"
    fatal = [p["name"] for p in d["processes"] if p["state"] == "FATAL"]
    health = f"DEGRADED: {', '.join(fatal)} FATAL (its last error below)" if fatal else "ok"
    api = d.get("url") or ("down" if "gateway" in fatal else "(starting)")
    head = (
        f"moe-pipe service {d.get('name') or '?'!r} pid {d['pid']}, up {d['uptime_s']:.0f} s, {health} — {d['model_name']} ({d['model']})\n"
        f"API {api}; expert cache {_mib(d['budget_bytes'])} = {d['slabs']} slabs "
        f"({d['budget']}); {d['tokens']} tokens, hit {hit}; logs {d['runtime_dir']}/moe-pipe.log"
    )
    if d.get("warming"):  # the reader's warm start from the last run's hot set: while it runs, and how it ended
        head += f"\n{d['warming']['text']}"
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
