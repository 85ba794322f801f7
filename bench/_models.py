"""The benchmark models: made once under bench/out/ and reused."""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def shape_model(model: str | None, layers: int, arch: str = "qwen3moe", preset: str = "qwen30b-shape") -> Path:
    """`model` if given, else the `preset` model cut to `layers`, made on first use."""
    if model:
        return Path(model)
    from moe_pipe.shared.makemodel.maker import make_model

    path = OUT / f"{preset}-L{layers}.gguf"
    if not path.exists():
        print(f"making {path} ...", file=sys.stderr)
        make_model(arch, preset, path, layers=layers)
    return path
