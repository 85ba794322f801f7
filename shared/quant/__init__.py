"""Matrix kernels on raw GGUF quantized blocks (the entry points: kernels.py).

    y = quant.matvec(qtype, w, x)      Y = quant.matmul(qtype, w, X)
    quant.prepare / apply, dequantize_rows, set_threads, INT8_DOT, ...

`blocks` (the block formats) needs only numpy and gguf; everything else
comes from `kernels`, which brings numba and LLVM (~60 MiB in a process and
~0.3 s to import). This package loads it on the first attribute asked for,
so a process that only needs block sizes — the reader, the parent of a run,
the supervisor, the layout of a GGUF — never pays for the compiler
(docs/architecture.md § Packages (`moe_pipe.shared`)).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as mypy should see them; at run time __getattr__ below
    from .kernels import *  # noqa: F403

__all__ = [
    "INT8_ACTIVATION_TYPES",
    "INT8_DOT",
    "SUPPORTED",
    "QType",
    "block_format",
    "dequantize_rows",
    "effective_activation",
    "get_threads",
    "most_threads",
    "kernels_for",
    "matmul",
    "matvec",
    "Prepared",
    "prepare",
    "row_range",
    "apply",
    "gather_apply",
    "grouped_apply",
    "Int8Rows",
    "int8_rows",
    "grouped_qualifies",
    "qtype_from_name",
    "int8_activations",
    "set_int8_activations",
    "set_threads",
    "one_blas_thread",
]


def __getattr__(name: str) -> Any:
    """Every kernel entry point, from kernels.py on first use (PEP 562). A private name is a
    submodule `from . import _x` is looking for (it asks here first): importing kernels for it
    would import the kernel modules from inside one of them, half made."""
    if name.startswith("_"):
        raise AttributeError(f"module 'moe_pipe.shared.quant' has no attribute {name!r}")
    kernels = importlib.import_module("moe_pipe.shared.quant.kernels")
    try:
        value = getattr(kernels, name)
    except AttributeError:
        raise AttributeError(f"module 'moe_pipe.shared.quant' has no attribute {name!r}") from None
    globals()[name] = value  # found once, then an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
