"""Batched passes over several sequences (shared/model/batch.py): every sequence's
greedy tokens, and the logits each was chosen from, are bit for bit what it gives
decoded alone, on every family, while others with other prompts and lengths join
and leave the batch and a prompt is read in chunks beside the decode rows; each
routed expert is asked for once a layer for all its rows; the hooks see every row.

CI time: a sliding-window family (its rings wrapping), a recurrent one and deepseek2's
MLA, quantized weights with an f16 KV cache, in the default tier; DeepSeek V4 and the
rest, every family on f32 weights and KV and every KV type behind -m slow."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moe_pipe.shared import quant
from moe_pipe.shared.family_registry import ARCHES
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.spec import RopeSpec
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.base import ModelOptions
from moe_pipe.shared.model.batch import BatchCache, BatchPart, Request, decode_together
from moe_pipe.shared.model.blocks import KVCache, rope_from_spec
from moe_pipe.shared.model.load import load_model

FAMILIES = ARCHES  # every family's GGUF arch (shared/family_registry.py)
DEFAULT_TIER = ("gemma4", "qwen35moe", "deepseek2")  # rings, recurrent state, latent attention; the rest behind -m slow
N_CTX = 512
CHUNK = 24
# A small prompt block makes a sliding layer's ring W - 1 + 16 rows, so the longer
# sequences here wrap it (the tiny models' window is 128).
PROMPT_BLOCK = 16


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    made: dict = {}

    def get(arch, quant=None):
        if (arch, quant) not in made:
            made[arch, quant] = make_model(arch, "tiny", folder / f"{arch}-{quant or 'mix'}.gguf", quant=quant)
        return made[arch, quant]

    return get


def loaded(mf, kv: str, **options):
    """The model, its caches rings of a small prompt block (see PROMPT_BLOCK)."""
    model = load_model(mf, options=ModelOptions(kv_type=kv, **options))
    plain = model.new_cache

    def new_cache(n_ctx, kv_type=None):
        cache = plain(n_ctx, kv_type)
        if any(cache.windows):
            small = KVCache.for_spec(model.spec, n_ctx, kv_type or model.kv_type, prompt_block=PROMPT_BLOCK)
            small.state = cache.state
            return small
        return cache

    model.new_cache = new_cache
    return model


def requests(n_vocab: int, long: int) -> list[Request]:
    """Different prompts and lengths, arriving at different passes, so sequences join a
    running batch and leave it while others go on; one prompt is read in several chunks
    beside the decode rows; the longest runs past a sliding layer's ring."""
    rng = np.random.default_rng(5)
    shapes = [(7, 12, 0), (long, 10, 0), (1, 24, 2), (40, 6, 3), (3, long, 9)]  # (prompt, max_tokens, arrive)
    return [Request(rng.integers(0, n_vocab, p).tolist(), m, a) for p, m, a in shapes]


def alone(model, r: Request) -> tuple[list[int], list[np.ndarray]]:
    """The request decoded by itself: prefill in CHUNK batches, then one decode step a token."""
    cache = model.new_cache(N_CTX)
    logits = [model.prefill(r.prompt, cache, batch=CHUNK)]
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < r.max_tokens:
        logits.append(model.decode_one(tokens[-1], cache))
        tokens.append(int(np.argmax(logits[-1])))
    return tokens, logits


def check_batched_is_alone(path, kv: str, long: int = 60, layers: int | None = None) -> None:
    with open_model(path) as mf:
        model = loaded(mf, kv)
        reqs = requests(model.spec.n_vocab, long)
        together = decode_together(model, reqs, N_CTX, chunk=CHUNK, keep_logits=True, layers=layers)
        assert max(len(set(g.passes) & set(h.passes)) for g, h in itertools.combinations(together, 2)) > 5  # they did share passes
        for r, got in zip(reqs, together):
            tokens, logits = alone(model, r)
            assert got.tokens == tokens
            assert len(got.logits) == len(logits)
            for a, b in zip(got.logits, logits):
                assert np.array_equal(a, b)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in DEFAULT_TIER else [pytest.mark.slow]) for a in FAMILIES])
def test_batched_greedy_decoding_is_decoding_alone(tiny_files, arch):
    """Quantized weights (the maker's mix), an f16 KV cache."""
    check_batched_is_alone(tiny_files(arch), "f16", long=200 if arch in ("gemma4", "gpt-oss") else 60)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in DEFAULT_TIER else [pytest.mark.slow]) for a in FAMILIES])
