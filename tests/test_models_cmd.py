"""`moe-pipe models` and `moe-pipe up CATALOG_NAME` on a model pulled from the
loopback hub of test_pull.py (the tiny model, served as the catalog's
Qwen3-30B-A3B repository so that the catalog entry finds it)."""

from __future__ import annotations

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


def test_up_a_catalog_name_not_pulled_gives_the_pull_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["up", "gpt-oss-20b"]) == 2
    assert "run `moe-pipe pull ggml-org/gpt-oss-20b-GGUF:MXFP4` first" in capsys.readouterr().err
    assert main(["up", "no-such-model"]) == 2
    assert "not a catalog model; the catalog: qwen3-30b-a3b" in capsys.readouterr().err


@pytest.mark.slow  # a whole service up and down: ~15 s on 2 cores
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
