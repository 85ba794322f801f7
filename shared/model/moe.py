"""The MoE block: routing, and applying the chosen experts to the tokens routed to them.

Legend: T tokens, D hidden, E experts, K experts per token.

Prefill batches: each expert multiplies all the tokens routed to it at once.
Experts may arrive in any order (cache hits first, misses as they land), but
the per-token sum is always taken in choice order (column 0 of `Routing.ids`,
the token's first choice, then column 1, ...), so the result is bit-identical
whatever the arrival order.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import quant
from ..errors import GGUFError
from ..gguf.spec import EXPERT_RUN_ROWS, ModelSpec, expert_output_parts, output_part_columns
from .blocks import sigmoid, softmax, swiglu
from .fused import _softmax_top_k, choice_sum
from .weights import Expert, ExpertSource, Weights


@dataclass(frozen=True)
class Routing:
    ids: np.ndarray  # int64 [T, K], best first
    weights: np.ndarray  # float32 [T, K]

    def unique_experts(self) -> list[int]:
        """Experts needed by these tokens, in order of first use (the fetch order)."""
        seen: dict[int, None] = {}
        for e in self.ids.reshape(-1).tolist():
            seen.setdefault(e, None)
        return list(seen)


def top_k_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, best first (ties: lower id first)."""
    order = np.argsort(-scores, axis=-1, kind="stable")  # [T, E]
    return order[:, :k]


