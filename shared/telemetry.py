"""Per-token telemetry: the CSV schema, the writers, the run summary, the meter.

The CSV (one row per generated token) has ten fixed columns first, in this
order, and extras only after them, so a reader written for the ten keeps
working (docs/telemetry.md § Per-token CSV columns):

    # moe-pipe telemetry v1            <- preamble: one "# key=value" per line
    # run_id=...                          (resolved config, model, budget)
    # config.cache.cache_mb=4000
    step,wall_ms,compute_ms,...,cpu_ms,hits,misses,...      <- header
    1,742.000,521.000,...                                   <- one row per token, flushed

The JSONL holds the same records as objects, one per line, with a "kind"
("run_info", "token", "summary"), so one file has the whole run. Meanings and
units of every column: docs/telemetry.md (a test keeps it in step).
"""

from __future__ import annotations

import os
import resource
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import orjson
import psutil

from .speed import steady_start
from .wire.messages import RunInfo, RunSummary, TokenRecord, as_dict, field_names

# The fixed schema (docs/telemetry.md § Per-token CSV columns), in its order. Never reorder; add new columns as extras.
CSV_COLUMNS = ("step", "wall_ms", "compute_ms", "io_ms", "read_bytes", "cache_hit_pct", "stall_ms", "mgmt_ms", "majflt", "cpu_ms")
# The extras are the TokenRecord fields after the schema: declared there, once.
EXTRA_COLUMNS = field_names(TokenRecord)[len(CSV_COLUMNS) :]
ALL_COLUMNS = CSV_COLUMNS + EXTRA_COLUMNS
# The wire record and the CSV cannot drift apart: fail at import if they do.
assert field_names(TokenRecord)[: len(CSV_COLUMNS)] == CSV_COLUMNS, "TokenRecord must start with CSV_COLUMNS, in order"

PREAMBLE_TITLE = "moe-pipe telemetry v1"
MIB = 1 << 20


# ------------------------------------------------------------------ preamble


def _one_line(value: object) -> str:
    # A value with a newline would end the comment line and corrupt the CSV.
    return str(value).replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


def preamble_items(info: RunInfo) -> list[tuple[str, object]]:
    """(key, value) pairs of the preamble, in order: run facts, config, model."""
    items: list[tuple[str, object]] = [
        ("run_id", info.run_id),
        ("started_unix", f"{info.started_unix:.3f}"),
        ("budget_bytes", info.budget_bytes),
        ("budget_mib", f"{info.budget_bytes / MIB:.3f}"),
        ("load_seconds", f"{info.load_seconds:.3f}"),
        ("compile_seconds", f"{info.compile_seconds:.3f}"),
    ]
    items += [(f"config.{k}", v) for k, v in info.config.items()]
    items += [(f"model.{k}", v) for k, v in info.model.items()]
    return items


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"  # ms to the microsecond; pct to 0.001
    return str(value)


