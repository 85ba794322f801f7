"""Speculative decoding's mechanism, measured: the verify pass's cost for 1-5 rows
and its extra expert reads, and tok/s with drafts replayed from a plain greedy run
at a chosen acceptance, next to plain decoding in the same run; on a file with an
MTP/NextN block (make-model --mtp), the block's own cost as the drafter.

    python bench/bench_speculate.py [--layers 8] [--model PATH] [-n 64] [--widths 1,2,3,4]
                                    [--accuracy 1,0.8,0.6,0.4] [--adaptive] [--stream --limit-mb MB] [--adaptive-only]
                                    [--draft-vocab 0,32768] [--mtp-only]

Random weights draft nothing a real model would accept, so the drafts come from
the plain run's own tokens (shared/text/speculate.py ReplayDrafter), each made
wrong with probability 1 - accuracy: these are mechanism figures, not a model's
acceptance. Resident (the default): one process, the model in RAM, as `run
--no-stream`. With --stream: the engine's pipeline (reader, compute, the expert
cache at --cache-mb or the budget of --limit-mb) on the file, warm after a first
plain run; each figure is the median of --repeat runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF to use (default: make a qwen30b-shape model cut to --layers)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-n", type=int, default=64, help="decode tokens")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--widths", default="1,2,3,4")
    p.add_argument("--accuracy", default="1,0.8,0.6,0.4", help="per draft token, the chance it is right")
    p.add_argument("--adaptive", action="store_true", help="also run the adaptive width (compute.draft_adapt)")
    p.add_argument("--adaptive-only", action="store_true", help="--stream: only the adaptive width, not the fixed widths")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--stream", action="store_true", help="through the engine's pipeline instead of resident")
    p.add_argument("--cache-mb", type=float, help="--stream: the expert cache (default: the config's auto budget)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--stream: more config overrides")
    p.add_argument(
        "--draft-vocab",
        help="(c), resident: the compute.draft_vocab values to compare, taken in turn "
        "(default: 0, the whole head, and the config's default)",
    )
    p.add_argument("--mtp-only", action="store_true", help="resident: only section (c), the MTP block as the drafter")
    return p.parse_args(argv)


def prompt_ids(n: int, n_vocab: int) -> list[int]:
    return [(i * 7919 + 13) % min(n_vocab, 4000) + 10 for i in range(n)]


# -- resident -------------------------------------------------------------------------------


class Resident:
    """The model in this process; routing observed to count a pass's distinct experts."""

    def __init__(self, path: Path, threads: int):
        from moe_pipe.shared import quant
        from moe_pipe.shared.gguf.model_file import open_model
        from moe_pipe.shared.model.load import ModelOptions, load_model

        quant.set_threads(threads)
        quant.one_blas_thread()
        self.mf = open_model(path)
        self.routes: list[tuple[int, object]] = []
        options = ModelOptions(kv_type="f16", route_observer=lambda i, r: self.routes.append((i, r)))
        self.model = load_model(self.mf, options=options)
        self.model.prefill([1, 2, 3, 4], self.model.new_cache(16))  # compile outside the timing

    def generate(self, prompt, n, drafter=None, width=0, adapt=False):
        from moe_pipe.shared.model.session import Session
        from moe_pipe.shared.text.generate import GenerationConfig, generate
        from moe_pipe.shared.text.sampling import SamplingParams

        tok = _NoText()
        cfg = GenerationConfig(
            max_tokens=n, ignore_eos=True, draft=width, draft_adapt=adapt, n_ctx=len(prompt) + n + 16, prefill_batch=len(prompt)
        )
        g = generate(self.model, tok, prompt, SamplingParams(), cfg, session=Session(), drafter=drafter)
        return g

    def verify_cost(self, prompt, continuation, rows: int, repeat: int) -> tuple[float, int]:
        """(median ms of a verify pass of `rows` rows after the prompt, distinct routed experts it touched)."""
        import numpy as np

        cache = self.model.new_cache(len(prompt) + 16)
        self.model.prefill(prompt, cache, batch=len(prompt))
        n0 = cache.n
        snap = cache.state.snapshot() if cache.state is not None else None  # a recurrent state is put back, not truncated
        times = []
        for _ in range(repeat):
            if snap is not None:
                cache.rewind(n0, snap)  # copied back in place: the snapshot stays as it was
            else:
                cache.truncate(n0)
            self.routes.clear()
            t0 = time.perf_counter()
            self.model.verify(np.asarray(continuation[:rows]), cache)
            times.append((time.perf_counter() - t0) * 1e3)
        experts = sum(len({int(e) for e in r.ids.reshape(-1)}) for _, r in self.routes)
        return statistics.median(times), experts


