"""The small parent of a one-shot run: makes the arenas, starts reader,
compute and telemetry, feeds one or more generations, and takes everything
down again on every exit path.

    parent ──requests──► compute ──fetch/release──► reader ◄── model.gguf (O_DIRECT)
      ▲                    │  ◄──────ready (slab ids)──┘  │
      └──────tokens────────┤   maps slabs read-only        writes slabs
                           └──records──► telemetry ──PUB──► tails

Owned here, released in `close()` whatever happened: the runtime dir (ipc
sockets), the slab arena, the dense arena, the child processes. Stale
segments and runtime dirs of a parent that died by kill -9 are reclaimed at
the next start (their pid is dead). Children die with their parent
(PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import zmq

from moe_pipe.shared.errors import PipelineError, UserError
from moe_pipe.shared.experts import shm
from moe_pipe.shared.experts.budget import RUN_ROLES, engine_bytes, resolve_budget
from moe_pipe.shared.experts.cache import check_budget
from moe_pipe.shared.experts.dense import arena_bytes
from moe_pipe.shared.experts.directio import ExpertFiles, describe_os_error, model_identity
from moe_pipe.shared.experts.residency import ResidencyIndex
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.spec import kv_cache_bytes
from moe_pipe.shared.model.routes import RouteReplay
from moe_pipe.shared.model.trace import read_trace
from moe_pipe.shared.wire import ipc
from moe_pipe.shared.wire import messages as m

from . import compute, reader, telemetry
from .lifecycle import describe_exit

log = logging.getLogger("moe_pipe.pipeline")
START_TIMEOUT_S = 120.0  # compute's start includes first-use kernel compiles
STOP_WAIT_S = 5.0
POLL_MS = 200


@dataclass(frozen=True)
class Resolved:
    """What start-up decided, for the preamble and the summary."""

    budget_bytes: int
    budget_description: str
    n_slots: int
    slab_bytes: int
    load_seconds: float
    direct_io: bool
    model_identity: tuple[str, ...] = ()  # of every shard at start-up: children refuse any other file


class Resources:
    """What outlives any child: the runtime dir, the slab arena (the expert
    cache), the residency index and the dense arena. Made by the parent of a
    run or by the supervisor, released by `close()` (idempotent)."""

    def __init__(self):
        self.rt: ipc.RuntimeDir | None = None
        self.slabs: shm.SlabArena | None = None
        self.dense: shm.Arena | None = None
        self.index: ResidencyIndex | None = None
        self.resolved: Resolved | None = None

    @classmethod
    def create(cls, cfg, model_path: Path, progress: Callable[[str], None] | None = None, roles: tuple[str, ...] = RUN_ROLES) -> Resources:
        """`roles`: the children that will run beside the arenas (their memory is
        left out of an auto budget)."""
        res = cls()
        try:
            res._create(cfg, Path(model_path), progress, roles)
        except BaseException:
            res.close()
            raise
        return res

    def _create(self, cfg, model_path: Path, progress, roles: tuple[str, ...]) -> None:
        shm.reclaim_stale()
        ipc.RuntimeDir.reclaim_stale()
        t0 = time.perf_counter()
        with open_model(model_path) as mf:
            layout, spec = mf.layout, mf.spec
            top_k = cfg.compute.top_k or spec.n_expert_used
            if top_k > spec.n_expert:
                raise UserError(f"--top-k {top_k} is out of range: this model has {spec.n_expert} experts")
            if cfg.compute.threads and cfg.compute.threads > (os.cpu_count() or 1):
                raise UserError(f"--threads {cfg.compute.threads}: this machine has {os.cpu_count()} cores")
            if cfg.cache.warm_from:  # a bad trace is the user's error, before anything starts
                reader.hottest_experts(str(cfg.cache.warm_from), spec, 1)
            if cfg.compute.route_replay:
                RouteReplay(read_trace(str(cfg.compute.route_replay)), spec)
            # Refused here, with the numbers, rather than OOM-killed once the arenas and children exist:
            # an auto budget below one token's experts names the memory it found; a fixed one that
            # cannot fit beside the processes says so (check_budget names a fixed one below the floor).
            auto = cfg.cache.cache_mb == "auto"
            budget = resolve_budget(
                cfg,
                dense_bytes=layout.dense_bytes,
                kv_bytes=kv_cache_bytes(spec, cfg.compute.ctx_size),
                min_bytes=layout.min_cache_bytes(top_k) if auto else None,
                engine_bytes=engine_bytes(roles, spec.n_vocab),
                check_memory=True,
            )
            # More slabs than experts would never be used.
            n_slots = min(check_budget(budget.bytes, layout, top_k), spec.n_layer * spec.n_expert)
            slab_bytes = layout.slab_bytes
            identity = _read_or_fail(lambda: model_identity(mf.gguf.paths), "reading the model file's header")
            self.rt = ipc.RuntimeDir.create()
            # Every slab page is allocated now: the budget is committed up front
            # (a memory limit that cannot hold it fails here, not mid-run), and
            # no first read into a slab pays for page allocation.
            self.slabs = shm.SlabArena.create(shm.segment_name("slabs"), n_slots, slab_bytes, reserve=True)
            self.index = ResidencyIndex.create(spec)
            direct = True
            if cfg.io.dense_weights == "anon":
                if progress:
                    progress(f"reading the dense set ({layout.dense_bytes / 2**20:,.0f} MiB) into shared memory")
                self.dense = shm.Arena.create(shm.segment_name("dense"), max(arena_bytes(layout), 4096))
                with ExpertFiles(mf.gguf.paths, identity=identity) as files:
                    _read_or_fail(lambda: files.read_dense(layout.dense, self.dense.buf), "reading the dense set")
                    direct = files.direct
        self.resolved = Resolved(budget.bytes, budget.description, n_slots, slab_bytes, time.perf_counter() - t0, direct, identity)

    def close(self) -> None:
        for arena in (self.slabs, self.dense, self.index):
            if arena is not None:
                arena.close()
                arena.unlink()
        self.slabs = self.dense = self.index = None
        if self.rt is not None:
            self.rt.remove()
            self.rt = None


def _read_or_fail(read: Callable, what: str):
    """A disk fault at start-up is the run's failure, in one line (exit 1), not a traceback."""
    try:
        return read()
    except OSError as exc:  # DiskReadError, ModelChanged, or the open itself
        raise PipelineError(f"{what} failed: {describe_os_error(exc)}") from exc


