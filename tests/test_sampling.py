"""Sampling: greedy, truncation rules, penalty, seeds, bad values."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.text.sampling import Sampler, SamplingParams, penalize_repeats, ranked_prefix, truncate


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


# -- the ranked draw: what a full sort gives, without sorting the vocabulary -------------


def sorted_truncate(z, top_k, top_p, min_p):
    """The definition: the whole vocabulary sorted best first (ties to the lower id), then
    top-k, top-p (normalized over what top-k kept), min-p."""
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
        order, probs = order[:cut], probs[:cut]
    if min_p > 0.0:
        order = order[probs >= min_p * probs[0]]
    return order


def sorted_draw(z, params, rng):
    keep = sorted_truncate(z, params.top_k, params.top_p, params.min_p)
    zk = z[keep] / params.temperature
    probs = np.exp(zk - zk.max())
    probs /= probs.sum()
    return int(keep[rng.choice(keep.size, p=probs)])


def vocab(rng, size=20_000, ties=False):
    if ties:  # few distinct values: many ties at every boundary
        return rng.integers(-40, 8, size).astype(np.float64) / 4
    return rng.standard_normal(size) * rng.uniform(0.5, 6)


@pytest.mark.parametrize("ties", [False, True])
def test_ranked_prefix_is_the_stable_sorts_first_ids(ties):
    rng = np.random.default_rng(1)
    for _ in range(20):
        z = vocab(rng, 3000, ties)
        z[rng.integers(0, z.size, 50)] = -np.inf  # a grammar's masked ids
        full = np.argsort(-z, kind="stable")
        for n in (1, 7, 256, 2999, 3000, 5000):
            assert ranked_prefix(z, n).tolist() == full[:n].tolist()


@pytest.mark.parametrize("ties", [False, True])
def test_truncation_keeps_what_the_full_sort_keeps(ties):
    rng = np.random.default_rng(2)
    settings = [(40, 1.0, 0.0), (40, 0.95, 0.05), (0, 0.95, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.05), (0, 0.9, 0.1), (3, 1.0, 0.0)]
    for _ in range(30):
        z = vocab(rng, ties=ties)
        for top_k, top_p, min_p in settings:
            assert truncate(z, top_k, top_p, min_p).tolist() == sorted_truncate(z, top_k, top_p, min_p).tolist()
    assert truncate(vocab(rng), 0, 1.0, 0.0) is None  # nothing cut: the draw ranks what it needs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    ],
)
def test_seeded_draws_are_the_full_sorts_draws(params):
    """The same seed draws the same ids as sorting the whole vocabulary did, flat and peaked
    distributions alike (a flat one needs thousands of ranked ids)."""
    rng = np.random.default_rng(3)
    for seed in range(40):
        z = vocab(rng) * (0.2 if seed % 4 == 0 else 1)
        sampler, want_rng = Sampler(SamplingParams(**{**params.__dict__, "seed": seed})), np.random.default_rng(seed)
        for _ in range(3):
            assert sampler(z) == sorted_draw(z, params, want_rng)
