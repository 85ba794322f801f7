"""What outlives any child process: the runtime dir (ipc sockets), the slab
arena (the expert cache), the residency index and the dense arena.

`Resources.create` decides the budget (refused with the numbers before
anything is allocated), then allocates each piece; the object exists only
once every piece does, and a failure half-way releases what was made.
`close()` releases everything, once, whoever calls it (the parent of a run,
the supervisor, a test).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..shared.config import Config
from ..shared.errors import PipelineError, UserError
from ..shared.experts import shm
from ..shared.experts.budget import (
    RUN_ROLES,
    CacheFloor,
    kv_lendable_bytes,
    pipeline_bytes,
    prompt_lendable_bytes,
    resolve_budget,
    service_kv_bytes,
)
from ..shared.experts.dense import arena_bytes
from ..shared.experts.directio import ExpertFiles, describe_os_error, model_identity
from ..shared.experts.hotset import hottest_experts
from ..shared.experts.populate import Populator
from ..shared.experts.residency import ResidencyIndex
from ..shared.gguf.model_file import open_model
from ..shared.gguf.nextn import require_nextn
from ..shared.gguf.spec import experts_per_token, lossy_expert_count
from ..shared.model.trace import read_trace
from ..shared.wire import ipc
from ..shared.wire import messages as m

T = TypeVar("T")


@dataclass(frozen=True)
class Resolved:
    """What start-up decided, for the preamble and the summary."""

    budget_bytes: int
    budget_description: str
    n_slabs: int
    slab_bytes: int
    load_seconds: float
    direct_io: bool
    model_identity: tuple[str, ...] = ()  # of every shard at start-up: children refuse any other file
    io_align: int = 4096  # Layout.align resolved here once; children open the model with it (shared/gguf/alignment.py)
    lent_slabs: int = 0  # of n_slabs, those the KV cache lends until its context grows into them (cache.lend_kv)
    prompt_lent_slabs: int = 0  # of n_slabs, those a long prompt's allowance lends while none runs (cache.lend_prompt)


def cache_description(budget_text: str, n_slabs: int, budget_slabs: int) -> str:
    """How the cache's size came about, beside the size itself in one start-up line: the
    budget's own line, or, when the model's experts all fit in less, that they do (the
    cache is then smaller than the budget, and the line said two sizes with no reason)."""
    if n_slabs < budget_slabs:
        return f"every expert of the model, under the {budget_text}"
    return budget_text


class Resources:
    """The runtime dir, the slab arena, the residency index and (with
    dense_weights "anon") the dense arena, all made: see `create`."""

    def __init__(
        self,
        rt: ipc.RuntimeDir,
        slabs: shm.SlabArena,
        index: ResidencyIndex,
        dense: shm.Arena | None,
        resolved: Resolved,
    ):
        self.rt, self.slabs, self.index, self.dense, self.resolved = rt, slabs, index, dense, resolved
        self.closed = False

    @classmethod
    def create(
        cls, cfg: Config, model_path: str | os.PathLike, progress: Callable[[str], None] | None = None, roles: tuple[str, ...] = RUN_ROLES
    ) -> Resources:
        """Check the settings against the model, resolve the budget, allocate.
        `roles`: the children that will run beside the arenas (their memory is
        left out of an auto budget)."""
        shm.reclaim_stale()
        ipc.RuntimeDir.reclaim_stale()
        t0 = time.perf_counter()
        with open_model(Path(model_path)) as mf, ExitStack() as undo:
            layout, spec = mf.layout, mf.spec
            top_k = experts_per_token(spec, cfg.compute.n_expert_used)
            if cfg.compute.threads and cfg.compute.threads > (os.cpu_count() or 1):
                raise UserError(f"--threads {cfg.compute.threads}: this machine has {os.cpu_count()} cores")
            if cfg.cache.warm_from:  # a bad trace is the user's error, before anything starts
                hottest_experts(str(cfg.cache.warm_from), spec, 1)
            if cfg.compute.drafts_from_block:
                require_nextn(spec)
            if cfg.compute.route_replay:
                from ..shared.model.routes import RouteReplay  # model code: only when a trace drives the run

                RouteReplay(read_trace(str(cfg.compute.route_replay)), spec)
            # Refused here, with the numbers, rather than OOM-killed once the arenas and children exist:
            # a budget below one token's experts says what that floor is made of (and, for auto, the
            # memory it found); a fixed one that cannot fit beside the processes says so.
            budget = resolve_budget(
                cfg,
                dense_bytes=layout.dense_bytes,
                kv_bytes=service_kv_bytes(cfg, spec),  # N slots: N caches (an undercount was OOM-killed at --parallel 4)
                floor=CacheFloor.of(layout, top_k),
                engine_bytes=pipeline_bytes(roles, spec, cfg.compute.prefill_tokens, top_k),
                check_memory=True,
                lendable_bytes=kv_lendable_bytes(cfg, spec),
                prompt_bytes=prompt_lendable_bytes(cfg, spec, top_k),
            )
            own, lent, prompt_lent = budget.slabs(layout.slab_bytes, spec.n_layer * spec.n_expert)
            n_slabs = own + lent + prompt_lent
            lossy = lossy_expert_count(spec, cfg.compute.n_expert_used)
            if lossy:  # after the checks above, so a refusal stays the one line
                print(lossy, file=sys.stderr)
            if progress:  # only now: a refusal above is the one line the user sees
                progress("starting: dense weights, compute process, then its kernels to compile")
            identity = _read_or_fail(lambda: model_identity(mf.gguf.paths), "reading the model file's header")
            rt = ipc.RuntimeDir.create()
            undo.callback(rt.remove)
            # Every slab page is allocated before start-up ends: the budget is committed up
            # front (a memory limit that cannot hold it fails here, not mid-run), and no first
            # read into a slab pays for page allocation. A thread does it beside the dense
            # read, which mostly waits on the disk while the kernel zeroes the slabs' pages.
            slabs = shm.SlabArena.create(shm.segment_name("slabs"), n_slabs, layout.slab_bytes)
            undo.callback(_release, slabs)
            reserving = ThreadPoolExecutor(1, thread_name_prefix="reserve-slabs")
            undo.callback(reserving.shutdown)  # before the arena is released: the thread is done with it
            # The prompt's loan is not the cache's while compute warms up (compiling the kernels
            # takes memory of its own): its slabs, the arena's last, get pages once compute lends them.
            reserved = reserving.submit(slabs.arena.reserve, (n_slabs - prompt_lent) * layout.slab_bytes)
            index = ResidencyIndex.create(spec)
            undo.callback(_release, index)
            if prompt_lent:
                index.usable = n_slabs - prompt_lent  # the reader holds to it from the start
            dense, direct = None, True
            if cfg.io.dense_weights == "anon":
                if progress:
                    progress(f"reading the dense set ({layout.dense_bytes / 2**20:,.0f} MiB) into shared memory")
                arena = dense = shm.Arena.create(shm.segment_name("dense"), max(arena_bytes(layout), 4096))
                undo.callback(_release, arena)
                # Its pages are made and mapped on a thread just ahead of the reads,
                # which then run at the disk's rate (shared/experts/populate.py).
                ahead = Populator(arena, what="dense set").start() if cfg.io.populate else None
                try:
                    with ExpertFiles(mf.gguf.paths, identity=identity, align=layout.align) as files:
                        _read_or_fail(lambda: files.read_dense(layout.dense, arena.buf), "reading the dense set")
                        direct = files.direct
                finally:
                    if ahead is not None:
                        ahead.stop()
            reserved.result()  # its failure (no room for the slabs) is start-up's, as before
            reserving.shutdown()
            resolved = Resolved(
                budget.bytes,
                cache_description(budget.description, n_slabs, sum(budget.slabs(layout.slab_bytes, most=sys.maxsize))),
                n_slabs,
                layout.slab_bytes,
                time.perf_counter() - t0,
                direct,
                identity,
                layout.align,
                lent,
                prompt_lent,
            )
            res = cls(rt, slabs, index, dense, resolved)
            undo.pop_all()  # made whole: from here close() releases it
        return res

    def close(self) -> None:
        """Unmap and unlink the arenas, remove the runtime dir. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for arena in (self.slabs, self.dense, self.index):
            if arena is not None:
                _release(arena)
        self.rt.remove()

    def __enter__(self) -> Resources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(arena: shm.SlabArena | shm.Arena | ResidencyIndex) -> None:
    arena.close()
    arena.unlink()


def _read_or_fail(read: Callable[[], T], what: str) -> T:
    """A disk fault at start-up is the run's failure, in one line (exit 1), not a traceback."""
    try:
        return read()
    except OSError as exc:  # DiskReadError, ModelChanged, or the open itself
        raise PipelineError(f"{what} failed: {describe_os_error(exc)}") from exc


def run_info(cfg: Config, res: Resources, model_path: str | os.PathLike, load_seconds: float) -> m.RunInfo:
    """The run's header for telemetry (the CSV preamble, the JSONL's first line)."""
    r = res.resolved
    flat: dict[str, str | int | float | bool | None] = {
        f"{table}.{k}": (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
        for table, keys in cfg.to_dict().items()
        for k, v in keys.items()
    }
    model: dict[str, str | int | float | bool | None] = {
        "path": str(model_path),
        "slab_bytes": r.slab_bytes,
        "slabs": r.n_slabs,
        "direct_io": r.direct_io,
        "budget": r.budget_description,
    }
    return m.RunInfo(f"{os.getpid()}-{int(time.time())}", time.time(), flat, model, r.n_slabs * r.slab_bytes, load_seconds)