def telemetry_args(cfg, res: Resources) -> telemetry.TelemetryConfig:
    return telemetry.TelemetryConfig(str(res.rt.path), str(cfg.telemetry.csv or ""))


def reader_args(cfg, res: Resources, model_path: Path) -> reader.ReaderConfig:
    r = res.resolved
    return reader.ReaderConfig(
        str(model_path),
        str(res.rt.path),
        res.slabs.arena.name,
        r.slab_bytes,
        r.n_slots,
        cfg.io.io_threads,
        cfg.cache.policy,
        index_arena=res.index.name,
        warm_from=str(cfg.cache.warm_from or ""),
        model_identity=r.model_identity,
    )


def compute_args(cfg, res: Resources, model_path: Path, reader_pid: int) -> compute.ComputeConfig:
    r, c = res.resolved, cfg.compute
    return compute.ComputeConfig(
        str(model_path),
        str(res.rt.path),
        res.slabs.arena.name,
        r.slab_bytes,
        r.n_slots,
        reader_pid,
        dense_weights=cfg.io.dense_weights,
        dense_arena=res.dense.name if res.dense else "",
        index_arena=res.index.name,
        overlap=c.overlap,
        prefetch=c.prefetch == "next-layer",
        top_k=c.top_k,
        threads=c.threads,
        ctx_size=c.ctx_size,
        drop_cold_experts=c.drop_cold_experts,
        cache_route=c.cache_route,
        route_trace=str(cfg.telemetry.route_trace or ""),
        route_replay=str(c.route_replay or ""),
        model_identity=r.model_identity,
    )