def softmax_then_top_k(logits: np.ndarray, k: int, renormalize: bool = True) -> Routing:
    """Qwen3-MoE / Gemma-4: p = softmax over all experts, keep the top k (ties:
    lower id), renormalize. One fused loop: this runs once per layer per token."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)  # [T, E]
    ids = np.empty((logits.shape[0], k), np.int64)
    w = np.empty((logits.shape[0], k), np.float32)
    _softmax_top_k(logits, k, renormalize, ids, w)
    return Routing(ids, w)


def top_k_then_softmax(logits: np.ndarray, k: int) -> Routing:
    """gpt-oss: the k largest logits, softmax over just those."""
    ids = top_k_ids(logits, k)
    return Routing(ids, softmax(np.take_along_axis(logits, ids, axis=-1)).astype(np.float32))


def gated_group_top_k(
    logits: np.ndarray,
    k: int,
    *,
    gating: str = "sigmoid",
    bias: np.ndarray | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = True,
    scale: float = 1.0,
    group_score: str = "top2",
) -> Routing:
    """DeepSeek-style routing (deepseek2, glm4moe, lfm2moe; docs/models.md § Routing):
    p = gating(logits) (softmax or sigmoid over all experts); the experts are
    *chosen* on p + bias (the correction bias steers selection only), among the
    `topk_group` best of `n_group` groups; their weights are the unbiased p,
    renormalized to sum 1 when `norm`, times `scale`. A group's score is the sum of
    its two best (`group_score` "top2": V3's noaux_tc) or its best ("max": V2's
    group_limited_greedy). Ties: the lower group, then the lower expert id."""
    logits = np.asarray(logits, dtype=np.float32)  # [T, E]
    if gating == "softmax":
        p = softmax(logits).astype(np.float32)
    elif gating == "sigmoid":
        p = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    else:
        raise ValueError(f"expert gating {gating!r} is not softmax or sigmoid")
    choose = p if bias is None else p + bias.astype(np.float32)  # [T, E]
    if n_group > 1 and topk_group < n_group:
        t, e = choose.shape
        groups = choose.reshape(t, n_group, e // n_group)  # [T, G, E/G]
        if group_score == "top2":
            score = -np.sort(-groups, axis=-1)[:, :, :2].sum(axis=-1)  # [T, G]
        elif group_score == "max":
            score = groups.max(axis=-1)  # [T, G]
        else:
            raise ValueError(f"group score {group_score!r} is not top2 or max")
        keep = top_k_ids(score, topk_group)  # [T, topk_group]
        mask = np.zeros((t, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choose = np.where(np.repeat(mask, e // n_group, axis=-1), choose, -np.inf)
    ids = top_k_ids(choose, k)
    w = np.take_along_axis(p, ids, axis=-1)
    if norm:
        w = w / w.sum(axis=-1, keepdims=True)
    return Routing(ids.astype(np.int64), (w * np.float32(scale)).astype(np.float32))


def route_as_spec(spec: ModelSpec, logits: np.ndarray, k: int, bias: np.ndarray | None) -> Routing:
    """gated_group_top_k with the file's routing keys (ModelSpec's expert_* fields)."""
    return gated_group_top_k(
        logits,
        k,
        gating=spec.expert_gating,
        bias=bias,
        n_group=spec.expert_groups,
        topk_group=spec.expert_groups_used,
        norm=spec.expert_weights_norm,
        scale=spec.expert_weights_scale,
        group_score=spec.expert_group_score,
    )


def swiglu_expert(e: Expert, x: np.ndarray) -> np.ndarray:
    """The plain SwiGLU expert, down(silu(gate x) ⊙ up x), of most families; x [n, D] → [n, D]."""
    return e.down(swiglu(*e.gate_and_up(x)))


def _decode_experts(
    x: np.ndarray, routing: Routing, source: ExpertSource, layer: int, ffn: Callable[[Expert, np.ndarray], np.ndarray]
) -> np.ndarray:
    """A decoded token's Σ_s w[s] · ffn(expert ids[s], x), x [1, D] → [1, D] (its k experts are
    distinct): their outputs in the order the source yields them, then one choice_sum in choice
    order, as a prompt's tokens add theirs (measured: 3.5 µs a layer, where numpy's products
    and sums one choice at a time took 10)."""
    ids = routing.ids[0].tolist()
    glu = GLU_EXPERTS.get(ffn)
    here = {i for i, r in zip(ids, source.resident(layer, ids)) if r} if glu is not None else set()
    # one expert in memory gains nothing from a call of its own: each then goes alone, as it lands
    came, ys = _glu_decode(x, source.experts(layer, ids), here if len(here) > 1 else set(), ffn, glu)
    row = {e: j for j, e in enumerate(came)}
    return choice_sum(ys, np.array([[row[e] for e in ids]], np.int64), routing.weights)


def _glu_decode(
    x: np.ndarray, experts, here: set[int], ffn, glu, rows_of: Callable[[int], np.ndarray] | None = None
) -> tuple[list[int], np.ndarray]:
    """A decoded token's experts as `source.experts` yields them, their ids and their outputs
    [K, D] (row j expert came[j]'s): the ones in memory (`here`) together in two kernel calls
    once all of them have come, each other one (every one, when `here` is empty) alone as it
    lands, so its read still overlaps the work on the rest. With `rows_of` (a few decode rows,
    x [T, D]), expert e is on rows rows_of(e) of x: its outputs are that many rows, together
    in came's order, and the experts in memory take a row of each call per (expert, row)."""
    came: list[int] = []
    rows: list[np.ndarray] = []
    waiting: list[Expert] = []
    for e in experts:
        if e.id not in here:
            came.append(e.id)
            rows.append(ffn(e, x if rows_of is None else x[rows_of(e.id)]))
            continue
        waiting.append(e)
        if len(waiting) == len(here):
            if rows_of is None:
                ys = _glu_experts_at_once(x, waiting, glu)
            else:
                on = [rows_of(w.id) for w in waiting]
                ys = _glu_experts_at_once(x, [w for w, r in zip(waiting, on) for _ in r], glu, np.concatenate(on))
            came += [w.id for w in waiting]
            rows += [ys] if ys is not None else [ffn(w, x if rows_of is None else x[rows_of(w.id)]) for w in waiting]
    return came, rows[0] if len(rows) == 1 else np.concatenate(rows)


def _glu_experts_at_once(
    x: np.ndarray, experts: list[Expert], glu: Callable[[np.ndarray, np.ndarray], np.ndarray], rows: np.ndarray | None = None
) -> np.ndarray | None:
    """A gated expert (down(glu(gate x, up x))) of each expert on one token x [1, D] (or expert
    j on row rows[j] of x [T, D]), [K, D] in order, in two kernel calls (every gate and up,
    then every down: quant.gather_apply)
    where a call per matrix pays a rounding of the activation and a parallel region each
    (measured on qwen30b-shape: 16 gates and ups 0.38 ms against 0.73). Each row is what the
    expert function gives bit for bit (glu is elementwise, each bias added to its own row as
    Expert.gate_and_up adds it); None when the experts' matrices do not qualify (float types)."""
    k = len(experts)
    act = np.zeros(k, np.int64) if rows is None else rows
    if all(e.gate_up is not None for e in experts):
        gu = quant.gather_apply([e.gate_up.prep for e in experts], x, act)  # type: ignore[union-attr]
        if gu is None:
            return None
        _add_biases(gu, [e.gate_up_bias for e in experts])
        f = gu.shape[1] // 2
        g, u = gu[:, :f], gu[:, f:]
    elif all(e.gate is not None and e.up is not None for e in experts):
        both = quant.gather_apply([e.gate.prep for e in experts] + [e.up.prep for e in experts], x, np.concatenate([act, act]))  # type: ignore[union-attr]
        if both is None:
            return None
        _add_biases(both, [e.gate_bias for e in experts] + [e.up_bias for e in experts])
        g, u = both[:k], both[k:]
    else:
        return None
    y = quant.gather_apply([e.down.prep for e in experts], glu(g, u), np.arange(k, dtype=np.int64))
    if y is not None:
        _add_biases(y, [e.down_bias for e in experts])
    return y


def _add_biases(rows: np.ndarray, biases: list[np.ndarray | None]) -> None:
    """rows[j] += biases[j] where there is one (in place, each row as its own product's)."""
    for j, b in enumerate(biases):
        if b is not None:
            rows[j] += b


# Expert functions of the form down(glu(gate·x, up·x)) with an elementwise glu: a decode step
# takes all of a layer's experts at once (_glu_experts_at_once). A family adds its own here.
# Weak keys: a model whose expert function is its own bound method (deepseek4: the file's
# clamp) registers it for as long as the model lives (it keeps that method as an attribute).
GLU_EXPERTS: MutableMapping[Callable[[Expert, np.ndarray], np.ndarray], Callable[[np.ndarray, np.ndarray], np.ndarray]] = (
    weakref.WeakKeyDictionary()
)
GLU_EXPERTS[swiglu_expert] = swiglu


_SCRATCH = threading.local()


def _outputs_buffer(rows: int, cols: int) -> np.ndarray:
    """A float32 [rows, cols] view of this thread's grow-only buffer for a chunk's expert
    outputs (K·D floats a token: prefill_activation_bytes counts them). Reused across layers
    and chunks: fresh pages of a few hundred MB cost more to fault in than to fill (~0.1 s a
    layer on a 2,048-token chunk)."""
    buf = getattr(_SCRATCH, "ys", None)
    if buf is None or buf.size < rows * cols:
        buf = _SCRATCH.ys = np.empty(rows * cols, np.float32)
    return buf[: rows * cols].reshape(rows, cols)


def apply_experts(
    x: np.ndarray, routing: Routing, source: ExpertSource, layer: int, ffn: Callable[[Expert, np.ndarray], np.ndarray]
) -> np.ndarray:
    """Σ_k w[t,k] · ffn(expert ids[t,k], x[t]) for every token t; x [T, D] → [T, D]."""
    t, k = routing.ids.shape
    if t == 1:  # decode: one token, k distinct experts — no index bookkeeping
        return _decode_experts(x, routing, source, layer, ffn)
    at = np.empty((t, k), np.int64)  # (token, choice) → its row of the outputs
    unique = routing.unique_experts()
    glu = GLU_EXPERTS.get(ffn)
    pairs = _pairs_by_expert(routing.ids)  # expert → its (token, choice) pairs, tokens ascending
    if glu is not None and len(unique) <= source.held_together:
        if t <= DECODE_ROWS:
            return _decode_rows_experts(x, routing, source, layer, ffn, glu, unique, pairs, at)
        return _experts_in_groups(x, source, layer, unique, pairs, glu, ffn, routing, at)
    ys = _outputs_buffer(t * k, x.shape[1])  # the experts' outputs, one expert's rows after another
    n = 0
    for expert in source.experts(layer, unique):  # as each becomes usable; a token picks an expert at most once
        n = _experts_one_by_one(x, [(expert, pairs(expert.id))], ffn, ys, at, n, k)
    return choice_sum(ys, at, routing.weights)  # fixed choice order, as a decode step adds


# A pass of this many rows or fewer is decode rows (a token of each of several sequences, a
# verify pass's drafts), whose experts are each on a row or two: they go as a decoded token's,
# a row of a gather call per (expert, row) (_decode_rows_experts). The grouped calls made for a
# prompt's experts took a 4-row pass's ~29 experts a layer at full depth 130 ms against 82-91
# this way (qwen30b-shape, resident): Python per run, and 37 GB/s where the gather reads 43.
DECODE_ROWS = 8


def _decode_rows_experts(
    x: np.ndarray,
    routing: Routing,
    source: ExpertSource,
    layer: int,
    ffn: Callable[[Expert, np.ndarray], np.ndarray],
    glu: Callable[[np.ndarray, np.ndarray], np.ndarray],
    unique: list[int],
    pairs: Callable[[int], np.ndarray],
    at: np.ndarray,
) -> np.ndarray:
    """A few decode rows' Σ_s w[t, s] · ffn(expert ids[t, s], x[t]), x [T, D] → [T, D], as a
    decoded token's (_glu_decode, each expert on its rows): the experts in memory together once
    all of them have come, in two gather calls with a row per (expert, row) pair, and each
    other one on its rows as it lands; then one choice_sum in choice order. Every pair's row
    is the row kernel's, as in a grouped call or alone (batch-exact)."""
    k = routing.ids.shape[1]
    here = {e for e, r in zip(unique, source.resident(layer, unique)) if r}
    # one expert in memory gains nothing from a call of its own: each then goes alone, as it lands
    came, ys = _glu_decode(x, source.experts(layer, unique), here if len(here) > 1 else set(), ffn, glu, lambda e: pairs(e) // k)
    n = 0
    for e in came:  # its outputs' rows, in its (token, choice) pairs' order
        got = pairs(e)
        at[got // k, got % k] = np.arange(n, n + got.size)
        n += got.size
    return choice_sum(ys, at, routing.weights)


# A prompt's experts in memory are taken in groups of about this many rows a call: enough to
# pay one Python dispatch, rounding and parallel region for several experts, few enough that
# the group's activations and outputs stay in the core's L2 (a layer's at once were ~100 MB
# of fresh temporaries on a 512-token prompt, slower than an expert at a time).
GROUP_ROWS = 128


def _experts_in_groups(
    x: np.ndarray,
    source: ExpertSource,
    layer: int,
    unique: list[int],
    pairs: Callable[[int], np.ndarray],
    glu: Callable[[np.ndarray, np.ndarray], np.ndarray],
    ffn: Callable[[Expert, np.ndarray], np.ndarray],
    routing: Routing,
    at: np.ndarray,
) -> np.ndarray:
    """A prompt's gated experts, several a kernel call (_hidden_of_run, _down_of_run): the ones in
    memory together once all of them have come, then each miss with the misses that have
    landed while the work before it ran (they come next from the source without a wait), so a
    read still overlaps the work on what is already here. A chunk whose outputs would be
    large (expert_output_parts) keeps each run's hidden activations and takes the down
    projections at the end, a part of the output's columns at a time (_downs_in_parts)."""
    t, k = routing.ids.shape
    d = x.shape[1]
    ys: np.ndarray | None = None  # the outputs whole, once a run shows they are to be
    held: list[_HeldRun] = []  # runs whose down projections wait for the parts
    parts = 0
    here = {e for e, r in zip(unique, source.resident(layer, unique)) if r}
    hits_left = len(here)
    seen: set[int] = set()
    group: list[tuple[Expert, np.ndarray]] = []
    n = 0
    rounded: list[quant.Int8Rows] = []

    def x_rounded() -> quant.Int8Rows:
        """x rounded to int8 once for every run of the layer (quant.int8_rows), on first use."""
        if not rounded:
            rounded.append(quant.int8_rows(x))
        return rounded[0]

    def work_on(group: list[tuple[Expert, np.ndarray]]) -> None:
        nonlocal ys, held, parts, n
        for part in _runs_of_rows(group, GROUP_ROWS):
            run = _hidden_of_run(x_rounded, part, glu, at, n, k)
            parts = parts or (expert_output_parts(t * k, d, run.hidden.shape[1]) if run else 1)
            if run is not None and parts > 1:
                held.append(run)
                n += run.hidden.shape[0]
                continue
            if ys is None:
                ys = _outputs_buffer(t * k, d)
                for r in held:  # (a layer's matrices are of one type: in practice none here)
                    _down_of_run(r, ys)
                held = []
            n = _down_of_run(run, ys) if run is not None else _experts_one_by_one(x, part, ffn, ys, at, n, k)

    it = iter(source.experts(layer, unique))
    for expert in it:
        seen.add(expert.id)
        group.append((expert, pairs(expert.id)))
        if expert.id in here:
            hits_left -= 1
            if hits_left:
                continue
        rest = [e for e in unique if e not in seen]
        for _ in range(sum(source.resident(layer, rest)) if rest else 0):
            landed = next(it)
            seen.add(landed.id)
            hits_left -= landed.id in here
            group.append((landed, pairs(landed.id)))
        work_on(group)
        group = []
    if group:  # a source that yields a resident expert after a miss leaves some waiting
        work_on(group)
    if ys is not None:
        return choice_sum(ys, at, routing.weights)  # fixed choice order, as a decode step adds
    return _downs_in_parts(held, at, routing.weights, d)


@dataclass(frozen=True)
class _HeldRun:
    """A run of a prompt's experts whose down projections wait (_downs_in_parts): the
    experts, their gated hidden activations [m, F] (each expert's rows after the one before,
    `counts` of them from `first`), and the row of the outputs its first row goes to."""

    experts: list[Expert]
    hidden: np.ndarray
    first: np.ndarray
    counts: np.ndarray
    row: int


def _hidden_of_run(
    x_rounded: Callable[[], quant.Int8Rows],
    group: list[tuple[Expert, np.ndarray]],
    glu: Callable[[np.ndarray, np.ndarray], np.ndarray],
    at: np.ndarray,
    n: int,
    k: int,
) -> _HeldRun | None:
    """glu(gate x, up x) [m, F] of each expert of `group` on its tokens, in one kernel call,
    at[t, s] pointing at the output rows from n on that its down projection fills; x as
    `x_rounded()` gives it, rounded once for the layer (each run takes its tokens' rows where
    they lie). Grouped, a prompt's experts pay one parallel region and one Python dispatch a
    run rather than each (~330 calls a layer on a 512-token qwen30b-shape prompt); each row
    is what the expert function gives bit for bit (glu is elementwise, each bias added to its
    own expert's rows). None when the matrices do not qualify (float types): the run then
    goes one expert at a time through its function."""
    experts = [e for e, _ in group]
    if not all(quant.grouped_qualifies(e.down.prep) for e in experts):
        return None
    tokens = [got // k for _, got in group]
    counts = np.array([r.size for r in tokens], np.int64)
    first = np.zeros(len(group), np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    h = _grouped_glu(x_rounded, np.concatenate(tokens), experts, first, counts, glu)
    if h is None:
        return None
    for (_, got), f, c in zip(group, first, counts):
        at[got // k, got % k] = np.arange(n + f, n + f + c)
    return _HeldRun(experts, h, first, counts, n)


def _downs_in_parts(held: list[_HeldRun], at: np.ndarray, weights: np.ndarray, d: int) -> np.ndarray:
    """Σ_s w[t, s] · down(hidden) of the held runs, [T, D], a part of the output's columns at
    a time: every expert's rows of its down projection for those columns (quant.row_range),
    then their choice-order sum into those columns of the result. Each output element is the
    same row's product and the same sum as in a whole pass (the kernels compute every weight
    row alone), so the result is _down_of_run's and choice_sum's bit for bit."""
    rows = sum(r.hidden.shape[0] for r in held)
    f = held[0].hidden.shape[1]
    out = np.empty((at.shape[0], d), np.float32)
    for c0, c1 in output_part_columns(d, expert_output_parts(rows, d, f)):
        ys = _outputs_buffer(rows, c1 - c0)
        for r in held:
            _down_of_run(r, ys, (c0, c1))
        out[:, c0:c1] = choice_sum(ys, at, weights)
    return out


def _experts_one_by_one(
    x: np.ndarray,
    group: list[tuple[Expert, np.ndarray]],
    ffn: Callable[[Expert, np.ndarray], np.ndarray],
    ys: np.ndarray,
    at: np.ndarray,
    n: int,
    k: int,
) -> int:
    """Each expert of `group` (expert, its flat (token, choice) pairs) through `ffn` on its
    tokens, its outputs into ys from row n on, at[t, s] pointing at each: the next free row."""
    for e, got in group:
        rows = got // k
        ys[n : n + rows.size] = ffn(e, x[rows])
        at[rows, got % k] = np.arange(n, n + rows.size)
        n += rows.size
    return n


def _runs_of_rows(group: list[tuple[Expert, np.ndarray]], rows: int) -> list[list[tuple[Expert, np.ndarray]]]:
    """group split, in order, into runs of experts with about `rows` pairs each; an expert with
    more is a run of its own, in pieces of at most EXPERT_RUN_ROWS pairs (a run's arrays stay
    that small whatever a prompt routes to one expert: prefill_activation_bytes; each row's
    numbers are the same in any piece)."""
    runs: list[list[tuple[Expert, np.ndarray]]] = [[]]
    size = 0
    for expert, got in group:
        for piece in (got[a : a + EXPERT_RUN_ROWS] for a in range(0, max(1, got.size), EXPERT_RUN_ROWS)):
            if runs[-1] and size + piece.size > rows:
                runs.append([])
                size = 0
            runs[-1].append((expert, piece))
            size += piece.size
    return runs


def _pairs_by_expert(ids: np.ndarray) -> Callable[[int], np.ndarray]:
    """expert id -> its (token, choice) pairs as flat indices t·K + s into ids [T, K],
    ascending: one sort for the layer rather than a comparison of all of ids per expert."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat)
    ends = np.cumsum(counts)
    starts = ends - counts
    return lambda e: order[starts[e] : ends[e]]


def _down_of_run(run: _HeldRun, ys: np.ndarray, columns: tuple[int, int] | None = None) -> int:
    """The down projections of a run's experts on their hidden activations, in one kernel call
    (quant.grouped_apply), into ys from the run's row on: every output column, or only
    `columns` [c0, c1) (each expert's down rows for them: quant.row_range); returns the next
    free row."""
    downs = [e.down.prep for e in run.experts]
    biases = [e.down_bias for e in run.experts]
    if columns is not None:
        c0, c1 = columns
        downs = [quant.row_range(p, c0, c1) for p in downs]
        biases = [None if b is None else b[c0:c1] for b in biases]
    end = run.row + run.hidden.shape[0]
    y = quant.grouped_apply(downs, run.hidden, run.first, run.counts, out=ys[run.row : end])
    assert y is not None  # _hidden_of_run checked that they qualify
    _add_run_biases(y, biases, run.first, run.counts)
    return end


def _grouped_glu(
    x_rounded: Callable[[], quant.Int8Rows],
    rows: np.ndarray,
    experts: list[Expert],
    first: np.ndarray,
    counts: np.ndarray,
    glu: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray | None:
    """glu(gate x, up x) [m, F] of each expert on its run of x's rows (rows[first[j]] ..
    rows[first[j] + counts[j] − 1] of x, rounded by `x_rounded()`), in one kernel call; None
    when the matrices do not qualify (x is then not rounded)."""
    if all(e.gate_up is not None for e in experts):
        ps = [e.gate_up.prep for e in experts]  # type: ignore[union-attr]
        gu = quant.grouped_apply(ps, x_rounded(), first, counts, rows=rows) if quant.grouped_qualifies(ps[0]) else None
        if gu is None:
            return None
        _add_run_biases(gu, [e.gate_up_bias for e in experts], first, counts)
        f = gu.shape[1] // 2
        return glu(gu[:, :f], gu[:, f:])
    if all(e.gate is not None and e.up is not None for e in experts):
        ps = [e.gate.prep for e in experts] + [e.up.prep for e in experts]  # type: ignore[union-attr]
        if not quant.grouped_qualifies(ps[0]):
            return None
        both = quant.grouped_apply(ps, x_rounded(), np.concatenate([first, first]), np.concatenate([counts, counts]), rows=rows)
        if both is None:
            return None
        m = rows.size
        _add_run_biases(both[:m], [e.gate_bias for e in experts], first, counts)
        _add_run_biases(both[m:], [e.up_bias for e in experts], first, counts)
        return glu(both[:m], both[m:])
    return None


def _add_run_biases(rows: np.ndarray, biases: list[np.ndarray | None], first: np.ndarray, counts: np.ndarray) -> None:
    """rows[first[j] : first[j] + counts[j]] += biases[j] where there is one (each expert's own rows)."""
    for b, f, c in zip(biases, first, counts):
        if b is not None:
            rows[f : f + c] += b


def load_shared_expert(w: Weights, p: str, n_embd: int) -> dict[str, Any]:
    """The always-on shared expert behind a sigmoid gate (qwen35moe, qwen2moe) of the
    layer with tensor prefix `p`: `ffn_{gate,up,down}_shexp`, and the gate
    `ffn_gate_inp_shexp` as a function n [T, D] → [T, 1]. Files store the gate as [D]
    (moe-pipe convert, made models) or as llama.cpp's converter leaves HF's [1, D]
    (possibly quantized); both are read."""
    name = p + "ffn_gate_inp_shexp.weight"
    shape = tuple(w.mf.gguf.tensor(name).shape)
    if shape not in ((n_embd,), (1, n_embd)):
        raise GGUFError(w.mf.gguf.path, f"tensor {name!r} has shape {list(shape)}, expected [{n_embd}] (n_embd)")
    if len(shape) == 2:
        gate: Callable[[np.ndarray], np.ndarray] = w.matrix(name)
    else:
        v = w.vector(name)
        # a row-wise sum, not n @ v: BLAS sums a batch's rows in another order than one row's,
        # and a position must compute the same alone or in a batch (attend_rows)
        gate = lambda n: np.sum(n * v, axis=-1, keepdims=True)  # noqa: E731
    return dict(
        sh_gate=w.matrix(p + "ffn_gate_shexp.weight"),
        sh_up=w.matrix(p + "ffn_up_shexp.weight"),
        sh_down=w.matrix(p + "ffn_down_shexp.weight"),
        sh_inp=gate,
    )


def gated_shared_expert(L: dict[str, Any], n: np.ndarray) -> np.ndarray:
    """σ(`ffn_gate_inp_shexp`·n) · `ffn_down_shexp`·(silu(`ffn_gate_shexp`·n) ⊙ `ffn_up_shexp`·n),
    with L's entries from `load_shared_expert`; n [T, D] → [T, D]."""
    return L["sh_down"](swiglu(L["sh_gate"](n), L["sh_up"](n))) * sigmoid(L["sh_inp"](n))
