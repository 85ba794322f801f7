"""What a forward pass of several sequences' decode rows costs, resident: the compute side
of continuous batching (docs/batching.md), without reads.

    python bench/bench_batch.py [--layers 8] [--model PATH] [--rows 1,2,4,8] [--steps 24]

For each row count B: B sequences, each after its own prompt, then --steps passes of one
decode row each (`MoEModel.forward_batch`, the model in RAM as `run --no-stream`). Prints
the median pass, the aggregate tok/s and its ratio to one row, the time by stage, the
distinct experts a layer the rows route to, and the bytes a pass multiplies: each distinct
expert once and the dense matrices (attention, norms, routers, the output head) once. On a
CPU whose products stream their weights from memory, one row's bytes over B rows' bytes is
what batching can gain at most; the last column says it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)

WARM_TOKENS = 512


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF to use (default: make a qwen30b-shape model cut to --layers)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="1,2,4,8", help="decode rows a pass (sequences), comma-separated")
    p.add_argument("--steps", type=int, default=24, help="passes timed per row count (the first 4 not counted)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


def prompt_ids(seq: int, n: int, n_vocab: int) -> list[int]:
    """Sequence seq's own prompt: different tokens for every sequence."""
    return [(i * 7919 + seq * 104729 + 13) % min(n_vocab, 20000) + 10 for i in range(n)]


def measure(model, mf, B: int, steps: int, prompt_tokens: int) -> dict:
    import numpy as np

    from moe_pipe.shared.model.batch import BatchPart

    caches, toks = [], []
    for s in range(B):
        cache = model.new_cache(prompt_tokens + steps + 8)
        logits = model.prefill(prompt_ids(s, prompt_tokens, mf.spec.n_vocab), cache)
        caches.append(cache)
        toks.append(int(np.argmax(logits)))
    model.stage.reset()
    seen: dict[tuple[int, int], int] = {}  # (pass, layer) → distinct experts its rows route to
    times: list[float] = []

    def observe(layer: int, routing) -> None:
        seen[(len(times), layer)] = len(routing.unique_experts())  # the pass under way is the len(times)-th

    model.route_observer = observe
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model.forward_batch([BatchPart([t], c) for t, c in zip(toks, caches)])
        times.append(time.perf_counter() - t0)
        toks = [int(np.argmax(o[-1])) for o in out]
    model.route_observer = None
    expert_bytes = sum(n * mf.layout.expert_bytes(layer) for (_, layer), n in seen.items()) / steps
    return {
        "rows": B,
        "pass_ms": 1000 * statistics.median(times[4:]),
        "stages_ms": {k: 1000 * v / steps for k, v in sorted(model.stage.seconds.items(), key=lambda kv: -kv[1])},
        "distinct_experts_a_layer": sum(seen.values()) / max(1, len(seen)),
        # each distinct expert once, and the dense set (what the layout keeps resident: every
        # matrix but the experts, the NextN block and the rows read one a token) once
        "bytes_a_pass": mf.layout.dense_bytes + expert_bytes,
    }


def main(argv=None) -> int:
    args = parse(argv)
    from moe_pipe.shared import quant
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model.base import ModelOptions
    from moe_pipe.shared.model.load import load_model

    quant.set_threads(args.threads)
    quant.one_blas_thread()
    path = shape_model(args.model, args.layers)
    mf = open_model(path)
    model = load_model(mf, options=ModelOptions(stage_timing=True))
    # Compile the kernels and touch every matrix once outside the timing: a prompt this long
    # routes to nearly every expert, so no pass below pays a first touch of its pages.
    model.prefill(prompt_ids(99, WARM_TOKENS, mf.spec.n_vocab), model.new_cache(WARM_TOKENS))
    print(
        f"model: {path.name} ({mf.spec.arch}, {mf.spec.n_layer} layers), resident, threads {args.threads}; "
        f"{args.steps} passes a row count, medians of the last {args.steps - 4}"
    )
    print(f"{'rows':>5} {'pass ms':>8} {'tok/s':>8} {'x one row':>9} {'experts/layer':>13} {'GB a pass':>9} {'bytes bound':>11}  stages ms")
    rows = []
    for B in (int(x) for x in args.rows.split(",")):
        r = measure(model, mf, B, args.steps, args.prompt_tokens)
        r["tok_s"] = 1000 * B / r["pass_ms"]
        one = rows[0] if rows and rows[0]["rows"] == 1 else r if B == 1 else None
        r["x_one_row"] = r["tok_s"] / one["tok_s"] if one else None
        r["bytes_bound"] = B * one["bytes_a_pass"] / r["bytes_a_pass"] if one else None
        rows.append(r)
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r["stages_ms"].items() if v >= 0.05)
        x = f"{r['x_one_row']:.2f}" if r["x_one_row"] else "-"
        bound = f"{r['bytes_bound']:.2f}" if r["bytes_bound"] else "-"
        print(
            f"{B:>5} {r['pass_ms']:>8.1f} {r['tok_s']:>8.2f} {x:>9} {r['distinct_experts_a_layer']:>13.1f} "
            f"{r['bytes_a_pass'] / 1e9:>9.2f} {bound:>11}  {stages}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": path.name, "layers": mf.spec.n_layer, "rows": rows}, indent=1))
    mf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
