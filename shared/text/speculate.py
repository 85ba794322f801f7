"""Speculative decoding that changes speed, never output (docs/speculative.md).

A drafter guesses the next few tokens; one verify pass runs the decoded token and
its drafts as rows of one batch (`Session.verify`: each routed expert read once and
applied to all its rows in one GEMM); then the tokens are sampled from the rows'
logits one after another, exactly as plain decoding would sample them, and a
draft is kept while it equals what was sampled. The kernels are batch-exact, so
row j's logits are the ones plain decoding computes at that position: the output
is the plain output, token for token, greedy or sampled with the same seed.

Sampling this way is the standard speculative-sampling rule for a drafter whose
guess is certain (its distribution q is all on the draft d): d is kept with
probability p(d) = min(1, p(d)/q(d)), and otherwise the token comes from
p without d, renormalised, the rule's residual (p − q)+. Drawing from p first and
comparing gives both at once and spends one draw per emitted token, the draws
plain decoding spends.

    drafter_for(source, ...)      "ngram" → NGramDrafter; "mtp" → MtpDrafter; "none" → None
    Speculation(session, ...)     the drafts in flight, accepted or rolled back
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..config import DRAFT_SOURCES, MAX_DRAFT
from ..errors import UserError
from ..model.mtp import NextN, NextNStep, SubsetHead
from ..model.session import Session, common_prefix


class Drafter(Protocol):
    """Guesses what follows `history` (prompt and output so far, the last token decoded included).
    `free`: a proposal costs next to nothing (an index lookup, not a pass of a block), so the
    width chooser asks for the widest one every step and learns how often drafts would be kept
    while it drafts nothing."""

    free: bool

    def start(self, prompt: Sequence[int]) -> None:
        """A generation begins after `prompt`."""

    def propose(self, history: Sequence[int], n: int) -> list[int]: ...


class NGramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    history's last g tokens, the longest g from `max_n` down to `min_n` that occurs.
    Repeated text (code being edited, a document quoted back, a list's pattern) is
    drafted; anything else drafts nothing and costs nothing. The index of g-grams
    grows with the history, so a proposal is a few dict lookups."""

    free = True

    def __init__(self, max_n: int = 4, min_n: int = 2):
        self.max_n, self.min_n = max_n, min_n
        self._last: dict[tuple[int, ...], int] = {}  # g-gram → end of its latest occurrence (exclusive)
        self._indexed = 0  # grams ending before this position are in _last
        self._history: list[int] = []

    def start(self, prompt: Sequence[int]) -> None:
        self._extend(prompt)

    def propose(self, history: Sequence[int], n: int) -> list[int]:
        h = self._extend(history)
        end = len(h)
        for g in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            at = self._last.get(tuple(h[end - g :]))
            if at is not None:
                return h[at : at + n]
        return []

    def _extend(self, history: Sequence[int]) -> list[int]:
        """Index every gram that ends before the history's last position (the last
        one's own gram must not find itself)."""
        h = self._history
        if len(history) < len(h) or list(history[: len(h)]) != h:  # not a continuation: start over
            h, self._last, self._indexed = [], {}, 0
        h.extend(int(t) for t in history[len(h) :])
        self._history = h
        for end in range(max(self._indexed, 1), len(h)):
            for g in range(self.min_n, min(self.max_n, end) + 1):
                self._last[tuple(h[end - g : end])] = end
        self._indexed = max(self._indexed, len(h))
        return h


