"""The expert cache budget: how many bytes the slab arena may hold.

    probe_memory()            -> MemoryProbe   what this process tree may still use (reads /proc, /sys)
    compute_budget(...)       -> Budget        pure: probe + cache settings + dense + KV -> bytes
    resolve_budget(cfg, ...)  -> Budget        both, plus the refusal when the floor does not fit
    check_floor(budget, floor) -> int          the slab count, or the refusal below one token's experts

auto = min(host available, every enclosing cgroup's limit - working set)
       - dense set (when resident: dense_weights anon or warm) - KV cache
       - max(reserve, the engine's own processes), clamped to cache_ceil_mb.

The KV cache is what compute allocates (shared/gguf/spec.py kv_cache_bytes):
a sliding-window layer's ring of its window and one prompt block, every other
layer the whole context, so what the rings save goes to the expert cache.

The KV cache's loan (cache.lend_kv; docs/architecture.md § The KV cache's
loan): a whole-context layer's rows take memory only as positions are written,
so a short context leaves most of the KV reservation unused. With one slot and
an auto budget, the cache is made larger by that part (`Budget.lent_bytes`,
`kv_lendable_bytes`; beyond cache_ceil_mb too, since the engine then holds no
more than it would with its context full) and compute takes it back, slab by
slab, before its context grows into it.

The prompt's loan (cache.lend_prompt; docs/architecture.md § The prompt's loan):
the allowance auto leaves for a long prompt chunk's activations (`pipeline_bytes`)
is memory only a pass of many rows uses. With one slot and an auto budget the
cache holds that part of the reserve too (`Budget.prompt_lent_bytes`: what the
chunk's allowance adds beyond reserve_mb and the processes' own estimate), except
while compute warms up; compute takes it back before a pass of many rows and gives
it to the cache again once the pass is done.

Why cgroups: psutil's `available` is the host's; inside a memory cgroup (a
container, or the benchmark's emulated 11 GB device) the limit is what the
OOM killer enforces. Limits are hierarchical, so every level from this
process's cgroup up to the hierarchy root is read and the tightest wins.
Working set = usage - inactive file pages, as container runtimes count it:
the page cache counts against the limit but the kernel drops inactive file
pages before it OOM-kills, so counting them as used would starve the budget
right after the model file was written or read.

The reserve (cache.reserve_mb, default 512 MiB) is what is left beside the
cache, dense set and KV cache for the processes themselves and the system.
The allowance is at least `engine_bytes(roles, n_vocab)` whatever reserve_mb
says, because reserve_mb is the first thing a user lowers in a tight cgroup
(the refusal below says so): below what reader, compute and gateway are about
to take, a run near its limit would reclaim its own code pages constantly.
engine_bytes is an estimate of what the children yet to be started will hold
(see ROLE_PRIVATE_MIB); `pipeline_bytes` adds a prompt chunk's activations. The
parent needs no estimate: it is running when memory is probed, so its pages
are already in the cgroup's usage (or gone from the host's available).
A fixed amount rather than a percentage: the overhead is per process, not
per GiB of RAM, and a percentage would take 1-2 GiB from a large host for
nothing.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..gguf.nextn import nextn_spec
from ..gguf.spec import ModelSpec, kv_cache_bytes, kv_pool_bytes, kv_position_bytes, kv_row_runs, prefill_activation_bytes

MiB = 1 << 20
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX rounded to a page (9223372036854771712);
# anything this large is no limit.
UNLIMITED = 1 << 62
RESIDENT_DENSE = ("anon", "warm")  # dense policies that keep the dense set in RAM for the whole run

# -- the engine's own processes ---------------------------------------------------
#
# Private memory (anonymous pages: interpreter heap, imported modules, numba's
# compiled kernels, the tokenizer, buffers) of each child once it has served a
# request, MiB, measured on this machine (x86-64, CPython 3.11, numpy, numba)
# from /proc/PID/smaps_rollup with `moe-pipe up` on two models:
#
#   role        tiny (vocab 2,048)   qwen30b-shape (vocab 151,936)
#   telemetry        13-16                  13     (16.2 with a cold numba cache beside it, tests/test_budget.py)
#   reader             24                    —     (44-47 if it imported numba; it imports none of the
#                                                  kernels: shared/quant/__init__.py)
#   compute            78                  161     150 on tiny with a cold numba cache
#   gateway         41-60                   82     (60 with the chat-template sandbox loaded)
#
# A role's figure = a fixed part (the tiny column with ~10 % room, rounded
# up to 8 MiB; compute's from a cold numba cache: its compiled code stays
# resident) + bytes per vocab entry for the two roles that hold a tokenizer,
# fitted to the qwen30b column (gateway 287 B, compute 580 B: the tokenizer
# and vocab-sized buffers). tests/test_budget.py starts the service and fails
# if a child outgrows its figure, so the table cannot quietly go stale.
# Besides their private pages the processes map code — libllvmlite (68-74
# MiB), libpython, numpy, tokenizers: 110-116 MiB of distinct file pages,
# charged once to the cgroup that first reads them. All of it is counted,
# the parent's too: freshly read file pages sit on the inactive list, which
# the working set leaves out, and if the limit squeezes code out every kernel
# call faults it back in (the run crawls instead of failing).
# Not counted: KV (its own term) and the shared-memory arenas (the budget).
ROLE_PRIVATE_MIB = {"telemetry": 20, "reader": 32, "compute": 168, "gateway": 72}
VOCAB_BYTES_PER_TOKEN = {"compute": 600, "gateway": 300}
SHARED_CODE_MIB = 120
RUN_ROLES = ("telemetry", "reader", "compute")  # `moe-pipe run`
SERVICE_ROLES = RUN_ROLES + ("gateway",)  # `moe-pipe up`


def role_bytes(role: str, n_vocab: int) -> int:
    """The estimate of one child's private pages (ROLE_PRIVATE_MIB and its vocabulary's part)."""
    if role not in ROLE_PRIVATE_MIB:
        raise ValueError(f"no memory estimate for process role {role!r}; known: {sorted(ROLE_PRIVATE_MIB)}")
    return ROLE_PRIVATE_MIB[role] * MiB + VOCAB_BYTES_PER_TOKEN.get(role, 0) * n_vocab


def engine_bytes(roles: tuple[str, ...] | list[str], n_vocab: int) -> int:
    """Estimated memory the engine's children in `roles` take beside the
    arenas and the KV cache: their private pages and the code they share."""
    private = sum(role_bytes(r, n_vocab) for r in roles)
    return private + (SHARED_CODE_MIB * MiB if roles else 0)


def service_kv_bytes(cfg: Config, spec: ModelSpec) -> int:
    """The KV caches compute holds: one of compute.ctx_size positions of compute.kv_type, or
    with several slots (gateway.parallel, docs/batching.md) the slots' pool (`kv_pool_bytes`:
    gateway.kv_pool positions together, each slot's rings and state its own), and the MTP
    drafter's one layer when drafts come from the file's block (one slot only: a slot does not
    draft from the block). The service's budget and `doctor` both take it from here."""
    n_ctx, kv_type, n = cfg.compute.ctx_size, cfg.compute.kv_type, cfg.gateway.parallel
    slots = kv_cache_bytes(spec, n_ctx, kv_type) if n == 1 else kv_pool_bytes(spec, n_ctx, kv_type, n, cfg.kv_pool_tokens)
    mtp = cfg.compute.drafts_from_block and spec.n_layer_nextn and cfg.gateway.parallel == 1
    return slots + (kv_cache_bytes(nextn_spec(spec), n_ctx, kv_type) - kv_cache_bytes(spec, n_ctx, kv_type) if mtp else 0)


