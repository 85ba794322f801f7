"""A portable benchmark report: what a user with a board runs and sends back.

    python bench/bench_report.py [--model M.gguf] [--out docs/report-example] [--tokens 16] [--seconds 4]

Writes OUT.json and OUT.md: the machine (CPU, the features the kernels look
for and which int8 dot build is active, cores, page size and I/O alignment,
memory and any cgroup limit), storage read speed at the model's expert size
and the doctor's kernel figures (shared/analysis/forecast.py, the same code
as `moe-pipe doctor`), kernel rates per type (forecast.measure_kernels on a
768×2048 expert matrix of each type), and a short streamed run: by default a
qwen30b-shape model cut to 2 layers, made with make-model into a temp dir,
run at its smallest cache so every token streams. About a minute here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

TYPES = ("Q4_K", "Q6_K", "Q8_0", "MXFP4", "Q5_0", "F16")
SHAPE = (768, 2048)  # rows × cols: a qwen30b expert's gate/up matrix
CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vnni", "f16c", "neon", "dotprod", "i8mm", "fullfp16")


def machine(model_dir: Path) -> dict:
    import numba
    import psutil
    from llvmlite import binding as llb

    from moe_pipe.shared import quant
    from moe_pipe.shared.gguf.alignment import io_alignment

    feats = llb.get_host_cpu_features()
    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line), "")
    vm = psutil.virtual_memory()
    cg = "none found"
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            cg = Path(f).read_text().strip()
            if cg == "max" or (cg.isdigit() and int(cg) >= 1 << 62):  # v1 writes "no limit" as a huge page count
                cg = f"none ({f}: {cg})"
            break
        except OSError:
            continue
    al = io_alignment([model_dir])
    return {
        "arch": platform.machine(),
        "cpu": name or platform.processor() or "unknown",
        "llvm_cpu": llb.get_host_cpu_name(),
        "cpu_features": {f: bool(feats.get(f)) for f in CPU_FLAGS},
        "int8_dot": quant.INT8_DOT,
        "numba": numba.__version__,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "page_bytes": al.page,
        "io_align_bytes": al.value,
        "io_align": al.describe(),
        "mem_total_bytes": vm.total,
        "mem_available_bytes": vm.available,
        "cgroup_memory_max": cg,
    }


def kernel_rates(seconds: float) -> dict:
    from moe_pipe.shared.analysis.fit import KernelClass
    from moe_pipe.shared.analysis.forecast import measure_kernels

    rows, cols = SHAPE
    classes = [KernelClass("expert", t, rows, cols, rows * cols) for t in TYPES]
    got = measure_kernels(classes, (1, 2), seconds=seconds)
    return {c.qtype: {f"{n}t_gweights_s": round(got[(c.key, n)] / 1e9, 2) for n in (1, 2)} for c in classes}


def streamed_run(model: Path, tokens: int) -> dict:
    from moe_pipe.procs.pipeline import start_pipeline
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(model) as mf:
        prompt = Tokenizer.from_gguf(mf.gguf).encode("The old mill by the river")
        floor = mf.layout.min_cache_bytes()
    cfg = load_config(None, {"model.path": str(model), "cache.cache_mb": floor / 2**20 + 1e-6})
    with start_pipeline(cfg, model) as pipe:
        pipe.generate(prompt, {"temperature": 0.0}, 2)  # compile and first reads outside the timing
        t0 = time.perf_counter()
        done = pipe.generate(prompt, {"temperature": 0.0}, tokens)
        wall = time.perf_counter() - t0
        r = pipe.resolved
    return {
        "tokens": len(done.tokens),
        "wall_s": round(wall, 3),
        "tok_s_incl_prompt": round(len(done.tokens) / wall, 2),
        "cache_bytes": r.n_slabs * r.slab_bytes,
        "slab_bytes": r.slab_bytes,
        "io_align": r.io_align,
        "o_direct": r.direct_io,
        "timings": {k: v for k, v in done.timings.items() if isinstance(v, (int, float))},
    }


def to_markdown(rep: dict) -> str:
    m, d, s = rep["machine"], rep["doctor"], rep["streamed"]
    feats = ", ".join(f for f, on in m["cpu_features"].items() if on) or "none of those looked for"
    lines = [
        f"# moe-pipe benchmark report ({rep['date']})",
        "",
        *([f"> {rep['note']}", ""] if rep.get("note") else []),
        "## Machine",
        "",
        f"- CPU: {m['cpu']} ({m['arch']}, LLVM `{m['llvm_cpu']}`), {m['cores']} cores ({m['cores_usable']} usable), "
        f"load average {m['load_avg_1m']} at start",
        f"- features: {feats}; int8 dot build: **{m['int8_dot']}**",
        f"- page {m['page_bytes']} B; I/O alignment {m['io_align']}",
        f"- memory {m['mem_total_bytes'] / 2**30:.1f} GiB, {m['mem_available_bytes'] / 2**30:.1f} GiB available; "
        f"cgroup limit {m['cgroup_memory_max']}; the doctor counts {d['available_bytes'] / 2**30:.1f} GiB ({d['available']})",
        f"- Linux {m['kernel']}, Python {m['python']}, numba {m['numba']}",
        "",
        "## Storage and the doctor's figures",
        "",
        f"Model: {rep['model']}.",
        "",
        f"- reads at the expert size ({d['expert_bytes'] / 1e6:.2f} MB): "
        + " / ".join(f"{d[f'read_gbps_{n}']:.2f}" for n in (1, 2, 4) if d.get(f"read_gbps_{n}") is not None)
        + f" GB/s at 1 / 2 / 4 lanes ({d['read_note']})",
        f"- kernels on the model's classes: experts {d['expert_gws']} G weights/s ({d['threads']} threads), dense {d['dense_gws']}",
        f"- doctor's forecast: {d['tok_s']} tok/s decode, bottleneck {d['bottleneck']}",
        "",
        f"## Kernel rates per type ({SHAPE[0]}×{SHAPE[1]} matvec, G weights/s, best window)",
        "",
        "| type | 1 thread | 2 threads |",
        "|---|---|---|",
        *(f"| {t} | {v['1t_gweights_s']} | {v['2t_gweights_s']} |" for t, v in rep["kernels"].items()),
        "",
        "## Streamed run",
        "",
        f"{s['tokens']} tokens in {s['wall_s']} s ({s['tok_s_incl_prompt']} tok/s including the prompt), "
        f"cache {s['cache_bytes'] / 2**20:.1f} MiB (the smallest: one token's experts), slabs {s['slab_bytes']:,} B, "
        f"{'O_DIRECT' if s['o_direct'] else 'buffered reads'}, alignment {s['io_align']} B.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a GGUF model (default: a qwen30b-shape model cut to 2 layers, made in a temp dir)")
    p.add_argument("--out", type=Path, default=Path("moe-pipe-report"), help="writes OUT.json and OUT.md")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--seconds", type=float, default=4.0, help="for the doctor's measurements, and again for the per-type kernel rates")
    p.add_argument("--note", default="", help="a line for the top of the report (e.g. 'the machine was shared with other jobs')")
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.seconds <= 0:
        print("bench_report: --tokens and --seconds must be positive", file=sys.stderr)
        return 2
    if args.model is not None and not args.model.is_file():
        print(f"bench_report: {args.model}: no such file", file=sys.stderr)
        return 2
    from moe_pipe.shared.analysis.forecast import forecast
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.makemodel.maker import make_model

    t0 = time.perf_counter()
    took: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        took[name] = round(time.perf_counter() - since, 1)
        return time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="moe-pipe-report-") as tmp:
        model = args.model or make_model("qwen3moe", "qwen30b-shape", Path(tmp) / "qwen30b-shape-2l.gguf", layers=2)
        what = str(args.model) if args.model else "qwen30b-shape cut to 2 layers (make-model, random weights)"
        print(f"machine ... ({what})", file=sys.stderr)
        rep: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "note": args.note, "model": what}
        t = lap("make_model", t0)
        rep["machine"] = machine(Path(model).parent)
        print("doctor: reads and kernels on the model ...", file=sys.stderr)
        cfg = load_config(None, {"model.path": str(model)})
        with open_model(model) as mf:
            rep["doctor"] = forecast(mf, cfg, seconds=args.seconds)
        t = lap("doctor", t)
        print("kernel rates per type ...", file=sys.stderr)
        rep["kernels"] = kernel_rates(args.seconds)
        t = lap("kernels", t)
        print("streamed run ...", file=sys.stderr)
        rep["streamed"] = streamed_run(Path(model), args.tokens)
        lap("streamed", t)
    rep["report_seconds"] = round(time.perf_counter() - t0, 1)
    rep["stage_seconds"] = took  # compiles included: a first run on a machine compiles every kernel it measures
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(rep, indent=1) + "\n")
    stages = ", ".join(f"{k} {v} s" for k, v in took.items())
    Path(f"{args.out}.md").write_text(to_markdown(rep) + f"\n(report took {rep['report_seconds']} s: {stages})\n")
    print(f"wrote {args.out}.json and {args.out}.md in {rep['report_seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
