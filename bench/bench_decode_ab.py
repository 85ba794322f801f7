"""Resident decode of an earlier commit against the working tree, in one process.

    python bench/bench_decode_ab.py --base REF [--model PATH] [--layers 8] [-n 24] [--rounds 6] [--prompt-tokens 64]

The commit REF is exported to the temporary folder (outside the tree: the docs' tests
read every file in it) and imported beside the working tree as `moe_pipe_base` (its
absolute imports renamed), so both load the same file, share the page cache and meet
the same load on this machine. First their logits are compared over `--check` decode
steps, bit for bit (the run stops if they differ), then each times `-n` decode steps
after the same prompt, the two alternated `--rounds` times (which goes first alternates
too); the medians are printed. Timings of separate processes drift by 10-20 % within an
hour on this 2-core host: alternating in one process is how a change of a few percent
is seen (docs/benchmarks.md § Decode: Python between the kernels (2026-12-05)).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)
from bench_decode import prompt_ids  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASE_PACKAGE = "moe_pipe_base"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the git commit (or any ref) to compare the working tree with")
    p.add_argument("--model", help="GGUF to use (default: the qwen30b-shape model cut to --layers)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-n", type=int, default=24, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--check", type=int, default=40, help="decode steps whose logits are compared")
    return p.parse_args(argv)


def export_base(ref: str) -> Path:
    """The commit's package in <tmp>/moe-pipe-base-<sha>/moe_pipe_base, made once (a fixed
    folder, so numba's disk cache keeps its kernels between runs)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", ref], check=True, capture_output=True, text=True).stdout.strip()
    folder = Path(tempfile.gettempdir()) / f"moe-pipe-base-{sha[:12]}"
    package = folder / BASE_PACKAGE
    if not package.exists():
        package.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)
        for py in package.rglob("*.py"):
            py.write_text(re.sub(r"\bmoe_pipe\.", f"{BASE_PACKAGE}.", py.read_text()))
    return folder


def load(package: str, path: Path, threads: int):
    """The model of `path` from `package` (the working tree's or the base's)."""
    quant = __import__(f"{package}.shared.quant", fromlist=["quant"])
    model_file = __import__(f"{package}.shared.gguf.model_file", fromlist=["model_file"])
    load_part = __import__(f"{package}.shared.model.load", fromlist=["load"])
    quant.set_threads(threads)
    quant.one_blas_thread()  # as `run --no-stream` does (bench_decode.py says why)
    return load_part.load_model(model_file.open_model(path))


def decode(model, prompt: list[int], n: int):
    """The prompt's logits and n greedy decode steps' after it, and the steps' ms/token."""
    import numpy as np

    cache = model.new_cache(len(prompt) + n + 8)
    logits = [model.prefill(prompt, cache, batch=len(prompt))]
    t0 = time.perf_counter()
    for _ in range(n):
        logits.append(model.decode_one(int(np.argmax(logits[-1])), cache))
    return logits, (time.perf_counter() - t0) * 1e3 / n


def main(argv=None) -> int:
    import numpy as np

    args = parse(argv)
    path = shape_model(args.model, args.layers)
    sys.path.insert(0, str(export_base(args.base)))
    models = {"base": load(BASE_PACKAGE, path, args.threads), "tree": load("moe_pipe", path, args.threads)}
    prompt = prompt_ids(args.prompt_tokens, models["tree"].spec.n_vocab)
    (base, _), (tree, _) = (decode(m, prompt, args.check) for m in models.values())
    same = all(np.array_equal(a, b) for a, b in zip(base, tree))
    print(f"{path.name}: logits of the prompt and {args.check} decode steps bit-identical, {args.base} and the working tree: {same}")
    if not same:
        return 1
    ms: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name in models if r % 2 == 0 else reversed(models):
            ms[name].append(decode(models[name], prompt, args.n)[1])
        print(f"round {r}: base {ms['base'][-1]:.2f}, tree {ms['tree'][-1]:.2f} ms/token", flush=True)
    b, t = statistics.median(ms["base"]), statistics.median(ms["tree"])
    print(f"median ms/token over {args.rounds} rounds of {args.n} tokens: base {b:.2f}, tree {t:.2f} ({b / t:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
