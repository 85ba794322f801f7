"""A made shape preset's header held to a real file's published load log
(`llama_model_loader: - kv …` in an issue thread; docs/adding-a-family.md): the header
alone is written (`make_header`, a few MB) and read back (`open_header_model`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from moe_pipe.shared.gguf.model_file import open_header_model
from moe_pipe.shared.gguf.reader import GGUFFile
from moe_pipe.shared.makemodel.maker import make_header


@contextmanager
def made_header(arch: str, preset: str, folder: Path, **kw) -> Iterator[GGUFFile]:
    """The header make-model writes for `preset` (keywords as make_model's, e.g. mtp=True)."""
    path = folder / f"{arch}-{preset}-header.gguf"
    size = make_header(arch, preset, path, **kw)
    with open_header_model([(path, size)]) as mf:
        yield mf.gguf


def assert_published(f: GGUFFile, published: dict) -> None:
    """Every published key has the published value; a float as the log printed it, stored in
    the file's float32 (so 0.0707 is 0.0707f exactly, not within a tolerance)."""
    want = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in published.items()}
    assert {k: f.meta(k) for k in published} == want
