"""`moe-pipe bench` machinery on the tiny model: cgroups made and removed,
trace-driven routing, CSVs, summary and plots. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_pipe.shared.analysis.benchmark import (
    PEER_READAHEAD_KB,
    BenchPlan,
    RunFigures,
    peer_runs,
    summarize_runs,
    summary_markdown,
    wall_figures,
)
from moe_pipe.shared.analysis.cgroup import MemoryCgroup, MemoryLimitError
from moe_pipe.shared.analysis.peer_llama import read_result
from moe_pipe.shared.errors import UserError
from moe_pipe.shared.model.routes import RouteReplay
from moe_pipe.shared.model.trace import TraceHeader, TraceWriter, read_trace
from moe_pipe.shared.telemetry import read_csv

CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")


def _cgroup_or_skip(limit_mb):
    try:
        return MemoryCgroup.create(limit_mb)
    except MemoryLimitError as exc:
        pytest.skip(f"no memory cgroup here: {exc}")


@pytest.mark.integration
def test_a_cgroup_limits_its_process_tree_and_is_removed():
    cg = _cgroup_or_skip(64)
    try:
        out = subprocess.run(cg.wrap(["cat", "/proc/self/cgroup"]), capture_output=True, text=True, check=True).stdout
        assert cg.path.name in out
        limit_file = "memory.limit_in_bytes" if cg.version == 1 else "memory.max"
        assert int((cg.path / limit_file).read_text()) == 64 << 20
        # A process that touches more than the limit is killed by it, inside the group only.
        hog = subprocess.run(
            cg.wrap([sys.executable, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])"]), capture_output=True
        )
        assert hog.returncode != 0 and cg.oom_kills() >= 1
        assert cg.peak_bytes() is not None and cg.peak_bytes() <= (64 << 20) + (1 << 20)
    finally:
        cg.remove()
    assert not cg.path.exists()


def test_no_controller_is_a_clear_error(tmp_path):
    with pytest.raises(MemoryLimitError, match="no memory cgroup"):
        MemoryCgroup.create(100, v1_root=tmp_path / "v1", v2_root=tmp_path / "v2")


def _trace(path: Path, n_layer=2, n_expert=8, tokens=((0, 1), (2, 3), (4, 5))):
    h = TraceHeader("m", "qwen3moe", n_layer, n_expert, 2, (100,) * n_layer, (0,) * n_layer)
    with TraceWriter(path) as w:
        w.write_header(h)
        for step, ids in enumerate(tokens):
            for layer in range(n_layer):
                w.write_routing(0, 1, step, layer, ids, [0.75, 0.25], [0, 0])
    return read_trace(path)


def test_route_replay_follows_the_trace_layer_by_layer_and_cycles(tmp_path):
    from types import SimpleNamespace

    rr = RouteReplay(_trace(tmp_path / "t.csv"), SimpleNamespace(n_layer=2, n_expert=8))
    assert rr.peek(0, 2).ids.tolist() == [[0, 1], [2, 3]] == rr.peek(0, 2).ids.tolist()  # a look does not move on
    assert rr.route(0, 2).ids.tolist() == [[0, 1], [2, 3]]  # a prompt batch of two
    assert rr.route(1, 1).ids.tolist() == [[0, 1]]  # each layer has its own cursor
    r = rr.route(0, 2)
    assert r.ids.tolist() == [[4, 5], [0, 1]]  # cycled
    np.testing.assert_allclose(r.weights, [[0.75, 0.25]] * 2)
    with pytest.raises(UserError, match="cannot drive"):
        RouteReplay(_trace(tmp_path / "u.csv"), SimpleNamespace(n_layer=2, n_expert=16))
    with pytest.raises(UserError, match="cannot drive"):
        RouteReplay(_trace(tmp_path / "v.csv"), SimpleNamespace(n_layer=3, n_expert=8))


@pytest.mark.integration
@pytest.mark.slow  # a whole bench run of the pipeline: ~18 s
def test_a_trace_driven_run_routes_like_the_trace(tmp_path):
    first, second = tmp_path / "a.trace", tmp_path / "b.trace"
    base = [*CLI, "run", TINY, "-n", "10", "--ignore-eos", "--output-format", "json"]
    subprocess.run([*base, "-p", "The old mill", "--route-trace", str(first)], check=True, capture_output=True)
    subprocess.run(
        [*base, "-p", "Something else entirely", "--route-replay", str(first), "--route-trace", str(second)],
        check=True,
        capture_output=True,
    )
    a, b = read_trace(first), read_trace(second)
    for layer in range(a.header.n_layer):
        ea, eb = a.expert[a.layer == layer], b.expert[b.layer == layer]
        n = min(len(ea), len(eb))
        assert n and (ea[:n] == eb[:n]).all()


@pytest.mark.integration
@pytest.mark.slow  # ~40 s; the default tier keeps under 10 minutes
def test_prefetch_under_a_route_replay_guesses_exactly(tmp_path):
    """Replayed routing gives prefetch a perfect predictor (the ceiling the
    benchmarks measure): every guess sent is used."""
    trace, csv = tmp_path / "a.trace", tmp_path / "run.csv"
    base = [*CLI, "run", TINY, "-n", "12", "--ignore-eos", "--output-format", "json", "--cache-mb", "1.2"]
    subprocess.run([*base, "-p", "The old mill", "--route-trace", str(trace)], check=True, capture_output=True)
    subprocess.run(
        [*base, "-p", "Something else", "--route-replay", str(trace), "--prefetch", "next-layer", "--csv", str(csv)],
        check=True,
        capture_output=True,
    )
    _, recs = read_csv(csv)
    issued, used = sum(r.prefetch_issued for r in recs), sum(r.prefetch_used for r in recs)
    assert issued > 0 and used == issued


@pytest.mark.integration
@pytest.mark.slow  # ~37 s; test_vs_llama_cpp_on_the_tiny_model runs bench in the default tier
def test_bench_writes_csvs_summary_and_plots(tmp_path):
    trace = tmp_path / "tiny.trace"
    subprocess.run(
        [*CLI, "run", TINY, "-p", "hello", "-n", "4", "--ignore-eos", "--route-trace", str(trace)], check=True, capture_output=True
    )
    out = tmp_path / "out"
    try:
        MemoryCgroup.create(None).remove()
        limit = ["--mem-limit-mb", "1024"]
    except MemoryLimitError:
        limit = []
    r = subprocess.run(
        [*CLI, "bench", TINY, "-n", "6", "--repeat", "2", "--cooldown", "0", "--out", str(out), "--route-replay", str(trace), *limit],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "[1/2] moe-pipe run 1/2" in r.stderr  # progress
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trace_driven"] and len(summary["runs"]) == 2
    assert all(run["tokens"] == 6 for run in summary["runs"])
    md = (out / "summary.md").read_text()
    assert "moe-pipe (trace-driven) #1" in md and "trace-driven" in md.splitlines()[2]
    assert (out / "moe-pipe-1.csv").exists() and (out / "moe-pipe-2.csv").exists()
    pytest.importorskip("matplotlib")
    assert (out / "per-token.png").stat().st_size > 1000 and (out / "hit-rate.png").exists()


@pytest.mark.integration
def test_bench_bad_input_is_one_line_exit_2(tmp_path):
    r = subprocess.run([*CLI, "bench", str(tmp_path / "missing.gguf"), "-n", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1


def test_summary_ratio_uses_the_better_peer_and_medians(tmp_path):
    def fig(engine, label, k, tok_s, tokens=(1, 2, 3)):
        return RunFigures(engine, label, k, 3, True, tok_s, tok_s, 10.0, 1.0, token_ids=list(tokens))

    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    rows = [
        fig("moe-pipe", "moe-pipe", 1, 4.0),
        fig("moe-pipe", "moe-pipe", 2, 6.0),
        fig("moe-pipe", "moe-pipe", 3, 5.0),
        fig("llama.cpp", "llama.cpp mmap, readahead 8192 KiB", 1, 0.5, (1, 9, 3)),
        fig("llama.cpp", "llama.cpp mmap, readahead 128 KiB (killed, exit -9)", 1, 2.0),
    ]
    s = summarize_runs(BenchPlan(model, n=3, repeat=3), rows, 8192)
    assert s["median_steady_tok_s"]["moe-pipe"] == 5.0
    assert s["ratio_vs_best_llama"] == pytest.approx(2.5)  # against the better peer
    assert s["llama_tokens_equal_moe_pipe"]["llama.cpp mmap, readahead 8192 KiB"] == 1
    assert "**2.50×**" in summary_markdown(s)


def test_peer_runs_cover_both_readaheads_without_repack_then_the_default_once():
    runs = peer_runs(8192)
    assert [(r.readahead_kb, r.repack) for r in runs] == [(8192, False), (PEER_READAHEAD_KB, False), (8192, True)]
    assert len({r.tag for r in runs}) == 3  # their CSVs do not overwrite each other
    assert [(r.readahead_kb, r.repack) for r in peer_runs(PEER_READAHEAD_KB)] == [(128, False), (128, True)]
    assert peer_runs(None)[0].label == "llama.cpp mmap"


def test_wall_figures_and_a_killed_peers_partial_result(tmp_path):
    f = wall_figures([1000.0, 100.0, 100.0, 100.0, 100.0, 50.0, 50.0, 50.0])
    assert f["first5_wall_ms"] == pytest.approx(280.0) and f["tok_s_steady"] > f["tok_s_mean"]
    p = tmp_path / "peer.csv"
    p.write_text("step,wall_ms,token\n1,900.0,5\n2,30.5,6\n")
    res = read_result(p)
    assert res["wall_ms"] == [900.0, 30.5] and res["tokens"] == [5, 6] and not res["finished"]
    p.write_text(p.read_text() + "# done load_s=1.5 majflt=7 peak_rss=100\n")
    assert read_result(p)["finished"] and read_result(p)["majflt"] == 7


@pytest.mark.integration
def test_vs_llama_cpp_on_the_tiny_model(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the optional peer (pip install llama-cpp-python)")
    out = tmp_path / "out"
    r = subprocess.run(
        # A prompt whose first token leads the next by ~1 logit in both engines: on the fixed bench
        # prompt the tiny model's top three logits lie within 0.1, and the engines' activation
        # rounding (llama.cpp per 256 values on K-quants, ours per 32) and KV rounding reorder them.
        [*CLI, "bench", TINY, "-n", "4", "--repeat", "1", "--cooldown", "0", "--out", str(out), "--vs", "llama.cpp"]
        + ["--kv-type", "f32", "-p", "The quick brown fox"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    peers = [x for x in s["runs"] if x["engine"] == "llama.cpp"]
    assert peers and all(p["tokens"] == 4 and p["finished"] for p in peers)
    assert any(p["label"].startswith("llama.cpp mmap") for p in peers)
    assert any(p["label"].startswith("llama.cpp default") for p in peers)
    assert sorted((out).glob("llama.cpp-repack-*.csv"))
    assert s["ratio_vs_best_llama"] is not None
    assert all(v >= 1 for v in s["llama_tokens_equal_moe_pipe"].values())  # the first token agrees: same file, same math


def test_bench_says_what_it_does_while_it_forecasts(monkeypatch, capsys, tmp_path):
    """The forecast before the runs takes seconds (6 s of silence on a first run): each of its
    stages is shown as it starts (a spinner on a terminal, a line elsewhere)."""
    from moe_pipe.cli.main import main
    from moe_pipe.shared.analysis import benchmark, forecast

    def fake_forecast(mf, cfg, *, on_stage=None, **kw):
        on_stage("measuring the kernels")
        return {"fits": False, "refusal": "no"}

    class Stop(Exception):
        pass

    def stop(*a, **kw):
        raise Stop

    monkeypatch.setattr(forecast, "forecast", fake_forecast)
    monkeypatch.setattr(benchmark, "run_bench", stop)
    with pytest.raises(Stop):
        main(["bench", "-n", "1", "--out", str(tmp_path)])
    assert capsys.readouterr().err.splitlines() == [
        "[forecasting (moe-pipe doctor) ...]",
        "[forecasting: measuring the kernels]",
        "    forecast: does not fit (no)",
    ]