class CsvWriter:
    """Preamble, header, then one row per `write`, flushed so `tail -f` (or a
    crash) sees every finished token."""

    def __init__(self, path: str | os.PathLike, run_info: RunInfo):
        self.path = Path(path)
        self._f: IO[str] = open(self.path, "w", encoding="utf-8", newline="")
        try:
            lines = [f"# {PREAMBLE_TITLE}"]
            lines += [f"# {_one_line(k)}={_one_line(v)}" for k, v in preamble_items(run_info)]
            lines.append(",".join(ALL_COLUMNS))
            self._f.write("\n".join(lines) + "\n")
            self._f.flush()
        except BaseException:
            self._f.close()
            raise

    def write(self, record: TokenRecord) -> None:
        self._f.write(",".join(_format(getattr(record, c)) for c in ALL_COLUMNS) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> CsvWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_csv(path: str | os.PathLike) -> tuple[dict[str, str], list[TokenRecord]]:
    """(preamble key -> value text, records) of a CSV this module wrote; extra
    columns the reader does not know (a newer writer) are ignored."""
    preamble: dict[str, str] = {}
    records: list[TokenRecord] = []
    types = {name: TokenRecord.__dataclass_fields__[name].type for name in ALL_COLUMNS}
    header: list[str] | None = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("#"):
                key, sep, value = line[1:].strip().partition("=")
                if sep:
                    preamble[key] = value
            elif header is None:
                header = line.split(",")
            elif line:
                row = dict(zip(header, line.split(",")))
                # int or float per column; TokenRecord's own field checks hold each to its type
                fields: dict[str, Any] = {c: (int(row[c]) if types[c] == "int" else float(row[c])) for c in ALL_COLUMNS if c in row}
                records.append(TokenRecord(**fields))
    return preamble, records


# --------------------------------------------------------------------- JSONL

JSONL_KINDS = {RunInfo: "run_info", TokenRecord: "token", RunSummary: "summary"}


class JsonlWriter:
    """One JSON object per line: {"kind": ..., **fields}; flushed per line."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = open(self.path, "wb")

    def write(self, msg: RunInfo | TokenRecord | RunSummary) -> None:
        obj = {"kind": JSONL_KINDS[type(msg)], **as_dict(msg)}
        # NaN/inf would become null in orjson; summaries never produce them.
        self._f.write(orjson.dumps(obj) + b"\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------- summary


def _tok_s(records: Sequence[TokenRecord]) -> float:
    wall_s = sum(r.wall_ms for r in records) / 1000.0
    return len(records) / wall_s if wall_s > 0 else 0.0


class Tally:
    """What a run summary needs of its records, kept small: a long-lived
    service sends records for hours, so holding every TokenRecord (~0.4 KB)
    would grow without end. This keeps 16 bytes a token (wall and step, for
    the steady window, which moves with the count) and running totals."""

    def __init__(self) -> None:
        self.walls = array("d")
        self.steps = array("q")
        self.tokens = array("q")  # per record: 1, or a verify pass's 1 + its kept drafts
        self.drafted = self.accepted = 0
        self.first5: list[float] = []
        self.final_hit_pct = 0.0
        self.read_bytes = 0
        self.peak_rss_bytes = 0
        self.resident_bytes = 0  # the last record's

    def __len__(self) -> int:
        return len(self.walls)

    def add(self, r: TokenRecord) -> None:
        self.walls.append(r.wall_ms)
        self.steps.append(r.step)
        self.tokens.append(1 + r.accepted)
        self.drafted += r.drafted
        self.accepted += r.accepted
        if len(self.first5) < 5:
            self.first5.append(r.wall_ms)
        self.final_hit_pct = r.cache_hit_pct
        self.read_bytes += r.read_bytes
        self.peak_rss_bytes = max(self.peak_rss_bytes, r.rss_bytes)
        self.resident_bytes = r.resident_bytes

    def summary(
        self, load_seconds: float, budget_bytes: int, resident_bytes: int | None = None, peak_rss_bytes: int | None = None
    ) -> RunSummary:
        """The run's figures. tok/s is tokens over summed wall time (a
        throughput, not a mean of per-token rates, which would overweight fast
        tokens); the final hit % and resident bytes are the last record's
        (resident_bytes None: that record's)."""
        n = len(self.walls)  # records: one per pass
        warm = steady_start(n)
        steady_s = sum(self.walls[warm:]) / 1000.0
        all_s = sum(self.walls) / 1000.0
        tokens, steady_tokens = sum(self.tokens), sum(self.tokens[warm:])
        return RunSummary(
            tokens=tokens,
            load_seconds=float(load_seconds),
            mean_tok_s=tokens / all_s if all_s > 0 else 0.0,
            steady_tok_s=steady_tokens / steady_s if steady_s > 0 else 0.0,
            steady_from_step=self.steps[warm] if n > warm else 0,
            first5_wall_ms=sum(self.first5) / len(self.first5) if self.first5 else 0.0,
            final_hit_pct=self.final_hit_pct,
            read_bytes=self.read_bytes,
            budget_mib=budget_bytes / MIB,
            resident_mib=(self.resident_bytes if resident_bytes is None else resident_bytes) / MIB,
            peak_rss_mib=(self.peak_rss_bytes if peak_rss_bytes is None else peak_rss_bytes) / MIB,
            drafted=self.drafted,
            accepted=self.accepted,
        )


def summarize(
    records: Sequence[TokenRecord], load_seconds: float, budget_bytes: int, resident_bytes: int | None, peak_rss_bytes: int
) -> RunSummary:
    """The summary of a run's records (in any order: sorted by step)."""
    tally = Tally()
    for r in sorted(records, key=lambda r: r.step):
        tally.add(r)
    return tally.summary(load_seconds, budget_bytes, resident_bytes, peak_rss_bytes)


# A record's figures that are a reading at its end rather than a count over it: a row made of
# several passes (a prompt read in chunks) takes its last pass's; every other figure is summed.
READINGS = ("step", "cache_hit_pct", "rss_bytes", "req_id", "resident_bytes")


def merge_records(records: Sequence[TokenRecord], **fields: Any) -> TokenRecord:
    """One row of several passes' records (in order): their counts and times summed, the
    readings (READINGS) the last one's; `fields` set the rest (a request's step, req_id, rows)."""
    sums = {
        name: sum(getattr(r, name) for r in records) for name in field_names(TokenRecord) if name not in READINGS and name not in fields
    }
    return replace(records[-1], **sums, **fields)


def format_summary(s: RunSummary) -> str:
    """A short block for stdout."""
    return "\n".join(
        [
            f"tokens {s.tokens}   load {s.load_seconds:.2f} s",
            f"tok/s  mean {s.mean_tok_s:.2f}   steady {s.steady_tok_s:.2f} (from step {s.steady_from_step})"
            f"   first-5 wall {s.first5_wall_ms:.0f} ms",
            f"cache  hit {s.final_hit_pct:.1f} %   read {s.read_bytes / MIB:.1f} MiB"
            f"   budget {s.budget_mib:.1f} MiB   resident {s.resident_mib:.1f} MiB",
            f"memory peak RSS {s.peak_rss_mib:.1f} MiB",
        ]
        + ([f"drafts {s.accepted} of {s.drafted} kept ({s.accepted / s.drafted:.0%})"] if s.drafted else [])
    )


# --------------------------------------------------------------------- meter


@dataclass(frozen=True)
class ResourceDelta:
    majflt: int  # major page faults since the last reading
    cpu_ms: float  # user + system CPU time, summed over all threads


class ResourceMeter:
    """Per-token deltas of the calling process's own major faults and CPU time
    (getrusage RUSAGE_SELF: every thread, no children), and its RSS (psutil).

    Use it in the process whose cost it should show (compute), one reading per
    token: `meter.delta()` returns what happened since the previous call."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, float]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_majflt, (ru.ru_utime + ru.ru_stime) * 1000.0

    def delta(self) -> ResourceDelta:
        now = self._read()
        d = ResourceDelta(now[0] - self._last[0], max(0.0, now[1] - self._last[1]))
        self._last = now
        return d

    def rss_bytes(self) -> int:
        """Resident set now (includes touched shared-memory slabs: RssShmem)."""
        return self._proc.memory_info().rss

    @staticmethod
    def peak_rss_bytes() -> int:
        """Highest RSS this process reached (ru_maxrss is KiB on Linux)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_records(records: Iterable[TokenRecord], path: str | os.PathLike, run_info: RunInfo) -> None:
    """Convenience for one-shot runs and benchmarks: a whole CSV at once."""
    with CsvWriter(path, run_info) as w:
        for r in records:
            w.write(r)
