"""The engine's child processes, in one table, and the one way to start and to
stop them. `moe-pipe run` (procs/pipeline.py) starts RUN_ORDER, `moe-pipe up`
(procs/supervisor.py) SERVICE_ORDER, both through a ProcessStarter:

    CHILDREN[name] = ChildSpec(entry, needs, shutdown_link)
    SpawnStarter(launch)(name, pids) -> a started process running
        lifecycle.run_child(name, entry, config, facts)
    stop_child(process, spec, links, ...)  Shutdown on its link, wait;
        SIGTERM, wait; SIGKILL

Every child's entry is `main(config, facts)`: the frozen Config whole, and
the RunFacts (procs/run_facts.py) the parent resolved, made when it starts
from the launch (resources, model) and the pids of the children already
running: compute needs its reader's pid, to notice when the reader dies.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import zmq

from ..shared.config import Config
from ..shared.experts.budget import RUN_ROLES, SERVICE_ROLES
from ..shared.wire import ipc
from ..shared.wire import messages as m
from . import reader, telemetry
from .lifecycle import error_file, run_child
from .resources import Resources
from .run_facts import RunFacts

SHUTDOWN_SEND_MS = 200  # a child whose link cannot take a Shutdown this fast gets SIGTERM instead


@dataclass(frozen=True)
class Launch:
    """What every child is started from: the config, what the parent made, the model."""

    cfg: Config
    res: Resources
    model_path: Path
    model_name: str
    hot_set: str = ""  # the service's hot-set file; a one-shot run keeps none

    def facts(self, pids: Mapping[str, int]) -> RunFacts:
        """The run's facts for a child starting now, beside `pids`, the children running."""
        r = self.res.resolved
        return RunFacts(
            runtime_dir=str(self.res.rt.path),
            model_path=str(self.model_path),
            model_name=self.model_name,
            slab_arena=self.res.slabs.arena.name,
            slab_bytes=r.slab_bytes,
            n_slabs=r.n_slabs,
            lent_slabs=r.lent_slabs,
            prompt_lent_slabs=r.prompt_lent_slabs,
            index_arena=self.res.index.name,
            dense_arena=self.res.dense.name if self.res.dense is not None else "",
            model_identity=r.model_identity,
            io_align=r.io_align,
            reader_pid=pids.get("reader", 0),
            hot_set=self.hot_set,
        )


# -- the entries that load their code in the child --------------------------------------


def compute_main(config: Config, facts: RunFacts) -> None:
    from . import compute  # the model code, numba and LLVM: only the compute process loads them

    compute.main(config, facts)


def gateway_main(config: Config, facts: RunFacts) -> None:
    from . import gateway  # aiohttp and the chat templates: only `up` needs them

    gateway.main(config, facts)


# -- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    name: str
    entry: Callable[[Config, RunFacts], None]  # runs in the child: main(config, facts)
    needs: tuple[str, ...] = ()  # started only while these run; their pids are in `pids`
    shutdown_link: str = ""  # the endpoint on which a Shutdown asks it to stop ("": SIGTERM is its stop)


CHILDREN: dict[str, ChildSpec] = {
    spec.name: spec
    for spec in (
        ChildSpec("telemetry", telemetry.main, shutdown_link="telemetry_in"),
        ChildSpec("reader", reader.main, shutdown_link="fetch"),
        ChildSpec("compute", compute_main, needs=("reader",), shutdown_link="requests"),
        ChildSpec("gateway", gateway_main),
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
        facts = self.launch.facts(pids)
        error_file(facts.runtime_dir, name).unlink(missing_ok=True)
        process = self._ctx.Process(target=run_child, name=f"moe-pipe-{name}", daemon=True, args=(name, spec.entry, self.launch.cfg, facts))
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
