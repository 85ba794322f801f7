"""The file's NextN/MTP block run as a drafter: one decoder layer that reads the next
token beside the model's hidden state and guesses the token after it
(shared/gguf/nextn.py says what the block holds; docs/speculative.md § MTP drafts).

A step at position j takes the pair (h_j, t_{j+1}), where h_j is the model's final
hidden state at j (after its output norm: `MoEModel.final_hidden`) and t_{j+1} the
token that followed:

    x = eh_proj · [enorm(embed(t_{j+1})); hnorm(h_j)]
    x = the block's decoder layer at position j (its own KV cache: one attention layer)
    logits = head(shared_head_norm(x))      → a guess at t_{j+2}

and a further draft feeds x (after the norm on Qwen3.5/3.6 and Ling,
`nextn_feeds_normed`) back as the hidden state beside that guess, one position on;
DeepSeek's, GLM's and Ling's blocks take a zero embedding at position 0
(`nextn_masks_first`), as vLLM runs them. The block's layer is
the family's own layer code: `_block_model` is the model seen with the block as one
more layer (shared/gguf/nextn.py `nextn_spec`), its weights read through the file
mapping (the block is in neither the dense set nor the expert cache, and never
streamed), its experts too (FileExperts over the block's own).

    head = NextN(model)                 the block, loaded (a UserError when the file has none)
    cache = head.new_cache(n_ctx)       its KV cache: one layer
    out = head.step(tokens, hidden, cache)   rows at the cache's next positions → NextNStep
    guess = head.greedy(out)            the head's argmax over the whole vocabulary

    subset = SubsetHead(head.head, n)   the head over the n lowest ids and the ids added to it
    subset.add(ids); subset.greedy(out) its argmax over that part of the vocabulary
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ..gguf.layout import nextn_layer_experts
from ..gguf.nextn import nextn_spec, require_nextn
from .base import MoEModel
from .blocks import KVCache, rms_norm
from .levers import Levers
from .stages import Stages
from .weights import FileExperts, QWeight, Weights


@dataclass(frozen=True)
class NextNStep:
    feed: np.ndarray  # [T, D]: what each row hands the next draft step as its hidden state
    normed_last: np.ndarray  # [1, D]: the last row after the shared-head norm, for the head


def _block_model(model: MoEModel) -> MoEModel:
    """`model` seen with its first NextN block as one more layer, number n_layer: a shallow
    copy sharing every decoder weight, whose spec, weights, experts and layers list are its
    own, and which observes, traces and prefetches nothing (a drafter's pass is none of the
    decoder's)."""
    j, mf = model.spec.n_layer, model.mf
    twin = copy.copy(model)
    twin.spec = nextn_spec(model.spec)
    twin.w = Weights(mf)  # the file mapping: the block is not in the dense set
    twin.source = FileExperts(mf, nextn_layer_experts(mf.gguf, model.spec)[:1])
    twin.stage = Stages(False)
    twin.prefetch_next = twin.prefetch_prompt = False
    twin.levers = Levers()
    twin.route_observer = twin.router_input_observer = twin.route_replay = twin.layer_observer = None
    twin.hidden_sink = None
    twin.layers = [*model.layers, twin.load_layer(j)]
    return twin


class NextN:
    """The first NextN/MTP block of `model`'s file, ready to run (see the module's text)."""

    def __init__(self, model: MoEModel):
        require_nextn(model.spec)
        self.model, self.j = model, model.spec.n_layer
        self.block = _block_model(model)
        w, p = self.block.w, f"blk.{self.j}.nextn."
        self.eh_proj = w.matrix(p + "eh_proj.weight")
        self.enorm, self.hnorm = w.vector(p + "enorm.weight"), w.vector(p + "hnorm.weight")
        # bailingmoe3 names its shared-head norm layer_output_norm (shared/gguf/nextn.py)
        norm = p + "shared_head_norm.weight" if w.has(p + "shared_head_norm.weight") else f"blk.{self.j}.layer_output_norm.weight"
        self.head_norm = w.vector(norm)
        # GLM-4.5's block may carry its own embedding and head; otherwise the model's are used, as llama.cpp does
        self.embd = w.matrix(p + "embed_tokens.weight") if w.has(p + "embed_tokens.weight") else None
        self.head = w.matrix(p + "shared_head_head.weight") if w.has(p + "shared_head_head.weight") else model.output

    def new_cache(self, n_ctx: int) -> KVCache:
        """The block's KV cache: its one layer's rows (the decoder's layers take no memory here)."""
        s = self.block.spec
        heads = (0,) * self.j + (s.n_head_kv[self.j],)
        return KVCache(n_ctx, heads, s.head_dim_k, s.head_dim_v, self.model.kv_type)

    def step(self, tokens: np.ndarray, hidden: np.ndarray, cache: KVCache) -> NextNStep:
        """Rows (h_j, t_{j+1}) at the cache's next positions: `tokens` [T] the next tokens,
        `hidden` [T, D] the hidden states beside them; their K and V go into `cache`."""
        eps, start = self.model.spec.rms_eps, cache.n
        e = self.embd.rows(tokens) if self.embd is not None else self.model.embed(tokens)
        if start == 0 and self.model.nextn_masks_first:
            e = e.copy()
            e[0] = 0.0
        x = self.eh_proj(np.concatenate([rms_norm(e, self.enorm, eps), rms_norm(hidden, self.hnorm, eps)], axis=1))
        x = self.block.layer(self.j, x, cache, start, np.arange(start, start + x.shape[0]))
        cache.advance(x.shape[0])
        if self.model.nextn_feeds_normed:
            normed = rms_norm(x, self.head_norm, eps)
            return NextNStep(normed, normed[-1:])
        return NextNStep(x, rms_norm(x[-1:], self.head_norm, eps))

    def logits(self, step: NextNStep) -> np.ndarray:
        """The head on a step's last row: [V]."""
        return self.head(step.normed_last)[0]

    def greedy(self, step: NextNStep) -> int:
        """The guess at a step's next token over the whole vocabulary."""
        return int(np.argmax(self.logits(step)))


class SubsetHead:
    """The output head over part of the vocabulary: the `n_low` lowest token ids and the
    ids `add`ed since the last `clear` (docs/speculative.md § The head over part of the
    vocabulary). Its argmax is the whole head's argmax with every other id left out, ties
    going to the lowest id as np.argmax's do; each row's logit is the whole head's, bit for
    bit (the kernels compute a row alone), at the cost of reading only the subset's rows.

    The low ids' rows are the head's first rows, contiguous already: a view, no copy. An
    added id's row is copied as bytes (same type, so the same kernels apply) into a
    second matrix that grows as ids arrive, at most SEEN_MOST rows: past that an id is
    simply not added (a guess lost, the output unchanged)."""

    SEEN_MOST = 8192  # added rows at most: ~14 MB of Qwen3.5's Q6_K head (2,048 columns)

    def __init__(self, head: QWeight, n_low: int):
        n_vocab, n_cols = head.shape
        if not 0 < n_low < n_vocab:
            raise ValueError(f"a subset head takes 1 to {n_vocab - 1} low ids, not {n_low}")
        self.head, self.n_low = head, n_low
        self.low = QWeight(head.qtype, head.data[:n_low], (n_low, n_cols))
        self.member = np.zeros(n_vocab, bool)  # which ids the subset holds
        self.clear()

    def clear(self) -> None:
        """Back to the low ids alone (the added rows' memory freed)."""
        self.member[:] = False
        self.member[: self.n_low] = True
        self.added = np.empty(0, np.int64)  # the added ids, in the order of their rows
        self._rows = self.head.data[:0].copy()  # their rows, with room to grow
        self.seen: QWeight | None = None  # the added rows as a matrix

    def add(self, ids) -> None:
        """Put `ids` in the subset (ids it holds already, or out of the vocabulary, are skipped)."""
        ids = np.unique(np.asarray(ids, np.int64))
        ids = ids[(ids >= 0) & (ids < self.member.size)]
        new = ids[~self.member[ids]][: self.SEEN_MOST - self.added.size]
        if not new.size:
            return
        k, n = self.added.size, self.added.size + new.size
        if n > self._rows.shape[0]:  # room doubles: an add copies the new rows, not the old ones, mostly
            grown = np.empty((max(n, 2 * self._rows.shape[0], 256), *self._rows.shape[1:]), self._rows.dtype)
            grown[:k] = self._rows[:k]
            self._rows = grown
        self._rows[k:n] = self.head.data[new]
        self.member[new] = True
        self.added = np.concatenate([self.added, new])
        self.seen = QWeight(self.head.qtype, self._rows[:n], (n, self.head.shape[1]))

    def ids(self) -> np.ndarray:
        """The subset's token ids, ascending."""
        return np.flatnonzero(self.member)

    def greedy(self, step: NextNStep) -> int:
        """The guess at a step's next token over the subset."""
        low = self.low(step.normed_last)[0]
        best = int(np.argmax(low))
        if self.seen is not None:
            seen = self.seen(step.normed_last)[0]
            top = seen.max()
            if top > low[best]:  # every added id is above the low ones: a tie stays with the low id
                best = int(self.added[seen == top].min())
        return best
