"""Time spent per stage of the forward pass (attention, router, experts, head),
for benchmarks and telemetry. Off by default: a disabled stage costs one
attribute test."""

from __future__ import annotations

import time
from collections import defaultdict


class Stages:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)
        self._name = ""
        self._t0 = 0.0

    def __call__(self, name: str) -> Stages:
        self._name = name
        return self

    def __enter__(self) -> Stages:
        if self.enabled:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.seconds[self._name] += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.seconds.clear()
