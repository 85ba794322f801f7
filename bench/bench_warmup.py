"""The warm-up analysis from our own runs: dense policy, overlap and cache budget.

    python bench/bench_warmup.py [--shapes qwen30b,gptoss120b] [--qwen-layers 8] [--gptoss-layers 16]
                                 [-n 24] [--repeat 1] [--threads 2] [--budgets 0.1,0.2,0.3,0.5]

For each shape (the models and memory limits of bench_vs_llama.py: the
reference phone's model-to-RAM ratio), `moe-pipe bench` with the shape's recipe
is run cold, page cache dropped, once per variant:

  dense-anon, dense-warm, dense-mmap   io.dense_weights, under the limit
  overlap-off                          compute.overlap = false (dense anon), under the limit
  budget-F                             cache.cache_mb = F x all experts, no limit (the budget curve)

Each variant's CSVs and summary go to bench/results/<shape>-L<layers>/warmup/<variant>/
(committed); the tables (first-5 wall, steady wall, their ratio, major faults
in the first five tokens and per steady token, hit %, load seconds; the
first token carries the whole prompt, so tokens 2-6 are shown too) and a
plot of the first tokens' wall per dense policy go into docs/warmup-analysis.md
between the markers. The prose around them is written by hand from these.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from _models import shape_model  # noqa: E402  (bench/ is the script's folder)
from bench_vs_llama import ROOT, SHAPES, limit_mb, moe_pipe_bench, replace_block, results_dir, results_name, shape_arguments, shape_layers

DOC = ROOT / "docs" / "warmup-analysis.md"
BEGIN, END = "<!-- bench_warmup: begin -->", "<!-- bench_warmup: end -->"
HEAD = 12  # tokens drawn in the cold-head plot


def variants(budgets: list[float], all_experts_mb: float) -> list[tuple[str, list[str], bool]]:
    """(name, config overrides, under the memory limit?)"""
    out = [(f"dense-{d}", [f'io.dense_weights="{d}"'], True) for d in ("anon", "warm", "mmap")]
    out.append(("overlap-off", ['io.dense_weights="anon"', "compute.overlap=false"], True))
    out += [
        (f"budget-{f:g}", [f"cache.cache_mb={f * all_experts_mb:.0f}", f"cache.cache_ceil_mb={f * all_experts_mb:.0f}"], False)
        for f in budgets
    ]
    return out


def all_experts_mib(model: Path) -> float:
    from moe_pipe.shared.gguf.model_file import open_model

    with open_model(model) as mf:
        return mf.spec.n_layer * mf.spec.n_expert * mf.layout.slab_bytes / 2**20


def run_variant(name: str, model: Path, out: Path, sets: list[str], limit: float | None, args) -> dict:
    moe_pipe_bench(name, model, out, args, limit, [a for x in sets for a in ("--set", x)])
    return json.loads((out / "summary.json").read_text())


def head_figures(out: Path, summary: dict) -> dict:
    """Figures of the variant's runs (medians over repeats): the cold head
    against the steady window, from the per-token CSVs."""
    from moe_pipe.shared.speed import steady_start
    from moe_pipe.shared.telemetry import read_csv

    rows = []
    for run in summary["runs"]:
        _, recs = read_csv(out / run["csv"])
        walls = [r.wall_ms for r in recs]
        s0 = steady_start(len(recs))
        steady = recs[s0:]
        rows.append(
            dict(
                first5=statistics.mean(walls[:5]),
                decode5=statistics.mean(walls[1:6]),
                steady=statistics.median(r.wall_ms for r in steady),
                first1=walls[0],
                majflt5=sum(r.majflt for r in recs[:5]),
                majflt_steady=statistics.mean(r.majflt for r in steady),
                compute5=statistics.mean(r.compute_ms for r in recs[:5]),
                compute_steady=statistics.median(r.compute_ms for r in steady),
                io_steady=statistics.median(r.io_ms for r in steady),
                stall_steady=statistics.median(r.stall_ms for r in steady),
                hit=run["hit_pct"],
                load=run["load_s"],
                budget=run["budget_mib"],
                peak=run["peak_mem_mib"],
                tok_s=run["tok_s_steady"],
                walls=walls[:HEAD],
            )
        )
    med = {
        k: statistics.median(r[k] for r in rows if r[k] is not None) if any(r[k] is not None for r in rows) else None
        for k in rows[0]
        if k != "walls"
    }
    med["walls"] = rows[0]["walls"]
    return med


def table(rows: list[tuple[str, dict]], cols: list[tuple[str, str, str]]) -> str:
    lines = ["| variant | " + " | ".join(c[0] for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for label, fig in rows:
        cells = ["" if fig.get(key) is None else fmt.format(fig[key]) for _, key, fmt in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


HEAD_COLS = [
    ("first token ms", "first1", "{:.0f}"),
    ("first-5 wall ms", "first5", "{:.0f}"),
    ("steady wall ms", "steady", "{:.0f}"),
    ("first-5 / steady", "ratio", "{:.2f}"),
    ("decode tokens 2-6 ms", "decode5", "{:.0f}"),
    ("2-6 / steady", "decode_ratio", "{:.2f}"),
    ("majflt first 5", "majflt5", "{:.0f}"),
    ("majflt / steady token", "majflt_steady", "{:.1f}"),
    ("compute first-5 ms", "compute5", "{:.0f}"),
    ("compute steady ms", "compute_steady", "{:.0f}"),
    ("hit %", "hit", "{:.1f}"),
    ("load s", "load", "{:.2f}"),
    ("peak MiB", "peak", "{:.0f}"),
]
OVERLAP_COLS = [
    ("steady wall ms", "steady", "{:.0f}"),
    ("compute ms", "compute_steady", "{:.0f}"),
    ("io ms", "io_steady", "{:.0f}"),
    ("stall ms", "stall_steady", "{:.0f}"),
    ("tok/s steady", "tok_s", "{:.2f}"),
    ("hit %", "hit", "{:.1f}"),
]
BUDGET_COLS = [
    ("budget MiB", "budget", "{:.0f}"),
    ("hit %", "hit", "{:.1f}"),
    ("tok/s steady", "tok_s", "{:.2f}"),
    ("steady wall ms", "steady", "{:.0f}"),
    ("io ms", "io_steady", "{:.0f}"),
    ("first-5 / steady", "ratio", "{:.2f}"),
]


def plot_heads(path: Path, title: str, figs: dict[str, dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, f in figs.items():
        ax.plot(range(1, len(f["walls"]) + 1), f["walls"], marker="o", ms=3, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("token (1 = prompt + first token)")
    ax.set_ylabel("wall ms (log)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def shape_section(name: str, layers: int, model: Path, limit: float, results: dict[str, dict]) -> str:
    for f in results.values():
        f["ratio"] = f["first5"] / f["steady"] if f["steady"] else None
        f["decode_ratio"] = f["decode5"] / f["steady"] if f["steady"] else None
    stem = results_name(model.stem)
    heads = {k: v for k, v in results.items() if k.startswith("dense-")}
    png = DOC.parent / f"warmup-{stem}.png"
    drawn = plot_heads(png, f"{stem}: first {HEAD} tokens, cold, limit {limit:,.0f} MiB", heads)
    parts = [
        f"### {name}-shape, {layers} layers ({model.stat().st_size / 2**20:,.0f} MiB), memory limit {limit:,.0f} MiB\n",
        f"Dense policy (overlap on), under the limit; bench/results/{stem}/warmup/dense-*:\n",
        table([(k, v) for k, v in heads.items()], HEAD_COLS),
        "",
    ]
    if drawn:
        parts += [f"![first tokens per dense policy]({png.name})", ""]
    ov = [(k, results[k]) for k in ("dense-anon", "overlap-off") if k in results]
    parts += [
        "Overlap (dense anon), under the limit:\n",
        table([(("overlap on" if k == "dense-anon" else "overlap off"), v) for k, v in ov], OVERLAP_COLS),
        "",
    ]
    bud = [(k, v) for k, v in results.items() if k.startswith("budget-")]
    if bud:
        parts += ["Cache budget (fraction of all experts; no memory limit):\n", table(bud, BUDGET_COLS), ""]
    return "\n".join(parts)


def write_doc(sections: list[str]) -> None:
    if not DOC.exists():
        DOC.write_text("# Warm-up analysis\n")
    replace_block(DOC, BEGIN, END, "\n" + "\n".join(sections), "## Measured")


def main(argv=None) -> int:
    p = shape_arguments(__doc__.splitlines()[0], n=24, repeat=1)
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.5", help="cache budgets as fractions of all experts")
    p.add_argument("--only", default="", help="comma-separated variant names to (re)run; others are read from disk")
    args = p.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    budgets = [float(x) for x in args.budgets.split(",") if x]
    sections = []
    for name in args.shapes.split(","):
        spec = SHAPES[name]
        layers = shape_layers(name, args)
        model = shape_model(None, layers, spec["arch"], spec["preset"])
        limit = limit_mb(name, model)
        base = results_dir(model) / "warmup"
        results = {}
        for vname, sets, limited in variants(budgets, all_experts_mib(model)):
            out = base / vname
            if only and vname not in only and (out / "summary.json").exists():
                summary = json.loads((out / "summary.json").read_text())
            else:
                summary = run_variant(name, model, out, sets, limit if limited else None, args)
            results[vname] = head_figures(out, summary)
        sections.append(shape_section(name, layers, model, limit, results))
    write_doc(sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