class _NoText:
    """The tokenizer's part generate uses, for a benchmark that never reads the text."""

    eog_ids: frozenset = frozenset()
    bos_id = None

    def stream(self):
        return self

    def feed(self, token):
        return ""

    def flush(self):
        return ""


def resident(args, path: Path) -> None:
    r = Resident(path, args.threads)
    spec = r.mf.spec
    prompt = prompt_ids(args.prompt_tokens, spec.n_vocab)
    print(
        f"model: {path.name} ({spec.arch}, {spec.n_layer} layers, {r.mf.gguf.file_bytes / 2**30:.2f} GiB), resident; "
        f"prompt {len(prompt)} tokens, {args.n} decoded, threads {args.threads}, medians of {args.repeat}"
    )
    reference = r.generate(prompt, args.n).tokens  # the decode kernels compile outside the timing
    widths = [int(w) for w in args.widths.split(",")]
    if not args.mtp_only:
        replayed(r, prompt, reference, widths, args)
    if spec.n_layer_nextn:
        mtp_cost(r, prompt, reference, widths, args)
    r.mf.close()


def replayed(r: Resident, prompt, reference, widths, args) -> None:
    """(a) a verify pass's cost by its rows, (b) decoding with drafts replayed at chosen accuracies."""
    from moe_pipe.shared.text.speculate import ReplayDrafter

    slab = r.mf.layout.slab_bytes
    plain_tps = statistics.median(r.generate(prompt, args.n).timings["predicted_tok_s"] for _ in range(args.repeat))

    print("\n(a) one verify pass after the prompt: rows = the decoded token and its drafts")
    print(f"{'rows':>5}{'ms':>10}{'x one row':>11}{'experts':>9}{'extra expert MiB':>18}")
    base_ms = base_experts = None
    for rows in range(1, 6):
        ms, experts = r.verify_cost(prompt, reference, rows, max(5, args.repeat))
        base_ms, base_experts = base_ms or ms, base_experts or experts
        print(f"{rows:>5}{ms:>10.1f}{ms / base_ms:>11.2f}{experts:>9}{(experts - base_experts) * slab / 2**20:>18.1f}")

    print(
        f"\n(b) decode with replayed drafts (plain {plain_tps:.2f} tok/s at the start; each row's ratio is to plain runs interleaved with its own)"
    )
    print(f"{'width':>6}{'accuracy':>10}{'accepted':>10}{'tok/s':>9}{'x plain':>9}{'passes':>8}")
    for acc in [float(a) for a in args.accuracy.split(",")]:
        for width, adapt in [(w, False) for w in widths] + ([(max(widths), True)] if args.adaptive else []):
            runs, plains = [], []
            for k in range(args.repeat):  # plain runs interleaved: the host's speed drifts within minutes
                runs.append(r.generate(prompt, args.n, ReplayDrafter(reference, acc, seed=k), width, adapt))
                plains.append(r.generate(prompt, args.n))
            assert all(g.tokens == reference for g in runs), "speculative output differs from plain output"
            tps = statistics.median(g.timings["predicted_tok_s"] for g in runs)
            plain_tps = statistics.median(g.timings["predicted_tok_s"] for g in plains)
            t = runs[0].timings
            rate = t["draft_accepted"] / max(t["draft_n"], 1)
            passes = len(reference) - 1 - t["draft_accepted"]  # every token after the first: a pass's, or a kept draft's
            label = f"<={width}" if adapt else str(width)
            print(f"{label:>6}{acc:>10.2f}{rate:>10.0%}{tps:>9.2f}{tps / plain_tps:>9.2f}{passes:>8}")


class TimedDrafter:
    """A drafter whose proposals are timed: what drafting itself costs a verify pass."""

    def __init__(self, inner):
        self.inner, self.seconds, self.drafted, self.calls = inner, 0.0, 0, 0
        self.free = inner.free

    def start(self, prompt):
        self.inner.start(prompt)

    def propose(self, history, n):
        t0 = time.perf_counter()
        drafts = self.inner.propose(history, n)
        self.seconds += time.perf_counter() - t0
        self.drafted += len(drafts)
        self.calls += 1
        return drafts