def kv_lendable_bytes(cfg: Config, spec: ModelSpec) -> int:
    """What the KV cache may lend the expert cache (cache.lend_kv): one slot's whole-context
    rows, which take memory only as positions are written (a ring, compressed entries and a
    recurrent state are taken at once; several slots share a pool and lend nothing)."""
    if not cfg.cache.lend_kv or cfg.gateway.parallel != 1:
        return 0
    return cfg.compute.ctx_size * kv_position_bytes(spec, cfg.compute.kv_type)


def prompt_lendable_bytes(cfg: Config, spec: ModelSpec, top_k: int) -> int:
    """What a long prompt chunk's allowance may lend the expert cache (cache.lend_prompt): its
    activations (`prefill_activation_bytes` at compute.prefill_tokens), set aside by the budget
    but used only while a pass of many rows runs (one slot: a slot's chunk runs beside the
    others' decoding, and the slots' pool lends nothing either). The budget lends what of it
    the reserve holds beyond reserve_mb and the processes (`compute_budget`)."""
    if not cfg.cache.lend_prompt or cfg.gateway.parallel != 1:
        return 0
    return prefill_activation_bytes(spec, cfg.compute.prefill_tokens, top_k)


# Compute takes back this many slabs more than a pass needs, so a growing context asks rarely.
LOAN_AHEAD_SLABS = 8


