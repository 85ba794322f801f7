"""The gated delta rule's recurrence: qwen35moe's Gated DeltaNet and bailingmoe3's Kimi Delta
Attention (KDA) run it on their recurrent layers (docs/models.md § qwen35moe, § bailingmoe3).

Per token t and value head h, with the matrix S [d_k, d_v] of the head's state:

    S ← diag(decay_t)·S                    decay per head (qwen35moe) or per key channel (KDA)
    r = kᵀS;  δ = (v − r)·β;  S ← S + k ⊗ δ;  o = qᵀS

`scan` runs it over a sequence's rows in one kernel call: the heads split across the cores,
and each head's S (64 KiB at d = 128) stays in the core's cache for all of the rows, where
the per-token numpy form passed every head's state through memory four times a token
(half of a 2,048-token prompt's time on qwen35-35b-shape cut to 4 layers).

The order of the floating-point steps is fixed and is the same for a row alone as for the
row in a prompt (so prefix reuse and a decode step see the prompt's own numbers): per row,
first S's rows scaled by their decay (each product rounded) while r sums k_a·S[a, :] in a
order, then δ, then S[a, :] + k_a·δ (the product rounded, then the sum: no fused
multiply-add, as numpy's `S += k ⊗ δ`) while o sums q_a·S[a, :] in a order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant import _target  # noqa: F401  (before any jit: the ARM dot-product target and the cache's stamps, shared/quant/_target.py)
from .blocks import RecurrentState


@njit(cache=True, boundscheck=False, parallel=True, nogil=True)
def _scan_heads(S, q, k, v, beta, decay, key_of, mark, kept, o):  # pragma: no cover - compiled
    """S [H, dk, dv] in place; q, k [T, G, dk]; v [T, H, dv]; beta [T, H]; decay [T, H, 1 or dk];
    key_of [H] (the key head of value head h); o [T, H, dv] out; after row mark − 1, S into
    kept [H, dk, dv] (mark 0: never)."""
    T, H = v.shape[0], v.shape[1]
    dk, dv = S.shape[1], S.shape[2]
    per_channel = decay.shape[2] != 1
    for h in prange(H):
        g = key_of[h]
        Sh = S[h]
        r = np.empty(dv, np.float32)
        dl = np.empty(dv, np.float32)
        acc = np.empty(dv, np.float32)
        for j in range(T):
            r[:] = 0.0
            for a in range(dk):
                dd = decay[j, h, a] if per_channel else decay[j, h, 0]
                ka = k[j, g, a]
                for b in range(dv):
                    s = Sh[a, b] * dd
                    Sh[a, b] = s
                    r[b] += ka * s
            bt = beta[j, h]
            for b in range(dv):
                dl[b] = (v[j, h, b] - r[b]) * bt
            acc[:] = 0.0
            for a in range(dk):
                ka = k[j, g, a]
                qa = q[j, g, a]
                for b in range(dv):
                    s = Sh[a, b] + ka * dl[b]
                    Sh[a, b] = s
                    acc[b] += qa * s
            for b in range(dv):
                o[j, h, b] = acc[b]
            if j + 1 == mark:
                kept[h] = Sh


def scan(state: RecurrentState, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, decay: np.ndarray) -> np.ndarray:
    """Layer i's rows of one sequence through the gated delta rule, from and into state.delta[i]:
    q, k [T, G, d_k] (G key heads: value head h reads key head h mod G), v [T, H, d_v], beta
    [T, H], decay [T, H] (per head) or [T, H, d_k] (per key channel) → o [T, H, d_v]. With a
    verify pass's mark (RecurrentState.mark) within these rows, the state after the mark's
    last row also goes into `state.kept`, for a rollback of the pass's drafts."""
    t, n_heads = v.shape[0], v.shape[1]
    S = state.delta[i]
    o = np.empty(v.shape, np.float32)
    mark = state.mark if 0 < state.mark <= t else 0
    kept = np.empty(S.shape if mark else (0, 0, 0), np.float32)
    f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)  # noqa: E731
    decay = f32(decay)
    key_of = np.arange(n_heads, dtype=np.int64) % q.shape[1]
    _scan_heads(S, f32(q), f32(k), f32(v), f32(beta), decay.reshape(t, n_heads, -1), key_of, mark, kept, o)
    if mark:
        state.kept[1][i] = kept
    return o
