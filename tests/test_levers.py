"""The lossy levers: exact when off, and doing what they say when on."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from moe_pipe.shared.model.levers import Levers, apply_levers, drop_cold, prefer_cached
from moe_pipe.shared.model.moe import Routing


def routing(ids, w):
    return Routing(np.asarray([ids], np.int64), np.asarray([w], np.float32))


def cached_set(*keep):
    return lambda ids: [e in keep for e in ids]


def test_off_is_the_identity():
    r = routing([3, 1], [0.7, 0.3])
    scores = np.zeros(8, np.float32)
    assert apply_levers(Levers(), r, scores, cached_set()) is r
    assert apply_levers(Levers(0.5, 0.5), r, scores, None) is r  # nothing known about the cache: exact
    batch = Routing(np.array([[3, 1], [2, 1]]), np.ones((2, 2), np.float32))
    assert apply_levers(Levers(0.5, 0.5), batch, np.zeros((2, 8)), cached_set()) is batch  # prompts stay exact


def test_drop_cold_drops_only_cold_light_experts_and_keeps_the_sum():
    r = routing([0, 1, 2, 3], [0.5, 0.3, 0.15, 0.05])  # even share 0.25
    out = drop_cold(r, cached_set(0, 3), 0.8)  # below 0.2: experts 2 and 3; 3 is cached → kept
    assert out.ids[0].tolist() == [0, 1, 3]
    assert out.weights.sum() == pytest.approx(1.0)
    assert out.weights[0].tolist() == pytest.approx([0.5 / 0.85, 0.3 / 0.85, 0.05 / 0.85])
    assert drop_cold(r, cached_set(), 0.0).ids[0].tolist() == [0, 1, 2, 3]
    assert drop_cold(routing([5, 6], [0.5, 0.5]), cached_set(), 1.0 + 1e-6).ids[0].tolist() == [5]  # never all


def test_cache_route_swaps_a_miss_for_a_cached_near_tie_only():
    p = np.array([0.30, 0.26, 0.25, 0.10, 0.09], np.float64)
    scores = np.log(p).astype(np.float32)
    r = routing([0, 1], [0.54, 0.46])
    # expert 1 is missing; 2 is cached with probability 0.25 ≥ (1 - 0.1) × 0.26
    out = prefer_cached(r, scores, cached_set(0, 2), 0.1)
    assert out.ids[0].tolist() == [0, 2] and out.weights is r.weights
    # a margin too small for the gap: unchanged
    assert prefer_cached(r, scores, cached_set(0, 2), 0.01).ids[0].tolist() == [0, 1]
    # 4 is cached but far: no swap
    assert prefer_cached(r, scores, cached_set(0, 4), 0.1).ids[0].tolist() == [0, 1]
    assert math.log1p(-0.1) < 0


CLI = [sys.executable, "-m", "moe_pipe.cli.main", "run"]


def _run(*extra):
    r = subprocess.run(
        [
            *CLI,
            "configs/tiny.toml",
            "-p",
            "The old mill by the river",
            "-n",
            "24",
            "--ignore-eos",
            "--output-format",
            "json",
            "--cache-mb",
            "1.2",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.integration
@pytest.mark.slow  # ~14 s; the levers are lossy and off by default
def test_levers_in_the_pipeline_raise_the_hit_rate_and_zero_is_exact():
    exact = _run()
    assert _run("--drop-cold-experts", "0", "--cache-route", "0")["tokens"] == exact["tokens"]
    ref = _run("--no-stream")
    assert ref["tokens"] == exact["tokens"]
    lossy = _run("--drop-cold-experts", "1.0", "--cache-route", "0.5")
    assert lossy["timings"]["final_hit_pct"] > exact["timings"]["final_hit_pct"]
