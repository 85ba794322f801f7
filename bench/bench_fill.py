"""The cache fill's read rate by how the slab arena's pages were prepared.

    python3 bench/bench_fill.py [--region-gib 1] [--rounds 2] [--lanes 4] [--keep]

O_DIRECT reads land in the slab arena's shared-memory pages. A page no
process has mapped yet is faulted in inside the read (allocated and zeroed,
or only mapped when the segment was fallocated), on the read's own path.
This measures the fill at expert granularity, the reader's way
(`ExpertFiles.read_expert` of a qwen30b-sized expert, 3 parts, into
consecutive slabs from `lanes` threads), into an arena prepared three ways:

- `fresh`      ftruncate only: pages allocated by the reads themselves
- `reserved`   posix_fallocate, as the supervisor creates the slab arena:
               pages exist, but this process has not mapped them
- `populated`  fallocate + `Arena.populate` (MADV_POPULATE_WRITE) in the
               reading process, as the reader's Populator does ahead of its
               fill (shared/experts/populate.py)

Every region is read once only: the file is written fresh, the page cache
dropped, and each (mode, round) reads its own never-read region, modes
interleaved, since this VM's host caches blocks read before (a re-read is
~1.6x faster) and the disk's rate drifts through the day. GB/s is 10^9 B
over the wall time of the reads; the preparation's own time is beside it.
Needs root (drop_caches). Writes region-gib x 3 x rounds GiB under bench/out/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "out"
GiB = 1 << 30
# Qwen3-30B-A3B Q4_K_M: gate and up Q4_K, down Q6_K (docs/formats.md)
PARTS = (884_736, 884_736, 1_290_240)
MODES = ("fresh", "reserved", "populated")


def write_probe_file(path: Path, nbytes: int) -> None:
    """Bytes nobody has read: random chunks, fsynced, then out of the page cache."""
    rng = np.random.default_rng(int(time.time()))
    chunk = 64 << 20
    with open(path, "wb") as f:
        for at in range(0, nbytes, chunk):
            f.write(rng.integers(0, 256, min(chunk, nbytes - at), dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())


def page_round(n: int) -> int:
    return -(-n // 4096) * 4096


def expert_extents(region_start: int, region_bytes: int, Extent) -> list[tuple]:
    """Consecutive experts of PARTS inside the region, each part page-aligned like a GGUF's."""
    experts, at = [], region_start
    size = sum(page_round(n) for n in PARTS)
    while at + size <= region_start + region_bytes:
        parts = []
        for n in PARTS:
            parts.append(Extent(0, at, n))
            at += page_round(n)
        experts.append(tuple(parts))
    return experts


def run_one(path: Path, mode: str, region_start: int, region_bytes: int, lanes: int) -> dict:
    from moe_pipe.shared.experts.directio import ExpertFiles
    from moe_pipe.shared.experts.shm import SlabArena, segment_name
    from moe_pipe.shared.gguf.layout import Extent

    slab = sum(page_round(n) for n in PARTS)
    experts = expert_extents(region_start, region_bytes, Extent)
    t0 = time.perf_counter()
    arena = SlabArena.create(segment_name(f"fill-{mode}"), len(experts), slab)
    try:
        if mode != "fresh":
            arena.arena.reserve()
        t_reserve = time.perf_counter() - t0
        t0 = time.perf_counter()
        if mode == "populated" and not arena.arena.populate(0, arena.arena.size):
            raise SystemExit("bench_fill: this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
        t_populate = time.perf_counter() - t0
        with ExpertFiles([path]) as files:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(lanes) as pool:
                placements = list(pool.map(lambda i: files.read_expert(experts[i], arena.slab(i)), range(len(experts))))
            wall = time.perf_counter() - t0
        disk = sum(p.disk_bytes for p in placements)
    finally:
        arena.close()
        arena.unlink()
    return {"mode": mode, "gbps": disk / wall / 1e9, "read_s": wall, "reserve_s": t_reserve, "populate_s": t_populate, "bytes": disk}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--region-gib", type=float, default=1.0, help="bytes read per (mode, round)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lanes", type=int, default=4, help="read threads (io.io_threads)")
    ap.add_argument("--keep", action="store_true", help="keep the probe file")
    args = ap.parse_args(argv)
    from moe_pipe.shared.analysis.cgroup import drop_page_cache

    region = int(args.region_gib * GiB) // 4096 * 4096
    n = len(MODES) * args.rounds
    OUT.mkdir(exist_ok=True)
    path = OUT / "fill-probe.bin"
    print(f"writing {n * region / GiB:.1f} GiB of never-read bytes to {path} ...", file=sys.stderr)
    write_probe_file(path, n * region)
    if not drop_page_cache():
        print("bench_fill: could not drop the page cache (not root?): reads may not be cold", file=sys.stderr)
    rows = []
    try:
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]  # interleaved, alternating, against drift
            for i, mode in enumerate(order):
                k = r * len(MODES) + i
                row = run_one(path, mode, k * region, region, args.lanes)
                rows.append(row)
                print(
                    f"  round {r + 1} {mode:<9} {row['gbps']:.2f} GB/s  (read {row['read_s']:.2f} s, "
                    f"fallocate {row['reserve_s']:.2f} s, populate {row['populate_s']:.2f} s)",
                    file=sys.stderr,
                )
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    print(f"\nfill read rate, {args.region_gib:g} GiB per run, {args.lanes} lanes, qwen30b experts (medians of {args.rounds}):\n")
    print("| slab pages | GB/s | x populated | fallocate s/GiB | populate s/GiB |")
    print("|---|---|---|---|---|")
    med = {mode: statistics.median(r["gbps"] for r in rows if r["mode"] == mode) for mode in MODES}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        res = statistics.median(r["reserve_s"] for r in mine) / args.region_gib
        pop = statistics.median(r["populate_s"] for r in mine) / args.region_gib
        print(f"| {mode} | {med[mode]:.2f} | {med[mode] / med['populated']:.2f} | {res:.2f} | {pop:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
