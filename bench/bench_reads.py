"""O_DIRECT read throughput at expert sizes, 1 and more I/O lanes.

    python3 bench/bench_reads.py [MODEL.gguf] [--lanes 1,4] [--seconds 3] [--shapes model,gpt-oss] [--buffered]

Reads random experts of MODEL (default bench/out/qwen30b-shape-L8.gguf) the
way the reader does: `ExpertFiles.read_expert` into page-aligned slabs of a
shared-memory slab arena, one slab per lane. Two shapes:

- `model`   : the file's own experts (Qwen3-30B-A3B: gate/up Q4_K 884,736 B,
              down Q6_K 1,290,240 B = 3.06 MB per expert);
- `gpt-oss` : 3 extents of 4,406,400 B (gpt-oss-120b's MXFP4 gate/up/down)
              at random 32-aligned offsets of the same file;

then one sequential dense-style read (`read_dense`, 8 MiB chunks). GB/s is
bytes that came off the disk over wall time (10^9 B/s); per-expert latency
is per lane. O_DIRECT bypasses the page cache, so a file that is cached still
measures the device. `--buffered` forces the fallback path (which does not:
with the file cached it measures memory copies).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

GPT_OSS_EXTENT = 4_406_400
DEFAULT_MODEL = Path(__file__).resolve().parent / "out" / "qwen30b-shape-L8.gguf"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from moe_pipe.shared.experts.directio import ExpertFiles, aligned_buffer
    from moe_pipe.shared.experts.shm import SlabArena, segment_name
    from moe_pipe.shared.gguf.layout import Extent, aligned_bytes
    from moe_pipe.shared.gguf.model_file import open_model

    with open_model(args.model) as mf, ExpertFiles(mf.gguf.paths, direct=not args.buffered) as ef:
        lay, spec = mf.layout, mf.spec
        print(
            f"{args.model}: {spec.n_layer} layers x {spec.n_expert} experts, "
            f"expert {lay.max_expert_bytes:,} B, slab {lay.slab_bytes:,} B, "
            f"{'O_DIRECT' if ef.direct else 'buffered: ' + str(ef.fallback_reason)}"
        )
        rng = random.Random(args.seed)
        size = mf.gguf.file_sizes[0]
        start = mf.gguf.data_start(0)

        def model_expert():
            return lay.expert_extents(rng.randrange(spec.n_layer), rng.randrange(spec.n_expert))

        def gptoss_expert():
            return tuple(Extent(0, rng.randrange(start, size - GPT_OSS_EXTENT) // 32 * 32, GPT_OSS_EXTENT) for _ in range(3))

        shapes = {k: v for k, v in {"model": model_expert, "gpt-oss": gptoss_expert}.items() if k in args.shapes}
        # the worst page rounding of a 32-aligned extent: it starts 32 B before a page ends
        slab_bytes = max(lay.slab_bytes, aligned_bytes(tuple(Extent(0, lay.align - 32, GPT_OSS_EXTENT) for _ in range(3)), lay.align))
        max_lanes = max(args.lanes)
        print(f"{'shape':8} {'lanes':>5} {'experts':>8} {'GB/s':>6} {'ms/expert p50':>14} {'p90':>6}")
        with SlabArena.create(segment_name("bench-reads"), max_lanes, slab_bytes) as arena:
            for shape, make in shapes.items():
                for lanes in args.lanes:
                    work = [make() for _ in range(20000)]  # drawn up front: lanes only read
                    n, nbytes, lat, secs = _run(ef, arena, work, lanes, args.seconds)
                    print(
                        f"{shape:8} {lanes:5d} {n:8d} {nbytes / secs / 1e9:6.2f} "
                        f"{statistics.median(lat) * 1e3:14.2f} {_p90(lat) * 1e3:6.2f}"
                    )
            first = rng.randrange(start, size - (args.dense_mb << 20)) // 4096 * 4096
            dense = [Extent(0, first, args.dense_mb << 20)]
            dest = aligned_buffer(aligned_bytes(dense, lay.align))
            t0 = time.perf_counter()
            pl = ef.read_dense(dense, dest)
            secs = time.perf_counter() - t0
            print(f"dense    {1:5d} {'-':>8} {pl.disk_bytes / secs / 1e9:6.2f}   ({pl.disk_bytes / 1e6:.0f} MB sequential, 8 MiB reads)")
    return 0


def expert_bandwidth(model, seconds: float = 2.0, seed: int = 1) -> float:
    """GB/s of one lane reading random experts of `model` with O_DIRECT: the
    machine's figure the pipeline's reader is compared with."""
    from moe_pipe.shared.experts.directio import ExpertFiles
    from moe_pipe.shared.experts.shm import SlabArena, segment_name
    from moe_pipe.shared.gguf.model_file import open_model

    with (
        open_model(model) as mf,
        ExpertFiles(mf.gguf.paths) as ef,
        SlabArena.create(segment_name("bench-reads"), 1, mf.layout.slab_bytes) as arena,
    ):
        rng, spec = random.Random(seed), mf.spec
        work = [mf.layout.expert_extents(rng.randrange(spec.n_layer), rng.randrange(spec.n_expert)) for _ in range(5000)]
        _n, nbytes, _lat, secs = _run(ef, arena, work, 1, seconds)
    return nbytes / secs / 1e9


def _run(ef, arena, work, lanes, seconds):
    """(reads, bytes, per-read seconds, seconds) of lanes pulling experts off a shared list for `seconds`."""
    from moe_pipe.shared.analysis.forecast import read_lanes

    lat: list[float] = []
    nbytes, secs = read_lanes(ef, arena, work, lanes, seconds, latencies=lat)
    return len(lat), nbytes, lat, secs


def _p90(xs):
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    p.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--seconds", type=float, default=3.0, help="per shape and lane count")
    p.add_argument("--dense-mb", type=int, default=512, help="size of the sequential read")
    p.add_argument("--seed", type=int, default=0, help="which random experts (a new seed avoids any host-side cache)")
    p.add_argument("--shapes", type=lambda s: s.split(","), default=["model", "gpt-oss"], help="which read shapes (model, gpt-oss)")
    p.add_argument("--buffered", action="store_true", help="force the buffered fallback")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
