"""bench/_protocol.py: the figures of a whole reply and the comparison table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _protocol import Engine, markdown, reply_figures, summarize  # noqa: E402


def test_reply_figures_first_token_fill_steady_and_whole():
    # a 5 s prompt, a fill falling from 400 ms to 100 ms over tokens 2..41, then 100 ms flat to token 80
    walls = [5000.0] + [400.0 - 300.0 * i / 39 for i in range(40)] + [100.0] * 39
    f = reply_figures(walls)
    assert f["tokens"] == 80
    assert f["first_s"] == 5.0
    assert f["steady_tps"] == pytest.approx(10.0)  # the last quarter: 20 tokens of 100 ms
    assert f["whole_tps"] == pytest.approx(80 / (sum(walls) / 1e3))
    assert f["fill_ms"] == pytest.approx(sum(walls[1:50]) / 49)
    # steady from the token after the last 8-token window averaging above 1.2x of 100 ms
    t = f["steady_at_token"]
    assert sum(walls[t - 2 : t + 6]) / 8 > 120.0
    assert all(sum(walls[u : u + 8]) / len(walls[u : u + 8]) <= 120.0 for u in range(t - 1, 80))
    assert f["steady_at_s"] == pytest.approx(sum(walls[: t - 1]) / 1e3)


def test_reply_figures_a_late_stall_moves_steady_past_it():
    walls = [1000.0] + [100.0] * 30 + [400.0] * 5 + [100.0] * 44  # tokens 32-36 stall
    f = reply_figures(walls)
    assert f["steady_at_token"] == 37  # after the last slow window (it starts at token 36)


def _row(engine, kind, first_s, fill_ms, steady, whole, run=1, tokens=(1, 2, 3), **kw):
    return dict(engine=engine, kind=kind, lossy=False, finished=True, tokens=3, first_s=first_s, steady_at_token=10,
                steady_at_s=2.0, fill_ms=fill_ms, steady_tps=steady, whole_tps=whole, run=run, position=1,
                token_ids=list(tokens), page_cache_mib=kw.get("page_cache_mib"), budget_mib=kw.get("budget_mib"))  # fmt: skip


def test_summary_ratios_against_the_best_peer(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1024)
    engines = [Engine("moe-pipe", "moe-pipe"), Engine("llama.cpp mmap ra8192", "llama.cpp", readahead_kb=8192),
               Engine("llama.cpp mmap ra128", "llama.cpp", readahead_kb=128)]  # fmt: skip
    rows = [
        _row("moe-pipe", "moe-pipe", 4.0, 100.0, 10.0, 6.0, run=1, budget_mib=800.0),
        _row("moe-pipe", "moe-pipe", 6.0, 140.0, 12.0, 8.0, run=2, budget_mib=800.0),
        _row("llama.cpp mmap ra8192", "llama.cpp", 9.0, 900.0, 1.0, 1.0, tokens=(1, 2, 9)),
        _row("llama.cpp mmap ra128", "llama.cpp", 5.0, 200.0, 5.5, 3.5, tokens=(1, 9, 9), page_cache_mib=1500.0),
    ]
    s = summarize(model, Path("c.toml"), engines, rows, [], limit_mb=2000.0, n=3, repeat=2, threads=2, cold="copy")
    assert s["best_llama"] == "llama.cpp mmap ra128"  # the higher last-quarter tok/s
    assert s["medians"]["moe-pipe"]["first_s"] == 5.0 and s["medians"]["moe-pipe"]["steady_tps"] == 11.0
    r = s["ratios_vs_best_llama"]["moe-pipe"]
    assert r == {"first_token": 1.0, "fill": 200.0 / 120.0, "steady": 2.0, "whole": 2.0}
    assert s["llama_tokens_equal_moe_pipe"] == {"llama.cpp mmap ra8192 #1": 2, "llama.cpp mmap ra128 #1": 1}
    md = markdown(s, "a title")
    assert "| moe-pipe | 1.00× | 1.67× | 2.00× | 2.00× |" in md
    assert "expert cache 800 MiB = 40%" in md and "page cache 1,500 MiB = 75%" in md


def test_read_rates_divide_the_lanes_summed_read_time(tmp_path):
    from _protocol import io_lanes, moe_pipe_io_figures, read_rows, run_info

    csv_path = tmp_path / "run.csv"
    csv_path.write_text(
        "# model: m.gguf\nstep,wall_ms,io_ms,read_bytes,cache_hit_pct\n1,5000,8000,4000000000,0\n2,200,400,100000000,50\n3,100,0,0,75\n"
    )
    (tmp_path / "run.jsonl").write_text('{"kind": "other"}\n{"kind": "run_info", "config": {"io.io_threads": 4}}\n')
    rows = read_rows(csv_path)
    assert [r["wall_ms"] for r in rows] == [5000.0, 200.0, 100.0]
    lanes = io_lanes(run_info(tmp_path / "run.jsonl"))
    f = moe_pipe_io_figures(rows, lanes)
    assert lanes == 4 and f["first_gb"] == 4.0 and f["hit_pct"] == 75.0
    assert f["first_read_gbps"] == pytest.approx(4e9 / (8.0 / 4) / 1e9)  # 8 s of lane time over 4 lanes = 2 s busy
    assert f["fill_read_gbps"] == pytest.approx(1e8 / (0.4 / 4) / 1e9)


def test_a_prose_prompt_has_the_asked_length_and_is_the_corpus_opening(tiny_model):
    """The long-prompt runs: ordinary prose, as many tokens as asked (cut at a word), the same text for every engine."""
    from _protocol import prose_prompt

    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.gguf.vocab import CORPUS
    from moe_pipe.shared.text.chat import encode_prompt
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(tiny_model) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
    for length in (16, 512, 3600):
        text = prose_prompt(tok, length)
        n = len(encode_prompt(tok, text))
        assert length - 16 <= n <= length, (length, n)
        assert " ".join(CORPUS.read_text().split()).startswith(text)
    assert prose_prompt(tok, 3600) == prose_prompt(tok, 3600)
