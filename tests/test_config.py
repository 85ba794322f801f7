"""Config: the whole schema walked (wrong types, out-of-range values), presets, overrides, docs in step."""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from moe_pipe.shared import config as C
from moe_pipe.shared.config import KEYS, SCHEMA, TABLES, Config, load_config, toml_repr
from moe_pipe.shared.errors import ConfigError

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
    return {"int": '"four"', "float": '"fast"', "bool": "1", "str": "5", "path": "5", "choice": "7",
            "mb": "true"}[key.spec.kind]


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
        load_config(p, check_model_path=False)
    msg = str(exc.value)
    assert key.dotted in msg and str(p) in msg and "wrong type" in msg and "allowed:" in msg, msg
    assert f"{p}:3:" in msg, msg  # the line of the key
    assert "\n" not in msg


@pytest.mark.parametrize("key", [k for k in SCHEMA if out_of_range(k)], ids=lambda k: k.dotted)
def test_out_of_range_names_key_file_value_and_allowed(tmp_path, key):
    for bad in out_of_range(key):
        p = one_key(tmp_path, key, bad)
        with pytest.raises(ConfigError) as exc:
            load_config(p, check_model_path=False)
        msg = str(exc.value)
        assert key.dotted in msg and str(p) in msg and "allowed:" in msg, msg
        assert ("out of range" in msg or "not allowed" in msg), msg
        shown = bad.strip('"')
        assert shown in msg or shown.rstrip("0").rstrip(".") in msg, (bad, msg)


@pytest.mark.parametrize("key", SCHEMA, ids=lambda k: k.dotted)
def test_default_is_valid_and_round_trips(tmp_path, key):
    assert C._check(key, key.default) == key.default
    if key.default is not None:
        p = one_key(tmp_path, key, toml_repr(key.default))
        cfg = load_config(p, check_model_path=False)
        assert getattr(getattr(cfg, key.table), key.name) == key.default


@pytest.mark.parametrize("key", [k for k in SCHEMA if k.spec.flags], ids=lambda k: k.dotted)
def test_every_flag_rejects_a_bad_value(key):
    parser = argparse.ArgumentParser()
    C.add_override_arguments(parser)
    if key.spec.kind == "bool":
        args = parser.parse_args([key.spec.flags[0]])
        assert C.overrides_from_args(args) == {key.dotted: True}
        return
    bad = {"int": "lots", "float": "lots", "mb": "lots", "choice": "bogus"}.get(key.spec.kind)
    if bad is None:  # strings and paths: any text is a value; "" is the bad one
        bad = ""
    args = parser.parse_args([key.spec.flags[-1], bad])
    with pytest.raises(ConfigError) as exc:
        C.overrides_from_args(args)
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
    cases = [("compute", "threads", "4.0", "wrong type"), ("compute", "threads", "true", "wrong type"),
             ("compute", "overlap", '"yes"', "wrong type"), ("cache", "cache_mb", '"lots"', "wrong type"),
             ("cache", "cache_mb", "nan", "finite"), ("cache", "cache_ceil_mb", "inf", "finite"),
             ("io", "dense_weights", '"anno"', 'did you mean "anon"')]
    for table, name, value, want in cases:
        p = write(tmp_path, f"[{table}]\n{name} = {value}\n")
        with pytest.raises(ConfigError, match=re.escape(want)):
            load_config(p, check_model_path=False)


def test_fractional_cache_and_ints_for_floats(tmp_path):
    cfg = load_config(write(tmp_path, "[cache]\ncache_mb = 0.25\ncache_ceil_mb = 1\n"))
    assert cfg.cache.cache_mb == 0.25 and cfg.cache.cache_ceil_mb == 1.0 and isinstance(cfg.cache.cache_ceil_mb, float)


# ---------------------------------------------------------------- unknown names

@pytest.mark.parametrize("text,want", [
    ("[cache]\ncache_mbb = 5\n", 'unknown key cache.cache_mbb (did you mean "cache_mb"?)'),
    ("[cach]\ncache_mb = 5\n", 'unknown table [cach] (did you mean "cache"?)'),
    ("[io]\nthreads = 2\n", 'unknown key io.threads (threads belongs in [compute]; or did you mean "io_threads"?)'),
    ("cache_mb = 5\n", "key cache_mb must be inside a table: write it under [cache]"),
    ("[cache]\npolicyy = 1\n", 'did you mean "policy"?'),
    ("[compute]\nzzz = 1\n", "keys of [compute]: threads, overlap"),
    ("modle = 1\n", 'unknown top-level key modle (did you mean "model"?)'),
])
def test_unknown_names_suggest(tmp_path, text, want):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_config(p, check_model_path=False)
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
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert str(tmp_path / "nope.gguf") in msg and "moe-pipe make-model" in msg and "moe-pipe convert" in msg
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(write(tmp_path, '[model]\npath = "."\n'))