@dataclass(frozen=True)
class KVLoan:
    """The KV cache's loan to the expert cache, as compute takes it back: while the context
    holds `positions`, its whole-context rows take at most positions × `position_bytes`
    plus a partly filled page a run (`page_slack`), and the cache gives up that many of its
    `lent_slabs` (docs/architecture.md § The KV cache's loan)."""

    n_slabs: int
    lent_slabs: int
    slab_bytes: int
    position_bytes: int
    page_slack: int

    @classmethod
    def of(cls, n_slabs: int, lent_slabs: int, slab_bytes: int, spec: ModelSpec, kv_type: str) -> KVLoan:
        """A run's arena (`n_slabs` of `slab_bytes`, `lent_slabs` of them lent) and the model's KV shape."""
        runs = kv_row_runs(spec, kv_type) * mmap.PAGESIZE
        return cls(n_slabs, lent_slabs, slab_bytes, kv_position_bytes(spec, kv_type), runs)

    def slabs_at(self, positions: int) -> int:
        """The slabs the cache may hold while the context holds `positions`."""
        if positions <= 0 or not self.lent_slabs:
            return self.n_slabs
        held = positions * self.position_bytes + self.page_slack
        return self.n_slabs - min(self.lent_slabs, -(-held // self.slab_bytes))

    @property
    def ahead(self) -> int:
        """The positions a take-back covers beyond the pass that asks for it."""
        return LOAN_AHEAD_SLABS * max(1, self.slab_bytes // max(1, self.position_bytes))


# A pass of at most this many rows (a decoded token, a verify pass of drafts, a short prompt)
# takes none of the prompt's loan back: its activations are a few MiB at most, inside the
# processes' own estimate (ROLE_PRIVATE_MIB), and a take-back around every such pass would
# cost two messages and the cache's slabs a token.
SMALL_PASS_ROWS = 32


@dataclass(frozen=True)
class PromptLoan:
    """The prompt's loan to the expert cache (docs/architecture.md § The prompt's loan): the
    cache holds `lent_slabs` more while no pass of many rows runs; before one, compute takes
    back as many as its activations need (`slabs_for`), and after it the cache has them again."""

    lent_slabs: int
    slab_bytes: int
    spec: ModelSpec
    top_k: int

    def slabs_for(self, rows: int, withheld: int = 0) -> int:
        """Of the lent slabs, those the cache may not hold while a pass of `rows` rows runs: what
        its activations need, beside the `withheld` slabs compute's own pages took (`withheld_for`)."""
        if not self.lent_slabs:
            return 0
        need = prefill_activation_bytes(self.spec, rows, self.top_k) if rows > SMALL_PASS_ROWS else 0
        return min(self.lent_slabs, withheld + -(-need // self.slab_bytes))

    def withheld_for(self, private_bytes: int) -> int:
        """The slabs never lent when compute's own pages (`private_bytes`, once warm) are above its
        estimate (`role_bytes`): kernels compiled at start-up rather than loaded from numba's
        cache stay resident, ~420 MiB against the ~255 estimated on qwen30b-shape, and take that
        much of the allowance themselves."""
        over = private_bytes - role_bytes("compute", self.spec.n_vocab)
        return min(self.lent_slabs, max(0, -(-over // self.slab_bytes)))


def pipeline_bytes(roles: tuple[str, ...] | list[str], spec: ModelSpec, prefill_tokens: int, top_k: int) -> int:
    """What the pipeline's children take beside the arenas and the KV cache: their
    processes (`engine_bytes`) and compute's largest prompt chunk in flight
    (shared/gguf/spec.py `prefill_activation_bytes`)."""
    return engine_bytes(roles, spec.n_vocab) + prefill_activation_bytes(spec, prefill_tokens, top_k)


@dataclass(frozen=True)
class CgroupLimit:
    """One level of the cgroup hierarchy that has a memory limit."""

    where: str  # e.g. "cgroup v1 /sys/fs/cgroup/memory/bench"
    limit_bytes: int
    usage_bytes: int
    inactive_file_bytes: int = 0

    @property
    def working_set_bytes(self) -> int:
        return max(0, self.usage_bytes - self.inactive_file_bytes)

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.limit_bytes - self.working_set_bytes)


@dataclass(frozen=True)
class MemoryProbe:
    """What this process tree may still allocate, and where that figure comes from."""

    host_available_bytes: int
    cgroups: tuple[CgroupLimit, ...] = ()

    @property
    def available_bytes(self) -> int:
        return min([self.host_available_bytes] + [c.headroom_bytes for c in self.cgroups])

    def describe(self) -> str:
        tight = min(self.cgroups, key=lambda c: c.headroom_bytes, default=None)
        if tight is not None and tight.headroom_bytes < self.host_available_bytes:
            return (
                f"{_mib(tight.headroom_bytes)} free in {tight.where} (limit {_mib(tight.limit_bytes)}, "
                f"working set {_mib(tight.working_set_bytes)}; host available {_mib(self.host_available_bytes)})"
            )
        return f"host available {_mib(self.host_available_bytes)}" + (
            f" (cgroup limit {_mib(tight.limit_bytes)} not tighter)" if tight is not None else ""
        )


@dataclass(frozen=True)
class Budget:
    """The resolved expert cache size; `description` is printed at start-up and recorded in telemetry."""

    bytes: int
    mode: str  # "auto" | "fixed"
    description: str
    available_bytes: int | None = None  # auto only
    dense_bytes: int = 0  # subtracted (0 unless resident)
    kv_bytes: int = 0
    reserve_bytes: int = 0  # what was left beside cache, dense and KV: max(reserve_mb, engine_bytes)
    engine_bytes: int = 0  # the estimate for the processes (auto only)
    ceil_bytes: int = 0
    clamped: bool = False
    lent_bytes: int = 0  # the KV reservation's part the cache holds until the context grows into it (auto only)
    prompt_lent_bytes: int = 0  # the prompt chunk's allowance the cache holds while no long pass runs (auto only)

    @property
    def mb(self) -> float:
        return self.bytes / MiB

    def slabs(self, slab_bytes: int, most: int) -> tuple[int, int, int]:
        """(the budget's slabs, the KV cache's loan and the prompt's loan in whole slabs on
        top), never more than `most` together: more slabs than the model has experts would
        never be used; the prompt's loan is cut first."""
        own = min(slabs_for_budget(self.bytes, slab_bytes), most)
        kv = min(own + self.lent_bytes // slab_bytes, most) - own
        prompt = min(own + kv + self.prompt_lent_bytes // slab_bytes, most) - own - kv
        return own, kv, prompt

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"mb": round(self.mb, 3)}


# cache_ceil_mb = "auto": a phone keeps most of its RAM for its OS and the apps
# beside the engine (Android kills background apps under pressure); the recipes
# that ran fastest on the 11.3 GB reference phone leave 4,000 MiB of it to the
# cache, 35 % (docs/configuration.md). A board or a
# laptop running the engine has nothing to be courteous to: a ceiling there
# leaves memory idle that the cache would turn into hits (docs/configuration.md).
PHONE_CEIL_SHARE = 0.35
NO_CEIL_MB = float(1 << 24)  # "no ceiling": the config's own upper bound on any size


def on_phone() -> bool:
    """Android, as Python reports it (3.13+) or as its filesystem shows (Termux and older Pythons)."""
    return sys.platform == "android" or os.path.exists("/system/build.prop")


def platform_ceil_mb(total_ram_bytes: int, phone: bool) -> float:
    """What cache_ceil_mb = "auto" means on this device."""
    return math.floor(total_ram_bytes * PHONE_CEIL_SHARE / MiB) if phone else NO_CEIL_MB


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.3g} MiB"


# ---------------------------------------------------------------- pure


def compute_budget(
    cache_mb: float | str,
    cache_ceil_mb: float,
    memory: MemoryProbe | None,
    *,
    dense_bytes: int,
    kv_bytes: int,
    dense_policy: str,
    reserve_mb: float = 512.0,
    engine_bytes: int = 0,
    floor_bytes: int = 0,
    lendable_bytes: int = 0,
    prompt_bytes: int = 0,
) -> Budget:
    """The budget from its inputs; no I/O. `memory` is only read when cache_mb is "auto".
    `engine_bytes` (see `engine_bytes()`) is the least the reserve may be.
    `lendable_bytes` (`kv_lendable_bytes`, part of `kv_bytes`) is lent to an auto budget
    (`Budget.lent_bytes`), the ceiling's clamp or not: the engine never holds more than
    with its context full; a fixed one borrows nothing (the cache is the size it says).
    `prompt_bytes` (`prompt_lendable_bytes`, part of `engine_bytes`) is lent to an auto budget
    as far as it raises the reserve above reserve_mb and the rest of `engine_bytes`
    (`Budget.prompt_lent_bytes`): the memory only a long prompt pass uses.

    The dense set is subtracted when it is resident ("anon", "warm"). A mapped one ("mmap") is
    file pages the kernel may drop, but every token reads all of it, so a dropped page is read
    again within the token: auto leaves it as much as the smallest cache (`floor_bytes`, one
    token's experts) lets it have, and only what it cannot have is left to paging."""
    ceil = int(cache_ceil_mb * MiB)
    dense = dense_bytes if dense_policy in RESIDENT_DENSE else 0
    if cache_mb != "auto":
        want = int(float(cache_mb) * MiB)
        size = min(want, ceil)
        text = f"budget {_mib(size)}: fixed cache_mb {float(cache_mb):g}" + (
            f", clamped to cache_ceil_mb {cache_ceil_mb:g}" if want > ceil else ""
        )
        return Budget(
            size, "fixed", text, dense_bytes=dense, kv_bytes=kv_bytes, engine_bytes=engine_bytes, ceil_bytes=ceil, clamped=want > ceil
        )
    if memory is None:
        raise ValueError("cache_mb = auto needs a memory probe")
    avail = memory.available_bytes
    asked = int(reserve_mb * MiB)
    reserve = max(asked, engine_bytes)
    if dense_policy not in RESIDENT_DENSE:
        dense = min(dense_bytes, max(0, avail - kv_bytes - reserve - floor_bytes))
    free = max(0, avail - dense - kv_bytes - reserve)
    size = min(free, ceil)
    if dense_policy in RESIDENT_DENSE or dense == dense_bytes:
        dense_text = f"dense {_mib(dense)} ({dense_policy})"
    elif dense:
        dense_text = f"dense {_mib(dense)} of {_mib(dense_bytes)} ({dense_policy}: what one token's experts leave; the rest is paged)"
    else:
        dense_text = f"dense not counted ({dense_policy}: no room beside one token's experts, paged)"
    reserve_text = (
        f"reserve {_mib(reserve)}" if reserve == asked else f"processes {_mib(reserve)} (estimated; more than reserve_mb {reserve_mb:g})"
    )
    lent = max(0, lendable_bytes)  # counted in kv_bytes already: the memory is there, ceiling or not
    prompt_lent = max(0, reserve - max(asked, engine_bytes - max(0, prompt_bytes)))  # counted in the reserve: there too
    text = f"budget {_mib(size)}: auto = {memory.describe()} - {dense_text} - KV {_mib(kv_bytes)} - {reserve_text} = {_mib(free)}" + (
        f", clamped to cache_ceil_mb {cache_ceil_mb:g}" if free > ceil else ""
    )
    if lent:
        text += f"; and up to {_mib(lent)} of the KV cache's while the context is short"
    if prompt_lent:
        text += f"; and {_mib(prompt_lent)} of a long prompt's while none runs"
    return Budget(
        size,
        "auto",
        text,
        available_bytes=avail,
        dense_bytes=dense,
        kv_bytes=kv_bytes,
        reserve_bytes=reserve,
        engine_bytes=engine_bytes,
        ceil_bytes=ceil,
        clamped=free > ceil,
        lent_bytes=lent,
        prompt_lent_bytes=prompt_lent,
    )


@dataclass(frozen=True)
class CacheFloor:
    """The smallest expert cache that runs well: one token's working set, every
    MoE layer's top-k experts, one slab each (leading dense layers have none). Progress alone needs only one layer's
    top_k pinned slabs, but below a token's set LRU evicts each expert before
    the next token can reuse it, and every lookup misses."""

    n_layer: int  # the layers with experts
    top_k: int
    slab_bytes: int

    @classmethod
    def of(cls, layout: Any, top_k: int | None = None) -> CacheFloor:
        """From a gguf Layout; `top_k` None is the model's own n_expert_used."""
        return cls(len(layout.spec.moe_layers), layout.spec.n_expert_used if top_k is None else top_k, layout.slab_bytes)

    @property
    def bytes(self) -> int:
        return self.n_layer * self.top_k * self.slab_bytes

    @property
    def mib(self) -> float:
        """Rounded up to 0.01 MiB: a printed figure must suffice when it is set."""
        return math.ceil(self.bytes * 100 / MiB) / 100

    def describe(self) -> str:
        return f"{self.mib:.2f} MiB = {self.n_layer} layers x top-{self.top_k} experts x {self.slab_bytes / MiB:.2f} MiB slabs"


def slabs_for_budget(budget_bytes: int, slab_bytes: int) -> int:
    """How many whole slabs fit in the budget (the slab arena is the budget)."""
    if slab_bytes <= 0:
        raise ValueError(f"slab size must be positive, got {slab_bytes}")
    return max(0, int(budget_bytes) // slab_bytes)


def check_floor(budget: Budget, floor: CacheFloor, where: str = "config") -> int:
    """The slab count of `budget`, or a one-line ConfigError when it is below
    one token's working set: what the cache is (and why, for auto), what the
    floor needs and is made of, and what would work."""
    if budget.bytes >= floor.bytes:
        return slabs_for_budget(budget.bytes, floor.slab_bytes)
    need = f"one token's working set of {floor.describe()}"
    if budget.mode == "fixed":
        fix = f"set cache_mb to at least {floor.mib:g}" + (f" and cache_ceil_mb to at least {floor.mib:g}" if budget.clamped else "")
        raise ConfigError(f"{where}: expert cache of {budget.bytes / MiB:.2f} MiB is below {need}; {fix}")
    if budget.clamped:
        raise ConfigError(f"{where}: cache_ceil_mb {budget.ceil_bytes / MiB:g} is below {need}; raise it to at least {floor.mib:g}")
    # What is missing: against what was left before the 0 MiB clamp, so a limit raised by this much works.
    left = (budget.available_bytes or 0) - budget.dense_bytes - budget.kv_bytes - budget.reserve_bytes
    short = floor.bytes - min(budget.bytes, left)
    # Lowering reserve_mb only helps down to the processes' own estimate.
    lower = "lower cache.reserve_mb, " if budget.reserve_bytes > budget.engine_bytes else ""
    raise ConfigError(
        f"{where}: not enough memory for the expert cache: {budget.description}, but it needs {need} "
        f'({short / MiB:.4g} MiB short); raise the memory limit, {lower}use dense_weights = "mmap", or fewer experts per token (--n-expert-used, lossy)'
    )


def check_fit(budget: Budget, memory: MemoryProbe | None, where: str = "config") -> None:
    """Refuse a fixed cache that, with the dense set, KV and the processes, is
    more than the memory there is: it would be OOM-killed mid-run, not refused."""
    if budget.mode != "fixed" or memory is None:
        return
    need = budget.bytes + budget.dense_bytes + budget.kv_bytes + budget.engine_bytes
    if need > memory.available_bytes:
        raise ConfigError(
            f"{where}: cache_mb {budget.bytes / MiB:g} does not fit: cache + dense {_mib(budget.dense_bytes)} + KV "
            f"{_mib(budget.kv_bytes)} + processes {_mib(budget.engine_bytes)} (estimated) = {_mib(need)}, but "
            f"{memory.describe()}; lower cache_mb to {max(0, (memory.available_bytes - need + budget.bytes)) // MiB} "
            f'or less, or use cache_mb = "auto"'
        )


# ---------------------------------------------------------------- probing


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, names: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    stats = dict(line.split(None, 1) for line in lines if " " in line)
    for name in names:
        if name in stats:
            try:
                return int(stats[name])
            except ValueError:
                pass
    return 0


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(v1 memory path, v2 path) of this process, from /proc/self/cgroup."""
    v1 = v2 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _walk(mount: Path, rel: str):
    """The cgroup's folder and its ancestors up to the mount, tightest first.

    Inside a container the mount's root may already be this cgroup (cgroup
    namespaces), so leading components that do not exist are dropped.
    """
    parts = [p for p in rel.split("/") if p]
    while parts and not (mount.joinpath(*parts)).is_dir():
        parts.pop(0)
    while True:
        yield mount.joinpath(*parts) if parts else mount
        if not parts:
            return
        parts.pop()


def _v1_limits(mount: Path, rel: str) -> list[CgroupLimit]:
    out = []
    for d in _walk(mount, rel):
        limit = _read_int(d / "memory.limit_in_bytes")
        if limit is None or limit >= UNLIMITED:
            continue
        usage = _read_int(d / "memory.usage_in_bytes") or 0
        inactive = _stat_value(d / "memory.stat", ("total_inactive_file", "inactive_file"))
        out.append(CgroupLimit(f"cgroup v1 {d}", limit, usage, inactive))
    return out


def _v2_limits(mount: Path, rel: str) -> list[CgroupLimit]:
    out = []
    for d in _walk(mount, rel):
        # memory.high throttles hard before memory.max kills; the tighter of the two is the limit to plan for.
        limits = [x for x in (_read_int(d / "memory.max"), _read_int(d / "memory.high")) if x is not None and x < UNLIMITED]
        if not limits or d == mount:  # the root cgroup has no memory.max
            continue
        usage = _read_int(d / "memory.current") or 0
        inactive = _stat_value(d / "memory.stat", ("inactive_file",))
        out.append(CgroupLimit(f"cgroup v2 {d}", min(limits), usage, inactive))
    return out


def _host_available() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil is a declared runtime dependency; /proc/meminfo says the same thing
        kib = _stat_value(Path("/proc/meminfo"), ("MemAvailable:",))
        return kib * 1024


def probe_memory(
    sys_cgroup: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup", host_available_bytes: int | None = None
) -> MemoryProbe:
    """Memory this process tree may still use: host available and every enclosing cgroup v1/v2 limit.

    The arguments exist so tests can point it at fake trees; callers use the defaults.
    """
    root = Path(sys_cgroup)
    v1, v2 = _own_cgroups(Path(proc_cgroup))
    limits: list[CgroupLimit] = []
    if v1 is not None and (root / "memory").is_dir():
        limits += _v1_limits(root / "memory", v1)
    if v2 is not None:
        # unified hierarchy at the root (pure v2) or at unified/ (hybrid, as on these machines)
        mount = root if (root / "cgroup.controllers").exists() else root / "unified"
        if mount.is_dir():
            limits += _v2_limits(mount, v2)
    host = _host_available() if host_available_bytes is None else host_available_bytes
    return MemoryProbe(host, tuple(limits))


def resolve_budget(
    cfg: Config,
    *,
    dense_bytes: int,
    kv_bytes: int,
    floor: CacheFloor | None = None,
    memory: MemoryProbe | None = None,
    engine_bytes: int = 0,
    check_memory: bool = False,
    floor_bytes: int = 0,
    lendable_bytes: int = 0,
    prompt_bytes: int = 0,
) -> Budget:
    """The budget for a loaded Config (`cfg.cache`, `cfg.io.dense_weights`); probes memory when auto.

    With `floor` (CacheFloor.of(layout, top_k)), a budget below it is a ConfigError with the numbers;
    `floor_bytes` is that floor for a caller that checks it itself (a mapped dense set keeps what
    the floor leaves: compute_budget).
    `engine_bytes` (`engine_bytes(roles, n_vocab)`) is the least auto leaves for the processes; with
    `check_memory` a fixed cache that cannot fit beside them is refused too (`check_fit`).
    """
    c = cfg.cache
    if (c.cache_mb == "auto" or check_memory) and memory is None:
        memory = probe_memory()
    ceil_mb = c.cache_ceil_mb
    if ceil_mb == "auto":
        import psutil

        ceil_mb = platform_ceil_mb(psutil.virtual_memory().total, on_phone())
    budget = compute_budget(
        c.cache_mb,
        float(ceil_mb),
        memory,
        dense_bytes=dense_bytes,
        kv_bytes=kv_bytes,
        dense_policy=cfg.io.dense_weights,
        reserve_mb=c.reserve_mb,
        engine_bytes=engine_bytes,
        floor_bytes=floor.bytes if floor is not None else floor_bytes,
        lendable_bytes=lendable_bytes,
        prompt_bytes=prompt_bytes,
    )
    where = cfg.source or "config"
    if floor is not None:
        check_floor(budget, floor, where)
    if check_memory:
        check_fit(budget, memory, where)
    return budget


if __name__ == "__main__":
    probe = probe_memory()
    print(probe.describe())
    for c in probe.cgroups:
        print(" ", c)
    print("pid", os.getpid())
