"""Routing and route traces: recording them (`--route-trace`) and driving
a model by one (`--route-replay`).

RouteTracer: an observer for `MoEModel.route_observer` that writes every
routing decision to a route trace (shared/model/trace.py).

RouteReplay — trace-driven routing for benchmarks (`--route-replay TRACE`).

A synthetic-weight model routes however its random router says; to let the
cache and the disk see a real model's access pattern, the router's choices
are replaced by a recorded route trace's: at layer L, the n-th token routed
through this model takes the experts (and weights) of the n-th token the
trace recorded at layer L, cycling when the run is longer. Only the experts
change, so every kernel, read and cache decision is the real one; the
tokens are not the model's own (a benchmark only).

The model must have the trace's expert count and at most its layers (a model
cut to fewer layers takes the trace's first ones).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import UserError
from .moe import Routing
from .trace import TraceHeader, TraceWriter


class RouteTracer:
    """`--route-trace FILE`: every routing decision, in the route-trace format
    (shared.trace), with whether each expert was cached when it was routed
    (`resident(layer, ids)`; without one, the resident path: all cached).
    A turn is one request; its steps are token positions (prompt 0..P-1,
    then one per generated token), as in the published phone traces."""

    def __init__(self, path: str, mf, top_k: int | None, resident: Callable[[int, list[int]], list[bool]] | None = None):
        self.writer = TraceWriter(path)
        self.writer.write_header(TraceHeader.from_layout(mf.gguf.path, mf.layout, top_k))
        self.resident = resident or (lambda layer, ids: [True] * len(ids))  # resident path: all cached
        self.last_layer = mf.spec.n_layer - 1
        self.turn, self.phase, self.step = self.writer.next_turn - 1, 0, 0

    def begin_turn(self) -> None:
        self.turn, self.step = self.turn + 1, 0

    def __call__(self, layer: int, routing) -> None:
        ids = routing.ids
        cached = np.asarray(self.resident(layer, ids.reshape(-1).tolist()), np.int64).reshape(ids.shape)
        self.writer.write_routing(self.turn, self.phase, self.step, layer, ids, routing.weights, cached)
        if layer == self.last_layer:
            self.step += ids.shape[0]

    def close(self) -> None:
        self.writer.close()


class RouteReplay:
    def __init__(self, trace, spec):
        h = trace.header
        if h.n_expert != spec.n_expert or spec.n_layer > h.n_layer:
            raise UserError(
                f"{trace.path}: a trace of {h.n_layer} layers x {h.n_expert} experts cannot drive this "
                f"model's {spec.n_layer} layers x {spec.n_expert} experts (the expert counts must match "
                "and the model may not have more layers)"
            )
        self.path = str(trace.path)
        self.tokens: list[list[tuple[np.ndarray, np.ndarray]]] = [self._layer_tokens(trace, l) for l in range(spec.n_layer)]
        for l, toks in enumerate(self.tokens):
            if not toks:
                raise UserError(f"{trace.path}: the trace has no routing for layer {l}")
        self.cursor = [0] * spec.n_layer

    @staticmethod
    def _layer_tokens(trace, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(expert ids, weights) of every token the trace routed at `layer`, in order."""
        rows = np.flatnonzero(trace.layer == layer)
        if rows.size == 0:
            return []
        key = np.stack([trace.turn[rows], trace.step[rows]], axis=1)
        cut = np.flatnonzero(np.any(key[1:] != key[:-1], axis=1)) + 1
        return [(trace.expert[g].astype(np.int64), trace.weight[g].astype(np.float32)) for g in np.split(rows, cut)]

    def route(self, layer: int, n_tokens: int) -> Routing:
        """The next `n_tokens` tokens' routing at `layer` (equal k per call: the
        trace's top-k; a token recorded with fewer experts is padded with other
        experts at weight 0, so a token never names an expert twice)."""
        routing = self.peek(layer, n_tokens)
        self.cursor[layer] = (self.cursor[layer] + n_tokens) % len(self.tokens[layer])
        return routing

    def peek(self, layer: int, n_tokens: int = 1) -> Routing:
        """What `route` will answer next at `layer`, without moving on: the
        perfect next-layer guess (prefetch under replay measures its ceiling)."""
        toks, at = self.tokens[layer], self.cursor[layer]
        picked = [toks[(at + t) % len(toks)] for t in range(n_tokens)]
        k = max(len(ids) for ids, _ in picked)
        ids = np.empty((n_tokens, k), np.int64)
        w = np.zeros((n_tokens, k), np.float32)
        for t, (e, ww) in enumerate(picked):
            ids[t, : len(e)], w[t, : len(e)] = e, ww
            if len(e) < k:
                ids[t, len(e) :] = [x for x in range(k + len(e)) if x not in set(e.tolist())][: k - len(e)]
        return Routing(ids, w)