class ReplayDrafter:
    """Benchmarks only: drafts from a recorded greedy continuation `tokens` of the
    prompt, each draft token made wrong with probability 1 - `accuracy` (its id + 1),
    so the verify mechanism is measured at a chosen acceptance (random weights'
    own drafts are noise). The continuation starts where the prompt ends."""

    free = True

    def __init__(self, tokens: Sequence[int], accuracy: float = 1.0, seed: int = 0, n_vocab: int = 1 << 31):
        if not 0.0 <= accuracy <= 1.0:
            raise UserError(f"a replay drafter's accuracy must be in [0, 1], not {accuracy}")
        self.tokens, self.accuracy, self.n_vocab = [int(t) for t in tokens], accuracy, n_vocab
        self.rng = np.random.default_rng(seed)
        self.base = 0

    def start(self, prompt: Sequence[int]) -> None:
        self.base = len(prompt)

    def propose(self, history: Sequence[int], n: int) -> list[int]:
        at = len(history) - self.base
        right = self.tokens[at : at + n]
        wrong = self.rng.random(len(right)) >= self.accuracy
        return [(t + 1) % self.n_vocab if w else t for t, w in zip(right, wrong)]

    @classmethod
    def from_file(cls, path: str, n_vocab: int) -> ReplayDrafter:
        try:
            with open(path, encoding="utf-8") as fh:
                d = json.load(fh)
            return cls(d["tokens"], float(d.get("accuracy", 1.0)), int(d.get("seed", 0)), n_vocab)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"cannot read the draft replay {path}: {exc}") from None


