"""The embedded default model: a tiny Qwen3-MoE GGUF the project makes itself,
written once to the user's cache folder and reused, so `moe-pipe run` works
on a fresh machine with nothing downloaded."""

from __future__ import annotations

import os
from pathlib import Path

ARCH, PRESET, SEED = "qwen3moe", "tiny", 0  # what it is: the family, preset and seed make-model writes it from
# The generator's version for this preset: bump it whenever make_model writes
# different bytes for it (v2: the calibrated routers), so a cached older
# default is not reused.
_VERSION = 2


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-pipe"


def default_model_path() -> Path:
    """The default model's path, making it first if it is not there yet (~0.2 s)."""
    from . import maker as makemodel

    path = cache_dir() / f"{ARCH}-{PRESET}-seed{SEED}-v{_VERSION}.gguf"
    if not path.exists():
        makemodel.make_model(ARCH, PRESET, path, seed=SEED)  # writes .part, then renames
    return path
