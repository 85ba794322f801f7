"""`moe-pipe make-model`: write a deterministic GGUF with random weights in real quant types."""

from __future__ import annotations

import argparse
import sys
import time

# The registry imports nothing but the standard library, so --help stays instant; the
# presets are in the families' plan parts (numpy and gguf), so make_model checks them.
from ..shared.family_registry import FAMILIES, by_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = [f.arch for f in FAMILIES] + [f.name for f in FAMILIES if f.name != f.arch]
    families = ", ".join(f.label for f in FAMILIES)
    p.add_argument("--arch", required=True, choices=names, metavar="ARCH", help=f"the model family: {families}")
    p.add_argument(
        "--preset",
        default="tiny",
        help="widths and depth: tiny (default), small, or the family's real shape, e.g. qwen30b-shape (docs/cli.md § make-model)",
    )
    p.add_argument("--layers", type=int, help="cut the depth to N layers")
    p.add_argument("--quant", help="one quant type for every weight matrix (default: the preset's mix)")
    p.add_argument(
        "--mtp",
        action="store_true",
        help="add the NextN/MTP block after the decoder's layers, as llama.cpp writes Qwen3.5/3.6 (qwen35moe); never loaded",
    )
    p.add_argument(
        "--experts",
        metavar="TYPE",
        help="a quant type for the routed experts' matrices only, over the mix or --quant (e.g. IQ2_XXS, as unsloth's UD-IQ2_XXS files)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0); same seed, same bytes")
    p.add_argument(
        "-o", "--output", required=True, help="output .gguf path, or a folder to write the default name into (ARCH-PRESET-seedS.gguf)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from ..shared.makemodel.maker import make_model, output_path
    from ..shared.progress import byte_progress

    t0 = time.perf_counter()
    family = by_name(args.arch)
    assert family is not None, args.arch  # argparse's choices are the registry's names
    # The text as typed, not a Path: a trailing "/" means a folder to write the default name into.
    target = output_path(args.output, family.arch, args.preset, args.layers, args.quant, args.seed, args.experts, args.mtp)
    with byte_progress(f"writing {target}", enabled=not args.quiet and sys.stderr.isatty()) as progress:
        out = make_model(
            family.arch,
            args.preset,
            args.output,
            layers=args.layers,
            quant=args.quant,
            seed=args.seed,
            progress=progress,
            experts=args.experts,
            mtp=args.mtp,
        )
    size = out.stat().st_size
    print(f"wrote {out} ({size / (1 << 20):,.1f} MiB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