class MtpDrafter:
    """Drafts from the file's own NextN/MTP block (shared/model/mtp.py): a guess at what
    follows the last token from the model's hidden state before it, then each further
    guess from the block's own output beside the guess before.

    The block attends over its own cache, where position j holds the pair (h_j, t_{j+1}):
    the model's final hidden state at j and the token after it. The model hands every
    pass's hidden rows to `observe` (`MoEModel.hidden_sink`); a pair is added once its next
    token is certain: in the pass, for a prompt's rows (in batches of at least PAIR_BATCH,
    so a long prompt needs no store of its hidden rows), else when `propose` learns the
    token just decoded. A draft's own rows are never pairs: the cache goes back to the
    last certain pair after each proposal. A pass that starts earlier than the pairs reach
    (a new request's prefix, a rollback's redo) cuts them back to what it leaves valid.

    The state follows its session across requests (`Session.drafter_state`), and is fed
    by requests that draft nothing too (`drafter_for`). A position whose hidden state the
    drafter never saw (a context shift kept an old prefix, a restored session, a prefix
    computed before the drafter was made) leaves a gap the block's cache cannot step
    over: it then drafts nothing until the conversation starts again from position 0.

    With `vocab` N (compute.draft_vocab) between 0 and the vocabulary's size, a guess is the
    head's argmax over the N lowest ids and the ids of the conversation so far (its prompts
    and output, added as `propose` sees them; a conversation that reuses no prefix starts
    the set again): `SubsetHead`, N rows of the head read a guess, not all. 0 (or N at
    least the vocabulary) is the whole head. Either way the output is the plain output."""

    free = False  # a guess is a step of the block and a pass of the head
    PAIR_BATCH = 64  # certain pairs waiting before a pass adds them (a prompt's chunk: at once)
    PAIR_STEP = 512  # rows of one block step at most: a prompt chunk's activations stay bounded

    def __init__(self, model, session: Session, n_ctx: int, vocab: int = 0):
        self.model, self.session, self.n_ctx, self.vocab = model, session, n_ctx, vocab
        self.head = NextN(model)
        whole = not 0 < vocab < self.head.head.shape[0]
        self.subset = None if whole else SubsetHead(self.head.head, vocab)  # None: guesses over the whole head
        self._seen = 0  # history entries already added to the subset
        self.cache = self.head.new_cache(n_ctx)  # pairs 0..cache.n-1: one layer's KV rows
        self.ids: list[int] = []  # each position's token as the passes ran it (draft rows' too, until cut)
        self.rows: dict[int, np.ndarray] = {}  # position → final hidden [D], from the last paired on
        self.gap = False  # a position's hidden state was never seen: no drafts until position 0 again

    @classmethod
    def for_session(cls, model, session: Session, n_ctx: int, vocab: int = 0) -> MtpDrafter:
        """The session's drafter, made on first use (or for another model, context size or vocabulary)."""
        held = session.drafter_state
        if not (isinstance(held, cls) and held.model is model and held.n_ctx == n_ctx and held.vocab == vocab):
            held = session.drafter_state = cls(model, session, n_ctx, vocab)
        return held

    @property
    def paired(self) -> int:
        return self.cache.n

    def start(self, prompt: Sequence[int]) -> None:
        """A generation begins, the session holding the prefix it reuses: pairs and rows of
        positions it no longer holds go, and the model hands this drafter its passes."""
        same = common_prefix(self.ids, self.session.tokens)
        self._cut(same, int(prompt[same]) if same < len(prompt) else None)
        self.model.hidden_sink = self.observe
        if self.subset is not None and same == 0:  # another conversation: its own ids are the likely ones
            self.subset.clear()
        self._seen = 0  # the next proposal's history is this request's: added whole once

    def observe(self, start: int, tokens: np.ndarray, hidden: np.ndarray, certain: int) -> None:
        """A pass ran `tokens` at positions start.. (their final hidden rows `hidden`), the
        first `certain` of them the conversation's own tokens."""
        if start == 0:
            self.gap = False
        self._cut(start, int(tokens[0]))
        if start > len(self.ids):
            self.gap = True
        if self.gap:
            return
        self.ids.extend(int(t) for t in tokens)
        for i, row in enumerate(hidden):
            self.rows[start + i] = row
        ready = start + min(certain, tokens.size) - 1  # pairs before this have a certain next token
        if ready - self.paired >= self.PAIR_BATCH:
            self._pair_up(ready)

    def propose(self, history: Sequence[int], n: int) -> list[int]:
        """Up to n greedy guesses at what follows history[-1], the token decoded last."""
        p = len(history) - 1
        self._add_seen(history)
        if self.gap or n <= 0 or p < 1:
            return []
        if self.paired > p - 1:  # pair p-1 is stepped now: its output gives the first guess
            self.cache.truncate(p - 1)
        if len(self.ids) < p or any(self.ids[j] != history[j] for j in range(self.paired, p)):
            self.gap = True  # a row the model never ran with the conversation's own token
            return []
        self._forget_from(p)  # rows past it are drafts' (or nothing)
        self.ids.append(int(history[p]))
        step = self._pair_up(p)
        if step is None:
            return []
        drafts = [self._guess(step)]
        mark = self.paired
        while len(drafts) < n:  # each further guess from the block's own output beside the guess before
            step = self.head.step(np.array(drafts[-1:]), step.feed[-1:], self.cache)
            drafts.append(self._guess(step))
        self.cache.truncate(mark)  # guesses are not pairs
        return drafts

    def _guess(self, step: NextNStep) -> int:
        return self.subset.greedy(step) if self.subset is not None else self.head.greedy(step)

    def _add_seen(self, history: Sequence[int]) -> None:
        """The conversation's ids not added yet join the subset: a proposal adds the tokens
        since the last one (a history shorter than that is another request's: added whole)."""
        if self.subset is None:
            return
        start = self._seen if self._seen <= len(history) else 0
        self.subset.add(history[start:])
        self._seen = len(history)

    def _cut(self, n: int, token: int | None = None) -> None:
        """Positions from n on are run again (with `token` first, when known): pairs that
        use them go (pair n-1 stays when its next token is `token`), and so do their rows."""
        keep = min(self.paired, n if token is not None and n < len(self.ids) and self.ids[n] == token else n - 1)
        if keep < self.paired:
            self.cache.truncate(max(keep, 0))
        self._forget_from(n)

    def _forget_from(self, n: int) -> None:
        del self.ids[n:]
        for j in [j for j in self.rows if j >= n]:
            del self.rows[j]

    def _pair_up(self, end: int) -> NextNStep | None:
        """Add the pairs from `paired` to end-1 (their rows and next tokens known), PAIR_STEP
        rows a step at most; the last step, None when a row is missing (a gap)."""
        step = None
        while self.paired < end:
            lo = self.paired
            hi = min(end, lo + self.PAIR_STEP)
            if any(j not in self.rows for j in range(lo, hi)):
                self.gap = True
                return None
            hidden = np.stack([self.rows[j] for j in range(lo, hi)])
            step = self.head.step(np.array(self.ids[lo + 1 : hi + 1]), hidden, self.cache)
        for j in [j for j in self.rows if j < self.paired - 1]:  # the last paired row stays: a pass may re-pair it
            del self.rows[j]
        return step


