"""`moe-pipe models` and `moe-pipe up CATALOG_NAME` on a model pulled from the
loopback hub of test_pull.py (the tiny model, served as the catalog's
Qwen3-30B-A3B repository so that the catalog entry finds it)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from moe_pipe.cli.main import main
from moe_pipe.shared.hub import catalog

from .test_pull import hub, repo_files  # noqa: F401  (fixtures)

CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
ENTRY = catalog.get("qwen3-30b-a3b")


@pytest.fixture
def pulled(hub, repo_files, capsys) -> Path:  # noqa: F811
    hub.repos[ENTRY.repo] = {"Tiny-Q4_K_M.gguf": repo_files["Tiny-Q4_K_M.gguf"]}
    assert main(["pull", ENTRY.name]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"moe-pipe up {ENTRY.name}" in out
    return Path(json.loads((Path(os.environ["XDG_CACHE_HOME"]) / "moe-pipe" / "pulled.json").read_text())["pulled"][0]["path"])


def models_json(capsys, *args: str) -> list[dict]:
    assert main(["models", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["models"]


def test_models_lists_the_pulled_model_with_its_forecast(pulled, capsys):
    [row] = models_json(capsys)
    assert row["path"] == str(pulled) and row["catalog"] == ENTRY.name and row["repo"] == ENTRY.repo
    assert (row["arch"], row["quant"], row["shards"]) == ("qwen3moe", "Q4_K_M", 1)
    assert row["file_bytes"] == pulled.stat().st_size and row["config"].endswith("configs/qwen30b.toml")
    assert row["fits"] is True and row["resident"] is True and row["hit_pct"] == 100.0
    # no measurement stored yet: the speed says how to get one
    assert row["tok_s"] is None and "--measure" in row["speed_note"]


@pytest.mark.slow  # measures reads and kernels (and may compile them): ~8 s
def test_models_measure_stores_the_speeds_and_later_listings_reuse_them(pulled, capsys):
    [measured] = models_json(capsys, "--measure", "--seconds", "0.5")
    assert measured["tok_s"] > 0 and measured["read_gbps"] > 0 and measured["bottleneck"] == "compute"
    stored = json.loads((Path(os.environ["XDG_CACHE_HOME"]) / "moe-pipe" / "measurements.json").read_text())
    assert stored["reads"] and stored["kernels"]
    [again] = models_json(capsys)  # the stored measurement, not a new one
    assert again["tok_s"] == measured["tok_s"] and again["read_measured_at"] == measured["read_measured_at"]


def test_models_takes_a_path_and_the_catalog_lists_what_is_pulled(pulled, tiny_model, capsys):
    rows = models_json(capsys, str(tiny_model))
    assert [r["path"] for r in rows] == [str(pulled), str(tiny_model)] and rows[1]["catalog"] is None
    assert main(["models", "--catalog", "--json"]) == 0
    by_name = {r["name"]: r for r in json.loads(capsys.readouterr().out)["catalog"]}
    assert by_name[ENTRY.name]["pulled"] == str(pulled) and by_name["gpt-oss-120b"]["pulled"] is None
    assert by_name["gpt-oss-120b"]["mix"].startswith("experts MXFP4") and "Q6_K" in by_name[ENTRY.name]["mix"]
    assert main(["models", "missing.gguf"]) == 2


COMMANDS_TAKING_A_MODEL = [
    ["run", "-p", "hi"],
    ["inspect"],  # doctor forecasts a model not pulled: tests/test_preview.py
    ["bench"],
    ["warmup"],
    ["models"],
    ["up"],
    ["chat"],
]


@pytest.mark.parametrize("command", COMMANDS_TAKING_A_MODEL, ids=lambda c: c[0])
def test_a_catalog_name_not_pulled_gives_the_pull_command(command, tmp_path, monkeypatch, capsys):
    """Every command that takes a model takes a catalog name: not pulled is one short line with
    the exact pull command; a misspelt one names the nearest catalog names."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # chat: no service running here
    cmd, *rest = command
    assert main([cmd, "gpt-oss-20b", *rest]) == 2
    assert capsys.readouterr().err == (
        "moe-pipe: error: gpt-oss-20b is not pulled yet: `moe-pipe pull ggml-org/gpt-oss-20b-GGUF:MXFP4` fetches it (12.1 GB)\n"
    )
    assert main([cmd, "qwen3-30b", *rest]) == 2
    assert capsys.readouterr().err == (
        "moe-pipe: error: qwen3-30b: no such file, and not a catalog name; "
        "did you mean qwen3-30b-a3b or qwen3.6-35b-a3b or qwen3.5-35b-a3b? (moe-pipe models --catalog lists them)\n"
    )


def test_pull_a_misspelt_catalog_name_names_the_nearest(capsys):
    assert main(["pull", "qwen3-30b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean qwen3-30b-a3b" in err and "ORG/NAME[:QUANT]" in err


def test_a_pulled_catalog_name_is_its_file_for_every_command(pulled, capsys):
    """run/doctor/bench/warmup/up load the entry's recipe over the pulled file; inspect and models read the file."""
    from moe_pipe.cli import run_cmd
    from moe_pipe.cli.inspect_cmd import model_path

    assert model_path(ENTRY.name) == str(pulled)
    args = argparse.Namespace(model=ENTRY.name, config_set=[])
    cfg = run_cmd.load_run_config(args)
    assert cfg.model.path == str(pulled) and cfg.source.endswith("configs/qwen30b.toml")
    [row] = models_json(capsys, ENTRY.name)  # the pulled row, not listed twice
    assert row["path"] == str(pulled)
    assert main(["inspect", ENTRY.name, "--json"]) == 0 and json.loads(capsys.readouterr().out)["arch"] == "qwen3moe"


@pytest.mark.slow  # a whole service up and down: ~15 s on 2 cores
@pytest.mark.integration
def test_up_a_pulled_catalog_name_serves_it(pulled):
    env = {**os.environ, "XDG_RUNTIME_DIR": tempfile.mkdtemp(prefix="mpc", dir="/tmp")}
    up = subprocess.run(
        [*CLI, "up", ENTRY.name, "--detach", "--port", "0", "-t", "1"], env=env, capture_output=True, text=True, timeout=300
    )
    try:
        assert up.returncode == 0, up.stderr
        assert f"as '{ENTRY.name}'" in up.stdout
        url = up.stdout.split(" at ")[1].split(" as ")[0]
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            assert r.status == 200
        status = json.loads(subprocess.run([*CLI, "status", "--json"], env=env, capture_output=True, text=True, timeout=60).stdout)
        assert status["model"] == str(pulled) and status["config"].endswith("configs/qwen30b.toml")
    finally:
        down = subprocess.run([*CLI, "down", "--name", ENTRY.name], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
