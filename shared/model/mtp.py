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
from .weights import FileExperts, Weights


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