def test_relative_model_path_is_read_from_the_config_folder(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.gguf").write_bytes(b"GGUF")
    p = write(tmp_path / "m", '[model]\npath = "x.gguf"\n[telemetry]\ncsv = "out/run.csv"\n')
    monkeypatch.chdir("/")
    cfg = load_config(p)
    assert cfg.model.path == str(tmp_path / "m" / "x.gguf") and cfg.telemetry.csv == str(tmp_path / "m" / "out" / "run.csv")
    assert cfg.model_file() == tmp_path / "m" / "x.gguf"
    # a path typed on the command line is the shell's: relative to the current folder
    monkeypatch.chdir(tmp_path)
    cfg2 = load_config(p, {"telemetry.csv": "here.csv"})
    assert cfg2.telemetry.csv == str(tmp_path / "here.csv")


def test_embedded_model_is_the_default():
    cfg = load_config(None)
    assert cfg == Config() and cfg.model.path == "tiny" and cfg.source is None


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads(preset):
    cfg = load_config(preset, check_model_path=False)
    assert cfg.source == str(preset)
    if preset.name == "tiny.toml":
        assert load_config(preset).model.path == "tiny"
        return
    # real-model presets: the recipe is there, the model path is the user's to set
    assert cfg.model.path == "" and cfg.model.name
    assert cfg.cache.cache_mb == "auto" and cfg.compute.overlap and cfg.io.io_threads == 4 and cfg.compute.threads == 4
    assert cfg.cache.cache_ceil_mb == (3000 if "gptoss" in preset.name else 4000)
    assert cfg.generate.no_think == ("gptoss" in preset.name)
    with pytest.raises(ConfigError) as exc:
        load_config(preset)
    assert "model.path is not set" in str(exc.value) and cfg.model.name in str(exc.value) and str(preset) in str(exc.value)
    fixed = load_config(preset, {"model.path": "tiny"})
    assert fixed.model.path == "tiny"


def test_presets_comment_every_key():
    for preset in PRESETS:
        for no, line in enumerate(preset.read_text().splitlines(), 1):
            if re.match(r"\s*[a-z_]+\s*=", line) and not line.lstrip().startswith("#"):
                assert "#" in line or preset.read_text().splitlines()[no - 2].lstrip().startswith("#"), \
                    f"{preset.name}:{no} has no comment: {line}"


# ---------------------------------------------------------------- overrides

def test_cli_overrides_apply_without_mutation(tmp_path):
    parser = argparse.ArgumentParser()
    C.add_override_arguments(parser)
    args = parser.parse_args(["--cache-mb", "0.5", "--cache-ceil-mb", "100", "--io-threads", "1", "-t", "2",
                              "--no-overlap", "--dense-weights", "warm", "--top-k", "2", "--prefetch", "next-layer",
                              "--csv", "run.csv", "--policy", "lru", "-c", "512", "-n", "9", "--temp", "0.7",
                              "--seed", "42", "--no-think", "--port", "0",
                              "--set", "supervisor.start_secs=2.5", "--set", "model.path=tiny",
                              "--set", "gateway.api_key=s3cret", "--set", "supervisor.gateway_restart=never"])
    ov = C.overrides_from_args(args)
    base = load_config(ROOT / "configs" / "qwen30b.toml", check_model_path=False)
    before = base.to_dict()
    cfg = C.apply_overrides(base, ov, base=tmp_path)
    assert base.to_dict() == before  # the original is untouched
    assert (cfg.cache.cache_mb, cfg.cache.cache_ceil_mb, cfg.io.io_threads, cfg.compute.threads) == (0.5, 100.0, 1, 2)
    assert (cfg.compute.overlap, cfg.io.dense_weights, cfg.compute.top_k, cfg.compute.prefetch) == (False, "warm", 2, "next-layer")
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
    C.add_override_arguments(parser)
    assert C.overrides_from_args(parser.parse_args([])) == {}
    args = parser.parse_args(["--overlap", "--think", "--top-k", "none", "--cache-mb", "auto"])
    assert C.overrides_from_args(args) == {"compute.overlap": True, "generate.no_think": False,
                                           "compute.top_k": None, "cache.cache_mb": "auto"}


def test_add_override_arguments_subset():
    parser = argparse.ArgumentParser()
    C.add_override_arguments(parser, tables=("cache", "io"))
    assert parser.parse_args(["--cache-mb", "1"]).cache_mb == "1"
    with pytest.raises(SystemExit):
        parser.parse_args(["-t", "2"])


def test_set_errors(tmp_path):
    parser = argparse.ArgumentParser()
    C.add_override_arguments(parser)
    with pytest.raises(ConfigError, match="expected TABLE.KEY=VALUE"):
        C.overrides_from_args(parser.parse_args(["--set", "cache.cache_mb"]))
    with pytest.raises(ConfigError) as exc:
        C.overrides_from_args(parser.parse_args(["--set", "supervisor.start_retries=many"]))
    assert str(exc.value).startswith('--set: supervisor.start_retries = "many": wrong type')
    ov = C.overrides_from_args(parser.parse_args(["--set", "supervisor.overlap=true"]))
    with pytest.raises(ConfigError, match="overlap belongs in \\[compute\\]"):
        C.apply_overrides(Config(), ov)
    with pytest.raises(ConfigError) as exc:
        C.apply_overrides(Config(), {"gateway.host": 5})
    assert str(exc.value).startswith("command line: gateway.host = 5: wrong type")
    with pytest.raises(ConfigError, match="out of range"):
        load_config(None, {"compute.top_k": 0})


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
    assert documented == set(KEYS), (f"undocumented: {sorted(set(KEYS) - documented)}; "
                                     f"documented but not in the schema: {sorted(documented - set(KEYS))}")
    block = text[text.index(C.DOCS_BEGIN):text.index(C.DOCS_END) + len(C.DOCS_END)]
    assert block == C.reference_markdown(), "docs/configuration.md is stale: run python -m moe_pipe.shared.config --docs"
