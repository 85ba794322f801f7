"""The windows every speed figure of moe-pipe takes, in one place.

    steady_start(n)        -> int   leading records of a run of n that are not its steady window
    warmup_walls(walls)    -> walls the reply's tokens 2..50

`moe-pipe doctor` forecasts both figures; the benchmark protocol (bench/_protocol.py),
`moe-pipe bench`, the run summary (shared/telemetry.py), a reply's `timings`, `tail`
and the web page report them (docs/telemetry.md § Run summary).
"""

from __future__ import annotations

from collections.abc import Sequence

# The steady window is a run's last quarter of records. See `steady_start` for why.
STEADY_PARTS = 4
# The warm-up figure: the mean wall of tokens 2..50 of a reply, the cache filling from cold.
WARMUP_TOKENS = range(2, 51)


def steady_start(n: int) -> int:
    """How many leading records of a run of n are not in its steady window: all but the last
    quarter (at least one record).

    Why: one speed story. `moe-pipe doctor` forecasts, and the benchmark protocol
    (bench/_protocol.py), `moe-pipe bench`, the run summary, `tail` and the web page
    report, the same "steady" figure: tokens over the wall of a reply's last quarter,
    where a cache that was still filling at token 10 % has settled (a 256-token reply's
    cache keeps filling well past token 26). A fixed rule (not a detected plateau) keeps
    figures comparable across runs and configs."""
    if n < 2:
        return 0
    return n - max(1, n // STEADY_PARTS)


def warmup_walls(walls_ms: Sequence[float]) -> Sequence[float]:
    """The walls of tokens WARMUP_TOKENS (2..50) of a reply, its first token's (the prompt) left out."""
    return walls_ms[WARMUP_TOKENS.start - 1 : WARMUP_TOKENS.stop - 1]
