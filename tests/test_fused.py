"""shared/model/fused.py: each fused loop computes what its numpy expression computes, bit for
bit, one row (a decode step) or a prompt's many (PARALLEL_ROWS and more, on numba's threads)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.model.attend import exp32
from moe_pipe.shared.model.fused import PARALLEL_ROWS, choice_sum, swiglu

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
