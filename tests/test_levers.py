"""The lossy levers: exact when off, and doing what they say when on (route-ahead too)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from moe_pipe.shared.family_registry import ARCHES
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.base import ModelOptions
from moe_pipe.shared.model.levers import Levers, apply_levers, drop_cold, prefer_cached
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.model.moe import Routing
from moe_pipe.shared.model.session import Session
from moe_pipe.shared.model.weights import FileExperts
from moe_pipe.shared.text.generate import GenerationConfig, generate
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.speculate import ReplayDrafter
from moe_pipe.shared.text.tokenizer import Tokenizer


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


# -- route-ahead -----------------------------------------------------------------------

ROUTE_AHEAD_DEFAULT_TIER = ("qwen3moe", "gemma4", "glm4moe", "deepseek4")
PROMPT_IDS = [3, 17, 5, 60, 9, 41, 2, 8]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ahead")
    made: dict = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_model(arch, "tiny", folder / f"{arch}.gguf")
        return made[arch]

    return get


class Watched:
    """A resident model of `path` whose routings, router inputs and prefetches are recorded."""

    def __init__(self, mf, route_ahead: bool):
        self.routes: list[tuple[int, Routing]] = []
        self.inputs: dict[int, np.ndarray] = {}
        self.hints: dict[int, list[int]] = {}
        watched = self

        class Hinted(FileExperts):
            def prefetch(self, layer, ids):
                watched.hints[layer] = list(ids)

        def observe_input(i, x):
            self.inputs[i] = x.copy()

        options = ModelOptions(
            prefetch_next=True,
            levers=Levers(route_ahead=route_ahead),
            route_observer=lambda i, r: self.routes.append((i, r)),
            router_input_observer=observe_input,
        )
        self.model = load_model(mf, experts=Hinted(mf), options=options)

    def clear(self):
        self.routes.clear(), self.inputs.clear(), self.hints.clear()


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in ROUTE_AHEAD_DEFAULT_TIER else [pytest.mark.slow]) for a in ARCHES])
def test_route_ahead_routes_a_decode_step_on_the_previous_layers_router_input(tiny_files, arch):
    """A prompt routes exactly; in a decode step each layer that follows a routed or dense
    layer routes by its own rule on its router applied to that layer's router input, and
    the source is told exactly those experts a layer early. The first routed layer (and
    deepseek4's hash layers) route as the exact model does."""
    with open_model(tiny_files(arch)) as mf:
        ahead, exact = Watched(mf, True), Watched(mf, False)
        ca, ce = ahead.model.new_cache(64), exact.model.new_cache(64)
        ahead.model.forward(np.array(PROMPT_IDS), ca), exact.model.forward(np.array(PROMPT_IDS), ce)
        assert len(ahead.routes) == len(exact.routes) > 0
        for (i, a), (j, e) in zip(ahead.routes, exact.routes):  # the prompt: exact
            assert i == j and np.array_equal(a.ids, e.ids) and np.array_equal(a.weights, e.weights)
        ahead.clear()
        ahead.model.forward(np.array([11]), ca, decoding=True)
        m, used = ahead.model, 0
        for i, got in ahead.routes:
            early = i - 1 in ahead.inputs and m.routes_by_scores(i)
            want = m.route(i, m.router_logits(i, ahead.inputs[i - 1] if early else ahead.inputs[i]))
            assert np.array_equal(got.ids, want.ids) and np.array_equal(got.weights, want.weights), i
            if early:
                used += 1
                assert sorted(ahead.hints[i]) == sorted(set(want.ids.reshape(-1).tolist())), i
        assert used >= 1


def test_route_ahead_changes_the_output_and_off_is_exact(tiny_files):
    with open_model(tiny_files("qwen3moe")) as mf:
        outs = {}
        for on in (False, True, None):
            model = load_model(mf, options=ModelOptions(levers=Levers(route_ahead=bool(on))) if on is not None else None)
            cache = model.new_cache(64)
            model.forward(np.array(PROMPT_IDS), cache)
            outs[on] = [model.decode_one(t, cache) for t in (4, 50, 7)]
        for a, b in zip(outs[False], outs[None]):
            assert np.array_equal(a, b)
        assert not all(np.array_equal(a, b) for a, b in zip(outs[True], outs[None]))


@pytest.mark.parametrize("arch", ["qwen3moe", pytest.param("qwen35moe", marks=pytest.mark.slow)])
def test_speculative_decoding_with_route_ahead_gives_its_plain_output(tiny_files, arch):
    """A verify pass routes each row ahead as its decode step would (the router is batch-exact),
    so drafts, kept or not, leave route-ahead's own greedy output unchanged."""
    with open_model(tiny_files(arch)) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        prompt = tok.encode("Once upon a time, there was a little fox who liked to run.")

        def run(drafter=None, width=0):
            model = load_model(mf, options=ModelOptions(levers=Levers(route_ahead=True)))
            cfg = GenerationConfig(max_tokens=16, ignore_eos=True, draft=width, draft_adapt=False, n_ctx=256)
            g = generate(model, tok, prompt, SamplingParams(), cfg, session=Session(), drafter=drafter)
            return g.tokens, g.timings

        plain, _ = run()
        got, timings = run(ReplayDrafter(plain, 0.6, seed=1), 3)
        assert got == plain and 0 < timings["draft_accepted"] < timings["draft_n"]


@pytest.mark.integration
def test_route_ahead_streamed_gives_the_resident_tokens():
    """Route-ahead depends on nothing the cache holds, so the pipeline with a small cache
    gives what every weight in memory gives; and it is not the exact output."""
    streamed = _run("--route-ahead")
    assert streamed["tokens"] == _run("--no-stream", "--route-ahead")["tokens"]
    assert streamed["tokens"] != _run("--no-stream")["tokens"]
