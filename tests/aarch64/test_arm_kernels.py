"""aarch64 only (tests/aarch64/run.sh runs it under qemu-user): the int8 dot
build follows the CPU's dot-product extension, its IR says so, and one
streamed pipeline run gives the resident reference's tokens."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from moe_pipe.shared import quant
from moe_pipe.shared.quant import _q8, _target
from moe_pipe.shared.quant.blocks import QK, QK_K

pytestmark = pytest.mark.skipif(platform.machine() not in ("aarch64", "arm64"), reason="aarch64 only (tests/aarch64/run.sh)")
SDOT = "llvm.aarch64.neon.sdot.v4i32.v16i8"


def emitted_ir() -> str:
    """Freshly compiled IR of the Q4_K and Q8_0 row kernels (numba shows IR only for code it compiled here)."""

    @numba.njit(cache=False)
    def probe(w, xq, dx, bs16, bs32, xs32, half, out):
        _q8._q4_k_r1(w, 0, QK_K // QK, xq, 0, QK_K, dx, bs16, bs32, xs32, half, out, 0, 1)
        _q8._q8_0_r1(w, 0, QK_K // QK, xq, 0, QK_K, dx, bs16, bs32, xs32, half, out, 1, 1)

    w = np.zeros(4 * QK_K, np.uint8)
    xq = np.zeros(QK_K, np.int8)
    dx = np.zeros(QK_K // QK, np.float32)
    bs16 = np.zeros(2 * QK_K // QK, np.int32)
    bs32 = np.zeros(QK_K // QK, np.int32)
    xs32 = np.zeros(QK_K // QK, np.float32)
    out = np.full(2, np.nan, np.float32)
    probe(w, xq, dx, bs16, bs32, xs32, np.ones(256, np.float32), out)
    return "\n".join(probe.inspect_llvm().values())


def test_the_build_follows_the_cpus_dot_product():
    forced = numba.config.CPU_NAME == "generic"
    want = "sdot" if _target.arm_dotprod() and not forced else "portable"
    assert quant.INT8_DOT == want
    assert (SDOT in emitted_ir()) == (want == "sdot")
    print(f"int8 dot build: {quant.INT8_DOT} (HWCAP asimddp: {_target.arm_dotprod()})")


@pytest.mark.integration
def test_pipeline_io_mode(tmp_path):
    """One streamed run at the smallest budget: the reference's tokens; says whether O_DIRECT ran."""
    from moe_pipe.shared.makemodel.maker import make_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the pipeline tests' helpers
    from test_pipeline import MiB, run_pipeline, with_reference

    path, prompt, reference, sizes = with_reference(make_model("qwen3moe", "tiny", tmp_path / "qwen3moe.gguf"))
    tokens, _, resolved = run_pipeline(path, prompt, **{"cache.cache_mb": sizes["min_mb"] + 1e-6})
    assert tokens == reference[None]
    assert resolved.n_slabs * resolved.slab_bytes <= (sizes["min_mb"] + 1e-6) * MiB
    print(f"pipeline I/O: {'O_DIRECT' if resolved.direct_io else 'buffered fallback'}; alignment {resolved.io_align} B")
