"""Long GGUF fuzzing, on demand: the fuzz target of tests/test_fuzz_gguf.py
run for a given time, every input that breaks it kept as a regression test.

    python bench/fuzz_gguf.py --seconds 300 [--engine auto|atheris|hypothesis]

The target (`check_one` in the test module, loaded from there so that the
test and this runner fuzz the very same thing): open a mutated copy of one of
the project's own tiny models (qwen3moe, gpt-oss, gemma4; tokenizer and all)
and either get a self-consistent byte-range map or a one-line GGUFError that
names the problem. Engines:

- atheris (libFuzzer, coverage-guided on the load path: gguf-py's reader,
  gguf_file, spec, layout, model_file) when it is installed; libFuzzer stops
  at its own timeouts, so it runs in a child process, restarted until the
  time is up;
- hypothesis otherwise (or with --engine hypothesis): the test's structured
  mutations (extreme values in counts, lengths, type ids, offsets and dims;
  non-UTF-8 bytes in strings; cuts, insertions, deletions), in batches.

A failure is any other exception, a multi-line or over-long message, a
message from gguf_file's safety net instead of a named check, a hang (30 s),
or a MemoryError under an address-space limit of what the process had plus
1.5 GiB (an allocation sized by a lying count). Each distinct failure (by
exception type and innermost frame, or by kind of broken message) is saved
once, the smallest input seen, cut down while it still fails the same way,
into tests/fuzz_corpus/. Prints a summary: inputs, outcomes by message kind,
failures. A benchmark script: it reports, it never asserts.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import inspect
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_MODULE = ROOT / "tests" / "test_fuzz_gguf.py"
CORPUS = ROOT / "tests" / "fuzz_corpus"
# The modules atheris instruments for coverage: the load path, nothing else.
# Instrumented numba kernels fail to compile (numba cannot type atheris's
# tracing calls), and atheris.instrument_imports(include=...) reached them
# through the imports of the load path, so functions are instrumented one by one.
LOAD_PATH = [
    "gguf.gguf_reader",
    "moe_pipe.shared.gguf.reader",
    "moe_pipe.shared.gguf.spec",
    "moe_pipe.shared.gguf.layout",
    "moe_pipe.shared.gguf.model_file",
]
HEADROOM = 3 << 29  # 1.5 GiB of address space on top of what the warmed-up process maps


def load_target():
    """tests/test_fuzz_gguf.py as a module (it imports nothing relative for this)."""
    spec = importlib.util.spec_from_file_location("fuzz_target", TEST_MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_target"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def limit_address_space() -> None:
    """An allocation sized by a lying count becomes a MemoryError (a finding)
    instead of the machine swapping; set after warm-up so imports don't count."""
    with open("/proc/self/status") as fh:
        vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, resource.RLIM_INFINITY))


def message_kind(msg: str) -> str:
    """A GGUFError message with the path, names and numbers taken out: the check that fired."""
    msg = msg.split(": ", 1)[-1]
    msg = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", msg)
    msg = re.sub(r"\[[^\]]*\]|\([^)]*\)|-?\d+", "N", msg)
    return " ".join(msg.split()[:9])


def signature(exc: BaseException) -> str:
    """What broke: the kind of broken message, or the exception and where it was raised."""
    if type(exc).__name__ == "Broken":
        text = str(exc)
        net = re.search(r"unreadable GGUF \((\w+)", text)
        return f"net-{net.group(1)}" if net else text.split(":")[0]
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if "moe_pipe" in f.filename or "/gguf/" in f.filename or "/shared/" in f.filename
    ]
    where = f"{Path(frames[-1].filename).stem}-{frames[-1].name}" if frames else "unknown"
    return f"{type(exc).__name__}-{where}"


