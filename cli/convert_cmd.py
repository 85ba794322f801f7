"""`moe-pipe convert HF_DIR -o OUT.gguf [--outtype f32|f16|bf16|q8_0] [--no-mtp]`: a Hugging Face checkpoint to GGUF."""

from __future__ import annotations

import argparse
import sys
import time

OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # mirrors shared.convert (kept here so --help needs no numpy)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="folder with config.json, *.safetensors and tokenizer.json")
    p.add_argument("-o", "--output", required=True, help="output .gguf path")
    p.add_argument(
        "--outtype", default="f16", choices=OUTTYPES, help="type of the weight matrices (default f16); norms, biases and routers stay F32"
    )
    p.add_argument(
        "--no-mtp",
        action="store_true",
        help="leave out the NextN/MTP block (written after the decoder by default when the checkpoint has one, as llama.cpp does)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from ..shared.convert.converter import convert
    from ..shared.progress import byte_progress

    t0 = time.perf_counter()
    with byte_progress(f"converting {args.hf_dir}", enabled=not args.quiet and sys.stderr.isatty()) as progress:
        out = convert(args.hf_dir, args.output, outtype=args.outtype, progress=progress, mtp=not args.no_mtp)
    print(f"wrote {out} ({out.stat().st_size / (1 << 20):,.1f} MiB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
