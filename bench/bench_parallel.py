"""Several conversations at once: N clients together against the same N requests one at a time.

    python bench/bench_parallel.py [--shape qwen30b|gemma26b|gptoss120b] [--layers 48] [--clients 4]
                                   [-n 128] [--prompt-tokens 40] [--config CONFIG] [--ratio R] [--threads 2]
                                   [--set KEY=VALUE] [--alone-first] [--json OUT]
    python bench/bench_parallel.py --long-prompt 3600 [--clients 4] ...
    python bench/bench_parallel.py --shared-prefix 2000 [--clients 4] ...

Starts `moe-pipe up CONFIG --parallel N` on a fresh copy of the `--shape` model
(qwen30b-shape unless said) cut to `--layers` (made under bench/out/ on first use),
inside a memory cgroup of file / `--ratio` MiB (bench_vs_llama.py's equal-memory
limit and recipe for the shape unless given), in a private
runtime folder. After one short warm-up request it sends N greedy chat
completions of `-n` tokens, each its own prompt of ordinary prose (a different
stretch of bench/_protocol.py's prose), first all N at once ("together"), then
the same N one after another ("alone"). Together goes first, so alone runs on
the cache together warmed: the ratio is if anything low (`--alone-first` the
other way round).

It prints, per phase, the completion tokens over the phase's wall time (the
aggregate tok/s), each request's first-token time and tok/s, and from
/metrics over the phase: bytes read, expert lookups and the expert uses
another row's lookup served (`moe_pipe_experts_shared_total`); and
whether each request's text together is its text alone (greedy: it must be).
With `--set compute.draft=N` the requests draft (docs/batching.md § Slots in
compute), and it also prints the drafts each kept of those it made (the `timings`
of each response's finish chunk).

With `--long-prompt T`, it measures chunked prefill instead: `--clients` − 1
clients decode `-n` tokens undisturbed; then the same clients again, and once each
has its first token a T-token prose prompt arrives (16 tokens asked): the
decoders' gaps between tokens while that prompt runs against their undisturbed
gaps (medians and the longest), and the long prompt's first token beside the
decoders against the same prompt alone in the same service (its prefix not
cached: a different stretch of prose).

With `--shared-prefix T`, it measures agents that share a system prompt: each
client's prompt is one T-token stretch of prose followed by its own question. The
first client goes alone until its first token (it computes the prefix); then the
others all at once, which take the prefix from its slot (docs/batching.md § Prompt
prefixes shared across slots). Per request: first-token time, prompt tokens and of
them cached (`usage.prompt_tokens_details.cached_tokens`); over the phase: bytes read
and the prompt tokens compute ran (/metrics); and the KV pool's held positions after,
against what the four slots would hold with the prefix copied into each.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import load_gateway as gateway  # noqa: E402  (bench/ is the script's folder)
from _models import shape_model  # noqa: E402
from _protocol import fresh_copy, prose_prompt  # noqa: E402
from bench_vs_llama import SHAPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METRICS = (
    "moe_pipe_read_bytes_total",
    "moe_pipe_expert_lookups_total",
    "moe_pipe_experts_shared_total",
    "moe_pipe_prompt_tokens_total",
    "moe_pipe_prompt_tokens_cached_total",
)
HELD = "moe_pipe_kv_pool_held_positions"  # a gauge: read as it is, not as a phase's difference


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen30b", help="the made model (bench_vs_llama.py's shapes)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("-n", type=int, default=128, help="completion tokens a request")
    p.add_argument("--prompt-tokens", type=int, default=40, help="each request's prompt, about this many tokens of prose")
    p.add_argument("--config", help="the recipe (default: the shape's, bench_vs_llama.py SHAPES)")
    p.add_argument("--ratio", type=float, help="memory limit = file size / this (default: the shape's)")
    p.add_argument("--threads", type=int, default=2, help="compute threads (the recipes' are a phone's big cores)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for `up` (e.g. compute.ctx_size=2048)")
    p.add_argument("--alone-first", action="store_true", help="the phases the other way round (alone then runs colder)")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--long-prompt", type=int, default=0, metavar="T", help="a T-token prompt arriving while the other clients decode")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="T", help="every client's prompt begins with the same T tokens")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    args.config = args.config or str(ROOT / shape["config"])
    args.ratio = args.ratio or shape["ratio"]
    return args


class Service(gateway.Service):
    """load_gateway's private service, inside a memory cgroup, with its URL and model id."""

    def __init__(self, model: Path, config: str, parallel: int, limit_mb: float, threads: int, sets: list[str]):
        import urllib.request

        from moe_pipe.shared.analysis.cgroup import MemoryCgroup, drop_page_cache

        drop_page_cache()
        self.cg = MemoryCgroup.create(limit_mb)
        overrides = [a for kv in (f"model.path={model}", *sets) for a in ("--set", kv)]
        try:
            super().__init__(config, "--parallel", str(parallel), "-t", str(threads), *overrides, wrap=self.cg.wrap, up_timeout_s=900)
        except BaseException:
            self.cg.remove()
            raise
        self.url = json.loads(self.cli("status", "--json").stdout)["url"].rstrip("/")
        self.model = json.loads(urllib.request.urlopen(f"{self.url}/v1/models", timeout=30).read())["data"][0]["id"]

    def metrics(self, names: tuple[str, ...] = METRICS) -> dict[str, float]:
        import urllib.request

        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=30).read().decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                out[name] = float(value)
        return out

    def close(self) -> None:
        self.stop()
        self.cg.remove()


