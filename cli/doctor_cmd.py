"""`moe-pipe doctor [MODEL|CONFIG] [--mem-limit-mb M] [--json]`: will this model fit
on this machine, and how fast will it decode? (shared/analysis/fit.py and forecast.py do the work.)"""

from __future__ import annotations

import argparse
import json

MIB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..shared.config_flags import add_override_arguments

    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a GGUF file (any shard of a split set), a TOML config or a catalog name; default: the embedded tiny model",
    )
    p.add_argument(
        "--mem-limit-mb",
        type=float,
        default=None,
        metavar="M",
        help="forecast as if the run were in a new memory cgroup of M MiB (the emulated device)",
    )
    p.add_argument(
        "--seconds", type=float, default=4.0, metavar="S", help="time spent measuring read bandwidth and kernel speed, in total (default 4)"
    )
    p.add_argument("--json", action="store_true", help="print one flat JSON object instead of the report")
    add_override_arguments(p, tables=("cache", "io", "compute"))


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


def _context(f: dict) -> str:
    """The context and what its KV cache costs here, against the longest this memory affords
    (KV at most 1/8 of it, never past the trained context: shared/analysis/fit.py affordable_context)."""
    from ..shared.analysis.fit import KV_SHARE

    ctx, kv, avail, most = f["ctx_size"], f["kv_bytes"], max(f["available_bytes"], 1), f["ctx_affordable"]
    text = f"{ctx:,} tokens, KV {_mib(kv)} ({100 * kv / avail:.1f} % of the memory here)"
    if f["kv_ring_layers"]:
        text += f"; {f['kv_ring_layers']} of {f['n_layer']} layers slide and keep {f['kv_ring_rows']:,} positions each"
    share = f"KV at most 1/{round(1 / KV_SHARE)} of it"
    if ctx > f["ctx_train"]:
        return text + f"; longer than the model was trained for ({f['ctx_train']:,})"
    if not most:
        return text + f"; this memory affords less than 4,096 ({share})"
    if ctx > most:
        return text + f"; longer than this memory affords: up to {most:,} keeps the {share} (-c {most})"
    trained = ", the model's trained context" if most == f["ctx_train"] else ""
    return text + f"; this memory affords up to {most:,} ({share}{trained})"


def _slots(f: dict) -> str:
    """gateway.parallel: requests decoded at once, each slot with its own KV cache (docs/batching.md)."""
    n = f["parallel"]
    if n == 1:
        return "1: one request at a time (--parallel N decodes N at once, each slot with its own KV cache)"
    pool, ctx = f["kv_pool"], f["ctx_size"]
    return (
        f"{n} requests decoded at once in one batched pass; their KV caches share a pool of {pool:,} positions "
        f"({pool / ctx:.2g} contexts; KV above: {_mib(f['kv_bytes'])} for all slots), idle slots giving theirs back "
        "as others need it (--kv-pool)"
    )


def _experts_used(f: dict) -> str:
    k, own = f["n_expert_used"], f["n_expert_used_model"]
    return f"{k} a token" + ("" if k == own else f" (--n-expert-used, LOSSY: the model's own is {own})")


