"""Config: the whole schema walked (wrong types, out-of-range values), presets, overrides, docs in step."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from moe_pipe.shared import config as C
from moe_pipe.shared import config_flags as F
from moe_pipe.shared.config import KEYS, SCHEMA, TABLES, Config, load_config, toml_repr
from moe_pipe.shared.errors import ConfigError
from moe_pipe.shared.hub.resolve import load_runnable, model_file

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "configs").glob("*.toml"))


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def one_key(tmp_path: Path, key: C.Key, value_toml: str) -> Path:
    return write(tmp_path, f"# a comment\n[{key.table}]\n{key.name} = {value_toml}\n")


def wrong_type(key: C.Key) -> str:
    """A TOML value of the wrong type for this key."""
    return {"int": '"four"', "float": '"fast"', "bool": "1", "str": "5", "path": "5", "choice": "7", "mb": "true"}[key.spec.kind]


def out_of_range(key: C.Key) -> list[str]:
    s = key.spec
    if s.kind == "choice":
        return ['"bogus"']
    if s.kind not in ("int", "float", "mb"):
        return []
    vals = []
    if s.lo is not None:
        vals.append(s.lo if s.lo_open else s.lo - 1)
    if s.hi is not None:
        vals.append(s.hi * 2 + 1)
    return [str(int(v)) if s.kind == "int" else repr(float(v)) for v in vals]


# ---------------------------------------------------------------- the schema walk


@pytest.mark.parametrize("key", SCHEMA, ids=lambda k: k.dotted)
def test_wrong_type_names_key_file_value_and_allowed(tmp_path, key):
    p = one_key(tmp_path, key, wrong_type(key))
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert key.dotted in msg and str(p) in msg and "wrong type" in msg and "allowed:" in msg, msg
    assert f"{p}:3:" in msg, msg  # the line of the key
    assert "\n" not in msg


@pytest.mark.parametrize("key", [k for k in SCHEMA if out_of_range(k)], ids=lambda k: k.dotted)
def test_out_of_range_names_key_file_value_and_allowed(tmp_path, key):
    for bad in out_of_range(key):
        p = one_key(tmp_path, key, bad)
        with pytest.raises(ConfigError) as exc:
            load_config(p)
        msg = str(exc.value)
        assert key.dotted in msg and str(p) in msg and "allowed:" in msg, msg
        assert "out of range" in msg or "not allowed" in msg, msg
        shown = bad.strip('"')
        assert shown in msg or shown.rstrip("0").rstrip(".") in msg, (bad, msg)


@pytest.mark.parametrize("key", SCHEMA, ids=lambda k: k.dotted)
def test_default_is_valid_and_round_trips(tmp_path, key):
    assert C._check(key, key.default) == key.default
    if key.default is not None:
        p = one_key(tmp_path, key, toml_repr(key.default))
        cfg = load_config(p)
        assert getattr(getattr(cfg, key.table), key.name) == key.default


@pytest.mark.parametrize("key", [k for k in SCHEMA if k.spec.flags], ids=lambda k: k.dotted)
def test_every_flag_rejects_a_bad_value(key):
    parser = argparse.ArgumentParser()
    F.add_override_arguments(parser)
    if key.spec.kind == "bool":
        args = parser.parse_args([key.spec.flags[0]])
        assert F.overrides_from_args(args) == {key.dotted: True}
        return
    bad = {"int": "lots", "float": "lots", "mb": "lots", "choice": "bogus"}.get(key.spec.kind)
    if bad is None:  # strings and paths: any text is a value; "" is the bad one
        bad = ""
    args = parser.parse_args([key.spec.flags[-1], bad])
    with pytest.raises(ConfigError) as exc:
        F.overrides_from_args(args)
    assert key.dotted in str(exc.value) and key.spec.flags[-1] in str(exc.value)


def test_schema_shape():
    assert list(TABLES) == ["model", "cache", "io", "compute", "generate", "telemetry", "supervisor", "gateway"]
    names = [k.name for k in SCHEMA]
    assert len(names) == len(set(names)), "argparse dests are key names: they must be unique"
    for k in SCHEMA:
        assert k.spec.doc and "\n" not in k.spec.doc
        assert k.spec.kind in ("int", "float", "bool", "str", "path", "choice", "mb")
        if k.spec.kind == "choice":
            assert k.default in k.spec.choices
    for f in dataclasses.fields(Config):  # frozen all the way down
        assert f.name == "source" or dataclasses.is_dataclass(f.type if isinstance(f.type, type) else TABLES[f.name])
    for cls in TABLES.values():
        assert cls.__dataclass_params__.frozen


def test_types_are_strict(tmp_path):
    cases = [
        ("compute", "threads", "4.0", "wrong type"),
        ("compute", "threads", "true", "wrong type"),
        ("compute", "overlap", '"yes"', "wrong type"),
        ("cache", "cache_mb", '"lots"', "wrong type"),
        ("cache", "cache_mb", "nan", "finite"),
        ("cache", "cache_ceil_mb", "inf", "finite"),
        ("io", "dense_weights", '"anno"', 'did you mean "anon"'),
    ]
    for table, name, value, want in cases:
        p = write(tmp_path, f"[{table}]\n{name} = {value}\n")
        with pytest.raises(ConfigError, match=re.escape(want)):
            load_config(p)


def test_fractional_cache_and_ints_for_floats(tmp_path):
    cfg = load_config(write(tmp_path, "[cache]\ncache_mb = 0.25\ncache_ceil_mb = 1\n"))
    assert cfg.cache.cache_mb == 0.25 and cfg.cache.cache_ceil_mb == 1.0 and isinstance(cfg.cache.cache_ceil_mb, float)


# ---------------------------------------------------------------- unknown names


@pytest.mark.parametrize(
    "text,want",
    [
        ("[cache]\ncache_mbb = 5\n", 'unknown key cache.cache_mbb (did you mean "cache_mb"?)'),
        ("[cach]\ncache_mb = 5\n", 'unknown table [cach] (did you mean "cache"?)'),
        ("[io]\nthreads = 2\n", 'unknown key io.threads (threads belongs in [compute]; or did you mean "io_threads"?)'),
        ("cache_mb = 5\n", "key cache_mb must be inside a table: write it under [cache]"),
        ("[cache]\npolicyy = 1\n", 'did you mean "policy"?'),
        ("[compute]\nzzz = 1\n", "keys of [compute]: threads, overlap"),
        ("modle = 1\n", 'unknown top-level key modle (did you mean "model"?)'),
    ],
)
def test_unknown_names_suggest(tmp_path, text, want):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert want in str(exc.value) and str(p) in str(exc.value)


def test_unknown_override_suggests():
    with pytest.raises(ConfigError, match='did you mean "cache_mb"'):
        C.apply_overrides(Config(), {"cache.cache_md": 3})
    with pytest.raises(ConfigError, match="unknown key"):
        C.apply_overrides(Config(), {"nothing": 3})


def test_bad_toml_names_file_and_line(tmp_path):
    p = write(tmp_path, "[cache]\ncache_mb = 5\ncache_ceil_mb = = 3\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert str(exc.value).startswith(f"{p}:3: invalid TOML")
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")
    bad = tmp_path / "bin.toml"
    bad.write_bytes(b"\xff\xfe[")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_cross_check_backoff(tmp_path):
    with pytest.raises(ConfigError, match="backoff_cap_s"):
        load_config(write(tmp_path, "[supervisor]\nbackoff_s = 10\nbackoff_cap_s = 5\n"))


# ---------------------------------------------------------------- model path


def test_model_path_missing_says_how_to_get_one(tmp_path):
    p = write(tmp_path, '[model]\npath = "nope.gguf"\n')
    assert load_config(p).model.path == str(tmp_path / "nope.gguf")  # parsed only: the file is the runner's to find
    with pytest.raises(ConfigError) as exc:
        load_runnable(p)
    msg = str(exc.value)
    assert str(tmp_path / "nope.gguf") in msg and "moe-pipe make-model" in msg and "moe-pipe convert" in msg
    with pytest.raises(ConfigError, match="is a folder"):
        load_runnable(write(tmp_path, '[model]\npath = "."\n'))


def test_relative_model_path_is_read_from_the_config_folder(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.gguf").write_bytes(b"GGUF")
    p = write(tmp_path / "m", '[model]\npath = "x.gguf"\n[telemetry]\ncsv = "out/run.csv"\n')
    monkeypatch.chdir("/")
    cfg = load_config(p)
    assert cfg.model.path == str(tmp_path / "m" / "x.gguf") and cfg.telemetry.csv == str(tmp_path / "m" / "out" / "run.csv")
    assert model_file(cfg) == tmp_path / "m" / "x.gguf"
    # a path typed on the command line is the shell's: relative to the current folder
    monkeypatch.chdir(tmp_path)
    cfg2 = load_config(p, {"telemetry.csv": "here.csv"})
    assert cfg2.telemetry.csv == str(tmp_path / "here.csv")


def test_embedded_model_is_the_default():
    cfg = load_config(None)
    assert cfg == Config() and cfg.model.path == "tiny" and cfg.source is None


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads(preset):
    cfg = load_config(preset)
    assert cfg.source == str(preset)
    if preset.name == "tiny.toml":
        assert load_config(preset).model.path == "tiny"
        return
    # real-model presets: the recipe is there, the model path is the user's to set
    assert cfg.model.path == "" and cfg.model.name
    assert cfg.cache.cache_mb == "auto" and cfg.compute.overlap and cfg.io.io_threads == 4 and cfg.compute.threads == 4
    assert cfg.cache.cache_ceil_mb == "auto"  # the platform decides: docs/configuration.md
    assert cfg.generate.no_think == ("gptoss" in preset.name)
    with pytest.raises(ConfigError) as exc:
        load_runnable(preset)
    assert "model.path is not set" in str(exc.value) and cfg.model.name in str(exc.value) and str(preset) in str(exc.value)
    fixed = load_runnable(preset, {"model.path": "tiny"})
    assert fixed.model.path == "tiny"


def test_presets_comment_every_key():
    for preset in PRESETS:
        for no, line in enumerate(preset.read_text().splitlines(), 1):
            if re.match(r"\s*[a-z_]+\s*=", line) and not line.lstrip().startswith("#"):
                assert "#" in line or preset.read_text().splitlines()[no - 2].lstrip().startswith("#"), (
                    f"{preset.name}:{no} has no comment: {line}"
                )


# ---------------------------------------------------------------- overrides


def test_cli_overrides_apply_without_mutation(tmp_path):
    parser = argparse.ArgumentParser()
    F.add_override_arguments(parser)
    args = parser.parse_args(
        [
            "--cache-mb",
            "0.5",
            "--cache-ceil-mb",
            "100",
            "--io-threads",
            "1",
            "-t",
            "2",
            "--no-overlap",
            "--dense-weights",
            "warm",
            "--n-expert-used",
            "2",
            "--top-k",
            "40",
            "--prefetch",
            "next-layer",
            "--csv",
            "run.csv",
            "--policy",
            "lru",
            "-c",
            "512",
            "-n",
            "9",
            "--temp",
            "0.7",
            "--seed",
            "42",
            "--no-think",
            "--port",
            "0",
            "--set",
            "supervisor.start_secs=2.5",
            "--set",
            "model.path=tiny",
            "--set",
            "gateway.api_key=s3cret",
            "--set",
            "supervisor.gateway_restart=never",
        ]
    )
    ov = F.overrides_from_args(args)
    base = load_config(ROOT / "configs" / "qwen30b.toml")
    before = base.to_dict()
    cfg = C.apply_overrides(base, ov, base=tmp_path)
    assert base.to_dict() == before  # the original is untouched
    assert (cfg.cache.cache_mb, cfg.cache.cache_ceil_mb, cfg.io.io_threads, cfg.compute.threads) == (0.5, 100.0, 1, 2)
    assert (cfg.compute.overlap, cfg.io.dense_weights, cfg.compute.n_expert_used, cfg.compute.prefetch) == (False, "warm", 2, "next-layer")
    assert cfg.generate.top_k == 40  # sampling top-k, as llama.cpp's --top-k
    assert cfg.telemetry.csv == str(tmp_path / "run.csv") and cfg.compute.ctx_size == 512
    assert (cfg.generate.max_tokens, cfg.generate.temperature, cfg.generate.seed, cfg.generate.no_think) == (9, 0.7, 42, True)
    assert cfg.supervisor.start_secs == 2.5 and cfg.model.path == "tiny" and cfg.gateway.port == 0
    assert cfg.gateway.api_key == "s3cret" and cfg.supervisor.gateway_restart == "never"
    assert cfg.source == base.source
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.cache_mb = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache = base.cache  # type: ignore[misc]


def test_flags_left_out_change_nothing():
    parser = argparse.ArgumentParser()
    F.add_override_arguments(parser)
    assert F.overrides_from_args(parser.parse_args([])) == {}
    args = parser.parse_args(["--overlap", "--think", "--n-expert-used", "none", "--cache-mb", "auto"])
    assert F.overrides_from_args(args) == {
        "compute.overlap": True,
        "generate.no_think": False,
        "compute.n_expert_used": None,
        "cache.cache_mb": "auto",
    }


def test_cold_turns_the_warm_start_off_and_warm_start_on():
    parser = argparse.ArgumentParser()
    F.add_override_arguments(parser)
    assert F.overrides_from_args(parser.parse_args(["--cold"])) == {"cache.warm_start": False}
    assert F.overrides_from_args(parser.parse_args(["--warm-start"])) == {"cache.warm_start": True}
    with pytest.raises(SystemExit):
        parser.parse_args(["--no-warm-start"])  # --cold is its off switch
    assert Config().cache.warm_start and Config().cache.warm_save_s == 30.0


def test_add_override_arguments_subset():
    parser = argparse.ArgumentParser()
    F.add_override_arguments(parser, tables=("cache", "io"))
    assert parser.parse_args(["--cache-mb", "1"]).cache_mb == "1"
    with pytest.raises(SystemExit):
        parser.parse_args(["-t", "2"])


def test_set_errors(tmp_path):
    parser = argparse.ArgumentParser()
    F.add_override_arguments(parser)
    with pytest.raises(ConfigError, match="expected TABLE.KEY=VALUE"):
        F.overrides_from_args(parser.parse_args(["--set", "cache.cache_mb"]))
    with pytest.raises(ConfigError) as exc:
        F.overrides_from_args(parser.parse_args(["--set", "supervisor.start_retries=many"]))
    assert str(exc.value).startswith('--set: supervisor.start_retries = "many": wrong type')
    with pytest.raises(ConfigError, match="^--set: unknown key supervisor.overlap \\(overlap belongs in \\[compute\\]"):
        F.overrides_from_args(parser.parse_args(["--set", "supervisor.overlap=true"]))
    with pytest.raises(ConfigError, match="overlap belongs in \\[compute\\]"):
        C.apply_overrides(Config(), {"supervisor.overlap": True})
    with pytest.raises(ConfigError) as exc:
        C.apply_overrides(Config(), {"gateway.host": 5})
    assert str(exc.value).startswith("command line: gateway.host = 5: wrong type")
    with pytest.raises(ConfigError, match="out of range"):
        load_config(None, {"compute.n_expert_used": 0})


def test_temperature_has_one_range_openais():
    """[0, 2] on the command line and in a config, as over HTTP (shared/serve/openai_api.py)."""
    assert load_config(None, {"generate.temperature": 2}).generate.temperature == 2.0
    with pytest.raises(ConfigError, match="generate.temperature = 2.5: out of range; allowed: a number >= 0 and <= 2"):
        load_config(None, {"generate.temperature": 2.5})


def test_the_old_expert_count_key_is_read_with_one_line(tmp_path, capsys, monkeypatch):
    """compute.top_k (before llama.cpp's name n_expert_used) still works for a release, in a file
    and with --set, and says so once on stderr."""
    monkeypatch.setattr(C, "_said_renamed", set())
    p = tmp_path / "old.toml"
    p.write_text("[compute]\ntop_k = 2\n")
    assert load_config(p).compute.n_expert_used == 2
    assert C.apply_overrides(Config(), {"compute.top_k": 3}).compute.n_expert_used == 3
    err = capsys.readouterr().err.splitlines()
    assert err == [f"moe-pipe: {p}:2: compute.top_k is now compute.n_expert_used (the old name goes in the next release)"]
    parser = argparse.ArgumentParser()
    F.add_override_arguments(parser)
    assert F.overrides_from_args(parser.parse_args(["--set", "compute.top_k=4"])) == {"compute.n_expert_used": 4}
    p.write_text("[compute]\ntop_k = 0\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert str(exc.value).startswith(f"{p}:2: compute.n_expert_used = 0: out of range")


# ---------------------------------------------------------------- docs cannot drift


def _documented_keys(text: str) -> set[str]:
    keys, table = set(), None
    for line in text.splitlines():
        head = re.match(r"### \[([a-z_]+)\]", line)
        if head:
            table = head.group(1)
        row = re.match(r"\| `([a-z_]+)` \|", line)
        if row and table:
            keys.add(f"{table}.{row.group(1)}")
    return keys


def test_docs_list_exactly_the_schema():
    text = (ROOT / "docs" / "configuration.md").read_text()
    documented = _documented_keys(text)
    assert documented == set(KEYS), (
        f"undocumented: {sorted(set(KEYS) - documented)}; documented but not in the schema: {sorted(documented - set(KEYS))}"
    )
    block = text[text.index(F.DOCS_BEGIN) : text.index(F.DOCS_END) + len(F.DOCS_END)]
    assert block == F.reference_markdown(), "docs/configuration.md is stale: run python -m moe_pipe.shared.config_flags --docs"


# ---------------------------------------------------------------- the schema walk, through the command line
#
# Every key, every kind of bad value it can be given, by each way a user can
# give it: a TOML file, --set, and the key's own flag. Each must end in exit
# code 2 and one line naming the key, the value and what is allowed.


def bad_values(key: C.Key) -> list[str]:
    """TOML literals this key must refuse: the wrong type, out of range / not allowed, and for text keys a
    control character, an over-long value and (for keys with a pattern) a value the pattern refuses."""
    out = [wrong_type(key), *out_of_range(key)]
    if key.spec.kind in ("str", "path"):
        out += ['"a\\u0001b"', '"' + "x" * (C.MAX_TEXT + 1) + '"']
    if key.spec.pattern:
        out.append('"no spaces allowed"')
    return out


def flag_text(key: C.Key, literal: str) -> str | None:
    """What a user would type after the key's flag for this bad value (None: a flag cannot say it)."""
    value = tomllib.loads(f"v = {literal}")["v"]
    if key.spec.kind in ("str", "path") and not isinstance(value, str):
        return None  # any text after a string flag is a string: the wrong type cannot be typed
    return value if isinstance(value, str) else toml_repr(value)


def shown(key: C.Key, value) -> str:
    """How the error shows a value: as TOML, numbers typed after a flag as numbers; a secret as C.REDACTED."""
    if key.spec.secret:
        return toml_repr(C.REDACTED)
    if isinstance(value, str) and key.spec.kind in ("int", "float", "mb"):
        try:
            value = int(value, 0) if key.spec.kind == "int" else float(value)
        except ValueError:
            pass
    return toml_repr(value)[:100]  # long values are cut short in the message


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run `moe-pipe ARGS` in-process; return (exit code, the one stderr line). A config that
    passes would start the service: that is a failure of the test, not a hang."""
    from moe_pipe.cli import up_cmd
    from moe_pipe.cli.main import main

    def started(*a, **k):
        raise AssertionError("the config was accepted and the service would start")

    monkeypatch.setattr(up_cmd, "_serve", started)
    monkeypatch.setattr(up_cmd, "_detach", started)

    def run(*argv: str) -> tuple[int, str]:
        code = main(list(argv))
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
        assert lines[0].startswith("moe-pipe: error: ") and captured.out == "", lines
        return code, lines[0]

    return run


def ways_to_give(key: C.Key, literal: str, tmp_path: Path) -> list[tuple[list[str], str, object]]:
    """(moe-pipe arguments, where the error must say it came from, the value as given) for each way
    to give this bad value."""
    value = tomllib.loads(f"v = {literal}")["v"]
    ways = [
        (["up", str(one_key(tmp_path, key, literal))], f"{tmp_path / 'c.toml'}:3: ", value),
        (["up", "--set", f"{key.dotted}={literal}"], "--set: ", value),
    ]
    text = flag_text(key, literal) if key.spec.flags and key.spec.kind != "bool" else None
    if text is not None:
        ways.append((["up", f"{key.spec.flags[-1]}={text}"], f"{'/'.join(key.spec.flags)}: ", text))
    return ways


@pytest.mark.parametrize("key", SCHEMA, ids=lambda k: k.dotted)
def test_every_key_every_bad_value_every_way_is_one_line_exit_2(key, tmp_path, cli):
    checked = 0
    for literal in bad_values(key):
        for argv, where, value in ways_to_give(key, literal, tmp_path):
            code, line = cli(*argv)
            assert code == 2, (argv, line)
            assert line.startswith(f"moe-pipe: error: {where}{key.dotted} = {shown(key, value)}"), (argv, line)
            assert line.endswith(f"; allowed: {key.allowed_text()}"), line
            checked += 1
    assert checked >= 2 * len(bad_values(key)) >= 2  # every value at least by file and by --set


def test_malformed_toml_by_the_command_line_names_the_line(tmp_path, cli):
    p = write(tmp_path, "[cache]\ncache_mb = 5\n\n[io]\nio_threads = = 3\n")
    code, line = cli("up", str(p))
    assert code == 2 and line.startswith(f"moe-pipe: error: {p}:5: invalid TOML"), line
    code, line = cli("run", str(write(tmp_path, "[cache\n", "open.toml")), "-p", "hi")
    assert code == 2 and f"{tmp_path / 'open.toml'}:1:" in line, line


def test_config_file_missing_or_a_folder(tmp_path, cli):
    code, line = cli("up", str(tmp_path / "absent.toml"))
    assert code == 2 and f"{tmp_path / 'absent.toml'}: no such config file" in line
    (tmp_path / "folder.toml").mkdir()
    code, line = cli("up", str(tmp_path / "folder.toml"))
    assert code == 2 and f"{tmp_path / 'folder.toml'}: is a folder, not a TOML config file" in line
    code, line = cli("run", str(tmp_path), "-p", "hi")  # a folder given as the model
    assert code == 2 and "is a folder; point it at the .gguf file" in line


def test_unknown_keys_by_the_command_line_suggest(tmp_path, cli):
    code, line = cli("up", "--set", "cache.cache_mbb=5")
    assert code == 2 and 'unknown key cache.cache_mbb (did you mean "cache_mb"?)' in line
    code, line = cli("up", str(write(tmp_path, '[generate]\nchat_templat = "plain"\n')))
    assert code == 2 and 'did you mean "chat_template"?' in line and f"{tmp_path / 'c.toml'}:2:" in line


def test_missing_model_says_how_to_get_one(tmp_path, cli):
    code, line = cli("up", str(ROOT / "configs" / "qwen30b.toml"))
    assert code == 2 and "model.path is not set" in line
    code, line2 = cli("run", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert code == 2 and line2.startswith(f'moe-pipe: error: command line: model.path = "{tmp_path / "nope.gguf"}": no such file')
    for text in (line, line2):
        assert "moe-pipe make-model" in text and "--set model.path=" in text and 'path = "tiny"' in text, text


@pytest.mark.integration
def test_config_errors_from_the_real_entry_point(tmp_path):
    """No traceback, one line, exit 2 from `python -m moe_pipe.cli.main` itself (not only main())."""
    p = one_key(tmp_path, KEYS["compute.n_expert_used"], "0")
    for argv in (
        ["up", str(p)],
        ["run", "-p", "hi", "--n-expert-used", "lots"],
        ["run", "-p", "hi", "--top-k", "-1"],
        ["run", "-p", "hi", "--set", "cache.policy=lruu"],
    ):
        r = subprocess.run([sys.executable, "-m", "moe_pipe.cli.main", *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr and "allowed:" in r.stderr


def test_text_values_stay_on_one_line(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, '[model]\nname = "two\\nlines"\n'))
    assert '"two\\u000alines": contains a control character' in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match=r"too long \(5000 characters, at most 4096\)") as exc:
        load_config(None, {"model.name": "k" * 5000})  # not a secret key: a secret's value is never shown (test_secrets.py)
    assert "(5,002 characters)" in str(exc.value) and len(str(exc.value)) < 500
    with pytest.raises(ConfigError, match="not allowed; allowed: an IP address or host name"):
        load_config(None, {"gateway.host": "local host"})
    assert load_config(None, {"gateway.host": "::1", "gateway.api_key": "s3cr3t-K3y!"}).gateway.host == "::1"


# ---------------------------------------------------------------- chat_template


def test_chat_template_words_and_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for word in ("model", "plain"):
        cfg = load_config(write(tmp_path, f'[generate]\nchat_template = "{word}"\n'))
        assert cfg.generate.chat_template == word  # a word, not a path next to the config
        assert load_config(None, {"generate.chat_template": word}).generate.chat_template == word
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.jinja").write_text("{{ messages }}")
    cfg = load_config(write(tmp_path / "sub", '[generate]\nchat_template = "mine.jinja"\n'))
    assert cfg.generate.chat_template == str(tmp_path / "sub" / "mine.jinja")
    assert load_config(None, {"generate.chat_template": "./plain.jinja"})  # parsed only: a run checks it (load_runnable)
    with pytest.raises(ConfigError) as exc:
        load_runnable(write(tmp_path, '[generate]\nchat_template = "absent.jinja"\n'))
    assert str(exc.value) == (
        f'{tmp_path / "c.toml"}: generate.chat_template = "{tmp_path / "absent.jinja"}": no such file; '
        'allowed: "model", "plain" or a file path'
    )
    with pytest.raises(ConfigError, match="chat_template = .*: is a folder"):
        load_runnable(None, {"generate.chat_template": str(tmp_path)})


# ---------------------------------------------------------------- its place in the stack


def test_the_config_imports_only_the_errors():
    """Every layer and process reads the typed Config, so the schema sits just
    above the leaves: it parses and validates, and finds no model (shared/hub/resolve.py)."""
    import ast

    for module in ("config.py", "config_flags.py"):
        tree = ast.parse((ROOT / "shared" / module).read_text())
        project = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
        assert project <= {"errors", "config"}, f"shared/{module} imports {sorted(project - {'errors', 'config'})}"