def complete(url: str, model: str, prompt: str, n: int, began: threading.Event | None = None, cache_prompt: bool = True) -> dict:
    """One streamed greedy chat completion: its text, completion tokens, first-token and whole time,
    and when each text piece came (`began` set at the first)."""
    import urllib.request

    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": cache_prompt,
    }
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, tokens, times, usage, timings = None, [], 0, [], {}, {}
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece:
                    times.append(time.perf_counter())
                    if first is None:
                        first = times[0] - t0
                        if began is not None:
                            began.set()
                text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = usage["completion_tokens"]
            timings = chunk.get("timings") or timings  # the finish chunk's (llama.cpp's shape)
    total = time.perf_counter() - t0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "text": "".join(text),
        "tokens": tokens,
        "first_s": first,
        "total_s": total,
        "tok_s": tokens / total,
        "times": times,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": cached,
        "drafted": timings.get("draft_n", 0),
        "accepted": timings.get("draft_n_accepted", 0),
    }


def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each of METRICS counted between two readings of /metrics."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}


def phase(svc: Service, prompts: list[str], n: int, together: bool) -> dict:
    before = svc.metrics()
    results: list[dict | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    if together:
        threads = [
            threading.Thread(target=lambda k=k: results.__setitem__(k, complete(svc.url, svc.model, prompts[k], n)))
            for k in range(len(prompts))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for k, p in enumerate(prompts):
            results[k] = complete(svc.url, svc.model, p, n)
    wall = time.perf_counter() - t0
    delta = since(before, svc.metrics())
    done = [r for r in results if r is not None]
    tokens = sum(r["tokens"] for r in done)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "requests": done, "metrics": delta}


def gaps_ms(times: list[float], start: float = float("-inf"), end: float = float("inf")) -> list[float]:
    """The gaps between a stream's text pieces whose later piece came in [start, end), in ms."""
    return [1e3 * (b - a) for a, b in zip(times, times[1:]) if start <= b < end]


def long_prompt_phases(svc: Service, prompts: list[str], long_prompt: str, n: int) -> dict:
    """The decoders undisturbed; the long prompt alone; the decoders again with the long prompt
    arriving once each has its first token. The long prompt never reuses a cached prefix."""
    undisturbed = phase(svc, prompts, n, together=True)
    alone = complete(svc.url, svc.model, long_prompt, 16, cache_prompt=False)
    results: list[dict | None] = [None] * len(prompts)
    began = [threading.Event() for _ in prompts]
    threads = [
        threading.Thread(target=lambda k=k: results.__setitem__(k, complete(svc.url, svc.model, prompts[k], n, began[k])))
        for k in range(len(prompts))
    ]
    for t in threads:
        t.start()
    for e in began:
        e.wait(1800)
    arrived = time.perf_counter()
    beside = complete(svc.url, svc.model, long_prompt, 16, cache_prompt=False)
    for t in threads:
        t.join()
    decoders = [r for r in results if r is not None]
    during = [g for r in decoders for g in gaps_ms(r["times"], arrived, arrived + beside["first_s"])]
    before = [g for r in undisturbed["requests"] for g in gaps_ms(r["times"])]
    return {
        "undisturbed": undisturbed,
        "decoders": decoders,
        "alone": alone,
        "beside": beside,
        "gaps_before_ms": before,
        "gaps_during_ms": during,
    }


def shared_prefix_phases(svc: Service, prompts: list[str], n: int) -> dict:
    """The first prompt alone until its first token, then the others at once beside it."""
    before = svc.metrics()
    results: list[dict | None] = [None] * len(prompts)
    began = threading.Event()
    first = threading.Thread(target=lambda: results.__setitem__(0, complete(svc.url, svc.model, prompts[0], n, began)))
    first.start()
    began.wait(1800)
    rest = [
        threading.Thread(target=lambda k=k: results.__setitem__(k, complete(svc.url, svc.model, prompts[k], n)))
        for k in range(1, len(prompts))
    ]
    for t in rest:
        t.start()
    for t in [first, *rest]:
        t.join()
    delta = since(before, svc.metrics())
    return {"requests": [r for r in results if r is not None], "metrics": delta, "held": svc.metrics((HELD,)).get(HELD, 0.0)}


def print_shared_prefix(f: dict, args, prefix_tokens: int) -> None:
    reqs, m = f["requests"], f["metrics"]
    print(f"\n{args.clients} requests of {args.n} tokens, each a {prefix_tokens}-token shared prefix and its own question")
    print("| request | first token s | prompt tokens | of them cached |")
    print("|---|---|---|---|")
    for k, r in enumerate(reqs):
        print(f"| {k} {'(alone first)' if k == 0 else ''} | {r['first_s']:.1f} | {r['prompt_tokens']} | {r['cached_tokens']} |")
    computed = m["moe_pipe_prompt_tokens_total"] - m["moe_pipe_prompt_tokens_cached_total"]
    copied = sum(r["prompt_tokens"] + r["tokens"] for r in reqs)
    print(
        f"prompt tokens computed: {computed:.0f} of {m['moe_pipe_prompt_tokens_total']:.0f}; read {m['moe_pipe_read_bytes_total'] / 1e9:.2f} GB"
    )
    print(
        f"KV pool held after: {f['held']:.0f} positions (the prefix once, and each slot's own); with the prefix copied into each slot: about {copied}"
    )


def print_long_prompt(f: dict, args) -> None:
    import statistics

    before, during = f["gaps_before_ms"], f["gaps_during_ms"]
    med_b, med_d = statistics.median(before), statistics.median(during) if during else float("nan")
    print(f"\n{args.clients - 1} decoders of {args.n} tokens, a {args.long_prompt}-token prompt arriving once each has its first token")
    print("| | median gap ms | longest gap ms | gaps |")
    print("|---|---|---|---|")
    print(f"| decoders undisturbed | {med_b:.0f} | {max(before):.0f} | {len(before)} |")
    print(f"| decoders while the prompt runs | {med_d:.0f} | {max(during, default=float('nan')):.0f} | {len(during)} |")
    print(f"\nmedian gap while the prompt runs / undisturbed: {med_d / med_b:.2f}x")
    print(f"long prompt's first token: {f['beside']['first_s']:.1f} s beside the decoders, {f['alone']['first_s']:.1f} s alone")


def main(argv=None) -> int:
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.text.tokenizer import Tokenizer

    args = parse(argv)
    model = shape_model(None, args.layers, SHAPES[args.shape]["arch"], SHAPES[args.shape]["preset"])
    limit = model.stat().st_size / 2**20 / args.ratio
    with open_model(model) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        # a different stretch of prose a client: the opening of a prose prompt k times as long, its last part
        prompts = [
            tok.decode(tok.encode(prose_prompt(tok, args.prompt_tokens * (k + 1)))[-args.prompt_tokens :]) for k in range(args.clients)
        ]
        long_prompt = prose_prompt(tok, args.long_prompt) if args.long_prompt else ""
        if args.shared_prefix:
            prefix = prose_prompt(tok, args.shared_prefix)
            prompts = [f"{prefix}\n\nQuestion {k + 1}: {q}" for k, q in enumerate(prompts)]
    copy = model.with_name(model.stem + "-parallel-copy.gguf")
    print(f"fresh copy in {fresh_copy(model, copy):.0f} s; limit {limit:,.0f} MiB; {args.clients} slots", flush=True)
    try:
        svc = Service(copy, args.config, args.clients, limit, args.threads, args.set)
        try:
            complete(svc.url, svc.model, "Hello", 16)  # the kernels compiled and the dense set in before either phase
            if args.shared_prefix:
                figures = shared_prefix_phases(svc, prompts, args.n)
            elif args.long_prompt:
                figures = long_prompt_phases(svc, prompts[: args.clients - 1], long_prompt, args.n)
            elif args.alone_first:
                alone = phase(svc, prompts, args.n, together=False)
                together = phase(svc, prompts, args.n, together=True)
            else:
                together = phase(svc, prompts, args.n, together=True)
                alone = phase(svc, prompts, args.n, together=False)
        finally:
            svc.close()
    finally:
        copy.unlink(missing_ok=True)
    if args.shared_prefix:
        print_shared_prefix(figures, args, args.shared_prefix)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
        return 0
    if args.long_prompt:
        print_long_prompt(figures, args)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
        return 0
    same = [a["text"] == t["text"] for a, t in zip(alone["requests"], together["requests"])]
    print(
        f"\n{SHAPES[args.shape]['preset']} L{args.layers}, {limit:,.0f} MiB (file / {args.ratio:g}), {args.clients} requests of {args.n} tokens"
        + ("".join(f", {kv}" for kv in args.set))
        + (", alone first" if args.alone_first else ", together first")
    )
    print("| phase | wall s | tokens | aggregate tok/s | first token s (each) | tok/s (each) | read GB | expert lookups | uses shared |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, ph in (("together", together), ("alone", alone)):
        m = ph["metrics"]
        print(
            f"| {name} | {ph['wall_s']:.1f} | {ph['tokens']} | {ph['tok_s']:.2f} | "
            + ", ".join(f"{r['first_s']:.1f}" for r in ph["requests"])
            + " | "
            + ", ".join(f"{r['tok_s']:.2f}" for r in ph["requests"])
            + f" | {m['moe_pipe_read_bytes_total'] / 1e9:.2f} | {m['moe_pipe_expert_lookups_total']:.0f} | {m['moe_pipe_experts_shared_total']:.0f} |"
        )
    for name, ph in (("together", together), ("alone", alone)):
        drafted = sum(r["drafted"] for r in ph["requests"])
        if drafted:  # --draft: the requests' drafts kept, from each response's timings
            kept = ", ".join(f"{r['accepted']}/{r['drafted']}" for r in ph["requests"])
            print(f"drafts kept {name}: {sum(r['accepted'] for r in ph['requests'])} of {drafted} (each: {kept})")
    print(f"\naggregate together / alone: {together['tok_s'] / alone['tok_s']:.2f}x; each text together == alone: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"together": together, "alone": alone, "same": same, "limit_mb": limit}, indent=1))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
