"""What a prompt prefix shared across slots costs: memory and time, by reference and by copy.

    python bench/bench_share.py [--prefix 3000] [--takers 3] [--layers 48] [--kv-heads 4]
                                [--head-dim 128] [--ctx 8192] [--kv-type f16]

Fills one KV cache (qwen30b-shape's geometry by default: 48 layers, 4 kv heads of 128, an
8k context, f16) with `--prefix` positions, then lets `--takers` empty caches take that
prefix from it (KVCache.share_prefix_from, what a slot does when its request begins like
another slot's: docs/batching.md § Held once, by reference), and prints for each taker the
memory the caches grew by (this process's anonymous memory plus the page files' blocks)
and the time the take took; then the same with sharing by reference off (each taker a copy).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from moe_pipe.shared.gguf.spec import KV_TYPE_BYTES
from moe_pipe.shared.model import kv_pages
from moe_pipe.shared.model.blocks import KVCache

MiB = 1 << 20


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=3000, help="positions the donor holds and gives")
    p.add_argument("--takers", type=int, default=3)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--kv-type", default="f16", choices=sorted(KV_TYPE_BYTES))
    return p.parse_args(argv)


def memory(caches) -> int:
    """Anonymous memory of this process and the blocks of the page files the caches map."""
    with open("/proc/self/status") as f:
        anon = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    files = set().union(*(c.page_files() for c in caches))
    return anon + sum(os.fstat(f.fd).st_blocks * 512 for f in files)


def run(a, by_reference: bool) -> list[tuple[float, float]]:
    """(MiB grown, seconds) per taker."""
    make = lambda: KVCache(a.ctx, (a.kv_heads,) * a.layers, (a.head_dim,) * a.layers, (a.head_dim,) * a.layers, a.kv_type)  # noqa: E731
    donor = make()
    rng = np.random.default_rng(0)
    for layer in range(a.layers):
        k = rng.standard_normal((a.prefix, a.kv_heads, a.head_dim), dtype=np.float32)
        donor.store(layer, k, k)
    donor.advance(a.prefix)
    caches, out = [donor], []
    supported = kv_pages.supported
    if not by_reference:  # as on a system without memory files: every taker copies
        kv_pages.supported = lambda: False  # type: ignore[assignment]
    try:
        for _ in range(a.takers):
            taker = make()
            caches.append(taker)
            before = memory(caches)
            t0 = time.perf_counter()
            taker.share_prefix_from(donor, a.prefix)
            seconds = time.perf_counter() - t0
            out.append(((memory(caches) - before) / MiB, seconds))
    finally:
        kv_pages.supported = supported  # type: ignore[assignment]
    return out


def main(argv=None) -> None:
    a = parse(argv)
    num, den = KV_TYPE_BYTES[a.kv_type]
    kv_mib = a.prefix * a.layers * 2 * a.kv_heads * a.head_dim * num / den / MiB
    print(
        f"a {a.prefix:,}-position prefix, {a.layers} layers x {a.kv_heads} kv heads x {a.head_dim}, {a.kv_type}, "
        f"context {a.ctx:,}: {kv_mib:,.1f} MiB of K and V"
    )
    for by_reference in (True, False):
        rows = run(a, by_reference)
        how = "by reference" if by_reference else "by copy     "
        cells = ", ".join(f"+{mib:,.1f} MiB in {s * 1e3:,.0f} ms" for mib, s in rows)
        print(f"{how}: {cells}; {a.takers} takers {sum(m for m, _ in rows):,.1f} MiB in all")


if __name__ == "__main__":
    main()
