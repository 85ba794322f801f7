"""The engine's child processes, in one table, and the one way to start and to
stop them. `moe-pipe run` (procs/pipeline.py) starts RUN_ORDER, `moe-pipe up`
(procs/supervisor.py) SERVICE_ORDER, both through a ProcessStarter:

    CHILDREN[name] = ChildSpec(entry, args(launch, pids), needs, shutdown_link)
    SpawnStarter(launch)(name, pids) -> a started process running
        lifecycle.run_child(name, runtime_dir, entry, args)
    stop_child(process, spec, links, ...)  Shutdown on its link, wait;
        SIGTERM, wait; SIGKILL

A child's arguments are built when it starts, from the launch (config,
resources, model) and the pids of the children already running: compute
needs its reader's pid, to notice when the reader dies.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq

from moe_pipe.shared.experts.budget import RUN_ROLES, SERVICE_ROLES
from moe_pipe.shared.wire import ipc
from moe_pipe.shared.wire import messages as m

from . import reader, telemetry
from .compute_config import ComputeConfig
from .lifecycle import error_file, run_child
from .resources import Resources

SHUTDOWN_SEND_MS = 200  # a child whose link cannot take a Shutdown this fast gets SIGTERM instead


@dataclass(frozen=True)
class Launch:
    """What every child's arguments are made from."""

    cfg: Any
    res: Resources
    model_path: Path
    model_name: str


# -- each child's arguments ----------------------------------------------------------


def telemetry_args(cfg: Any, res: Resources) -> telemetry.TelemetryConfig:
    return telemetry.TelemetryConfig(str(res.rt.path), str(cfg.telemetry.csv or ""))


def reader_args(cfg: Any, res: Resources, model_path: str | Path) -> reader.ReaderConfig:
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
        populate=cfg.io.populate,
        io_align=r.io_align,
    )


def compute_args(cfg: Any, res: Resources, model_path: str | Path, reader_pid: int) -> ComputeConfig:
    r, c = res.resolved, cfg.compute
    return ComputeConfig(
        str(model_path),
        str(res.rt.path),
        res.slabs.arena.name,
        r.slab_bytes,
        r.n_slots,
        reader_pid,
        dense_weights=cfg.io.dense_weights,
        dense_arena=res.dense.name if res.dense is not None else "",
        index_arena=res.index.name,
        overlap=c.overlap,
        prefetch=c.prefetch == "next-layer",
        prefetch_prompt=c.prefetch in ("prompt", "next-layer"),
        top_k=c.top_k,
        threads=c.threads,
        ctx_size=c.ctx_size,
        kv_type=c.kv_type,
        drop_cold_experts=c.drop_cold_experts,
        cache_route=c.cache_route,
        route_trace=str(cfg.telemetry.route_trace or ""),
        route_replay=str(c.route_replay or ""),
        model_identity=r.model_identity,
        populate=cfg.io.populate,
        context_shift=cfg.generate.context_shift,
        n_keep=cfg.generate.n_keep,
        io_align=r.io_align,
    )


def gateway_args(launch: Launch) -> Any:
    from . import gateway  # aiohttp and the chat templates: only `up` needs them

    cfg, g, gen = launch.cfg, launch.cfg.gateway, launch.cfg.generate
    return gateway.GatewaySettings(
        runtime_dir=str(launch.res.rt.path),
        model_path=str(launch.model_path),
        model_name=launch.model_name,
        host=g.host,
        port=g.port,
        api_key=g.api_key,
        queue_size=g.queue_size,
        ctx_size=cfg.compute.ctx_size,
        max_tokens=gen.max_tokens,
        temperature=gen.temperature,
        seed=gen.seed,
        no_think=gen.no_think,
        chat_template=gen.chat_template,
        context_shift=gen.context_shift,
        slot_save_path=str(g.slot_save_path or ""),
        config=cfg.to_dict(),  # secrets REDACTED: the web page shows it (procs/gateway_events.py)
    )


def compute_main(cfg: ComputeConfig) -> None:
    from . import compute  # the model code, numba and LLVM: only the compute process loads them

    compute.main(cfg)


def gateway_main(settings: Any) -> None:
    from . import gateway

    gateway.main(settings)


