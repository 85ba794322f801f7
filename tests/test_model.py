"""Forward passes on made models of every architecture: finite, batch-consistent,
KV-cache-consistent, routed as asked (llama.cpp's agreement on them:
tests/test_families_oracle.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.levers import Levers
from moe_pipe.shared.model.load import ModelOptions, load_model
from moe_pipe.shared.model.moe import softmax_then_top_k, top_k_then_softmax
from moe_pipe.shared.model.weights import FileExperts

ARCHES = ["qwen3moe", "gpt-oss", "gemma4"]
PROMPT = [1, 5, 9, 20, 33, 70, 100, 200, 7, 300, 11]


@pytest.fixture(scope="module", params=ARCHES)
def tiny(request, tmp_path_factory):
    path = make_model(request.param, "tiny", tmp_path_factory.mktemp("m") / f"{request.param}.gguf")
    with open_model(path) as mf:
        yield load_model(mf)


def test_prefill_batches_equal_one_token_at_a_time(tiny):
    a = tiny.new_cache(64)
    whole = tiny.forward(PROMPT, a, all_logits=True)  # [T, V]
    assert whole.shape == (len(PROMPT), tiny.spec.n_vocab) and np.isfinite(whole).all()
    b = tiny.new_cache(64)
    steps = np.stack([tiny.decode_one(t, b) for t in PROMPT])

    # Tolerance: a one-token product on the integer types multiplies on
    # int8-rounded activations (x̂ = dx·int8 per block of 32, |x − x̂| ≤
    # amax/254, ~0.5 % relative per product; docs/kernels.md), while multi-token
    # prefill products keep float32 — as in llama.cpp, the two paths
    # legitimately differ by that rounding. Measured on these 4-layer models:
    # 1.5–7 % relative (L2) per logits row, median 2–3 %, and up to ~0.3 on a
    # row where a top-k routing near-tie flips an expert. A batching,
    # position or KV-cache bug moves rows by O(1) (decoding one position
    # late: ≥ 0.72 on every row). Hence median row ≤ 5e-2, every row ≤ 0.4.
    # (With quant.set_int8_activations(False) they agree to rtol 2e-4.)
    def rel(a, b):
        return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)

    r = rel(steps, whole)
    assert np.median(r) <= 5e-2 and r.max() <= 0.4, r
    c = tiny.new_cache(64)
    assert rel(tiny.prefill(PROMPT, c, batch=3), whole[-1]) <= 0.4
    assert a.n == b.n == c.n == len(PROMPT)


def test_deterministic(tiny):
    x = tiny.forward(PROMPT, tiny.new_cache(32))
    y = tiny.forward(PROMPT, tiny.new_cache(32))
    assert np.array_equal(x, y)


def test_top_k_override_changes_output(tiny):
    fewer = load_model(tiny.mf, top_k=1)
    assert fewer.top_k == 1
    assert not np.allclose(fewer.forward(PROMPT, fewer.new_cache(32)), tiny.forward(PROMPT, tiny.new_cache(32)))
    with pytest.raises(UserError):
        load_model(tiny.mf, top_k=tiny.spec.n_expert + 1)


def test_caching_source_options_change_nothing_on_the_file_mapping(tiny):
    """Prefetch and the lossy levers act through the source: the file mapping
    has every expert resident and nothing to read ahead, so the outputs are
    the exact ones (a source answering "not resident" would let drop_cold cut experts)."""
    lossy = ModelOptions(prefetch_next=True, levers=Levers(drop_cold=0.99, cache_route=0.9))
    model = load_model(tiny.mf, options=lossy)
    a, b = model.new_cache(32), tiny.new_cache(32)
    model.prefill(PROMPT, a), tiny.prefill(PROMPT, b)
    for t in (3, 50, 7):
        assert np.array_equal(model.decode_one(t, a), tiny.decode_one(t, b))


def test_options_reach_the_source_and_the_observer(tiny):
    """prefetch_next: while decoding, every layer but the last tells the source
    its guess at the next layer's experts (never during a prompt batch), and
    route_observer sees every layer's routing."""
    hints: list[tuple[int, list[int]]] = []
    routed: list[tuple[int, tuple[int, ...]]] = []

    class Hinted(FileExperts):
        def prefetch(self, layer, ids):
            hints.append((layer, list(ids)))

    def observe(layer, routing):
        routed.append((layer, routing.ids.shape))

    n, k = tiny.spec.n_layer, tiny.spec.n_expert_used
    for on in (False, True):
        hints.clear(), routed.clear()
        model = load_model(tiny.mf, experts=Hinted(tiny.mf), options=ModelOptions(prefetch_next=on, route_observer=observe))
        cache = model.new_cache(32)
        model.prefill(PROMPT, cache)
        assert hints == [] and routed == [(i, (len(PROMPT), k)) for i in range(n)]
        routed.clear()
        model.decode_one(5, cache)
        assert routed == [(i, (1, k)) for i in range(n)]
        assert [layer for layer, _ in hints] == (list(range(n)) if on else [])  # layer 0 from the embedding, first
        assert all(len(ids) <= k and all(0 <= e < tiny.spec.n_expert for e in ids) for _, ids in hints)


