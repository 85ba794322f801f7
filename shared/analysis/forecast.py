"""How fast will a model decode on this machine? (`moe-pipe doctor`)

shared/analysis/fit.py says whether the model fits and how often its cache
hits, from the header alone; this module times what that cannot know and
does the per-token arithmetic:

    measure_reads(mf, lanes, seconds)    -> ReadFigures  O_DIRECT GB/s at this model's expert size
    measure_kernels(classes, threads, s) -> {(key, threads): weights/s}
    measure_read_tax(mf, class, threads, lanes) -> s   compute lost per GB read beside it
    decode_speed(...)                    -> Speed        pure: the per-token arithmetic below
    forecast(mf, cfg, ...)               -> dict         all of it, one flat record (docs/cli.md ## doctor)

Per decoded token (L layers, k experts per token, h the decode hit rate):

    step    = a decode step of the model's forward pass on stand-in weights (standin.py)
    experts = expert kernels (weights / measured weights/s) + read bytes × compute lost per GB
              read (measure_read_tax: a VM's disk served on the guest's cores; a cache's
              first fill adds the system CPU its fresh pages take)
    dense   = step − expert kernels + PER_TOKEN_S;  compute = dense + experts
    a layer = j of its k lookups miss, P(j) binomial in 1 − h: its j reads keep min(j, lanes)
              lanes busy at their measured rate, read(j) = j × one expert / GB/s(min(j, lanes));
              it costs experts/L when j = 0, else max(experts/L, read(j) + experts/(L·k))
              + PER_LAYER_WIRE_S
    io      = L × Σ_j P(j) read(j)
    wall    = dense + L × Σ_j P(j) × (a layer with j misses)
              (dense + experts when nothing is read: every expert cached)
    tok/s   = 1 / wall

The wall is the pipeline's own shape, layer by layer: attention, norms and
routing run before the layer's misses are known, so nothing is read under
them (no prefetch in decode); then the hits are computed while the misses are
read, and each miss is computed as it lands, so the layer ends one expert's
compute after its last read (or when the experts are done, if reads were
shorter); and a layer with a miss sends its requests to the reader and hears
back (one trip), a layer without one does not. A layer's one or two misses
read at the rate of one or two lanes, not of four: on the 2026-12-01 protocol
the steady qwen30b token had 7 misses spread over 48 layers.
`max(compute, io)` times one fitted constant fits one regime and misses the
other by 30-40 % (docs/benchmarks.md, "doctor").
"""

from __future__ import annotations

import math
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .. import speed
from ..config import Config
from ..cores import Cores, choose_threads
from ..experts.budget import MemoryProbe
from .fit import HitRate, KernelClass, affordable_context, hit_rate, limited_probe, memory_fit, model_footprint

# The warm-up figure: the mean wall of a reply's tokens 2..50 (shared/speed.py), the cache
# filling from cold, at the hit rate a replay of the trace's first 49 decoded tokens gives.
WARMUP_TOKENS = len(speed.WARMUP_TOKENS)

# One layer's trip to the reader and back (request, replies, slab lookups):
# the wire_ms + mgmt_ms columns per layer, median of streamed decode on this
# machine, 0.78 + 0.43 ms (qwen30b-shape, 8 layers) and 0.78 + 0.32 ms
# (gptoss120b-shape, 16 layers).
PER_LAYER_WIRE_S = 1.15e-3
# What the pipeline adds to each token besides the forward pass (its telemetry record and the
# token's messages): the tiny model's steady token streamed against in process (docs/cli.md § doctor).
PER_TOKEN_S = 0.3e-3
# decode_speed without a timed step: time per layer outside the quant kernels (attention's numpy work, norms, RoPE,
# routing, dispatch): docs/benchmarks.md, decode of the 8-layer qwen30b-shape
# model minus the time inside the kernels = 2.9-3.1 ms per token, /8 layers.
PER_LAYER_OVERHEAD_S = 3.0e-3 / 8
# A cache under twice one token's working set evicts nearly every expert
# before its next use: the run is memory-bound whatever the disk does.
FLOOR_MARGIN = 2.0
# When the file is mostly holes (a header-only test model), reads measure
# nothing; docs/benchmarks.md's O_DIRECT figure for this disk stands in.
ASSUMED_READ_GBPS = 1.1
READ_LANES = (1, 2, 4)
# Kernels read their weights from DRAM in decode (each matrix is used once per
# token): rotate through this many bytes per class, twice the 32 MB L3.
ROTATE_BYTES = 64 << 20
MAX_MATRIX_BYTES = 8 << 20  # one measured matrix; a taller one (the output head) is measured cut to this
FRESH_BYTES = 256 << 20  # read into never-used slabs to price a cache's first fill
WINDOW_BYTES = 4 << 20  # one timing window: ~1 ms of kernel, shorter than a scheduler slice
TAX_TURNS = 2  # measure_read_tax: turns alone and beside reads, alternating (the host drifts)


