"""Will a model fit this machine, and how often will its expert cache hit? From
the GGUF header, the config and the memory this machine gives, with nothing
timed (shared/analysis/forecast.py times the reads and kernels and turns all of
it into decode speed):

    model_footprint(mf, cfg)              -> ModelFootprint  sizes, floor, kernel work, from the header alone
    memory_fit(footprint, cfg, memory)    -> MemoryFit       the auto budget (resolve_budget) and fits / refuses
    affordable_context(spec, kv_type, m)  -> int             the longest context whose KV cache a memory affords
    limited_probe(mem_limit_mb)           -> MemoryProbe     this machine as if in a new cgroup of that limit
    hit_rate(footprint, n_slabs, policy)  -> HitRate         a shipped phone trace replayed, or a stated fallback

A kernel class is one (quant type, shape) the decode multiplies: each expert
projection, and each dense matrix family grouped by (type, columns). The
token embedding is a row lookup, not a product, so it is left out (unless the
output head is tied to it).

The hit rate comes from the BigMoeOnEdge phone traces shipped in
data/traces/ when the model's architecture and expert count match one
(qwen3moe × 128 → Qwen3-30B-A3B, gpt-oss × 128 → gpt-oss-120b; gemma4 × 128
below). The cache is
replayed at the same number of slabs *per layer* as the model's budget gives:
a model with fewer layers than the trace replays the trace's first n_layer
layers at its own slab count; a deeper model replays the whole trace at its
slabs × trace layers / model layers. The steady hit rate counts the lookups
of the trace's last quarter of decoded tokens (the window every steady figure
of moe-pipe takes: a slowly filling cache, Gemma's, still gains ten points
after its first 50 tokens), the warm-up's those of its first 49 from a cold
cache. The trace's top-k (6 and 2, reduced on
the phone) is kept as recorded and the slab count is not rescaled for the
model's own top-k: under the independent-reference (Che) approximation of
an LRU-like cache, scaling every expert's request rate by the same factor
rescales time and leaves each hit probability unchanged, so hit % depends on
slabs and the popularity spread, not on k. A file make-model wrote routes by
its synthetic routers, not as the trained model: for the benchmark shapes
(MADE_TRACES) the doctor replays the routing of that made model itself,
recorded with the benchmark protocol's prompt and 256 greedy tokens (source
"synthetic"). Gemma 4 has no phone recording, so a gemma4 file of any origin
replays the made gemma26b-shape's (a real Gemma's reuse may differ: on the
2026-12-01 protocol the Qwen trace as a proxy forecast 96 % hits for that file
at 10,673 MiB and uniform routing 48 %, against 79 % measured:
docs/benchmarks.md § The protocol (2026-12-01)). A model whose architecture has
no trace but whose expert count matches a phone trace replays that one as a
proxy (source "proxy"): another trained router over as many experts, nearer
a trained router's reuse than uniform routing, which no trained router shows. Without any trace of
that expert count the fallback is slabs / (layers × experts): exact for
uniform routing, which a real router beats, so it is a pessimistic guess and
flagged as one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

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
    kv_lendable_bytes,
    pipeline_bytes,
    probe_memory,
    prompt_lendable_bytes,
    resolve_budget,
    service_kv_bytes,
)
from ..gguf.layout import aligned_bytes

MiB = 1 << 20
INTEGER_TYPES = frozenset({"I8", "I16", "I32", "I64"})
TRACE_DIR = Path(__file__).parent.parent / "data" / "traces"
# (arch, n_expert) -> shipped trace (shared/data/traces/README.md says what each one recorded)
TRACES = {("qwen3moe", 128): "qwen.route.csv", ("gpt-oss", 128): "gptoss.route.csv", ("gemma4", 128): "made-gemma26b-shape.route.csv"}
# A file make-model wrote routes by make-model's synthetic routers, not as the trained model a
# phone trace recorded: (arch, preset) -> the routing of that made model itself, recorded with
# the benchmark protocol's prompt (shared/data/traces/README.md). Their hit rates carry the
# source "synthetic".
MADE_NAME = "moe-pipe made "  # general.name's start in make-model's files (shared/makemodel/maker.py)
MADE_TRACES = {
    ("qwen3moe", "qwen30b-shape"): "made-qwen30b-shape.route.csv",
    ("gemma4", "gemma26b-shape"): "made-gemma26b-shape.route.csv",
    ("gpt-oss", "gptoss120b-shape"): "made-gptoss120b-shape.route.csv",
}
SYNTHETIC_TRACES = frozenset(MADE_TRACES.values())


# ---------------------------------------------------------------- the header


@dataclass(frozen=True)
class KernelClass:
    """One (role, type, shape) the decode multiplies, and how many weights of it per token."""

    role: str  # expert | dense
    qtype: str
    rows: int  # the tallest matrix of the class (forecast.py measures it cut to MAX_MATRIX_BYTES)
    cols: int
    weights_per_token: int

    @property
    def key(self) -> str:
        return f"{self.role} {self.qtype} {self.rows}x{self.cols}"


@dataclass(frozen=True)
class ModelFootprint:
    """What running this model asks of a machine, read from its GGUF header under a
    config: the bytes it holds (dense set, KV cache, one slab, the floor), the bytes it
    reads and the weights it multiplies per decoded token."""

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
    kv_ring_layers: int = 0  # sliding-window layers, whose KV is a ring of kv_ring_rows positions, not ctx_size
    kv_ring_rows: int = 0
    nextn_bytes: int = 0  # the NextN/MTP block (shared/gguf/nextn.py): in the file, never read
    parallel: int = 1  # gateway.parallel: slots, each with its own KV cache (kv_bytes counts all of them)
    kv_lendable_bytes: int = 0  # of kv_bytes, what the KV cache lends the expert cache while the context is short
    prompt_lendable_bytes: int = 0  # of engine_bytes, a long prompt chunk's activations: lent while none runs
    name: str = ""  # general.name: make-model's files say "moe-pipe made ARCH PRESET"

    @property
    def made_preset(self) -> str | None:
        """The make-model shape preset this file was made from, or None for any other file."""
        return self.name.removeprefix(MADE_NAME).split()[-1] if self.name.startswith(MADE_NAME) else None

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
    def all_experts_slabs(self) -> int:
        """Slabs that hold every expert: a cache this big never evicts."""
        return self.moe_layers * self.n_expert


def model_footprint(mf, cfg: Config) -> ModelFootprint:
    """The model's footprint under `cfg`, read from its header (no weight is touched)."""
    from ..gguf.spec import kv_rows, kv_windows  # the KV size the pipeline allocates

    spec, layout = mf.spec, mf.layout
    top_k = cfg.compute.n_expert_used or spec.n_expert_used
    if cfg.compute.route_replay:  # a trace-driven run routes the trace's k experts a layer, not the model's
        from ..model.trace import read_trace_header

        top_k = read_trace_header(cfg.compute.route_replay).n_expert_used
    if top_k > spec.n_expert:
        raise UserError(f"--n-expert-used {top_k} is out of range: {mf.gguf.path} has {spec.n_expert} experts per layer")
    return ModelFootprint(
        path=str(mf.gguf.path),
        name=spec.name,
        arch=spec.arch,
        n_layer=spec.n_layer,
        n_expert=spec.n_expert,
        top_k=top_k,
        ctx_size=cfg.compute.ctx_size,
        file_bytes=mf.gguf.file_bytes,
        dense_bytes=layout.dense_bytes,
        expert_bytes=tuple(layout.expert_bytes(i) for i in range(spec.n_layer)),
        slab_bytes=layout.slab_bytes,
        kv_bytes=service_kv_bytes(cfg, spec),
        kv_lendable_bytes=kv_lendable_bytes(cfg, spec),
        prompt_lendable_bytes=prompt_lendable_bytes(cfg, spec, top_k),
        classes=kernel_classes(mf, top_k),
        read_bytes_per_expert=tuple(aligned_bytes(l.extents(0), layout.align) for l in layout.layers),
        engine_bytes=pipeline_bytes(RUN_ROLES, spec, cfg.compute.prefill_tokens, top_k),
        kv_ring_layers=sum(1 for w in kv_windows(spec) if w),
        kv_ring_rows=max((kv_rows(w, cfg.compute.ctx_size) for w in kv_windows(spec) if w), default=0),
        nextn_bytes=layout.nextn_bytes,
        parallel=cfg.gateway.parallel,
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
        if t.name in mf.layout.expert_tensor_names or t.name in mf.layout.nextn_tensor_names or len(t.shape) != 2 or t.name in skip:
            continue
        if t.qtype.name in INTEGER_TYPES:  # a table looked up (deepseek4's token -> experts hash routing), not multiplied
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
    n_slabs: int
    lent_slabs: int  # slabs more while the context is short and no long prompt runs: the KV cache's and the prompt's loans (Budget.slabs)
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


def memory_fit(footprint: ModelFootprint, cfg: Config, memory: MemoryProbe) -> MemoryFit:
    """The budget `moe-pipe run` would resolve here, and whether the model runs in it."""
    budget = resolve_budget(
        cfg,
        dense_bytes=footprint.dense_bytes,
        kv_bytes=footprint.kv_bytes,
        memory=memory,
        engine_bytes=footprint.engine_bytes,
        floor_bytes=footprint.floor_bytes,
        lendable_bytes=footprint.kv_lendable_bytes,
        prompt_bytes=footprint.prompt_lendable_bytes,
    )
    avail = memory.available_bytes
    reserve = max(int(cfg.cache.reserve_mb * MiB), footprint.engine_bytes)  # as the budget counts it
    dense = footprint.dense_bytes if cfg.io.dense_weights in RESIDENT_DENSE else 0
    # the run never makes more slabs than there are experts
    all_experts = footprint.all_experts_slabs * footprint.slab_bytes
    cache_least = max(footprint.floor_bytes, min(budget.bytes, all_experts) if budget.mode == "fixed" else 0)
    need = dense + footprint.kv_bytes + reserve + cache_least
    floor_mb = footprint.floor_bytes / MiB
    parts = (
        f"dense {dense / MiB:,.0f} MiB + KV {footprint.kv_bytes / MiB:,.0f} MiB (ctx {footprint.ctx_size}) + "
        f"reserve/processes {reserve / MiB:,.0f} MiB + "
    )
    refusal, limit_mb = None, None
    if budget.bytes < footprint.floor_bytes and (budget.clamped or budget.mode == "fixed"):
        try:  # the same refusal, worded the same, as the run's own check
            check_floor(budget, footprint.floor, where="config")
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
            f"{fix} (or lower --reserve-mb, -c/--ctx-size, --n-expert-used (lossy), or use --dense-weights mmap)"
        )
    n_slabs, kv_lent, prompt_lent = budget.slabs(footprint.slab_bytes, footprint.all_experts_slabs)
    lent_slabs = kv_lent + prompt_lent
    return MemoryFit(
        budget,
        avail,
        memory.describe(),
        reserve,
        need,
        n_slabs,
        lent_slabs,
        refusal is None,
        refusal is None and n_slabs >= footprint.all_experts_slabs,
        refusal,
        limit_mb,
    )


