"""`moe-pipe models [MODEL ...] [--catalog] [--measure] [--json]`: the GGUFs moe-pipe
knows on this machine (pulled ones and any given), each with size, architecture,
quant and the doctor's fit-and-speed forecast; or, with --catalog, the known models.

The forecast is the doctor's (shared/analysis/fit.py and forecast.py): the fit and the
budget from this machine's memory now (cgroup-aware), the hit rate from the
shipped traces, and tok/s from read bandwidth and kernel speed. Those two are
measured only with --measure (the doctor measures every time, ~4 s a model)
and kept in `measurements.json` in moe-pipe's cache folder: read GB/s per
filesystem, kernel weights/s per (quant type, shape, threads). Without a
stored measurement that covers a model, its tok/s is null and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..shared.config import Config

MEASUREMENTS = "measurements.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "models", nargs="*", metavar="MODEL", help="GGUF files (any shard of a split set) or catalog names to list besides the pulled ones"
    )
    p.add_argument("--catalog", action="store_true", help="list the catalog of known models instead (moe-pipe pull NAME fetches one)")
    p.add_argument(
        "--forecast",
        action="store_true",
        help="with --catalog: the doctor's fit and tok/s for each entry, before the download (from its GGUF header, "
        "fetched by range request and kept; offline, from the catalog's shape)",
    )
    p.add_argument("--measure", action="store_true", help="measure read speed and kernel speed now (and store them), as the doctor does")
    p.add_argument("--seconds", type=float, default=4.0, metavar="S", help="with --measure: seconds of measuring per model (default 4)")
    p.add_argument("--mem-limit-mb", type=float, default=None, metavar="M", help="forecast as if in a new memory cgroup of M MiB")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


# ---------------------------------------------------------------- stored measurements


def _store_path() -> Path:
    from ..shared.makemodel.default_model import cache_dir

    return cache_dir() / MEASUREMENTS


def load_measurements() -> dict:
    try:
        data = json.loads(_store_path().read_text())
    except (OSError, ValueError):
        return {"reads": {}, "kernels": {}}
    if not isinstance(data, dict):
        return {"reads": {}, "kernels": {}}
    return {"reads": dict(data.get("reads") or {}), "kernels": dict(data.get("kernels") or {})}


def save_measurements(data: dict) -> None:
    path = _store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{MEASUREMENTS}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # whole or not at all


def device_key(path: Path) -> str:
    """The filesystem a file lives on: read speed is a property of the disk, not of the model."""
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _kernel_key(class_key: str, threads: int) -> str:
    return f"{class_key} @{threads}t"


# ---------------------------------------------------------------- one model


def _model_config(path: Path, entry) -> Config:
    """The recipe of its catalog entry (ctx, reserve, dense policy), else the defaults, over this file."""
    from ..shared.config import load_config
    from ..shared.hub.resolve import resolve_model

    recipe = entry.recipe_path() if entry else None
    return resolve_model(load_config(recipe if recipe and recipe.is_file() else None, {"model.path": str(path)}))


def file_type_name(mf) -> str:
    """general.file_type as llama.cpp names it (Q4_K_M, MXFP4_MOE), else the experts' commonest type."""
    from gguf import LlamaFileType

    ft = mf.gguf.meta("general.file_type")
    try:
        return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else _commonest_expert_type(mf)
    except ValueError:
        return _commonest_expert_type(mf)


