"""Where a prompt's compute goes: one resident prefill, by stage and by product.

    python bench/bench_prefill.py [--layers 8 | --model FILE] [--prompt-tokens 3600]
                                  [--threads 2] [--kv-type f16] [--top 12]

Prefills `--prompt-tokens` tokens in one chunk on a resident model
(qwen30b-shape cut to `--layers`, made on first use under bench/out/; the file
mapped, no expert cache, no disk reads), after a short warm-up that compiles
the kernels, and prints the wall time, each stage of the forward pass per
layer (`ModelOptions.stage_timing`: attention, router, experts, ...), the
attention kernel's own share, and every quantized product grouped by weight
type, shape and tokens per call, with its multiply-adds per second — the
figures docs/benchmarks.md § Long prompts quotes. Each product is timed at
the one place every matrix product goes through (`quant.kernels._multiply`,
and `quant.grouped_apply` for a prompt's experts taken several a call, counted
per matrix), so the grouping costs one clock read a call.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)
from bench_decode import prompt_ids  # noqa: E402

TOKEN_BUCKETS = (16, 64, 256, 1024)  # a call's tokens: below each bound, or all of the prompt


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: qwen30b-shape cut to --layers)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=3600)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-type", default="f16", help="the KV cache's type (the engine's default: f16)")
    p.add_argument("--top", type=int, default=12, help="product groups to print, the longest first")
    return p.parse_args(argv)


def bucket(tokens: int, prompt: int) -> str:
    if tokens == prompt:
        return "the prompt"
    bound = next((b for b in TOKEN_BUCKETS if tokens < b), None)
    return f"< {bound} tokens" if bound else f">= {TOKEN_BUCKETS[-1]} tokens"


class ProductLog:
    """Wraps the quantized-product dispatch: seconds and multiply-adds per group."""

    def __init__(self, kernels, quant, prompt: int):
        self.kernels, self.prompt, self.inner = kernels, prompt, kernels._multiply
        self.quant, self.inner_grouped = quant, quant.grouped_apply
        self.groups: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    def __enter__(self) -> ProductLog:
        def timed(qtype, flat, stride, X, out):
            t0 = time.perf_counter()
            self.inner(qtype, flat, stride, X, out)
            g = self.groups[(getattr(qtype, "name", str(qtype)), out.shape[1], X.shape[1], bucket(X.shape[0], self.prompt))]
            g[0] += 1
            g[1] += time.perf_counter() - t0
            g[2] += X.shape[0] * out.shape[1] * X.shape[1]

        def timed_grouped(ps, X, first, count, rows=None, out=None):  # a prompt's experts in memory, several a call (shared/model/moe.py)
            t0 = time.perf_counter()
            out = self.inner_grouped(ps, X, first, count, rows=rows, out=out)
            if out is not None:
                p = ps[0]
                per = int(sum(count)) // max(1, len(ps))
                g = self.groups[(p.qtype.name, p.n_rows, p.n_cols, f"{bucket(per, self.prompt)}, grouped")]
                g[0] += len(ps)
                g[1] += time.perf_counter() - t0
                g[2] += int(sum(count)) * p.n_rows * p.n_cols
            return out

        self.kernels._multiply = timed
        self.quant.grouped_apply = timed_grouped
        return self

    def __exit__(self, *exc) -> None:
        self.kernels._multiply = self.inner
        self.quant.grouped_apply = self.inner_grouped


def main(argv=None) -> None:
    args = parse(argv)
    from moe_pipe.shared import heap, quant
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model import gqa
    from moe_pipe.shared.model.load import ModelOptions, load_model
    from moe_pipe.shared.quant import kernels

    path = shape_model(args.model, args.layers)
    if not path.exists():
        raise SystemExit(f"error: {path} does not exist")
    quant.set_threads(args.threads)
    heap.keep_freed_memory()  # as compute does (shared/heap.py)
    quant.one_blas_thread()
    n = args.prompt_tokens
    with open_model(path) as mf:
        prompt = prompt_ids(n, mf.spec.n_vocab)
        model = load_model(mf, options=ModelOptions(stage_timing=True, kv_type=args.kv_type))
        model.prefill(prompt[:300], model.new_cache(400), batch=300)  # compiles every kernel it uses
        model.stage.reset()
        attention_s = [0.0]
        inner_attention = gqa.attention

        def timed_attention(*a, **kw):
            t0 = time.perf_counter()
            out = inner_attention(*a, **kw)
            attention_s[0] += time.perf_counter() - t0
            return out

        gqa.attention = timed_attention  # the kernel alone, inside the attention stage (gqa families)
        try:
            cache = model.new_cache(n + 8)
            with ProductLog(kernels, quant, n) as log:
                t0 = time.perf_counter()
                model.prefill(prompt, cache, batch=n)
                wall = time.perf_counter() - t0
        finally:
            gqa.attention = inner_attention
        layers = model.spec.n_layer
    print(f"{path.name}: {n} prompt tokens in {wall:.2f} s = {n / wall:.1f} tok/s, {wall / layers:.3f} s a layer ({args.threads} threads)")
    print("stage s a layer: " + ", ".join(f"{k} {v / layers:.3f}" for k, v in model.stage.seconds.items()))
    if attention_s[0]:
        print(f"  of which the attention kernel (over the cache): {attention_s[0] / layers:.3f}")
    print("\n| weight type | rows × columns | tokens a call | calls | s | G multiply-adds/s |")
    print("|---|---|---|---|---|---|")
    for (qtype, rows, cols, tokens), (calls, s, macs) in sorted(log.groups.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"| {qtype} | {rows} × {cols} | {tokens} | {calls} | {s:.2f} | {macs / s / 1e9:.0f} |")


if __name__ == "__main__":
    main()