# -- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    name: str
    entry: Callable[[Any], None]  # runs in the child, with what `args` built
    args: Callable[[Launch, Mapping[str, int]], Any]  # (launch, pids of the running children) -> the entry's argument
    needs: tuple[str, ...] = ()  # started only while these run; their pids are in `pids`
    shutdown_link: str = ""  # the endpoint on which a Shutdown asks it to stop ("": SIGTERM is its stop)


CHILDREN: dict[str, ChildSpec] = {
    spec.name: spec
    for spec in (
        ChildSpec("telemetry", telemetry.main, lambda ln, pids: telemetry_args(ln.cfg, ln.res), shutdown_link="telemetry_in"),
        ChildSpec("reader", reader.main, lambda ln, pids: reader_args(ln.cfg, ln.res, ln.model_path), shutdown_link="fetch"),
        ChildSpec(
            "compute",
            compute_main,
            lambda ln, pids: compute_args(ln.cfg, ln.res, ln.model_path, pids["reader"]),
            needs=("reader",),
            shutdown_link="requests",
        ),
        ChildSpec("gateway", gateway_main, lambda ln, pids: gateway_args(ln)),
    )
}
RUN_ORDER: tuple[str, ...] = RUN_ROLES  # start order; stop is the reverse
SERVICE_ORDER: tuple[str, ...] = SERVICE_ROLES


def check_order(order: tuple[str, ...]) -> None:
    """Every child of `order` is in the table and after what it needs."""
    for i, name in enumerate(order):
        late = [n for n in CHILDREN[name].needs if n not in order[:i]]
        if late:
            raise ValueError(f"{name} needs {late}, which do not start before it in {order}")


check_order(RUN_ORDER)
check_order(SERVICE_ORDER)


# -- starting -------------------------------------------------------------------------------


class ChildProcess(Protocol):
    """What a parent needs of a started child (multiprocessing's Process has it)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class ProcessStarter(Protocol):
    """Starts the child `name`; `pids` holds the pids of the children running now."""

    def __call__(self, name: str, pids: Mapping[str, int]) -> ChildProcess: ...


class SpawnStarter:
    """The real starter: a fresh interpreter (spawn: no inherited sockets or
    mappings) running `run_child`, which keeps the last error line of a child
    that dies in the runtime dir (`lifecycle.error_file`)."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self._ctx = mp.get_context("spawn")

    def __call__(self, name: str, pids: Mapping[str, int]) -> ChildProcess:
        spec = CHILDREN[name]
        missing = [n for n in spec.needs if n not in pids]
        if missing:
            raise ValueError(f"{name} cannot start before {', '.join(missing)}")
        args = spec.args(self.launch, pids)
        runtime_dir = str(self.launch.res.rt.path)
        error_file(runtime_dir, name).unlink(missing_ok=True)
        process = self._ctx.Process(target=run_child, name=f"moe-pipe-{name}", daemon=True, args=(name, runtime_dir, spec.entry, args))
        process.start()
        return process


# -- stopping -------------------------------------------------------------------------------


def ask_to_stop(name: str, links: Mapping[str, zmq.Socket], why: str) -> bool:
    """Send the child its Shutdown, if the caller holds a socket on its link.
    A Shutdown lets it finish cleanly (telemetry writes the run summary)."""
    sock = links.get(CHILDREN[name].shutdown_link)
    if sock is None:
        return False
    try:
        ipc.send(sock, m.Shutdown(why), timeout_ms=SHUTDOWN_SEND_MS)
    except ipc.PeerTimeout:
        return False
    return True


def stop_process(process: ChildProcess, grace_s: float, wait_s: float) -> None:
    """The one way a child ends: `grace_s` to exit on its own (0 when it was
    not asked), then SIGTERM and `wait_s`, then SIGKILL. Reaped on return."""
    if grace_s > 0:
        process.join(grace_s)
    if process.is_alive():
        process.terminate()
        process.join(wait_s)
    if process.is_alive():
        process.kill()
    process.join()


def stop_child(process: ChildProcess, name: str, links: Mapping[str, zmq.Socket], why: str, grace_s: float, wait_s: float) -> None:
    """Shutdown on its link if there is one, then `stop_process`."""
    asked = process.is_alive() and ask_to_stop(name, links, why)
    stop_process(process, grace_s if asked else 0.0, wait_s)
