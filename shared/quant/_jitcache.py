"""numba's disk cache, stamped with every kernel source rather than one file.

numba keys a cached function on the contents of the file that defines it, but
our kernels inline the LLVM IR, constants and helpers of other modules (_q8ir,
_iqir, _floatir, _common and blocks into the quant drivers; attend_ir into
attend), so an edit to one of those alone loaded the machine code of the former
IR from the cache: a benchmark or a test ran the old kernel and said nothing
(2026-12-06). For a function defined in a kernel source (`KERNEL_SOURCES`)
this module's locator stamps the cache with the hash of all of them: an edit to
any recompiles every kernel once (a few minutes), and no edit is missed.
Functions elsewhere keep numba's own stamp.

It wraps the locators numba tries (numba.core.caching, numba's internals: CacheImpl's
`_locator_classes` and a locator's `_py_file`), so it installs before any kernel module defines a
cached function: _target imports it, and every kernel module imports _target
first. `installed()` says whether it took (tests/test_jitcache.py checks it, so a
numba that moved these fails a test rather than loading stale code).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

_SHARED = Path(__file__).resolve().parents[1]
# Every module whose code ends up in a cached kernel: the quant package, and the model's
# kernels with what they inline (attend_ir, and quant's IR through them).
KERNEL_SOURCES = tuple(
    sorted(
        [
            *(_SHARED / "quant").glob("*.py"),
            *(_SHARED / "model" / name for name in ("attend.py", "attend_ir.py", "fused.py", "delta_rule.py")),
        ]
    )
)


@functools.lru_cache(maxsize=1)
def kernel_stamp() -> str:
    """sha256 over every kernel source (names and contents, in a fixed order)."""
    h = hashlib.sha256()
    for path in KERNEL_SOURCES:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


class _KernelStamp:
    """Mixed in before a numba locator: a kernel source's stamp is kernel_stamp()."""

    moe_pipe_stamp = True

    def get_source_stamp(self):
        py_file = getattr(self, "_py_file", None)
        if py_file is not None and Path(py_file).resolve() in KERNEL_SOURCES:
            return kernel_stamp()
        return super().get_source_stamp()  # type: ignore[misc]


def _locator_classes() -> list | None:
    """numba's list of locator classes (CacheImpl's; _CacheImpl's before numba 0.61)."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    return classes if isinstance(classes, list) else None


def _install() -> None:
    classes = _locator_classes()
    if classes is None or installed():
        return
    # The stamp of the sources as this process imports them: taken later (at the first cache
    # lookup), an edit in between would stamp the code in memory with the edited sources' hash.
    kernel_stamp()
    classes[:] = [type(cls.__name__, (_KernelStamp, cls), {"__module__": __name__}) for cls in classes]


def installed() -> bool:
    """Whether numba's cache now stamps the kernel sources with kernel_stamp()."""
    classes = _locator_classes()
    return classes is not None and len(classes) > 0 and all(getattr(cls, "moe_pipe_stamp", False) for cls in classes)


_install()
