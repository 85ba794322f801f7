"""Compute's prefetch gate: per layer, whether its next-layer guesses still
pay (procs/compute.py SlabExperts asks it before every guess)."""

from __future__ import annotations

# Prefetch switches itself off per layer where its guesses stop paying: a
# layer is judged each time GUESS_WINDOW of its guessed experts have been
# scored, and if fewer than GUESS_MIN_USED of them were then chosen it stops
# guessing for GUESS_PAUSE tokens (a wrong guess costs a read and evicts a
# cached expert), then guesses again and is judged afresh. Not tuned yet (no
# quiet-machine run): the floor only stops layers whose guesses are mostly
# wrong; the confident guesses (shared/model/base.py PREFETCH_MIN_P) were
# right ~69 % of the time on the qwen30b-shape model.
GUESS_WINDOW = 32
GUESS_MIN_USED = 0.25
GUESS_PAUSE = 64


class GuessGate:
    """Per layer: do its next-layer guesses still pay? Counts the guessed
    experts issued and used since the layer was last judged, and how many
    more of its guesses to skip."""

    def __init__(self, window: int = GUESS_WINDOW, min_used: float = GUESS_MIN_USED, pause: int = GUESS_PAUSE):
        self.window, self.min_used, self.pause = window, min_used, pause
        self.issued: dict[int, int] = {}
        self.used: dict[int, int] = {}
        self.off: dict[int, int] = {}  # layer -> guesses still to skip
        self.switched_off = 0  # times a layer was switched off (since start)

    def allow(self, layer: int) -> bool:
        """May this layer guess now? A switched-off layer's skipped guess counts down its pause."""
        left = self.off.pop(layer, 0)
        if left > 1:
            self.off[layer] = left - 1
        return left == 0

    def score(self, layer: int, issued: int, used: int) -> None:
        """A guess of `issued` experts of which `used` were then chosen."""
        self.issued[layer] = n = self.issued.get(layer, 0) + issued
        self.used[layer] = u = self.used.get(layer, 0) + used
        if n >= self.window:
            if u < self.min_used * n:
                self.off[layer] = self.pause
                self.switched_off += 1
            self.issued[layer] = self.used[layer] = 0