def drafter_for(
    source: str,
    replay: str | None = None,
    n_vocab: int = 1 << 31,
    model=None,
    session: Session | None = None,
    n_ctx: int = 0,
    vocab: int = 0,
) -> Drafter | None:
    """The configured drafter (compute.draft_source; compute.draft_replay, benchmarks only, over it).
    `model` (the MoEModel itself, not a wrapper), `session`, `n_ctx` and `vocab` (compute.draft_vocab,
    0 = the whole vocabulary): what the MTP drafter runs with. The model hands its passes to the
    session's MTP drafter when it has one, even for a request that drafts nothing (so the block's
    cache has no gap when the next request drafts again), and to nothing otherwise."""
    if model is not None:
        held = session.drafter_state if session is not None else None
        model.hidden_sink = held.observe if isinstance(held, MtpDrafter) and held.model is model else None
    if replay:
        return ReplayDrafter.from_file(replay, n_vocab)
    if source == "ngram":
        return NGramDrafter()
    if source == "mtp":
        if model is None or session is None:
            raise ValueError("the MTP drafter needs the model and its session")
        return MtpDrafter.for_session(model, session, n_ctx, vocab)
    if source == "none":
        return None
    raise UserError(f"unknown draft source {source!r}: one of {', '.join(DRAFT_SOURCES)}")


