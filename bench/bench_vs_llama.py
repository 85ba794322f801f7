"""moe-pipe against llama.cpp on an emulated phone, end to end.

    python bench/bench_vs_llama.py [--shapes qwen30b,gptoss120b] [--qwen-layers 8] [--gptoss-layers 16]
                                   [-n 32] [--repeat 2] [--threads 2] [--no-llama]

For each shape: makes the synthetic full-width model cut to the given layers
(bench/out/, once), then runs `moe-pipe bench` twice with the shape's recipe
(configs/qwen30b.toml, configs/gptoss120b.toml; threads set to this machine's):

  own/    each engine's own routing on the same file, moe-pipe and llama.cpp
          (mmap without repacking at the machine's readahead and at 128 KiB, and
          its default loading), in one memory cgroup limit;
  trace/  moe-pipe driven by the real model's recorded routing
          (--route-replay shared/data/traces/*.route.csv), same limit.

The limit gives the seed phone's model-to-RAM ratio: Qwen3-30B-A3B ran at
1.6x RAM, gpt-oss-120b at 5.2x, so limit = file / ratio. A cut model keeps
the whole embedding and output head, so its dense share is larger than the
full model's; gpt-oss is therefore cut to 16 layers by default (27 GB), the
fewest at which file / 5.2 still leaves a cache of about a tenth of the
experts after the dense set, KV cache and the engine's processes, near the
phone's 7 %. A cut whose limit cannot hold that is refused. Results go to
bench/results/<shape>-L<layers>/{own,trace}/ (committed), and their summary.md
files into docs/benchmarks.md between the markers.
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
    "gptoss120b": dict(arch="gpt-oss", preset="gptoss120b-shape", config="configs/gptoss120b.toml", trace="gptoss.route.csv", ratio=5.2),
}


def limit_mb(name: str, model: Path) -> float:
    """file / the phone's ratio, checked to leave room for a useful cache."""
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.gguf.spec import kv_cache_bytes

    with open_model(model) as mf:
        limit = mf.gguf.file_bytes / 2**20 / SHAPES[name]["ratio"]
        ctx = load_config(ROOT / SHAPES[name]["config"], {"model.path": str(model)}).compute.ctx_size
        per_layer_mb = mf.spec.n_expert * mf.layout.slab_bytes / 2**20
        fixed_mb = mf.layout.dense_bytes / 2**20 + kv_cache_bytes(mf.spec, ctx) / 2**20 + PROCESSES_MB
        n_layer = mf.spec.n_layer
    if limit - fixed_mb < MIN_CACHE_FRACTION * n_layer * per_layer_mb:
        sys.exit(
            f"{name} cut to {n_layer} layers: file / {SHAPES[name]['ratio']} = {limit:,.0f} MiB does not hold "
            f"the dense set, KV cache and processes ({fixed_mb:,.0f} MiB) plus {MIN_CACHE_FRACTION:.0%} of the "
            f"experts; cut it to more layers"
        )
    return round(limit)


def results_dir(model: Path) -> Path:
    return RESULTS / model.stem.replace("-shape", "")


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


def bench(name: str, model: Path, limit: float, args, kind: str) -> Path:
    if kind == "trace":
        extra = ["--route-replay", str(TRACES / SHAPES[name]["trace"])]
    else:
        extra = [] if args.no_llama else ["--vs", "llama.cpp", "--peer-timeout", str(args.peer_timeout)]
    return moe_pipe_bench(name, model, results_dir(model) / kind, args, limit, extra)


def shape_arguments(description: str, n: int, repeat: int) -> argparse.ArgumentParser:
    """The flags both end-to-end scripts take: which shapes, their cuts, the generation and overrides."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shapes", default="qwen30b,gptoss120b")
    p.add_argument("--qwen-layers", type=int, default=8)
    p.add_argument("--gptoss-layers", type=int, default=16)
    p.add_argument("-n", type=int, default=n)
    p.add_argument("--repeat", type=int, default=repeat)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for moe-pipe runs")
    return p


def main(argv=None) -> int:
    p = shape_arguments(__doc__.splitlines()[0], n=32, repeat=2)
    p.add_argument("--peer-timeout", type=float, default=600)
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--kinds", default="own,trace", help="which runs: own (vs llama.cpp), trace (route-replayed)")
    p.add_argument("--doc-only", action="store_true", help="only rewrite docs/benchmarks.md from the committed results")
    args = p.parse_args(argv)
    for name in [] if args.doc_only else args.shapes.split(","):
        spec = SHAPES[name]
        layers = args.qwen_layers if name == "qwen30b" else args.gptoss_layers
        model = shape_model(None, layers, spec["arch"], spec["preset"])
        limit = limit_mb(name, model)
        for kind in args.kinds.split(","):
            bench(name, model, limit, args, kind)
    write_doc()
    return 0


def write_doc() -> None:
    """Every shape's committed results (not just this invocation's) into docs/benchmarks.md."""
    import json

    parts = []
    for name, spec in SHAPES.items():
        for res in sorted(RESULTS.glob(f"{name}-L*")):
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