def print_report(f: dict) -> None:
    rows = [
        (
            "model",
            f"{f['model']}: {f['arch']}, {f['n_layer']} layers × {f['n_expert']} experts, {_experts_used(f)}, file {_mib(f['file_bytes'])}",
        ),
        (
            "sizes",
            f"dense {_mib(f['dense_bytes'])}, experts {_mib(f['expert_bytes_total'])} "
            f"({f['expert_bytes'] / 1e6:.2f} MB each), KV {_mib(f['kv_bytes'])} at ctx {f['ctx_size']}"
            + (f"; MTP/NextN block {_mib(f['nextn_bytes'])}, not loaded" if f["nextn_bytes"] else ""),
        ),
        (
            "per token",
            f"one token's experts {_mib(f['floor_bytes'])} (the smallest cache), active weights {_mib(f['active_bytes_per_token'])}",
        ),
        ("context", _context(f)),
        ("slots", _slots(f)),
        ("memory", f"{_mib(f['available_bytes'])} available: {f['available']}"),
        (
            "budget",
            f"{f['budget']} → {f['n_slabs']:,} slabs"
            + (
                f", {f['n_slabs'] + f['n_slabs_lent']:,} while the context is short and no long prompt runs"
                if f.get("n_slabs_lent")
                else ""
            ),
        ),
    ]
    if not f["fits"]:
        rows.append(("fits", f"NO: {f['refusal']}"))
    else:
        rows.append(
            (
                "fits",
                "yes, resident: every expert fits in the cache"
                if f["resident"]
                else f"yes, streaming: the cache holds {100 * f['n_slabs'] / (f['n_layer'] * f['n_expert']):.0f} % of the experts",
            )
        )
        rows.append(("hit rate", f"{f['hit_pct']:.1f} % of decode lookups ({f['hit_source']}: {f['hit_note']})"))
    reads = " / ".join(f"{f[f'read_gbps_{n}']:.2f}" for n in (1, 2, 4) if f[f"read_gbps_{n}"] is not None)
    rows.append(
        (
            "reads",
            f"{reads} GB/s at 1 / 2 / 4 lanes, {f['expert_bytes'] / 1e6:.2f} MB experts "
            f"({f['read_note']}); {f['read_gbps']:.2f} used ({f['read_lanes']} lanes)"
            + (f"; reads cost the compute beside them {f['read_tax_s_per_gb']:.2f} s a GB" if f.get("read_tax_s_per_gb") else ""),
        )
    )
    rows.append(("threads", f"{f['threads']} compute threads ({f['threads_reason']})"))
    rows.append(
        (
            "kernels",
            f"experts {f['expert_gws']} G weights/s ({f['threads']} threads; {f['expert_gws_1t']} at 1), "
            f"dense {f['dense_gws']} ({f['dense_gws_1t']} at 1)",
        )
    )
    io = "-" if f["io_ms"] is None else f"{f['io_ms']:.1f} ms"
    rows.append(
        (
            "time/token",
            f"compute {f['compute_ms']:.1f} ms (a decode step of the model on stand-in weights {f['step_ms']:.1f} ms; "
            f"kernels alone {f['kernel_ms']:.1f}), io {io}",
        )
    )
    if f["tok_s"] is None:
        rows.append(("forecast", f"does not run here; bottleneck: {f['bottleneck']}"))
    else:
        rows.append(
            (
                "forecast",
                f"≈ {f['tok_s']:.1f} tok/s decode, bottleneck: {f['bottleneck']} (wall = {f['overlap_factor']:.2f} × max(compute, io))",
            )
        )
    if f["tok_s"] is not None and f["threads"] > 1 and f["tok_s_1t"] > 1.1 * f["tok_s"]:
        rows.append(
            (
                "note",
                f"with -t 1 (one compute thread): ≈ {f['tok_s_1t']:.1f} tok/s; {f['threads']} threads "
                "lose here now, their calls wait for a busy core",
            )
        )
    if f["load_avg_1m"] > 0.5 * (f["cores"] or 1):
        rows.append(
            (
                "note",
                f"load average {f['load_avg_1m']} on {f['cores']} cores while measuring: the figures "
                "are the best windows, what the machine does when quiet; busy, it runs slower",
            )
        )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def print_source(f: dict) -> None:
    """Where a forecast before the download came from, and how to get the file."""
    if f["source"] == "file":
        return
    print(f"{'source':<10}  {f['source_note']}")
    print(f"{'pull':<10}  `{f['pull']}` fetches it ({f['file_bytes'] / 1e9:.1f} GB)")


def run(args: argparse.Namespace) -> int:
    from ..shared.config_flags import overrides_from_args
    from ..shared.errors import UserError
    from ..shared.gguf.model_file import open_model
    from ..shared.hub.resolve import model_file, unpulled_model
    from ..shared.progress import StatusLine
    from .run_cmd import load_run_config

    if args.seconds <= 0:
        raise UserError(f"--seconds must be positive, got {args.seconds:g}")
    # a catalog model not pulled yet is forecast from its header (shared/hub/preview.py)
    unpulled = unpulled_model(args.model, overrides_from_args(args))
    cfg = unpulled[0] if unpulled else load_run_config(args)  # a bad config or model: its one line, before anything is shown
    # Something at once: the imports, a first run's kernel compiles and the measuring take seconds.
    with StatusLine() as status:

        def stage(text: str) -> None:
            status.update(f"doctor: {text}")

        stage("loading the forecast's code")
        from ..shared.analysis.forecast import forecast

        if unpulled:
            from ..shared.hub.preview import open_preview

            with open_preview(unpulled[1], on_status=stage) as pv:
                f = forecast(pv.mf, cfg, mem_limit_mb=args.mem_limit_mb, seconds=args.seconds, on_stage=stage)
            e = pv.entry
            f.update(model=f"{e.name} ({e.repo}:{e.quant})", source=pv.source, source_note=pv.note, pull=e.pull_command)
        else:
            with open_model(model_file(cfg)) as mf:
                f = forecast(mf, cfg, mem_limit_mb=args.mem_limit_mb, seconds=args.seconds, on_stage=stage)
            f.update(source="file", source_note=None, pull=None)
    if args.json:
        print(json.dumps(f))
    else:
        print_report(f)
        print_source(f)
    return 0 if f["fits"] else 1  # a verdict scripts can test; 2 stays "bad input"
