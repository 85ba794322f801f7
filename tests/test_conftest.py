"""The shared test machinery of tests/conftest.py holds: a test that starts a
process must be marked `integration`."""

import multiprocessing
import subprocess

import pytest


def test_an_unmarked_test_cannot_start_a_subprocess():
    with pytest.raises(AssertionError, match="mark it @pytest.mark.integration"):
        subprocess.run(["true"], check=True)


def test_an_unmarked_test_cannot_start_a_multiprocessing_child():
    with pytest.raises(AssertionError, match="mark it @pytest.mark.integration"):
        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.integration
def test_a_marked_test_may():
    assert subprocess.run(["true"], check=True).returncode == 0
