"""`moe-pipe warmup [MODEL|CONFIG]`: compile every kernel the model needs into
numba's disk cache (NUMBA_CACHE_DIR, else __pycache__ beside the kernels), so
the next `run` or `up` of it starts without compiling. The same steps the
compute process takes before its first request (procs/warmup.py)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..shared.config_flags import add_override_arguments

    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a GGUF file (any shard of a split set), a TOML config or a catalog name; default: the embedded tiny model",
    )
    add_override_arguments(p, tables=("compute",))


def run(args: argparse.Namespace) -> int:
    from ..procs.warmup import forward_pass, kernel_steps, warm_up
    from ..shared.gguf.model_file import open_model
    from ..shared.hub.resolve import model_file
    from ..shared.progress import StatusLine
    from .run_cmd import kernel_text, load_run_config

    cfg = load_run_config(args)
    with open_model(model_file(cfg)) as mf, StatusLine() as status:
        steps = kernel_steps(mf, forward_pass(mf, cfg.compute.n_expert_used, kv_type=cfg.compute.kv_type))
        warm = warm_up(steps, lambda i, n, item: status.update(kernel_text(i, n, item)))
        status.done(
            f"{mf.gguf.path.name}: {warm.steps} kernel steps ready in {warm.seconds:.2f} s: "
            f"{warm.compiled} compiled, the rest already in numba's cache"
        )
    print(f"numba cache: {_cache_dir()}", file=sys.stderr)
    return 0


def _cache_dir() -> str:
    import os

    return os.environ.get("NUMBA_CACHE_DIR") or "__pycache__ folders beside moe_pipe's kernels (NUMBA_CACHE_DIR unset)"
