"""What the disk's reads cost the compute beside them, on this machine.

    python3 bench/bench_read_tax.py [MODEL.gguf] [--seconds 6] [--lanes 4] [--seed N]

The pipeline overlaps a prompt's expert reads with its compute; that is free only
where a read costs the cores nothing (DMA into memory). Three phases of --seconds
each, twice in turn:

- compute alone: the prompt's int8 GEMM (a Q4_K 768 × 2,048 expert over 64 rows,
  the shape of a 512-token prompt's experts) on --threads threads, from DRAM;
- reads alone: the reader's O_DIRECT expert reads of MODEL (`bench_reads.py`,
  its own process, --lanes lanes, experts drawn at random by --seed);
- both at once.

It prints the GEMM's rate alone and beside the reads, the reads' GB/s alone and
beside the GEMM, and the compute lost per GB read (the GEMM's shortfall × seconds
over the GB read: seconds of the GEMM on its threads, as `moe-pipe doctor` measures it). A host that serves its guests'
disk on their own cores (a VM's emulated disk) shows it here; the same compute
at full depth then runs as much slower as the prompt reads (docs/benchmarks.md
§ Reads cost compute on this host).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE / "out" / "qwen30b-shape-L48.gguf"
ROWS, COLS, TOKENS = 768, 2048, 64  # a prompt's gate or up projection over its 64 rows
ROTATE_BYTES = 300e6  # enough distinct weights to be read from DRAM, as a prompt's experts are


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not Path(args.model).exists():
        print(f"bench_read_tax: {args.model} does not exist (bench/_models.py shape_model makes it)", file=sys.stderr)
        return 2
    from moe_pipe.shared import quant

    quant.set_threads(args.threads)
    gemm = _gemm_loop(quant)
    gemm(0.2)  # compile or load the kernel outside the timing
    alone, beside, reads_alone, reads_beside = [], [], [], []
    for turn in range(args.turns):
        alone.append(gemm(args.seconds))
        reads_alone.append(_reads(args, seed=args.seed + 2 * turn).wait_rate())
        reader = _reads(args, seed=args.seed + 2 * turn + 1)
        reader.started()  # its lanes under way before the GEMM starts, and still when it ends
        beside.append(gemm(args.seconds - 0.5))
        reads_beside.append(reader.wait_rate())
    a, b = statistics.median(alone), statistics.median(beside)
    ra, rb = statistics.median(reads_alone), statistics.median(reads_beside)
    lost = (1 - b / a) / rb if rb > 0 else float("nan")  # seconds of the GEMM's rate lost per second, over GB per second
    print(f"{Path(args.model).name}: {args.threads} threads, {args.lanes} read lanes, {args.seconds:g} s a phase, medians of {args.turns}")
    print("| what | alone | beside the other | ratio |\n|---|---|---|---|")
    print(f"| Q4_K {ROWS} × {COLS} GEMM over {TOKENS} rows, G multiply-adds/s | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    print(f"| O_DIRECT expert reads, GB/s | {ra:.2f} | {rb:.2f} | {rb / ra:.2f} |")
    print(
        f"compute lost per GB read: {lost:.2f} s of the GEMM on {args.threads} threads ({lost * args.threads:.2f} core-seconds; the doctor's read_tax_s_per_gb)"
    )
    return 0


def _gemm_loop(quant):
    """A function(seconds) -> G multiply-adds/s of the GEMM, rotating through weights in DRAM."""
    import numpy as np

    from moe_pipe.shared.quant.blocks import QType, random_blocks

    rng = np.random.default_rng(0)
    per = ROWS * COLS * 144 // 256  # Q4_K: 144 B a 256-weight block
    weights = [random_blocks(QType.Q4_K, ROWS * COLS, rng).reshape(ROWS, -1) for _ in range(max(2, int(ROTATE_BYTES // per)))]
    x = rng.standard_normal((TOKENS, COLS), dtype=np.float32)
    y = np.empty((TOKENS, ROWS), np.float32)

    def run(seconds: float) -> float:
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for w in weights:
                quant.matmul(QType.Q4_K, w, x, out=y)
            calls += len(weights)
        return calls * ROWS * COLS * TOKENS / (time.perf_counter() - t0) / 1e9

    return run


class _reads:
    """bench_reads.py's model-shaped expert reads in a process of their own, started at once."""

    def __init__(self, args, seed: int):
        cmd = [sys.executable, "-u", str(HERE / "bench_reads.py"), args.model, "--lanes", str(args.lanes), "--seconds", str(args.seconds)]
        cmd += ["--seed", str(seed), "--dense-mb", "8", "--shapes", "model"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.head: list[str] = []

    def started(self) -> None:
        """Wait for the table's header: the lanes start reading as it is printed."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.head.append(line)
            if line.startswith("shape"):
                return

    def wait_rate(self) -> float:
        out, err = self.proc.communicate()
        out = "".join(self.head) + out
        if self.proc.returncode != 0:
            raise SystemExit(f"bench_read_tax: the reads failed: {err.strip().splitlines()[-1] if err.strip() else self.proc.returncode}")
        m = re.search(r"^model\s+\d+\s+\d+\s+([\d.]+)", out, re.M)
        if m is None:
            raise SystemExit(f"bench_read_tax: no rate in the reads' output:\n{out}")
        return float(m.group(1))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL), help="a GGUF to read experts of (default: qwen30b-shape L48)")
    p.add_argument("--seconds", type=float, default=6.0, help="each phase")
    p.add_argument("--lanes", type=int, default=4, help="read lanes (the engine's io.io_threads)")
    p.add_argument("--threads", type=int, default=2, help="the GEMM's threads (the engine's compute.threads)")
    p.add_argument("--turns", type=int, default=2, help="how many times the phases run in turn")
    p.add_argument("--seed", type=int, default=0, help="which experts are read (a new seed reads blocks the host has not cached)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