def _prompt_guessing_model(tiny):
    """The tiny model with prompt prefetch on: (model, the guesses its source is told as
    (layer, ids), each layer's router input by layer)."""
    hints: list[tuple[int, list[int]]] = []
    inputs: dict[int, np.ndarray] = {}

    class Hinted(FileExperts):
        def prefetch(self, layer, ids):
            hints.append((layer, list(ids)))

    opts = ModelOptions(prefetch_prompt=True, router_input_observer=lambda i, r: inputs.__setitem__(i, r.copy()))
    return load_model(tiny.mf, experts=Hinted(tiny.mf), options=opts), hints, inputs


def test_prompt_guesses_are_the_union_of_the_batch_rows(tiny):
    """prefetch_prompt: while a prompt's batch runs, layer i tells the source
    its guess at layer i+1: router i+1 on layer i's router input, every row's
    top k of p >= PREFETCH_MIN_P, the union, the most probable first; and
    nothing while decoding unless prefetch_next."""
    from moe_pipe.shared.model.base import PREFETCH_MIN_P

    model, hints, inputs = _prompt_guessing_model(tiny)
    cache = model.new_cache(32)
    model.prefill(PROMPT, cache)
    n = model.spec.n_layer
    assert [layer for layer, _ in hints] == list(range(1, n))
    for layer, ids in hints:
        logits = model.router_logits(layer, inputs[layer - 1]).astype(np.float64)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        best: dict[int, float] = {}
        for row in range(len(PROMPT)):
            for e in np.argsort(-logits[row], kind="stable")[: model.top_k]:
                if p[row, e] >= PREFETCH_MIN_P:
                    best[int(e)] = max(best.get(int(e), 0.0), p[row, e])
        assert ids == sorted(best, key=best.__getitem__, reverse=True)
        assert len(ids) > model.top_k  # a batch's union is wider than one token's guess
    hints.clear()
    model.decode_one(5, cache)
    assert hints == []


def test_a_long_prompt_guesses_from_evenly_spaced_rows(tiny, monkeypatch):
    """A batch longer than GUESS_ROWS guesses the next layer from that many of its rows,
    evenly spaced (the first among them): the guess is what those rows alone would give."""
    from moe_pipe.shared.model import base

    monkeypatch.setattr(base, "GUESS_ROWS", 3)
    model, hints, inputs = _prompt_guessing_model(tiny)
    model.prefill(PROMPT, model.new_cache(32))
    assert len(PROMPT) > 3 and hints
    step = -(-len(PROMPT) // 3)
    guessed = list(hints)
    hints.clear()
    monkeypatch.setattr(base, "GUESS_ROWS", 10**6)
    for layer, _ in guessed:
        model.guess_layer(layer, inputs[layer - 1][::step])  # those rows alone, every one of them used
    assert hints == guessed


def test_layer0_guess_is_router0_on_the_token_embedding(tiny):
    """Decoding with prefetch on, layer 0 is guessed before anything runs: its
    router on the new token's embedding, normed as layer 0's router input is
    (the arch's own norm), its top k of p >= PREFETCH_MIN_P."""
    from moe_pipe.shared.model.base import PREFETCH_MIN_P
    from moe_pipe.shared.model.blocks import rms_norm

    hints: list[tuple[int, list[int]]] = []

    class Hinted(FileExperts):
        def prefetch(self, layer, ids):
            hints.append((layer, list(ids)))

    model = load_model(tiny.mf, experts=Hinted(tiny.mf), options=ModelOptions(prefetch_next=True))
    cache = model.new_cache(32)
    model.prefill(PROMPT, cache)
    L0, eps = model.layers[0], model.spec.rms_eps
    guessed = 0
    for token in (5, 321, 1000):
        hints.clear()
        model.decode_one(token, cache)
        x = model.embd.rows(np.array([token])).astype(np.float64)
        if model.arch == "gemma4":  # the router's own scale on the plain RMS norm
            r = rms_norm(x.astype(np.float32), None, eps) * L0["router_in_scale"] * model.router_scale
        else:  # the pre-FFN norm
            r = rms_norm(x.astype(np.float32), L0["ffn_norm"], eps)
        logits = L0["router"](r)[0].astype(np.float64) + (L0["router_b"] if "router_b" in L0 else 0.0)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-logits, kind="stable")[: model.top_k]
        assert hints[0] == (0, [int(e) for e in top if p[e] >= PREFETCH_MIN_P])
        assert [layer for layer, _ in hints] == list(range(model.spec.n_layer))
        guessed += len(hints[0][1])
    assert guessed > 0


