"""A new user's first hour, the small things (issue 16, items 7 and 8):
make-model given a folder or an unwritable one, inspect given a config or
the name `tiny`, replay given a shipped trace's short name, the tiny model's
id, the README's usage block, and the bench plots."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_pipe.cli.main import COMMANDS, main
from moe_pipe.shared.config import load_config
from moe_pipe.shared.makemodel.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[1]


# -- make-model ----------------------------------------------------------------------------


def test_make_model_into_a_folder_writes_the_default_name_inside_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["make-model", "--arch", "qwen3moe", "--layers", "2", "-q", "-o", "."]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["qwen3moe-tiny-L2-seed0.gguf"]
    assert main(["make-model", "--arch", "gpt-oss", "--layers", "2", "-q", "-o", "new/"]) == 0  # "/": a folder, made
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["gpt-oss-tiny-L2-seed0.gguf"]
    assert "new/gpt-oss-tiny-L2-seed0.gguf" in capsys.readouterr().err


@pytest.mark.parametrize("out", ["/proc/x.gguf", "/proc/sub/x.gguf"])
def test_make_model_into_an_unwritable_folder_is_one_line_exit_2(out, capsys):
    assert main(["make-model", "--arch", "qwen3moe", "--layers", "2", "-q", "-o", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a writable folder" in err and str(Path(out).parent) in err, err
    assert "GB" not in err  # not a free-space complaint


# -- inspect ---------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["tiny", str(ROOT / "configs" / "tiny.toml")])
def test_inspect_takes_the_embedded_name_and_a_config(what, capsys):
    assert main(["inspect", what, "--json"]) == 0
    out = capsys.readouterr().out
    assert main(["inspect", str(default_model_path()), "--json"]) == 0
    assert out == capsys.readouterr().out  # the same model as its file


def test_inspect_a_config_without_a_model_says_how_to_get_one(capsys):
    assert main(["inspect", str(ROOT / "configs" / "qwen30b.toml")]) == 2
    err = capsys.readouterr().err
    assert "model.path is not set" in err and len(err.strip().splitlines()) == 1


# -- replay -----------------------------------------------------------------------------------


def test_replay_takes_a_shipped_trace_by_its_short_name(capsys):
    assert main(["replay", "gptoss", "--budget-mb", "500", "--policy", "lru", "--json"]) == 0
    assert '"policy": "lru"' in capsys.readouterr().out


def test_replay_an_unknown_name_lists_the_shipped_ones(capsys):
    assert main(["replay", "qwne", "--budget-mb", "500"]) == 2
    err = capsys.readouterr().err
    assert '"qwen"' in err and "gptoss" in err and len(err.strip().splitlines()) == 1


# -- names and docs -----------------------------------------------------------------------------


def test_the_tiny_model_id_is_a_clean_id():
    name = load_config(ROOT / "configs" / "tiny.toml").model.name
    assert name == "moe-pipe-tiny" and re.fullmatch(r"[A-Za-z0-9._-]+", name)


@pytest.mark.integration
def test_an_install_leaves_the_tree_clean():
    # `pip install .` writes moe_pipe.egg-info/ and build/ beside the sources: never
    # tracked, always ignored, so a user's `git status` stays clean after installing.
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [p for p in tracked if ".egg-info/" in p or p.startswith(("build/", "dist/")) or p.endswith(".whl")]
    made = ["moe_pipe.egg-info/PKG-INFO", "build/lib/moe_pipe/__init__.py", "dist/moe_pipe-0.1.0-py3-none-any.whl"]
    ignored = subprocess.run(["git", "check-ignore", *made], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert ignored == made


def test_the_readme_usage_block_names_every_command():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Usage", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"^moe-pipe ([a-z-]+)", block, re.M)) | set(re.findall(r"\| ([a-z-]+)", block))  # "down | status | ..."
    assert set(COMMANDS) <= named, sorted(set(COMMANDS) - named)


# -- bench plots -----------------------------------------------------------------------------------


@pytest.fixture
def bench_runs(tmp_path):
    """A plan and the rows of one moe-pipe run (io above wall) and two llama.cpp runs, one killed after one token."""
    from moe_pipe.shared.analysis.benchmark import BenchPlan, RunFigures
    from moe_pipe.shared.telemetry import CsvWriter
    from moe_pipe.shared.wire.messages import RunInfo, TokenRecord

    pytest.importorskip("matplotlib")
    model = tmp_path / "big-model.gguf"
    model.write_bytes(b"")
    info = RunInfo("r", 0.0, {"io.io_threads": 4}, {}, 512 << 20, 0.1)
    with CsvWriter(tmp_path / "moe-pipe-1.csv", info) as w:
        for i in range(1, 21):
            w.write(TokenRecord(i, 100.0, 60.0, 150.0, 1000, 50.0 + i, 40.0, 0.0, 0, 50.0))
    (tmp_path / "llama-1.csv").write_text("step,wall_ms,token\n" + "".join(f"{i},200.0,{i}\n" for i in range(1, 21)) + "# done load_s=1\n")
    (tmp_path / "llama-2.csv").write_text("step,wall_ms,token\n1,900.0,5\n")

    def fig(engine, label, run, csv, finished=True, budget=None):
        return RunFigures(engine, label, run, 20, finished, 1.0, 1.0, 1.0, 1.0, budget_mib=budget, csv=csv)

    rows = [
        fig("moe-pipe", "moe-pipe", 1, "moe-pipe-1.csv", budget=512.0),
        fig("llama.cpp", "llama.cpp mmap", 1, "llama-1.csv"),
        fig("llama.cpp", "llama.cpp mmap (killed, exit -9)", 2, "llama-2.csv", finished=False),
    ]
    return BenchPlan(model, out=tmp_path), rows


def test_per_token_plot_shows_every_curve_marks_a_killed_run_and_explains_io(bench_runs):
    import matplotlib.pyplot as plt

    from moe_pipe.shared.analysis.benchmark import per_token_figure

    plan, rows = bench_runs
    fig = per_token_figure(plan, rows)
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        legend = ax.get_legend()
        assert not legend.get_window_extent().overlaps(ax.get_window_extent())  # beside the curves, over none
        killed = [ln for ln in ax.get_lines() if "#2" in ln.get_label()]
        assert len(killed) == 1 and "ended at token 1" in killed[0].get_label()
        assert killed[0].get_marker() not in (None, "", "None")  # one point: visible only as a marker
        caption = " ".join(t.get_text() for t in fig.texts)
        assert "io" in caption and "4 lanes" in caption and "above wall" in caption
    finally:
        plt.close(fig)


def test_hit_rate_plot_names_the_model_and_the_budget(bench_runs):
    import matplotlib.pyplot as plt

    from moe_pipe.shared.analysis.benchmark import hit_rate_figure, write_plots

    plan, rows = bench_runs
    fig = hit_rate_figure(plan, rows)
    try:
        title = fig.axes[0].get_title()
        assert "big-model.gguf" in title and "512 MiB" in title
    finally:
        plt.close(fig)
    assert [p.name for p in write_plots(plan, rows)] == ["per-token.png", "hit-rate.png"]
