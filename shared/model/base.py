"""What every architecture shares: embedding, the layer loop, the output head.

An architecture module subclasses `MoEModel`, resolves its per-layer weights
once in `load_layer`, and implements `layer()` for one decoder block. The
stage-named entry points are `prefill` (a prompt batch) and `decode_one`.
Legend: T tokens, D hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import ModelFile
from moe_pipe.shared.model.blocks import KVCache, rms_norm, softmax
from moe_pipe.shared.model.levers import Levers, apply_levers
from moe_pipe.shared.model.moe import Routing, top_k_ids
from moe_pipe.shared.model.stages import Stages
from moe_pipe.shared.model.weights import ExpertSource, FileExperts, Weights

if TYPE_CHECKING:
    from moe_pipe.shared.model.routes import RouteReplay

# Next-layer guesses below this router probability are not read. On the
# calibrated qwen30b-shape model (bench/out, 24 decode tokens) a guess's
# accuracy falls with its rank (top-1 78 %, 4th 55 %, 8th 22 %); p >= 0.05
# keeps ~2.9 guesses per layer at 69 % right.
PREFETCH_MIN_P = 0.05


@dataclass(frozen=True)
class ModelOptions:
    """How a model runs beyond its weights, fixed when it is built (`load_model`).
    The defaults are the exact, unobserved forward pass."""

    # Guess each next layer's experts while decoding and tell the source
    # (`ExpertSource.prefetch`); only the pipeline's source reads ahead.
    prefetch_next: bool = False
    # The lossy routing levers (shared/model/levers.py): off, i.e. exact, unless the config asks.
    levers: Levers = field(default_factory=Levers)
    # Called with (layer, routing) for every routing decision, e.g. a route-trace writer.
    route_observer: Callable[[int, Routing], None] | None = None
    # Route by a recorded trace instead of the router (benchmarks only: the tokens are not the model's).
    route_replay: RouteReplay | None = None
    # Time each stage of the forward pass into `MoEModel.stage` (benchmarks).
    stage_timing: bool = False


class MoEModel:
    arch: str = ""

    def __init__(
        self,
        mf: ModelFile,
        *,
        top_k: int | None = None,
        experts: ExpertSource | None = None,
        dense_view: Callable[[str], np.ndarray] | None = None,
        options: ModelOptions | None = None,
    ):
        self.mf, self.spec = mf, mf.spec
        self.w = Weights(mf, dense_view)
        self.source: ExpertSource = experts or FileExperts(mf)
        if top_k is not None and not 1 <= top_k <= self.spec.n_expert:
            raise UserError(f"--top-k {top_k} is out of range: this model has {self.spec.n_expert} experts")
        self.top_k = top_k or self.spec.n_expert_used
        options = options or ModelOptions()
        self.stage = Stages(options.stage_timing)
        self.prefetch_next = options.prefetch_next
        self.levers = options.levers
        self.route_observer = options.route_observer
        self.route_replay = options.route_replay
        self.embd = self.w.matrix("token_embd.weight")
        self.output_norm = self.w.vector("output_norm.weight")
        self.output = self.w.matrix("output.weight") if self.w.has("output.weight") else self.embd
        self.layers = [self.load_layer(i) for i in range(self.spec.n_layer)]

    # -- per architecture ----------------------------------------------------
    def load_layer(self, i: int) -> dict:
        raise NotImplementedError

    def layer(self, i: int, x: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.embd.rows(tokens)  # [T, D]

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.output(rms_norm(x, self.output_norm, self.spec.rms_eps))  # [T, V]

    def routed(self, i: int, routing: Routing, scores: np.ndarray) -> Routing:
        """Every architecture's routing passes here: the lossy levers (off by
        default) may change it, then an observer may record it."""
        if self.route_replay is not None:
            routing = self.route_replay.route(i, routing.ids.shape[0])
        if self.levers.active:
            routing = apply_levers(self.levers, routing, scores, lambda ids: self.source.resident(i, ids))
        if self.route_observer is not None:
            self.route_observer(i, routing)
        return routing

    def hint_next_layer(self, i: int, router_input: np.ndarray) -> None:
        """Speculative prefetch while decoding: guess layer i+1's experts by
        running its router on this layer's router input, and tell the source
        so it can start reading them. Only confident guesses: of the top k,
        those the router gives at least PREFETCH_MIN_P (a wrong guess costs a
        read and evicts a cached expert). Under a route replay (benchmarks)
        the guess is the trace's own next routing: a perfect predictor, for
        the ceiling of what prefetch can give. A guess only warms the cache:
        outputs never depend on it."""
        if not self.prefetch_next or i + 1 >= self.spec.n_layer or router_input.shape[0] != 1:
            return
        if self.route_replay is not None:  # routing comes from a trace: the guess is exact
            self.source.prefetch(i + 1, self.route_replay.peek(i + 1).ids[0].tolist())
            return
        nxt = self.layers[i + 1]
        logits = nxt["router"](router_input)  # [1, E]
        if "router_b" in nxt:
            logits = logits + nxt["router_b"]
        ids = top_k_ids(logits, self.top_k)[0]
        p = softmax(logits[0].astype(np.float64))
        self.source.prefetch(i + 1, [int(e) for e in ids if p[e] >= PREFETCH_MIN_P])

    # -- shared ----------------------------------------------------------------
    def new_cache(self, n_ctx: int) -> KVCache:
        s = self.spec
        return KVCache(n_ctx, s.n_head_kv, s.head_dim_k, s.head_dim_v)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run tokens at the cache's next positions; logits [T, V] or [1, V] (last)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.spec.n_vocab:
            raise UserError(f"token id out of range 0..{self.spec.n_vocab - 1}")
        start = cache.n
        positions = np.arange(start, start + tokens.size)
        with self.stage("embed"):
            x = self.embed(tokens)
        for i in range(self.spec.n_layer):
            x = self.layer(i, x, cache, start, positions)
        cache.advance(tokens.size)
        with self.stage("head"):
            return self.logits(x if all_logits else x[-1:])

    def prefill(self, tokens, cache: KVCache, batch: int = 64) -> np.ndarray:
        """Prompt in batches of `batch` tokens; returns the last position's logits [V]."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        logits = self.forward(tokens[:batch], cache)  # an empty prompt is forward's ValueError
        for s in range(batch, tokens.size, batch):
            logits = self.forward(tokens[s : s + batch], cache)
        return logits[-1]

    def decode_one(self, token: int, cache: KVCache) -> np.ndarray:
        return self.forward(np.array([token]), cache)[-1]
