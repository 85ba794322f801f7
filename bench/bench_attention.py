"""Attention over an f16 KV cache: a prompt block and a decode step, next to numpy.

    python bench/bench_attention.py [--threads 2] [--kv-heads 4] [--group 8] [--head-dim 128]
                                    [--cached 2048] [--block 1024] [--repeat 5]

The kernel (shared/model/attend.py `attend`) against numpy float32 on the same
inputs in the same run: the cache's positions converted to float32, one
batched matmul for the scores, a causal mask, softmax, one matmul for the
values (what a q8_0 cache still runs). Shape defaults are Qwen3-30B-A3B's
attention (4 kv heads × 8 query heads × 128); the prompt block is `--block`
tokens after `--cached` positions, the decode step one token after all of
them. Prints medians in ms, GFLOP/s (2·(d + dv) per query head and visible
key) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="query heads per kv head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cached", type=int, default=2048, help="positions before the prompt block")
    p.add_argument("--block", type=int, default=1024, help="prompt tokens in the block")
    p.add_argument("--repeat", type=int, default=5)
    return p.parse_args(argv)


def numpy_attention(q, k16, v16, start):
    """The plain float32 way, over positions 0..start+T-1 (no window, no sinks)."""
    t, hk, g, d = q.shape
    n = start + t
    k, v = k16[:, :n].astype(np.float32), v16[:, :n].astype(np.float32)
    qg = q.transpose(1, 2, 0, 3).reshape(hk, g * t, d)
    s = (qg @ k.transpose(0, 2, 1)).reshape(hk, g, t, n) / np.float32(np.sqrt(d))
    hidden = np.arange(n)[None, :] > np.arange(start, n)[:, None]
    s = np.where(hidden, np.float32(-np.inf), s)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    p = (e / e.sum(axis=-1, keepdims=True)).reshape(hk, g * t, n)
    return (p @ v).reshape(hk, g, t, -1).transpose(2, 0, 1, 3)


def timed(fn, repeat: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from moe_pipe.shared import quant
    from moe_pipe.shared.model.attend import attend

    quant.set_threads(a.threads)
    # As the engine does (procs/compute.py): OpenBLAS's workers, spinning after the numpy
    # reference's matmuls, would otherwise take the cores from the next case's kernel.
    quant.one_blas_thread()
    rng = np.random.default_rng(0)
    hk, g, d = a.kv_heads, a.group, a.head_dim
    n_ctx = a.cached + a.block + 1
    k = rng.standard_normal((hk, n_ctx, d)).astype(np.float16)
    v = rng.standard_normal((hk, n_ctx, d)).astype(np.float16)
    q = rng.standard_normal((a.block, hk, g, d)).astype(np.float32)
    scale = 1 / np.sqrt(d)
    print(f"attention, f16 cache, {hk} kv heads × {g} query heads × {d}, {a.threads} threads, median of {a.repeat}")
    print(f"{'case':<34} {'moe-pipe ms':>12} {'numpy ms':>10} {'GFLOP/s':>9} {'ratio':>7}")
    cases = [
        (f"prompt block of {a.block} after {a.cached}", q, a.cached, a.block * (a.cached + (a.block + 1) / 2)),
        (f"decode step after {a.cached + a.block}", q[:1], a.cached + a.block, a.cached + a.block + 1),
    ]
    for name, qq, start, visible in cases:
        ours = timed(lambda qq=qq, start=start: attend(qq, k, v, 0, start, 0, scale, None), a.repeat)
        theirs = timed(lambda qq=qq, start=start: numpy_attention(qq, k, v, start), a.repeat)
        flop = 2 * 2 * d * hk * g * visible
        print(f"{name:<34} {ours * 1e3:>12.2f} {theirs * 1e3:>10.2f} {flop / ours / 1e9:>9.1f} {theirs / ours:>6.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
