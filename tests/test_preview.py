"""A forecast before the download (shared/hub/preview.py; `doctor NAME`,
`models --catalog --forecast`): over a loopback hub (tests/rangehub.py) the
catalog's qwen3-30b-a3b is served as Qwen3-30B-A3B's width cut to 2 layers
(holes, a 3.5 MB header). The forecast from the fetched header is the
doctor's on the whole file, figure for figure; a second look asks the hub
nothing; offline (HF_HUB_OFFLINE, a refused connection) it is the catalog
shape's, said to be an estimate, in seconds; garbage on the hub is one line
and exit code 2. The kernels' speed is a fixed fake: measuring is
tests/test_forecast.py's, and compiling every kernel type here would cost
the default tier half a minute."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moe_pipe.cli.main import main
from moe_pipe.shared.analysis import forecast as fc
from moe_pipe.shared.analysis.standin import StepTime
from moe_pipe.shared.experts.budget import MemoryProbe
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.hub import catalog
from moe_pipe.shared.hub.preview import open_preview
from moe_pipe.shared.hub.resolve import unpulled_model
from moe_pipe.shared.makemodel.maker import make_model

ENTRY = catalog.get("qwen3-30b-a3b")
FILE = "Qwen3-30B-A3B-Q4_K_M.gguf"
HOST = MemoryProbe(64 << 30)  # verdicts must not depend on this machine's free RAM
# what differs between two forecasts of one model: its name, the words on the reads, the clock
VARIES = {"model", "read_note", "measure_s", "load_avg_1m"}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return make_model("qwen3moe", "qwen30b-shape", tmp_path_factory.mktemp("q") / FILE, layers=2, sparse=True)


@pytest.fixture(autouse=True)
def fixed_kernels(monkeypatch):
    def measure_kernels(classes, threads, seconds=2.0, rotate_bytes=0):
        return {(c.key, n): 2e9 * n for c in classes for n in threads}

    monkeypatch.setattr(fc, "measure_kernels", measure_kernels)
    # the stand-in decode step runs for the header as for the whole file; its time is fixed here too
    monkeypatch.setattr(fc, "time_steps", lambda mf, top_k, points: {p: StepTime(0.01, 6, 0.0) for p in points})


@pytest.fixture
def hub(range_hub, qwen2):
    range_hub.repos[ENTRY.repo] = {FILE: qwen2, "README.md": qwen2}
    return range_hub


def doctor(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["doctor", *args, "--seconds", "0.05", "--mem-limit-mb", "4000"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_forecast_from_the_fetched_header_is_the_doctors_on_the_whole_file(hub, qwen2):
    cfg, entry = unpulled_model(ENTRY.name, {})
    assert entry is ENTRY and not cfg.model.path and cfg.source.endswith("qwen30b.toml")
    with open_preview(entry) as pv:
        assert pv.source == "header" and pv.requests <= 3
        assert pv.fetched_bytes < qwen2.stat().st_size / 100  # a few MB of 0.8 GB
        before = fc.forecast(pv.mf, cfg, memory=HOST, seconds=0.05)
    with open_model(qwen2) as mf:
        after = fc.forecast(mf, cfg, memory=HOST, seconds=0.05)
    assert {k: v for k, v in before.items() if k not in VARIES} == {k: v for k, v in after.items() if k not in VARIES}
    assert before["n_layer"] == 2 and before["file_bytes"] == qwen2.stat().st_size


def test_doctor_name_says_its_source_and_the_pull_command_and_asks_nothing_the_second_time(hub, capsys):
    code, out, err = doctor(capsys, ENTRY.name)
    assert code == 0, err
    rows = dict(line.split(None, 1) for line in out.splitlines())
    assert rows["model"].startswith(f"{ENTRY.name} ({ENTRY.repo}:Q4_K_M): qwen3moe, 2 layers")
    assert rows["source"].startswith("from the file's header, fetched by range request (") and rows["source"].endswith("cached)")
    assert rows["pull"].startswith(f"`moe-pipe pull {ENTRY.repo}:Q4_K_M` fetches it")
    asked = dict(hub.requests)
    code, out, err = doctor(capsys, str(catalog.CONFIGS_DIR / "qwen30b.toml"), "--json")  # a recipe naming the entry
    f = json.loads(out)
    assert code == 0 and f["source"] == "header" and "fetched earlier" in f["source_note"] and f["pull"] == ENTRY.pull_command
    assert hub.requests == asked


def test_offline_the_forecast_is_the_catalog_shapes_and_says_so(range_hub, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t = time.perf_counter()
    code, out, err = doctor(capsys, ENTRY.name, "--json")
    assert time.perf_counter() - t < 10 and code == 0, err
    f = json.loads(out)
    assert f["source"] == "shape" and f["source_note"].startswith("an estimate from the catalog's shape facts (qwen30b-shape")
    assert "HF_HUB_OFFLINE" in f["source_note"] and "not pulled" in f["source_note"]
    assert f["n_layer"] == 48 and f["n_expert"] == 128 and f["file_bytes"] == ENTRY.file_bytes  # the real model's shape
    assert range_hub.requests == {}


def test_a_refused_connection_falls_back_to_the_shape_within_seconds(range_hub, monkeypatch):
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    t = time.perf_counter()
    with open_preview(ENTRY) as pv:
        assert pv.source == "shape" and "connection refused" in pv.note and pv.offline
    assert time.perf_counter() - t < 5


def test_garbage_on_the_hub_is_one_line_and_exit_code_2(hub, capsys):
    hub.garbage.add(f"{ENTRY.repo}/{FILE}")
    code, out, err = doctor(capsys, ENTRY.name)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith(f"moe-pipe: error: {ENTRY.repo}/{FILE}: ") and "Traceback" not in err


def test_models_catalog_forecast_gives_each_entry_a_forecast_and_its_source(hub, monkeypatch, capsys):
    lfm = catalog.get("lfm2-8b-a1b")  # not on this hub: its shape
    monkeypatch.setattr(catalog, "CATALOG", (ENTRY, lfm))
    assert main(["models", "--catalog", "--forecast", "--json", "--mem-limit-mb", "4000", "--seconds", "0.05"]) == 0
    out = capsys.readouterr()
    rows = {r["name"]: r for r in json.loads(out.out)["catalog"]}
    qwen, other = rows[ENTRY.name]["forecast"], rows[lfm.name]["forecast"]
    assert qwen["source"] == "header" and qwen["fits"] is True and qwen["tok_s"] > 0
    assert other["source"] == "shape" and "no header" in other["source_note"] and other["offline"] is None
    assert other["fits"] is True and other["tok_s"] > 0
    assert "models: lfm2-8b-a1b (2/2)" in out.err  # the status line as it works
    assert main(["models", "--catalog", "--forecast", "--mem-limit-mb", "4000"]) == 0
    table = capsys.readouterr().out
    assert "its header" in table and "catalog shape (estimate)" in table and "tok/s" in table


def test_a_misspelt_name_names_the_nearest_and_asks_nothing(range_hub, capsys):
    assert main(["doctor", "qwen3-30b"]) == 2
    assert "qwen3-30b: no such file, and not a catalog name; did you mean qwen3-30b-a3b" in capsys.readouterr().err
    assert range_hub.requests == {}


def test_forecast_goes_with_catalog(capsys):
    assert main(["models", "--forecast"]) == 2
    assert "--forecast goes with --catalog" in capsys.readouterr().err