def test_a_prompt_sliced_by_layers_beside_decode_rows_is_its_prompt_alone(tiny_files, arch):
    """Each prompt chunk goes through one layer a pass (PromptSlice) while the others decode:
    every token and logits row is still the request's alone (its rings wrapping, its recurrent
    state folding the chunk layer by layer)."""
    check_batched_is_alone(tiny_files(arch), "f16", long=200 if arch in ("gemma4", "gpt-oss") else 60, layers=1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_prompt_sliced_by_layers_on_f32_weights_and_every_kv_type(tiny_files, arch):
    for kv in ("f32", "q8_0"):
        check_batched_is_alone(tiny_files(arch, "F32" if kv == "f32" else None), kv, layers=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_decoding_on_f32_weights_and_kv(tiny_files, arch):
    check_batched_is_alone(tiny_files(arch, "F32"), "f32", long=200 if arch in ("gemma4", "gpt-oss") else 60)


@pytest.mark.slow
@pytest.mark.parametrize("arch,kv", list(itertools.product(FAMILIES, ("f32", "q8_0"))))
def test_batched_decoding_on_every_kv_type(tiny_files, arch, kv):
    """q8_0 too: a sequence's rows attend by themselves, as its own pass would have them."""
    check_batched_is_alone(tiny_files(arch), kv)


def test_each_expert_is_asked_for_once_a_layer_for_all_its_rows(tiny_files):
    """Three decode rows and a prompt's chunk in one pass: every layer asks its source once
    for the union of the rows' experts, the route observer and the layer observer see every row."""
    routes: list[tuple[int, np.ndarray]] = []
    layers: list[tuple[int, int]] = []
    options = dict(route_observer=lambda i, r: routes.append((i, r.ids)), layer_observer=lambda i, t: layers.append((i, t)))
    with open_model(tiny_files("qwen3moe")) as mf:
        model = loaded(mf, "f32", **options)
        asked: list[tuple[int, list[int]]] = []
        experts = model.source.experts

        def counted(layer, ids):
            ids = list(ids)
            asked.append((layer, ids))
            return experts(layer, ids)

        model.source.experts = counted
        caches = [model.new_cache(N_CTX) for _ in range(4)]
        for c, p in zip(caches[:3], ([1, 2, 3], [4], [5, 6, 7, 8, 9])):
            model.prefill(p, c)
        for seen in (routes, asked, layers):
            seen.clear()
        out = model.forward_batch(
            [BatchPart([11], caches[0]), BatchPart([12], caches[1]), BatchPart([13], caches[2]), BatchPart([7] * 9, caches[3])]
        )
    assert [o.shape[0] for o in out] == [1, 1, 1, 1]
    assert [c.n for c in caches] == [4, 2, 6, 9]
    n = model.spec.n_layer
    assert layers == [(i, 12) for i in range(n)]
    assert [i for i, _ in routes] == list(range(n)) and all(ids.shape == (12, model.top_k) for _, ids in routes)
    assert [i for i, _ in asked] == list(range(n))
    for (_, ids), (_, want) in zip(asked, routes):
        assert len(ids) == len(set(ids)) and set(ids) == set(want.reshape(-1).tolist())


def test_decode_rows_whose_experts_come_late_are_each_row_alone(tiny_files, monkeypatch):
    """A pass of four decode rows whose experts come partly as a cache's misses do (not in
    memory, given after the others, as the slab cache gives one once its read lands): the
    rows' experts in memory go together, two kernel calls a layer with a row per (expert,
    row), each late one on its own rows as it comes; every row's logits are its decode step's
    alone, bit for bit."""
    with open_model(tiny_files("qwen3moe")) as mf:
        model = loaded(mf, "f16")
        late = lambda layer, e: (layer + e) % 3 == 0  # noqa: E731
        given = model.source.experts
        model.source.resident = lambda layer, ids: [not late(layer, e) for e in ids]
        model.source.experts = lambda layer, ids: given(layer, sorted(ids, key=lambda e: late(layer, e)))
        prompts = ([1, 2, 3], [4], [5, 6, 7, 8, 9], [30, 31])
        batch, each = [model.new_cache(N_CTX) for _ in prompts], [model.new_cache(N_CTX) for _ in prompts]
        for a, b, p in zip(batch, each, prompts):
            model.prefill(p, a)
            model.prefill(p, b)
        calls = []
        gather = quant.gather_apply
        monkeypatch.setattr(quant, "gather_apply", lambda ps, x, act: calls.append(x.shape[0]) or gather(ps, x, act))
        routes = []
        model.route_observer = lambda i, r: routes.append(r.ids)
        out = model.forward_batch([BatchPart([20 + s], c) for s, c in enumerate(batch)])
        in_memory = [sum(not late(i, e) for e in set(ids.reshape(-1).tolist())) for i, ids in enumerate(routes)]
        assert any(n < len(set(ids.reshape(-1).tolist())) for n, ids in zip(in_memory, routes))  # some came late
        together = sum(n >= 2 for n in in_memory)  # layers with two or more of their experts in memory
        assert len(calls) == 2 * together and calls[0::2] == [4] * together  # gates and ups on the 4 rows, then downs
        model.route_observer = None
        for s, (got, cache) in enumerate(zip(out, each)):
            assert np.array_equal(got, model.decode_one(20 + s, cache)[None])


def test_prefetch_guesses_for_a_batch_of_decode_rows_and_keeps_the_output(tiny_files):
    """With prefetch on, a batch of decode rows is guessed as a decode step is (each next layer,
    the first from the embeddings); the guesses only warm the cache, the tokens stay."""
    with open_model(tiny_files("qwen35moe")) as mf:
        model = loaded(mf, "f32", prefetch_next=True)
        guessed: list[int] = []
        model.source.prefetch = lambda layer, ids: guessed.append(layer)
        reqs = requests(model.spec.n_vocab, 20)[:3]
        got = decode_together(model, reqs, N_CTX, chunk=CHUNK)
        assert set(guessed) == set(range(model.spec.n_layer))
        assert [g.tokens for g in got] == [alone(model, r)[0] for r in reqs]


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_a_verify_pass_in_a_batch_is_its_verify_pass_alone(tiny_files, kv):
    """A sequence's token and drafts (`all_logits`: every row) beside another's decode row and a
    prompt's chunk: its rows are what `verify` gives alone, q8_0 rows taken one at a time there
    as in a verify pass (KVCache.rows_alone on that sequence's cache)."""
    with open_model(tiny_files("gemma4")) as mf:
        model = loaded(mf, kv)
        a, b, c, alone_cache = (model.new_cache(N_CTX) for _ in range(4))
        for cache in (a, alone_cache):
            model.prefill(list(range(40, 80)), cache, batch=CHUNK)
        model.prefill([9, 8, 7], b)
        a.rows_alone = alone_cache.rows_alone = True
        batched = model.forward_batch([BatchPart([1], b), BatchPart([5, 6, 7, 8], a, all_logits=True), BatchPart([4] * 20, c)])
        assert np.array_equal(batched[1], model.verify([5, 6, 7, 8], alone_cache))
        assert [x.shape[0] for x in batched] == [1, 4, 1]


def test_a_bad_batch_is_refused_before_any_cache_changes(tiny_files):
    with open_model(tiny_files("qwen3moe")) as mf:
        model = loaded(mf, "f32")
        a, b = model.new_cache(N_CTX), model.new_cache(8)
        with pytest.raises(ValueError, match="each sequence's cache once"):
            model.forward_batch([BatchPart([1], a), BatchPart([2], a)])
        with pytest.raises(ValueError, match="context full"):
            model.forward_batch([BatchPart([1], a), BatchPart(list(range(9)), b)])
        with pytest.raises(ValueError, match="at least one token"):
            model.forward_batch([BatchPart([1], a), BatchPart([], b)])
        with pytest.raises(ValueError, match="at least one sequence"):
            model.forward_batch([])
        assert a.n == b.n == 0


def test_rope_tables_are_each_rows_own_position():
    """A batch's rows sit at unrelated positions: the tables kept from the last pass are
    reused only for the very same positions, never for others of the same first and count."""
    rope = rope_from_spec(RopeSpec(10000.0, 8))
    rope.tables(np.array([5, 6, 7]))
    cos, sin = rope.tables(np.array([5, 17, 3]))
    for row, p in enumerate([5, 17, 3]):
        want = rope.tables(np.array([p]))
        assert np.array_equal(cos[row], want[0][0]) and np.array_equal(sin[row], want[1][0])


def test_a_read_across_sequences_is_refused(tiny_files):
    """A family that reads its cache by position range must do so per sequence: a batch has no one range."""
    with open_model(tiny_files("qwen3moe")) as mf:
        model = loaded(mf, "f32")
        batch = BatchCache([model.new_cache(N_CTX), model.new_cache(N_CTX)], [1, 2])
        for read in (lambda: batch.keys(0, 0, 1), lambda: batch.values(0, 0, 1), lambda: batch.stored(0)):
            with pytest.raises(ValueError, match="per sequence"):
                read()
        assert batch.positions.tolist() == [0, 0, 1]
