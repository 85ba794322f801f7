"""What every family's forward pass shares: embedding, the layer loop, the output head.

A family's model part (shared/families/<family>/model.py; load.ModelPart)
exports `Model`, a subclass of `MoEModel` that names its `arch`, resolves its
per-layer weights once in `load_layer`, and implements `layer()` for one
decoder block. Where a family differs from the plain pass it overrides a hook
whose default is that plain pass: `output_norm_name`, `embed`, `logits`,
`router_input`, `router_logits`, `guess_layer`, `new_cache`. The stage-named
entry points are `prefill` (a prompt batch) and `decode_one`; `forward_batch`
runs the rows of several sequences in one pass (shared/model/batch.py).
Legend: T tokens, D hidden, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import UserError
from ..gguf.model_file import ModelFile
from ..gguf.spec import check_kv_type
from .batch import BatchCache, BatchPart, PromptSlice
from .blocks import KVCache, rms_norm, softmax
from .levers import Levers, apply_levers
from .moe import Routing, softmax_then_top_k, top_k_ids
from .stages import Stages
from .weights import ExpertSource, FileExperts, Weights

if TYPE_CHECKING:
    from .routes import RouteReplay

# Next-layer guesses below this router probability are not read: a guess's
# accuracy falls with its rank (top-1 78 %, 4th 55 %, 8th 22 % on a
# qwen30b-shape model whose residual stream is not shaped for cross-layer
# predictability, 24 decode tokens), and p >= 0.05 keeps ~2.9 guesses a layer
# at 69 % right. On the shaped model the next layer's router finds 88 % of the
# next layer's experts (bench/bench_routing.py --cross-layer; docs/warmup-analysis.md).
PREFETCH_MIN_P = 0.05
# A prompt's batch guesses the next layer from at most this many of its rows, evenly spaced:
# the union of their confident choices is the batch's (a 3,600-token prompt routes to
# nearly every expert of a layer), and the next layer's router on every row of a long
# prompt cost as much as the layer's own routing (~3 % of a prompt's compute, 2026-12-03).
GUESS_ROWS = 256


def guess_rows(router_input: np.ndarray) -> np.ndarray:
    """The rows [T', D] of a pass's router input that a next-layer guess runs on: all of a
    decode step's, GUESS_ROWS evenly spaced ones of a long prompt's batch."""
    t = router_input.shape[0]
    return router_input if t <= GUESS_ROWS else router_input[:: -(-t // GUESS_ROWS)]


@dataclass(frozen=True)
class ModelOptions:
    """How a model runs beyond its weights, fixed when it is built (`load_model`).
    The defaults are the exact, unobserved forward pass."""

    # Guess each next layer's experts while decoding and tell the source
    # (`ExpertSource.prefetch`); only the pipeline's source reads ahead.
    prefetch_next: bool = False
    # The same for a prompt's batch: the union of its tokens' confident guesses for
    # the next layer, read while this layer computes (the prompt's pass is compute-bound).
    prefetch_prompt: bool = False
    # The lossy routing levers (shared/model/levers.py): off, i.e. exact, unless the config asks.
    levers: Levers = field(default_factory=Levers)
    # Called with (layer, routing) for every routing decision, e.g. a route-trace writer.
    route_observer: Callable[[int, Routing], None] | None = None
    # Called with (layer, router input [T, D]) as each layer routes: the hidden state its
    # router saw (bench/bench_routing.py --cross-layer applies later layers' routers to it).
    router_input_observer: Callable[[int, np.ndarray], None] | None = None
    # Route by a recorded trace instead of the router (benchmarks only: the tokens are not the model's).
    route_replay: RouteReplay | None = None
    # Time each stage of the forward pass into `MoEModel.stage` (benchmarks, and the engine's telemetry).
    stage_timing: bool = False
    # Called with (layer, tokens) after each layer of a pass: how far a prompt's pass has come, and
    # where a Stop may end it (by raising: the cache counts a pass only once every layer stored it).
    layer_observer: Callable[[int, int], None] | None = None
    # How `new_cache` stores K and V: f32 (exact), f16 or q8_0 (shared/model/blocks.py KVCache);
    # the engine passes the config's compute.kv_type (default f16).
    kv_type: str = "f32"


class MoEModel:
    arch: str = ""  # the GGUF general.architecture it runs (saved sessions record it)
    output_norm_name = "output_norm.weight"  # the final norm's tensor (lfm2moe: token_embd_norm.weight)
    # What the NextN/MTP block hands its next draft step (shared/model/mtp.py): its output after
    # its shared-head norm (Qwen3.5/3.6 and Ling, whose MTP modules end in that norm), else
    # before it (DeepSeek's and GLM's layout, the norm taken only for the head).
    nextn_feeds_normed = False
    # Whether the block zeroes the token embedding of its position-0 pair (DeepSeek's, GLM's
    # and Ling's MTP modules do; Qwen3.5/3.6's does not).
    nextn_masks_first = True

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
        if top_k is not None and top_k > self.spec.n_expert:  # its range on its own is the config schema's
            raise UserError(f"--top-k {top_k} is out of range: this model has {self.spec.n_expert} experts")
        self.top_k = top_k or self.spec.n_expert_used
        options = options or ModelOptions()
        self.stage = Stages(options.stage_timing)
        self.prefetch_next = options.prefetch_next
        self.prefetch_prompt = options.prefetch_prompt
        self.levers = options.levers
        self.route_observer = options.route_observer
        self.router_input_observer = options.router_input_observer
        self.route_replay = options.route_replay
        self.layer_observer = options.layer_observer
        check_kv_type(options.kv_type, self.spec.head_dim_k + self.spec.head_dim_v)  # before the layers load
        self.kv_type = options.kv_type
        self.embd = self.w.matrix("token_embd.weight")
        self.output_norm = self.w.vector(self.output_norm_name)
        self.output = self.w.matrix("output.weight") if self.w.has("output.weight") else self.embd
        self.layers = [self.load_layer(i) for i in range(self.spec.n_layer)]
        self._decoding = False  # the pass running is a decode step's (one token, or a verify pass's few)
        # Route-ahead's routings of the layers ahead of the one running (`route_ahead`), each
        # taken by its layer's `routed` in the same pass.
        self._ahead: dict[int, Routing] = {}
        # Told (first position, tokens, final hidden rows [T, D], how many leading rows are
        # certain, not drafts) after each single-sequence pass: the MTP drafter's input
        # (shared/text/speculate.py MtpDrafter); None, the default, computes nothing more.
        self.hidden_sink: Callable[[int, np.ndarray, np.ndarray, int], None] | None = None

    # -- per family ----------------------------------------------------------
    def load_layer(self, i: int) -> dict:
        raise NotImplementedError

    def layer(self, i: int, x: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.embd.rows(tokens)  # [T, D]

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.output(self.final_hidden(x))  # [T, V]

    def final_hidden(self, x: np.ndarray) -> np.ndarray:
        """The last layer's output after the final norm [T, D]: what the output head
        multiplies, and what a NextN/MTP block takes as the hidden state beside the next token."""
        return rms_norm(x, self.output_norm, self.spec.rms_eps)

    def row_tokens(self, tokens: np.ndarray) -> None:
        """The token ids of the rows the next layers run, when they are not the ones last
        embedded (a pass with a prompt's chunk in some of its layers: `_with_slice`). A family
        that routes by token id keeps them (deepseek4's hash layers); the rest need nothing."""

    def route(self, i: int, scores: np.ndarray) -> Routing:
        """Layer i's routing from its router's scores [T, E] (the logits, bias included): the
        top k of a softmax, renormalized (qwen3moe, qwen35moe, mixtral); the other families
        override it with their own rule."""
        return softmax_then_top_k(scores, self.top_k)

    def routed(self, i: int, scores: np.ndarray) -> Routing:
        """Every architecture's routing passes here, from its router's scores [T, E]: the
        family's rule (`route`), or the routing route-ahead made a layer early when that lever
        is on; then the lossy levers (off by default) may change it, then an observer may
        record it."""
        ahead = self._ahead.pop(i, None)
        if ahead is not None and self._decoding and ahead.ids.shape[0] == scores.shape[0]:
            routing = ahead
        else:
            routing = self.route(i, scores)
        if self.route_replay is not None:
            routing = self.route_replay.route(i, routing.ids.shape[0])
        if self.levers.active:
            routing = apply_levers(self.levers, routing, scores, lambda ids: self.source.resident(i, ids))
        if self.route_observer is not None:
            self.route_observer(i, routing)
        return routing

    def router_input(self, i: int, h: np.ndarray) -> np.ndarray:
        """What layer i's router reads from the residual stream h [T, D]: its
        pre-FFN RMS norm (qwen3moe, gpt-oss; gemma4 overrides). The layers
        compute it inline; this is for guessing ahead of them."""
        return rms_norm(h, self.layers[i]["ffn_norm"], self.spec.rms_eps)

    def router_logits(self, i: int, router_input: np.ndarray) -> np.ndarray:
        """Layer i's router logits [T, E] (bias included) on any router input."""
        L = self.layers[i]
        logits = L["router"](router_input)
        return logits + L["router_b"] if "router_b" in L else logits

    def hint_next_layer(self, i: int, router_input: np.ndarray) -> None:
        """Every layer calls this with its router input as it routes: an
        observer may see it, and with prefetch on, layer i+1's experts are
        guessed by running its router on it (`guess_layer`): for a prompt's
        batch with `prefetch_prompt`, for a decoded token with `prefetch_next`."""
        if self.router_input_observer is not None:
            self.router_input_observer(i, router_input)
        if self.levers.route_ahead and self._decoding and self.route_replay is None and self.routes_by_scores(i + 1):
            self.route_ahead(i + 1, router_input)
            return
        wanted = self.prefetch_next if self._decoding else self.prefetch_prompt
        if wanted and i + 1 < self.spec.n_layer:
            self.guess_layer(i + 1, router_input)

    def routes_by_scores(self, j: int) -> bool:
        """Whether layer j exists and chooses its experts by its router's scores: not a
        leading dense layer (deepseek4 adds its hash-routed layers)."""
        return j < self.spec.n_layer and self.spec.has_experts(j)

    def route_ahead(self, j: int, router_input: np.ndarray) -> None:
        """The route-ahead lever (LOSSY, decode only): layer j routes on its router applied
        to the previous layer's router input [T, D], computed here, a layer early, so its
        reads are exactly known and start while this layer computes. The source is told
        every chosen expert, each row's in rank order."""
        routing = self._ahead[j] = self.route(j, self.router_logits(j, router_input))
        self.source.prefetch(j, list(dict.fromkeys(int(e) for e in routing.ids.T.reshape(-1))))

    def guess_layer(self, j: int, router_input: np.ndarray) -> None:
        """Speculative prefetch: guess layer j's experts with its router on an
        earlier hidden state [T, D] and tell the source so it can start
        reading them. Only confident guesses: of each row's top k, those the
        router gives at least PREFETCH_MIN_P (a wrong guess costs a read and
        evicts a cached expert); for a prompt's batch, the union over its
        rows (GUESS_ROWS of them at most), the most probable first. Under a route replay (benchmarks) the
        guess is the trace's own next routing: a perfect predictor, for the
        ceiling of what prefetch can give. A guess only warms the cache:
        outputs never depend on it."""
        t = router_input.shape[0]
        if self.route_replay is not None:  # routing comes from a trace: the guess is exact
            ids = self.route_replay.peek(j, t).ids
            self.source.prefetch(j, list(dict.fromkeys(int(e) for e in ids.T.reshape(-1))))
            return
        logits = self.router_logits(j, guess_rows(router_input)).astype(np.float64)  # [T, E]
        top = top_k_ids(logits, self.top_k)  # [T, k]
        p = np.take_along_axis(softmax(logits), top, axis=1)  # each row's top k probabilities
        confident = p >= PREFETCH_MIN_P
        ids, probs = top[confident], p[confident]  # row by row, each row's choices in rank order
        if ids.size == 0:
            self.source.prefetch(j, [])
            return
        best = np.zeros(logits.shape[1])
        np.maximum.at(best, ids, probs)
        guessed, first = np.unique(ids, return_index=True)  # each expert where it first comes
        order = np.lexsort((first, -best[guessed]))  # most probable first; ties as they came
        self.source.prefetch(j, guessed[order].tolist())

    # -- shared ----------------------------------------------------------------
    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> KVCache:
        """An empty KV cache for `n_ctx` positions, stored as `kv_type` (default: the model's options):
        a sliding-window layer's a ring of its window, every other layer's the whole context
        (what the budget counts: shared/gguf/spec.py kv_cache_bytes)."""
        return KVCache.for_spec(self.spec, n_ctx, kv_type or self.kv_type)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False, decoding: bool = False, certain: int | None = None) -> np.ndarray:
        """Run tokens at the cache's next positions; logits [T, V] or [1, V] (last).
        `decoding`: the rows are a decode step's (a verify pass: a token and its drafts),
        prefetched as a decoded token is (`prefetch_next`), not as a prompt's batch.
        `certain`: how many leading rows are the conversation's own tokens, not drafts
        (all by default), for `hidden_sink`."""
        tokens = self._checked(tokens)
        start = cache.n
        x = self._layers(tokens, cache, start, np.arange(start, start + tokens.size), decoding or tokens.size == 1)
        cache.advance(tokens.size)
        if self.hidden_sink is not None:
            self.hidden_sink(start, tokens, self.final_hidden(x), tokens.size if certain is None else certain)
        with self.stage("head"):
            return self.logits(x if all_logits else x[-1:])

    def forward_batch(
        self, parts: Sequence[BatchPart], decoding: bool = False, prompt: PromptSlice | None = None, layers: int | None = None
    ) -> list[np.ndarray]:
        """One pass over the rows of several sequences, each part's tokens at its own cache's
        next positions (shared/model/batch.py): a decode step of many, a prompt's chunk
        beside them. Per part, the logits `forward` gives it alone, bit for bit: [1, V] (its
        last row) or [T_s, V] (`all_logits`). The pass counts as a decode step's (prefetch)
        when every part is one token, or when `decoding` says so.
        `prompt`: a chunk that goes through its next `layers` layers in this pass (all that
        are left when None) beside the parts' rows, which go through every layer; once it is
        through the last its cache commits it and its `logits` are set (PromptSlice)."""
        if not parts and prompt is None:
            raise ValueError("forward_batch needs at least one sequence")
        tokens = [self._checked(p.tokens) for p in parts]
        if prompt is not None:
            return self._with_slice(parts, tokens, prompt, layers, decoding)
        batch = BatchCache([p.cache for p in parts], [t.size for t in tokens])
        rows = np.concatenate(tokens)
        x = self._layers(rows, batch, 0, batch.positions, decoding or all(t.size == 1 for t in tokens))
        batch.advance(rows.size)
        return self._heads(parts, batch, x)

    def _heads(self, parts: Sequence[BatchPart], batch: BatchCache, x: np.ndarray, extra: np.ndarray | None = None) -> list[np.ndarray]:
        """Each part's logits rows (its last, or all), and `extra`'s [1, D] last, in one head call."""
        wanted = [np.arange(s.rows.start, s.rows.stop) if p.all_logits else [s.rows.stop - 1] for p, s in zip(parts, batch.segments)]
        at = np.cumsum([0] + [len(w) for w in wanted] + ([1] if extra is not None else []))
        rows = [x[np.concatenate(wanted)]] if wanted else []
        with self.stage("head"):
            logits = self.logits(np.concatenate(rows + ([extra] if extra is not None else [])))  # one head call for every sequence
        return [logits[a:b] for a, b in zip(at[:-1], at[1:])]

    def _with_slice(
        self, parts: Sequence[BatchPart], tokens: list[np.ndarray], prompt: PromptSlice, layers: int | None, decoding: bool
    ) -> list[np.ndarray]:
        """forward_batch with a prompt's chunk in layers [lo, hi) beside the parts' rows: those
        layers run both sequences' rows in one batch, the others the parts' rows alone."""
        n_layer = self.spec.n_layer
        lo = prompt.next_layer
        if prompt.done or not 0 <= lo < n_layer:
            raise ValueError(f"the prompt's chunk is past layer {lo} of {n_layer}: nothing left to run")
        hi = n_layer if layers is None else min(n_layer, lo + max(int(layers), 1))
        chunk = self._checked(prompt.tokens)
        caches, counts = [p.cache for p in parts], [t.size for t in tokens]
        both = BatchCache([*caches, prompt.cache], [*counts, chunk.size])  # checks the chunk fits its context
        alone = BatchCache(caches, counts) if parts else None
        rows = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
        d = rows.size
        rows_decoding = decoding or all(t.size == 1 for t in tokens)
        self._ahead.clear()  # as _layers
        with self.stage("embed"):
            if lo == 0:
                prompt.hidden = self.embed(chunk)
            x = self.embed(rows) if d else None  # last: what a family keeps of the tokens embedded is the rows' (row_tokens)
        if self.prefetch_next and x is not None and rows_decoding:
            first = self.spec.n_dense_lead  # as _layers: its reads start while the layers before it run
            self._decoding = True
            self.guess_layer(first, self.router_input(first, x))
        both_positions, alone_positions = both.positions, alone.positions if alone is not None else None
        told = None
        prompt.inside_s = prompt.outside_s = 0.0
        for i in range(n_layer):
            sliced = lo <= i < hi
            if not sliced and x is None:
                continue
            t0 = time.perf_counter()
            if told is not sliced:
                self.row_tokens(np.concatenate([rows, chunk]) if sliced else rows)
                told = sliced
            if sliced:
                assert prompt.hidden is not None
                xi = prompt.hidden if x is None else np.concatenate([x, prompt.hidden])
                self._decoding = False  # a prompt's rows are in it: the next layer is guessed as a prompt's
                y = self.layer(i, xi, both, 0, both_positions)
                x, prompt.hidden = (y[:d], y[d:]) if d else (None, y)
            else:
                assert x is not None and alone is not None and alone_positions is not None
                self._decoding = rows_decoding
                x = self.layer(i, x, alone, 0, alone_positions)
            took = time.perf_counter() - t0
            if sliced:
                prompt.inside_s += took
            else:
                prompt.outside_s += took
            if self.layer_observer is not None:
                self.layer_observer(i, d + (chunk.size if sliced else 0))
        prompt.next_layer = hi
        if alone is not None:
            alone.advance(d)
        last = None
        if hi == n_layer:
            assert prompt.hidden is not None
            prompt.cache.advance(chunk.size)
            last, prompt.hidden = prompt.hidden[-1:], None
        if alone is None:
            if last is not None:
                with self.stage("head"):
                    prompt.logits = self.logits(last)
            return []
        assert x is not None
        out = self._heads(parts, alone, x, last)
        if last is not None:
            prompt.logits = out.pop()
        return out

    def _checked(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.spec.n_vocab:
            raise UserError(f"token id out of range 0..{self.spec.n_vocab - 1}")
        return tokens

    def _layers(self, tokens: np.ndarray, cache: KVCache, start: int, positions: np.ndarray, decoding: bool) -> np.ndarray:
        """Embed the tokens and run every layer on them at `positions`: the pass's last hidden state."""
        with self.stage("embed"):
            x = self.embed(tokens)
        self._decoding = decoding
        self._ahead.clear()  # scores a failed pass took ahead are not this pass's
        if self.prefetch_next and self._decoding:
            # The first MoE layer has no earlier router input to guess from: its router
            # on the token's embedding, so its reads start while the layers before it run.
            first = self.spec.n_dense_lead
            self.guess_layer(first, self.router_input(first, x))
        for i in range(self.spec.n_layer):
            x = self.layer(i, x, cache, start, positions)
            if self.layer_observer is not None:
                self.layer_observer(i, tokens.size)
        return x

    def prefill(self, tokens, cache: KVCache, batch: int = 64) -> np.ndarray:
        """Prompt in batches of `batch` tokens; returns the last position's logits [V]."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        logits = self.forward(tokens[:batch], cache)  # an empty prompt is forward's ValueError
        for s in range(batch, tokens.size, batch):
            logits = self.forward(tokens[s : s + batch], cache)
        return logits[-1]

    def decode_one(self, token: int, cache: KVCache) -> np.ndarray:
        return self.forward(np.array([token]), cache)[-1]

    def drafts_judged(self, drafted: int, kept: int) -> None:
        """Told when a verify pass's drafts are settled: `kept` of its `drafted` were
        kept. Nothing to do here; a metered model's telemetry records it."""

    def verify(self, tokens, cache: KVCache, redo: int = 0) -> np.ndarray:
        """A decoded token and its drafts in one pass: every position's logits [T, V]. The
        kernels are batch-exact, so row j is what `decode_one` gives at that position after
        the rows before it (shared/text/speculate.py relies on it). `redo`: how many leading
        rows are accepted tokens a rollback runs again (a hybrid model's; telemetry counts them apart)."""
        return self.forward(tokens, cache, all_logits=True, decoding=True, certain=redo + 1)
