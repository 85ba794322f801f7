"""`moe-pipe tail [--csv] [--wait S]`: watch the running service's tokens live.

A tail is one SUB socket on the telemetry process's PUB ("telemetry_pub"):
attaching and detaching never touch the service, and any number of tails can
watch at once. PUB/SUB has no history, so a tail sees the records published
after it connected, not the ones before.

Three outputs, picked by where stdout goes:

    --csv          header + one row per token, flushed per line (for pipes)
    a terminal     a live table: recent tokens, a tok/s sparkline, the summary so far,
                   and while a prompt is computed its progress ("prompt 1,536 / 3,664 tokens · 41 s left");
                   with several slots (gateway.parallel), a line a slot instead
    otherwise      one plain text line per token, the summary at the end of a run; a
                   prompt's progress every PROMPT_LINE_S while it runs, and once when it is done;
                   with several slots, a line as one changes state, and at most every PROMPT_LINE_S between

While the reader warms the cache from the last run's hot set, the table and
the text output show "warming 812/3,071 experts" (read from warm.json in the
runtime folder every WARM_POLL_S: no message to the service), and the line
that ends it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..shared.experts.hotset import WarmProgress
    from ..shared.wire.messages import PromptProgress, RunInfo, RunSummary, SlotStates

MIB = 1 << 20
SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_TOKENS = 60  # tokens in the sparkline: a minute or so at the speeds we see
TABLE_ROWS = 15  # recent tokens in the live table
# How long a recv waits before we look whether the service is still there:
# the service going away sends nothing (kill -9 cannot), so we poll for it.
LIVENESS_POLL_MS = 500
# The live table redraws at most this often; tokens can come faster than a
# terminal is worth repainting.
REDRAW_INTERVAL_S = 0.1
WAITING_NOTICE = "waiting for a moe-pipe service (start one with `moe-pipe up CONFIG`)..."
# The text output's prompt progress: a line this often while a prompt runs (compute sends
# four a second, for live views; a log needs far fewer), and always the one that ends it.
PROMPT_LINE_S = 5.0
# The service's status, for the run's budget and load time: asked once at attach, after the
# subscription (records queue meanwhile); a supervisor answers in milliseconds.
STATUS_TIMEOUT_MS = 1000
WARM_POLL_S = 0.5  # how often the warm start's progress file is looked at


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--csv", action="store_true", help="print CSV rows (the per-token schema) instead of a table")
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help="give up after S seconds if no service is running (default: wait until one starts)",
    )
    from .status_cmd import add_selector_arguments

    add_selector_arguments(p, "the service to watch")


# ------------------------------------------------------------------ formatting


def tok_per_s(wall_ms: float, tokens: int = 1) -> float:
    """A record's rate: its tokens (a verify pass's 1 + kept drafts) over its wall time."""
    return 1000.0 * tokens / wall_ms if wall_ms > 0 else 0.0


def sparkline(values, width: int = SPARK_TOKENS) -> str:
    """The last `width` values as unicode blocks, scaled from 0 to their max
    (from 0, not from the min, so steady noise does not look like a cliff).
    Block k of 8 stands for (k/8, (k+1)/8] of the max: half the max is ▄."""
    recent = list(values)[-width:]
    top = max(recent, default=0.0)
    if top <= 0:
        return SPARK_BLOCKS[0] * len(recent)
    n = len(SPARK_BLOCKS)
    return "".join(SPARK_BLOCKS[min(n - 1, max(0, math.ceil(v / top * n) - 1))] for v in recent)


def format_line(rec) -> str:
    """One token as plain text (the non-terminal, non-CSV output)."""
    return (
        f"step {rec.step:>5}  {tok_per_s(rec.wall_ms, 1 + rec.accepted):7.2f} tok/s  wall {rec.wall_ms:8.1f} ms  "
        f"compute {rec.compute_ms:8.1f} ms  io {rec.io_ms:8.1f} ms  stall {rec.stall_ms:7.1f} ms  "
        f"hit {rec.cache_hit_pct:5.1f} %  read {rec.read_bytes / MIB:8.2f} MiB  majflt {rec.majflt}"
        + (f"  drafts {rec.accepted}/{rec.drafted} kept" if rec.drafted else "")
    )


def format_prompt(p) -> str:
    """A prompt's progress (a PromptProgress) as one line: "prompt 1,536 / 3,664 tokens · 41 s left"."""
    from ..shared.progress import prompt_progress_text

    return prompt_progress_text(p.total, p.cache, p.processed, p.time_ms)


