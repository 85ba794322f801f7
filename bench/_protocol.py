"""The real-scale protocol of bench_vs_llama.py: whole replies from a cold
start, per engine, at equal memory, figures a user feels.

A reply begins cold, and this VM's host keeps blocks that were read before
(a re-read runs ~1.6x faster), so a run is cold only on bytes no earlier run
read. With `cold="copy"` every engine run reads its own fresh copy of the
model (written, synced, the page cache dropped; removed after the run); with
`cold="alternate"` (a model too big to copy on this disk) every run reads
the same file and the engines' order alternates between repeats, each row
saying whether it ran first. A cold check copies one region of the model
(1 GiB of its middle: expert bytes) to a new file and reads it twice,
O_DIRECT into populated pages with the engine's read lanes: the first read
is the disk's rate on never-read blocks (the reference of the warm-up
target), the second the re-read rate, and their ratio says whether a copy
is really cold. It runs before and after the engine runs.

Figures per run, from the per-token walls (token 1 = the prompt's pass):

  start-up          launch to ready, before the prompt (moe-pipe: load plus the
                    kernel warm-up; llama.cpp: its Llama() constructor, which
                    maps the file and leaves the reading to the prompt)
  first token       the prompt: its reads into an empty cache and its compute
  steady at         the token after the last window of 8 tokens slower than
                    1.2x the last quarter's mean wall, and the time spent until it
  tokens 2-50       mean wall of the cache fill
  last quarter      steady tok/s over the last quarter of the reply
  whole             tokens / total wall, first token included
and for moe-pipe the disk rate of its reads (bytes over the time its lanes
were busy) during the prompt and during tokens 2-50, the hit rate and the
expert cache's budget; for llama.cpp the page cache it held at the end.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moe_pipe.shared.speed import steady_start, warmup_walls

STEADY_WINDOW = 8
STEADY_SLACK = 1.2
COLD_CHECK_GIB = 1.0


def clean_up_on_term() -> None:
    """A SIGTERM (a `kill`, a timeout) ends the run through its `finally` blocks, as Ctrl-C
    does: the fresh copies of the model (tens of GB), the cold check's copy, the cgroups and
    the engine under test go, instead of staying behind."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@dataclass(frozen=True)
class Engine:
    """One way of running the reply: moe-pipe with config overrides, or llama.cpp mmap at a readahead."""

    name: str
    kind: str  # "moe-pipe" | "llama.cpp"
    overrides: tuple[str, ...] = ()  # moe-pipe: KEY=VALUE config overrides
    readahead_kb: int | None = None  # llama.cpp: the block device's readahead for the run
    lossy: bool = False

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name).strip("-")


# -- figures --------------------------------------------------------------------------


def reply_figures(walls_ms: list[float]) -> dict:
    n = len(walls_ms)
    tail = walls_ms[steady_start(n) :] if n > 1 else walls_ms  # the last quarter: the doctor's "steady"
    tail_ms = statistics.mean(tail)
    # Steady from the token after the last window of STEADY_WINDOW tokens slower
    # than STEADY_SLACK x the last quarter's mean (a late stall counts too).
    slow = [t for t in range(1, n) if statistics.mean(walls_ms[t : t + STEADY_WINDOW]) > STEADY_SLACK * tail_ms]
    steady_at = slow[-1] + 2 if slow else 2  # 1-based token number
    fill = warmup_walls(walls_ms)
    return {
        "tokens": n,
        "first_s": walls_ms[0] / 1e3,
        "steady_at_token": steady_at,
        "steady_at_s": sum(walls_ms[: steady_at - 1]) / 1e3,
        "fill_ms": statistics.mean(fill) if fill else float("nan"),
        "steady_tps": 1e3 / tail_ms,
        "whole_tps": n / (sum(walls_ms) / 1e3),
    }


def read_rows(csv_path: Path) -> list[dict]:
    """A moe-pipe run's per-token CSV (docs/telemetry.md) as float rows, the preamble skipped."""
    with open(csv_path) as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(line for line in f if not line.startswith("#"))]


def run_info(jsonl_path: Path) -> dict:
    """The run's run_info record, the JSONL's first (docs/telemetry.md § JSONL)."""
    for line in jsonl_path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "run_info":
            return rec
    raise SystemExit(f"no run_info record in {jsonl_path}")