# ---------------------------------------------------------------- measuring


@dataclass(frozen=True)
class ReadFigures:
    gbps: dict[int, float]  # lanes -> GB/s (1e9 B/s) of disk bytes over wall time, into slabs used before
    direct: bool  # O_DIRECT (False: the buffered fallback, which may measure the page cache)
    source: str  # measured | assumed
    note: str
    # Into slabs never used (a cache's first fill): the kernel gives each page on the read's
    # way in (measured on this VM: half the rate, 1.9 s of system CPU for 2 GiB against 0.1)
    fresh_gbps: float | None = None  # at the most lanes measured
    fresh_cpu_s_per_gb: float = 0.0  # system CPU seconds a GB read into fresh slabs costs beyond a reused slab's


def is_sparse(paths: Sequence[str]) -> bool:
    """Mostly holes (a header-only model): reading it measures no disk."""
    st = [os.stat(p) for p in paths]
    return sum(s.st_blocks * 512 for s in st) < 0.5 * sum(s.st_size for s in st)


def measure_reads(mf, lanes: Sequence[int] = READ_LANES, seconds: float = 1.5, seed: int | None = None, rounds: int = 4) -> ReadFigures:
    """Random experts of the model read the way the reader does (ExpertFiles.read_expert into
    the slabs of a shared-memory slab arena, one per lane), `seconds` split over the lane counts,
    each in `rounds` short rounds; the best round counts (lanes are threads: on two busy
    cores a round can lose whole scheduler slices)."""
    from ..experts.directio import ExpertFiles
    from ..experts.shm import SlabArena, segment_name

    paths = list(mf.gguf.paths)
    if getattr(mf.gguf, "header_only", False):
        return ReadFigures(
            {n: ASSUMED_READ_GBPS for n in lanes},
            True,
            "assumed",
            f"the file is not here yet, only its header: {ASSUMED_READ_GBPS} GB/s assumed (docs/benchmarks.md, O_DIRECT on this disk)",
        )
    if is_sparse(paths):
        return ReadFigures(
            {n: ASSUMED_READ_GBPS for n in lanes},
            True,
            "assumed",
            f"the file is mostly holes (header-only): {ASSUMED_READ_GBPS} GB/s assumed (docs/benchmarks.md, O_DIRECT on this disk)",
        )
    lay = mf.layout
    # a new seed each run: experts a previous run read may sit in the host's disk cache
    rng = random.Random(seed)
    out = {}
    # the arena is unlinked on the way out, whatever happens
    with ExpertFiles(paths, align=lay.align) as ef, SlabArena.create(segment_name("doctor-reads"), max(lanes), lay.slab_bytes) as arena:

        def pick_work() -> list:
            return random_experts(mf, rng)

        for n in lanes:
            best = 0.0
            for _ in range(rounds):
                work = pick_work()
                nbytes, secs = read_lanes(ef, arena, work, n, seconds / len(lanes) / rounds)
                best = max(best, nbytes / secs / 1e9)
            out[n] = best
        direct = ef.direct
        n = max(lanes)
        reused, _ = cpu_per_gb(lambda: read_lanes(ef, arena, pick_work(), n, FRESH_BYTES / (out[n] * 1e9)))
        fresh_cpu, fresh_gbps = measure_fresh_reads(ef, lay, pick_work(), n)
    note = "measured with O_DIRECT" if direct else f"measured buffered ({ef.fallback_reason}): may be the page cache, not the disk"
    return ReadFigures(out, direct, "measured", note, fresh_gbps, max(0.0, fresh_cpu - reused))


def random_experts(mf, rng: random.Random, n: int = 2048) -> list:
    """The extents of `n` experts drawn at random over the model's MoE layers: reads' work."""
    spec, lay = mf.spec, mf.layout
    return [lay.expert_extents(rng.choice(spec.moe_layers), rng.randrange(spec.n_expert)) for _ in range(n)]


