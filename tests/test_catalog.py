"""The catalog (shared/hub/catalog.py): every entry's recipe exists in configs/
and parses, names point back at their entry, and the sizes hang together."""

from __future__ import annotations

import pytest

from moe_pipe.shared.config import load_config
from moe_pipe.shared.errors import ConfigError
from moe_pipe.shared.hub import catalog
from moe_pipe.shared.hub.client import quant_of
from moe_pipe.shared.hub.resolve import load_runnable, resolve_model


@pytest.mark.parametrize("entry", catalog.CATALOG, ids=lambda e: e.name)
def test_every_entry_has_a_recipe_that_parses(entry):
    recipe = entry.recipe_path()
    assert recipe.is_file(), f"{entry.name}: no recipe configs/{entry.recipe}"
    cfg = load_config(recipe)
    assert cfg.model.catalog in ("", entry.name), f"configs/{entry.recipe} names catalog entry {cfg.model.catalog!r}"


@pytest.mark.parametrize("entry", catalog.CATALOG, ids=lambda e: e.name)
def test_entries_are_well_formed(entry):
    assert catalog.find(entry.name) is entry and catalog.find(entry.name.upper()) is entry
    assert entry.name == entry.name.lower() and "/" not in entry.name
    assert quant_of(f"x-{entry.quant}.gguf") == entry.quant  # pull matches it in file names
    assert 0 < entry.routed_bytes_per_token < entry.file_bytes and entry.shards >= 1
    assert entry.pull_command == f"moe-pipe pull {entry.repo}:{entry.quant}"


def test_names_are_unique():
    assert len(catalog.BY_NAME) == len(catalog.CATALOG)


def test_recipes_that_name_an_entry_point_at_a_real_one():
    for recipe in sorted(catalog.CONFIGS_DIR.glob("*.toml")):
        cfg = load_config(recipe)
        if cfg.model.catalog:
            assert catalog.find(cfg.model.catalog) is not None, recipe


def test_an_unpulled_catalog_model_says_the_pull_command(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing pulled here
    with pytest.raises(ConfigError, match=r"has not been pulled: run `moe-pipe pull unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M`"):
        load_runnable(catalog.CONFIGS_DIR / "qwen30b.toml")


def test_an_unknown_catalog_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="is not in the catalog; allowed: qwen3-30b-a3b, gpt-oss-120b"):
        resolve_model(load_config(None, {"model.catalog": "qwen-9000"}))


@pytest.mark.parametrize("entry", catalog.CATALOG, ids=lambda e: e.name)
def test_every_entry_says_its_quant_mix(entry):
    assert entry.quant in catalog.MIXES, f"{entry.name}: no quant mix for {entry.quant} in catalog.MIXES"


@pytest.mark.slow
@pytest.mark.parametrize("entry", catalog.CATALOG, ids=lambda e: e.name)
def test_every_entry_s_shape_makes_a_header_of_its_size(entry, tmp_path, monkeypatch):
    """The offline forecast's header (shared/hub/preview.py): the entry's shape as make-model
    makes it opens, is the entry's architecture, and is the catalog's size (exact where the
    sizes came from that preset: within 0.1 %; the estimates within 10 %)."""
    from moe_pipe.shared.gguf.model_file import open_header_model
    from moe_pipe.shared.hub.preview import shape_header

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path, size = shape_header(entry)
    with open_header_model([(path, size)]) as mf:
        assert mf.spec.arch == entry.arch and mf.gguf.file_bytes == size
        routed = mf.spec.n_expert_used * sum(mf.layout.expert_bytes(i) for i in range(mf.spec.n_layer))
    near = 0.1 if entry.sizes == catalog.ESTIMATE else 0.001
    assert abs(size - entry.file_bytes) <= near * entry.file_bytes, (size, entry.file_bytes)
    assert abs(routed - entry.routed_bytes_per_token) <= near * entry.routed_bytes_per_token, (routed, entry.routed_bytes_per_token)
