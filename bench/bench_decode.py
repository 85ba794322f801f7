"""Resident (`--no-stream`) prefill and decode speed next to llama.cpp on the same file.

    python bench/bench_decode.py [--layers 8] [--threads 2] [-n 32] [--prompt-tokens 64] [--model PATH]

Makes (once, under bench/out/) a qwen30b-shape model cut to `--layers` so it
fits in RAM, then runs the same greedy generation through llama.cpp
(llama-cpp-python, default mmap loading, the same threads) and through
moe-pipe's single-process path (numpy's BLAS on one thread, as `run
--no-stream` sets it), in the same run, and prints tok/s and their
ratio, the share of moe-pipe's decode time per stage (attention, router,
experts, head), and the Python time outside the kernels. llama-cpp-python is
optional: without it only moe-pipe's figures print.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF to use (default: make a qwen30b-shape model)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-n", type=int, default=32, help="decode tokens")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument(
        "--prefill-chunk",
        type=int,
        help="prompt tokens per layer-major chunk (default: compute.prefill_chunk's, the whole prompt up to 4096)",
    )
    p.add_argument("--repeat", type=int, default=3)
    return p.parse_args(argv)


def ensure_model(args) -> Path:
    return shape_model(args.model, args.layers)


def prompt_ids(n: int, n_vocab: int) -> list[int]:
    return [(i * 7919 + 13) % min(n_vocab, 4000) + 10 for i in range(n)]


def run_llama(path: Path, prompt: list[int], n: int, threads: int):
    try:
        import llama_cpp
    except ImportError:
        return None
    from moe_pipe.shared.analysis.peer_llama import last_logits

    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + n + 8, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    tokens = []
    for _ in range(n):
        tok = int(last_logits(llama_cpp, llm).argmax())
        tokens.append(tok)
        llm.eval([tok])
    t2 = time.perf_counter()
    llm.close()
    return t1 - t0, t2 - t1, tokens


class KernelClock:
    """Wraps the quant entry points and the attention kernel (wherever a loaded module holds
    it by name) to count time spent inside kernels."""

    def __init__(self):
        from moe_pipe.shared import quant
        from moe_pipe.shared.model import attend

        self.quant, self.seconds = quant, 0.0
        self.saved = {name: getattr(quant, name) for name in ("matvec", "matmul", "apply", "gather_apply", "dequantize_rows")}
        for name, fn in self.saved.items():
            setattr(quant, name, self._timed(fn))
        # Attention is a kernel too: left out, a long context's attention counted as Python.
        self.attend = attend.attend
        self.attend_sites = [
            m for name, m in list(sys.modules.items()) if name.startswith("moe_pipe.") and getattr(m, "attend", None) is self.attend
        ]
        for m in self.attend_sites:
            m.attend = self._timed(self.attend)

    def _timed(self, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return wrapper

    def restore(self):
        for name, fn in self.saved.items():
            setattr(self.quant, name, fn)
        for m in self.attend_sites:
            m.attend = self.attend


def run_ours(path: Path, prompt: list[int], n: int, threads: int, profile: bool, stages: bool = True, chunk: int | None = None):
    import numpy as np

    from moe_pipe.shared import quant
    from moe_pipe.shared.config import AUTO_PREFILL_CHUNK
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model.load import ModelOptions, load_model

    quant.set_threads(threads)
    # As `run --no-stream` and compute do (cli/run_cmd.py, procs/compute.py):
    # without it OpenBLAS's spinning workers from a prompt's attention
    # products take the cores from the kernels after them (prefill runs 2.5x
    # slower on the 8-layer qwen30b-shape model without it: docs/kernels.md).
    quant.one_blas_thread()
    mf = open_model(path)
    model = load_model(mf, options=ModelOptions(stage_timing=profile and stages))
    model.prefill(prompt[:4], model.new_cache(16))  # compile/load kernels outside the timing
    clock = KernelClock() if profile else None
    cache = model.new_cache(len(prompt) + n + 8)
    t0 = time.perf_counter()
    logits = model.prefill(prompt, cache, batch=chunk or min(len(prompt), AUTO_PREFILL_CHUNK))
    t1 = time.perf_counter()
    model.stage.reset()
    if clock:
        clock.seconds = 0.0
    tokens = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        logits = model.decode_one(tok, cache)
    t2 = time.perf_counter()
    stages = dict(model.stage.seconds)
    kernel_s = clock.seconds if clock else None
    if clock:
        clock.restore()
    mf.close()
    return t1 - t0, t2 - t1, tokens, stages, kernel_s


def python_only_ms(path: Path, prompt: list[int], n: int) -> float:
    """ms/token of the model's own Python with the matrix kernels (`quant.apply`,
    `quant.gather_apply`) and the shared attention kernel stubbed out (each returns
    zeros of the right shape): the orchestration cost alone, without the cache misses
    that real kernels cause around it. The small fused loops (norms, RoPE, SwiGLU, the
    experts' sum, routing) still run: they are the decode step's own work between the
    big kernels."""
    import numpy as np

    from moe_pipe.shared import quant
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model import blocks
    from moe_pipe.shared.model.load import load_model

    mf = open_model(path)
    model = load_model(mf)
    cache = model.new_cache(len(prompt) + 2 * n + 8)
    model.prefill(prompt, cache)
    real = quant.apply, quant.gather_apply, blocks.attend
    quant.apply = lambda p, X: np.zeros((X.shape[0], p.n_rows), np.float32)
    quant.gather_apply = lambda ps, X, act: np.zeros((len(ps), ps[0].n_rows), np.float32)
    blocks.attend = lambda q, k, v, *rest: np.zeros((*q.shape[:3], v if isinstance(v, int) else v.shape[2]), np.float32)
    try:
        model.decode_one(5, cache)
        t0 = time.perf_counter()
        for _ in range(n):
            model.decode_one(5, cache)
        return (time.perf_counter() - t0) * 1e3 / n
    finally:
        quant.apply, quant.gather_apply, blocks.attend = real
        mf.close()


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    path = ensure_model(args)
    from moe_pipe.shared.gguf.model_file import open_model

    with open_model(path) as mf:
        prompt = prompt_ids(args.prompt_tokens, mf.spec.n_vocab)
        desc = f"{mf.spec.arch} {mf.spec.n_layer} layers, {mf.gguf.file_bytes / 2**30:.2f} GiB"
    from moe_pipe.shared import quant

    print(
        f"model: {path.name} ({desc}); prompt {len(prompt)} tokens, decode {args.n}, threads {args.threads}, {args.repeat} repeats (medians); "
        f"int8 activations {'on' if quant.int8_activations() else 'off'} (MOE_PIPE_INT8_ACT)"
    )
    ours, peer = [], []
    for _ in range(args.repeat):
        ours.append(run_ours(path, prompt, args.n, args.threads, profile=False, chunk=args.prefill_chunk))
        res = run_llama(path, prompt, args.n, args.threads)
        if res:
            peer.append(res)
    prof = run_ours(path, prompt, args.n, args.threads, profile=True, chunk=args.prefill_chunk)
    # Kernel time alone (no stage timers), best of three: the Python share is
    # what the rest of a decode costs.
    clocked = min(
        (run_ours(path, prompt, args.n, args.threads, profile=True, stages=False, chunk=args.prefill_chunk) for _ in range(3)),
        key=lambda r: r[1],
    )

    def rates(runs):
        return (statistics.median(len(prompt) / r[0] for r in runs), statistics.median(args.n / r[1] for r in runs))

    o_pre, o_dec = rates(ours)
    print(f"\n{'engine':<12}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'moe-pipe':<12}{o_pre:>15.2f}{o_dec:>15.2f}")
    if peer:
        p_pre, p_dec = rates(peer)
        print(f"{'llama.cpp':<12}{p_pre:>15.2f}{p_dec:>15.2f}")
        print(f"{'ratio':<12}{o_pre / p_pre:>15.2f}{o_dec / p_dec:>15.2f}   (moe-pipe ÷ llama.cpp)")
        same = sum(a == b for a, b in zip(ours[0][2], peer[0][2]))
        print(f"greedy tokens identical to llama.cpp: {same}/{args.n}")
    else:
        print("llama.cpp: not installed (pip install llama-cpp-python) — no peer figures")
    _, dec_s, _, stages, kernel_s = prof
    print(f"\nmoe-pipe decode time by stage (profiled run, {args.n} tokens, {dec_s * 1e3 / args.n:.1f} ms/token):")
    total = sum(stages.values())
    for name, sec in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<12}{sec / dec_s * 100:6.1f} %")
    print(f"  {'other':<12}{(dec_s - total) / dec_s * 100:6.1f} %")
    _, c_dec_s, _, _, c_kernel_s = clocked
    stub_ms = python_only_ms(path, prompt, args.n)
    print(
        f"Python outside the kernels: {(c_dec_s - c_kernel_s) / c_dec_s * 100:.1f} % of decode time "
        f"({(c_dec_s - c_kernel_s) * 1e3 / args.n:.2f} of {c_dec_s * 1e3 / args.n:.1f} ms/token; best of 3 runs timing only the kernels)"
    )
    print(
        f"the model's own Python with the matrix and attention kernels stubbed out: {stub_ms:.2f} ms/token "
        f"({stub_ms / (c_dec_s * 1e3 / args.n) * 100:.1f} % of a real decode)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