def format_slots(states) -> list[str]:
    """Compute's slots (a SlotStates), a line each: "slot 1 prompt 512 / 3,664 tokens", then
    how full their KV pool is: "KV pool 4,352 / 14,336 positions"."""
    from ..shared.progress import pool_text, slot_text

    return [slot_text(row) for row in states.rows()] + ([pool_text(states.pool_held, states.pool)] if states.pool else [])


def csv_header() -> str:
    from ..shared.telemetry import CSV_COLUMNS

    return ",".join(CSV_COLUMNS)


def csv_row(rec) -> str:
    """The schema's columns of one record, formatted as the run CSV writes them
    (floats to 3 decimals: ms to the microsecond), so the two compare as text."""
    from ..shared.telemetry import CSV_COLUMNS

    values = (getattr(rec, c) for c in CSV_COLUMNS)
    return ",".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in values)


# ----------------------------------------------------------------------- state


@dataclass
class RunSoFar:
    """What a tail has seen of the current run. A RunInfo starts a new run
    (as it does in the telemetry process's recorder)."""

    info: RunInfo | None = None
    # the last rows for the table; the summary keeps a Tally: a tail may watch a service for hours
    records: deque = field(default_factory=lambda: deque(maxlen=TABLE_ROWS))
    tally: Any = field(default_factory=lambda: _tally())  # analysis.benchmark.Tally, imported late
    tok_s: deque = field(default_factory=lambda: deque(maxlen=SPARK_TOKENS))
    final: RunSummary | None = None  # once the run ended
    prompt: PromptProgress | None = None  # the prompt being computed, until its first token
    slots: SlotStates | None = None  # what compute's slots are doing (gateway.parallel above 1: none at 1)
    warming: WarmProgress | None = None  # the reader's warm start (the last progress seen)
    # where the RunInfo comes from when its message went out before this tail subscribed: asked
    # once, when a summary is first shown (a CSV or a log of lines never waits for it)
    fetch_info: Callable[[], RunInfo | None] | None = None

    def start_run(self, info) -> None:
        self.info, self.final, self.tally, self.prompt = info, None, _tally(), None
        self.records.clear()
        self.tok_s.clear()

    def add(self, rec) -> None:
        self.records.append(rec)
        self.tally.add(rec)
        self.tok_s.append(tok_per_s(rec.wall_ms, 1 + rec.accepted))
        self.prompt = None  # its prompt is done: this is its first token (or a later one)

    def summary(self):
        """The run summary over the records seen (the service's own at the end)."""
        if self.final is not None:
            return self.final
        if self.info is None and self.fetch_info is not None:
            self.info, self.fetch_info = self.fetch_info(), None
        load_s = self.info.load_seconds if self.info is not None else 0.0
        budget = self.info.budget_bytes if self.info is not None else 0
        return self.tally.summary(load_s, budget)


def _tally():
    from ..shared.telemetry import Tally

    return Tally()


# --------------------------------------------------------------------- outputs


class CsvOutput:
    def __init__(self) -> None:
        print(csv_header(), flush=True)

    def on_token(self, run: RunSoFar, rec) -> None:
        print(csv_row(rec), flush=True)

    def on_run_event(self, run: RunSoFar) -> None:
        pass  # the CSV is tokens only

    def on_prompt(self, run: RunSoFar, p) -> None:
        pass

    def on_slots(self, run: RunSoFar) -> None:
        pass

    def on_warming(self, run: RunSoFar) -> None:
        pass

    def idle(self, run: RunSoFar) -> None:
        pass

    def close(self) -> None:
        pass


