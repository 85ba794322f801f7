"""The command line: exit codes, one-line errors, inspect's JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_pipe.cli.main import COMMANDS, main

from .ggufgen import write_qwen_like

INSPECT_KEYS = {
    "arch",
    "n_layer",
    "n_expert",
    "n_expert_used",
    "expert_bytes",
    "dense_bytes",
    "file_bytes",
    "routed_bytes_per_token",
    "quant_types",
}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_qwen_like(tmp_path_factory.mktemp("cli") / "small.gguf", n_layer=3)


def test_inspect_json(small, capsys):
    assert main(["inspect", str(small), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert INSPECT_KEYS <= set(out)
    assert out["arch"] == "qwen3moe" and out["n_layer"] == 3 and out["n_expert"] == 4 and out["n_expert_used"] == 2
    assert out["file_bytes"] == small.stat().st_size
    assert out["routed_bytes_per_token"] == 3 * 2 * out["expert_bytes"]
    assert out["quant_types"]["experts"] == {"Q8_0": 9}
    assert out["quant_types"]["dense"]["F32"] > 0
    assert out["dense_bytes"] + out["expert_bytes_total"] < out["file_bytes"]


def test_inspect_table(small, capsys):
    assert main(["inspect", str(small)]) == 0
    out = capsys.readouterr().out
    assert "qwen3moe" in out and "smallest useful cache" in out and "Q8_0 ×9" in out


@pytest.mark.integration
def test_bad_file_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\0" * 100)
    r = subprocess.run([sys.executable, "-m", "moe_pipe.cli.main", "inspect", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "Traceback" not in r.stderr


@pytest.mark.integration
def test_unknown_command_and_bad_flag():
    r = subprocess.run([sys.executable, "-m", "moe_pipe.cli.main", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2
    r = subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", "make-model", "--arch", "mamba", "-o", "x.gguf"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "invalid choice" in r.stderr


# Real-model facts (docs/formats.md § Real files' quant mixes): what the shape presets must reproduce.
SHAPE_FACTS = {
    ("qwen3moe", "qwen30b-shape"): dict(
        n_layer=48,
        n_expert=128,
        n_expert_used=8,
        per_layer={2654208, 3059712},
        file_gib=17.28,
        routed_gb=1.10,
        experts={"Q4_K": 120, "Q6_K": 24},
    ),
    ("gpt-oss", "gptoss120b-shape"): dict(
        n_layer=36,
        n_expert=128,
        n_expert_used=4,
        per_layer={13219200 + 34560},
        file_gib=59.02,
        routed_gb=1.91,
        experts={"MXFP4": 108, "F32": 108},
    ),
    ("gemma4", "gemma26b-shape"): dict(
        n_layer=30, n_expert=128, n_expert_used=8, per_layer={3593216, 4336640}, file_gib=None, routed_gb=0.95, experts=None
    ),
}


def _inspect_json(path, capsys):
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("arch,preset", list(SHAPE_FACTS))
def test_inspect_shape_presets(arch, preset, tmp_path, capsys):
    from moe_pipe.shared.makemodel.maker import make_model

    # Full depth and width, data left as a hole: the header and sizes are exact.
    path = make_model(arch, preset, tmp_path / "m.gguf", sparse=True)
    out, facts = _inspect_json(path, capsys), SHAPE_FACTS[(arch, preset)]
    assert (out["arch"], out["n_layer"], out["n_expert"], out["n_expert_used"]) == (
        arch,
        facts["n_layer"],
        facts["n_expert"],
        facts["n_expert_used"],
    )
    assert set(out["expert_bytes_per_layer"]) == facts["per_layer"]
    assert out["expert_bytes"] == max(facts["per_layer"])
    if facts["file_gib"]:  # llama.cpp's "file size" line is the sum of tensor bytes
        assert round((out["dense_bytes"] + out["row_bytes"] + out["expert_bytes_total"]) / 2**30, 2) == facts["file_gib"]
    assert round(out["routed_bytes_per_token"] / 1e9, 2) == facts["routed_gb"]
    if facts["experts"]:
        assert out["quant_types"]["experts"] == facts["experts"]
    assert out["routed_bytes_per_token"] == sum(out["expert_bytes_per_layer"]) * out["n_expert_used"]
    assert out["dense_bytes"] + out["row_bytes"] + out["expert_bytes_total"] <= out["file_bytes"]
    assert out["min_cache_bytes"] >= out["routed_bytes_per_token"]


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "gemma4"])
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_inspect_made_presets(arch, preset, tmp_path, capsys):
    path = tmp_path / "m.gguf"
    assert main(["make-model", "--arch", arch, "--preset", preset, "-q", "-o", str(path)]) == 0
    out = _inspect_json(path, capsys)
    assert out["arch"] == arch and out["file_bytes"] == path.stat().st_size
    assert out["routed_bytes_per_token"] == sum(out["expert_bytes_per_layer"]) * out["n_expert_used"]
    assert out["expert_bytes_total"] == sum(out["expert_bytes_per_layer"]) * out["n_expert"]
    assert out["quant_types"]["experts"] and out["quant_types"]["dense"]["F32"] > 0


def test_every_command_and_flag_is_documented():
    """docs/cli.md has a section per command and names each of its own flags
    (config overrides are documented in docs/configuration.md, from the schema)."""
    import argparse
    from pathlib import Path

    from moe_pipe.cli.main import COMMANDS, build_parser
    from moe_pipe.shared.config import KEYS

    root = Path(__file__).resolve().parents[1]
    cli_doc = (root / "docs" / "cli.md").read_text()
    config_flags = {f for k in KEYS.values() for f in k.spec.flags} | {"--set"}
    config_flags |= {"--no-" + k.spec.flags[0][2:] for k in KEYS.values() if k.spec.kind == "bool" and k.spec.flags}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name in COMMANDS:
        if f"## {name}\n" not in cli_doc:
            missing.append(f"section ## {name}")
        for action in sub.choices[name]._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and flag not in config_flags and flag not in cli_doc:
                    missing.append(f"{name} {flag}")
    assert not missing, f"docs/cli.md does not mention: {missing}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_help(command, capsys):
    # argparse formats help text with %: a literal "%" in a setting's doc once made `run --help` a traceback.
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert f"usage: moe-pipe {command}" in capsys.readouterr().out


def _parsed(argv: list[str]):
    import argparse

    from moe_pipe.cli import run_cmd

    p = argparse.ArgumentParser()
    run_cmd.add_arguments(p)
    return p.parse_args(argv)


def test_top_k_is_sampling_and_sample_top_k_is_its_old_name(capsys):
    """`run --top-k` is llama.cpp's sampling top-k (generate.top_k); `--sample-top-k` still works
    for a release with one line saying so; experts per token are --n-expert-used."""
    from moe_pipe.cli.run_cmd import load_run_config

    cfg = load_run_config(_parsed(["-p", "x", "--top-k", "40", "--n-expert-used", "1"]))
    assert (cfg.generate.top_k, cfg.compute.n_expert_used) == (40, 1)
    assert capsys.readouterr().err == ""
    cfg = load_run_config(_parsed(["-p", "x", "--sample-top-k", "7"]))
    assert cfg.generate.top_k == 7 and cfg.compute.n_expert_used is None
    assert capsys.readouterr().err.splitlines() == [
        "moe-pipe: --sample-top-k is now --top-k, sampling top-k as llama.cpp's (the old name goes in the next release)"
    ]


def test_run_holds_no_tokenizer_while_the_pipeline_runs(tiny_model, monkeypatch, capsys):
    """`run`'s own process drops the tokenizer once the prompt is tokens: compute detokenizes,
    and what this process holds when the pipeline probes memory comes out of the expert cache."""
    import gc

    from moe_pipe.cli import run_cmd
    from moe_pipe.shared.text.tokenizer import Tokenizer

    alive: list[int] = []

    def pipeline(cfg, model_path, prompt_tokens, params, args, on_text):
        alive.append(sum(isinstance(o, Tokenizer) for o in gc.get_objects()))
        assert prompt_tokens
        return {"timings": {}, "tokens": [], "finish_reason": "length"}

    monkeypatch.setattr(run_cmd, "_run_pipeline", pipeline)
    assert run_cmd.run(_parsed([str(tiny_model), "-p", "hello there", "-n", "2", "--output-format", "json"])) == 0
    assert alive == [0]
    assert json.loads(capsys.readouterr().out)["finish_reason"] == "length"