def run_info(cfg, res: Resources, model_path: Path, load_seconds: float) -> m.RunInfo:
    r = res.resolved
    flat = {
        f"{table}.{k}": (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
        for table, keys in cfg.to_dict().items()
        for k, v in keys.items()
    }
    model = {
        "path": str(model_path),
        "slab_bytes": r.slab_bytes,
        "slots": r.n_slots,
        "direct_io": r.direct_io,
        "budget": r.budget_description,
    }
    return m.RunInfo(f"{os.getpid()}-{int(time.time())}", time.time(), flat, model, r.n_slots * r.slab_bytes, load_seconds)


class Pipeline:
    def __init__(self, cfg, model_path: Path):
        self.cfg, self.model_path = cfg, Path(model_path)
        self.procs: dict[str, mp.Process] = {}
        self.res: Resources | None = None
        self.ctx: zmq.Context | None = None
        self.socks: dict[str, zmq.Socket] = {}
        self.resolved: Resolved | None = None
        self._req = 0

    @property
    def rt(self) -> ipc.RuntimeDir | None:
        return self.res.rt if self.res else None

    # -- start ---------------------------------------------------------------
    def start(self) -> Pipeline:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        t0 = time.perf_counter()
        self.res = Resources.create(self.cfg, self.model_path)
        self.resolved = self.res.resolved
        self._spawn()
        self._connect()
        self._wait_for_compute()
        # load_seconds: everything before the first token can be computed —
        # the dense load here and compute's own start (warm sweep, mapping).
        self.resolved = replace(self.resolved, load_seconds=time.perf_counter() - t0)
        ipc.send(self.socks["telemetry"], run_info(self.cfg, self.res, self.model_path, self.resolved.load_seconds))

    def _spawn(self) -> None:
        # OMP_WAIT_POLICY is left as the user has it. Measured here (8-layer
        # qwen30b-shape, 600 MiB cache): PASSIVE cuts compute's messaging time
        # 5.2 → 1.4 ms and flash stall 12.5 → 3.9 ms per token, because numba's
        # OpenMP threads stop spinning on the cores the reader needs — but each
        # kernel call then wakes sleeping threads, and decode fell from 20–24 to
        # 16–19 tok/s. Throughput wins.
        cfg, res = self.cfg, self.res
        spawn = mp.get_context("spawn")
        for name, target, args in (
            ("telemetry", telemetry.main, lambda: telemetry_args(cfg, res)),
            ("reader", reader.main, lambda: reader_args(cfg, res, self.model_path)),
            ("compute", compute.main, lambda: compute_args(cfg, res, self.model_path, self.procs["reader"].pid)),
        ):
            self.procs[name] = spawn.Process(target=target, name=f"moe-pipe-{name}", daemon=True, args=(args(),))
            self.procs[name].start()

    def _connect(self) -> None:
        self.ctx = zmq.Context()
        ep = self.rt.endpoints
        self.socks["tokens"] = ipc.bind(self.ctx, ep, "tokens")
        self.socks["requests"] = ipc.connect(self.ctx, ep, "requests")
        self.socks["fetch"] = ipc.connect(self.ctx, ep, "fetch")  # to tell the reader to stop
        self.socks["telemetry"] = ipc.connect(self.ctx, ep, "telemetry_in")

    def _wait_for_compute(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_children()
            if ipc.recv(self.socks["tokens"], POLL_MS, expect=(m.Hello,)) is not None:
                return
        raise PipelineError(f"compute did not start within {START_TIMEOUT_S:.0f} s")

    # -- generate ----------------------------------------------------------------
    def generate(
        self,
        prompt_tokens: list[int],
        sampling: dict,
        max_tokens: int,
        stop: tuple[str, ...] = (),
        on_text: Callable[[str], None] | None = None,
        ignore_eos: bool = False,
    ) -> m.Done:
        self._req += 1
        ipc.send(self.socks["requests"], m.Generate(self._req, tuple(prompt_tokens), max_tokens, sampling, tuple(stop), ignore_eos))
        while True:
            self._check_children()
            msg = ipc.recv(self.socks["tokens"], POLL_MS, expect=(m.Token, m.Done, m.Hello))
            if msg is None or isinstance(msg, m.Hello) or msg.req_id != self._req:
                continue
            if isinstance(msg, m.Token):
                if on_text:
                    on_text(msg.text)
                continue
            if not msg.ok:
                raise PipelineError(f"generation failed ({msg.code}): {msg.error}")
            return msg

    def _check_children(self) -> None:
        for name, p in self.procs.items():
            if not p.is_alive():
                raise PipelineError(f"the {name} process {describe_exit(p.exitcode)}; the run was stopped")

    # -- stop ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop children in order (compute, reader, telemetry), then release
        sockets, arenas and the runtime dir. Safe to call more than once."""
        for name, sock in (("compute", "requests"), ("reader", "fetch"), ("telemetry", "telemetry")):
            p = self.procs.get(name)
            if p is not None and p.is_alive() and sock in self.socks:
                try:
                    ipc.send(self.socks[sock], m.Shutdown("run finished"), timeout_ms=200)
                except ipc.PeerTimeout:
                    pass
            if p is not None:
                _stop(p)
        self.procs.clear()
        for sock in self.socks.values():
            sock.close(linger=0)
        self.socks.clear()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.res is not None:
            self.res.close()
            self.res = None

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(p: mp.Process) -> None:
    """Shutdown was asked; then SIGTERM; then SIGKILL."""
    p.join(STOP_WAIT_S)
    if p.is_alive():
        p.terminate()
        p.join(STOP_WAIT_S)
    if p.is_alive():
        p.kill()
        p.join()
