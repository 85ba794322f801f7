"""shared/heap.py: a freed large array's pages stay for the next one; give_back returns them.

Measured in a child process (the settings are the whole process's), by the kernel's own
count of the process's anonymous memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
import numpy as np
from moe_pipe.shared import heap

def rss_anon_mib():  # heap.private_bytes: the kernel's RssAnon, the figure the prompt's loan leaves out
    return heap.private_bytes() / 2**20

def layer():  # a prompt layer's large array: 64 MiB, written whole, then freed
    a = np.empty(16 << 20, np.float32)
    a.fill(1.0)
    return float(a[-1])

mode = __import__("sys").argv[1]
if mode == "keep":
    print(heap.keep_freed_memory())
base = rss_anon_mib()
layer()
kept = rss_anon_mib() - base
heap.give_back()
after = rss_anon_mib() - base
print(f"{kept:.1f} {after:.1f}")
"""


def _run(mode: str) -> tuple[str, float, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True).stdout.splitlines()
    kept, after = (float(v) for v in out[-1].split())
    return (out[0] if len(out) > 1 else ""), kept, after


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux")
def test_the_heap_keeps_a_freed_layer_s_pages_until_given_back():
    line, kept, after = _run("keep")
    if "not glibc" in line:
        pytest.skip(line)
    assert "reuse" in line
    assert kept >= 60  # the 64 MiB the layer freed are still this process's, for the next layer
    assert after < 8  # and gone once a request ends
    _, kept_default, _ = _run("default")
    assert kept_default < 8  # glibc's own way: a block this large is unmapped when freed
