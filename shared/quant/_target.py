"""numba's compile target on aarch64: add the dot-product feature LLVM's host detection can miss.

LLVM's host detection reads /proc/cpuinfo, which under qemu-user (and some
container runtimes) is the host's, so a CPU whose HWCAP has the dot product
(`asimddp`) can still get a numba target without `+dotprod`, and the
`llvm.aarch64.neon.sdot` intrinsic of _q8ir would not select. This module
adds it through the environment numba reads (children inherit it; numba's
disk cache keys on it), never over a target the user set. It has to run
before numba makes its codegen, which happens at the first compile and also
when some modules are imported (_common's jitted helpers, model/fused's
overloads), so those import this module before anything of numba's.
Elsewhere (x86, an aarch64 CPU without the dot product) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

from . import _jitcache  # noqa: F401  (also before any jit: the disk cache's stamps, _jitcache.py)

ARM = platform.machine() in ("aarch64", "arm64")
_AT_HWCAP = 16
_HWCAP_ASIMDDP = 1 << 20  # arch/arm64 uapi hwcap.h


def arm_dotprod() -> bool:
    """Has this aarch64 CPU SDOT/UDOT? The kernel's HWCAP (which qemu-user sets
    for the CPU it emulates), else the Features line of /proc/cpuinfo."""
    try:
        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype = ctypes.c_ulong
        if getauxval(ctypes.c_ulong(_AT_HWCAP)) & _HWCAP_ASIMDDP:
            return True
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("Features") and "asimddp" in line.split() for line in f)
    except OSError:
        return False


def _enable_dotprod() -> None:
    if not ARM or "NUMBA_CPU_FEATURES" in os.environ or "NUMBA_CPU_NAME" in os.environ or not arm_dotprod():
        return
    import numba
    from numba.core.codegen import get_host_cpu_features
    from numba.core.registry import cpu_target

    if "_toplevel_target_context" in vars(cpu_target):
        return  # too late: this process compiles for what numba found (the portable build)
    host = get_host_cpu_features()
    if "+dotprod" in host.split(","):
        return
    os.environ["NUMBA_CPU_FEATURES"] = ",".join(f for f in (host, "+dotprod") if f)
    numba.config.reload_config()


_enable_dotprod()
