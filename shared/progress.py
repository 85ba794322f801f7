"""Progress bars for long work (rich), off when output is not a terminal."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


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
