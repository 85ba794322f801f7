"""`moe-pipe`: the command line. Thin: parse, call, print.

Subcommand modules are imported lazily so `moe-pipe --help` stays instant.
A `UserError` prints one line and exits 2; anything else is a bug and keeps
its traceback. `--debug` shows tracebacks for user errors too.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from .. import __version__


class _Terminated(BaseException):
    """Raised by the SIGTERM handler (a BaseException, like KeyboardInterrupt,
    so no `except Exception` swallows it)."""


def _terminate(signum, frame):
    raise _Terminated()


# name -> (module under moe_pipe.cli, one-line help)
COMMANDS = {
    "run": ("run_cmd", "generate text from a prompt"),
    "make-model": ("make_model", "write a deterministic GGUF model with random weights"),
    "inspect": ("inspect_cmd", "show a GGUF model's layout: experts, bytes, quant types"),
    "convert": ("convert_cmd", "convert a Hugging Face checkpoint (safetensors) to GGUF"),
    "up": ("up_cmd", "start the service: streaming pipeline + OpenAI-compatible HTTP API, supervised"),
    "down": ("down_cmd", "stop the running service"),
    "status": ("status_cmd", "show the running service's processes, budget and hit rate"),
    "bench": ("bench_cmd", "benchmark a model: moe-pipe (and llama.cpp) under an optional memory limit"),
    "tail": ("tail_cmd", "watch the running service's per-token telemetry live"),
    "chat": ("chat_cmd", "chat with a model in the terminal (the running service, or one brought up for it)"),
    "replay": ("replay_cmd", "replay a route trace through the cache policies"),
    "doctor": ("doctor_cmd", "forecast whether a model fits this machine and its decode speed"),
    "warmup": ("warmup_cmd", "compile every kernel a model needs into numba's cache, so its next run starts fast"),
    "pull": ("pull_cmd", "download a GGUF model from the Hugging Face Hub (resumable, sha256-verified)"),
    "models": ("models_cmd", "list the models on this machine (and the catalog) with a fit-and-speed forecast for each"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-pipe", description="Run Mixture-of-Experts models larger than RAM by streaming experts from flash."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"moe-pipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(f"moe_pipe.cli.{module}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # for commands that re-run themselves (up --detach)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    from ..shared.errors import UserError

    # SIGTERM unwinds like Ctrl-C, so every context manager releases what it
    # holds (shared memory, sockets, child processes) on the way out.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        module = importlib.import_module(f"moe_pipe.cli.{args._module}")
        return int(module.run(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        print(f"moe-pipe: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("moe-pipe: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("moe-pipe: terminated", file=sys.stderr)
        return 143
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
