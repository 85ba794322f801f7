"""What the test modules share: fixtures pytest hands to any test that names
them (no module imports a fixture).

A test that starts a process (a subprocess, multiprocessing, the CLI, the
service) is marked `integration` where it is written: `pytestmark` for a module
whose every test does, `@pytest.mark.integration` on the test otherwise
(`no_process_outside_integration` below fails a test that starts one unmarked).

Tiers (pyproject.toml [tool.pytest.ini_options]):
    python -m pytest -q -m "not integration and not slow"   the unit tests: no process started
    python -m pytest -q                                      everything but the slow tier
    python -m pytest -q -m slow                              the slow tier alone
"""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# The project is imported only where a fixture needs it: a module broken in
# the tree then fails the tests that use it, not the collection of every file.
DIRECTIO = "moe_pipe.shared.experts.directio"


def pytest_configure(config):
    """Ctrl-C reaches the processes the tests start, also when the suite itself runs as a
    background job of a script (`pytest ... &`): such a shell starts it with SIGINT ignored, which
    every child would inherit, and the tests that press Ctrl-C on a run, a service or a pull
    would wait for an interrupt that never comes. A handler is not inherited across exec: the
    children start with the default, as from a terminal.

    Then compile the tiny model's kernels once, before any test starts a process: from an empty
    numba cache every compute process a test starts compiles them itself (~30 s of two cores
    each), and with two workers starting services at once that is minutes of the tier. Here,
    in the controller only (xdist workers have `workerinput`), `moe-pipe warmup` writes them to
    the cache every later process loads from (seconds when it is warm already). A run of the
    unit tier starts no process and skips it."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config, "workerinput") or "not integration" in (config.option.markexpr or ""):
        return
    if config.option.collectonly:
        return
    subprocess.run([sys.executable, "-m", "moe_pipe.cli.main", "warmup"], capture_output=True, check=False, timeout=900)


@pytest.fixture(autouse=True, scope="session")
def llama_cpp_without_repacking():
    """llama.cpp loads the tests' files as the benchmark's peer does (mmap, no weight
    repacking: shared/analysis/peer_llama.py set_repack). llama-cpp-python 0.3.36
    crashes in its AMX repacked buffers on quantized files where the CPU has AMX."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:  # the llama.cpp oracle tests skip
        yield
        return
    from moe_pipe.shared.analysis.peer_llama import set_repack

    set_repack(False)
    yield


@pytest.fixture(autouse=True)
def no_process_outside_integration(request, monkeypatch):
    """A test not marked `integration` that starts a process fails, so the unit
    tier (-m "not integration and not slow") stays in-process and the marker
    cannot go stale. Process-starting fixtures of a wider scope belong to
    modules marked `integration` as a whole."""
    if request.node.get_closest_marker("integration") is None:

        def refuse(*args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.integration")

        monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


@pytest.fixture(autouse=True)
def no_fault_hook():
    """Every test starts without a directio fault hook and leaves none behind
    (a hook is process-wide: a test that failed holding one would fail the next).
    A test sets one only through the module it imported: not imported, no hook."""
    directio = sys.modules.get(DIRECTIO)
    previous = directio.set_fault_hook(None) if directio else None
    yield
    directio = sys.modules.get(DIRECTIO)
    if directio:
        directio.set_fault_hook(previous)


@pytest.fixture(autouse=True, scope="module")
def private_state_home_per_module(tmp_path_factory):
    """A module's services (a module-scoped one too) keep their hot sets and kept logs in a
    folder of the module's own, never the user's ~/.local/state: a hot set one test's service
    saved would warm the next test's cache and change what it reads."""
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old


@pytest.fixture(autouse=True)
def private_state_home(tmp_path_factory, monkeypatch):
    """Each test's own state folder (hot sets, kept logs): see the module-wide one above."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture
def short_tmp() -> Path:
    """A private folder with a short path: a runtime folder's unix sockets must
    stay under 107 bytes, which pytest's tmp_path can exceed."""
    folder = Path(tempfile.mkdtemp(prefix="mpt", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny model (made once and cached), read-only: copy it to change it."""
    from moe_pipe.shared.makemodel.default_model import default_model_path

    return default_model_path()


@pytest.fixture
def model(short_tmp, tiny_model) -> Path:
    """A private copy of the tiny model (tests truncate, move and replace it)."""
    path = short_tmp / "m.gguf"
    shutil.copy(tiny_model, path)
    return path


@pytest.fixture
def harness(model):
    """The reader of tests/readerhelp.py over the private copy."""
    from .readerhelp import Harness

    h = Harness(model)
    yield h
    h.close()


@pytest.fixture
def range_hub(tmp_path, monkeypatch):
    """The hub, and this test's HF_ENDPOINT, HF_HOME and moe-pipe cache folder (nothing pulled, no header kept)."""
    from .rangehub import RangeHub, point_hf_at

    h = RangeHub()
    point_hf_at(monkeypatch, h.url, tmp_path)
    yield h
    h.close()
