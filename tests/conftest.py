"""What the test modules share: fixtures pytest hands to any test that names
them (no module imports a fixture), and the `integration` marker for tests in
modules that mix in-process tests with ones that start processes.

Tiers (pyproject.toml [tool.pytest.ini_options]):
    python -m pytest -q -m "not integration and not slow"   the unit tests: no process started
    python -m pytest -q                                      everything but the slow tier
    python -m pytest -q -m slow                              the slow tier alone
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The project is imported only where a fixture needs it: a module broken in
# the tree then fails the tests that use it, not the collection of every file.
DIRECTIO = "moe_pipe.shared.experts.directio"

# Tests that start a process, in modules whose other tests run in this one.
# A module whose every test starts one says so itself (`pytestmark`); these
# modules' decorators are not ours to edit, so their tests are named here.
# A name that no longer exists fails the collection: the list cannot go stale.
INTEGRATION = {
    "test_budget.py": {
        "test_real_cgroup_v1_child_sees_its_limit",
        "test_run_near_its_limit_fits_and_a_smaller_limit_is_refused_with_the_numbers",
        "test_service_in_a_tight_cgroup_answers_and_each_child_is_within_its_estimate",
    },
    "test_generate.py": {
        "test_run_json",
        "test_run_chat_seeded_sampling_is_reproducible",
        "test_run_text_streams_and_reports",
        "test_run_bad_values_exit_2",
    },
    "test_quant.py": {"test_kernels_load_from_the_disk_cache_on_the_second_start"},
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    stale: set[str] = set()
    for item in items:
        names = INTEGRATION.get(item.path.name)
        if names is None:
            continue
        stale |= {f"{item.path.name}::{name}" for name in names if not hasattr(item.module, name)}
        if item.originalname in names:
            item.add_marker(pytest.mark.integration)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py INTEGRATION names tests that do not exist: {sorted(stale)}")


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