def start_seconds(info: dict) -> float:
    """Launch to ready: the run's load plus its kernel warm-up."""
    return float(info["load_seconds"]) + float(info.get("compile_seconds", 0.0))


def io_lanes(info: dict) -> int:
    """The run's read lanes (the CSV's io_ms sums over them)."""
    return int(info["config"]["io.io_threads"])


def lane_gbps(rows: list[dict], lanes: int) -> float:
    """Disk bytes per second of reading: io_ms sums every lane's read time, so it is divided by the lanes."""
    busy_s = sum(r["io_ms"] for r in rows) / 1e3 / lanes
    return sum(r["read_bytes"] for r in rows) / busy_s / 1e9 if busy_s else float("nan")


def moe_pipe_io_figures(rows: list[dict], lanes: int) -> dict:
    """Read rates of the prompt and of tokens 2-50, its bytes, the final hit rate."""
    return {
        "lanes": lanes,
        "first_gb": rows[0]["read_bytes"] / 1e9,
        "first_read_gbps": lane_gbps(rows[:1], lanes),
        "fill_read_gbps": lane_gbps(rows[1:50], lanes),
        "hit_pct": rows[-1]["cache_hit_pct"],
    }


# -- cold copies and the cold check ---------------------------------------------------


def cold_run_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a bench that serves MODEL from fresh copies in a memory cgroup
    (bench_cold.py, bench_restart.py): the model, the limit, the reply, the repeats."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("model", type=Path)
    ap.add_argument("--limit-mb", type=float, required=True, help="memory cgroup limit for every run")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--config", default="configs/qwen30b.toml")
    return ap


def fresh_copy(model: Path, dest: Path) -> float:
    """A copy of the model on blocks no run has read, out of the page cache; seconds taken."""
    t0 = time.perf_counter()
    shutil.copyfile(model, dest)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t0


def fresh_region(model: Path, dest: Path, start: int, length: int) -> None:
    """Bytes start..start+length of the model copied to `dest`: blocks no run has read (a
    region, not the whole file, so the check fits beside a model too big to copy)."""
    with open(model, "rb") as src, open(dest, "wb") as out:
        src.seek(start)
        left = length
        while left:
            chunk = src.read(min(left, 64 << 20))
            if not chunk:
                raise SystemExit(f"bench_vs_llama: {model} ends before {start + length} bytes")
            out.write(chunk)
            left -= len(chunk)
    subprocess.run(["sync"], check=True)


