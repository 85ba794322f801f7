"""Telemetry: the CSV schema, preamble, JSONL, summary figures, resource meter, and the doc's table."""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import orjson
import pytest

from moe_pipe.shared import telemetry as tm
from moe_pipe.shared.speed import steady_start
from moe_pipe.shared.wire.messages import RunInfo, TokenRecord, field_names

DOC = Path(__file__).resolve().parent.parent / "docs" / "telemetry.md"

INFO = RunInfo(
    run_id="r1",
    started_unix=1_700_000_000.0,
    config={"cache.cache_mb": 4000, "io.io_threads": 4, "compute.overlap": True, "note": "two\nlines"},
    model={"path": "/m/qwen.gguf", "arch": "qwen3moe", "layers": 48},
    budget_bytes=4000 << 20,
    load_seconds=1.25,
)


def rec(step, wall_ms, hit_pct=50.0, read_bytes=1000, **extra):
    return TokenRecord(step, wall_ms, wall_ms - 20.0, 10.0, read_bytes, hit_pct, 1.5, 0.25, 0, wall_ms * 1.5, **extra)


def test_schema_is_designs():
    assert tm.CSV_COLUMNS == (
        "step",
        "wall_ms",
        "compute_ms",
        "io_ms",
        "read_bytes",
        "cache_hit_pct",
        "stall_ms",
        "mgmt_ms",
        "majflt",
        "cpu_ms",
    )
    assert field_names(TokenRecord) == tm.CSV_COLUMNS + tm.EXTRA_COLUMNS
    assert not set(tm.CSV_COLUMNS) & set(tm.EXTRA_COLUMNS)


def test_csv_preamble_header_rows(tmp_path):
    path = tmp_path / "run.csv"
    records = [rec(i, 100.0 + i, hits=i, misses=8 - i, req_id=3) for i in range(1, 6)]
    with tm.CsvWriter(path, INFO) as w:
        w.write(records[0])
        # flushed per row: a reader sees the row before the writer closes
        assert path.read_text().splitlines()[-1].startswith("1,101.000,")
        for r in records[1:]:
            w.write(r)
    lines = path.read_text().splitlines()
    pre = [ln for ln in lines if ln.startswith("#")]
    body = lines[len(pre) :]
    assert lines[: len(pre)] == pre  # the preamble comes first, all of it
    assert all(re.fullmatch(r"# [^=\n]+=.*", ln) for ln in pre[1:])
    assert "# budget_mib=4000.000" in pre and "# config.cache.cache_mb=4000" in pre
    assert "# model.arch=qwen3moe" in pre and "# config.note=two\\nlines" in pre
    assert tuple(body[0].split(",")) == tm.CSV_COLUMNS + tm.EXTRA_COLUMNS  # header exactly the schema
    assert tuple(body[0].split(","))[:10] == tm.CSV_COLUMNS
    assert len(body) == 1 + len(records)
    preamble, back = tm.read_csv(path)
    assert back == records
    assert preamble["run_id"] == "r1" and preamble["model.layers"] == "48"


def test_jsonl(tmp_path):
    path = tmp_path / "run.jsonl"
    records = [rec(i, 100.0) for i in range(1, 4)]
    summary = tm.summarize(records, 1.0, 1 << 20, 1 << 19, 1 << 30)
    with tm.JsonlWriter(path) as w:
        w.write(INFO)
        for r in records:
            w.write(r)
        w.write(summary)
    objs = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [o["kind"] for o in objs] == ["run_info", "token", "token", "token", "summary"]
    assert objs[0]["config"]["cache.cache_mb"] == 4000
    assert [k for k in objs[1] if k != "kind"] == list(tm.CSV_COLUMNS + tm.EXTRA_COLUMNS)
    assert objs[-1]["tokens"] == 3 and objs[-1]["peak_rss_mib"] == 1024.0


# ------------------------------------------------------------------- summary


