"""Sampling: greedy, truncation rules, penalty, seeds, bad values."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.text.sampling import Sampler, SamplingParams, penalize_repeats, truncate


def test_greedy_is_argmax_and_lowest_id_on_ties():
    z = np.array([0.1, 3.0, 3.0, -1.0])
    assert Sampler(SamplingParams())(z) == 1


def test_top_k_top_p_min_p():
    z = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert truncate(z, 2, 1.0, 0.0).tolist() == [0, 1]
    assert truncate(z, 0, 0.6, 0.0).tolist() == [0, 1]  # 0.5 < 0.6 ≤ 0.7
    assert truncate(z, 0, 0.5, 0.0).tolist() == [0]
    assert truncate(z, 0, 1.0, 0.25).tolist() == [0, 1, 2]  # ≥ 0.125
    assert truncate(z, 4, 0.9, 0.35).tolist() == [0, 1]


def test_seeded_sampling_is_reproducible_and_follows_distribution():
    z = np.log(np.array([0.6, 0.3, 0.1]))
    p = SamplingParams(temperature=1.0, seed=7)
    a = [Sampler(p)(z) for _ in range(3)]
    s1, s2 = Sampler(p), Sampler(p)
    draws1 = [s1(z) for _ in range(2000)]
    assert draws1 == [s2(z) for _ in range(2000)]
    freq = np.bincount(draws1, minlength=3) / 2000
    assert np.allclose(freq, [0.6, 0.3, 0.1], atol=0.04)
    assert len(set(a)) == 1  # a fresh sampler with the same seed starts the same way


def test_low_temperature_concentrates():
    z = np.array([1.0, 0.9, 0.0])
    s = Sampler(SamplingParams(temperature=0.01, seed=1))
    assert all(s(z) == 0 for _ in range(200))


def test_repeat_penalty():
    z = np.array([2.0, -1.0, 0.5])
    out = penalize_repeats(z, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5]
    s = Sampler(SamplingParams(repeat_penalty=10.0))
    assert s(np.array([2.0, 1.5]), history=[0]) == 1


@pytest.mark.parametrize(
    "kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=1.0), dict(top_k=-2), dict(repeat_penalty=0)]
)
def test_bad_values_are_user_errors(kw):
    with pytest.raises(UserError):
        SamplingParams(**kw)
