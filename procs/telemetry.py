"""The telemetry process: receives per-token records, writes the CSV and
JSONL, republishes every record for tails, and writes the run summary. A
prompt's progress (PromptProgress) and the slots' states (SlotStates) are
republished for tails only: they are no tokens, so neither file has them.

It never slows compute: compute sends without blocking and drops when this
process falls behind (the drop count is in compute's own accounting).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..shared.config import Config, TelemetryConfig
from ..shared.telemetry import CsvWriter, JsonlWriter, Tally, format_summary
from ..shared.wire import ipc
from ..shared.wire import messages as m
from .lifecycle import child_setup
from .run_facts import RunFacts

log = logging.getLogger("moe_pipe.telemetry")


class RecordWriter:
    """Per-token records into the run's CSV and JSONL (telemetry.csv; none when
    unset) and a tally for the run summary."""

    def __init__(self, table: TelemetryConfig):
        self.csv_path = table.csv or ""  # "" = no files; records are still republished
        self.csv: CsvWriter | None = None
        self.jsonl: JsonlWriter | None = None
        self.info: m.RunInfo | None = None
        self.tally = Tally()  # not the records: a service runs for hours

    def on_run_info(self, info: m.RunInfo) -> None:
        self.close()
        self.info, self.tally = info, Tally()
        if self.csv_path:
            path = Path(self.csv_path)
            self.csv = CsvWriter(path, info)
            self.jsonl = JsonlWriter(path.with_suffix(".jsonl"))
            self.jsonl.write(info)

    def on_record(self, rec: m.TokenRecord) -> None:
        self.tally.add(rec)
        if self.csv:
            self.csv.write(rec)
        if self.jsonl:
            self.jsonl.write(rec)

    def finish(self) -> m.RunSummary | None:
        if not len(self.tally) or self.info is None:
            return None
        summary = self.tally.summary(self.info.load_seconds, self.info.budget_bytes)
        if self.jsonl:
            self.jsonl.write(summary)
        return summary

    def close(self) -> None:
        for w in (self.csv, self.jsonl):
            if w:
                w.close()
        self.csv = self.jsonl = None


def main(config: Config, facts: RunFacts) -> None:
    child_setup("telemetry")
    with ipc.context() as ctx:
        ep = ipc.Endpoints(Path(facts.runtime_dir))
        inbox = ipc.bind(ctx, ep, "telemetry_in")
        pub = ipc.DroppingSender(ipc.bind(ctx, ep, "telemetry_pub"))
        rec = RecordWriter(config.telemetry)
        try:
            while True:
                try:
                    msg = ipc.recv(inbox, None, expect=(m.RunInfo, m.TokenRecord, m.PromptProgress, m.SlotStates, m.Shutdown))
                except m.ProtocolError as exc:
                    log.warning("dropped a bad frame: %s", exc)
                    continue
                if isinstance(msg, m.Shutdown):
                    summary = rec.finish()
                    if summary:
                        pub.send(summary)
                    return
                if isinstance(msg, m.RunInfo):
                    rec.on_run_info(msg)
                elif isinstance(msg, m.TokenRecord):
                    rec.on_record(msg)
                elif not isinstance(msg, (m.PromptProgress, m.SlotStates)):
                    continue  # None: recv waits forever, so never
                pub.send(msg)
        finally:
            rec.close()


__all__ = ["main", "RecordWriter", "format_summary"]
