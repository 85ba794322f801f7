"""The model file a config names, found.

shared/config.py only parses and validates; what `model.path` and
`model.catalog` point at on this machine is decided here, where the catalog,
the record of pulled models and the embedded tiny model are known:

    resolve_model(cfg)              -> Config  model.catalog checked; its pulled file stands in for an unset model.path
    check_model(cfg)                           a ConfigError that says how to get a model when model.path names none
    model_file(cfg)                 -> Path    the model's file, the embedded tiny model made first if it is asked for
    load_runnable(path, overrides)  -> Config  load_config + resolve_model, then every file a run reads checked
    catalog_entry(arg)              -> Entry   the catalog entry a command's MODEL argument names (None: a file)
    pulled_path(entry)              -> Path    the file `pull` fetched for it, or the pull command as the error
    load_model_argument(arg, overrides) -> Config  a run's config from MODEL|CONFIG|NAME, as every command takes it
    unpulled_model(arg, overrides)  -> (Config, Entry) | None  a catalog model not pulled yet, for a forecast before the download
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import EMBEDDED_MODEL, Config, check_chat_template, check_kv_pool, load_config, toml_repr
from ..errors import ConfigError, UserError
from . import catalog, store


def load_runnable(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """The config a run starts from: `load_config`, the catalog's pulled file
    filled in, and a model path or chat template file that is not there
    refused here, before anything starts."""
    cfg = resolve_model(load_config(path, overrides))
    check_model(cfg)
    check_chat_template(cfg)
    check_kv_pool(cfg)
    return cfg


def resolve_model(cfg: Config) -> Config:
    """model.catalog names a catalog entry (checked here); with model.path unset, its pulled file stands in."""
    if not cfg.model.catalog:
        return cfg
    entry = catalog.find(cfg.model.catalog)
    if entry is None:
        raise ConfigError(
            f"{_where(cfg)}: model.catalog = {toml_repr(cfg.model.catalog)} is not in the catalog; allowed: {', '.join(catalog.BY_NAME)}"
        )
    if cfg.model.path:
        return cfg
    pulled = store.find_pulled(entry.repo, entry.quant)
    if pulled is None:
        return cfg  # check_model says how to pull it
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(pulled.path)))


def check_model(cfg: Config) -> None:
    """Raise a ConfigError that says how to get a model when model.path names none."""
    path = cfg.model.path
    if path == EMBEDDED_MODEL:
        return
    what = f"a {cfg.model.name} GGUF" if cfg.model.name else "a GGUF model"
    how = (
        f"download {what} and set path under [model] or pass --set model.path=FILE; or make a test model with "
        "`moe-pipe make-model --arch qwen3moe --preset tiny -o model.gguf`, convert a checkpoint with "
        '`moe-pipe convert HF_DIR -o model.gguf`, or use path = "tiny" (the embedded tiny model)'
    )
    if not path and cfg.model.catalog:
        entry = catalog.get(cfg.model.catalog)
        raise ConfigError(
            f"{_where(cfg)}: model.path is not set and {entry.name} ({entry.model}) has not been pulled: run `{entry.pull_command}`; or {how}"
        )
    if not path:
        raise ConfigError(f"{_where(cfg)}: model.path is not set: {how}")
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"{_where(cfg)}: model.path = {toml_repr(path)} is a folder; point it at the .gguf file (the first shard of a split set)"
        )
    if not p.exists():
        raise ConfigError(f"{_where(cfg)}: model.path = {toml_repr(path)}: no such file; {how}")


def model_file(cfg: Config) -> Path:
    """The model's path, making the embedded tiny model first if it is asked for and absent."""
    check_model(cfg)
    if cfg.model.path == EMBEDDED_MODEL:
        from ..makemodel.default_model import default_model_path

        return default_model_path()
    return Path(cfg.model.path)


def _where(cfg: Config) -> str:
    return cfg.source or "command line"  # with no file, a model path can only have come from the command line


def catalog_entry(arg: str) -> catalog.Entry | None:
    """The catalog entry that a MODEL argument names, or None when it names a file:
    "tiny", a .gguf or .toml, a path with a folder in it, or anything that exists.
    A word that is neither a file nor a catalog name: one line with the nearest names."""
    if arg == EMBEDDED_MODEL or arg.lower().endswith((".gguf", ".toml")) or "/" in arg or Path(arg).exists():
        return None
    entry = catalog.find(arg)
    if entry is None:
        raise UserError(f"{arg}: no such file, and not a catalog name; {catalog.names_hint(arg)}")
    return entry


def pulled_path(entry: catalog.Entry) -> Path:
    """The first file of the entry's pulled set; not pulled yet: one short line with the pull command."""
    pulled = store.find_pulled(entry.repo, entry.quant)
    if pulled is None:
        raise UserError(f"{entry.name} is not pulled yet: `{entry.pull_command}` fetches it ({entry.file_bytes / 1e9:.1f} GB)")
    return pulled.path


def load_model_argument(arg: str | None, overrides: Mapping[str, Any]) -> Config:
    """The config of `COMMAND MODEL|CONFIG|NAME [flags]` (run, up, doctor, bench, warmup, chat):
    a TOML config, a GGUF file, or a catalog name, which runs its recipe over its pulled file."""
    overrides = dict(overrides)
    if arg and arg.lower().endswith(".toml"):
        return load_runnable(arg, overrides)
    entry = catalog_entry(arg) if arg else None
    if entry is not None:
        overrides.setdefault("model.path", str(pulled_path(entry)))
        recipe = entry.recipe_path()
        return load_runnable(recipe if recipe.is_file() else None, overrides)
    if arg:
        overrides["model.path"] = arg if arg == EMBEDDED_MODEL else str(Path(arg).resolve())
    return load_runnable(None, overrides)


def unpulled_model(arg: str | None, overrides: Mapping[str, Any]) -> tuple[Config, catalog.Entry] | None:
    """When MODEL|CONFIG|NAME names a catalog model that is not pulled (a catalog name, or a
    config whose model.catalog names one and no model.path): the config its run would take
    (the recipe's, with no model file) and the entry; None for anything else, which
    `load_model_argument` opens or refuses as before."""
    overrides = dict(overrides)
    if not arg or overrides.get("model.path"):
        return None
    if arg.lower().endswith(".toml"):
        cfg = resolve_model(load_config(arg, overrides))
        if not cfg.model.catalog or cfg.model.path:
            return None
        return cfg, catalog.get(cfg.model.catalog)
    entry = catalog_entry(arg)
    if entry is None or store.find_pulled(entry.repo, entry.quant) is not None:
        return None
    recipe = entry.recipe_path()
    return resolve_model(load_config(recipe if recipe.is_file() else None, overrides)), entry
