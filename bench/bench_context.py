"""A long context in the recipe's equal-memory cgroup: does the recipe's context fit?

    python bench/bench_context.py [--shapes gemma26b,gptoss120b] [--tokens 20000] [-n 8]

Makes the shape's model as bench_vs_llama does (gemma26b-shape at full depth,
gptoss120b-shape cut to `--gptoss-layers`, under bench/out/), drops the page
cache, and runs `moe-pipe run` with the shape's recipe as shipped (its 32k
context, rings on the sliding layers) inside a memory cgroup of the
protocol's limit (file / 1.5, file / 5.2), on a prompt of `--tokens` tokens of
prose (_protocol.prose_prompt: the corpus repeated, cut at a word). Prints the exit code,
the cgroup's peak memory (page cache included) against the limit, OOM kills,
the expert cache's budget, the prompt's time, the decode steps' walls at that
context and the bytes read (docs/benchmarks.md § Long prompts, "A 20,000-token context").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)
from _protocol import prose_prompt  # noqa: E402

SHAPES = {  # arch, preset, default layers, file / limit, recipe (bench_vs_llama's)
    "gemma26b": ("gemma4", "gemma26b-shape", 30, 1.5, "configs/gemma26b.toml"),
    "gptoss120b": ("gpt-oss", "gptoss120b-shape", 16, 5.2, "configs/gptoss120b.toml"),
}
ROOT = Path(__file__).resolve().parent.parent


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="gemma26b,gptoss120b")
    p.add_argument("--tokens", type=int, default=20000, help="prompt tokens")
    p.add_argument("-n", type=int, default=8, help="tokens generated after the prompt")
    p.add_argument("--gptoss-layers", type=int, default=16)
    return p.parse_args(argv)


def run_shape(name: str, args) -> None:
    from moe_pipe.shared.analysis.cgroup import MemoryCgroup, drop_page_cache
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.telemetry import read_csv
    from moe_pipe.shared.text.chat import encode_prompt
    from moe_pipe.shared.text.tokenizer import Tokenizer

    arch, preset, layers, ratio, config = SHAPES[name]
    path = shape_model(None, args.gptoss_layers if name == "gptoss120b" else layers, arch, preset)
    limit = path.stat().st_size / 2**20 / ratio
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        text = prose_prompt(tok, args.tokens)
        n_prompt = len(encode_prompt(tok, text))
    with tempfile.TemporaryDirectory() as tmp:
        prompt, csv = Path(tmp) / "prompt.txt", Path(tmp) / "run.csv"
        prompt.write_text(text, encoding="utf-8")
        cmd = [
            *(sys.executable, "-m", "moe_pipe.cli.main", "run", str(ROOT / config), "--set", f"model.path={path}"),
            *("-f", str(prompt), "-n", str(args.n), "--ignore-eos", "--output-format", "json", "--csv", str(csv), "-t", "2"),
        ]
        drop_page_cache()
        with MemoryCgroup.create(limit_mb=limit) as cg:
            t0 = time.monotonic()
            r = subprocess.run(cg.wrap(cmd), capture_output=True, text=True)
            wall = time.monotonic() - t0
            peak, kills = cg.peak_bytes(), cg.oom_kills()
        print(f"{path.name} ({path.stat().st_size / 2**20:,.0f} MiB), limit {limit:,.0f} MiB, {config}, a {n_prompt:,}-token prompt:")
        print(f"  exit {r.returncode}, wall {wall:.1f} s, cgroup peak {(peak or 0) / 2**20:,.0f} MiB, OOM kills {kills}")
        if r.returncode:
            print("  " + (r.stderr.strip().splitlines() or ["(no error text)"])[-1])
            return
        header, recs = read_csv(csv)
        walls = [x.wall_ms for x in recs]
        out = json.loads(r.stdout)
        print(
            f"  context {header.get('config.compute.ctx_size')}, expert cache {float(header['budget_mib']):,.0f} MiB "
            f"({float(header['budget_mib']) / limit:.0%} of the limit); first token {walls[0] / 1000:.1f} s "
            f"({n_prompt / walls[0] * 1000:.1f} tok/s); then {', '.join(f'{w:.0f}' for w in walls[1:])} ms a token; "
            f"{out['timings']['predicted_n']} tokens generated; {out['timings']['read_bytes'] / 1e9:.1f} GB read"
        )


def main(argv=None) -> None:
    args = parse(argv)
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"error: --shapes takes {', '.join(SHAPES)}, not {name!r}")
        run_shape(name, args)


if __name__ == "__main__":
    main()
