"""numba and LLVM load only where kernels run: the block formats and every
process but compute come without them (shared/quant/__init__.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_pipe.shared import quant


def test_every_public_name_resolves():
    for name in quant.__all__:
        assert getattr(quant, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'matvecc'"):
        quant.matvecc  # noqa: B018


def _loads_numba(module: str) -> bool:
    code = f"import sys, {module}; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    return out.strip() == "True"


@pytest.mark.integration
@pytest.mark.parametrize(
    "module",
    [
        "moe_pipe.shared.quant.blocks",
        "moe_pipe.shared.gguf.layout",
        "moe_pipe.procs.reader",
        "moe_pipe.procs.telemetry",
        "moe_pipe.procs.pipeline",
        "moe_pipe.procs.supervisor",
        "moe_pipe.procs.gateway",
        "moe_pipe.cli.main",
    ],
)
def test_only_compute_imports_numba(module):
    assert not _loads_numba(module), f"{module} imports numba"


@pytest.mark.integration
def test_the_check_sees_numba_where_it_is():
    assert _loads_numba("moe_pipe.procs.compute")


@pytest.mark.integration
@pytest.mark.parametrize("module", ["moe_pipe.shared.model.attend_ir", "moe_pipe.shared.quant._floatir", "moe_pipe.shared.quant._target"])
def test_a_kernel_module_imports_first(module):
    # `from . import _x` asks the package's __getattr__ first: it must not import kernels from
    # inside the kernel module being imported (which then failed, half made).
    subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120, check=True)
