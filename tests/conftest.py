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
import threading
import time
from pathlib import Path

import pytest

# The project is imported only where a fixture needs it: a module broken in
# the tree then fails the tests that use it, not the collection of every file.
DIRECTIO = "moe_pipe.shared.experts.directio"
WARMUP_DONE = "MOE_PIPE_TEST_WARMUP_DONE"  # the file that says the controller's kernel warm-up has ended
WARMUP_WAIT_S = 900.0  # the most an integration test waits for it (a cold cache takes ~60 s)
_WARMUP = pytest.StashKey[tuple]()


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
    the cache every later process loads from (seconds when it is warm already). It runs beside
    the tests (~60 s on one core from an empty cache): the unit tests go on meanwhile and an
    integration test waits for it (`kernels_warm_before_a_process`). A run of the unit tier
    starts no process and skips it."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config, "workerinput") or "not integration" in (config.option.markexpr or ""):
        return
    if config.option.collectonly:
        return
    folder = Path(tempfile.mkdtemp(prefix="moe-pipe-test-warmup-"))
    warmup = subprocess.Popen([sys.executable, "-m", "moe_pipe.cli.main", "warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ[WARMUP_DONE] = str(folder / "done")  # the workers, started after this, inherit it
    config.stash[_WARMUP] = (warmup, folder)

    def mark_done() -> None:
        warmup.wait()  # a failed warm-up is done too: the processes then compile for themselves
        (folder / "done").touch()

    threading.Thread(target=mark_done, daemon=True).start()


def pytest_unconfigure(config):
    """The warm-up goes with the run (an interrupted run kills it), and its marker folder."""
    warmup, folder = config.stash.get(_WARMUP, (None, None))
    if warmup is not None:
        warmup.kill()
        warmup.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def kernels_warm_before_a_process(request):
    """An integration test, or one marked `quiet` (it measures how busy the machine's cores
    are), waits for the controller's warm-up (pytest_configure) before it starts processes
    that would compile the same kernels at once; a unit test goes ahead."""
    done = os.environ.get(WARMUP_DONE)
    if done and (request.node.get_closest_marker("integration") or request.node.get_closest_marker("quiet")):
        waited = 0.0
        while not os.path.exists(done) and waited < WARMUP_WAIT_S:
            time.sleep(0.2)
            waited += 0.2
    yield


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marks added here count
def pytest_collection_modifyitems(config, items):
    """A module's `slow_case(name, params)` moves cases to the slow tier that a mark on a
    parameter cannot say: a combination of a fixture's parameter and a test's (the float
    activations on a type that computes on int8 ones; a process's lifecycle on the second
    and third family) that repeats what the default tier's other cases cover.

    Then the tests that start no process go first, file by file (a file stays whole, on one
    xdist worker), so the two workers run them while the kernel warm-up (pytest_configure)
    runs, rather than wait for it at a file's first integration test."""
    for item in items:
        slow_case = getattr(getattr(item, "module", None), "slow_case", None)
        callspec = getattr(item, "callspec", None)
        if slow_case is not None and callspec is not None and slow_case(item.originalname, callspec.params):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("integration") is not None)  # stable: files keep their order


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
