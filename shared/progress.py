"""Progress for long work: rich bars and spinners on a terminal; elsewhere off
(`byte_progress`) or a plain line now and then (`StatusLine`); a prompt's
progress as one line (`prompt_progress_text`, what `chat`, `tail` and the web
page show), and a slot's (`slot_text`, what `tail` and the web page show)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
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


def duration_text(seconds: float) -> str:
    """A span for people: "<1 s", "41 s", "3 min 20 s", "1 h 5 min"."""
    s = math.floor(seconds + 0.5)  # half up, as the web page's Math.round
    if seconds < 1:
        return "<1 s"
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def prompt_progress_text(total: int, cache: int, processed: int, time_ms: int) -> str:
    """llama.cpp's `prompt_progress` fields as one line: "prompt 1,536 / 3,664
    tokens · 41 s left". The time left is the rate so far (tokens computed, not
    reused, over `time_ms`) applied to what remains; none before any token is
    done. shared/serve/web/app.js `promptProgressText` writes the same."""
    text = f"prompt {processed:,} / {total:,} tokens"
    if cache:
        text += f" ({cache:,} cached)"
    done = processed - cache
    if processed >= total:
        return text + f" · done in {duration_text(time_ms / 1e3)}"
    if done > 0 and time_ms > 0:
        return text + f" · {duration_text((total - processed) * time_ms / done / 1e3)} left"
    return text


def slot_text(slot: Mapping[str, Any]) -> str:
    """One of compute's slots (a row of SlotStates.rows()) as one line: "slot 0 idle",
    "slot 1 prompt 1,536 / 3,664 tokens (512 cached)", "slot 2 decoding, 35 tokens".
    shared/serve/web/app.js `slotText` writes the same."""
    head = f"slot {slot['id']}"
    if slot["state"] == "idle":
        return f"{head} idle"
    if slot["state"] == "prompt":
        cached = f" ({slot['cache']:,} cached)" if slot["cache"] else ""
        return f"{head} prompt {slot['processed']:,} / {slot['total']:,} tokens{cached}"
    n = slot["decoded"]
    return f"{head} decoding, {n:,} token{'' if n == 1 else 's'}"


def pool_text(held: int, pool: int) -> str:
    """How full the slots' KV pool is, as one line: "KV pool 4,352 / 14,336 positions".
    shared/serve/web/app.js `poolText` writes the same."""
    return f"KV pool {held:,} / {pool:,} positions"
