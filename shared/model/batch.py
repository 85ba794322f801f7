"""One forward pass over the rows of several sequences: continuous batching's model layer.

A pass takes a decode step of N sequences (one token each) and, beside them, a
chunk of another sequence's prompt, each sequence with its own KV cache (and
recurrent state) at its own position. Every per-row operation (embedding, norms,
dense projections, router, routed experts, shared experts, output head) runs once
on the concatenated rows, so each routed expert multiplies all its rows, whatever
sequence they come from, in one call (shared/model/moe.py apply_experts); only what
depends on a sequence's own positions runs per sequence: attention over its cache
and a recurrent layer's scan over its state.

Why a cache object and not a second forward pass per family: the layers already
take one `KVCache` and a row per position, and the per-row operations are
batch-exact (a row in a batch computes exactly what it computes alone:
docs/kernels.md). So `BatchCache` presents the cache interface the layers use —
`store` puts each sequence's rows in its own cache at its own next position, and
`attention`, `store_and_attend` (shared/model/blocks.py), deepseek2's MLA and the
recurrent scans split their rows with `per_sequence` — while the rows' positions
(`positions`, each row its own) carry RoPE. A family's `layer` runs unchanged on
a batch, and its output for each sequence is, bit for bit, what a pass of that
sequence alone gives (tests/test_batch.py: every family, token for token and
logit for logit).

    parts = [BatchPart([tok_a], cache_a), BatchPart([tok_b], cache_b), BatchPart(chunk, cache_c)]
    logits = model.forward_batch(parts)            # [1, V] each: every part's last row
    decode_together(model, requests, n_ctx)        # greedy sequences joining and leaving

A prompt's chunk may also go through the layers a few at a time (`PromptSlice`):
each pass takes the decode rows through every layer and the chunk through its
next layers only, its hidden state kept between passes, so decoding sequences
wait a few layers of the chunk between tokens rather than all of them:

    piece = PromptSlice(chunk, cache_c)
    while not piece.done:
        logits = model.forward_batch(decode_parts, prompt=piece, layers=2)
    piece.logits                                   # [1, V]: the chunk's last row

Legend: T rows of the pass (all sequences), S sequences, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .blocks import KVCache


@dataclass(frozen=True)
class BatchPart:
    """One sequence's rows in a batched pass: its tokens at its cache's next positions."""

    tokens: Sequence[int] | np.ndarray
    cache: KVCache
    all_logits: bool = False  # every row's logits, not only the last's (a verify pass's)


@dataclass
class PromptSlice:
    """A prompt's chunk on its way through the layers, a few a pass (`forward_batch`'s
    `prompt`): `hidden` is its rows' input to layer `next_layer`, and its cache holds
    their K and V (and a recurrent layer's state has folded them in) for the layers
    before it, at positions the cache does not count yet. The pass that takes it
    through the last layer commits them and sets `logits`. Each layer runs the chunk's
    rows exactly as a pass of the whole chunk would (the kernels are batch-exact), so
    how many layers a pass takes never changes a bit of the output."""

    tokens: np.ndarray
    cache: KVCache
    next_layer: int = 0
    hidden: np.ndarray | None = None  # [C, D] once embedded
    logits: np.ndarray | None = None  # [1, V]: the last row's, once through every layer
    # its last pass's seconds in its layers (its rows and the parts' together) and in the others
    # (the parts' rows alone): what the chunk's layers cost beside the decode rows (procs/slots.py Pace)
    inside_s: float = 0.0
    outside_s: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)

    @property
    def done(self) -> bool:
        return self.logits is not None


def _no_range() -> ValueError:
    return ValueError("a batch of sequences has no one position range: read it per sequence (blocks.per_sequence)")


@dataclass(frozen=True)
class _Segment:
    cache: KVCache
    start: int  # the sequence's first new position (its cache's n when the pass began)
    rows: slice  # its rows in the pass


class BatchCache(KVCache):
    """Several sequences' caches seen as one by a pass's layers: rows lo..hi-1 of the pass
    are sequence s's, at positions start_s..; `store` sends each sequence's rows to its own
    cache, and whatever reads a position range runs per sequence (`sequences`,
    blocks.per_sequence). It holds no rows of its own: a read of one range across
    sequences (`keys`, `values`, `stored`) has no meaning and is refused."""

    batched = True

    def __init__(self, caches: Sequence[KVCache], counts: Sequence[int]):  # no KVCache.__init__: no rows of its own
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a batched pass takes each sequence's cache once")
        self.segments: list[_Segment] = []
        at = 0
        for c, t in zip(caches, counts):
            if c.batched or t < 1:
                raise ValueError("a batched pass takes one or more rows of each sequence, each in its own cache")
            if c.n + t > c.n_ctx:
                raise ValueError(f"context full: {c.n} + {t} tokens > n_ctx {c.n_ctx}")
            self.segments.append(_Segment(c, c.n, slice(at, at + t)))
            at += t
        self.rows_alone = False
        self.state = None  # each sequence's recurrent state is its own cache's: the scans run per sequence

    @property
    def positions(self) -> np.ndarray:
        """Each row's position in its own sequence, int64 [T]."""
        return np.concatenate([np.arange(s.start, s.start + s.rows.stop - s.rows.start) for s in self.segments])

    def sequences(self, start: int) -> list[tuple[KVCache, int, slice]]:
        return [(s.cache, s.start, s.rows) for s in self.segments]  # `start` is a single sequence's: unused

    def store(self, layer: int, k: np.ndarray, v: np.ndarray, at: int | None = None) -> None:
        if at is not None:
            raise ValueError("a batched pass stores each sequence at its own next position: per_sequence for an explicit one")
        for s in self.segments:
            s.cache.store(layer, k[s.rows], v[s.rows])

    def keys(self, layer: int, lo: int, hi: int) -> np.ndarray:
        raise _no_range()

    def values(self, layer: int, lo: int, hi: int) -> np.ndarray:
        raise _no_range()

    def stored(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        raise _no_range()

    def advance(self, t: int) -> None:
        """Commit the pass: each sequence's cache counts its own rows (t is the pass's total)."""
        for s in self.segments:
            s.cache.advance(s.rows.stop - s.rows.start)


# ---- a greedy loop over several sequences ------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A greedy generation of `max_tokens` tokens after `prompt`, arriving before pass `arrive`."""

    prompt: Sequence[int]
    max_tokens: int
    arrive: int = 0


@dataclass
class Generated:
    """What `decode_together` gave one request: its tokens, and the logits [V] each was
    chosen from (the prompt's last row's, then one per decode step)."""

    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)  # the pass that produced each logits row


def decode_together(
    model, requests: Sequence[Request], n_ctx: int, chunk: int = 64, keep_logits: bool = False, layers: int | None = None
) -> list[Generated]:
    """Greedy decoding of every request in shared batched passes (`MoEModel.forward_batch`),
    the way a server with several slots runs them: each pass takes one row of every
    sequence that is decoding and, beside them, the next `chunk` prompt tokens of the
    earliest arrived request still reading its prompt (chunked prefill: a long prompt
    never stops the others) — with `layers`, that chunk through its next `layers` layers
    only, so it takes several passes (PromptSlice). A request joins at the first pass at or after `arrive` and
    leaves when it has `max_tokens` tokens; its cache is its own (`model.new_cache`).
    Each request's tokens and logits are what `model.prefill(prompt, batch=chunk)` then
    `decode_one` give it alone (tests/test_batch.py). `keep_logits`: keep each token's logits."""
    out = [Generated() for _ in requests]
    caches: dict[int, KVCache] = {}
    fed = [0] * len(requests)  # prompt tokens run so far (a chunk on its way through the layers included)
    done = [r.max_tokens <= 0 for r in requests]
    piece: PromptSlice | None = None  # with `layers`: the chunk on its way, and whose
    owner = -1
    step = 0
    while not all(done):
        parts: list[BatchPart] = []
        owners: list[int] = []
        waiting = [j for j, r in enumerate(requests) if r.arrive <= step and not done[j]]
        for j in waiting:  # every sequence that has read its prompt: one row, its last token
            if fed[j] == len(requests[j].prompt) and j != owner:
                parts.append(BatchPart([out[j].tokens[-1]], caches[j]))
                owners.append(j)
        reading = owner if piece is not None else next((j for j in waiting if fed[j] < len(requests[j].prompt)), None)
        if reading is not None and piece is None:
            if reading not in caches:
                caches[reading] = model.new_cache(n_ctx)
            tokens = requests[reading].prompt[fed[reading] : fed[reading] + chunk]
            fed[reading] += len(tokens)
            if layers is None:
                parts.append(BatchPart(tokens, caches[reading]))
                owners.append(reading)
            else:
                piece, owner = PromptSlice(np.asarray(tokens), caches[reading]), reading
        if parts or piece is not None:
            got = list(zip(owners, model.forward_batch(parts, prompt=piece, layers=layers)))
            if piece is not None and piece.done:
                assert piece.logits is not None
                got.append((owner, piece.logits))
                piece, owner = None, -1
            for j, logits in got:
                if fed[j] < len(requests[j].prompt):
                    continue  # a prompt's chunk before its last: no token yet
                row = logits[-1]
                g = out[j]
                g.tokens.append(int(np.argmax(row)))
                g.passes.append(step)
                if keep_logits:
                    g.logits.append(row)
                done[j] = len(g.tokens) >= requests[j].max_tokens
        step += 1
    return out
