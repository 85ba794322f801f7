"""A prompt's pass, watched: how far it has come (llama.cpp's server
`prompt_progress`: total, cache, processed, time_ms), and where a Stop may end it.

    watch.begin(total, cached, cache)  the prompt's uncached tokens are about to run: the opening event
    watch.layer_done(i, t)             the model's layer observer (ModelOptions.layer_observer)
    watch.poll()                       between experts (procs/compute.py SlabExperts): a long layer can be stopped
    watch.end()                        the pass is done: the closing event, processed == total
    watch.abort()                      the pass failed or was stopped: a recurrent state goes back to the last chunk's end

How `processed` advances under layer-major prefill. A chunk of C tokens goes
through layer 0, then layer 1, ... (shared/model/base.py `forward`), so none
of its tokens is finished before its last layer: counting finished tokens
would sit still for the whole chunk and then jump by C (a 3,664-token prompt
in one chunk: 0 for minutes, then 3,664). `processed` counts the work done
instead, token-layers over the layers:

    processed = cached + (tokens each finished layer ran, summed) // n_layer

so after layer i of a chunk of C tokens that starts `before` tokens into the
computed part it is cached + before + C·(i+1) // n_layer. It grows a little
after every layer and equals `total` exactly when the last chunk's last layer
is done. Layers do not all cost the same (dense lead layers, sliding-window
and full attention, cold experts early in a prompt), so a rate read from it
is an estimate.

Events are sent in order: the opening one (processed == cached), then at most
one every PROGRESS_INTERVAL_S while processed grows and stays below total,
then the closing one (processed == total): at most four a second plus two,
however fast the layers go, and the last before the first token.

A Stop arrives as an exception from `check` (compute's Interrupts), asked at
most every POLL_INTERVAL_S: after every layer and between experts. Raised
there, the pass ends before `forward` counts its chunk (the KV cache counts a
chunk only once every layer stored it: shared/model/session.py), so the
positions held are the chunks done before. A hybrid model's recurrent state
(qwen35moe) is updated in place by every layer, so it is copied at the start
of the prompt and after each chunk, and `abort` puts the copy back: the state
then matches the positions the cache holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# At most this often an event that only reports growth (4 a second): a client
# redraws a line, and a stream of thousands of chunks would cost more than it shows.
PROGRESS_INTERVAL_S = 0.25
# At most this often the Stop check (a non-blocking poll of a socket, a few µs):
# a Stop ends a prompt well within a second, and thousands of experts a chunk
# do not each pay for a poll.
POLL_INTERVAL_S = 0.05


@dataclass(frozen=True)
class PromptProgress:
    """llama.cpp's `prompt_progress`: of `total` prompt tokens, `cache` were reused
    and `processed` (cache included) are done, `time_ms` since the pass began."""

    total: int
    cache: int
    processed: int
    time_ms: int


class PromptWatch:
    def __init__(
        self,
        n_layer: int,
        send: Callable[[PromptProgress], None],
        check: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = PROGRESS_INTERVAL_S,
        poll_s: float = POLL_INTERVAL_S,
    ):
        """`send` each event; `check` raises to stop the pass (None: nothing stops it)."""
        self.n_layer, self.send, self.check, self.clock = n_layer, send, check, clock
        self.interval_s, self.poll_s = interval_s, poll_s
        self.armed = False
        self.total = self.cached = self.token_layers = self.sent = 0
        self.t0 = self.sent_at = self.polled_at = 0.0
        self.cache = None
        self.saved: tuple[dict[int, np.ndarray], dict[int, np.ndarray]] | None = None

    @property
    def processed(self) -> int:
        return self.cached + self.token_layers // self.n_layer

    def begin(self, total: int, cached: int, cache=None) -> None:
        """A prompt of `total` tokens, `cached` of them already in `cache`, starts its pass."""
        self.armed, self.total, self.cached, self.token_layers = True, total, cached, 0
        self.t0 = self.polled_at = self.clock()
        self.cache = cache
        self.saved = None
        self._save_state()
        self._send(self.cached)

    def layer_done(self, layer: int, tokens: int) -> None:
        if not self.armed:  # a decoded token, a context shift's pass: not a prompt
            return
        self.token_layers += tokens
        self.poll()
        if layer == self.n_layer - 1:  # the chunk is done (the cache counts it next): its state is the next chunk's start
            self._save_state()
        processed = self.processed
        if self.sent < processed < self.total and self.clock() - self.sent_at >= self.interval_s:
            self._send(processed)

    def poll(self) -> None:
        """Ask whether to stop, at most every `poll_s`, while a prompt runs."""
        if self.armed and self.check is not None:
            now = self.clock()
            if now - self.polled_at >= self.poll_s:
                self.polled_at = now
                self.check()

    def end(self) -> None:
        if self.armed:
            self._disarm()  # first: a send that fails leaves no watch armed for the decode steps
            self._send(self.total)

    def abort(self) -> None:
        """The pass stopped half way: put the recurrent state back to the end of the
        last chunk done, which is where the cache's count of positions stands."""
        if self.armed and self.saved is not None and self.cache is not None and self.cache.state is not None:
            self.cache.state.restore(self.saved)
        self._disarm()

    def _save_state(self) -> None:
        state = getattr(self.cache, "state", None)
        if state is not None:
            self.saved = state.snapshot()

    def _send(self, processed: int) -> None:
        now = self.clock()
        self.sent, self.sent_at = processed, now
        self.send(PromptProgress(self.total, self.cached, processed, round((now - self.t0) * 1e3)))

    def _disarm(self) -> None:
        self.armed, self.cache, self.saved = False, None, None
