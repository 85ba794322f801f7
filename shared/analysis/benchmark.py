"""The benchmark protocol of `moe-pipe bench`: the same greedy generation
(fixed prompt, N decode tokens, end-of-generation ignored) through moe-pipe
and, optionally, llama.cpp, each run started cold (page cache dropped), in a
memory cgroup when a limit is asked, with a cooldown between runs; then the
figures, a markdown table and plots.

    out/
      moe-pipe-1.csv ...        per-token CSV of each moe-pipe run (docs/telemetry.md)
      llama.cpp-ra8192-1.csv    per-token walls of each peer run (readahead in KiB)
      summary.json, summary.md  one row per run and the medians per engine
      per-token.png, hit-rate.png

Everything measured is a figure to print, never a pass/fail: a peer killed by
the memory limit or stopped for crawling is recorded as such.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UserError
from .cgroup import MemoryCgroup, MemoryLimitError, drop_page_cache

PROMPT = "The old mill by the river had stood there for a hundred years, and every spring"
FORECAST_KEYS = ("tok_s", "tok_s_1t", "hit_pct", "hit_source", "bottleneck", "budget_mb", "read_gbps", "compute_ms", "io_ms")
PEER_READAHEAD_KB = 128  # llama.cpp's mmap is measured at the machine's readahead and at this
MIB = 1 << 20


@dataclass(frozen=True)
class BenchPlan:
    model: Path
    run_target: str = ""  # what `moe-pipe run` is given: the config file (its settings) or "" for the model
    n: int = 64
    repeat: int = 3
    threads: int = 0  # 0: all cores
    mem_limit_mb: float | None = None
    route_replay: str | None = None
    vs: tuple[str, ...] = ()  # ("llama.cpp",)
    out: Path = Path("bench-out")
    cooldown_s: float = 3.0
    peer_timeout_s: float = 900.0
    run_args: tuple[str, ...] = ()  # config overrides passed to `moe-pipe run`
    prompt: str = PROMPT


@dataclass
class RunFigures:
    engine: str  # moe-pipe | llama.cpp
    label: str
    run: int
    tokens: int
    finished: bool
    tok_s_mean: float
    tok_s_steady: float
    first5_wall_ms: float
    steady_wall_ms: float
    hit_pct: float | None = None
    mib_per_token: float | None = None
    budget_mib: float | None = None
    peak_mem_mib: float | None = None
    page_cache_mib: float | None = None
    load_s: float | None = None
    majflt_per_token: float | None = None
    oom_kills: int = 0
    csv: str = ""
    token_ids: list[int] = field(default_factory=list, repr=False)


def wall_figures(walls_ms: list[float]) -> dict:
    """tok/s over all tokens and over the steady window (the last quarter, as the
    telemetry summary and the doctor take it), and the first-5 wall average."""
    from ..speed import steady_start

    if not walls_ms:
        return {"tok_s_mean": 0.0, "tok_s_steady": 0.0, "first5_wall_ms": 0.0, "steady_wall_ms": 0.0}
    steady = walls_ms[steady_start(len(walls_ms)) :]
    return {
        "tok_s_mean": 1e3 * len(walls_ms) / sum(walls_ms),
        "tok_s_steady": 1e3 * len(steady) / sum(steady),
        "first5_wall_ms": statistics.mean(walls_ms[:5]),
        "steady_wall_ms": statistics.median(steady),
    }


# -- one run of each engine ----------------------------------------------------------


def _in_cgroup(plan: BenchPlan, fn: Callable[[MemoryCgroup | None], RunFigures]) -> RunFigures:
    """Run fn cold, in a fresh cgroup (limited when asked; for accounting only
    otherwise, when one can be made)."""
    drop_page_cache()
    try:
        cg = MemoryCgroup.create(plan.mem_limit_mb)
    except MemoryLimitError:
        if plan.mem_limit_mb is not None:
            raise
        cg = None
    try:
        fig = fn(cg)
        if cg is not None:
            fig.peak_mem_mib = (cg.peak_bytes() or 0) / MIB
            fig.page_cache_mib = (cg.page_cache_bytes() or 0) / MIB
            fig.oom_kills = cg.oom_kills()
        return fig
    finally:
        if cg is not None:
            cg.remove()


def run_moe_pipe(plan: BenchPlan, k: int, cg: MemoryCgroup | None) -> RunFigures:
    from ..telemetry import read_csv

    csv = plan.out / f"moe-pipe-{k}.csv"
    cmd = [
        sys.executable,
        "-m",
        "moe_pipe.cli.main",
        "run",
        plan.run_target or str(plan.model),
        "-p",
        plan.prompt,
        "-n",
        str(plan.n),
        "--ignore-eos",
        "--output-format",
        "json",
        "--csv",
        str(csv),
        *plan.run_args,
    ]
    if plan.threads:
        cmd += ["-t", str(plan.threads)]
    if plan.route_replay:
        cmd += ["--route-replay", plan.route_replay]
    r = subprocess.run(cg.wrap(cmd) if cg else cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"moe-pipe run {k} failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:] or ''}")
    out = json.loads(r.stdout)
    _, recs = read_csv(csv)
    walls = [x.wall_ms for x in recs]
    t = out["timings"]
    return RunFigures(
        "moe-pipe",
        "moe-pipe" + (" (trace-driven)" if plan.route_replay else ""),
        k,
        len(recs),
        True,
        **wall_figures(walls),
        hit_pct=recs[-1].cache_hit_pct if recs else None,
        mib_per_token=statistics.mean(x.read_bytes for x in recs) / MIB if recs else None,
        budget_mib=t.get("budget_mib"),
        load_s=t.get("load_s"),
        majflt_per_token=sum(x.majflt for x in recs) / max(1, len(recs)),
        csv=csv.name,
        token_ids=list(out["tokens"]),
    )


@dataclass(frozen=True)
class PeerRun:
    """One way of running llama.cpp. `repack` is its default CPU weight
    repacking, which copies the weights into anonymous memory at load (see
    peer_llama.py); off, it serves them from the mapped file as llama.cpp does
    on an ARM phone, and that is the comparison the targets are about."""

    readahead_kb: int | None
    repack: bool = False

    @property
    def tag(self) -> str:
        return ("repack-" if self.repack else "") + (f"ra{self.readahead_kb}" if self.readahead_kb is not None else "ra-")

    @property
    def label(self) -> str:
        how = "llama.cpp default (weights repacked into RAM)" if self.repack else "llama.cpp mmap"
        return how + (f", readahead {self.readahead_kb} KiB" if self.readahead_kb is not None else "")


def peer_runs(machine_ra: int | None) -> list[PeerRun]:
    """mmap at the machine's readahead and at PEER_READAHEAD_KB, then the
    default loading once (at the machine's readahead)."""
    ras = [machine_ra] + ([PEER_READAHEAD_KB] if machine_ra not in (None, PEER_READAHEAD_KB) else [])
    return [PeerRun(ra) for ra in ras] + [PeerRun(machine_ra, repack=True)]


def peer_repeats(peer: PeerRun, repeat: int) -> int:
    """The default loading is a reference point, not the comparison: once."""
    return 1 if peer.repack else repeat


def run_llama(plan: BenchPlan, k: int, prompt_tokens: list[int], peer: PeerRun, cg: MemoryCgroup | None) -> RunFigures:
    from .peer_llama import read_result

    csv = plan.out / f"llama.cpp-{peer.tag}-{k}.csv"
    req = plan.out / f".llama-request-{k}.json"
    req.write_text(
        json.dumps({"prompt_tokens": prompt_tokens, "n": plan.n, "threads": plan.threads or os.cpu_count(), "repack": peer.repack})
    )
    cmd = [sys.executable, "-m", "moe_pipe.shared.analysis.peer_llama", str(plan.model), str(req), str(csv)]
    proc = subprocess.Popen(cg.wrap(cmd) if cg else cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=plan.peer_timeout_s)
        stopped = ""
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        stopped = f"stopped after {plan.peer_timeout_s:.0f} s"
    finally:
        req.unlink(missing_ok=True)
    if proc.returncode == 3:
        raise UserError("--vs llama.cpp: " + err.strip().splitlines()[-1])
    res = read_result(csv)
    label = peer.label
    if not res["finished"]:
        label += f" ({stopped or f'killed, exit {proc.returncode}'})"
    n_tok = len(res["wall_ms"])
    return RunFigures(
        "llama.cpp",
        label,
        k,
        n_tok,
        res["finished"],
        **wall_figures(res["wall_ms"]),
        load_s=res.get("load_s"),
        majflt_per_token=res["majflt"] / max(1, n_tok) if "majflt" in res else None,
        csv=csv.name,
        token_ids=res["tokens"],
    )


# -- readahead ---------------------------------------------------------------------------


def readahead_file(path: Path) -> Path | None:
    """/sys/.../queue/read_ahead_kb of the block device holding `path`."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for d in (dev, dev.resolve().parent if dev.exists() else None):
        if d is not None and (d / "queue" / "read_ahead_kb").exists():
            return d / "queue" / "read_ahead_kb"
    return None


def set_readahead(f: Path | None, kb: int) -> bool:
    if f is None:
        return False
    try:
        f.write_text(str(kb))
        return True
    except OSError:
        return False


# -- the whole benchmark ------------------------------------------------------------------


def run_bench(plan: BenchPlan, say: Callable[[str], None], forecast: dict | None = None) -> dict:
    plan.out.mkdir(parents=True, exist_ok=True)
    ra_file = readahead_file(plan.model)
    machine_ra = int(ra_file.read_text()) if ra_file else None
    peers = peer_runs(machine_ra)
    total = plan.repeat + (sum(peer_repeats(p, plan.repeat) for p in peers) if "llama.cpp" in plan.vs else 0)
    rows: list[RunFigures] = []
    t0 = time.monotonic()

    def step(what: str, fn):
        if rows:
            time.sleep(plan.cooldown_s)  # let the disk and the caches settle between runs
        say(f"[{len(rows) + 1}/{total}] {what} ... ({time.monotonic() - t0:.0f} s so far)")
        fig = _in_cgroup(plan, fn)
        rows.append(fig)
        say(f"    {fig.label}: {fig.tok_s_steady:.2f} tok/s steady, {fig.tokens} tokens" + ("" if fig.finished else " (did not finish)"))

    for k in range(1, plan.repeat + 1):
        step(f"moe-pipe run {k}/{plan.repeat}", lambda cg, k=k: run_moe_pipe(plan, k, cg))
    prompt_tokens = _prompt_tokens(plan)
    if "llama.cpp" in plan.vs:
        try:
            for peer in peers:
                ra = peer.readahead_kb
                if ra is not None and not set_readahead(ra_file, ra) and ra != machine_ra:
                    say(f"(readahead {ra} KiB skipped: {ra_file} is not writable)")
                    continue
                runs = peer_repeats(peer, plan.repeat)
                for k in range(1, runs + 1):
                    step(f"{peer.label}, run {k}/{runs}", lambda cg, k=k, peer=peer: run_llama(plan, k, prompt_tokens, peer, cg))
        finally:
            if machine_ra is not None:
                set_readahead(ra_file, machine_ra)  # restore the machine's setting whatever happened
    summary = summarize_runs(plan, rows, machine_ra)
    if forecast is not None:
        summary["forecast"] = {k: forecast.get(k) for k in FORECAST_KEYS}
    write_outputs(plan, summary, rows)
    return summary


def _prompt_tokens(plan: BenchPlan) -> list[int]:
    from ..gguf.model_file import open_model
    from ..text.chat import encode_prompt
    from ..text.tokenizer import Tokenizer

    with open_model(plan.model) as mf:
        return encode_prompt(Tokenizer.from_gguf(mf.gguf), plan.prompt)


def summarize_runs(plan: BenchPlan, rows: list[RunFigures], machine_ra: int | None) -> dict:
    groups: dict[str, list[RunFigures]] = {}
    for r in rows:
        groups.setdefault(r.label.split(" (")[0] if r.engine == "llama.cpp" else r.label, []).append(r)
    medians = {label: statistics.median(r.tok_s_steady for r in rs) for label, rs in groups.items()}
    ours = next((v for k, v in medians.items() if k.startswith("moe-pipe")), None)
    peers = {k: v for k, v in medians.items() if k.startswith("llama.cpp")}
    best_peer = max(peers.values()) if peers else None
    ref = next((r.token_ids for r in rows if r.engine == "moe-pipe"), [])
    same = {
        r.label: next((i for i, (a, b) in enumerate(zip(r.token_ids, ref)) if a != b), min(len(ref), len(r.token_ids)))
        for r in rows
        if r.engine == "llama.cpp"
    }
    return {
        "model": str(plan.model),
        "n": plan.n,
        "repeat": plan.repeat,
        "threads": plan.threads or os.cpu_count(),
        "mem_limit_mb": plan.mem_limit_mb,
        "trace_driven": bool(plan.route_replay),
        "route_replay": plan.route_replay,
        "machine_readahead_kb": machine_ra,
        "model_mib": plan.model.stat().st_size / MIB,
        "median_steady_tok_s": medians,
        "ratio_vs_best_llama": (ours / best_peer) if ours and best_peer else None,
        "llama_tokens_equal_moe_pipe": same,
        "runs": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in rows],
    }


def summary_markdown(s: dict) -> str:
    lim = f"{s['mem_limit_mb']:g} MiB memory limit" if s["mem_limit_mb"] else "no memory limit"
    lines = [
        f"# moe-pipe bench: {Path(s['model']).name} ({s['model_mib']:,.0f} MiB)",
        "",
        f"{s['n']} greedy tokens, fixed prompt, {s['threads']} threads, {lim}, {s['repeat']} run(s) each, "
        f"cold start (page cache dropped) per run"
        + (f"; **moe-pipe trace-driven** (--route-replay {Path(s['route_replay']).name})" if s["trace_driven"] else ""),
        "",
        "| run | tok/s mean | tok/s steady | first-5 wall ms | steady wall ms | hit % | MiB read/token | "
        "budget MiB | peak mem MiB | page cache MiB | load s | majflt/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt="{:.2f}"):
        return "" if v is None else fmt.format(v)

    for r in s["runs"]:
        lines.append(
            f"| {r['label']} #{r['run']} | {f(r['tok_s_mean'])} | {f(r['tok_s_steady'])} | "
            f"{f(r['first5_wall_ms'], '{:.1f}')} | {f(r['steady_wall_ms'], '{:.1f}')} | {f(r['hit_pct'], '{:.1f}')} | "
            f"{f(r['mib_per_token'])} | {f(r['budget_mib'], '{:.0f}')} | {f(r['peak_mem_mib'], '{:.0f}')} | "
            f"{f(r['page_cache_mib'], '{:.0f}')} | {f(r['load_s'])} | {f(r['majflt_per_token'], '{:.1f}')} |"
        )
    lines += ["", "Median steady tok/s: " + ", ".join(f"{k} {v:.2f}" for k, v in s["median_steady_tok_s"].items())]
    if s["ratio_vs_best_llama"] is not None:
        lines.append(f"moe-pipe ÷ llama.cpp (its better readahead): **{s['ratio_vs_best_llama']:.2f}×**")
    fc = s.get("forecast")
    ours = next((v for k, v in s["median_steady_tok_s"].items() if k.startswith("moe-pipe")), None)
    if fc and fc.get("tok_s"):
        lines.append(
            f"`moe-pipe doctor` forecast (before the runs): {fc['tok_s']:.2f} tok/s, {fc['bottleneck']}-bound "
            f"(compute {fc['compute_ms']} ms, reads {fc['io_ms']} ms per token; hit {fc['hit_pct']} % from "
            f"{fc['hit_source']}); measured {ours:.2f} = {ours / fc['tok_s']:.2f}× the forecast"
            if ours
            else f"`moe-pipe doctor` forecast: {fc['tok_s']:.2f} tok/s"
        )
    if s["llama_tokens_equal_moe_pipe"]:
        lines.append(
            "greedy tokens equal to moe-pipe's before the first difference (same file, same math; random "
            "weights give near-ties that float rounding can flip): "
            + ", ".join(f"{k}: {v}/{s['n']}" for k, v in s["llama_tokens_equal_moe_pipe"].items())
        )
    return "\n".join(lines) + "\n"


def write_outputs(plan: BenchPlan, summary: dict, rows: list[RunFigures]) -> list[Path]:
    (plan.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (plan.out / "summary.md").write_text(summary_markdown(summary))
    return [plan.out / "summary.json", plan.out / "summary.md", *write_plots(plan, rows)]


def write_plots(plan: BenchPlan, rows: list[RunFigures]) -> list[Path]:
    """per-token.png and hit-rate.png (below). Needs matplotlib (the `bench`
    extra); without it, no plots and a note in the summary."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for name, make in (("per-token.png", per_token_figure), ("hit-rate.png", hit_rate_figure)):
        fig = make(plan, rows)
        if fig is None:
            continue
        paths.append(plan.out / name)
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")  # tight: the legend sits outside the axes
        plt.close(fig)
    return paths


def per_token_figure(plan: BenchPlan, rows: list[RunFigures]):
    """Per-token wall/compute/io/stall of the first moe-pipe run, with each
    peer's first run (and any run that did not finish) as walls on the same
    axes. The legend sits outside the axes so it hides no curve; a run that
    did not finish ends in a cross (a run killed after one token is a single
    point, invisible as a line) and says so in its label; a caption says why
    io can lie above wall. None without a moe-pipe run."""
    import matplotlib.pyplot as plt

    from ..telemetry import read_csv
    from .peer_llama import read_result

    first = next((r for r in rows if r.engine == "moe-pipe"), None)
    if first is None:
        return None
    preamble, recs = read_csv(plan.out / first.csv)
    steps = [r.step for r in recs]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for name in ("wall_ms", "compute_ms", "io_ms", "stall_ms"):
        ax.plot(steps, [getattr(r, name) for r in recs], label=f"moe-pipe {name[:-3]}", lw=1.2)
    for r in rows:
        if r.engine != "llama.cpp" or (r.run != 1 and r.finished):
            continue
        walls = read_result(plan.out / r.csv)["wall_ms"]
        label = f"{r.label} #{r.run}"
        if r.finished:
            ax.plot(range(1, len(walls) + 1), walls, "--", label=label, lw=1.2)
        elif walls:
            ax.plot(
                range(1, len(walls) + 1),
                walls,
                "--",
                marker="X",
                markevery=[len(walls) - 1],
                ms=9,
                lw=1.2,
                label=f"{label}: ended at token {len(walls)} (x)",
            )
        else:  # nothing to draw: the legend still names it
            ax.plot([], [], "X", ms=9, label=f"{label}: no token")
    ax.set_yscale("log")
    ax.set_xlabel("token (1 = the prompt)")
    ax.set_ylabel("ms")
    ax.set_title(f"{plan.model.name}: per-token times")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    lanes = preamble.get("config.io.io_threads", "the")
    fig.text(
        0.01,
        0.005,
        f"io is read time summed over the reader's {lanes} lanes, so it can lie above wall while reads overlap "
        "each other and compute; stall is the part of io that compute waited for (docs/telemetry.md)",
        fontsize=7,
        va="bottom",
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def hit_rate_figure(plan: BenchPlan, rows: list[RunFigures]):
    """The running cache hit % of each moe-pipe run, titled with the model and
    the expert cache budget (the figure depends on both). None without a moe-pipe run."""
    import matplotlib.pyplot as plt

    from ..telemetry import read_csv

    ours = [r for r in rows if r.engine == "moe-pipe"]
    if not ours:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for r in ours:
        _, rr = read_csv(plan.out / r.csv)
        ax.plot([x.step for x in rr], [x.cache_hit_pct for x in rr], label=f"run {r.run}")
    budgets = sorted({round(r.budget_mib) for r in ours if r.budget_mib is not None})
    budget = " / ".join(f"{b:,} MiB" for b in budgets) if budgets else "unknown"
    ax.set_title(f"{plan.model.name}: expert cache hit %, budget {budget}")
    ax.set_xlabel("token")
    ax.set_ylabel("cache hit % (running)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