class WidthChooser:
    """Each pass's draft width, 0..`most`, from what the passes so far measured: the chance
    that draft i is kept once the ones before it were (`kept`), and the wall time of a pass
    by its rows (`cost`), which prices in what wider passes read — more distinct experts,
    each a read when the cache misses. A width w yields 1 + α1 + α1·α2 + … + α1⋯αw tokens
    for the cost of a pass of w + 1 rows; the best ratio wins, and 0 (plain decoding) when
    no width beats it.

    A session keeps its chooser across requests (`for_session`): a pass's cost is the
    model's and the machine's, so a new request starts from the prices the last one
    measured. The α come from every proposal judged against the text that followed
    (`Speculation`): a free drafter proposes at every step, drafted or not, so its α follow
    the text while the chooser drafts nothing, and are learnt again for each request
    (`new_text`); every `PROBE_EVERY` passes one draft more than the best is then tried only
    while that wider pass's price is a guess or old, and only where it could pay. A drafter
    that costs a pass is judged only on what it drafted, so its α stay from one request to
    the next, and every `PROBE_EVERY` passes one draft more than the best is tried: a text
    that turns repetitive is noticed."""

    PROBE_EVERY = 16
    PROBE_GAIN = 1.05
    # α before any is measured: a costly drafter's enough to try one draft (its α are learnt only
    # by drafting); a free drafter's below what pays, as its α are measured from its first step.
    PRIOR_KEPT = 0.7
    FREE_PRIOR_KEPT = 0.5
    FIRST_PLAIN = 3  # plain passes before any draft: one pass's time is too noisy a price
    REPRICE_PLAIN = 64  # while drafting, a plain pass this often: the price it is held against stays current
    # The weight of the past in each estimate. A pass's time varies with its misses, and one
    # drafted too often on a lucky price loses what the drafts gain: ten passes or so make a cost.
    # α is judged once per pass drafted, or with a free drafter once per step (ten steps make it).
    DECAY = 0.9
    KEPT_DECAY = 0.8
    FREE_KEPT_DECAY = 0.9

    def __init__(self, most: int, free: bool = False):
        self.most, self.free = most, free
        self.kept = [self.FREE_PRIOR_KEPT if free else self.PRIOR_KEPT] * most  # α_i; one never measured takes the one before it
        self.measured = [False] * most
        self.cost: dict[int, float] = {}  # rows → seconds, moving average
        self.samples: dict[int, int] = {}  # rows → passes measured
        self.age: dict[int, int] = {}  # rows → passes since the last of them
        self.since_probe = 0

    @classmethod
    def for_session(cls, session: Session, most: int, free: bool) -> WidthChooser:
        """The session's chooser, made on first use (or for another width or kind of drafter)."""
        held = session.width_chooser
        if not (isinstance(held, cls) and held.most == most and held.free == free):
            held = session.width_chooser = cls(most, free)
        return held

    def choose(self) -> int:
        one = self.cost.get(1)
        if self.samples.get(1, 0) < self.FIRST_PLAIN or one is None:
            return 0  # plain passes first: the price every width is held against
        best, best_rate = 0, 1.0 / one
        for w, tokens in enumerate(self.tokens(), start=1):
            rate = tokens / self.price(w + 1)
            if rate > best_rate:
                best, best_rate = w, rate
        self.since_probe += 1
        if self.since_probe >= self.PROBE_EVERY and best < self.most and self.worth_probing(best, best_rate):
            self.since_probe, best = 0, best + 1
        elif best and self.age.get(1, 0) >= self.REPRICE_PLAIN:  # a plain pass's price, measured again
            best = 0
        return best

    def tokens(self) -> list[float]:
        """Tokens a pass of each width 1..most yields: 1 + α1 + α1·α2 + …"""
        out, p, tokens, alpha = [], 1.0, 1.0, self.kept[0]
        for w in range(1, self.most + 1):
            alpha = self.kept[w - 1] if self.measured[w - 1] else alpha  # untried: as likely as the draft before
            p *= alpha
            tokens += p
            out.append(tokens)
        return out

    def worth_probing(self, best: int, best_rate: float) -> bool:
        """A costly drafter's α are learnt only by drafting: always. A free drafter's are known,
        so only what the wider pass costs is in doubt: only while its price is a guess or
        REPRICE_PLAIN passes old, and only if at a plain pass's price it would yield PROBE_GAIN
        more than the best does."""
        if not self.free:
            return True
        if self.age.get(best + 2, self.REPRICE_PLAIN) < self.REPRICE_PLAIN:
            return False  # its price is measured and current: `choose` weighed it already
        return self.tokens()[best] / self.cost[1] > self.PROBE_GAIN * best_rate

    def new_text(self) -> None:
        """A request begins: a free drafter's α are learnt again from its text (they cost nothing
        to learn, and another request's text may draft better or worse); the prices stay."""
        if self.free:
            self.kept, self.measured = [self.FREE_PRIOR_KEPT] * self.most, [False] * self.most

    def price(self, rows: int) -> float:
        """A pass's cost: measured, or the widest measured pass's cost per row times `rows`
        (half a plain pass per extra row before any is). Each row of a verify pass routes
        on its own, so its experts are mostly other experts, read in full: a pass costs
        nearly in proportion to its rows once the dense weights are shared (measured on
        qwen30b-shape: 1.4x for 2 rows, 2.0x for 3, 3.6x for 4; docs/speculative.md)."""
        if rows in self.cost:
            return self.cost[rows]
        widest = max(self.cost)
        if widest == 1:
            return self.cost[1] * (1.0 + 0.5 * (rows - 1))
        return self.cost[widest] * rows / widest

    def passed(self, rows: int, seconds: float) -> None:
        old = self.cost.get(rows)
        self.cost[rows] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds
        self.samples[rows] = self.samples.get(rows, 0) + 1
        for r in self.age:
            self.age[r] += 1
        self.age[rows] = 0

    def judged(self, drafted: int, kept: int) -> None:
        """A proposal of `drafted` tokens is settled: the first `kept` were what followed, the next (if any) was not."""
        for i in range(min(kept + 1, drafted, self.most)):
            if not self.measured[i] and i:  # its first measure: start from the estimate it was chosen by
                self.kept[i] = self.kept[i - 1]
            self.measured[i] = True
            decay = self.FREE_KEPT_DECAY if self.free else self.KEPT_DECAY
            self.kept[i] = decay * self.kept[i] + (1 - decay) * (1.0 if i < kept else 0.0)