def _commonest_expert_type(mf) -> str:
    counts: dict[str, int] = {}
    for layer in mf.layout.layers:
        for part in layer.parts:
            counts[part.tensor.qtype.name] = counts.get(part.tensor.qtype.name, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else "?"


def model_row(path: Path, pulled, entry, store: dict, *, measure: bool, seconds: float, mem_limit_mb: float | None) -> dict:
    """One model's row: what it is, and the doctor's forecast from stored (or, measuring, fresh) speeds."""
    from ..shared.gguf.model_file import open_model

    cfg = _model_config(path, entry)
    with open_model(path) as mf:
        row = {"path": str(path), "repo": pulled.repo if pulled else None, "catalog": entry.name if entry else None}
        return row | forecast_row(mf, cfg, store, device_key(path), measure=measure, seconds=seconds, mem_limit_mb=mem_limit_mb)


def forecast_row(
    mf, cfg: Config, store: dict, dev: str, *, measure: bool, seconds: float, mem_limit_mb: float | None, kernels_if_missing: bool = False
) -> dict:
    """The doctor's forecast of an opened model (a file, or a header before the download) from the
    speeds stored for its disk `dev` and its kernels; measuring them first with `measure` (with
    `kernels_if_missing`, the kernels only when some are not stored). A header-only model's
    reads cannot be measured: the stored figure of the disk it would land on stands in, else
    the doctor's assumed one."""
    from ..shared.analysis.fit import hit_rate, limited_probe, memory_fit, model_footprint
    from ..shared.analysis.forecast import (
        ASSUMED_READ_GBPS,
        FLOOR_MARGIN,
        ROTATE_BYTES,
        compute_threads,
        decode_speed,
        measure_kernels,
        measure_reads,
    )

    footprint = model_footprint(mf, cfg)
    header_only = mf.gguf.header_only
    threads = compute_threads(cfg)
    missing = any(_kernel_key(c.key, n) not in store["kernels"] for c in footprint.classes for n in {1, threads})
    if measure or (kernels_if_missing and missing):
        if measure and not header_only:
            reads = measure_reads(mf, seconds=0.4 * seconds)
            store["reads"][dev] = {
                "gbps": {str(n): g for n, g in reads.gbps.items()},
                "source": reads.source,
                "note": reads.note,
                "at": time.time(),
            }
        rotate = min(ROTATE_BYTES, footprint.active_bytes_per_token)
        rates = measure_kernels(footprint.classes, sorted({1, threads}), seconds=0.6 * seconds, rotate_bytes=rotate)
        store["kernels"].update({_kernel_key(k, n): r for (k, n), r in rates.items()})
    fit = memory_fit(footprint, cfg, limited_probe(mem_limit_mb))
    hit = hit_rate(footprint, fit.n_slabs, cfg.cache.policy) if fit.fits else None
    row = {
        "arch": footprint.arch,
        "quant": file_type_name(mf),
        "file_bytes": footprint.file_bytes,
        "shards": len(mf.gguf.paths),
        "routed_bytes_per_token": footprint.routed_bytes_per_token,
        "config": cfg.source or "",
        "available_bytes": fit.available_bytes,
        "budget_mb": round(fit.budget.mb, 1),
        "n_slabs": fit.n_slabs,
        "fits": fit.fits,
        "resident": fit.resident,
        "refusal": fit.refusal,
        "hit_pct": None if hit is None else round(hit.pct, 2),
        "hit_source": None if hit is None else hit.source,
        "read_gbps": None,
        "read_measured_at": None,
        "tok_s": None,
        "bottleneck": None,
        "speed_note": None,
    }
    read = store["reads"].get(dev)
    if read is None and header_only:
        read = {"gbps": {"1": ASSUMED_READ_GBPS, "2": ASSUMED_READ_GBPS, "4": ASSUMED_READ_GBPS}, "at": None}
    rates_at = {c.key: store["kernels"].get(_kernel_key(c.key, threads)) for c in footprint.classes}
    if read is None or any(r is None for r in rates_at.values()):
        row["speed_note"] = "speed not measured on this machine yet: moe-pipe models --measure"
        return row
    gbps = {int(n): float(g) for n, g in read["gbps"].items()}
    lanes = max([n for n in gbps if n <= cfg.io.io_threads] or [min(gbps)])
    row["read_gbps"], row["read_measured_at"] = round(gbps[lanes], 3), read.get("at")
    if hit is None:
        row["bottleneck"] = "memory"
        return row
    # the doctor's own arithmetic (forecast.decode_speed), on the stored figures
    speed = decode_speed(
        footprint.classes,
        {k: float(v) for k, v in rates_at.items() if v is not None},
        n_layer=footprint.n_layer,
        top_k=footprint.top_k,
        hit_pct=hit.pct,
        read_bytes_per_token=footprint.top_k * sum(footprint.read_bytes_per_expert),
        read_gbps=gbps[lanes],
        at_floor=fit.budget.bytes < FLOOR_MARGIN * footprint.floor_bytes,
    )
    row["tok_s"], row["bottleneck"] = round(speed.tok_s, 2), speed.bottleneck
    return row


def landing_device(entry) -> str:
    """The disk a pull of `entry` writes to (its folder, or the nearest one that exists)."""
    from ..shared.hub import store

    where = store.repo_dir(entry.repo)
    while not where.exists():
        where = where.parent
    return device_key(where)


# ---------------------------------------------------------------- the command


def _catalog_rows() -> list[dict]:
    from ..shared.hub import catalog, store

    rows = []
    for e in catalog.CATALOG:
        p = store.find_pulled(e.repo, e.quant)
        rows.append(
            {
                "name": e.name,
                "model": e.model,
                "arch": e.arch,
                "repo": e.repo,
                "quant": e.quant,
                "mix": e.mix,
                "pull": e.pull_command,
                "recipe": f"configs/{e.recipe}",
                "file_bytes": e.file_bytes,
                "routed_bytes_per_token": e.routed_bytes_per_token,
                "shards": e.shards,
                "sizes": e.sizes,
                "pulled": str(p.path) if p else None,
            }
        )
    return rows


FORECAST_KEYS = ("fits", "resident", "refusal", "budget_mb", "hit_pct", "read_gbps", "tok_s", "bottleneck", "speed_note")


def _forecast_catalog(rows: list[dict], *, measure: bool, seconds: float, mem_limit_mb: float | None) -> None:
    """Each catalog row's `forecast` (or `forecast_error`): a pulled entry's from its file, the
    rest before the download (shared/hub/preview.py), one status line saying which as it works.
    Once the Hub cannot be reached, the rest go straight to their shapes."""
    from ..shared.errors import UserError
    from ..shared.hub import catalog, store
    from ..shared.hub.preview import open_preview
    from ..shared.hub.resolve import unpulled_model
    from ..shared.progress import StatusLine

    measurements, offline = load_measurements(), None
    with StatusLine() as status:
        for i, (e, r) in enumerate(zip(catalog.CATALOG, rows)):

            def say(text: str, e=e, i=i) -> None:
                status.update(f"models: {e.name} ({i + 1}/{len(rows)}): {text}")

            say("forecasting")
            try:
                pulled = store.find_pulled(e.repo, e.quant)
                if pulled is not None:
                    f = model_row(pulled.path, pulled, e, measurements, measure=measure, seconds=seconds, mem_limit_mb=mem_limit_mb)
                    source, note, why = "file", f"from the pulled file {pulled.path}", None
                else:
                    found = unpulled_model(e.name, {})
                    assert found is not None  # not pulled: checked just above
                    with open_preview(e, on_status=say, offline=offline) as pv:
                        offline = offline or pv.offline
                        say("forecasting from its header (a first look at a shape measures its kernels)")
                        f = forecast_row(
                            pv.mf,
                            found[0],
                            measurements,
                            landing_device(e),
                            measure=measure,
                            seconds=seconds,
                            mem_limit_mb=mem_limit_mb,
                            kernels_if_missing=True,  # the kernels of a shape not measured here yet: ~0.6 × --seconds
                        )
                        source, note, why = pv.source, pv.note, pv.offline
            except UserError as exc:
                r["forecast"], r["forecast_error"] = None, str(exc)
                continue
            r["forecast"] = {"source": source, "source_note": note, "offline": why, **{k: f[k] for k in FORECAST_KEYS}}
            r["forecast_error"] = None
    save_measurements(measurements)  # kernels measured for shapes new here: the next listing is instant


def _forecast_cell(r: dict) -> str:
    f = r.get("forecast")
    if f is None:
        return f"error: {r['forecast_error']}"
    if not f["fits"]:
        return "does not fit"
    fit = "fits, resident" if f["resident"] else "fits, streaming"
    return f"{fit}, {f['tok_s']:.1f} tok/s ({f['bottleneck']})" if f["tok_s"] is not None else f"{fit}; tok/s not measured (--measure)"


_SOURCE_CELL = {"file": "the file", "header": "its header", "shape": "catalog shape (estimate)"}


def _print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*r)
    Console(width=max(160, Console().width)).print(table)