def cold_check(model: Path, copy: Path, lanes: int, region_gib: float = COLD_CHECK_GIB) -> dict:
    """Read a fresh copy of one region twice, O_DIRECT into populated pages: never-read rate, re-read rate."""
    from bench_fill import run_one  # bench/ is the script's folder

    from moe_pipe.shared.analysis.cgroup import drop_page_cache

    region = int(region_gib * 2**30) // 4096 * 4096
    start = (model.stat().st_size // 2) // 4096 * 4096  # the middle: expert bytes on every model here
    try:
        fresh_region(model, copy, start, region)
        drop_page_cache()
        first = run_one(copy, "populated", 0, region, lanes)["gbps"]
        drop_page_cache()
        again = run_one(copy, "populated", 0, region, lanes)["gbps"]
    finally:
        copy.unlink(missing_ok=True)
    return {"never_read_gbps": first, "reread_gbps": again, "lanes": lanes, "region_gib": region_gib}


# -- one run of one engine --------------------------------------------------------------


def run_engine(
    engine: Engine,
    model: Path,
    config: Path,
    limit_mb: float,
    n: int,
    threads: int,
    out: Path,
    prompt: str,
    prompt_tokens: list[int],
    peer_timeout_s: float,
) -> dict:
    from moe_pipe.shared.analysis import benchmark as bm
    from moe_pipe.shared.analysis.peer_llama import read_result

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    overrides = (f"model.path={model}", *engine.overrides)
    plan = bm.BenchPlan(
        model,
        run_target=str(config),
        prompt=prompt,
        n=n,
        repeat=1,
        threads=threads,
        mem_limit_mb=limit_mb,
        out=out,
        peer_timeout_s=peer_timeout_s,
        run_args=tuple(a for o in overrides for a in ("--set", o)),
    )
    if engine.kind == "moe-pipe":
        fig = bm._in_cgroup(plan, lambda cg: bm.run_moe_pipe(plan, 1, cg))
        rows = read_rows(out / fig.csv)
        walls = [r["wall_ms"] for r in rows]
        info = run_info((out / fig.csv).with_suffix(".jsonl"))
        extra = moe_pipe_io_figures(rows, io_lanes(info))
        extra["budget_mib"] = fig.budget_mib
        extra["start_s"] = start_seconds(info)
    else:
        ra_file = bm.readahead_file(model)
        machine_ra = int(ra_file.read_text()) if ra_file else None
        if engine.readahead_kb is not None and not bm.set_readahead(ra_file, engine.readahead_kb):
            raise SystemExit(f"bench_vs_llama: cannot set readahead {engine.readahead_kb} KiB ({ra_file} not writable)")
        try:
            fig = bm._in_cgroup(plan, lambda cg: bm.run_llama(plan, 1, prompt_tokens, bm.PeerRun(engine.readahead_kb), cg))
        finally:
            if machine_ra is not None:
                bm.set_readahead(ra_file, machine_ra)
        peer = read_result(out / fig.csv)
        walls = peer["wall_ms"]
        extra = {"start_s": peer.get("load_s")}
    row = {"engine": engine.name, "kind": engine.kind, "lossy": engine.lossy, "finished": fig.finished, **reply_figures(walls), **extra}
    row.update(peak_mem_mib=fig.peak_mem_mib, page_cache_mib=fig.page_cache_mib, oom_kills=fig.oom_kills, token_ids=fig.token_ids)
    return row


# -- the protocol ---------------------------------------------------------------------------


def run_protocol(
    model: Path,
    config: Path,
    engines: list[Engine],
    *,
    limit_mb: float,
    n: int,
    repeat: int,
    threads: int,
    out: Path,
    cold: str,
    peer_timeout_s: float,
    lanes: int,
    prompt_length: int | None = None,
) -> dict:
    """Every engine's runs, cold, on the fixed short prompt or, with `prompt_length`,
    on that many tokens of ordinary prose (`prose_prompt`)."""
    from moe_pipe.shared.analysis.benchmark import PROMPT
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.text.chat import encode_prompt
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(model) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        prompt = PROMPT if prompt_length is None else prose_prompt(tok, prompt_length)
        prompt_tokens = encode_prompt(tok, prompt)
        expert_bytes = sum(mf.layout.expert_bytes(i) * mf.spec.n_expert for i in mf.spec.moe_layers)  # every routed expert, once
    copy = model.with_name(model.stem + "-cold-copy.gguf")
    checks = []
    say(f"cold check: a fresh copy of a region read twice ({lanes} lanes) ...")
    checks.append(cold_check(model, copy, lanes))
    say(f"    never-read {checks[-1]['never_read_gbps']:.2f} GB/s, re-read {checks[-1]['reread_gbps']:.2f} GB/s")
    rows = []
    t0 = time.monotonic()
    for r in range(repeat):
        order = engines if r % 2 == 0 else engines[::-1]
        for pos, engine in enumerate(order):
            target = model
            try:
                if cold == "copy":  # inside the try: a copy cut short by a kill goes too
                    took = fresh_copy(model, copy)
                    target = copy
                    say(f"[{engine.name} #{r + 1}] fresh copy in {took:.0f} s")
                row = run_engine(
                    engine, target, config, limit_mb, n, threads, out / f"{engine.slug}-{r + 1}", prompt, prompt_tokens, peer_timeout_s
                )
            finally:
                if cold == "copy":
                    copy.unlink(missing_ok=True)
            row.update(run=r + 1, position=pos + 1)
            rows.append(row)
            say(
                f"[{engine.name} #{r + 1}] first {row['first_s']:.2f} s, 2-50 {row['fill_ms']:.0f} ms, last quarter "
                f"{row['steady_tps']:.2f} tok/s, whole {row['whole_tps']:.2f} tok/s, {row['tokens']} tokens "
                f"({time.monotonic() - t0:.0f} s so far)"
            )
    say("cold check again ...")
    checks.append(cold_check(model, copy, lanes))
    say(f"    never-read {checks[-1]['never_read_gbps']:.2f} GB/s, re-read {checks[-1]['reread_gbps']:.2f} GB/s")
    return summarize(
        model, config, engines, rows, checks, limit_mb=limit_mb, n=n, repeat=repeat, threads=threads, cold=cold,
        prompt_tokens=len(prompt_tokens), expert_gb=expert_bytes / 1e9,
    )  # fmt: skip


def prose_prompt(tok, length: int) -> str:
    """The longest opening of the project's prose corpus (a story in plain English,
    shipped to train the made models' tokenizers) that is at most `length` tokens,
    cut at a word: an ordinary long prompt, the same text for every engine. Past the
    corpus's own length (~7k tokens) the corpus is repeated as often as it takes
    (bench_context.py's 20,000-token context)."""
    from moe_pipe.shared.gguf.vocab import CORPUS
    from moe_pipe.shared.text.chat import encode_prompt

    corpus = " ".join(CORPUS.read_text(encoding="utf-8").split()).split(" ")
    words = corpus
    while len(encode_prompt(tok, " ".join(words))) <= length:
        words = words + corpus
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose text is at most `length` tokens
        mid = (lo + hi + 1) // 2
        if len(encode_prompt(tok, " ".join(words[:mid]))) <= length:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


FIGS = ("first_s", "steady_at_token", "steady_at_s", "fill_ms", "steady_tps", "whole_tps")


def summarize(model: Path, config: Path, engines: list[Engine], rows: list[dict], checks: list[dict], **how) -> dict:
    med = {}
    for e in engines:
        mine = [r for r in rows if r["engine"] == e.name]
        m = {k: statistics.median(r[k] for r in mine) for k in FIGS}
        for k in ("start_s", "first_read_gbps", "fill_read_gbps", "hit_pct", "budget_mib", "page_cache_mib", "first_gb"):
            vals = [r[k] for r in mine if r.get(k) is not None]
            m[k] = statistics.median(vals) if vals else None
        m["finished"] = all(r["finished"] for r in mine)
        med[e.name] = m
    peers = [e.name for e in engines if e.kind == "llama.cpp"]
    best = max(peers, key=lambda p: med[p]["steady_tps"]) if peers else None
    ratios = {}
    if best:
        b = med[best]
        for e in engines:
            if e.kind == "moe-pipe":
                m = med[e.name]
                ratios[e.name] = {
                    "first_token": b["first_s"] / m["first_s"],  # > 1: moe-pipe's first token is sooner
                    "fill": b["fill_ms"] / m["fill_ms"],
                    "steady": m["steady_tps"] / b["steady_tps"],
                    "whole": m["whole_tps"] / b["whole_tps"],
                }
    ref = next((r["token_ids"] for r in rows if r["kind"] == "moe-pipe" and not r["lossy"]), [])
    same = {
        f"{r['engine']} #{r['run']}": next(
            (i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b), min(len(ref), len(r["token_ids"]))
        )
        for r in rows
        if r["kind"] == "llama.cpp"
    }
    return {
        "model": model.name,
        "model_mib": model.stat().st_size / 2**20,
        "config": str(config),
        **how,
        "cold_checks": checks,
        "medians": med,
        "best_llama": best,
        "ratios_vs_best_llama": ratios,
        "llama_tokens_equal_moe_pipe": same,
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
    }


def markdown(s: dict, title: str) -> str:
    lim = s["limit_mb"]
    cold = (
        "every run on its own fresh copy of the file (cold for real)"
        if s["cold"] == "copy"
        else "every run on the same file, the engines' order alternating between repeats"
    )
    lines = [
        f"### {title}",
        "",
        f"{s['model']} ({s['model_mib']:,.0f} MiB), memory limit {lim:,.0f} MiB for every engine (the recipe's cache "
        f"ceiling lifted: `cache_ceil_mb` auto gives no ceiling off a phone), {s['n']} greedy tokens, {s['threads']} threads, "
        f"medians of {s['repeat']} runs, {cold}; the prompt: {s.get('prompt_tokens', '?')} tokens.",
        "",
        "| engine | start-up s | first token s | steady from token (s) | tokens 2-50 ms | last quarter tok/s | whole tok/s | "
        "prompt reads GB/s | fill reads GB/s | hit % | cache or page cache, share of limit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt="{:.2f}"):
        return "" if v is None else fmt.format(v)

    prompt_rows = []
    for name, m in s["medians"].items():
        n_prompt, gb = s.get("prompt_tokens"), m.get("first_gb")
        read = f"{gb:.1f} GB = {gb / s['expert_gb']:.2f}× the experts" if gb is not None and s.get("expert_gb") else "(page cache)"
        prompt_rows.append(f"| {name} | {f(m['first_s'])} | {f(n_prompt / m['first_s'] if n_prompt else None, '{:.1f}')} | {read} |")
        mem = m["budget_mib"] if m["budget_mib"] is not None else m["page_cache_mib"]
        what = "expert cache" if m["budget_mib"] is not None else "page cache"
        lines.append(
            f"| {name}{'' if m['finished'] else ' (did not finish)'} | {f(m['start_s'], '{:.1f}')} | {f(m['first_s'])} | {m['steady_at_token']:.0f} "
            f"({f(m['steady_at_s'], '{:.1f}')}) | {f(m['fill_ms'], '{:.0f}')} | {f(m['steady_tps'])} | {f(m['whole_tps'])} | "
            f"{f(m['first_read_gbps'])} | {f(m['fill_read_gbps'])} | {f(m['hit_pct'], '{:.0f}')} | "
            + (f"{what} {mem:,.0f} MiB = {mem / lim:.0%}" if mem is not None else "")
            + " |"
        )
    lines += [
        "",
        "The prompt:",
        "",
        "| engine | first token s | prefill tok/s | expert bytes read during the prompt |",
        "|---|---|---|---|",
    ]
    lines += prompt_rows
    if s["best_llama"]:
        lines += ["", f"Against llama.cpp's best configuration here ({s['best_llama']}, by last-quarter tok/s):", ""]
        lines += ["| moe-pipe | first token (× sooner) | tokens 2-50 (× faster) | last quarter | whole |", "|---|---|---|---|---|"]
        for name, r in s["ratios_vs_best_llama"].items():
            lines.append(f"| {name} | {r['first_token']:.2f}× | {r['fill']:.2f}× | {r['steady']:.2f}× | {r['whole']:.2f}× |")
    for c in s["cold_checks"]:
        lines.append(
            f"\nCold check ({c['region_gib']:g} GiB of a fresh copy, O_DIRECT into populated pages, {c['lanes']} lanes): "
            f"first read {c['never_read_gbps']:.2f} GB/s, re-read {c['reread_gbps']:.2f} GB/s."
        )
    if s["llama_tokens_equal_moe_pipe"]:
        lines.append(
            "\nGreedy tokens equal to moe-pipe's before the first difference (random weights give near-ties that float "
            "rounding flips): " + ", ".join(f"{k}: {v}" for k, v in s["llama_tokens_equal_moe_pipe"].items())
        )
    fc, ours = s.get("forecast"), s["medians"].get("moe-pipe")
    if fc and fc.get("tok_s") and ours:
        lines.append(
            f"\n`moe-pipe doctor` forecast for this limit: steady {fc['tok_s']:.2f} tok/s (hit {fc['hit_pct']:.0f} % from "
            f"{fc['hit_source']}), measured {ours['steady_tps']:.2f} = {ours['steady_tps'] / fc['tok_s']:.2f}× the forecast; "
            f"tokens 2-50 {fc['warmup_ms']:.0f} ms (hit {fc['warmup_hit_pct']:.0f} %), measured {ours['fill_ms']:.0f} ms = "
            f"{ours['fill_ms'] / fc['warmup_ms']:.2f}× the forecast."
        )
    lines += [
        "",
        "Runs:",
        "",
        "| engine | run | position | first s | 2-50 ms | last quarter tok/s | whole tok/s | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in s["runs"]:
        lines.append(
            f"| {r['engine']} | {r['run']} | {r['position']} | {r['first_s']:.2f} | {r['fill_ms']:.0f} | {r['steady_tps']:.2f} | "
            f"{r['whole_tps']:.2f} | {r['tokens']}{'' if r['finished'] else ' (stopped)'} |"
        )
    return "\n".join(lines) + "\n"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