def test_summary_figures():
    # 20 tokens: a cold head of 5 at 1000 ms, then 15 at 100 ms.
    records = [rec(i, 1000.0 if i <= 5 else 100.0, hit_pct=i * 4.0, read_bytes=1 << 20) for i in range(1, 21)]
    s = tm.summarize(list(reversed(records)), load_seconds=2.5, budget_bytes=3000 << 20, resident_bytes=2988 << 20, peak_rss_bytes=5 << 30)
    assert s.tokens == 20
    assert s.mean_tok_s == pytest.approx(20 / 6.5)  # 5 × 1 s + 15 × 0.1 s
    assert s.steady_from_step == 16  # the last quarter: 5 of 20
    assert s.steady_tok_s == pytest.approx(10.0)
    assert s.first5_wall_ms == pytest.approx(1000.0)
    assert s.final_hit_pct == 80.0  # the last step's running rate, whatever the input order
    assert s.read_bytes == 20 << 20
    assert (s.budget_mib, s.resident_mib, s.peak_rss_mib) == (3000.0, 2988.0, 5120.0)
    assert s.load_seconds == 2.5
    text = tm.format_summary(s)
    assert len(text.splitlines()) <= 5
    for figure in ("3.08", "10.00", "from step 16", "1000 ms", "80.0 %", "3000.0 MiB", "2988.0 MiB", "5120.0 MiB", "2.50 s"):
        assert figure in text


@pytest.mark.parametrize("n, warm", [(0, 0), (1, 0), (2, 1), (3, 2), (6, 5), (8, 6), (10, 8), (24, 18), (51, 39), (256, 192), (1000, 750)])
def test_warmup_rule(n, warm):
    assert steady_start(n) == warm


def test_summary_of_nothing():
    s = tm.summarize([], 0.5, 0, 0, 0)
    assert (s.tokens, s.mean_tok_s, s.steady_tok_s, s.first5_wall_ms, s.final_hit_pct) == (0, 0.0, 0.0, 0.0, 0.0)
    assert "tokens 0" in tm.format_summary(s)


def test_summary_of_one_token():
    s = tm.summarize([rec(1, 250.0)], 0.5, 0, 0, 0)
    assert s.mean_tok_s == s.steady_tok_s == pytest.approx(4.0)
    assert s.first5_wall_ms == 250.0


# --------------------------------------------------------------------- meter


def test_meter_deltas_non_negative():
    meter = tm.ResourceMeter()
    sum(i * i for i in range(200_000))  # burn a little CPU
    d = meter.delta()
    assert d.majflt >= 0 and d.cpu_ms >= 0
    assert meter.delta().cpu_ms >= 0
    assert meter.rss_bytes() > 0
    assert meter.peak_rss_bytes() >= meter.rss_bytes() // 2  # ru_maxrss and psutil agree roughly


def test_meter_sees_major_faults(tmp_path):
    path = tmp_path / "cold.bin"
    size = 1 << 20
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # drop its pages: the next touch faults from disk
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            try:
                mm.madvise(mmap.MADV_RANDOM)  # one fault per page touched, not readahead-batched
            except (AttributeError, OSError):
                pass
            meter = tm.ResourceMeter()
            total = sum(mm[i] for i in range(0, size, mmap.PAGESIZE))
            d = meter.delta()
    finally:
        os.close(fd)
    assert total >= 0
    if d.majflt == 0:
        pytest.skip("no major faults observable here (page cache not dropped, e.g. tmpfs or overlay)")
    assert d.majflt > 0


# ----------------------------------------------------------------------- doc


def doc_table(heading: str) -> list[list[str]]:
    """The rows of the first table under `## heading` in docs/telemetry.md."""
    text = DOC.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows[2:]]  # skip header + rule


def test_doc_lists_every_column_in_order():
    assert tuple(row[0] for row in doc_table("Per-token CSV columns")) == tm.CSV_COLUMNS + tm.EXTRA_COLUMNS


def test_doc_lists_every_summary_field():
    from moe_pipe.shared.wire.messages import RunSummary

    assert tuple(row[0] for row in doc_table("Run summary")) == field_names(RunSummary)


def test_the_telemetry_process_keeps_a_tally_not_the_records():
    """A service sends records for hours: the record writer keeps ~16 bytes a token
    (wall and step), not the records, and sums to the same summary."""
    import tracemalloc

    from moe_pipe.procs.telemetry import RecordWriter
    from moe_pipe.shared.config import TelemetryConfig

    def record(i):  # made on arrival, as the decoder makes them: kept only if the writer keeps it
        return rec(i, 100.0 + (i % 7), hit_pct=i / 1000, rss_bytes=i)

    n = 20_000
    r = RecordWriter(TelemetryConfig())  # no csv: the tally alone
    r.on_run_info(INFO)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(1, n + 1):
        r.on_record(record(i))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 40 * n  # a TokenRecord alone is ~10x that
    records = [record(i) for i in range(1, n + 1)]
    got = r.finish()
    assert got == tm.summarize(records, INFO.load_seconds, INFO.budget_bytes, 0, len(records))