def test_context_overflow_is_an_error(tiny):
    cache = tiny.new_cache(4)
    with pytest.raises(ValueError, match="context full"):
        tiny.forward(PROMPT, cache)


def test_routing_rules():
    logits = np.array([[0.0, 2.0, 1.0, -1.0]], np.float32)
    r = softmax_then_top_k(logits, 2)
    assert r.ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(r.weights, [[np.e / (np.e + 1), 1 / (np.e + 1)]], rtol=1e-6)
    g = top_k_then_softmax(logits, 2)
    assert g.ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(g.weights.sum(), 1.0, rtol=1e-6)
    p = np.exp(logits) / np.exp(logits).sum()
    un = softmax_then_top_k(logits, 2, renormalize=False)
    np.testing.assert_allclose(un.weights, p[:, [1, 2]], rtol=1e-6)


def test_group_limited_routing_scores_groups_by_the_rule_given():
    """Two groups of 3: group 0 has the single best expert, group 1 the best pair.
    V2's rule (a group's best) keeps group 0, V3's (its top-2 sum) group 1."""
    from moe_pipe.shared.model.moe import gated_group_top_k

    p = np.array([[0.5, 0.0, 0.0, 0.3, 0.3, 0.0]], np.float32)  # chosen on as given: sigmoid of a logit
    logits = np.log(p / (1 - p + 1e-12) + 1e-12).astype(np.float32)
    kw = dict(gating="sigmoid", n_group=2, topk_group=1, norm=False)
    assert gated_group_top_k(logits, 2, group_score="max", **kw).ids[0, 0] == 0
    assert sorted(gated_group_top_k(logits, 2, group_score="top2", **kw).ids[0].tolist()) == [3, 4]
    with pytest.raises(ValueError, match="group score"):
        gated_group_top_k(logits, 2, group_score="sum", **kw)


@pytest.mark.parametrize("arch", ARCHES)
def test_a_prompt_takes_its_resident_experts_in_grouped_kernel_calls(arch, tmp_path, monkeypatch):
    """A prompt's gated experts go through quant.grouped_apply, several a call: the ones in
    memory once all have come, then a miss together with the misses that have landed since
    (here all the rest: they land while the first miss is read). The logits are the
    one-expert-at-a-time path's bit for bit, and token-by-token decoding's."""
    from moe_pipe.shared import quant
    from moe_pipe.shared.model import moe

    path = make_model(arch, "tiny", tmp_path / "q.gguf")
    with open_model(path) as mf:

        class Landing(FileExperts):
            """Even experts in memory at once; odd ones read, every one landed once the first has."""

            def __init__(self, mf):
                super().__init__(mf)
                self.landed = False

            def resident(self, layer, ids):
                return [e % 2 == 0 or self.landed for e in ids]

            def experts(self, layer, ids):
                ids = list(ids)
                self.landed = False
                yield from super().experts(layer, [e for e in ids if e % 2 == 0])
                for e in (e for e in ids if e % 2):
                    yield next(super().experts(layer, [e]))
                    self.landed = True

        calls: list[int] = []
        real = quant.grouped_apply
        monkeypatch.setattr(quant, "grouped_apply", lambda *a, **kw: calls.append(len(a[0])) or real(*a, **kw))
        real_grouped = moe._hidden_of_run

        def prefill(grouped: bool, source=None) -> np.ndarray:
            monkeypatch.setattr(moe, "_hidden_of_run", real_grouped if grouped else lambda *a: None)  # None: one by one
            model = load_model(mf, experts=source)
            return model.forward(PROMPT, model.new_cache(32), all_logits=True)

        got = prefill(True)
        assert calls and len(calls) % 2 == 0  # per group: its gates and ups, then its downs
        np.testing.assert_array_equal(got, prefill(False))
        calls.clear()
        np.testing.assert_array_equal(prefill(True, Landing(mf)), got)
        n_moe = sum(1 for i in range(mf.spec.n_layer) if mf.spec.has_experts(i))
        assert len(calls) <= 2 * 3 * n_moe  # a layer: its hits, its first miss, the rest that landed (runs of GROUP_ROWS)
        model = load_model(mf)
        cache = model.new_cache(32)
        np.testing.assert_array_equal(np.concatenate([model.forward([t], cache) for t in PROMPT]), got)


