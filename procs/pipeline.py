"""The small parent of a one-shot run: makes the arenas, starts reader,
compute and telemetry, feeds one or more generations, and takes everything
down again on every exit path.

    parent ──requests──► compute ──fetch/release──► reader ◄── model.gguf (O_DIRECT)
      ▲                    │  ◄──────ready (slab ids)──┘  │
      └──────tokens────────┤   maps slabs read-only        writes slabs
                           └──records──► telemetry ──PUB──► tails

`start_pipeline` makes the resources and the sockets, builds the Pipeline
with all of them, and only then starts the children (procs/children.py) and
waits for compute's Hello; a failure there closes what was made. Owned by
the Pipeline, released in `close()` whatever happened: the runtime dir (ipc
sockets), the slab arena, the dense arena, the child processes. Stale
segments and runtime dirs of a parent that died by kill -9 are reclaimed at
the next start (their pid is dead). Children die with their parent
(PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import zmq

from ..shared.config import Config
from ..shared.errors import PipelineError, UserError
from ..shared.text.context import check_prompt_fits, too_long_for_one_request
from ..shared.wire import ipc
from ..shared.wire import messages as m
from .children import RUN_ORDER, ChildProcess, Launch, ProcessStarter, SpawnStarter, stop_child
from .compute_client import ComputeClient, failure_text
from .lifecycle import describe_exit, error_file
from .resources import Resolved, Resources, run_info

log = logging.getLogger("moe_pipe.pipeline")
START_TIMEOUT_S = 120.0  # of silence from compute while it starts (each Progress of its kernel warm-up restarts the clock)
STOP_WAIT_S = 5.0
POLL_MS = 200
# The links the parent holds: it sends requests and reads tokens; fetch and
# telemetry_in only carry the Shutdown that stops the reader and telemetry.
LINKS = ("requests", "fetch", "telemetry_in")


def start_pipeline(
    cfg: Config,
    model_path: str | os.PathLike,
    starter: Callable[[Launch], ProcessStarter] = SpawnStarter,
    on_progress: Callable[[m.Progress], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> Pipeline:
    """A running pipeline: resources, sockets, children, and compute's Hello.
    `on_stage` hears start-up's stages once the settings are checked (a refusal
    comes before any), `on_progress` compute's Progress messages (its kernel
    warm-up) as they come. On any failure everything made so far is released
    before it raises."""
    t0 = time.perf_counter()
    model_path = Path(model_path)
    # A run's compute serves its one client one request at a time: a config's gateway.parallel
    # (the service's slots) would only cost KV caches and drafts here.
    cfg = replace(cfg, gateway=replace(cfg.gateway, parallel=1))
    res = Resources.create(cfg, model_path, progress=on_stage)
    ctx = zmq.Context()
    try:
        ep = res.rt.endpoints
        tokens = ipc.bind(ctx, ep, "tokens")
        links = {name: ipc.connect(ctx, ep, name) for name in LINKS}
    except BaseException:
        ctx.destroy(linger=0)
        res.close()
        raise
    pipe = Pipeline(cfg, model_path, res, ctx, tokens, links)
    try:
        pipe._start_children(starter(Launch(cfg, res, model_path, cfg.model.name or model_path.stem)))
        pipe._wait_for_compute(on_progress)
        # load_seconds: everything before the first token can be computed — the
        # dense load here and compute's own start (warm sweep, mapping) — but
        # not its kernel warm-up, which is compile_seconds (docs/telemetry.md).
        # Rounded once, here, so the summary, the JSON and the CSV preamble carry one value.
        pipe.resolved = replace(pipe.resolved, load_seconds=round(max(time.perf_counter() - t0 - pipe.compile_seconds, 0.0), 3))
        info = run_info(cfg, res, model_path, pipe.resolved.load_seconds)
        ipc.send(links["telemetry_in"], replace(info, compile_seconds=pipe.compile_seconds))
    except BaseException:
        pipe.close()
        raise
    return pipe


class Pipeline:
    """A run's parent side, built whole by `start_pipeline`; a context manager
    that closes it."""

    def __init__(self, cfg: Config, model_path: Path, res: Resources, ctx: zmq.Context, tokens: zmq.Socket, links: dict[str, zmq.Socket]):
        self.cfg, self.model_path = cfg, model_path
        self.res = res
        self.resolved: Resolved = res.resolved
        self.ctx, self.tokens, self.links = ctx, tokens, links
        self.procs: dict[str, ChildProcess] = {}  # in start order
        self.client = ComputeClient()
        self.closed = False
        # compute's kernel warm-up, from its last Progress: seconds, and kernels compiled (not loaded from numba's cache)
        self.compile_seconds = 0.0
        self.kernels_compiled = 0

    @property
    def rt(self) -> ipc.RuntimeDir:
        return self.res.rt

    # -- start ---------------------------------------------------------------
    def _start_children(self, start: ProcessStarter) -> None:
        # OMP_WAIT_POLICY is left as the user has it. Measured here (8-layer
        # qwen30b-shape, 600 MiB cache): PASSIVE cuts compute's messaging time
        # 5.2 → 1.4 ms and flash stall 12.5 → 3.9 ms per token, because numba's
        # OpenMP threads stop spinning on the cores the reader needs — but each
        # kernel call then wakes sleeping threads, and decode fell from 20–24 to
        # 16–19 tok/s. Throughput wins.
        for name in RUN_ORDER:
            pids = {n: p.pid for n, p in self.procs.items() if p.pid is not None}
            self.procs[name] = start(name, pids)

    def _wait_for_compute(self, on_progress: Callable[[m.Progress], None] | None = None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_children()
            msg = ipc.recv(self.tokens, POLL_MS, expect=(m.Hello, m.Progress))
            if isinstance(msg, m.Progress):
                deadline = time.monotonic() + START_TIMEOUT_S  # slow, not stuck
                if msg.step == msg.total and not msg.item:  # the warm-up's end
                    self.compile_seconds, self.kernels_compiled = round(msg.seconds, 3), msg.compiled
                if on_progress:
                    on_progress(msg)
            if msg is not None:
                self.client.accept(msg)
            if self.client.ready:
                return
        raise PipelineError(f"compute did not start within {START_TIMEOUT_S:.0f} s")

    # -- generate ----------------------------------------------------------------
    def generate(
        self,
        prompt_tokens: Sequence[int],
        sampling: dict,
        max_tokens: int,
        stop: tuple[str, ...] = (),
        on_text: Callable[[str], None] | None = None,
        ignore_eos: bool = False,
        on_prompt: Callable[[m.PromptProgress], None] | None = None,
        draft: int = m.DRAFT_FROM_CONFIG,
    ) -> m.Done:
        """One generation; `on_text` hears its text as it becomes final, `on_prompt` its prompt's progress;
        `draft`: drafts per verify pass for this one (default: compute.draft)."""
        check_prompt_fits(len(prompt_tokens), self.cfg.compute.ctx_size)
        request = self.client.generate(prompt_tokens, max_tokens, sampling, stop, ignore_eos, draft=draft)
        try:
            ipc.send(self.links["requests"], request)
        except m.ProtocolError:  # past the frame cap: more ids than one request carries
            raise UserError(too_long_for_one_request(len(prompt_tokens))) from None
        return self._answer(on_text, on_prompt)

    def slot(self, action: str, path: str = "") -> m.Done:
        """Save, restore or erase compute's session (docs/conversations.md); a refused file is a UserError."""
        ipc.send(self.links["requests"], self.client.slot(action, str(path)))
        return self._answer(None)

    def _answer(self, on_text: Callable[[str], None] | None, on_prompt: Callable[[m.PromptProgress], None] | None = None) -> m.Done:
        while True:
            self._check_children()
            msg = ipc.recv(self.tokens, POLL_MS, expect=(m.Token, m.Done, m.Hello, m.PromptProgress))
            event = self.client.accept(msg) if msg is not None else None
            if isinstance(event, str):
                if on_text:
                    on_text(event)
            elif isinstance(event, m.PromptProgress):
                if on_prompt:
                    on_prompt(event)
            elif isinstance(event, m.Done):
                if not event.ok:
                    if event.code == m.Code.BAD_ARGUMENT:  # the user's input (a refused session file): one line, exit 2
                        raise UserError(event.error)
                    raise PipelineError(failure_text(event))
                return event

    def _check_children(self) -> None:
        for name, p in self.procs.items():
            if not p.is_alive():
                why = error_file(self.rt.path, name)
                detail = f" ({why.read_text().strip()})" if why.exists() else ""
                raise PipelineError(f"the {name} process {describe_exit(p.exitcode)}{detail}; the run was stopped")

    # -- stop ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop children in reverse start order (compute, reader, telemetry),
        each asked by a Shutdown first, then release sockets, arenas and the
        runtime dir. Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        try:
            for name in reversed(list(self.procs)):
                stop_child(self.procs.pop(name), name, self.links, "run finished", STOP_WAIT_S, STOP_WAIT_S)
        finally:
            self.ctx.destroy(linger=0)  # closes every socket of ours
            self.res.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
