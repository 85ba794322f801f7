"""shared/model/fused.py: each fused loop computes what its numpy expression computes, bit for
bit, one row (a decode step) or a prompt's many (PARALLEL_ROWS and more, on numba's threads)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.model.attend import exp32
from moe_pipe.shared.model.fused import PARALLEL_ROWS, _rope_tokens, choice_sum, norm_rope, rms_norm, swiglu

ROWS = [1, 8, PARALLEL_ROWS + 3]  # a decode step's row, its experts' rows, a prompt chunk's


@pytest.mark.parametrize("rows", ROWS)
def test_swiglu_is_silu_times_up_element_for_element(rows):
    rng = np.random.default_rng(rows)
    g = (rng.standard_normal((rows, 200)) * 30).astype(np.float32)
    u = rng.standard_normal((rows, 200)).astype(np.float32)
    g[0, :8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -200.0, 200.0]  # exp's ends and the specials
    with np.errstate(all="ignore"):
        want = g / (np.float32(1.0) + exp32(-g)) * u
    assert np.array_equal(swiglu(g, u).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("rows", ROWS)
def test_choice_sum_adds_each_rounded_product_in_choice_order(rows):
    rng = np.random.default_rng(rows)
    k = 8
    ys = rng.standard_normal((rows * k, 96)).astype(np.float32)
    at = rng.permutation(rows * k).reshape(rows, k)
    w = rng.random((rows, k)).astype(np.float32)
    want = ys[at[:, 0]] * w[:, :1]
    for s in range(1, k):
        want += ys[at[:, s]] * w[:, s : s + 1]
    assert np.array_equal(choice_sum(ys, at, w), want)


def _rotate_numpy(x, cos, sin, half):
    """RoPE's NEOX pairs (i, i + half) as numpy computes them: a·c − b·s and b·c + a·s, each rounded."""
    a, b = x[..., :half], x[..., half : 2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    out[..., :half], out[..., half : 2 * half] = a * c - b * s, b * c + a * s
    return out


@pytest.mark.parametrize("rows", ROWS)
def test_norm_rope_is_the_norm_then_the_rotation(rows):
    """norm_rope (qwen3moe's q and k) equals rms_norm then the rotation bit for bit, into a new
    array or in place; 96 of 128 dims rotated (the rest pass through)."""
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 5, 128)) * 3).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    angles = np.arange(rows, dtype=np.float32)[:, None] * np.geomspace(1, 1e-4, 48, dtype=np.float32)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    want = _rotate_numpy(rms_norm(x, w, 1e-6), cos, sin, 48)
    assert np.array_equal(norm_rope(x, w, 1e-6, cos, sin, 48).view(np.uint32), want.view(np.uint32))
    y = x.copy()
    assert np.array_equal(norm_rope(y, w, 1e-6, cos, sin, 48, out=y).view(np.uint32), want.view(np.uint32))
    rotated = rms_norm(x, w, 1e-6)
    _rope_tokens(rotated, cos, sin, 48)  # the one-thread loop Rope.apply takes below PARALLEL_ROWS
    assert np.array_equal(rotated.view(np.uint32), want.view(np.uint32))
