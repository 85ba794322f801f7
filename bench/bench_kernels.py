"""Quantized matvec/matmul throughput next to numpy float32 on the same shapes.

    python3 bench/bench_kernels.py [--types Q8_0,Q4_K] [--threads 2] [--tokens 16,128] [--quick] [--no-int8]

Per type and shape [R×C]: G weights/s and GB/s of quantized bytes read by
`matvec`, numpy float32 `W @ x` in the same run, and their ratio; then a
`matmul` line per --tokens T against numpy `X @ W.T` (for these, G w/s × T
is G multiply-adds/s: the int8 GEMM at T = 128 is a prompt's expert with
its share of a 2,048-token chunk). matvec runs on int8
activations for the integer types (the default, as in decode); `--no-int8`
measures the float-activation tile path instead.

Both sides read from DRAM, as experts do (each is used once per token): a
768×2048 float32 matrix is 6 MB and would sit in the 32 MB L3, so each side
rotates through enough distinct matrices for ≥ 300 MB of float32 (the
quantized side uses the same number of matrices, hence fewer bytes). Figures
are medians over repeats of one pass through all matrices.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SHAPES = [(768, 2048), (2048, 768), (2880, 2880), (151936, 2048)]
QUICK_HEAD_ROWS = 32768
ROTATE_BYTES = 300e6  # float32 bytes per side, well past the 32 MB L3


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # BLAS reads its thread count when numpy is imported: set it first.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np

    from moe_pipe.shared import quant
    from moe_pipe.shared.quant.blocks import random_blocks

    quant.set_threads(args.threads)
    quant.set_int8_activations(not args.no_int8)
    types = [quant.qtype_from_name(t) for t in args.types.split(",")] if args.types else list(quant.SUPPORTED)
    shapes = [(QUICK_HEAD_ROWS if r > 100_000 and args.quick else r, c) for r, c in SHAPES]
    repeats = 3 if args.quick else 7
    tokens = [int(t) for t in args.tokens.split(",")]
    rng = np.random.default_rng(0)
    print(
        f"threads={args.threads} repeats={repeats} (median); int8 activations {'on' if quant.int8_activations() else 'off'}; "
        "G w/s = 1e9 weights per second (per activation row on mm lines: G multiply-adds/s); ratio = kernel / numpy fp32"
    )
    print(f"{'type':7s} {'op':6s} {'shape':>12s} {'mats':>4s} {'G w/s':>7s} {'GB/s':>6s} {'numpy Gw/s':>10s} {'ratio':>6s}")
    for r, c in shapes:
        n_mats = max(1, int(ROTATE_BYTES // (r * c * 4)))
        mats = [rng.standard_normal((r, c), dtype=np.float32) for _ in range(n_mats)]
        x = rng.standard_normal(c, dtype=np.float32)
        Xs = {t: rng.standard_normal((t, c), dtype=np.float32) for t in tokens}
        np_mv = _median_pass(lambda m, x=x: m @ x, mats, repeats)
        np_mm = {t: _median_pass(lambda m, X=X: X @ m.T, mats, repeats) for t, X in Xs.items()}
        # OpenBLAS worker threads busy-wait for a while after a call; on two
        # cores they would steal the numba threads' time slices (8 ms stalls).
        time.sleep(1.0)
        for qtype in types:
            fmt = quant.block_format(qtype)
            if c % fmt.block_size:  # e.g. K-quants at C=2880: no such tensor exists
                print(f"{fmt.name:7s} {'-':6s} {f'{r}x{c}':>12s}  n/a: C is not a multiple of {fmt.block_size}")
                continue
            qmats = [random_blocks(qtype, r * c, rng).reshape(r, -1) for _ in range(n_mats)]
            y = np.empty(r, np.float32)
            quant.matvec(qtype, qmats[0], x, out=y)  # compile / load from cache outside the timing
            t_mv = _median_pass(lambda m, qtype=qtype, x=x, y=y: quant.matvec(qtype, m, x, out=y), qmats, repeats)
            rows = [("matvec", t_mv, np_mv)]
            for t, X in Xs.items():
                Y = np.empty((t, r), np.float32)
                quant.matmul(qtype, qmats[0], X, out=Y)
                t_mm = _median_pass(lambda m, qtype=qtype, X=X, Y=Y: quant.matmul(qtype, m, X, out=Y), qmats, repeats)
                rows.append((f"mm T{t}", t_mm / t, np_mm[t] / t))
            row_bytes = fmt.row_bytes(c)
            shape = f"{r}x{c}"
            for op, t, t_np in rows:
                gw, gw_np = r * c / t / 1e9, r * c / t_np / 1e9
                print(
                    f"{fmt.name:7s} {op:6s} {shape:>12s} {n_mats:4d} {gw:7.2f} {r * row_bytes / t / 1e9:6.2f} {gw_np:10.2f} {gw / gw_np:6.2f}",
                    flush=True,
                )
            del qmats
        del mats
    return 0


def _median_pass(fn, mats, repeats: int) -> float:
    """Median seconds per matrix over `repeats` passes through all of `mats`."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in mats:
            fn(m)
        times.append((time.perf_counter() - t0) / len(mats))
    times.sort()
    return times[len(times) // 2]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="", help="comma-separated type names (default: every supported type)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", default="16,128", help="matmul activation rows, comma-separated (default: 16,128)")
    p.add_argument("--quick", action="store_true", help=f"fewer repeats, output head cut to {QUICK_HEAD_ROWS} rows")
    p.add_argument("--no-int8", action="store_true", help="float activations everywhere (quant.set_int8_activations(False))")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
