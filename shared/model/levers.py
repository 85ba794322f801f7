"""The lossy levers: routing changes that trade exactness for cache hits.

Off by default, and each one CHANGES OUTPUTS when on. They act on decode
(one token) only — a prompt batch is routed exactly — and only where the
expert source can say what is cached (the pipeline's residency index); the
resident reference has everything cached, so there they do nothing.

- drop_cold F: skip a routed expert only if it is a cache miss and its
  weight is below F × the even share (1/k of the weights' sum); the kept
  weights are scaled back to the original sum. At least one expert stays.
- cache_route MARGIN: a routed expert that is a miss is swapped for the best
  unrouted expert that is cached and near-tied with it: router probability
  at least (1 − MARGIN) × its own, i.e. score ≥ its score + ln(1 − MARGIN)
  (probabilities are a softmax of the scores, so this holds for logits of
  every architecture). The swapped-in expert takes the replaced choice's weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .moe import Routing

Resident = Callable[[Sequence[int]], list[bool]]


@dataclass(frozen=True)
class Levers:
    drop_cold: float = 0.0
    cache_route: float = 0.0
    # Route each layer on the previous layer's router input (MoEModel.route_ahead): it acts
    # before the routing is made, where the two above act on it.
    route_ahead: bool = False

    @property
    def active(self) -> bool:
        """Whether a lever acts on a routing once it is made (`apply_levers`)."""
        return self.drop_cold > 0 or self.cache_route > 0


def prefer_cached(routing: Routing, scores: np.ndarray, resident: Resident, margin: float) -> Routing:
    """One token: swap each missing routed expert for a cached near-tie (see module doc)."""
    ids = routing.ids[0].tolist()
    cached = resident(ids)
    if all(cached) or margin <= 0:
        return routing
    slack = math.log1p(-min(margin, 1 - 1e-9))  # ≤ 0
    order = np.argsort(-scores, kind="stable").tolist()  # best first
    taken = set(ids)
    candidates = [e for e in order if e not in taken]
    candidate_cached = dict(zip(candidates, resident(candidates)))
    for choice in range(len(ids) - 1, -1, -1):  # the weakest misses first
        if cached[choice]:
            continue
        floor = float(scores[ids[choice]]) + slack
        for e in candidates:
            if scores[e] < floor:
                break  # sorted: no later candidate is close enough
            if candidate_cached[e] and e not in taken:
                taken.add(e)
                ids[choice], cached[choice] = e, True
                break
    return Routing(np.asarray([ids], np.int64), routing.weights)


def drop_cold(routing: Routing, resident: Resident, fraction: float) -> Routing:
    """One token: drop missing experts whose weight is below fraction × the even share."""
    ids, w = routing.ids[0], routing.weights[0]
    total = float(w.sum())
    even = total / len(ids)
    cached = resident(ids.tolist())
    keep = [s for s in range(len(ids)) if cached[s] or w[s] >= fraction * even]
    if not keep:
        keep = [int(np.argmax(w))]  # never drop them all: keep the strongest
    if len(keep) == len(ids):
        return routing
    kw = w[keep]
    kw = (kw * (total / float(kw.sum()))).astype(np.float32)
    return Routing(ids[keep][None, :].astype(np.int64), kw[None, :])


def apply_levers(levers: Levers, routing: Routing, scores: np.ndarray, resident: Resident | None) -> Routing:
    """The levers in order (swap first, then drop what is still cold); decode only."""
    if not levers.active or resident is None or routing.ids.shape[0] != 1:
        return routing
    if levers.cache_route > 0:
        routing = prefer_cached(routing, np.asarray(scores, np.float32).reshape(-1), resident, levers.cache_route)
    if levers.drop_cold > 0:
        routing = drop_cold(routing, resident, levers.drop_cold)
    return routing
