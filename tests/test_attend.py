"""shared/model/attend.py: attention over the cache as stored. A position gets the
same numbers bit for bit alone (decode) or in any prompt block, from a whole-context
cache or a ring of rows; the numbers are softmax(q·K)·V of the stored values to
float32 rounding; the kernels' exp is within 2 ulp of exp."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.model.attend import _NO_SINKS, PARALLEL_DECODE_KEYS, _attend_blocks, _attend_token, _half_row, attend, exp32


def _reference(q, k, v, start, window, scale, sinks):
    """float64 attention of q [T, Hk, G, d] over k, v [Hk, N, d] (positions 0..N-1)."""
    t_count, hk, g, _ = q.shape
    out = np.empty((t_count, hk, g, v.shape[2]))
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for t in range(t_count):
        p = start + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(hk):
            for a in range(g):
                s = k64[h, lo : p + 1] @ q[t, h, a].astype(np.float64) * scale
                m = max(s.max(), sinks[h * g + a]) if sinks is not None else s.max()
                e = np.exp(s - m)
                total = e.sum() + (np.exp(sinks[h * g + a] - m) if sinks is not None else 0.0)
                out[t, h, a] = (e / total) @ v64[h, lo : p + 1]
    return out


CASES = [  # T, Hk, G, d, window, sinks
    (40, 2, 4, 64, 0, False),
    (37, 2, 4, 64, 9, True),
    (70, 1, 16, 96, 0, True),
    (5, 3, 1, 32, 3, False),
    (19, 1, 8, 576, 0, False),  # deepseek2's latent head: d = 512 + 64
    (23, 2, 3, 40, 6, True),  # a head width that is not whole vectors: the numba loops, not the IR tiles
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-hk{c[1]}-g{c[2]}-d{c[3]}-w{c[4]}" + ("-sinks" if c[5] else "") for c in CASES])
def test_a_position_computes_the_same_alone_or_in_a_prompt_block(case, dtype):
    t_count, hk, g, d, window, with_sinks = case
    rng = np.random.default_rng(t_count)
    start, n_ctx = 7, 128
    k = rng.standard_normal((hk, n_ctx, d)).astype(dtype)
    v = rng.standard_normal((hk, n_ctx, d)).astype(dtype)
    q = rng.standard_normal((t_count, hk, g, d)).astype(np.float32)
    sinks = rng.standard_normal(hk * g).astype(np.float32) if with_sinks else None
    scale = 1 / np.sqrt(d)
    whole = attend(q, k, v, 0, start, window, scale, sinks)
    alone = np.stack([attend(q[t : t + 1], k, v, 0, start + t, window, scale, sinks)[0] for t in range(t_count)])
    split = np.concatenate([attend(q[a : a + 11], k, v, 0, start + a, window, scale, sinks) for a in range(0, t_count, 11)])
    assert np.array_equal(whole, alone) and np.array_equal(whole, split)
    want = _reference(q, k, v, start, window, scale, sinks)
    np.testing.assert_allclose(whole, want, rtol=0, atol=3e-6 * np.abs(want).max())


def test_a_long_decode_step_splits_its_heads_across_threads_and_computes_the_same():
    # Past PARALLEL_DECODE_KEYS positions a decode step runs its kv heads on numba's
    # threads (the prompt blocks' driver with blocks of one token): the same numbers.
    rng = np.random.default_rng(2)
    hk, g, d, start, t_count = 3, 4, 64, PARALLEL_DECODE_KEYS + 40, 5
    k = rng.standard_normal((hk, start + t_count, d)).astype(np.float16)
    v = rng.standard_normal((hk, start + t_count, d)).astype(np.float16)
    q = rng.standard_normal((t_count, hk, g, d)).astype(np.float32)
    whole = attend(q, k, v, 0, start, 0, 0.125, None)
    alone = np.stack([attend(q[t : t + 1], k, v, 0, start + t, 0, 0.125, None)[0] for t in range(t_count)])
    short = attend(q[:1], k[:, : start + 1], v[:, : start + 1], 0, start, PARALLEL_DECODE_KEYS - 1, 0.125, None)  # a window: serial
    windowed = attend(q[:2], k, v, 0, start, PARALLEL_DECODE_KEYS - 1, 0.125, None)
    assert np.array_equal(whole, alone)
    assert np.array_equal(short[0], windowed[0])


@pytest.mark.parametrize("parts", [2, 3])
def test_a_decode_step_split_by_query_heads_computes_the_same(parts):
    # One kv head (deepseek2's latent head) past PARALLEL_DECODE_KEYS: its query heads go to the
    # threads in parts, each part over every chunk; the numbers are the serial step's.
    rng = np.random.default_rng(3)
    g, d, start = 5, 64, PARALLEL_DECODE_KEYS + 70
    k = rng.standard_normal((1, start + 1, d)).astype(np.float16).view(np.uint16)
    q = rng.standard_normal((1, 1, g, d)).astype(np.float32)
    serial, split = np.empty((1, 1, g, 48), np.float32), np.empty((1, 1, g, 48), np.float32)
    args = (q, k, k, 0, start)
    _attend_token(*args, 0, np.float32(0.125), _NO_SINKS, False, serial)
    _attend_blocks(*args, 1, parts, 0, np.float32(0.125), _NO_SINKS, False, split)
    assert np.array_equal(serial, split)
    assert np.array_equal(attend(q, k.view(np.float16), 48, 0, start, 0, 0.125, None), serial)


@pytest.mark.parametrize("window, n", [(16, 100), (72, 200)])
def test_a_ring_of_rows_gives_what_the_whole_cache_gives(window, n):
    # A sliding-window layer may keep only its last `cap` positions, position j in row
    # j mod cap; or a prompt may pass a copy of a position range (base = its first position).
    # With a window of 72, the chunk of positions 128..159 is whole and its rows wrap (56..71,
    # 0..15): the kernels' whole-chunk path must not take them for rows one after another.
    rng = np.random.default_rng(1)
    hk, g, d = 2, 4, 64
    k = rng.standard_normal((hk, n, d)).astype(np.float16)
    v = rng.standard_normal((hk, n, d)).astype(np.float16)
    q = rng.standard_normal((1, hk, g, d)).astype(np.float32)
    ring_k, ring_v = np.zeros((hk, window, d), np.float16), np.zeros((hk, window, d), np.float16)
    for j in range(n):
        ring_k[:, j % window], ring_v[:, j % window] = k[:, j], v[:, j]
    p = n - 1
    want = attend(q, k, v, 0, p, window, 0.125, None)
    assert np.array_equal(attend(q, ring_k, ring_v, 0, p, window, 0.125, None), want)
    base = p - window + 1
    copy_k, copy_v = k[:, base:].copy(), v[:, base:].copy()
    assert np.array_equal(attend(q, copy_k, copy_v, base, p, window, 0.125, None), want)


def test_positions_the_rows_do_not_hold_are_refused():
    k = np.zeros((1, 8, 32), np.float32)
    q = np.zeros((4, 1, 1, 32), np.float32)
    with pytest.raises(ValueError, match="not all held"):
        attend(q, k, k, 0, 6, 0, 1.0, None)  # positions 0..9 in 8 rows
    with pytest.raises(ValueError, match="not all held"):
        attend(q[:1], k, k, 3, 9, 0, 1.0, None)  # position 0 is before the rows' first (3)


def test_exp_is_within_two_ulp_and_exact_where_it_matters():
    x = np.linspace(-87, 88, 400_001, dtype=np.float32)
    got = exp32(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert float(np.max(np.abs(got - want) / ulp)) <= 2.0
    special = exp32(np.array([0.0, -np.inf, -200.0, np.nan], np.float32))
    assert special[0] == 1.0  # the largest score's weight
    assert 0 <= special[1] < 1e-37 and 0 <= special[2] < 1e-37
    assert np.isnan(special[3])


def test_half_to_float_is_exact_for_every_f16():
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = np.empty(bits.size, np.float32)
    _half_row(bits, got)
    nan = np.isnan(want)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])  # signed zeros, subnormals, infinities
    assert np.isnan(got[nan]).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
def test_values_as_the_first_columns_of_the_keys_equal_a_copy_of_them(dtype):
    """deepseek2's latent head: `v` an int r reads each key's first r columns as its value."""
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 80, 96)).astype(dtype)
    q = rng.standard_normal((30, 1, 4, 96)).astype(np.float32)
    copy = np.ascontiguousarray(k[:, :, :64])
    for start, t in ((20, 30), (49, 1)):
        got = attend(q[:t], k, 64, 0, start, 0, 0.1, None)
        assert got.shape == (t, 1, 4, 64) and np.array_equal(got, attend(q[:t], k, copy, 0, start, 0, 0.1, None))
    with pytest.raises(ValueError, match="value columns"):
        attend(q, k, 97, 0, 20, 0, 0.1, None)
