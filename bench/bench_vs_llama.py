"""moe-pipe against llama.cpp on an emulated phone, end to end.

    python bench/bench_vs_llama.py [--shapes qwen30b,gptoss120b] [--qwen-layers 8] [--gptoss-layers 4]
                                   [-n 32] [--repeat 2] [--threads 2] [--no-llama]

For each shape: makes the synthetic full-width model cut to the given layers
(bench/out/, once), then runs `moe-pipe bench` twice with the shape's recipe
(configs/qwen30b.toml, configs/gptoss120b.toml; threads set to this machine's):

  own/    each engine's own routing on the same file, moe-pipe and llama.cpp
          (mmap, at the machine's readahead and at 128 KiB), in one memory cgroup limit;
  trace/  moe-pipe driven by the real model's recorded routing
          (--route-replay shared/data/traces/*.route.csv), same limit.

The limit gives the seed phone's model-to-RAM ratio where that is meaningful:
Qwen3-30B-A3B ran at 1.6x RAM, so limit = file / 1.6. gpt-oss-120b ran at
5.2x, but a model cut to a few layers keeps the whole embedding and output
head, so file / 5.2 would not even hold its dense set; instead the limit
leaves the expert cache the same fraction of all experts that the phone's
cache held of the real model's (FULL_MODEL_CACHE_FRACTION below). Results go
to bench/results/<shape>/{own,trace}/ (committed), and their summary.md
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
# gpt-oss-120b on the seed's 11 GB phone: 58.5 GB file, ~2.6 GB dense; auto
# budget capped at 4000 MiB of ~56 GB of experts: ~7 % of the experts cached.
FULL_MODEL_CACHE_FRACTION = {"gptoss120b": 4000 / (56_000 * 1.048576)}
RESERVE_MB = 512


SHAPES = {
    "qwen30b": dict(arch="qwen3moe", preset="qwen30b-shape", config="configs/qwen30b.toml", trace="qwen.route.csv",
                    ratio=1.6),
    "gptoss120b": dict(arch="gpt-oss", preset="gptoss120b-shape", config="configs/gptoss120b.toml",
                       trace="gptoss.route.csv", ratio=5.2),
}


def limit_mb(name: str, model: Path) -> float:
    from moe_pipe.procs.pipeline import kv_cache_bytes
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.model_file import open_model

    with open_model(model) as mf:
        file_mb = mf.gguf.file_bytes / 2**20
        if name not in FULL_MODEL_CACHE_FRACTION:
            return round(file_mb / SHAPES[name]["ratio"])
        ctx = load_config(ROOT / SHAPES[name]["config"], {"model.path": str(model)}).compute.ctx_size
        experts_mb = mf.spec.n_layer * mf.spec.n_expert * mf.layout.slab_bytes / 2**20
        dense_mb = mf.layout.dense_bytes / 2**20
        kv_mb = kv_cache_bytes(mf.spec, ctx) / 2**20
    return round(dense_mb + kv_mb + RESERVE_MB + FULL_MODEL_CACHE_FRACTION[name] * experts_mb)


def bench(name: str, model: Path, limit: float, args, kind: str) -> Path:
    spec = SHAPES[name]
    out = RESULTS / name / kind
    cmd = [sys.executable, "-m", "moe_pipe.cli.main", "bench", str(ROOT / spec["config"]), "--set",
           f'model.path="{model}"', "-t", str(args.threads), "-n", str(args.n), "--repeat", str(args.repeat),
           "--mem-limit-mb", str(limit), "--out", str(out)]
    if kind == "trace":
        cmd += ["--route-replay", str(TRACES / spec["trace"])]
    elif not args.no_llama:
        cmd += ["--vs", "llama.cpp", "--peer-timeout", str(args.peer_timeout)]
    print(f"== {name} {kind}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return out / "summary.md"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen30b,gptoss120b")
    p.add_argument("--qwen-layers", type=int, default=8)
    p.add_argument("--gptoss-layers", type=int, default=4)
    p.add_argument("-n", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer-timeout", type=float, default=600)
    p.add_argument("--no-llama", action="store_true")
    args = p.parse_args(argv)
    sections = []
    for name in args.shapes.split(","):
        spec = SHAPES[name]
        layers = args.qwen_layers if name == "qwen30b" else args.gptoss_layers
        model = shape_model(None, layers, spec["arch"], spec["preset"])
        limit = limit_mb(name, model)
        sections.append((name, layers, limit, [bench(name, model, limit, args, kind) for kind in ("own", "trace")]))
    write_doc(sections)
    return 0


def write_doc(sections) -> None:
    parts = [BEGIN]
    for name, layers, limit, summaries in sections:
        parts.append(f"\n### {name}-shape, {layers} layers, memory limit {limit:,.0f} MiB\n")
        for s in summaries:
            text = s.read_text().split("\n", 2)[2]  # drop the title line
            parts.append(f"From `{s.relative_to(ROOT)}`:\n\n{text}")
    parts.append(END)
    doc = DOC.read_text()
    block = "\n".join(parts)
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip() + "\n\n## moe-pipe against llama.cpp on an emulated phone\n\n" + block + "\n"
    DOC.write_text(doc)
    print(f"updated {DOC}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
