"""One generation: prefill the prompt, then decode token by token until an
end-of-generation token, a stop string, the token limit or the context end.

Text streams out through `on_text` as tokens are produced; text that might be
the start of a stop string is held back until it is known not to be.

Given a `Session` (shared/model/session.py), the generation starts from what
its KV cache already holds: only the prompt past the common prefix is
computed (`cache_prompt`), and the cache is left holding prompt + output for
the next request. When the cache fills, `context_shift` drops the oldest
tokens past `n_keep` and goes on; without it the generation ends with
finish_reason "context" (docs/conversations.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..config import MAX_DRAFT
from ..errors import UserError
from ..model.kv_pool import KVPoolFull
from ..model.session import Session
from ..speed import steady_start
from .context import check_prompt_fits
from .sampling import Constraint, Sampler, SamplingParams
from .speculate import Drafter, Speculation


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    n_ctx: int = 4096
    prefill_batch: int = 64
    ignore_eos: bool = False  # keep going past end-of-generation tokens (benchmarks, soak tests)
    cache_prompt: bool = True  # reuse the session's common prefix (no effect without a session)
    context_shift: bool = False  # a full cache drops its oldest tokens past n_keep instead of ending the generation
    n_keep: int = 0  # tokens at the start kept by a shift (after a BOS, which is always kept); -1 = the whole prompt
    draft: int = 0  # speculative decoding: drafts per verify pass at most (0 = off; shared/text/speculate.py)
    draft_adapt: bool = True  # each pass's width from the measured acceptance and pass cost (speculate.WidthChooser)

    def __post_init__(self):
        if self.max_tokens < 0:
            raise UserError(f"max tokens must be ≥ 0, not {self.max_tokens}")
        if self.n_ctx < 1:
            raise UserError(f"context size must be ≥ 1, not {self.n_ctx}")
        if self.prefill_batch < 1:
            raise UserError(f"prefill batch must be ≥ 1, not {self.prefill_batch}")
        if not 0 <= self.draft <= MAX_DRAFT:
            raise UserError(f"draft must be 0..{MAX_DRAFT} tokens per pass, not {self.draft}")
        if self.n_keep < -1:
            raise UserError(f"n_keep must be ≥ -1 (-1 = the whole prompt), not {self.n_keep}")


def reuse_align(session: Session, prefill_batch: int) -> int:
    """What a kept prefix is a multiple of. f32/f16 caches compute every position alike in any
    batch (attention row by row, int8 GEMM rows equal matvec), so any prefix can be kept; a q8_0
    cache's batched attention rounds otherwise: whole prefill batches only."""
    return prefill_batch if session.cache is not None and session.cache.kv_type == "q8_0" else 1


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # eog | stop | length | context
    timings: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "timings": self.timings,
        }