def mtp_cost(r: Resident, prompt, reference, widths, args) -> None:
    """(c) the file's MTP block as the drafter: its cost per draft token next to a plain
    decode step, and what it adds to the prompt (the block takes every prompt position),
    for each head the drafter may take its guesses from (compute.draft_vocab)."""
    from moe_pipe.shared.config import ComputeConfig
    from moe_pipe.shared.model.session import Session
    from moe_pipe.shared.text.generate import GenerationConfig, generate
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.speculate import drafter_for

    vocabs = [int(v) for v in args.draft_vocab.split(",")] if args.draft_vocab else [0, ComputeConfig().draft_vocab]

    def run(width, vocab=0):
        session = Session()
        n_ctx = len(prompt) + args.n + 16
        drafter = TimedDrafter(drafter_for("mtp", model=r.model, session=session, n_ctx=n_ctx, vocab=vocab)) if width else None
        cfg = GenerationConfig(max_tokens=args.n, ignore_eos=True, draft=width, draft_adapt=False, n_ctx=n_ctx, prefill_batch=len(prompt))
        g = generate(r.model, _NoText(), prompt, SamplingParams(), cfg, session=session, drafter=drafter)
        assert g.tokens == reference, "speculative output differs from plain output"
        return g, drafter

    for vocab in vocabs:
        run(1, vocab)  # the block's kernels compile outside the timing
    print("\n(c) the MTP block as the drafter (its own guesses: random weights, so nearly none is kept)")
    print("    vocab: compute.draft_vocab, 0 = the whole head; the heads are run in turn, each repeat, beside a plain run")
    print(f"{'width':>6}{'vocab':>8}{'ms a draft':>12}{'x a step':>10}{'prompt ms':>11}{'x plain':>9}{'tok/s':>9}{'x plain':>9}")
    for width in widths:
        runs: dict[int, list] = {v: [] for v in vocabs}
        plains = []
        for _ in range(args.repeat):  # in turn: the host's speed drifts within minutes
            for vocab in vocabs:
                runs[vocab].append(run(width, vocab))
            plains.append(run(0)[0])
        step_ms = statistics.median(1e3 / g.timings["predicted_tok_s"] for g in plains)
        plain_prompt = statistics.median(g.timings["prompt_ms"] for g in plains)
        plain_tps = statistics.median(g.timings["predicted_tok_s"] for g in plains)
        for vocab in vocabs:
            per_draft = statistics.median(d.seconds * 1e3 / max(d.drafted, 1) for _, d in runs[vocab])
            prompt_ms = statistics.median(g.timings["prompt_ms"] for g, _ in runs[vocab])
            tps = statistics.median(g.timings["predicted_tok_s"] for g, _ in runs[vocab])
            print(
                f"{width:>6}{vocab:>8}{per_draft:>12.2f}{per_draft / step_ms:>10.2f}{prompt_ms:>11.1f}{prompt_ms / plain_prompt:>9.2f}"
                f"{tps:>9.2f}{tps / plain_tps:>9.2f}"
            )


# -- streamed -------------------------------------------------------------------------------