# ---------------------------------------------------------------- context


# How long a context a memory affords (the recipes' ctx_size, and what `doctor` says): the longest
# whose KV cache takes at most KV_SHARE of the memory the run has, since every MiB of KV is a MiB
# the expert cache does not get. At 4,096 tokens the recipes spent up to 8 % of the 11 GB reference
# device on it (f16: Gemma-4 880 MiB while its sliding layers kept the whole context, Mixtral 512,
# Qwen3-30B-A3B 384); an eighth gives the models whose sliding layers keep only their window 32k
# there (Gemma-4 940 MiB, gpt-oss-120b 1,174 MiB) and Qwen3-30B-A3B 8k (768 MiB), not 16k (1.5 GiB).
KV_SHARE = 1 / 8
MIN_CONTEXT = 4096  # the steps: 4,096 × 2^k tokens, and the model's trained context
RECIPE_CONTEXT = 32768  # the recipes go no longer (a chat, a document, an agent's tools), however much fits


def affordable_context(spec, kv_type: str, memory_bytes: int, most: int | None = None) -> int:
    """The longest of 4,096 × 2^k tokens and the model's trained context (at most `most`)
    whose KV cache (`kv_cache_bytes`, rings included) is at most KV_SHARE of `memory_bytes`;
    0 when not even the shortest is."""
    from ..gguf.spec import kv_cache_bytes

    top = min(spec.n_ctx_train, most or spec.n_ctx_train)
    steps, c = [top], MIN_CONTEXT
    while c < top:
        steps.append(c)
        c *= 2
    return max((c for c in steps if kv_cache_bytes(spec, c, kv_type) <= KV_SHARE * memory_bytes), default=0)