class _StopScanner:
    """Finds stop strings in the growing text and says how much is safe to emit."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str, since: int) -> int:
        """Index where the earliest stop string starts, or -1."""
        start = max(0, since - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1

    def safe_end(self, text: str) -> int:
        return len(text) - self.hold if self.stops else len(text)


def _n_keep(cfg: GenerationConfig, prompt: list[int], tokenizer) -> int:
    """llama.cpp server's n_keep: -1 keeps the whole prompt; otherwise that
    many tokens, plus the BOS when the prompt starts with one."""
    if cfg.n_keep < 0:
        return len(prompt)
    bos = getattr(tokenizer, "bos_id", None)
    return cfg.n_keep + (1 if bos is not None and prompt[0] == bos else 0)


def steady_tok_s(stamps: Sequence[float]) -> float:
    """Tokens a second over the last quarter of a reply's tokens (shared/speed.py
    `steady_start`: the steady of every speed figure), from when each was sampled
    (stamps[0] is the prompt's start, so the first token's wall is the prompt's)."""
    walls = [b - a for a, b in zip(stamps, stamps[1:])]
    tail = walls[steady_start(len(walls)) :]
    return len(tail) / sum(tail) if tail and sum(tail) > 0 else 0.0


def generate(
    model,
    tokenizer,
    prompt_tokens: list[int],
    params: SamplingParams,
    cfg: GenerationConfig,
    on_text: Callable[[str], None] | None = None,
    session: Session | None = None,
    constraint: Constraint | None = None,
    drafter: Drafter | None = None,
) -> Generation:
    if not prompt_tokens:
        raise UserError("the prompt is empty after tokenization")
    check_prompt_fits(len(prompt_tokens), cfg.n_ctx)
    out = Generation(list(prompt_tokens))
    sampler, scanner = Sampler(params, constraint), _StopScanner(cfg.stop)  # constraint: a grammar the output must follow
    decoder = tokenizer.stream()
    session = session if session is not None else Session()
    session.cache_for(model, cfg.n_ctx)
    cached = session.reuse(prompt_tokens, cfg.cache_prompt, align=reuse_align(session, cfg.prefill_batch))
    n_keep = _n_keep(cfg, prompt_tokens, tokenizer)
    emitted = shifts = 0

    history = list(prompt_tokens)
    spec = Speculation(session, drafter, cfg.draft, cfg.draft_adapt) if drafter is not None and cfg.draft > 0 else None
    if spec is not None:
        spec.drafter.start(history)  # before the prompt runs: the MTP drafter takes its hidden states
    t0 = time.perf_counter()
    logits = session.feed(model, prompt_tokens[cached:], batch=cfg.prefill_batch)
    t1 = time.perf_counter()
    stamps = [t0]  # when each output token was sampled, after the prompt's start
    while True:
        if len(out.tokens) >= cfg.max_tokens:
            out.finish_reason = "length"
            break
        token = sampler(logits, history)
        if token in tokenizer.eog_ids and not cfg.ignore_eos:
            out.finish_reason = "eog"
            break
        out.tokens.append(token)
        stamps.append(time.perf_counter())
        history.append(token)
        out.text += decoder.feed(token)
        cut = scanner.find(out.text, emitted)
        if cut >= 0:
            out.text = out.text[:cut]
            out.finish_reason = "stop"
            break
        safe = scanner.safe_end(out.text)
        if on_text and safe > emitted:
            on_text(out.text[emitted:safe])
            emitted = safe
        if len(out.tokens) >= cfg.max_tokens:  # no forward pass for a token nobody will read
            out.finish_reason = "length"
            break
        if spec is not None:
            ahead = spec.next_logits(token)  # the verify pass computed it: the token was its draft
            if ahead is not None:
                logits = ahead
                continue
        if session.n + len(session.redo) >= cfg.n_ctx:
            if not (cfg.context_shift and session.shift(model, n_keep, cfg.prefill_batch)):
                out.finish_reason = "context"
                break
            shifts += 1
        try:
            if spec is not None:
                room = min(cfg.n_ctx - session.n - len(session.redo) - 1, cfg.max_tokens - len(out.tokens) - 1)
                logits = spec.step(model, token, history, room)
            else:
                logits = session.feed(model, [token])
        except KVPoolFull:  # several slots' pool has no room for it (shared/model/kv_pool.py): a full context too
            out.finish_reason = "context"
            break
    if spec is not None:  # the cache holds what plain decoding leaves: the prompt and the output but its last token
        spec.drop()
        spec.judge(model)
        spec.judge_proposals(history)
        session.settle(model)
    out.text += decoder.flush() if out.finish_reason != "stop" else ""
    if on_text and len(out.text) > emitted:
        on_text(out.text[emitted:])
    t2 = time.perf_counter()
    n_dec = len(out.tokens)
    computed = len(prompt_tokens) - cached
    out.timings = {
        "prompt_n": len(prompt_tokens),
        "prompt_cached": cached,  # of prompt_n, taken from the session's cache: not computed
        "prompt_ms": round((t1 - t0) * 1e3, 3),
        "prompt_tok_s": round(computed / max(t1 - t0, 1e-9), 3),  # computed tokens only
        "predicted_n": n_dec,
        "predicted_ms": round((t2 - t1) * 1e3, 3),
        "predicted_tok_s": round(n_dec / max(t2 - t1, 1e-9), 3) if n_dec else 0.0,
        "steady_tok_s": round(steady_tok_s(stamps), 3),
        "context_shifts": shifts,
    }
    if spec is not None:
        out.timings.update(draft_passes=spec.stats.passes, draft_n=spec.stats.drafted, draft_accepted=spec.stats.accepted)
    return out