class TextOutput:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.prompt_line_at = self.warm_line_at = self.slots_line_at = -math.inf
        self.slots_shown: list[str] | None = None  # the slots' last line: the same one is never printed twice
        self.slots_states: list[str] | None = None  # and their states in it

    def on_token(self, run: RunSoFar, rec) -> None:
        print(format_line(rec), flush=True)

    def on_prompt(self, run: RunSoFar, p) -> None:
        """While a prompt runs, a line now and then (not the opening one: a short
        prompt is over before it says anything); always the line that ends it."""
        now = self.clock()
        if p.processed == p.cache and p.processed < p.total:
            self.prompt_line_at = now  # the prompt starts: its first line PROMPT_LINE_S from now
            return
        if p.processed >= p.total or now - self.prompt_line_at >= PROMPT_LINE_S:
            self.prompt_line_at = now
            print(format_prompt(p), flush=True)

    def on_slots(self, run: RunSoFar) -> None:
        """The slots in one line: at once when a slot changes state (a request comes,
        its prompt is done, it ends: a few lines a request, beside its token lines),
        else at most every PROMPT_LINE_S while their figures move."""
        assert run.slots is not None
        lines, now = format_slots(run.slots), self.clock()
        states = [str(r["state"]) for r in run.slots.rows()]
        if lines == self.slots_shown or (states == self.slots_states and now - self.slots_line_at < PROMPT_LINE_S):
            return
        self.slots_line_at, self.slots_shown, self.slots_states = now, lines, states
        print("slots: " + " · ".join(lines), flush=True)

    def on_warming(self, run: RunSoFar) -> None:
        """While the cache warms, a line every PROMPT_LINE_S; always the line that ends it."""
        w, now = run.warming, self.clock()
        if w is not None and (w.state != "warming" or now - self.warm_line_at >= PROMPT_LINE_S):
            self.warm_line_at = now
            print(w.text(), flush=True)

    def on_run_event(self, run: RunSoFar) -> None:
        if run.final is not None:
            from ..shared.telemetry import format_summary

            print(format_summary(run.final), flush=True)

    def idle(self, run: RunSoFar) -> None:
        pass

    def close(self) -> None:
        pass


class LiveOutput:
    """A rich Live view, redrawn from the main thread only (auto refresh off:
    its refresh thread would read the run while we append to it)."""

    def __init__(self, service_desc: str) -> None:
        from rich.live import Live

        self.service_desc = service_desc
        self.live = Live(self._render(RunSoFar()), auto_refresh=False, transient=False)
        self.live.start()
        self.drawn_at = 0.0
        self.dirty = False

    def on_token(self, run: RunSoFar, rec) -> None:
        self.dirty = True
        if time.monotonic() - self.drawn_at >= REDRAW_INTERVAL_S:
            self._draw(run)

    def on_run_event(self, run: RunSoFar) -> None:
        self._draw(run)

    def on_prompt(self, run: RunSoFar, p) -> None:
        self._draw(run)  # compute sends at most four a second: every one is drawn

    def on_slots(self, run: RunSoFar) -> None:
        self._draw(run)  # at most four a second too, beside a state change

    def on_warming(self, run: RunSoFar) -> None:
        self._draw(run)

    def idle(self, run: RunSoFar) -> None:
        if self.dirty:  # the last tokens of a burst that came inside one redraw interval
            self._draw(run)

    def close(self) -> None:
        self.live.stop()

    def _draw(self, run: RunSoFar) -> None:
        self.live.update(self._render(run), refresh=True)
        self.drawn_at, self.dirty = time.monotonic(), False

    def _render(self, run: RunSoFar):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        from ..shared.telemetry import format_summary

        table = Table(title=self.service_desc, title_justify="left", expand=False)
        for name in ("step", "tok/s", "wall ms", "compute ms", "io ms", "stall ms", "hit %", "MiB read", "majflt"):
            table.add_column(name, justify="right")
        for r in run.records:
            table.add_row(
                str(r.step),
                f"{tok_per_s(r.wall_ms, 1 + r.accepted):.2f}",
                f"{r.wall_ms:.1f}",
                f"{r.compute_ms:.1f}",
                f"{r.io_ms:.1f}",
                f"{r.stall_ms:.1f}",
                f"{r.cache_hit_pct:.1f}",
                f"{r.read_bytes / MIB:.2f}",
                str(r.majflt),
            )
        if run.slots is not None:  # several slots: a line each says every prompt's progress
            prompt = [Text(line, style="dim" if line.endswith(" idle") else "bold") for line in format_slots(run.slots)]
        else:
            prompt = [Text(format_prompt(run.prompt), style="bold")] if run.prompt is not None else []
        if run.warming is not None:
            prompt.insert(0, Text(run.warming.text(), style="bold" if run.warming.state == "warming" else "dim"))
        if not run.records:
            return Group(table, *prompt, Text("waiting for tokens (send the service a request)...", style="dim"))
        spark = Text(f"tok/s {sparkline(run.tok_s)}  last {run.tok_s[-1]:.2f}, max {max(run.tok_s):.2f}")
        heading = "run finished" if run.final is not None else "run so far"
        return Group(table, *prompt, spark, Text(f"{heading}:", style="bold"), Text(format_summary(run.summary())))


def choose_output(args, service_desc: str):
    if args.csv:
        return CsvOutput()
    if sys.stdout.isatty():
        return LiveOutput(service_desc)
    return TextOutput()


