"""How compute's heap keeps the memory a prompt chunk frees, for the chunk's next layer.

    keep_freed_memory() -> str   once compute is warm: freed blocks stay in the heap (glibc), a line for the log
    give_back()                  once a prompt's pass is done (with several slots, each chunk's), and
                                 when a request ends: the heap's free pages go back to the system
    private_bytes() -> int       the process's private pages now (what the prompt's loan leaves out)

A prompt chunk allocates arrays of tens of MB in every layer and frees them before
the next (a 3,600-token chunk's queries and attention output on qwen30b-shape are
59 MB each). glibc's malloc serves a block above its mmap threshold (32 MiB at most)
with a mapping of its own and unmaps it when freed, so each layer faults those pages
in again: a 4,096 × 2,048 product over 3,600 rows took 245 ms into a fresh array
against 120 ms into pages used before (2026-12-05, this VM, whose host backs a page
on its first touch; on a device the kernel zeroes each page). With mappings of their
own off (M_MMAP_MAX 0) and the heap's top not trimmed when freed (M_TRIM_THRESHOLD),
the pages a layer frees serve the next one's arrays, and once the prompt's pass is done
`give_back` (malloc_trim) returns the free pages (again when a request ends), so the
reply's tokens and an idle compute hold what they held before. Kept through the reply,
a 2,933-token chunk's 1.6 GB starved a dense set read through the file mapping
(DeepSeek-V4-Flash's shape at full depth in 11 GB: 11-58 s a token against 0.9;
docs/benchmarks.md § Deep cuts of the largest families on a phone's memory). The
chunk's arrays are in the memory budget either way (shared/gguf/spec.py
prefill_activation_bytes). Only glibc has these knobs: on
another C library (musl, Android's) both calls do nothing.
"""

from __future__ import annotations

import ctypes
import functools

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_NEVER = 2**31 - 1  # the largest int mallopt takes: the heap's top is kept until give_back


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (the one with mallopt and malloc_trim)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    return libc


def keep_freed_memory() -> str:
    """Have the heap keep what a prompt chunk's layer frees for the next layer (module doc);
    a line for the start-up log."""
    libc = _glibc()
    if libc is None:
        return "heap: the C library's own (not glibc): a prompt's large arrays take fresh pages each layer"
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER)):
        return "heap: glibc refused the settings: a prompt's large arrays take fresh pages each layer"
    return "heap: a prompt's large arrays reuse the pages the layer before freed; given back when a request ends"


def private_bytes() -> int:
    """This process's private memory now (RssAnon; 0 where /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def give_back() -> None:
    """Return the heap's free pages to the system (a request has ended)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
