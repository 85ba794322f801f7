"""moe-pipe against llama.cpp on an emulated phone: whole replies, cold, at equal memory.

    python bench/bench_vs_llama.py [--shapes qwen30b,gemma26b,gptoss120b,qwen35] [--qwen-layers 48]
        [--gemma-layers 30] [--gptoss-layers 24] [--qwen35-layers 40] [-n 256] [--repeat 2] [--threads 2]
        [--cold copy|alternate] [--peer-readahead 8192,128] [--lossy] [--no-llama]
        [--peer-timeout S] [--doc-only]

For each shape: makes the synthetic full-width model cut to the given layers
(bench/out/, once; full depth by default), then runs the real-scale protocol
of bench/_protocol.py: each engine's whole reply from a cold start inside one
memory cgroup limit, every run on its own fresh copy of the file (`--cold
copy`, the default) or, where two copies do not fit on the disk, on the same
file with the engines' order alternating between repeats (`--cold alternate`).

Engines: moe-pipe with the shape's recipe (configs/), its cache ceiling
lifted by the recipe's own `cache_ceil_mb = "auto"` off a phone so both
engines get the same memory; llama.cpp (llama-cpp-python) mmap without
weight repacking at each `--peer-readahead` (KiB; its default loading copies
the weights into RAM and is killed loading under these limits, see
docs/benchmarks.md); with `--lossy`, moe-pipe's lossy recipe beside, labelled.

The limit gives the model-to-RAM ratio of the 11.3 GB reference phone
(docs/benchmarks.md § The protocol (2026-12-01)): Qwen3-30B-A3B is 1.6x its
RAM, Gemma 1.5x, gpt-oss-120b 5.2x (Qwen3.5-35B-A3B, `qwen35`, as Qwen3-30B-A3B:
1.6x; not in the default set), so limit = file / ratio. A cut
whose limit cannot hold the dense set, KV cache and processes plus a useful
cache is refused. Results go to bench/results/<shape>-L<layers>/protocol/
(summary.json, summary.md, per-run CSVs), and the summaries into
docs/benchmarks.md between the markers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TRACES = ROOT / "shared" / "data" / "traces"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_vs_llama: begin -->", "<!-- bench_vs_llama: end -->"
# What a limit must leave beyond the dense set and KV cache: the engine's own
# processes and at least this share of the experts as cache.
PROCESSES_MB = 1024
MIN_CACHE_FRACTION = 0.05


SHAPES = {
    "qwen30b": dict(arch="qwen3moe", preset="qwen30b-shape", config="configs/qwen30b.toml", trace="qwen.route.csv", ratio=1.6),
    "gemma26b": dict(arch="gemma4", preset="gemma26b-shape", config="configs/gemma26b.toml", trace=None, ratio=1.5),
    "gptoss120b": dict(arch="gpt-oss", preset="gptoss120b-shape", config="configs/gptoss120b.toml", trace="gptoss.route.csv", ratio=5.2),
    "qwen35": dict(arch="qwen35moe", preset="qwen35-35b-shape", config="configs/qwen35-35b.toml", trace=None, ratio=1.6),
}
# The lossy recipe reported beside (changes outputs): two experts fewer a token and
# misses of little weight skipped (docs/configuration.md, compute.n_expert_used and drop_cold_experts).
LOSSY = {"qwen30b": ("compute.n_expert_used=6", "compute.drop_cold_experts=0.5"), "gemma26b": ("compute.n_expert_used=6", "compute.drop_cold_experts=0.5"),
         "gptoss120b": ("compute.n_expert_used=2", "compute.drop_cold_experts=0.5"),
         "qwen35": ("compute.n_expert_used=6", "compute.drop_cold_experts=0.5")}  # fmt: skip


def limit_mb(name: str, model: Path) -> float:
    """file / the phone's ratio, checked to leave room for a useful cache."""
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.gguf.spec import kv_cache_bytes

    with open_model(model) as mf:
        limit = mf.gguf.file_bytes / 2**20 / SHAPES[name]["ratio"]
        compute = load_config(ROOT / SHAPES[name]["config"], {"model.path": str(model)}).compute
        per_layer_mb = mf.spec.n_expert * mf.layout.slab_bytes / 2**20
        fixed_mb = mf.layout.dense_bytes / 2**20 + kv_cache_bytes(mf.spec, compute.ctx_size, compute.kv_type) / 2**20 + PROCESSES_MB
        n_layer = mf.spec.n_layer
    if limit - fixed_mb < MIN_CACHE_FRACTION * n_layer * per_layer_mb:
        sys.exit(
            f"{name} cut to {n_layer} layers: file / {SHAPES[name]['ratio']} = {limit:,.0f} MiB does not hold "
            f"the dense set, KV cache and processes ({fixed_mb:,.0f} MiB) plus {MIN_CACHE_FRACTION:.0%} of the "
            f"experts; cut it to more layers"
        )
    return round(limit)


