"""bench/bench_report.py: bad input is one line and exit 2; a whole report on the tiny model (slow tier)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_report  # noqa: E402


@pytest.mark.parametrize("argv,says", [(["--tokens", "0"], "must be positive"), (["--model", "/nonexistent.gguf"], "no such file")])
def test_bad_input_is_one_line_and_exit_2(argv, says, tmp_path, capsys):
    assert bench_report.main([*argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
@pytest.mark.integration
def test_a_report_on_the_tiny_model_has_every_part(tmp_path):
    from moe_pipe.shared import quant
    from moe_pipe.shared.makemodel.maker import make_model

    model = make_model("qwen3moe", "tiny", tmp_path / "tiny.gguf")
    out = tmp_path / "report"
    assert bench_report.main(["--model", str(model), "--out", str(out), "--tokens", "3", "--seconds", "0.5", "--note", "a test"]) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    assert rep["machine"]["int8_dot"] == quant.INT8_DOT
    assert rep["machine"]["io_align_bytes"] % rep["machine"]["page_bytes"] == 0
    assert set(rep["kernels"]) == set(bench_report.TYPES) and all(v["1t_gweights_s"] > 0 for v in rep["kernels"].values())
    assert rep["streamed"]["tokens"] == 3 and rep["streamed"]["slab_bytes"] % rep["streamed"]["io_align"] == 0
    assert rep["doctor"]["expert_bytes"] > 0
    md = out.with_suffix(".md").read_text()
    for heading in ("## Machine", "## Storage", "## Kernel rates per type", "## Streamed run", "> a test"):
        assert heading in md
