"""A catalog model that is not pulled, opened from its header alone, so the
doctor can forecast it before the download (`doctor NAME`, `models --catalog --forecast`).

    open_preview(entry, on_status)  -> Preview   the header-only ModelFile and where it came from

In order of trust:

1. the file's own header kept from an earlier fetch (shared/hub/header.py: no request);
2. the file's own header, fetched now by range request (a few MB) and kept;
3. offline (HF_HUB_OFFLINE, or the Hub cannot be reached: network.check_reachable says so
   within seconds), or when the Hub has no such file, the header make-model writes for the entry's shape
   (catalog.Shape: its family's shape preset at the entry's depth, expert count and
   expert type). Its tensor table has the real model's names, types, shapes and
   sizes as far as the preset knows them (the catalog's `sizes` says how near):
   an estimate, and said to be one.

A fetched header that does not parse is the reader's one-line GGUFError, never
a silent fall back to the estimate: the file on the Hub is what `pull` would fetch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import GGUFError, UserError
from ..makemodel.default_model import cache_dir
from . import client, network
from . import header as remote_header
from .catalog import Entry

MB = 1e6


@dataclass(frozen=True)
class Preview:
    entry: Entry
    mf: Any  # a header-only gguf.model_file.ModelFile: forecasts, does not run
    source: str  # header | shape
    note: str  # which source, in words, for the report's line
    fetched_bytes: int = 0
    requests: int = 0
    offline: str | None = None  # why the Hub cannot be reached (source "shape"): the next preview need not try

    def close(self) -> None:
        self.mf.close()

    def __enter__(self) -> Preview:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_preview(entry: Entry, on_status: Callable[[str], None] | None = None, offline: str | None = None) -> Preview:
    """The entry's header-only model: its file's header (kept or fetched), else its shape (module docstring).
    `offline`: why the network is not to be tried again (a previous preview's): kept headers only."""
    from huggingface_hub import constants

    say = on_status or (lambda text: None)
    kept = remote_header.cached_header(entry.repo, entry.quant)
    if kept is not None:
        return Preview(
            entry,
            kept.open(),
            "header",
            f"from the file's header, fetched earlier by range request ({kept.header_bytes / MB:.1f} MB, cached)",
        )
    if constants.HF_HUB_OFFLINE:
        return shape_preview(entry, "HF_HUB_OFFLINE is set", say)
    if offline is None:
        say(f"reaching {client.endpoint()}")
        try:
            network.check_reachable(client.endpoint(), entry.repo)
        except UserError as exc:
            offline = "offline: " + _reason(str(exc))
    if offline:
        return shape_preview(entry, offline, say)
    try:
        got = remote_header.fetch_header(entry.repo, entry.quant, on_status=say)
    except GGUFError:
        raise  # the Hub's file is not a model moe-pipe reads: say so, do not estimate around it
    except UserError as exc:  # this entry's own (no such repository or quant, refused): the next may still fetch
        pv = shape_preview(entry, "no header: " + _reason(str(exc)), say)
        return replace(pv, offline=None)
    note = f"from the file's header, fetched by range request ({got.fetched_bytes / MB:.1f} MB in {got.requests} request{'s' * (got.requests > 1)}, cached)"
    return Preview(entry, got.open(), "header", note, got.fetched_bytes, got.requests)


def _reason(message: str) -> str:
    """A fetch's one-line error without its repository and hint: why the Hub gave no header."""
    return message.split("; ")[0].split(": ", 1)[-1]


def shape_preview(entry: Entry, why: str, on_status: Callable[[str], None] | None = None) -> Preview:
    """The entry's shape as make-model writes its header (no network)."""
    from ..gguf.model_file import open_header_model

    if on_status:
        on_status(f"making {entry.name}'s header from the catalog's shape ({entry.shape.preset})")
    path, size = shape_header(entry)
    note = f"an estimate from the catalog's shape facts ({entry.shape.preset}, {entry.quant}; {why}): the file is not pulled"
    return Preview(entry, open_header_model([(path, size)]), "shape", note, offline=why)


def shape_header(entry: Entry) -> tuple[Path, int]:
    """make-model's header of the entry's shape (a few MB, made afresh each time: < 1 s), and its whole size."""
    from ..makemodel.maker import make_header

    out = cache_dir() / "headers" / "shapes" / f"{entry.name}.gguf.header"
    size = make_header(entry.arch, entry.shape.preset, out, **entry.shape.make_args())
    return out, size