def results_name(stem: str) -> str:
    """A made model's name in results and figures: its preset's without "-shape" (qwen30b-L48)."""
    return stem.replace("-shape", "")


def results_dir(model: Path) -> Path:
    return RESULTS / results_name(model.stem)


def moe_pipe_bench(name: str, model: Path, out: Path, args, limit: float | None, extra: list[str]) -> Path:
    """`moe-pipe bench` with the shape's recipe (configs/), this script's -t/-n/--repeat/--set; its summary.md."""
    cmd = (
        [
            sys.executable,
            "-m",
            "moe_pipe.cli.main",
            "bench",
            str(ROOT / SHAPES[name]["config"]),
            "--set",
            f'model.path="{model}"',
            "-t",
            str(args.threads),
            "-n",
            str(args.n),
            "--repeat",
            str(args.repeat),
            "--out",
            str(out),
        ]
        + (["--mem-limit-mb", str(limit)] if limit is not None else [])
        + extra
    )
    for item in args.set:
        cmd += ["--set", item]
    print(f"== {out.relative_to(ROOT)}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return out / "summary.md"


def shape_arguments(description: str, n: int, repeat: int, layers: tuple[int, int, int, int] = (8, 30, 16, 40)) -> argparse.ArgumentParser:
    """The flags the end-to-end scripts take: which shapes, their cuts, the generation and overrides."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shapes", default="qwen30b,gptoss120b")
    p.add_argument("--qwen-layers", type=int, default=layers[0])
    p.add_argument("--gemma-layers", type=int, default=layers[1])
    p.add_argument("--gptoss-layers", type=int, default=layers[2])
    p.add_argument("--qwen35-layers", type=int, default=layers[3])
    p.add_argument("-n", type=int, default=n)
    p.add_argument("--repeat", type=int, default=repeat)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for moe-pipe runs")
    return p


def shape_layers(name: str, args) -> int:
    layers = {"qwen30b": args.qwen_layers, "gemma26b": args.gemma_layers, "gptoss120b": args.gptoss_layers, "qwen35": args.qwen35_layers}
    return layers[name]


def spec_trace(name: str) -> str | None:
    return SHAPES[name]["trace"]


def engines(name: str, args) -> list:
    from _protocol import Engine

    out = [Engine("moe-pipe", "moe-pipe", tuple(args.set))]
    if args.trace and spec_trace(name):
        out.append(
            Engine("moe-pipe trace-driven", "moe-pipe", (*args.set, f"compute.route_replay={TRACES / spec_trace(name)}"), lossy=True)
        )
    if args.lossy:
        out.append(Engine("moe-pipe lossy (" + ", ".join(LOSSY[name]) + ")", "moe-pipe", (*args.set, *LOSSY[name]), lossy=True))
    if not args.no_llama:
        out += [Engine(f"llama.cpp mmap ra{ra}", "llama.cpp", readahead_kb=int(ra)) for ra in args.peer_readahead.split(",")]
    return out


def main(argv=None) -> int:
    from _protocol import clean_up_on_term, markdown, run_protocol

    from moe_pipe.shared.config import load_config

    clean_up_on_term()
    p = shape_arguments(__doc__.splitlines()[0], n=256, repeat=2, layers=(48, 30, 24, 40))
    p.set_defaults(shapes="qwen30b,gemma26b,gptoss120b")
    p.add_argument("--cold", choices=("copy", "alternate"), default="copy", help="fresh copy per run, or engines alternating on one file")
    p.add_argument("--peer-readahead", default="8192,128", help="llama.cpp runs: readaheads in KiB, comma-separated")
    p.add_argument("--peer-timeout", type=float, default=900)
    p.add_argument("--lossy", action="store_true", help="also run the shape's lossy moe-pipe recipe (labelled)")
    p.add_argument("--trace", action="store_true", help="also run moe-pipe driven by the phone's recorded routing (labelled)")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--doc-only", action="store_true", help="only rewrite docs/benchmarks.md from the committed results")
    p.add_argument(
        "--forecast-only", action="store_true", help="only set the doctor's forecast afresh beside the shapes' committed results (no runs)"
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help="a prompt of this many tokens of ordinary prose (the protocol's lengths: 512, ~3,600) instead of the fixed 16-token one",
    )
    args = p.parse_args(argv)
    import json

    for name in [] if args.doc_only else args.shapes.split(","):
        spec = SHAPES[name]
        layers = shape_layers(name, args)
        model = shape_model(None, layers, spec["arch"], spec["preset"])
        limit = limit_mb(name, model)
        config = ROOT / spec["config"]
        lanes = load_config(config, {"model.path": str(model)}).io.io_threads
        out = results_dir(model) / ("protocol" if args.prompt_tokens is None else f"protocol-P{args.prompt_tokens}")
        if args.forecast_only:
            summary = json.loads((out / "summary.json").read_text())
        else:
            summary = run_protocol(
                model, config, engines(name, args), limit_mb=limit, n=args.n, repeat=args.repeat, threads=args.threads,
                out=out, cold=args.cold, peer_timeout_s=args.peer_timeout, lanes=lanes, prompt_length=args.prompt_tokens,
            )  # fmt: skip
        summary["forecast"] = doctor_forecast(config, model, limit, args.threads, fresh=args.cold == "copy")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "summary.md").write_text(
            markdown(
                summary,
                f"{spec['preset']}, {layers} layers, memory limit {limit:,.0f} MiB (file / {spec['ratio']})"
                + ("" if args.prompt_tokens is None else f", a {summary['prompt_tokens']:,}-token prose prompt"),
            )
        )
        print((out / "summary.md").read_text())
    write_doc()
    return 0


def doctor_forecast(config: Path, model: Path, limit: float, threads: int, fresh: bool = True) -> dict:
    """What `moe-pipe doctor` forecasts for this run (its threads, its memory limit), to set
    beside the measured figures. On a fresh copy of the model, as every run reads one: this
    VM's host reads blocks no one has read at 1.9-2.3 GB/s and others at 1.2-1.4 (the cold
    check's two figures), and the doctor's reads should meet the disk the runs met."""
    from _protocol import fresh_copy

    from moe_pipe.shared.analysis.forecast import forecast
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.gguf.model_file import open_model

    copy = model.with_name(model.stem + "-doctor.gguf") if fresh else model
    try:
        if fresh:
            fresh_copy(model, copy)
        cfg = load_config(config, {"model.path": str(copy), "compute.threads": threads})
        with open_model(copy) as mf:
            fc = forecast(mf, cfg, mem_limit_mb=limit, seconds=4.0)
    finally:
        if fresh:
            copy.unlink(missing_ok=True)
    keys = (
        "tok_s",
        "tok_s_1t",
        "hit_pct",
        "hit_source",
        "bottleneck",
        "budget_mb",
        "warmup_ms",
        "warmup_hit_pct",
        "read_gbps",
        "compute_ms",
        "io_ms",
    )
    return {k: fc.get(k) for k in keys}


def write_doc() -> None:
    """Every shape's committed results (not just this invocation's) into docs/benchmarks.md."""
    import json

    parts = []
    for name, spec in SHAPES.items():
        for res in sorted(RESULTS.glob(f"{results_name(spec['preset'])}-L*")):
            protocol = res / "protocol" / "summary.md"
            long_prompts = sorted(res.glob("protocol-P*/summary.md"), key=lambda p: int(p.parent.name.removeprefix("protocol-P")))
            if protocol.exists() or long_prompts:
                parts += ["\n" + p.read_text() for p in ([protocol] if protocol.exists() else []) + long_prompts]
                continue
            summaries = [res / kind / "summary.md" for kind in ("own", "trace") if (res / kind / "summary.md").exists()]
            if not summaries:
                continue
            s = json.loads(summaries[0].with_suffix(".json").read_text())
            parts.append(
                f"\n### {name}-shape, {res.name.split('-L')[-1]} layers, memory limit "
                f"{s['mem_limit_mb']:,.0f} MiB (file / {spec['ratio']})\n"
            )
            for path in summaries:
                text = path.read_text().split("\n", 2)[2]  # drop the title line
                parts.append(f"From `{path.relative_to(ROOT)}`:\n\n{text}")
    replace_block(DOC, BEGIN, END, "\n".join(parts), "## moe-pipe against llama.cpp on an emulated phone")


def replace_block(doc_path: Path, begin: str, end: str, body: str, heading: str) -> None:
    """Put `body` between the markers of a doc (appended under `heading` the first time)."""
    doc = doc_path.read_text() if doc_path.exists() else ""
    block = f"{begin}\n{body}\n{end}"
    if begin in doc:
        doc = doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end) :]
    else:
        doc = doc.rstrip() + f"\n\n{heading}\n\n{block}\n"
    doc_path.write_text(doc)
    print(f"updated {doc_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