# ---------------------------------------------------------------- hit rate


@dataclass(frozen=True)
class HitRate:
    pct: float  # decode lookups that hit, %
    source: str  # trace | proxy | resident | fallback
    note: str


def own_trace_path(arch: str, n_expert: int, made_preset: str | None = None) -> Path | None:
    """The shipped trace of a model like this one: the made model's own routing for a file
    make-model wrote from a preset that has one (present in the package), else the one
    recorded on this architecture with this many experts, or None."""
    made = MADE_TRACES.get((arch, made_preset or ""))
    if made and (TRACE_DIR / made).exists():
        return TRACE_DIR / made
    name = TRACES.get((arch, n_expert))
    return TRACE_DIR / name if name else None


def proxy_trace_path(n_expert: int) -> Path | None:
    """The first shipped trace over `n_expert` experts, for an architecture that has none of its own."""
    name = next((name for (_, n), name in TRACES.items() if n == n_expert), None)
    return TRACE_DIR / name if name else None


def first_layers(trace, n_layer: int):
    """`trace` cut to its first n_layer layers (rows and header)."""
    from ..model.trace import COLUMNS, Trace

    h = trace.header
    if n_layer >= h.n_layer:
        return trace
    keep = trace.layer < n_layer  # [N]
    header = replace(h, n_layer=n_layer, expert_bytes=h.expert_bytes[:n_layer], dense_bytes=h.dense_bytes[:n_layer])
    cols = {name: getattr(trace, name)[keep] for name in COLUMNS}
    return Trace(trace.path, header, first_row_line=trace.first_row_line, **cols)


