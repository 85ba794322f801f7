"""The x86 builds of the int8 dot, on any machine.

The int8-activation kernels (shared/quant/_q8.py, their IR in _q8ir.py) emit one build,
chosen once at import and reported as `quant.INT8_DOT`: "vnni" (the
vpdpbusd / vpshufb intrinsics) where the CPU numba compiles for has AVX-512
VNNI, "avx2" (vpmaddubsw / vpmaddwd / vpshufb on 32-byte halves) where it has
AVX2 but not VNNI, "portable" (target-independent LLVM IR) anywhere else (and
"sdot" on aarch64: tests/aarch64/run.sh). The other kernel tests run whichever
build this machine picks; here a child process per build, with numba's own
target switch (NUMBA_CPU_NAME=generic: a CPU with no features; haswell with
AVX2's features: the AVX2 build on a VNNI machine too; numba's disk cache keeps
each target's kernels apart from the host's),
runs tests/test_quant.py's matvec and matmul comparisons against gguf's
dequantizer, with the same tolerances and the same bit-for-bit equality of
matmul rows and matvec (and its GEMM tile test on the int8 types), for every
supported type with int8
activations on and off, and reports which build it compiled: the build flag
and the x86 intrinsics in IR numba compiled in that process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llvmlite.binding as llb
import numba
import numpy as np
import pytest
from gguf.quants import dequantize

from moe_pipe.shared import quant
from moe_pipe.shared.quant import _legacy, _q8, _q8ir, _target
from moe_pipe.shared.quant.blocks import E2M1_TWICE, MXFP4_BYTES, QK, QK_K, SUPPORTED, QType

TESTS = Path(__file__).resolve().parent
# The intrinsics only the VNNI build calls (the int8 dot, the MXFP4 code map), and the AVX2 build's.
VNNI_INTRINSICS = ("llvm.x86.avx512.vpdpbusd.512", "llvm.x86.avx512.pshuf.b.512")
AVX2_INTRINSICS = ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd", "llvm.x86.avx2.pshuf.b")
# A target with AVX2 and not AVX-512 (numba's CPU name and LLVM's feature string, as NUMBA_CPU_FEATURES takes it).
AVX2_TARGET = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,+f16c,+popcnt,+sse4.2,+bmi,+bmi2,+lzcnt,+movbe"}


def emitted_x86_intrinsics() -> list[str]:
    """The VNNI and AVX2 builds' intrinsics in freshly compiled IR of the Q4_K row kernel (one activation row)
    and the MXFP4 repack and tile kernel (a tile of 16 weight rows × TILE_TOKENS activation rows).

    Compiled here without the disk cache because numba shows the IR only of
    code it compiled in this process (a kernel loaded from the cache has none).
    """

    @numba.njit(cache=False)
    def probe(w, xq, dx, bs16, bs32, xs32, half, buf, out):
        _q8._q4_k_r1(w, 0, QK_K // QK, xq, 0, QK_K, dx, bs16, bs32, xs32, half, out, 0, 1)
        _q8._mxfp4_pack(w, 8 * MXFP4_BYTES, 0, 16, QK_K // QK, half, buf)
        _q8._mxfp4_t8(buf, 1, xq, 0, QK_K, dx, bs16, bs32, xs32, out, 1, 16, 16, _q8.TILE_TOKENS)

    w = np.zeros(16 * 8 * MXFP4_BYTES, np.uint8)  # a Q4_K super-block; 16 rows of 8 MXFP4 blocks: codes and scales 0
    xq = np.zeros(8 * QK_K, np.int8)  # 8 activation rows of QK_K
    dx = np.zeros(8 * QK_K // QK, np.float32)
    bs16, bs32 = np.zeros(16 * QK_K // QK, np.int32), np.zeros(8 * QK_K // QK, np.int32)
    xs32 = np.zeros(8 * QK_K // QK, np.float32)
    out = np.full(1 + _q8.TILE_TOKENS * 16, np.nan, np.float32)
    probe(w, xq, dx, bs16, bs32, xs32, np.ones(256, np.float32), np.zeros(_q8ir.PACKED_UNIT, np.uint8), out)
    assert np.array_equal(out, np.zeros_like(out)), out
    ir = "\n".join(probe.inspect_llvm().values())
    return [name for name in VNNI_INTRINSICS + AVX2_INTRINSICS if name in ir]


def child_main() -> None:
    """In the NUMBA_CPU_NAME=generic child: the comparisons, then one JSON line of what ran."""
    import test_quant  # the child has tests/ on sys.path; the comparisons and tolerances are that module's

    checked = []
    for int8 in (True, False):
        quant.set_int8_activations(int8)
        for qtype in SUPPORTED:
            test_quant.test_matvec_matches_gguf_dequantize(qtype)
            test_quant.test_matmul_matches_gguf_dequantize(qtype)
            if qtype in quant.INT8_ACTIVATION_TYPES:
                test_quant.test_int8_gemm_tiles_rows_and_threads(qtype)
            checked.append(f"{qtype.name}/{'int8' if int8 else 'f32'}")
    report = {"int8_dot": quant.INT8_DOT, "cpu": numba.config.CPU_NAME, "intrinsics": emitted_x86_intrinsics(), "checked": checked}
    print(json.dumps(report))


def _host_has_vnni() -> bool:
    f = llb.get_host_cpu_features()
    return bool(f.get("avx512vnni")) and bool(f.get("avx512bw"))


def _host_has_avx2() -> bool:
    return not _target.ARM and bool(llb.get_host_cpu_features().get("avx2"))


def test_this_process_compiles_the_build_its_target_allows():
    """Without a numba target in the environment: VNNI where the host has it, else AVX2 where it
    has that, and the IR says so."""
    if any(k in os.environ for k in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")) or os.environ.get("NUMBA_ENABLE_AVX") == "0":
        pytest.skip("the environment sets numba's target; the child test covers that case")
    # aarch64: "sdot" where HWCAP/cpuinfo report the dot product (tests/aarch64/run.sh runs it emulated)
    want = "vnni" if _host_has_vnni() else "avx2" if _host_has_avx2() else "sdot" if _target.ARM and _target.arm_dotprod() else "portable"
    assert quant.INT8_DOT == want
    assert emitted_x86_intrinsics() == {"vnni": list(VNNI_INTRINSICS), "avx2": list(AVX2_INTRINSICS)}.get(want, [])


@pytest.mark.integration
@pytest.mark.slow  # compiles every kernel again for another CPU in a child: ~70 s cold
@pytest.mark.parametrize(
    ("target", "build", "intrinsics"),
    [({"NUMBA_CPU_NAME": "generic"}, "portable", []), (AVX2_TARGET, "avx2", list(AVX2_INTRINSICS))],
    ids=["portable", "avx2"],
)
def test_the_build_matches_gguf_dequantize_for_every_type(target, build, intrinsics):
    if build == "avx2" and not _host_has_avx2():
        pytest.skip("this CPU has no AVX2 to run the AVX2 build on")
    env = dict(os.environ, **target)
    if "NUMBA_CPU_FEATURES" not in target:
        env.pop("NUMBA_CPU_FEATURES", None)  # generic then means no features at all
    env.pop("MOE_PIPE_INT8_ACT", None)  # the child switches int8 itself
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_quant_portable; test_quant_portable.child_main()"
    # First run compiles every type's kernels for the child's target (minutes on 2 busy cores).
    done = subprocess.run([sys.executable, "-c", code, str(TESTS)], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["cpu"] == target["NUMBA_CPU_NAME"]
    assert report["int8_dot"] == build
    assert report["intrinsics"] == intrinsics
    assert report["checked"] == [f"{t.name}/{mode}" for mode in ("int8", "f32") for t in SUPPORTED]


def test_e2m1_code_book_is_gguf_s_and_the_decoders_follow_it():
    """blocks.E2M1_TWICE against gguf's MXFP4 dequantizer; the numba decoder and the vpshufb table against it."""
    block = np.zeros(MXFP4_BYTES, np.uint8)
    block[0] = 128  # E8M0 2^(128-127) = 2: gguf's values are then 2·E2M1 = the doubled code book
    block[1:] = np.arange(16, dtype=np.uint8)  # element j (j < 16) holds code j in its low nibble
    gguf_twice = dequantize(block[None], QType.MXFP4).reshape(-1)[:16]
    book = [float(v) for v in E2M1_TWICE] + [-float(v) for v in E2M1_TWICE]
    np.testing.assert_array_equal(gguf_twice, book)
    assert [int(_legacy._fp4_twice(np.uint8(n))) for n in range(16)] == book
    assert [u - _q8ir._FP4_OFFSET for u in _q8ir._FP4_U] == book
