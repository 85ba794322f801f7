"""`moe-pipe up [CONFIG|MODEL] [--name NAME]`: the service — supervisor,
reader, compute, telemetry and the OpenAI-compatible gateway — in the
foreground (Ctrl-C stops it) or with --detach in the background (`moe-pipe
down` stops it). A name already running or a port in use is refused first,
in one line (exit 2); an API that cannot start ends `up` with its error."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..shared.config import Config

DETACH_TIMEOUT_S = 600.0  # a first start may read a large dense set and compile kernels
DETACHED_FLAG = "--_detached"
API_KEY_ENV = "MOE_PIPE_API_KEY"  # gateway.api_key from the environment: not in the process list, as --api-key is


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..shared.config_flags import add_override_arguments

    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a TOML config (configs/qwen30b.toml), a GGUF file or a pulled catalog model (qwen3-30b-a3b); default: the embedded tiny model",
    )
    p.add_argument("--detach", action="store_true", help="run in the background; return once the HTTP API listens")
    p.add_argument(
        "--name",
        default=None,
        help="the service's name, for status/down/tail/chat --name (default: the config file's or the model's name)",
    )
    p.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve the API with no key on a host other than loopback (refused without this; "
        f"set a key with {API_KEY_ENV}=KEY or --api-key KEY instead)",
    )
    p.add_argument(DETACHED_FLAG, dest="detached_child", action="store_true", help=argparse.SUPPRESS)
    add_override_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ..shared.hub.resolve import catalog_entry
    from ..shared.serve import service
    from .run_cmd import load_run_config

    if os.environ.get(API_KEY_ENV) and args.api_key is None:  # the flag wins over the environment
        args.api_key = os.environ[API_KEY_ENV]
    cfg = load_run_config(args)  # bad config, a catalog name not pulled: one line, exit 2, before anything starts
    check_exposure(cfg, args.no_api_key)
    entry = catalog_entry(args.model) if args.model else None
    if entry is not None and args.name is None:  # `up NAME` serves as NAME
        args.name = entry.name
    name = service.check_name(args.name) if args.name is not None else ""
    if args.detach:
        from ..procs.supervisor import preflight
        from ..shared.hub.resolve import model_file

        # A name in use or a port taken: one line now, not after a detached start (which checks again).
        name = name or service.default_name(cfg.source or "", cfg.model.name or model_file(cfg).stem)
        for sock in preflight(cfg, name):
            sock.close()
        return _detach(args.argv)
    return _serve(cfg, name, detached=args.detached_child)


def check_exposure(cfg: Config, no_api_key: bool) -> None:
    """An API on a network address needs a key, or --no-api-key to say that it is meant to be open."""
    from ..shared.errors import UserError
    from ..shared.serve.hosts import is_loopback

    host = cfg.gateway.host
    if is_loopback(host) or cfg.gateway.api_key:
        return
    if not no_api_key:
        raise UserError(
            f"--host {host} exposes the API to the network with no key: set one with {API_KEY_ENV}=KEY "
            "(kept out of the process list) or --api-key KEY, or pass --no-api-key to serve it openly"
        )
    print(f"moe-pipe: warning: serving the API on {host} with no key (--no-api-key): whoever reaches the port can use it", file=sys.stderr)


def _child_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The detached child's argv and environment: --api-key KEY travels in the environment
    (MOE_PIPE_API_KEY), so the long-lived service's command line does not show the key."""
    out, env, skip = [], dict(os.environ), False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--api-key" and i + 1 < len(argv):
            env[API_KEY_ENV], skip = argv[i + 1], True
        elif a.startswith("--api-key="):
            env[API_KEY_ENV] = a.partition("=")[2]
        elif a != "--detach":
            out.append(a)
    return out + [DETACHED_FLAG], env


def _serve(cfg: Config, name: str, detached: bool) -> int:
    from ..procs.supervisor import Supervisor
    from ..shared.hub.resolve import model_file
    from ..shared.serve import service

    def progress(text: str) -> None:
        print(f"moe-pipe: {text}", file=sys.stderr, flush=True)

    def listening(url: str) -> None:
        # `down` needs the name only when another service runs beside this one
        down = f"moe-pipe down --name {sup.name}" if len(service.live_services()) > 1 else "moe-pipe down"
        print(
            f"moe-pipe: serving {sup.model_name} at {url} as {sup.name!r} (supervisor pid {os.getpid()}; "
            f"{f'`{down}` stops it' if detached else 'Ctrl-C stops it'})",
            flush=True,
        )
        if detached:  # the `up --detach` parent has read what it needs: go quiet
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.close(devnull)

    sup = Supervisor.start(cfg, model_file(cfg), config_source=cfg.source or "", name=name, progress=progress)
    r = sup.res.resolved
    progress(
        f"expert cache {r.n_slabs * r.slab_bytes / 2**20:,.2f} MiB = {r.n_slabs} slabs ({r.budget_description}); "
        f"logs: {sup.res.rt.path / 'moe-pipe.log'}"
    )
    sup.run(on_listening=listening)
    return 0


class _Relay:
    """Which lines of a detached start `up --detach` shows: progress and
    problems, not every INFO line, nor a child's traceback (those stay in the
    log; the ERROR line logged with it says what failed)."""

    def __init__(self) -> None:
        self.after_error = False

    def wanted(self, line: str) -> bool:
        is_log = line[:2].isdigit()  # "HH:MM:SS moe-<role>[pid] LEVEL ..."
        if is_log or line.startswith("moe-pipe"):
            self.after_error = is_log and " ERROR " in line
            return not is_log or " WARNING " in line or " ERROR " in line
        return not self.after_error  # printed by a library, or the traceback of the ERROR line above


def _detach(argv: list[str]) -> int:
    """Start `up` again without --detach in its own session; relay its output
    until its gateway listens (then return 0) or it exits (its code)."""
    child_argv, env = _child_argv(argv)
    with tempfile.NamedTemporaryFile("w+", prefix="moe-pipe-up-", suffix=".log", delete=False) as out:
        out_path = Path(out.name)
    try:
        with open(out_path, "w") as sink, open(os.devnull) as devnull:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moe_pipe.cli.main", *child_argv],
                stdin=devnull,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        shown, relay = 0, _Relay()
        deadline = time.monotonic() + DETACH_TIMEOUT_S
        while time.monotonic() < deadline:
            text = out_path.read_text(errors="replace")
            lines = text.splitlines(keepends=True)
            for line in lines[shown:]:
                if not line.endswith("\n"):
                    break  # still being written
                shown += 1
                if line.startswith("moe-pipe: serving"):
                    sys.stdout.write(line)
                elif relay.wanted(line):
                    sys.stderr.write(line)
            if any(line.startswith("moe-pipe: serving") for line in lines):
                sys.stdout.flush()
                return 0
            code = proc.poll()
            if code is not None:
                rest = out_path.read_text(errors="replace").splitlines(keepends=True)[shown:]
                sys.stderr.write("".join(line for line in rest if relay.wanted(line)))
                return code or 1
            time.sleep(0.1)
        proc.terminate()
        print(f"moe-pipe: error: the service did not start within {DETACH_TIMEOUT_S:.0f} s", file=sys.stderr)
        return 1
    finally:
        out_path.unlink(missing_ok=True)
