"""Will a model fit this machine, and how fast will it decode? (`moe-pipe doctor`)

    model_facts(mf, cfg)                 -> ModelFacts   the GGUF header alone: sizes, floor, kernel work
    memory_fit(facts, cfg, memory)       -> MemoryFit    the auto budget (resolve_budget) and fits / refuses
    limited_probe(mem_limit_mb)          -> MemoryProbe  this machine as if in a new cgroup of that limit
    hit_rate(facts, n_slots, policy)     -> HitRate      a shipped phone trace replayed, or a stated fallback
    measure_reads(mf, lanes, seconds)    -> ReadFigures  O_DIRECT GB/s at this model's expert size
    measure_kernels(classes, threads, s) -> {(key, threads): weights/s}
    decode_speed(...)                    -> Speed        pure: the per-token arithmetic below
    forecast(mf, cfg, ...)               -> dict         all of it, one flat record (docs/cli.md ## doctor)

Per decoded token (L layers, k experts per token, h the decode hit rate):

    dense   = dense kernels (weights / measured weights/s) + L × PER_LAYER_OVERHEAD_S
    experts = expert kernels, the same way;  compute = dense + experts
    io      = (1 − h) × k × Σ_layers page-rounded expert bytes / read bandwidth
    wall    = dense + L × (max(experts/L, io/L + experts/(L·k)) + PER_LAYER_WIRE_S)
              (dense + experts when nothing is read: every expert cached)
    tok/s   = 1 / wall

The wall is the pipeline's own shape, layer by layer: attention, norms and
routing run before the layer's misses are known, so nothing is read under
them (no prefetch); then the hits are computed while the misses are read,
and each miss is computed as it lands, so the layer ends one expert's
compute after its last read (or when the experts are done, if reads were
shorter); and each layer's requests and replies cross the reader once.
`max(compute, io)` times a constant fitted one regime and missed the other
by 30-40 % (docs/benchmarks.md, "doctor").

A kernel class is one (quant type, shape) the decode multiplies: each expert
projection, and each dense matrix family grouped by (type, columns). The
token embedding is a row lookup, not a product, so it is left out (unless the
output head is tied to it).

The hit rate comes from the BigMoeOnEdge phone traces shipped in
data/traces/ when the model's architecture and expert count match one
(qwen3moe × 128 → Qwen3-30B-A3B, gpt-oss × 128 → gpt-oss-120b). The cache is
replayed at the same number of slots *per layer* as the model's budget gives:
a model with fewer layers than the trace replays the trace's first n_layer
layers at its own slot count; a deeper model replays the whole trace at its
slots × trace layers / model layers. The trace's top-k (6 and 2, reduced on
the phone) is kept as recorded and the slot count is not rescaled for the
model's own top-k: under the independent-reference (Che) approximation of
an LRU-like cache, scaling every expert's request rate by the same factor
rescales time and leaves each hit probability unchanged, so hit % depends on
slots and the popularity spread, not on k. A model whose architecture has no
trace but whose expert count matches one (gemma4 × 128) replays that trace as
a proxy (source "proxy"): another trained router over as many experts,
nearer a trained router's reuse than uniform routing, which no trained
router shows. On the gemma26b-shape file at 10,673 MiB (a synthetic router,
not calibrated on a Gemma recording) uniform routing forecast 48 % hits and
the Qwen proxy 96 %, against 79 % measured (docs/benchmarks.md § The
protocol (2026-12-01)). Without any trace of
that expert count the fallback is slots / (layers × experts): exact for
uniform routing, which a real router beats, so it is a pessimistic guess and
flagged as one.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..config import Config
from ..errors import ConfigError, UserError
from ..experts.budget import (
    RESIDENT_DENSE,
    RUN_ROLES,
    Budget,
    CacheFloor,
    CgroupLimit,
    MemoryProbe,
    check_floor,
    engine_bytes,
    probe_memory,
    resolve_budget,
)
from ..gguf.layout import aligned_bytes

MiB = 1 << 20
TRACE_DIR = Path(__file__).parent.parent / "data" / "traces"
# (arch, n_expert) -> shipped trace (data/traces/README.md says what each one recorded)
TRACES = {("qwen3moe", 128): "qwen.route.csv", ("gpt-oss", 128): "gptoss.route.csv"}
# The warm-up figure: the mean wall of a reply's tokens 2..50, the cache filling from
# cold (bench/bench_vs_llama.py reports the same window), at the hit rate a replay of
# the trace's first 49 decoded tokens gives.
WARMUP_TOKENS = 49

# One layer's trip to the reader and back (request, replies, slab lookups):
# the wire_ms + mgmt_ms columns per layer, median of streamed decode on this
# machine, 0.78 + 0.43 ms (qwen30b-shape, 8 layers) and 0.78 + 0.32 ms
# (gptoss120b-shape, 16 layers).
PER_LAYER_WIRE_S = 1.15e-3
# Time per layer outside the quant kernels (attention's numpy work, norms, RoPE,
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
WINDOW_BYTES = 4 << 20  # one timing window: ~1 ms of kernel, shorter than a scheduler slice


# ---------------------------------------------------------------- the header


@dataclass(frozen=True)
class KernelClass:
    """One (role, type, shape) the decode multiplies, and how many weights of it per token."""

    role: str  # expert | dense
    qtype: str
    rows: int  # the tallest matrix of the class (measured cut to MAX_MATRIX_BYTES)
    cols: int
    weights_per_token: int

    @property
    def key(self) -> str:
        return f"{self.role} {self.qtype} {self.rows}x{self.cols}"


@dataclass(frozen=True)
class ModelFacts:
    path: str
    arch: str
    n_layer: int
    n_expert: int
    top_k: int
    ctx_size: int
    file_bytes: int
    dense_bytes: int
    expert_bytes: tuple[int, ...]  # one expert, per layer
    slab_bytes: int
    kv_bytes: int
    classes: tuple[KernelClass, ...]
    read_bytes_per_expert: tuple[int, ...]  # page-rounded disk bytes of one expert, per layer
    engine_bytes: int = 0  # what `run`'s own processes take (budget.engine_bytes): auto leaves at least this

    @property
    def expert_bytes_total(self) -> int:
        return sum(self.expert_bytes) * self.n_expert

    @property
    def moe_layers(self) -> int:
        """Layers with experts (leading dense layers have none)."""
        return sum(1 for b in self.expert_bytes if b)

    @property
    def floor(self) -> CacheFloor:
        """One token's working set in slabs: the smallest cache that runs (the run's own check)."""
        return CacheFloor(self.moe_layers, self.top_k, self.slab_bytes)

    @property
    def floor_bytes(self) -> int:
        return self.floor.bytes

    @property
    def routed_bytes_per_token(self) -> int:
        return self.top_k * sum(self.expert_bytes)

    @property
    def active_bytes_per_token(self) -> int:
        """Weights one token touches: the dense set and k experts per layer."""
        return self.dense_bytes + self.routed_bytes_per_token

    @property
    def all_experts_slots(self) -> int:
        return self.moe_layers * self.n_expert


def model_facts(mf, cfg: Config) -> ModelFacts:
    """Everything the forecast needs from the model, read from its header (no weight is touched)."""
    from ..gguf.spec import kv_cache_bytes  # the KV size the pipeline allocates

    spec, layout = mf.spec, mf.layout
    top_k = cfg.compute.top_k or spec.n_expert_used
    if cfg.compute.route_replay:  # a trace-driven run routes the trace's k experts a layer, not the model's
        from ..model.trace import read_trace_header

        top_k = read_trace_header(cfg.compute.route_replay).n_expert_used
    if top_k > spec.n_expert:
        raise UserError(f"--top-k {top_k} is out of range: {mf.gguf.path} has {spec.n_expert} experts per layer")
    return ModelFacts(
        path=str(mf.gguf.path),
        arch=spec.arch,
        n_layer=spec.n_layer,
        n_expert=spec.n_expert,
        top_k=top_k,
        ctx_size=cfg.compute.ctx_size,
        file_bytes=mf.gguf.file_bytes,
        dense_bytes=layout.dense_bytes,
        expert_bytes=tuple(layout.expert_bytes(i) for i in range(spec.n_layer)),
        slab_bytes=layout.slab_bytes,
        kv_bytes=kv_cache_bytes(spec, cfg.compute.ctx_size, cfg.compute.kv_type),
        classes=kernel_classes(mf, top_k),
        read_bytes_per_expert=tuple(aligned_bytes(l.extents(0), layout.align) for l in layout.layers),
        engine_bytes=engine_bytes(RUN_ROLES, spec.n_vocab),
    )


def kernel_classes(mf, top_k: int) -> tuple[KernelClass, ...]:
    """The products of one decoded token, grouped: experts by (type, shape), dense by (type, columns)."""
    experts: dict[tuple[str, int, int], int] = {}
    for layer in mf.layout.layers:
        for part in layer.parts:
            if len(part.shape) == 2:  # biases are added, not multiplied
                out, inp = part.shape
                k = (part.tensor.qtype.name, out, inp)
                experts[k] = experts.get(k, 0) + top_k * out * inp
    dense: dict[tuple[str, int], list[int]] = {}  # (type, cols) -> [tallest rows, weights]
    skip = set() if mf.spec.tied_output else {"token_embd.weight"}  # a row lookup, not a product
    for t in mf.gguf.tensors.values():
        if t.name in mf.layout.expert_tensor_names or len(t.shape) != 2 or t.name in skip:
            continue
        rows, cols = t.shape
        acc = dense.setdefault((t.qtype.name, cols), [0, 0])
        acc[0], acc[1] = max(acc[0], rows), acc[1] + rows * cols
    out = [KernelClass("expert", q, r, c, w) for (q, r, c), w in experts.items()]
    out += [KernelClass("dense", q, r, c, w) for (q, c), (r, w) in dense.items()]
    return tuple(sorted(out, key=lambda c: (c.role != "expert", -c.weights_per_token)))


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryFit:
    budget: Budget
    available_bytes: int
    available_text: str
    reserve_bytes: int
    need_bytes: int  # resident dense + KV + reserve + the cache (at least the floor)
    n_slots: int
    fits: bool
    resident: bool  # every expert fits in the cache
    refusal: str | None
    limit_that_works_mb: int | None  # a memory limit (a new cgroup) that would fit; None when no limit helps


_LIMIT_WHERE = "a new cgroup of --mem-limit-mb"


def limited_probe(mem_limit_mb: float | None, memory: MemoryProbe | None = None) -> MemoryProbe:
    """This machine's probe, plus (with a limit) a new cgroup of `mem_limit_mb` holding
    only the run, as `moe-pipe run` started in one would see it (tighter real limits still win)."""
    memory = probe_memory() if memory is None else memory
    if mem_limit_mb is None:
        return memory
    if not (mem_limit_mb > 0 and math.isfinite(mem_limit_mb)):
        raise UserError(f"--mem-limit-mb must be a positive number of MiB, got {mem_limit_mb!r}")
    limit = CgroupLimit(_LIMIT_WHERE, int(mem_limit_mb * MiB), 0)
    return MemoryProbe(memory.host_available_bytes, memory.cgroups + (limit,))


def memory_fit(facts: ModelFacts, cfg: Config, memory: MemoryProbe) -> MemoryFit:
    """The budget `moe-pipe run` would resolve here, and whether the model runs in it."""
    budget = resolve_budget(cfg, dense_bytes=facts.dense_bytes, kv_bytes=facts.kv_bytes, memory=memory, engine_bytes=facts.engine_bytes)
    avail = memory.available_bytes
    reserve = max(int(cfg.cache.reserve_mb * MiB), facts.engine_bytes)  # as the budget counts it
    dense = facts.dense_bytes if cfg.io.dense_weights in RESIDENT_DENSE else 0
    # the run never makes more slabs than there are experts
    all_experts = facts.all_experts_slots * facts.slab_bytes
    cache_least = max(facts.floor_bytes, min(budget.bytes, all_experts) if budget.mode == "fixed" else 0)
    need = dense + facts.kv_bytes + reserve + cache_least
    floor_mb = facts.floor_bytes / MiB
    parts = (
        f"dense {dense / MiB:,.0f} MiB + KV {facts.kv_bytes / MiB:,.0f} MiB (ctx {facts.ctx_size}) + "
        f"reserve/processes {reserve / MiB:,.0f} MiB + "
    )
    refusal, limit_mb = None, None
    if budget.bytes < facts.floor_bytes and (budget.clamped or budget.mode == "fixed"):
        try:  # the same refusal, worded the same, as the run's own check
            check_floor(budget, facts.floor, where="config")
        except ConfigError as exc:
            refusal = str(exc)
    elif avail < need:
        cache_text = f"one token's experts {floor_mb:,.1f} MiB" if budget.mode == "auto" else f"cache_mb {budget.bytes / MiB:g}"
        need_mb = math.ceil(need / MiB)
        # what the machine gives without the hypothetical limit: no limit can make more
        others = MemoryProbe(memory.host_available_bytes, tuple(c for c in memory.cgroups if c.where != _LIMIT_WHERE))
        if others.available_bytes >= need:
            limit_mb = need_mb
            fix = f"a memory limit of {need_mb:,} MiB or more would work"
        else:
            fix = f"this machine has only {others.available_bytes / MiB:,.0f} MiB to give ({others.describe()})"
        refusal = (
            f"does not fit: {avail / MiB:,.0f} MiB available < {parts}{cache_text} = {need_mb:,} MiB; "
            f"{fix} (or lower --reserve-mb, -c/--ctx-size, --top-k, or use --dense-weights mmap)"
        )
    n_slots = min(budget.bytes // facts.slab_bytes, facts.all_experts_slots)
    return MemoryFit(
        budget,
        avail,
        memory.describe(),
        reserve,
        need,
        n_slots,
        refusal is None,
        refusal is None and n_slots >= facts.all_experts_slots,
        refusal,
        limit_mb,
    )


# ---------------------------------------------------------------- hit rate


@dataclass(frozen=True)
class HitRate:
    pct: float  # decode lookups that hit, %
    source: str  # trace | proxy | resident | fallback
    note: str


def trace_path(arch: str, n_expert: int) -> Path | None:
    name = TRACES.get((arch, n_expert))
    return TRACE_DIR / name if name else None


def proxy_trace_path(n_expert: int) -> Path | None:
    """The first shipped trace over `n_expert` experts, for an architecture that has none of its own."""
    name = next((name for (_, n), name in TRACES.items() if n == n_expert), None)
    return TRACE_DIR / name if name else None


def first_layers(trace, n_layer: int):
    """`trace` cut to its first n_layer layers (rows and header)."""
    from ..model.trace import Trace

    h = trace.header
    if n_layer >= h.n_layer:
        return trace
    keep = trace.layer < n_layer  # [N]
    header = replace(h, n_layer=n_layer, expert_bytes=h.expert_bytes[:n_layer], dense_bytes=h.dense_bytes[:n_layer])
    cols = {
        name: getattr(trace, name)[keep]
        for name in ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes")
    }
    return Trace(trace.path, header, first_row_line=trace.first_row_line, **cols)


def first_decode_tokens(trace, n: int):
    """`trace` cut to its first turn's prompt and first `n` decoded tokens: a reply's warm-up from a cold cache."""
    from ..model.trace import Trace

    turn = trace.turn.min()
    decode = trace.step[(trace.turn == turn) & (trace.phase == 1)]
    end = (decode.min() if decode.size else 0) + n
    keep = (trace.turn == turn) & ((trace.phase == 0) | (trace.step < end))
    cols = {
        name: getattr(trace, name)[keep]
        for name in ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes")
    }
    return Trace(trace.path, trace.header, first_row_line=trace.first_row_line, **cols)


def hit_rate(facts: ModelFacts, n_slots: int, policy: str, trace=None, decode_tokens: int | None = None) -> HitRate:
    """The decode hit rate of a cache of `n_slots` slabs under `policy` (module docstring: how);
    with `decode_tokens`, over a reply's first that many decoded tokens from a cold cache (the warm-up)."""
    from ..model.trace import read_trace
    from .replay import Replayer, slab_bytes

    if n_slots >= facts.all_experts_slots and decode_tokens is None:
        return HitRate(100.0, "resident", "every expert fits the cache: after the warm-up every lookup hits")
    path = trace_path(facts.arch, facts.n_expert)
    source, stand_in = "trace", ""
    if trace is None and path is None:
        path = proxy_trace_path(facts.n_expert)
        if path is not None:
            source, stand_in = "proxy", f"no trace for {facts.arch}: a real router over the same {facts.n_expert} experts stands in; "
    if trace is None and path is not None:
        trace = read_trace(path)
    if trace is None:
        share = min(1.0, n_slots / facts.all_experts_slots)
        pct = 100.0 * share
        if decode_tokens is not None:
            # uniform routing from a cold cache: a lookup at token t hits if its expert was picked
            # before (1 - (1 - k/E)^(t-1)) and is still held (at most the cache's share)
            seen = [1.0 - (1.0 - facts.top_k / facts.n_expert) ** (t - 1) for t in range(1, decode_tokens + 1)]
            pct = 100.0 * sum(min(share, s) for s in seen) / decode_tokens
        return HitRate(
            pct,
            "fallback",
            f"no shipped trace for {facts.arch} with {facts.n_expert} experts: "
            f"slots / experts, as uniform routing would give (a pessimistic guess)",
        )
    if decode_tokens is not None:
        trace = first_decode_tokens(trace, decode_tokens)
    tl = trace.header.n_layer
    if facts.n_layer < tl:
        trace, slots = first_layers(trace, facts.n_layer), n_slots
        how = f"its first {facts.n_layer} of {tl} layers at {slots} slots"
    else:
        slots = n_slots * tl // facts.n_layer
        how = f"all {tl} layers at {slots} slots (the model's {n_slots} × {tl}/{facts.n_layer}: same slots per layer)"
    slab = slab_bytes(trace)
    budget_mb = (slots * slab + slab // 2) / MiB  # mid-slab, so float rounding cannot lose one
    r = Replayer(trace).run(budget_mb, policy)
    name = Path(getattr(trace, "path", "") or str(path)).name
    return HitRate(r.hit_pct_decode, source, f"{stand_in}{name} (top-{trace.header.n_expert_used}) replayed with {policy}, {how}")


# ---------------------------------------------------------------- measuring


@dataclass(frozen=True)
class ReadFigures:
    gbps: dict[int, float]  # lanes -> GB/s (1e9 B/s) of disk bytes over wall time
    direct: bool  # O_DIRECT (False: the buffered fallback, which may measure the page cache)
    source: str  # measured | assumed
    note: str


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
    if is_sparse(paths):
        return ReadFigures(
            {n: ASSUMED_READ_GBPS for n in lanes},
            True,
            "assumed",
            f"the file is mostly holes (header-only): {ASSUMED_READ_GBPS} GB/s assumed (docs/benchmarks.md, O_DIRECT on this disk)",
        )
    spec, lay = mf.spec, mf.layout
    # a new seed each run: experts a previous run read may sit in the host's disk cache
    rng = random.Random(seed)
    out = {}
    # the arena is unlinked on the way out, whatever happens
    with ExpertFiles(paths, align=lay.align) as ef, SlabArena.create(segment_name("doctor-reads"), max(lanes), lay.slab_bytes) as arena:
        for n in lanes:
            best = 0.0
            for _ in range(rounds):
                work = [lay.expert_extents(rng.choice(spec.moe_layers), rng.randrange(spec.n_expert)) for _ in range(2048)]
                nbytes, secs = read_lanes(ef, arena, work, n, seconds / len(lanes) / rounds)
                best = max(best, nbytes / secs / 1e9)
            out[n] = best
        direct = ef.direct
    note = "measured with O_DIRECT" if direct else f"measured buffered ({ef.fallback_reason}): may be the page cache, not the disk"
    return ReadFigures(out, direct, "measured", note)


def read_lanes(ef, arena, work, lanes: int, seconds: float, latencies: list[float] | None = None) -> tuple[int, float]:
    """Lanes (threads) pull experts off a shared list until the time is up; (bytes, seconds).
    With `latencies`, each read's seconds are appended to it (bench/bench_reads.py)."""
    lock, nxt, stop = threading.Lock(), [0], time.perf_counter() + seconds
    totals = [0] * lanes
    lat: list[list[float]] = [[] for _ in range(lanes)]

    def lane(k: int) -> None:
        slab = arena.slab(k)
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(work) or (i >= lanes and time.perf_counter() >= stop):  # one read each, at least
                return
            t = time.perf_counter()
            totals[k] += ef.read_expert(work[i], slab).disk_bytes
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
    from ..quant.blocks import random_blocks

    rng = np.random.default_rng(0)
    before = quant.get_threads()
    per = seconds / max(1, len(classes) * len(threads))
    out = {}
    try:
        for c in classes:
            qt = quant.qtype_from_name(c.qtype)
            row_bytes = quant.block_format(qt).row_bytes(c.cols)
            rows = max(1, min(c.rows, MAX_MATRIX_BYTES // row_bytes))
            one = random_blocks(qt, rows * c.cols, rng).reshape(rows, row_bytes)
            n_mats = max(1, rotate_bytes // one.nbytes)
            mats = np.tile(one, (n_mats, 1)).reshape(n_mats, rows, row_bytes)  # [M, R, row]: distinct memory
            x = rng.standard_normal(c.cols, dtype=np.float32)  # [C]
            y = np.empty(rows, np.float32)  # [R]
            quant.matvec(qt, mats[0], x, out=y)  # compile / load from numba's cache outside the timing
            window = max(1, WINDOW_BYTES // one.nbytes)
            for n in threads:
                quant.set_threads(n)
                times: list[float] = []
                i, stop = 0, time.perf_counter() + per
                while not times or time.perf_counter() < stop:
                    t0 = time.perf_counter()
                    for _ in range(window):
                        quant.matvec(qt, mats[i], x, out=y)
                        i = (i + 1) % n_mats
                    times.append((time.perf_counter() - t0) / window)  # seconds per matrix
                out[(c.key, n)] = rows * c.cols / min(times)
            del mats
    finally:
        quant.set_threads(before)
    return out


def compute_threads(cfg: Config) -> int:
    import numba

    n_max = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # numba.config sets its NUMBA_* names at import time (globals), unseen by mypy
    return max(1, min(cfg.compute.threads or os.cpu_count() or 1, n_max))


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


def decode_speed(
    classes: Sequence[KernelClass],
    rates: Mapping[str, float],
    *,
    n_layer: int,
    top_k: int,
    hit_pct: float,
    read_bytes_per_token: int,
    read_gbps: float,
    at_floor: bool = False,
    overhead_s: float = PER_LAYER_OVERHEAD_S,
    wire_s: float = PER_LAYER_WIRE_S,
) -> Speed:
    """One decoded token's compute, io and wall time (module docstring). `read_bytes_per_token`
    is what a token reads with no cache (k × page-rounded experts, all layers)."""
    kernels = kernel_seconds(classes, rates)
    experts = kernel_seconds(classes, rates, "expert")
    dense = kernels - experts + n_layer * overhead_s
    compute = dense + experts
    io = (1.0 - hit_pct / 100.0) * read_bytes_per_token / (read_gbps * 1e9)
    if io > 0:
        layer = max(experts / n_layer, io / n_layer + experts / (n_layer * max(1, top_k)))
        wall = dense + n_layer * (layer + wire_s)
    else:
        wall = compute
    bottleneck = "memory" if at_floor else ("flash" if io > compute else "compute")
    return Speed(compute, kernels, io, wall, 1.0 / wall, bottleneck, wall / max(compute, io))


def _gws(classes, rates, role) -> float | None:
    """Weights/s over all classes of a role (weights-weighted harmonic mean), in G."""
    w = sum(c.weights_per_token for c in classes if c.role == role)
    return round(w / kernel_seconds(classes, rates, role) / 1e9, 2) if w else None


# ---------------------------------------------------------------- all of it


def forecast(mf, cfg: Config, *, mem_limit_mb: float | None = None, seconds: float = 4.0, memory: MemoryProbe | None = None) -> dict:
    """The doctor's record: one flat dict (keys documented in docs/cli.md, ## doctor).
    About `seconds` go to measuring: 40 % reads, 60 % kernels."""
    t0 = time.perf_counter()
    facts = model_facts(mf, cfg)
    fit = memory_fit(facts, cfg, limited_probe(mem_limit_mb, memory))
    policy = cfg.cache.policy
    hit = hit_rate(facts, fit.n_slots, policy) if fit.fits else None
    warm = hit_rate(facts, fit.n_slots, policy, decode_tokens=WARMUP_TOKENS) if fit.fits else None
    reads = measure_reads(mf, seconds=0.4 * seconds)
    lanes = max([n for n in reads.gbps if n <= cfg.io.io_threads] or [min(reads.gbps)])
    threads = compute_threads(cfg)
    # a model whose active weights fit in the L3 (the tiny ones) decodes from cache: measure it so
    rotate = min(ROTATE_BYTES, facts.active_bytes_per_token)
    rates = measure_kernels(facts.classes, sorted({1, threads}), seconds=0.6 * seconds, rotate_bytes=rotate)
    at_n = {c.key: rates[(c.key, threads)] for c in facts.classes}
    at_1 = {c.key: rates[(c.key, 1)] for c in facts.classes}
    read_per_token = facts.top_k * sum(facts.read_bytes_per_expert)
    at_floor = (not fit.fits) or fit.budget.bytes < FLOOR_MARGIN * facts.floor_bytes

    def speed_at(rates: Mapping[str, float], h: HitRate | None = hit) -> Speed:
        return decode_speed(
            facts.classes,
            rates,
            n_layer=facts.n_layer,
            top_k=facts.top_k,
            hit_pct=h.pct if h else 0.0,
            read_bytes_per_token=read_per_token,
            read_gbps=reads.gbps[lanes],
            at_floor=at_floor,
        )

    speed = speed_at(at_n)
    speed_1t = speed_at(at_1)  # -t 1: faster when other processes hold the cores
    warmup = speed_at(at_n, warm)  # tokens 2..WARMUP_TOKENS+1 of a reply: the cache filling
    b = fit.budget
    return {
        "model": facts.path,
        "arch": facts.arch,
        "n_layer": facts.n_layer,
        "n_expert": facts.n_expert,
        "top_k": facts.top_k,
        "ctx_size": facts.ctx_size,
        "file_bytes": facts.file_bytes,
        "dense_bytes": facts.dense_bytes,
        "expert_bytes": max(facts.expert_bytes),
        "layer_expert_bytes": max(facts.expert_bytes) * facts.n_expert,
        "expert_bytes_total": facts.expert_bytes_total,
        "slab_bytes": facts.slab_bytes,
        "kv_bytes": facts.kv_bytes,
        "floor_bytes": facts.floor_bytes,
        "routed_bytes_per_token": facts.routed_bytes_per_token,
        "active_bytes_per_token": facts.active_bytes_per_token,
        "mem_limit_mb": mem_limit_mb,
        "available_bytes": fit.available_bytes,
        "available": fit.available_text,
        "reserve_bytes": fit.reserve_bytes,
        "need_bytes": fit.need_bytes,
        "budget_bytes": b.bytes,
        "budget_mb": round(b.mb, 1),
        "budget": b.description,
        "n_slots": fit.n_slots,
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
        "read_source": reads.source,
        "direct_io": reads.direct,
        "read_note": reads.note,
        "threads": threads,
        "expert_gws_1t": _gws(facts.classes, at_1, "expert"),
        "expert_gws": _gws(facts.classes, at_n, "expert"),
        "dense_gws_1t": _gws(facts.classes, at_1, "dense"),
        "dense_gws": _gws(facts.classes, at_n, "dense"),
        "overhead_ms_per_layer": round(PER_LAYER_OVERHEAD_S * 1e3, 3),
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