def run(args: argparse.Namespace) -> int:
    from ..shared.errors import UserError
    from ..shared.hub import catalog, store
    from ..shared.hub.resolve import catalog_entry, pulled_path

    if args.forecast and not args.catalog:
        raise UserError("--forecast goes with --catalog (the models here are forecast without it)")
    if args.catalog:
        rows = _catalog_rows()
        if args.forecast:
            _forecast_catalog(rows, measure=args.measure, seconds=args.seconds, mem_limit_mb=args.mem_limit_mb)
        if args.json:
            print(json.dumps({"catalog": rows}))
        elif args.forecast:
            _print_table(
                "the catalog, forecast before the download (moe-pipe doctor NAME says more)",
                ["name", "repository:quant", "GB", "forecast here", "from", "pulled"],
                [
                    [
                        r["name"],
                        f"{r['repo']}:{r['quant']}",
                        f"{r['file_bytes'] / 1e9:.1f}",
                        _forecast_cell(r),
                        _SOURCE_CELL[r["forecast"]["source"]] if r["forecast"] else "-",
                        r["pulled"] or "-",
                    ]
                    for r in rows
                ],
            )
            why = next((r["forecast"]["offline"] for r in rows if r["forecast"] and r["forecast"]["offline"]), None)
            if why:
                print(f"no header from the Hub ({why}): a 'catalog shape' forecast is an estimate from the catalog's shape facts")
        else:
            _print_table(
                "the catalog (moe-pipe pull NAME, then moe-pipe up NAME)",
                ["name", "repository:quant", "GB", "routed MB/token", "recipe", "pulled", "quant mix"],
                [
                    [
                        r["name"],
                        f"{r['repo']}:{r['quant']}",
                        f"{r['file_bytes'] / 1e9:.1f}",
                        f"{r['routed_bytes_per_token'] / 1e6:,.0f}",
                        r["recipe"],
                        r["pulled"] or "-",
                        r["mix"],
                    ]
                    for r in rows
                ],
            )
        return 0
    if args.measure and args.seconds <= 0:
        raise UserError(f"--seconds must be positive, got {args.seconds:g}")
    found: list[tuple[Path, store.Pulled | None]] = [(p.path, p) for p in store.pulled()]
    for m in args.models:
        entry = catalog_entry(m)  # a catalog name: its pulled file (not pulled: the pull command)
        path = pulled_path(entry).resolve() if entry else Path(m).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"{m}: no such GGUF file")
        if all(path != q for q, _ in found):
            found.append((path, None))
    measurements = load_measurements()
    rows = []
    for path, pulled in found:
        entry = next((e for e in catalog.CATALOG if pulled and e.repo.lower() == pulled.repo.lower() and e.quant == pulled.quant), None)
        rows.append(
            model_row(path, pulled, entry, measurements, measure=args.measure, seconds=args.seconds, mem_limit_mb=args.mem_limit_mb)
        )
    if args.measure:
        save_measurements(measurements)
    if args.json:
        print(json.dumps({"models": rows}))
        return 0
    if not rows:
        print("no models yet: `moe-pipe pull REPO[:QUANT]` fetches one (`moe-pipe models --catalog` lists the known ones)")
        return 0

    def speed(r: dict) -> str:
        if not r["fits"]:
            return "does not fit"
        return f"{r['tok_s']:.1f} tok/s ({r['bottleneck']})" if r["tok_s"] is not None else "not measured (--measure)"

    _print_table(
        "models on this machine",
        ["model", "arch", "quant", "GB", "fits", "cache MiB", "hit %", "forecast", "path"],
        [
            [
                r["catalog"] or Path(r["path"]).name,
                r["arch"],
                r["quant"],
                f"{r['file_bytes'] / 1e9:.2f}",
                ("resident" if r["resident"] else "streaming") if r["fits"] else "no",
                f"{r['budget_mb']:,.0f}",
                "-" if r["hit_pct"] is None else f"{r['hit_pct']:.0f}",
                speed(r),
                r["path"],
            ]
            for r in rows
        ],
    )
    return 0