@dataclass
class DraftStats:
    passes: int = 0  # verify passes with at least one draft
    drafted: int = 0
    accepted: int = 0


class Speculation:
    """The drafts of the last verify pass that are still ahead of the decoded text.

    After a pass on [t, d1..dk], the logits of row j say what follows d_j. The
    caller samples from row 0; `next_logits(token)` then gives row 1 if the token
    is d1 (kept: no pass needed), and so on; on the first token that differs the
    rest are rolled back and the caller runs a new pass."""

    def __init__(self, session: Session, drafter: Drafter, width: int, adapt: bool = True):
        if not 1 <= width <= MAX_DRAFT:
            raise UserError(f"draft width must be 1..{MAX_DRAFT}, not {width}")
        self.session, self.drafter, self.width = session, drafter, width
        self.chooser = WidthChooser.for_session(session, width, drafter.free) if adapt else None
        if self.chooser is not None:
            self.chooser.new_text()
        self.queue: list[tuple[int, np.ndarray]] = []  # (draft, the logits of the row after it)
        self.stats = DraftStats()
        self._drafted = self._kept = 0  # the last pass's drafts, and how many of them were kept so far
        self.proposals: list[tuple[int, list[int]]] = []  # (where in the history, the drafts) not judged yet

    def next_logits(self, token: int) -> np.ndarray | None:
        """The logits after `token` if the pass already computed them (it was the draft);
        otherwise None, with the drafts past it rolled back."""
        if self.queue and self.queue[0][0] == token:
            self.stats.accepted += 1
            self._kept += 1
            return self.queue.pop(0)[1]
        self.drop()
        return None

    def drop(self) -> None:
        """Forget the drafts still ahead (a wrong one, or the generation ended)."""
        if self.queue:
            self.session.rollback(len(self.queue))
            self.queue = []

    def judge(self, model) -> None:
        """The last pass's drafts are settled (a pass is about to begin, or the generation
        ended): the model's telemetry hears how many were kept."""
        if self._drafted:
            model.drafts_judged(self._drafted, self._kept)
        self._drafted = self._kept = 0

    def judge_proposals(self, history: Sequence[int]) -> None:
        """Each proposal whose fate the history now shows (a draft that differs from what
        followed, or every draft followed) tells the width chooser how many would be kept:
        a verified draft is kept exactly when it is what followed."""
        if self.chooser is None:
            return
        pending = []
        for at, drafts in self.proposals:
            known = min(len(history) - at, len(drafts))
            kept = next((i for i in range(known) if history[at + i] != drafts[i]), known)
            if kept < known or kept == len(drafts):
                self.chooser.judged(len(drafts), kept)
            else:
                pending.append((at, drafts))
        self.proposals = pending

    def step(self, model, token: int, history: Sequence[int], room: int) -> np.ndarray:
        """Run `token` (the last entry of `history`) with up to `room` drafts after it; its logits [V]."""
        self.judge(model)
        self.judge_proposals(history)
        n = min(self.chooser.choose() if self.chooser is not None else self.width, room)
        # A free drafter is asked for the widest proposal even when fewer are drafted (or none):
        # the chooser learns from all of it.
        ask = self.width if self.chooser is not None and self.chooser.free else n
        t0 = time.perf_counter()  # a pass's price includes its drafting (the MTP block's steps)
        proposal = [int(t) for t in self.drafter.propose(history, ask)][:ask] if ask > 0 else []
        if proposal and self.chooser is not None:
            self.proposals.append((len(history), proposal))
        drafts = proposal[:n]
        rows = 1 + len(self.session.redo) + len(drafts)
        if drafts:
            out = self.session.verify(model, [token, *drafts])
            self.stats.passes += 1
            self.stats.drafted += len(drafts)
            self.queue, self._drafted = list(zip(drafts, out[1:])), len(drafts)
            logits = out[0]
        else:
            logits = self.session.feed(model, [token])
        if self.chooser is not None:
            self.chooser.passed(rows, time.perf_counter() - t0)
        return logits
