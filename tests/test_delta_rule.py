"""shared/model/delta_rule.py: the gated delta rule's recurrence in one kernel call."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.model import delta_rule
from moe_pipe.shared.model.blocks import RecurrentState


def _reference(S, q, k, v, beta, decay):
    """The recurrence as its docstring orders it, a row of S at a time (numpy, no fused steps)."""
    S = S.copy()
    t, n_heads = v.shape[:2]
    o = np.empty(v.shape, np.float32)
    for j in range(t):
        for h in range(n_heads):
            g = h % q.shape[1]
            d = decay[j, h] if decay.ndim == 3 else np.full(S.shape[1], decay[j, h], np.float32)
            r = np.zeros(S.shape[2], np.float32)
            for a in range(S.shape[1]):
                S[h, a] = S[h, a] * d[a]
                r = r + k[j, g, a] * S[h, a]
            delta = (v[j, h] - r) * beta[j, h]
            acc = np.zeros(S.shape[2], np.float32)
            for a in range(S.shape[1]):
                S[h, a] = S[h, a] + k[j, g, a] * delta
                acc = acc + q[j, g, a] * S[h, a]
            o[j, h] = acc
    return o, S


def _inputs(rng, t, n_heads, key_heads, d, per_channel):
    q = (rng.standard_normal((t, key_heads, d)) * 0.2).astype(np.float32)
    k = (rng.standard_normal((t, key_heads, d)) * 0.2).astype(np.float32)
    v = rng.standard_normal((t, n_heads, d)).astype(np.float32)
    beta = rng.random((t, n_heads)).astype(np.float32)
    decay = (0.5 + 0.5 * rng.random((t, n_heads, d) if per_channel else (t, n_heads))).astype(np.float32)
    return q, k, v, beta, decay


def _state(rng, n_heads, d):
    state = RecurrentState([3], 4, 3 * n_heads * d, n_heads, d, d)
    state.delta[3][:] = (rng.standard_normal((n_heads, d, d)) * 0.1).astype(np.float32)
    return state


@pytest.mark.parametrize(("n_heads", "key_heads", "per_channel"), [(6, 3, False), (4, 4, True)])
def test_the_scan_is_the_recurrence_in_its_stated_order(n_heads, key_heads, per_channel):
    rng = np.random.default_rng(7)
    state, d = _state(rng, n_heads, 8), 8
    rows = _inputs(rng, 11, n_heads, key_heads, d, per_channel)
    want_o, want_S = _reference(state.delta[3], *rows)
    o = delta_rule.scan(state, 3, *rows)
    np.testing.assert_array_equal(o, want_o)
    np.testing.assert_array_equal(state.delta[3], want_S)


@pytest.mark.parametrize("per_channel", [False, True])
def test_rows_one_at_a_time_give_what_the_rows_together_give(per_channel):
    rng = np.random.default_rng(8)
    together, alone = _state(rng, 4, 16), RecurrentState([3], 4, 3 * 4 * 16, 4, 16, 16)
    alone.delta[3][:] = together.delta[3]
    rows = _inputs(rng, 9, 4, 2, 16, per_channel)
    o = delta_rule.scan(together, 3, *rows)
    one_by_one = [delta_rule.scan(alone, 3, *(x[j : j + 1] for x in rows)) for j in range(9)]
    np.testing.assert_array_equal(np.concatenate(one_by_one), o)
    np.testing.assert_array_equal(alone.delta[3], together.delta[3])


def test_a_mark_keeps_the_state_after_its_last_row():
    rng = np.random.default_rng(9)
    state = _state(rng, 4, 8)
    before = state.delta[3].copy()
    rows = _inputs(rng, 6, 4, 4, 8, True)
    state.mark = 2
    delta_rule.scan(state, 3, *rows)
    _, after_two = _reference(before, *(x[:2] for x in rows))
    np.testing.assert_array_equal(state.kept[1][3], after_two)
    beyond = _state(rng, 4, 8)
    beyond.mark = 7  # past these rows: nothing kept
    delta_rule.scan(beyond, 3, *rows)
    assert 3 not in beyond.kept[1]
