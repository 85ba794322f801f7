"""`moe-pipe inspect MODEL|CONFIG|tiny [--json]`: what a model file holds and what it costs to stream."""

from __future__ import annotations

import argparse
import json

MIB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        help='GGUF file (or any shard of a split set), a TOML config (its model.path), a catalog name (its pulled file) or "tiny" (the embedded tiny model)',
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def summary(mf) -> dict:
    """The inspect record; the JSON keys are part of the CLI contract (docs/cli.md)."""
    from ..shared.gguf.alignment import io_alignment

    spec, layout = mf.spec, mf.layout
    found = io_alignment(mf.gguf.paths)  # only to say where layout.align came from: the same call built it
    return {
        "arch": spec.arch,
        "name": spec.name,
        "n_layer": spec.n_layer,
        "n_embd": spec.n_embd,
        "n_vocab": spec.n_vocab,
        "n_expert": spec.n_expert,
        "n_expert_used": spec.n_expert_used,
        "expert_bytes": layout.max_expert_bytes,
        "expert_bytes_per_layer": [layout.expert_bytes(i) for i in range(spec.n_layer)],
        "expert_bytes_total": layout.total_expert_bytes,
        "dense_bytes": layout.dense_bytes,
        "row_bytes": layout.row_bytes,
        "nextn_layers": spec.n_layer_nextn,
        "nextn_bytes": layout.nextn_bytes,
        "file_bytes": mf.gguf.file_bytes,
        "shards": len(mf.gguf.paths),
        "routed_bytes_per_token": layout.routed_bytes_per_token(),
        "slab_bytes": layout.slab_bytes,
        "io_align": layout.align,
        "io_align_source": found.describe(),
        "min_cache_bytes": layout.min_cache_bytes(),
        "quant_types": mf.quant_types(),
    }


def _types(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in counts.items()) or "-"


def _nextn(s: dict) -> str:
    n = s["nextn_layers"]
    return (
        f"{n} layer{'s' * (n > 1)} after the decoder's, {s['nextn_bytes'] / MIB:,.1f} MiB ({s['nextn_bytes']:,} B): "
        "not loaded (llama.cpp's speculative-decoding draft; docs/models.md § The MTP/NextN block)"
    )


def print_table(s: dict) -> None:
    per_layer = sorted(set(s["expert_bytes_per_layer"]))
    rows = [
        ("architecture", f"{s['arch']} ({s['name']})"),
        ("layers", s["n_layer"]),
        ("hidden / vocab", f"{s['n_embd']} / {s['n_vocab']}"),
        ("experts / used", f"{s['n_expert']} / {s['n_expert_used']}"),
        ("per-expert bytes", ", ".join(f"{b:,}" for b in per_layer) + (" (varies by layer)" if len(per_layer) > 1 else "")),
        ("all experts", f"{s['expert_bytes_total'] / MIB:,.1f} MiB"),
        ("dense bytes", f"{s['dense_bytes'] / MIB:,.1f} MiB ({s['dense_bytes']:,} B)"),
        *(
            [("read by row", f"{s['row_bytes'] / MIB:,.1f} MiB: the token embedding, a row a token from the file")]
            if s["row_bytes"]
            else []
        ),
        ("file bytes", f"{s['file_bytes'] / MIB:,.1f} MiB in {s['shards']} file(s)"),
        *([("MTP/NextN block", _nextn(s))] if s["nextn_layers"] else []),
        ("routed per token", f"{s['routed_bytes_per_token'] / MIB:,.1f} MiB (top-{s['n_expert_used']}, all layers, no cache)"),
        ("I/O alignment", s["io_align_source"]),
        ("cache slab", f"{s['slab_bytes']:,} B (largest expert rounded to the I/O alignment)"),
        ("smallest useful cache", f"{s['min_cache_bytes'] / MIB:,.1f} MiB (one token's working set)"),
        ("expert quant types", _types(s["quant_types"]["experts"])),
        ("dense quant types", _types(s["quant_types"]["dense"])),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def model_path(arg: str) -> str:
    """The GGUF file `arg` names: a config's model.path (the embedded model made
    if it is asked for), the embedded model for its name, a catalog name's pulled
    file, else `arg` itself."""
    from ..shared.config import EMBEDDED_MODEL, load_config
    from ..shared.hub.resolve import catalog_entry, model_file, pulled_path, resolve_model

    if arg == EMBEDDED_MODEL:
        from ..shared.makemodel.default_model import default_model_path

        return str(default_model_path())
    if arg.endswith(".toml"):
        return str(model_file(resolve_model(load_config(arg))))  # a bad or unset path: one line, exit 2
    entry = catalog_entry(arg)  # a word that is no file and no catalog name: the nearest names
    return str(pulled_path(entry)) if entry else arg


def run(args: argparse.Namespace) -> int:
    from ..shared.gguf.model_file import open_model

    with open_model(model_path(args.model)) as mf:
        s = summary(mf)
    if args.json:
        print(json.dumps(s))
    else:
        print_table(s)
    return 0
