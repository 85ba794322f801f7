"""Choosing the next token from logits: greedy, or temperature with top-k,
top-p and min-p truncation, a repetition penalty, and a seed.

The order is llama.cpp's: repetition penalty → top-k → top-p → min-p →
temperature → draw. Temperature 0 (the default) is greedy: argmax, ties to
the lowest id, no random numbers drawn.

A constraint (a grammar: shared/text/constrain.py) comes before all of them:
the logits of the tokens it does not allow next become -inf, so no
truncation or draw can pick one, and it is told the chosen token after.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        checks = [
            ("temperature", self.temperature >= 0, "≥ 0"),
            ("top_k", self.top_k >= 0, "≥ 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("repeat_penalty", self.repeat_penalty > 0, "> 0 (1 = off)"),
            ("repeat_last_n", self.repeat_last_n >= 0, "≥ 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise UserError(f"sampling {name} = {getattr(self, name)} is not allowed: must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Constraint(Protocol):
    """What the Sampler needs of a grammar (shared/text/constrain.py's JsonConstraint)."""

    def mask(self, z: np.ndarray) -> None:
        """In place: the logits of the tokens not allowed next become -inf
        (once the grammar is complete, all but end-of-generation)."""

    def accept(self, token: int) -> None:
        """The token chosen: advance the grammar past it."""


class Sampler:
    def __init__(self, params: SamplingParams, constraint: Constraint | None = None):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.constraint = constraint

    def __call__(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        token = self._draw(logits, history)
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    def _draw(self, logits: np.ndarray, history: list[int] | None) -> int:
        p = self.params
        recent = history[-p.repeat_last_n :] if p.repeat_penalty != 1.0 and history and p.repeat_last_n else None
        if p.greedy and self.constraint is None and recent is None:
            # float64 keeps every logit's order, so the argmax is the same one: this skips a
            # copy of the vocabulary each token (~50 µs of a token's 60 on Qwen3's 151,936)
            return int(np.argmax(logits))
        z = np.array(logits, dtype=np.float64)  # [V]
        if self.constraint is not None:
            self.constraint.mask(z)
        if recent is not None:
            z = penalize_repeats(z, recent, p.repeat_penalty)
        if p.greedy:
            return int(np.argmax(z))
        keep = truncate(z, p.top_k, p.top_p, p.min_p)  # candidate ids, best first; None: every id
        if keep is None:
            return draw_from_all(z / p.temperature, self.rng)
        zk = z[keep] / p.temperature
        probs = np.exp(zk - zk.max())
        probs /= probs.sum()
        return int(keep[self.rng.choice(keep.size, p=probs)])


def penalize_repeats(z: np.ndarray, recent: list[int], penalty: float) -> np.ndarray:
    """CTRL-style: divide positive logits of recent tokens by the penalty, multiply negative ones."""
    z = z.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    vals = z[ids]
    z[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return z


# A full stable sort of the vocabulary (10-30 ms at 152k ids, more than a resident decode
# step) is needed only for the ids a draw can reach: the best first, in blocks that grow by
# this factor from FIRST_RANKS until they hold what the truncation or the draw needs.
FIRST_RANKS = 256
RANKS_GROWTH = 8


def ranked_prefix(z: np.ndarray, n: int) -> np.ndarray:
    """The first n ids of `np.argsort(-z, kind="stable")` (best first, ties to the lower
    id), without sorting the rest: the ids above the n-th best value, then as many of
    those equal to it as fit, lowest first, stably sorted."""
    size = z.size
    if n >= size:
        return np.argsort(-z, kind="stable")
    nth = -np.partition(-z, n - 1)[n - 1]  # the n-th best value
    above = np.flatnonzero(z > nth)
    tied = np.flatnonzero(z == nth)[: n - above.size]
    ids = np.sort(np.concatenate([above, tied]))  # id order, so the stable sort breaks ties by id
    return ids[np.argsort(-z[ids], kind="stable")]


def ranked_blocks(z: np.ndarray) -> Iterator[np.ndarray]:
    """`ranked_prefix` of FIRST_RANKS ids, then RANKS_GROWTH times as many, ..., the last
    the whole vocabulary: for a caller that stops once a prefix holds what it needs."""
    n = FIRST_RANKS
    while n < z.size:
        yield ranked_prefix(z, n)
        n *= RANKS_GROWTH
    yield ranked_prefix(z, z.size)


def truncate(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray | None:
    """Ids that survive top-k, then top-p (smallest set with mass ≥ p), then min-p; best
    first, as a stable sort of the whole vocabulary would order them; None when nothing
    is cut (every id stays: `draw_from_all`). Only as many of the best ids are ranked as
    the cut needs (`ranked_prefix`). Without top-k the masses are normalized by the sum
    over the whole vocabulary taken in id order, where a full sort took it best first: the
    two differ in the last bits only, so a cut moves only where the running mass lands
    within a rounding of top_p."""
    size = z.size
    order = ranked_prefix(z, min(top_k, size)) if top_k else None
    if order is not None:
        probs = np.exp(z[order] - z[order[0]])
        probs /= probs.sum()
    elif top_p < 1.0 or min_p > 0.0:
        zmax = z.max()
        total = np.exp(z - zmax).sum()
        order, probs = _best_until(z, zmax, total, top_p if top_p < 1.0 else None, min_p)
    else:
        return None
    if top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), top_p)) + 1  # include the token that crosses p
        order, probs = order[:cut], probs[:cut]
    if min_p > 0.0:
        keep = probs >= min_p * probs[0]
        order = order[keep]
    return order


def _best_until(z: np.ndarray, zmax: float, total: float, top_p: float | None, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The best ids and their masses exp(z − zmax)/total, as many as top-p's cut (its
    running mass reaching top_p) or min-p's (a mass below min_p × the best's) needs."""
    for order in ranked_blocks(z):  # the last block is the whole vocabulary
        probs = np.exp(z[order] - zmax) / total
        if (np.cumsum(probs)[-1] >= top_p) if top_p is not None else (probs[-1] < min_p * probs[0]):
            break
    return order, probs


def draw_from_all(zt: np.ndarray, rng: np.random.Generator) -> int:
    """One id drawn from softmax(zt) over the whole vocabulary, as `rng.choice` over the
    ids sorted best first would draw it (one uniform number, the first id whose running
    mass passes it), ranking only the best ids until their mass passes it. The total is
    summed in id order (a sort summed it best first: the last bits only)."""
    w = np.exp(zt - zt.max())
    total = w.sum()
    u = rng.random()
    for order in ranked_blocks(zt):  # the last block is the whole vocabulary
        cdf = np.cumsum(w[order]) / total
        if cdf[-1] > u:
            break
    return int(order[min(int(np.searchsorted(cdf, u, side="right")), order.size - 1)])