# ------------------------------------------------------------------------ run


def find_or_wait_for_service(wait_s: float | None, name: str | None = None, port: int | None = None):
    """The running service (by name or port, or the only one); if none runs
    yet, say so once and wait for one."""
    from ..shared.serve.service import find_service, live_services, select_services, wait_for_service

    if select_services(live_services(), name, port):
        return find_service(name=name, port=port)  # the one (or a one-line error naming those that run)
    print(WAITING_NOTICE, file=sys.stderr, flush=True)
    return wait_for_service(wait_s, name=name, port=port)


def service_gone(info) -> bool:
    """The supervisor exited. A removed runtime dir counts as gone on its own:
    with no owner file, `is_live` falls back to "does the pid run", which a
    supervisor that has cleaned up but not yet exited still passes."""
    from ..shared.wire import ipc

    path = Path(info.runtime_dir)
    return not path.is_dir() or not ipc.RuntimeDir(path, info.pid).is_live()


def service_run_info(info) -> RunInfo | None:
    """The run's budget and load time from the service's status: its RunInfo went out
    once, when it started, before this tail could subscribe (PUB/SUB keeps no history),
    and without it the summary read `budget 0.0 MiB` and `load 0.00 s`. None when the
    service does not answer (the summary then says so)."""
    from ..shared.serve import service
    from ..shared.wire import messages as m

    try:
        reply = service.control(info, "status", timeout_ms=STATUS_TIMEOUT_MS)
    except service.NoService:
        return None
    data = reply.data if reply.ok else {}
    if "budget_bytes" not in data or "load_seconds" not in data:
        return None
    return m.RunInfo("", 0.0, {}, {}, int(data["budget_bytes"] or 0), float(data["load_seconds"] or 0.0))


def watch_warming(run: RunSoFar, runtime_dir: str) -> bool:
    """Read the warm start's progress; True when it changed (a line to show)."""
    from ..shared.experts.hotset import read_warm_progress

    w = read_warm_progress(runtime_dir)
    if w is None or (run.warming is not None and (w.state, w.done, w.total) == (run.warming.state, run.warming.done, run.warming.total)):
        return False
    run.warming = w
    return True


def follow(sock, info, output) -> None:
    """Show records until the service goes away (returns) or we are stopped."""
    from ..shared.wire import ipc
    from ..shared.wire import messages as m

    run = RunSoFar(fetch_info=lambda: service_run_info(info))
    warm_at = -math.inf
    while True:
        if time.monotonic() - warm_at >= WARM_POLL_S:
            warm_at = time.monotonic()
            if watch_warming(run, info.runtime_dir):
                output.on_warming(run)
        try:
            msg = ipc.recv(sock, LIVENESS_POLL_MS, expect=(m.TokenRecord, m.PromptProgress, m.SlotStates, m.RunInfo, m.RunSummary))
        except m.ProtocolError:
            continue  # a frame from a newer or broken peer: skip it, keep watching
        if msg is None:
            if service_gone(info):
                return
            output.idle(run)
        elif isinstance(msg, m.TokenRecord):
            run.add(msg)
            output.on_token(run, msg)
        elif isinstance(msg, m.PromptProgress):
            run.prompt = msg
            output.on_prompt(run, msg)
        elif isinstance(msg, m.SlotStates):
            run.slots = msg
            output.on_slots(run)
        elif isinstance(msg, m.RunInfo):
            run.start_run(msg)
            output.on_run_event(run)
        else:
            run.final = msg
            output.on_run_event(run)


def detach_from_closed_pipe() -> None:
    """The reader of our stdout went away (`| head`): point stdout at /dev/null
    so the interpreter's final flush does not print a BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run(args: argparse.Namespace) -> int:
    from ..shared.wire import ipc

    try:
        info = find_or_wait_for_service(args.wait, args.name, args.port)
        service_desc = f"moe-pipe service {info.name or '?'!r} pid {info.pid}: {info.model_name or info.model}"
        with ipc.context() as ctx:
            sock = ipc.connect(ctx, info.endpoints, "telemetry_pub")
            output = None
            try:
                output = choose_output(args, service_desc)
                follow(sock, info, output)
            finally:
                if output is not None:
                    output.close()
                sock.close(linger=0)  # a SUB has nothing to flush; detaching is just this
    except KeyboardInterrupt:
        return 0  # Ctrl-C is how a tail is meant to end
    except BrokenPipeError:
        detach_from_closed_pipe()
        return 0
    print("service stopped", file=sys.stderr)
    return 0
