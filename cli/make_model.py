"""`moe-pipe make-model`: write a deterministic GGUF with random weights in real quant types."""

from __future__ import annotations

import argparse
import sys
import time

# These mirror shared.makemodel's ARCHES and PRESETS (kept here so --help needs no numpy).
ARCHES = ("qwen3moe", "gpt-oss", "gemma4", "qwen35moe", "llama", "glm4moe", "lfm2moe", "deepseek2", "qwen2moe")
PRESETS = (
    "tiny",
    "small",
    "qwen30b-shape",
    "gptoss120b-shape",
    "gemma26b-shape",
    "qwen35-35b-shape",
    "mixtral-8x7b-shape",
    "glm45air-shape",
    "lfm2-8b-shape",
    "deepseek-v2-lite-shape",
    "qwen15-moe-shape",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", required=True, choices=ARCHES)
    p.add_argument("--preset", default="tiny", choices=PRESETS, help="widths and depth (default: tiny)")
    p.add_argument("--layers", type=int, help="cut the depth to N layers")
    p.add_argument("--quant", help="one quant type for every weight matrix (default: the preset's mix)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0); same seed, same bytes")
    p.add_argument(
        "-o", "--output", required=True, help="output .gguf path, or a folder to write the default name into (ARCH-PRESET-seedS.gguf)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from moe_pipe.shared.makemodel.maker import make_model, output_path
    from moe_pipe.shared.progress import byte_progress

    t0 = time.perf_counter()
    # The text as typed, not a Path: a trailing "/" means a folder to write the default name into.
    target = output_path(args.output, args.arch, args.preset, args.layers, args.quant, args.seed)
    with byte_progress(f"writing {target}", enabled=not args.quiet and sys.stderr.isatty()) as progress:
        out = make_model(args.arch, args.preset, args.output, layers=args.layers, quant=args.quant, seed=args.seed, progress=progress)
    size = out.stat().st_size
    print(f"wrote {out} ({size / (1 << 20):,.1f} MiB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
