"""Progress for long work: rich bars and spinners on a terminal; elsewhere off
(`byte_progress`) or a plain line now and then (`StatusLine`)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any


@contextlib.contextmanager
def byte_progress(label: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """Yields `update(done_bytes, total_bytes)`; draws a transfer bar when enabled."""
    if not enabled:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


class StatusLine:
    """One line of progress for a start-up stage (loading, compiling kernels).

    On a terminal: a rich spinner redrawn in place, gone when the stage ends.
    Elsewhere (a pipe, a log, a test): plain lines on the stream, one per
    update, at most one every `min_interval_s` (default 0: every step, so a
    log says what the wait was for, the same on a fast machine as on a slow
    one). `done(text)` always prints."""

    def __init__(self, stream: IO[str] | None = None, terminal: bool | None = None, min_interval_s: float = 0.0):
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.min_interval_s = min_interval_s
        self._last = -math.inf
        self._status: Any = None

    def __enter__(self) -> StatusLine:
        if self.terminal:
            from rich.console import Console

            self._status = Console(file=self.stream).status("")
            self._status.start()
        return self

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)
            return
        now = time.monotonic()
        if now - self._last >= self.min_interval_s:
            self._last = now
            print(f"[{text}]", file=self.stream, flush=True)

    def done(self, text: str) -> None:
        self.close()
        print(f"[{text}]", file=self.stream, flush=True)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def __exit__(self, *exc: object) -> None:
        self.close()
