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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import zmq

from ..shared import ipc, messages as m, shm
from ..shared.budget import resolve_budget
from ..shared.cache import check_budget
from ..shared.dense import arena_bytes
from ..shared.directio import ExpertFiles
from ..shared.errors import PipelineError, UserError
from ..shared.model_file import open_model
from ..shared.residency import ResidencyIndex
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


def kv_cache_bytes(spec, n_ctx: int) -> int:
    return 4 * n_ctx * sum(hk * (dk + dv) for hk, dk, dv in zip(spec.n_head_kv, spec.head_dim_k, spec.head_dim_v))


class Pipeline:
    def __init__(self, cfg, model_path: Path):
        self.cfg, self.model_path = cfg, Path(model_path)
        self.procs: dict[str, mp.Process] = {}
        self.rt: ipc.RuntimeDir | None = None
        self.slabs: shm.SlabArena | None = None
        self.dense: shm.Arena | None = None
        self.index: ResidencyIndex | None = None
        self.ctx: zmq.Context | None = None
        self.socks: dict[str, zmq.Socket] = {}
        self.resolved: Resolved | None = None
        self._req = 0

    # -- start ---------------------------------------------------------------
    def start(self) -> "Pipeline":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        cfg = self.cfg
        shm.reclaim_stale()
        ipc.RuntimeDir.reclaim_stale()
        t0 = time.perf_counter()
        with open_model(self.model_path) as mf:
            layout, spec = mf.layout, mf.spec
            top_k = cfg.compute.top_k or spec.n_expert_used
            if top_k > spec.n_expert:
                raise UserError(f"--top-k {top_k} is out of range: this model has {spec.n_expert} experts")
            if cfg.compute.threads and cfg.compute.threads > (os.cpu_count() or 1):
                raise UserError(f"--threads {cfg.compute.threads}: this machine has {os.cpu_count()} cores")
            budget = resolve_budget(cfg, dense_bytes=layout.dense_bytes, kv_bytes=kv_cache_bytes(spec, cfg.compute.ctx_size))
            # More slabs than experts would never be used.
            n_slots = min(check_budget(budget.bytes, layout, top_k), spec.n_layer * spec.n_expert)
            slab_bytes = layout.slab_bytes
            self.rt = ipc.RuntimeDir.create()
            self.slabs = shm.SlabArena.create(shm.segment_name("slabs"), n_slots, slab_bytes)
            self.index = ResidencyIndex.create(spec)
            direct = True
            if cfg.io.dense_weights == "anon":
                self.dense = shm.Arena.create(shm.segment_name("dense"), max(arena_bytes(layout), 4096))
                with ExpertFiles(mf.gguf.paths) as files:
                    files.read_dense(layout.dense, self.dense.buf)
                    direct = files.direct
        self.resolved = Resolved(budget.bytes, budget.description, n_slots, slab_bytes, time.perf_counter() - t0, direct)
        self._spawn(n_slots, slab_bytes)
        self._connect()
        self._wait_for_compute()
        # load_seconds: everything before the first token can be computed —
        # the dense load here and compute's own start (warm sweep, mapping).
        self.resolved = replace(self.resolved, load_seconds=time.perf_counter() - t0)
        self._send_run_info()

    def _spawn(self, n_slots: int, slab_bytes: int) -> None:
        # OMP_WAIT_POLICY is left as the user has it. Measured here (8-layer
        # qwen30b-shape, 600 MiB cache): PASSIVE cuts compute's messaging time
        # 5.2 → 1.4 ms and flash stall 12.5 → 3.9 ms per token, because numba's
        # OpenMP threads stop spinning on the cores the reader needs — but each
        # kernel call then wakes sleeping threads, and decode fell from 20–24 to
        # 16–19 tok/s. Throughput wins.
        cfg, rt = self.cfg, str(self.rt.path)
        spawn = mp.get_context("spawn")
        self.procs["telemetry"] = spawn.Process(target=telemetry.main, name="moe-pipe-telemetry", daemon=True,
                                                args=(telemetry.TelemetryConfig(rt, str(cfg.telemetry.csv or "")),))
        self.procs["telemetry"].start()
        self.procs["reader"] = spawn.Process(target=reader.main, name="moe-pipe-reader", daemon=True, args=(reader.ReaderConfig(
            str(self.model_path), rt, self.slabs.arena.name, slab_bytes, n_slots, cfg.io.io_threads, cfg.cache.policy,
            index_arena=self.index.name),))
        self.procs["reader"].start()
        self.procs["compute"] = spawn.Process(target=compute.main, name="moe-pipe-compute", daemon=True, args=(compute.ComputeConfig(
            str(self.model_path), rt, self.slabs.arena.name, slab_bytes, n_slots, self.procs["reader"].pid,
            dense_weights=cfg.io.dense_weights, dense_arena=self.dense.name if self.dense else "", index_arena=self.index.name,
            overlap=cfg.compute.overlap, prefetch=cfg.compute.prefetch == "next-layer", top_k=cfg.compute.top_k, threads=cfg.compute.threads,
            ctx_size=cfg.compute.ctx_size),))
        self.procs["compute"].start()

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

    def _send_run_info(self) -> None:
        cfg, r = self.cfg, self.resolved
        flat = {f"{table}.{k}": (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                for table, keys in cfg.to_dict().items() for k, v in keys.items()}
        model = {"path": str(self.model_path), "slab_bytes": r.slab_bytes, "slots": r.n_slots, "direct_io": r.direct_io,
                 "budget": r.budget_description}
        ipc.send(self.socks["telemetry"], m.RunInfo(f"{os.getpid()}-{int(time.time())}", time.time(), flat, model,
                                                    r.n_slots * r.slab_bytes, r.load_seconds))

    # -- generate ----------------------------------------------------------------
    def generate(self, prompt_tokens: list[int], sampling: dict, max_tokens: int, stop: tuple[str, ...] = (),
                 on_text: Callable[[str], None] | None = None, ignore_eos: bool = False) -> m.Done:
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
        for arena in (self.slabs, self.dense, self.index):
            if arena is not None:
                arena.close()
                arena.unlink()
        self.slabs = self.dense = self.index = None
        if self.rt is not None:
            self.rt.remove()
            self.rt = None

    def __enter__(self) -> "Pipeline":
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