def cpu_per_gb(read: Callable[[], tuple[int, float]]) -> tuple[float, float]:
    """(system CPU seconds of this process per GB, GB/s) of what `read()` reads."""
    t0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    nbytes, secs = read()
    gb = max(nbytes / 1e9, 1e-9)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_stime - t0) / gb, gb / secs


def measure_fresh_reads(ef, lay, work: list, lanes: int) -> tuple[float, float]:
    """(system CPU s per GB, GB/s) of experts read by `lanes` lanes into slabs never used
    before, FRESH_BYTES of them: what a cache's first fill pays."""
    from ..experts.shm import SlabArena, segment_name

    items = work[: max(2 * lanes, FRESH_BYTES // lay.slab_bytes)]
    with SlabArena.create(segment_name("doctor-fresh"), len(items), lay.slab_bytes) as arena:
        return cpu_per_gb(lambda: read_lanes(ef, arena, items, lanes, math.inf, fresh=True))  # every item


def read_lanes(ef, arena, work, lanes: int, seconds: float, latencies: list[float] | None = None, fresh: bool = False) -> tuple[int, float]:
    """Lanes (threads) pull experts off a shared list until the time is up; (bytes, seconds).
    Each lane reads into its own slab again and again, or (`fresh`) item i into slab i, a
    slab never used before. With `latencies`, each read's seconds are appended to it
    (bench/bench_reads.py)."""
    lock, nxt, stop = threading.Lock(), [0], time.perf_counter() + seconds
    totals = [0] * lanes
    lat: list[list[float]] = [[] for _ in range(lanes)]

    def lane(k: int) -> None:
        own = arena.slab(k)
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(work) or (i >= lanes and time.perf_counter() >= stop):  # one read each, at least
                return
            t = time.perf_counter()
            totals[k] += ef.read_expert(work[i], arena.slab(i) if fresh else own).disk_bytes
            lat[k].append(time.perf_counter() - t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=lane, args=(k,)) for k in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if latencies is not None:
        latencies.extend(x for per_lane in lat for x in per_lane)
    return sum(totals), max(time.perf_counter() - t0, 1e-9)


def measure_kernels(
    classes: Sequence[KernelClass], threads: Sequence[int], seconds: float = 2.0, rotate_bytes: int = ROTATE_BYTES
) -> dict[tuple[str, int], float]:
    """Weights/s of `quant.matvec` per class and thread count, on random valid blocks of the
    class's type and shape, rotating through `rotate_bytes` of copies (past the L3 by default:
    in decode each matrix is read from DRAM once per token). Timed in windows of about
    WINDOW_BYTES; the rate is the best window (timeit's rule: slower ones are interference):
    on two shared cores another process stalls a 2-thread call by whole scheduler slices."""
    from .. import quant

    rng = np.random.default_rng(0)
    before = quant.get_threads()
    per = seconds / max(1, len(classes) * len(threads))
    out = {}
    try:
        for c in classes:
            mats = _ClassMatrices(c, rotate_bytes, rng)
            window = max(1, WINDOW_BYTES // mats.matrix_bytes)
            for n in threads:
                quant.set_threads(n)
                times: list[float] = []
                stop = time.perf_counter() + per
                while not times or time.perf_counter() < stop:
                    t0 = time.perf_counter()
                    mats.run(window)
                    times.append((time.perf_counter() - t0) / window)  # seconds per matrix
                out[(c.key, n)] = mats.weights / min(times)
            del mats
    finally:
        quant.set_threads(before)
    return out


class _ClassMatrices:
    """Random valid blocks of a kernel class's type and shape (cut to MAX_MATRIX_BYTES),
    copied to fill `rotate_bytes`, and `quant.matvec` over them one after another."""

    def __init__(self, c: KernelClass, rotate_bytes: int, rng: np.random.Generator):
        from .. import quant
        from ..quant.blocks import random_blocks

        self.qt = quant.qtype_from_name(c.qtype)
        row_bytes = quant.block_format(self.qt).row_bytes(c.cols)
        rows = max(1, min(c.rows, MAX_MATRIX_BYTES // row_bytes))
        one = random_blocks(self.qt, rows * c.cols, rng).reshape(rows, row_bytes)
        self.n_mats = max(1, rotate_bytes // one.nbytes)
        self.mats = np.tile(one, (self.n_mats, 1)).reshape(self.n_mats, rows, row_bytes)  # [M, R, row]: distinct memory
        self.matrix_bytes, self.weights = one.nbytes, rows * c.cols
        self.x = rng.standard_normal(c.cols, dtype=np.float32)  # [C]
        self.y = np.empty(rows, np.float32)  # [R]
        self.i, self.matvec = 0, quant.matvec
        self.run(1)  # compile / load from numba's cache outside any timing

    def run(self, n: int) -> None:
        for _ in range(n):
            self.matvec(self.qt, self.mats[self.i], self.x, out=self.y)
            self.i = (self.i + 1) % self.n_mats


def measure_read_tax(mf, c: KernelClass, threads: int, lanes: int, seconds: float = 1.0, seed: int | None = None) -> float:
    """Seconds of compute lost per GB read beside it: class `c`'s kernel on `threads` threads,
    timed in turns alone and while `lanes` lanes read random experts of the model (as
    measure_reads does). Where a read costs the cores nothing (DMA) it is ~0; a VM whose host
    serves its disk on the guest's cores loses a share of the compute rate while reads are
    under way (docs/benchmarks.md § Reads cost compute on this host). Throughput over the
    whole turn, not the best window: the loss is the average over the reads' time. 0 for a
    file with nothing to read (header-only, mostly holes)."""
    from .. import quant
    from ..experts.directio import ExpertFiles
    from ..experts.shm import SlabArena, segment_name

    paths = list(mf.gguf.paths)
    if getattr(mf.gguf, "header_only", False) or is_sparse(paths):
        return 0.0
    lay = mf.layout
    rng = random.Random(seed)
    mats = _ClassMatrices(c, ROTATE_BYTES, np.random.default_rng(0))
    before = quant.get_threads()
    turn = seconds / (2 * TAX_TURNS)
    done = {False: 0.0, True: 0.0}  # matrices a second, summed over turns: alone, beside reads
    read_bytes = read_s = 0.0
    quant.set_threads(threads)
    try:
        with ExpertFiles(paths, align=lay.align) as ef, SlabArena.create(segment_name("doctor-tax"), lanes, lay.slab_bytes) as arena:
            for _ in range(TAX_TURNS):
                for beside in (False, True):
                    result: list[tuple[int, float]] = []
                    if beside:
                        work = random_experts(mf, rng)
                        reader = threading.Thread(target=lambda w=work, out=result: out.append(read_lanes(ef, arena, w, lanes, turn)))
                        reader.start()
                    n, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < turn:
                        mats.run(1)
                        n += 1
                    done[beside] += n / (time.perf_counter() - t0)
                    if beside:
                        reader.join()
                        read_bytes += result[0][0]
                        read_s += result[0][1]
    finally:
        quant.set_threads(before)
    if read_bytes <= 0 or done[False] <= 0:
        return 0.0
    lost = max(0.0, 1.0 - done[True] / done[False])  # the share of compute's rate the reads took
    return lost / (read_bytes / 1e9 / read_s)  # seconds of compute lost per second of reads, over GB/s


def time_steps(mf, top_k: int, points: Sequence[tuple[int, float]]) -> dict:
    """{(threads, hit %): StepTime} of the model's forward pass on stand-in weights
    (standin.py), its misses computed one by one; the tensor table is all it reads, so a
    header-only file (before the download) is timed as the whole file is."""
    from .standin import StandIn

    stand_in = StandIn(mf, top_k)
    return {(n, h): stand_in.step(n, miss=1.0 - h / 100.0) for n, h in dict.fromkeys(points)}


def compute_cores(cfg: Config) -> Cores:
    """The compute threads a run started now would use, and why (shared/cores.py)."""
    from .. import quant

    cores = choose_threads(cfg.compute.threads, most=quant.most_threads())
    return replace(cores, threads=min(cores.threads, quant.most_threads()))


def compute_threads(cfg: Config) -> int:
    return compute_cores(cfg).threads


# ---------------------------------------------------------------- the arithmetic


@dataclass(frozen=True)
class Speed:
    compute_s: float  # kernels + per-layer overhead
    kernel_s: float
    io_s: float
    wall_s: float
    tok_s: float
    bottleneck: str  # flash | compute | memory
    overlap_factor: float  # wall / max(compute, io): what the pipeline's shape adds


def kernel_seconds(classes: Sequence[KernelClass], rates: Mapping[str, float], role: str | None = None) -> float:
    """Seconds per token in the kernels: each class's weights at its rate (weights/s, by class key)."""
    return sum(c.weights_per_token / rates[c.key] for c in classes if role is None or c.role == role)


def lane_rate(gbps: float | Mapping[int, float], busy: int) -> float:
    """GB/s of `busy` lanes reading at once: the measured figure of that many lanes, the
    nearest below it between measured counts (a float: the same at every count)."""
    if not isinstance(gbps, Mapping):
        return gbps
    below = [n for n in gbps if n <= busy]
    return gbps[max(below)] if below else gbps[min(gbps)]


def misses_in_a_layer(k: int, miss: float) -> list[float]:
    """P(j of a layer's k lookups miss), j = 0..k: each lookup misses alike, apart from the others."""
    return [math.comb(k, j) * miss**j * (1.0 - miss) ** (k - j) for j in range(k + 1)]


def decode_speed(
    classes: Sequence[KernelClass],
    rates: Mapping[str, float],
    *,
    n_layer: int,
    top_k: int,
    hit_pct: float,
    read_bytes_per_token: int,
    read_gbps: float | Mapping[int, float],
    lanes: int = 4,
    at_floor: bool = False,
    overhead_s: float = PER_LAYER_OVERHEAD_S,
    wire_s: float = PER_LAYER_WIRE_S,
    read_cpu_s_per_gb: float = 0.0,
    step_s: float | None = None,
    token_s: float = 0.0,
) -> Speed:
    """One decoded token's compute, io and wall time (module docstring). `read_bytes_per_token`
    is what a token reads with no cache (k × page-rounded experts, all layers); `read_gbps`
    the read rate by lanes busy at once (a layer's j misses keep min(j, lanes) lanes busy);
    `read_cpu_s_per_gb` the CPU its reads take from compute's cores (pages given to a
    cache's first fill), counted with the experts' compute. `step_s`, a decode step timed
    on stand-in weights (shared/analysis/standin.py), sets everything but the experts'
    kernels (it replaces the dense kernels + n_layer × overhead_s estimate); `token_s` is
    the pipeline's own per-token work."""
    kernels = kernel_seconds(classes, rates)
    expert_kernels = kernel_seconds(classes, rates, "expert")
    miss = 1.0 - hit_pct / 100.0
    read_bytes = miss * read_bytes_per_token
    experts = expert_kernels + read_bytes / 1e9 * read_cpu_s_per_gb
    dense_kernels = kernels - expert_kernels
    dense = (dense_kernels + n_layer * overhead_s if step_s is None else max(step_s - expert_kernels, dense_kernels)) + token_s
    compute = dense + experts
    k = max(1, top_k)
    one_read = read_bytes_per_token / (k * n_layer) / 1e9  # GB: one expert, the layers' mean
    p = misses_in_a_layer(k, miss)
    # a layer's reads: j misses on min(j, lanes) lanes at their measured rate
    read_s = [j * one_read / lane_rate(read_gbps, min(j, lanes)) for j in range(k + 1)]
    io = n_layer * sum(pj * r for pj, r in zip(p, read_s))
    if io > 0:
        # a layer without a miss costs its experts; with j, its hits compute under the reads and
        # the last miss after its read, then the layer's trip to the reader
        e = experts / n_layer
        layer = p[0] * e + sum(p[j] * (max(e, read_s[j] + e / k) + wire_s) for j in range(1, k + 1))
        wall = dense + n_layer * layer
    else:
        wall = compute
    bottleneck = "memory" if at_floor else ("flash" if io > compute else "compute")
    return Speed(compute, kernels, io, wall, 1.0 / wall, bottleneck, wall / max(compute, io))


def _gws(classes, rates, role) -> float | None:
    """Weights/s over all classes of a role (weights-weighted harmonic mean), in G."""
    w = sum(c.weights_per_token for c in classes if c.role == role)
    return round(w / kernel_seconds(classes, rates, role) / 1e9, 2) if w else None


# ---------------------------------------------------------------- all of it


def forecast(
    mf,
    cfg: Config,
    *,
    mem_limit_mb: float | None = None,
    seconds: float = 4.0,
    memory: MemoryProbe | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> dict:
    """The doctor's record: one flat dict (keys documented in docs/cli.md, ## doctor).
    About `seconds` go to measuring: 40 % reads, 60 % kernels, then a quarter more to what
    reads cost the compute beside them (measure_read_tax). `on_stage(text)` hears
    what it is doing (a first run compiles the kernels it measures: seconds of silence else)."""
    stage = on_stage or (lambda text: None)
    t0 = time.perf_counter()
    stage("reading the model's header; replaying a route trace for the hit rate")
    footprint = model_footprint(mf, cfg)
    fit = memory_fit(footprint, cfg, limited_probe(mem_limit_mb, memory))
    policy = cfg.cache.policy
    hit = hit_rate(footprint, fit.n_slabs, policy) if fit.fits else None
    warm = hit_rate(footprint, fit.n_slabs, policy, decode_tokens=WARMUP_TOKENS) if fit.fits else None
    stage(f"measuring this disk's reads ({0.4 * seconds:.1f} s)")
    reads = measure_reads(mf, seconds=0.4 * seconds)
    lanes = max([n for n in reads.gbps if n <= cfg.io.io_threads] or [min(reads.gbps)])
    cores = compute_cores(cfg)
    threads = cores.threads
    # a model whose active weights fit in the L3 (the tiny ones) decodes from cache: measure it so
    rotate = min(ROTATE_BYTES, footprint.active_bytes_per_token)
    stage(f"measuring the kernels ({0.6 * seconds:.1f} s; a first run compiles them first)")
    rates = measure_kernels(footprint.classes, sorted({1, threads}), seconds=0.6 * seconds, rotate_bytes=rotate)
    experts = [c for c in footprint.classes if c.role == "expert"]
    stage(f"measuring what reads cost the compute beside them ({0.25 * seconds:.1f} s)")
    tax = (
        measure_read_tax(mf, (experts or list(footprint.classes))[0], threads, lanes, seconds=0.25 * seconds) if footprint.classes else 0.0
    )
    stage("timing decode steps of the model's own forward pass on stand-in weights")
    h_steady, h_warm = (hit.pct if hit else 100.0), (warm.pct if warm else 100.0)
    steps = time_steps(mf, footprint.top_k, [(threads, h_steady), (threads, h_warm), (1, h_steady)])
    at_n = {c.key: rates[(c.key, threads)] for c in footprint.classes}
    at_1 = {c.key: rates[(c.key, 1)] for c in footprint.classes}
    read_per_token = footprint.top_k * sum(footprint.read_bytes_per_expert)
    at_floor = (not fit.fits) or fit.budget.bytes < FLOOR_MARGIN * footprint.floor_bytes

    def speed_at(rates: Mapping[str, float], h: HitRate | None = hit, gbps: Mapping[int, float] = reads.gbps, cpu: float = tax) -> Speed:
        step = steps.get((threads if rates is at_n else 1, h.pct if h else 100.0))
        return decode_speed(
            footprint.classes,
            rates,
            n_layer=footprint.n_layer,
            top_k=footprint.top_k,
            hit_pct=h.pct if h else 0.0,
            read_bytes_per_token=read_per_token,
            read_gbps=gbps,
            lanes=lanes,
            at_floor=at_floor,
            read_cpu_s_per_gb=cpu,
            step_s=None if step is None else step.seconds,
            token_s=PER_TOKEN_S,
        )

    def warmup_speed(rates: Mapping[str, float], h: HitRate | None) -> Speed:
        """A reply's tokens 2..50: the misses land in slabs never used until the cache has been
        filled once, at the fresh-page rate and CPU (ReadFigures), then in reused ones."""
        if h is None or reads.fresh_gbps is None:
            return speed_at(rates, h)
        fill = (1.0 - h.pct / 100.0) * read_per_token * WARMUP_TOKENS  # bytes the warm-up reads
        fresh = min(1.0, fit.n_slabs * footprint.slab_bytes / fill) if fill > 0 else 1.0  # share of them into fresh slabs
        slower = reads.fresh_gbps / reads.gbps[max(reads.gbps)]  # fresh slabs against used ones, at the most lanes
        gbps = {n: g / (fresh / slower + (1.0 - fresh)) for n, g in reads.gbps.items()}
        return speed_at(rates, h, gbps, tax + fresh * reads.fresh_cpu_s_per_gb)

    speed = speed_at(at_n)
    speed_1t = speed_at(at_1)  # -t 1: faster when other processes hold the cores
    warmup = warmup_speed(at_n, warm)  # tokens 2..WARMUP_TOKENS+1 of a reply: the cache filling
    b = fit.budget
    return {
        "model": footprint.path,
        "arch": footprint.arch,
        "n_layer": footprint.n_layer,
        "n_expert": footprint.n_expert,
        "n_expert_used": footprint.top_k,
        "n_expert_used_model": mf.spec.n_expert_used,
        "ctx_size": footprint.ctx_size,
        "ctx_train": mf.spec.n_ctx_train,
        "file_bytes": footprint.file_bytes,
        "dense_bytes": footprint.dense_bytes,
        "nextn_bytes": footprint.nextn_bytes,
        "expert_bytes": max(footprint.expert_bytes),
        "layer_expert_bytes": max(footprint.expert_bytes) * footprint.n_expert,
        "expert_bytes_total": footprint.expert_bytes_total,
        "slab_bytes": footprint.slab_bytes,
        "kv_bytes": footprint.kv_bytes,
        "parallel": footprint.parallel,
        "kv_pool": cfg.kv_pool_tokens,
        "kv_ring_layers": footprint.kv_ring_layers,
        "kv_ring_rows": footprint.kv_ring_rows,
        "ctx_affordable": affordable_context(mf.spec, cfg.compute.kv_type, fit.available_bytes),
        "floor_bytes": footprint.floor_bytes,
        "routed_bytes_per_token": footprint.routed_bytes_per_token,
        "active_bytes_per_token": footprint.active_bytes_per_token,
        "mem_limit_mb": mem_limit_mb,
        "available_bytes": fit.available_bytes,
        "available": fit.available_text,
        "reserve_bytes": fit.reserve_bytes,
        "need_bytes": fit.need_bytes,
        "budget_bytes": b.bytes,
        "budget_mb": round(b.mb, 1),
        "budget": b.description,
        "n_slabs": fit.n_slabs,
        "n_slabs_lent": fit.lent_slabs,
        "fits": fit.fits,
        "resident": fit.resident,
        "refusal": fit.refusal,
        "limit_that_works_mb": fit.limit_that_works_mb,
        "policy": policy,
        "hit_pct": None if hit is None else round(hit.pct, 2),
        "hit_source": None if hit is None else hit.source,
        "hit_note": None if hit is None else hit.note,
        "read_gbps_1": _r(reads.gbps.get(1)),
        "read_gbps_2": _r(reads.gbps.get(2)),
        "read_gbps_4": _r(reads.gbps.get(4)),
        "read_lanes": lanes,
        "read_gbps": _r(reads.gbps[lanes]),
        "read_gbps_fresh": _r(reads.fresh_gbps),
        "read_cpu_s_per_gb_fresh": _r(reads.fresh_cpu_s_per_gb),
        "read_tax_s_per_gb": _r(tax),
        "read_source": reads.source,
        "direct_io": reads.direct,
        "read_note": reads.note,
        "threads": threads,
        "threads_reason": cores.reason,
        "expert_gws_1t": _gws(footprint.classes, at_1, "expert"),
        "expert_gws": _gws(footprint.classes, at_n, "expert"),
        "dense_gws_1t": _gws(footprint.classes, at_1, "dense"),
        "dense_gws": _gws(footprint.classes, at_n, "dense"),
        "step_ms": round(steps[(threads, h_steady)].seconds * 1e3, 2),
        "step_ms_1t": round(steps[(1, h_steady)].seconds * 1e3, 2),
        "overlap_factor": speed.overlap_factor,
        "kernel_ms": round(speed.kernel_s * 1e3, 2),
        "compute_ms": round(speed.compute_s * 1e3, 2),
        "io_ms": None if hit is None else round(speed.io_s * 1e3, 2),
        "tok_s": None if hit is None else round(speed.tok_s, 2),
        "bottleneck": speed.bottleneck,
        "tok_s_1t": None if hit is None else round(speed_1t.tok_s, 2),
        "warmup_hit_pct": None if warm is None else round(warm.pct, 2),
        "warmup_ms": None if warm is None else round(warmup.wall_s * 1e3, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cores": os.cpu_count(),
        "measure_s": round(time.perf_counter() - t0, 2),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