def first_decode_tokens(trace, n: int):
    """`trace` cut to its first turn's prompt and first `n` decoded tokens: a reply's warm-up from a cold cache."""
    from ..model.trace import COLUMNS, Trace

    turn = trace.turn.min()
    decode = trace.step[(trace.turn == turn) & (trace.phase == 1)]
    end = (decode.min() if decode.size else 0) + n
    keep = (trace.turn == turn) & ((trace.phase == 0) | (trace.step < end))
    cols = {name: getattr(trace, name)[keep] for name in COLUMNS}
    return Trace(trace.path, trace.header, first_row_line=trace.first_row_line, **cols)


def hit_rate(footprint: ModelFootprint, n_slabs: int, policy: str, trace=None, decode_tokens: int | None = None) -> HitRate:
    """The decode hit rate of a cache of `n_slabs` slabs under `policy` (module docstring: how);
    with `decode_tokens`, over a reply's first that many decoded tokens from a cold cache (the warm-up)."""
    from ..model.trace import read_trace
    from .replay import Replayer, slab_bytes

    if n_slabs >= footprint.all_experts_slabs and decode_tokens is None:
        return HitRate(100.0, "resident", "every expert fits the cache: after the warm-up every lookup hits")
    path = own_trace_path(footprint.arch, footprint.n_expert, footprint.made_preset)
    source, stand_in = "trace", ""
    if trace is None and path is not None and path.name in SYNTHETIC_TRACES:
        why = "a file make-model wrote" if footprint.made_preset else f"no real {footprint.arch} recording"
        source, stand_in = "synthetic", f"{why}: the routing of make-model's shape recorded; "
    if trace is None and path is None:
        path = proxy_trace_path(footprint.n_expert)
        if path is not None:
            source, stand_in = (
                "proxy",
                f"no trace for {footprint.arch}: a real router over the same {footprint.n_expert} experts stands in; ",
            )
    if trace is None and path is not None:
        trace = read_trace(path)
    if trace is None:
        share = min(1.0, n_slabs / footprint.all_experts_slabs)
        pct = 100.0 * share
        if decode_tokens is not None:
            # uniform routing from a cold cache: a lookup at token t hits if its expert was picked
            # before (1 - (1 - k/E)^(t-1)) and is still held (at most the cache's share)
            seen = [1.0 - (1.0 - footprint.top_k / footprint.n_expert) ** (t - 1) for t in range(1, decode_tokens + 1)]
            pct = 100.0 * sum(min(share, s) for s in seen) / decode_tokens
        return HitRate(
            pct,
            "fallback",
            f"no shipped trace for {footprint.arch} with {footprint.n_expert} experts: "
            f"slabs / experts, as uniform routing would give (a pessimistic guess)",
        )
    if decode_tokens is not None:
        trace = first_decode_tokens(trace, decode_tokens)
    tl = trace.header.n_layer
    if footprint.n_layer < tl:
        trace, slabs = first_layers(trace, footprint.n_layer), n_slabs
        how = f"its first {footprint.n_layer} of {tl} layers at {slabs} slabs"
    else:
        slabs = n_slabs * tl // footprint.n_layer
        how = f"all {tl} layers at {slabs} slabs (the model's {n_slabs} × {tl}/{footprint.n_layer}: same slabs per layer)"
    slab = slab_bytes(trace)
    budget_mb = (slabs * slab + slab // 2) / MiB  # mid-slab, so float rounding cannot lose one
    r = Replayer(trace).run(budget_mb, policy)
    name = Path(getattr(trace, "path", "") or str(path)).name
    # the warm-up: over its tokens from cold; steady: over the decode's last quarter, as measured
    pct = r.hit_pct_decode if decode_tokens is not None else r.hit_pct_steady
    window = "its first tokens from a cold cache" if decode_tokens is not None else "the last quarter of its decode"
    return HitRate(pct, source, f"{stand_in}{name} (top-{trace.header.n_expert_used}) replayed with {policy}, {how}; hits over {window}")