class Recorder:
    """Runs inputs through the target, counts outcomes, saves failures."""

    def __init__(self, target, work: Path, corpus: Path, stats_file: Path | None = None):
        self.target, self.work, self.corpus, self.stats_file = target, work, corpus, stats_file
        self.path = work / "input.gguf"
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures: dict[str, tuple[int, str]] = {}  # signature -> (size, saved file name)
        self.inputs = 0

    def outcome(self, data: bytes) -> tuple[str, BaseException | None]:
        self.target.write_new(self.path, data)
        try:
            result = self.target.check_one(self.path)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001  anything else is what we look for
            return signature(exc), exc
        return ("opened" if result == "opened" else message_kind(result)), None

    def __call__(self, data: bytes) -> None:
        self.inputs += 1
        kind, exc = self.outcome(data)
        if exc is None:
            self.outcomes[kind] += 1
        else:
            self.outcomes["FAILURE " + kind] += 1
            self.save(kind, data, exc)
        if self.stats_file is not None and self.inputs % 100 == 0:
            self.dump()

    def save(self, sig: str, data: bytes, exc: BaseException) -> None:
        data = self.shrink(sig, data)
        old = self.failures.get(sig)
        if old is not None and old[0] <= len(data):
            return
        if old is not None:
            (self.corpus / old[1]).unlink(missing_ok=True)
        name = self.target.input_name(data, sig)
        self.corpus.mkdir(exist_ok=True)
        (self.corpus / name).write_bytes(data)
        self.failures[sig] = (len(data), name)
        print(f"FAILURE {sig}: {type(exc).__name__}: {str(exc)[:300]} -> {self.corpus / name} ({len(data)} bytes)", flush=True)

    def shrink(self, sig: str, data: bytes) -> bytes:
        """Cut the tail while the input fails the same way (most failures are in the header)."""
        keep = 64
        while len(data) > keep:
            cut = data[: (keep + len(data)) // 2]
            if self.outcome(cut)[0] == sig:
                data = cut
            else:
                keep = (keep + len(data)) // 2 + 1
        return data

    def dump(self) -> None:
        self.stats_file.write_text(json.dumps({"inputs": self.inputs, "outcomes": self.outcomes, "failures": self.failures}))


# ------------------------------------------------------------------ engines


def run_hypothesis(target, work: Path, corpus: Path, seconds: float) -> Recorder:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seeds = [target.parse_seed(p) for p in target.make_seeds(work).values()]
    rec = Recorder(target, work, corpus)
    for s in seeds:  # warm-up: first-use imports and numba before the limit
        rec(s.data)
    limit_address_space()
    stop = time.monotonic() + seconds

    # Batches of fresh random examples until the time is up. Failures are
    # recorded, not raised, so hypothesis never stops to shrink.
    @settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(which=st.integers(0, len(seeds) - 1), ops=target.OPS)
    def batch(which, ops):
        if time.monotonic() < stop:
            rec(target.mutate(seeds[which], ops))

    while time.monotonic() < stop:
        batch()
    return rec


def instrument_load_path(atheris) -> int:
    """Coverage feedback on every function and method defined in LOAD_PATH."""
    n = 0
    for name in LOAD_PATH:
        module = importlib.import_module(name)
        for obj in list(vars(module).values()):
            if getattr(obj, "__module__", None) != name:
                continue
            funcs = (
                [obj]
                if inspect.isfunction(obj)
                else [v for v in vars(obj).values() if inspect.isfunction(v)]
                if inspect.isclass(obj)
                else []
            )
            for f in funcs:
                atheris.instrument_func(f)  # rewrites f.__code__ in place
                n += 1
    return n


def atheris_child(seed_dir: Path, work: Path, corpus: Path, seconds: int, stats_file: Path) -> None:
    import atheris

    target = load_target()
    print(f"instrumented {instrument_load_path(atheris)} functions of the load path", flush=True)
    rec = Recorder(target, work, corpus, stats_file)
    for p in sorted(seed_dir.glob("*.gguf")):
        rec(p.read_bytes())
    limit_address_space()
    max_len = max(p.stat().st_size for p in seed_dir.glob("*.gguf"))
    args = [
        sys.argv[0],
        f"-max_total_time={seconds}",
        "-timeout=60",
        "-rss_limit_mb=4096",
        f"-max_len={max_len}",
        f"-artifact_prefix={work}/",
        "-print_final_stats=1",
        str(work / "libfuzzer-corpus"),
        str(seed_dir),
    ]
    (work / "libfuzzer-corpus").mkdir(exist_ok=True)
    atheris.Setup(args, lambda data: rec(bytes(data)))
    atheris.Fuzz()


def run_atheris(target, work: Path, corpus: Path, seconds: float) -> dict:
    seed_dir = work / "seeds"
    seed_dir.mkdir(exist_ok=True)
    target.make_seeds(seed_dir)  # libFuzzer's seed corpus: every file in the folder
    total = {"inputs": 0, "outcomes": collections.Counter(), "failures": {}}
    stop = time.monotonic() + seconds
    run = 0
    while (left := int(stop - time.monotonic())) > 5:
        run += 1
        stats_file = work / f"stats-{run}.json"
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--seconds",
                str(left),
                "--work",
                str(work),
                "--corpus",
                str(corpus),
                "--seed-dir",
                str(seed_dir),
                "--stats",
                str(stats_file),
            ]
        )
        for art in list(work.glob("timeout-*")) + list(work.glob("oom-*")) + list(work.glob("crash-*")):
            kind = art.name.split("-")[0]
            dest = corpus / target.input_name(art.read_bytes(), f"libfuzzer-{kind}")
            corpus.mkdir(exist_ok=True)
            art.rename(dest)
            print(f"FAILURE libfuzzer-{kind} -> {dest}", flush=True)
            total["failures"][f"libfuzzer-{kind}-{run}"] = (dest.stat().st_size, dest.name)
        if stats_file.exists():
            s = json.loads(stats_file.read_text())
            total["inputs"] += s["inputs"]
            total["outcomes"].update(s["outcomes"])
            total["failures"].update(s["failures"])
        if child.returncode not in (0, 1, 70, 71, 77):  # libFuzzer: done, crash, timeout, OOM-ish
            print(f"fuzzer child exited with {child.returncode}", file=sys.stderr)
    return total


def report(stats: dict, seconds: float, engine: str) -> None:
    outcomes = collections.Counter(stats["outcomes"])
    print(f"\n{engine}: {stats['inputs']:,} inputs in {seconds:.0f} s")
    for kind, n in outcomes.most_common(40):
        print(f"  {n:8,}  {kind}")
    print(f"failures: {len(stats['failures'])}")
    for sig, (size, name) in sorted(stats["failures"].items()):
        print(f"  {sig}: tests/fuzz_corpus/{name} ({size} bytes)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto")
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="where failing inputs are saved")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--seed-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        atheris_child(args.seed_dir, args.work, args.corpus, int(args.seconds), args.stats)
        return 0
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if importlib.util.find_spec("atheris") else "hypothesis"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-") as tmp:
        work = Path(tmp)
        if engine == "atheris":
            target = load_target()
            stats = run_atheris(target, work, args.corpus, args.seconds)
        else:
            rec = run_hypothesis(load_target(), work, args.corpus, args.seconds)
            stats = {"inputs": rec.inputs, "outcomes": rec.outcomes, "failures": rec.failures}
    report(stats, time.monotonic() - t0, engine)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
