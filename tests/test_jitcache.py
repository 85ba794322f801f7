"""shared/quant/_jitcache.py: numba's disk cache stamps a kernel with every kernel source."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_pipe.shared.quant import _jitcache, _q8


def _stamp(dispatcher) -> object:
    return dispatcher._cache._impl.locator.get_source_stamp()


def test_the_stamp_is_installed_before_the_kernels():
    assert _jitcache.installed()
    assert _stamp(_q8._mm_q4_k) == _jitcache.kernel_stamp()


def test_a_function_elsewhere_keeps_numbas_stamp(tmp_path):
    src = tmp_path / "plain_kernel.py"
    src.write_text("from numba import njit\n\n@njit(cache=True)\ndef f():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("plain_kernel", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert _stamp(mod.f) not in (None, _jitcache.kernel_stamp())


def test_the_kernel_sources_are_what_the_kernels_inline():
    names = {p.name for p in _jitcache.KERNEL_SOURCES}
    assert {"_q8.py", "_q8ir.py", "_iqir.py", "_floatir.py", "_common.py", "blocks.py", "attend.py", "attend_ir.py", "fused.py"} <= names
    assert all(p.is_file() for p in _jitcache.KERNEL_SOURCES)


@pytest.mark.integration
def test_an_edit_to_an_inlined_module_alone_changes_the_stamp(tmp_path):
    """A copy of the package with a line added to _q8ir.py: the drivers of _q8.py, unchanged, get
    another stamp (numba's own would be the same: _q8.py's bytes)."""
    root = Path(_jitcache.__file__).resolve().parents[2]
    copy = tmp_path / "moe_pipe"
    shutil.copytree(root / "shared", copy / "shared", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "__init__.py").write_text("")
    probe = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from moe_pipe.shared.quant import _jitcache, _q8
        assert _q8.__file__.startswith(sys.argv[1])
        print(_q8._mm_q4_k._cache._impl.locator.get_source_stamp())
        """
    )

    def stamp() -> str:
        env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PATH": "/usr/bin:/bin"}
        return subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True, env=env
        ).stdout.strip()

    before = stamp()
    ir = copy / "shared" / "quant" / "_q8ir.py"
    ir.write_text(ir.read_text() + "\n# an edit\n")
    after = stamp()
    assert before and after and before != after
