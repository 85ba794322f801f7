"""`moe-pipe up [CONFIG|MODEL]`: the service — supervisor, reader, compute,
telemetry and the OpenAI-compatible gateway — in the foreground (Ctrl-C
stops it) or with --detach in the background (`moe-pipe down` stops it)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DETACH_TIMEOUT_S = 600.0  # a first start may read a large dense set and compile kernels
DETACHED_FLAG = "--_detached"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moe_pipe.shared.config_flags import add_override_arguments

    p.add_argument(
        "model", nargs="?", default=None, help="a TOML config (configs/qwen30b.toml) or a GGUF file; default: the embedded tiny model"
    )
    p.add_argument("--detach", action="store_true", help="run in the background; return once the HTTP API listens")
    p.add_argument(DETACHED_FLAG, dest="detached_child", action="store_true", help=argparse.SUPPRESS)
    add_override_arguments(p)


def run(args: argparse.Namespace) -> int:
    from moe_pipe.cli.run_cmd import load_run_config

    cfg = load_run_config(args)  # bad config: one line, exit 2, before anything starts
    if args.detach:
        return _detach(args.argv)
    return _serve(cfg, detached=args.detached_child)


def _serve(cfg, detached: bool) -> int:
    from moe_pipe.procs.supervisor import Supervisor

    def progress(text: str) -> None:
        print(f"moe-pipe: {text}", file=sys.stderr, flush=True)

    def listening(url: str) -> None:
        print(
            f"moe-pipe: serving {sup.model_name} at {url} (supervisor pid {os.getpid()}; "
            f"{'`moe-pipe down` stops it' if detached else 'Ctrl-C stops it'})",
            flush=True,
        )
        if detached:  # the `up --detach` parent has read what it needs: go quiet
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.close(devnull)

    sup = Supervisor.start(cfg, cfg.model_file(), config_source=cfg.source or "", progress=progress)
    r = sup.res.resolved
    progress(
        f"expert cache {r.n_slots * r.slab_bytes / 2**20:,.2f} MiB = {r.n_slots} slabs ({r.budget_description}); "
        f"logs: {sup.res.rt.path / 'moe-pipe.log'}"
    )
    sup.run(on_listening=listening)
    return 0


def _worth_relaying(line: str) -> bool:
    """Progress and problems, not every INFO line (those stay in the log)."""
    return line.startswith("moe-pipe") or " WARNING " in line or " ERROR " in line or not line[:2].isdigit()


def _detach(argv: list[str]) -> int:
    """Start `up` again without --detach in its own session; relay its output
    until its gateway listens (then return 0) or it exits (its code)."""
    child_argv = [a for a in argv if a != "--detach"] + [DETACHED_FLAG]
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
            )
        shown = 0
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
                elif _worth_relaying(line):
                    sys.stderr.write(line)
            if any(line.startswith("moe-pipe: serving") for line in lines):
                sys.stdout.flush()
                return 0
            code = proc.poll()
            if code is not None:
                rest = out_path.read_text(errors="replace").splitlines(keepends=True)[shown:]
                sys.stderr.write("".join(rest))
                return code or 1
            time.sleep(0.1)
        proc.terminate()
        print(f"moe-pipe: error: the service did not start within {DETACH_TIMEOUT_S:.0f} s", file=sys.stderr)
        return 1
    finally:
        out_path.unlink(missing_ok=True)