def streamed(args, path: Path) -> None:
    from moe_pipe.procs.pipeline import start_pipeline
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.gguf.model_file import open_model

    with open_model(path) as mf:
        prompt = prompt_ids(args.prompt_tokens, mf.spec.n_vocab)
        desc = f"{mf.spec.arch}, {mf.spec.n_layer} layers, {mf.gguf.file_bytes / 2**30:.2f} GiB"
        nextn = mf.spec.n_layer_nextn
    base = {"model.path": str(path), "compute.threads": args.threads, **dict(kv.split("=", 1) for kv in args.set)}
    if args.cache_mb:
        base["cache.cache_mb"] = args.cache_mb
    tmp = Path(tempfile.mkdtemp(prefix="bench-speculate-"))
    replay = tmp / "drafts.json"

    def one(pipe, draft: int) -> dict:
        done = pipe.generate(prompt, {"temperature": 0.0}, args.n, ignore_eos=True, draft=draft)
        return {**dict(done.timings), "ids": list(done.tokens)}

    # The replay file is read at each request, so each run below rewrites it (its accuracy, its seed).
    replay.write_text(json.dumps({"tokens": [], "accuracy": 1.0}))
    print(f"model: {path.name} ({desc}), streamed; prompt {len(prompt)} tokens, {args.n} decoded, medians of {args.repeat}")
    widths = [int(w) for w in args.widths.split(",")]
    accuracies = [float(a) for a in args.accuracy.split(",")]
    reference: list[int] = []
    modes = [True] if args.adaptive_only else [False, True] if args.adaptive else [False]
    for adapt in modes:  # compute.draft_adapt is the compute process's
        cfg = load_config(None, {**base, "compute.draft_replay": str(replay), "compute.draft_adapt": adapt})
        with start_pipeline(cfg, path) as pipe:
            warm = one(pipe, 0)  # the cache filled by one reply, as a conversation's next reply finds it
            cache_mib = pipe.resolved.n_slabs * pipe.resolved.slab_bytes / 2**20
            print(
                f"{'adaptive' if adapt else 'fixed'} widths: expert cache {cache_mib:.0f} MiB; warm-up run {warm['predicted_tok_s']:.2f} tok/s"
            )
            reference = reference or warm["ids"]
            plain = [one(pipe, 0) for _ in range(args.repeat)]
            plain_tps = statistics.median(p["predicted_tok_s"] for p in plain)
            print(f"plain {plain_tps:.2f} tok/s, {statistics.median(p['read_bytes'] for p in plain) / 2**20:.0f} MiB read a reply")
            print(f"{'width':>6}{'accuracy':>10}{'accepted':>10}{'tok/s':>9}{'x plain':>9}{'MiB read':>10}")
            for acc in accuracies:
                for width in [max(widths)] if adapt else widths:
                    runs, plains = [], []
                    for k in range(args.repeat):  # plain runs interleaved: the disk's and host's speed drift
                        replay.write_text(json.dumps({"tokens": reference, "accuracy": acc, "seed": k}))
                        runs.append(one(pipe, width))
                        plains.append(one(pipe, 0))
                    assert all(g["ids"] == reference for g in runs), "speculative output differs from plain output"
                    tps = statistics.median(g["predicted_tok_s"] for g in runs)
                    plain_tps = statistics.median(g["predicted_tok_s"] for g in plains)
                    rate = runs[0]["draft_accepted"] / max(runs[0]["draft_n"], 1)
                    mib = statistics.median(g["read_bytes"] for g in runs) / 2**20
                    label = f"<={width}" if adapt else str(width)
                    print(f"{label:>6}{acc:>10.2f}{rate:>10.0%}{tps:>9.2f}{tps / plain_tps:>9.2f}{mib:>10.0f}")
    if nextn:
        mtp_streamed(base, path, widths, reference, one, args.repeat)


def mtp_streamed(base: dict, path: Path, widths: list[int], reference: list[int], one, repeat: int) -> None:
    """(c) streamed: the file's MTP block drafting at fixed widths (its tensors read through
    the page cache, its guesses random weights' own: nearly none kept), next to plain runs."""
    from moe_pipe.procs.pipeline import start_pipeline
    from moe_pipe.shared.config import load_config

    cfg = load_config(None, {**base, "compute.draft_source": "mtp", "compute.draft_adapt": False})
    with start_pipeline(cfg, path) as pipe:
        one(pipe, 0)
        one(pipe, 1)  # the block's first reads and pairs outside the timing
        print("\n(c) the MTP block as the drafter, streamed (fixed widths; its guesses random weights' own)")
        print(f"{'width':>6}{'accepted':>10}{'tok/s':>9}{'x plain':>9}{'MiB read':>10}{'plain MiB':>11}")
        for width in widths:
            runs, plains = [], []
            for _ in range(repeat):
                runs.append(one(pipe, width))
                plains.append(one(pipe, 0))
            assert all(g["ids"] == reference for g in runs + plains), "speculative output differs from plain output"
            tps = statistics.median(g["predicted_tok_s"] for g in runs)
            plain_tps = statistics.median(g["predicted_tok_s"] for g in plains)
            rate = runs[0]["draft_accepted"] / max(runs[0]["draft_n"], 1)
            mib = statistics.median(g["read_bytes"] for g in runs) / 2**20
            plain_mib = statistics.median(g["read_bytes"] for g in plains) / 2**20
            print(f"{width:>6}{rate:>10.0%}{tps:>9.2f}{tps / plain_tps:>9.2f}{mib:>10.0f}{plain_mib:>11.0f}")


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    path = shape_model(args.model, args.layers)
    (streamed if args.stream else resident)(args, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
