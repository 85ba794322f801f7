"""A user's first run (issue 16): the kernel compile shows progress and stays
out of the prompt's rate, `moe-pipe warmup` fills numba's cache, one value per
timing figure across the JSON output, the run summary and the CSV, and the
small things of `run` (-p -, -f FILE, where the tiny model was made, --version)."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_pipe.cli import run_cmd
from moe_pipe.cli.main import main
from moe_pipe.shared.telemetry import MIB, read_csv

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
DOC = ROOT / "docs" / "telemetry.md"


def _moe_pipe(*argv: str, numba_cache: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if numba_cache is not None:
        env["NUMBA_CACHE_DIR"] = str(numba_cache)
    return subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def _kernels_compiled(stderr: str) -> int:
    found = re.search(r"\[kernels ready in [\d.]+ s \((\d+) compiled", stderr)
    assert found, stderr
    return int(found.group(1))


@pytest.mark.slow
@pytest.mark.integration
def test_a_first_run_shows_the_compile_and_keeps_it_out_of_the_prompt_rate(tmp_path):
    # exactly the user's first run: a fresh numba cache, so every kernel compiles
    r = _moe_pipe("run", TINY, "-p", "hi", "-n", "8", numba_cache=tmp_path / "numba")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    # the first line comes before anything slow starts, and names what is coming
    assert "compiling" in lines[0] or "kernels" in lines[0], lines[0]
    assert re.search(r"\[compiling kernels 1/\d+: \S+ matmul\]", r.stderr), r.stderr
    assert re.search(r"compiling kernels (\d+)/\1: forward pass", r.stderr), r.stderr
    assert _kernels_compiled(r.stderr) > 0  # it did compile, before the Hello ...
    last = lines[-1]
    assert re.search(r"load [\d.]+ s, kernels [\d.]+ s \(not in the rates\)\]$", last), last
    # ... and nothing compiled once the prompt ran (the JSON run below says how many did)


@pytest.mark.slow
@pytest.mark.integration
def test_warmup_fills_the_cache_so_a_run_compiles_nothing(tmp_path):
    cache = tmp_path / "numba"
    w = _moe_pipe("warmup", TINY, numba_cache=cache)
    assert w.returncode == 0, w.stderr
    assert "compiling kernels 1/" in w.stderr
    assert re.search(r"ready in [\d.]+ s: [1-9]\d* compiled", w.stderr), w.stderr
    r = _moe_pipe("run", TINY, "-p", "hi", "-n", "4", "--output-format", "json", numba_cache=cache)
    assert r.returncode == 0, r.stderr
    assert _kernels_compiled(r.stderr) == 0
    assert json.loads(r.stdout)["timings"]["late_compiles"] == 0


@pytest.mark.integration
def test_one_value_per_timing_figure_across_json_summary_and_csv(tmp_path):
    csv = tmp_path / "run.csv"
    r = _moe_pipe("run", TINY, "-p", "hi", "-n", "8", "--output-format", "json", "--csv", str(csv))
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["timings"]
    preamble, rows = read_csv(csv)
    jsonl = [json.loads(line) for line in csv.with_suffix(".jsonl").read_text().splitlines()]
    info, summary = jsonl[0], jsonl[-1]
    assert (info["kind"], summary["kind"]) == ("run_info", "summary")

    assert "load_s" not in t  # one name per figure
    assert t["load_seconds"] == float(preamble["load_seconds"]) == info["load_seconds"] == summary["load_seconds"]
    assert t["compile_seconds"] == float(preamble["compile_seconds"]) == info["compile_seconds"]
    assert f"loaded in {t['load_seconds']:.2f} s" in r.stderr
    budget_mib = info["budget_bytes"] / MIB
    assert t["budget_mib"] == float(preamble["budget_mib"]) == round(summary["budget_mib"], 3) == round(budget_mib, 3)

    assert t["tokens"] == t["predicted_n"] == summary["tokens"] == len(rows) == 8
    assert t["read_bytes"] == summary["read_bytes"] == sum(x.read_bytes for x in rows)
    assert t["final_hit_pct"] == summary["final_hit_pct"] == pytest.approx(rows[-1].cache_hit_pct, abs=1e-3)
    # resident: the experts in the cache after the last token, from the residency index
    assert t["resident_mib"] == summary["resident_mib"] == rows[-1].resident_bytes / MIB
    assert 0 < t["resident_mib"] <= budget_mib
    # mean_tok_s: tokens over their summed wall time (the prompt's pass is step 1)
    assert t["mean_tok_s"] == summary["mean_tok_s"] == pytest.approx(len(rows) / (sum(x.wall_ms for x in rows) / 1e3), rel=1e-3)
    # the llama.cpp-style rates are their own counts over their own times
    assert t["prompt_tok_s"] == pytest.approx(t["prompt_n"] / (t["prompt_ms"] / 1e3), rel=1e-3)
    assert t["predicted_tok_s"] == pytest.approx(t["predicted_n"] / (t["predicted_ms"] / 1e3), rel=1e-3)
    # docs/telemetry.md § Preamble names exactly the model.* keys the preamble carries
    row = next(line for line in DOC.read_text().splitlines() if line.startswith("| model.* |"))
    assert {f"model.{k}" for k in re.findall(r"`(\w+)` \(", row)} == {k for k in preamble if k.startswith("model.")}


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"prompt": None, "file": None} | kw))


def test_the_prompt_comes_from_stdin_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n"))
    assert run_cmd.read_prompt(_args(prompt="-")) == "from stdin\n"
    f = tmp_path / "prompt.txt"
    f.write_text("from a file", encoding="utf-8")
    assert run_cmd.read_prompt(_args(file=str(f))) == "from a file"
    assert run_cmd.read_prompt(_args(prompt="as given")) == "as given"


def test_a_missing_prompt_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["run", "-f", str(tmp_path / "nope.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read the prompt file" in err[0] and "nope.txt" in err[0], err


def test_prompt_and_file_are_one_or_the_other(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "-p", "hi", "-f", "x.txt"])
    assert exc.value.code == 2


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"moe-pipe {version('moe-pipe')}"
    import moe_pipe

    assert version("moe-pipe") == moe_pipe.__version__, "pyproject.toml reads the version from the package's __init__.py"


def test_run_says_where_it_made_the_embedded_model(tmp_path, monkeypatch, capsys):
    from moe_pipe.shared.config import load_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = load_config(None, {"model.path": "tiny"})
    path = run_cmd._model_file(cfg)
    assert path.is_file() and tmp_path in path.parents
    assert capsys.readouterr().err.strip() == f"[made the embedded tiny model: {path}]"
    assert run_cmd._model_file(cfg) == path  # made once: the second run says nothing
    assert capsys.readouterr().err == ""