@pytest.mark.parametrize("arch", ["gemma4", "glm4moe", "deepseek2"])
def test_a_large_chunk_sums_its_expert_outputs_a_part_of_the_columns_at_a_time(arch, tmp_path, monkeypatch):
    """A chunk whose expert outputs would be large keeps the experts' narrower hidden
    activations and takes the down projections a part of the output's columns at a time
    (shared/gguf/spec.py expert_output_parts): the logits are the whole path's bit for bit, on
    families whose experts are narrower than the model (F < D), with the misses landing late."""
    from moe_pipe.shared.gguf import spec
    from moe_pipe.shared.model import moe

    path = make_model(arch, "tiny", tmp_path / "q.gguf")
    prompt = [(7 * i + 3) % 200 + 5 for i in range(96)]
    with open_model(path) as mf:
        assert mf.spec.n_ff_exp < mf.spec.n_embd

        class Late(FileExperts):
            """Odd experts read: they land after the even ones have been worked on."""

            def resident(self, layer, ids):
                return [e % 2 == 0 for e in ids]

        whole = load_model(mf).forward(prompt, load_model(mf).new_cache(128), all_logits=True)
        parts_taken: list[int] = []
        real = moe._downs_in_parts
        monkeypatch.setattr(moe, "_downs_in_parts", lambda held, *a: parts_taken.append(len(held)) or real(held, *a))
        monkeypatch.setattr(spec, "SPLIT_OUTPUT_BYTES", 0)  # every chunk's outputs split
        for source in (None, Late(mf)):
            model = load_model(mf, experts=source)
            np.testing.assert_array_equal(model.forward(prompt, model.new_cache(128), all_logits=True), whole)
        n_moe = sum(1 for i in range(mf.spec.n_layer) if mf.spec.has_experts(i))
        assert len(parts_taken) == 2 * n_moe and min(parts_taken) >= 1


@pytest.mark.parametrize("arch", ARCHES)
def test_a_decode_step_takes_every_expert_of_a_layer_in_two_kernel_calls(arch, tmp_path, monkeypatch):
    """A decoded token's resident gated experts (SwiGLU, Gemma's GELU, gpt-oss's clamped SwiGLU
    with its biases) go through quant.gather_apply (gates and ups in one call, downs in another)
    and give the logits the one-matrix-at-a-time path gives, bit for bit."""
    from moe_pipe.shared import quant
    from moe_pipe.shared.model import moe

    path = make_model(arch, "tiny", tmp_path / "q.gguf")
    with open_model(path) as mf:
        model = load_model(mf)
        calls = []
        real = quant.gather_apply
        monkeypatch.setattr(quant, "gather_apply", lambda *a: calls.append(len(a[0])) or real(*a))

        def decode(fused: bool):
            if not fused:
                monkeypatch.setattr(moe, "_glu_experts_at_once", lambda x, experts, glu: None)
            cache = model.new_cache(32)
            model.prefill(PROMPT, cache)
            return np.stack([model.decode_one(t, cache) for t in (3, 4, 5)])

        got = decode(True)
        k = model.top_k
        assert calls and set(calls) <= {2 * k, k} and k in calls  # every gate and up (or fused gate_up) at once, then every down
        np.testing.assert_array_equal(got, decode(False))
