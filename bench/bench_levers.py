"""What the lossy levers buy and cost, on the tiny models of each architecture.

    python bench/bench_levers.py [-n 48] [--prompts 4]

For each architecture's tiny model (made under bench/out/), at the smallest
cache that holds one token's experts and at twice that, runs the exact
pipeline and each lever setting on the same prompts (greedy) and prints: the
decode hit %, MiB read, and output agreement with the exact run — the share
of generated tokens equal to the exact run's, and the mean length of the
common prefix (once a token differs, the rest follows a different text).
Random-weight models route less predictably than real ones: read the
directions, not the magnitudes. Figures, not verdicts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
PROMPTS = [
    "The old mill by the river",
    "Once upon a time there was",
    "A quiet night in the city of",
    "She opened the door and saw",
    "In the beginning the",
    "The recipe calls for",
]
SETTINGS = [
    ("exact", {}),
    ("drop-cold 0.5", {"compute.drop_cold_experts": 0.5}),
    ("drop-cold 1.0", {"compute.drop_cold_experts": 1.0}),
    ("cache-route 0.2", {"compute.cache_route": 0.2}),
    ("cache-route 0.5", {"compute.cache_route": 0.5}),
    ("both 1.0 / 0.5", {"compute.drop_cold_experts": 1.0, "compute.cache_route": 0.5}),
    ("route-ahead", {"compute.route_ahead": True}),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=48)
    p.add_argument("--prompts", type=int, default=4)
    args = p.parse_args(argv)
    from moe_pipe.procs.pipeline import start_pipeline
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.makemodel.maker import make_model
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    OUT.mkdir(exist_ok=True)
    print(f"{'model':10} {'cache':>8} {'setting':16} {'hit %':>6} {'MiB read':>9} {'same tokens':>12} {'common prefix':>14}")
    for arch in ("qwen3moe", "gpt-oss", "gemma4"):
        path = OUT / f"{arch}-tiny.gguf"
        if not path.exists():
            make_model(arch, "tiny", path)
        with open_model(path) as mf:
            tok = Tokenizer.from_gguf(mf.gguf)
            floor_mb = mf.layout.slab_bytes * mf.spec.n_layer * mf.spec.n_expert_used / 2**20
        prompts = [tok.encode(t) for t in PROMPTS[: args.prompts]]
        for cache_mb in (floor_mb * 1.01, floor_mb * 2):
            exact = None
            for label, over in SETTINGS:
                cfg = load_config(None, {"model.path": str(path), "cache.cache_mb": cache_mb, **over})
                with start_pipeline(cfg, path) as pipe:
                    dones = [pipe.generate(pr, asdict(SamplingParams()), args.n, ignore_eos=True) for pr in prompts]
                runs = [list(d.tokens) for d in dones]
                hit = statistics.mean(float(d.timings["final_hit_pct"]) for d in dones)
                read = sum(float(d.timings.get("read_bytes", 0)) for d in dones) / 2**20
                if exact is None:
                    exact = runs
                same = sum(a == b for r, e in zip(runs, exact) for a, b in zip(r, e)) / sum(len(e) for e in exact)
                prefix = statistics.mean(next((i for i, (a, b) in enumerate(zip(r, e)) if a != b), len(e)) for r, e in zip(runs, exact))
                print(f"{arch:10} {cache_mb:7.2f}M {label:16} {hit:6.1f} {read:9.1f} {same * 100:11.0f}% {prefix:14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
