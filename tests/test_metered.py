"""The compute process's model, metered and watched (procs/metered.py), on
real tiny models in this process: a prompt's progress comes in order and
closes with processed == total before its first text; a Stop mid-prompt,
mid-layer, leaves the session holding exactly the chunks done (KV rows and a
hybrid model's recurrent state as a fresh run of those tokens makes them),
and the next request on the same prompt reuses them and gives the tokens of
a fresh run; a decode step that stops half way on a hybrid model leaves an
empty, consistent cache; the rows split the prompt's time."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from moe_pipe.procs.compute import GenerationAborted
from moe_pipe.procs.metered import MeteredModel
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.base import ModelOptions
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.model.prompt_watch import PromptWatch
from moe_pipe.shared.model.session import Session
from moe_pipe.shared.model.stages import Stages
from moe_pipe.shared.model.weights import FileExperts
from moe_pipe.shared.text.generate import GenerationConfig, generate
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.tokenizer import Tokenizer
from moe_pipe.shared.wire import messages as m

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(40)]  # 40 tokens: three 16-token chunks
CHUNK = 16
N_CTX = 128


class Counters:
    """What MeteredModel reads of compute's SlabExperts: its counters, all 0 here
    (the model reads the file), and what it tells it (end of a step, a pass abandoned)."""

    def __init__(self) -> None:
        self.abandoned = 0
        self.usable = 0
        self.rooms: list[int] = []  # the KV positions each pass asked room for, in order
        self.rows: list[int] = []  # and the rows of each pass at once (the prompt's loan)
        self.reset_counters()

    def room_for(self, positions: int, rows: int = 1) -> None:
        self.rooms.append(positions)
        self.rows.append(rows)

    def reset_counters(self) -> None:
        self.hits = self.misses = self.read_bytes = self.io_ns = self.messages = 0
        self.stall_s = self.mgmt_s = self.wire_s = 0.0
        self.prefetch_issued = self.prefetch_used = self.prefetch_wasted_bytes = self.prefetch_paused = 0

    def end_step(self) -> None:
        pass

    def abandon(self) -> None:
        self.abandoned += 1

    def resident_bytes(self) -> int:
        return 0


class Engine:
    """A model as compute builds it (procs/compute.py model_options: stages timed, layers
    watched), the watch's events and a Stop that comes at the `stop_at`-th check."""

    def __init__(self, path, stop_at: int = 0):
        self.events: list[tuple[str, object]] = []
        self.checks, self.stop_at = 0, stop_at
        self.watch = PromptWatch(0, lambda p: self.events.append(("progress", p)), self.check, interval_s=0.0, poll_s=0.0)
        self.mf = open_model(path)
        self.tok = Tokenizer.from_gguf(self.mf.gguf)
        self.watch.n_layer = self.mf.spec.n_layer
        options = ModelOptions(stage_timing=True, layer_observer=self.watch.layer_done)
        self.model = load_model(self.mf, options=options)
        self.records: list[m.TokenRecord] = []
        self.source = Counters()
        self.metered = MeteredModel(self.model, self.source, SimpleNamespace(send=self.records.append), watch=self.watch)

    def check(self) -> None:
        self.checks += 1
        if self.checks == self.stop_at:
            raise GenerationAborted(m.Code.CANCELLED, "cancelled by the front end")

    def generate(self, prompt, session: Session, req_id: int = 1, metered: bool = True):
        self.metered.begin(req_id)
        cfg = GenerationConfig(max_tokens=6, n_ctx=N_CTX, prefill_batch=CHUNK)
        on_text = lambda text: self.events.append(("text", text))  # noqa: E731
        return generate(self.metered if metered else self.model, self.tok, list(prompt), SamplingParams(), cfg, on_text, session)

    def close(self) -> None:
        self.mf.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("metered")
    return {arch: make_model(arch, "tiny", folder / f"{arch}.gguf", quant="F32") for arch in ("qwen3moe", "qwen35moe")}


def test_a_prompt_s_progress_comes_in_order_and_closes_at_total_before_its_text(models):
    e = Engine(models["qwen3moe"])
    try:
        session = Session()
        first = e.generate(PROMPT, session, req_id=7)
        kinds = [k for k, _ in e.events]
        progress = [p for k, p in e.events if k == "progress"]
        assert kinds[: kinds.index("text")] == ["progress"] * len(progress)  # all of it before any text
        processed = [p.processed for p in progress]
        assert processed[0] == 0 and processed[-1] == len(PROMPT) and processed == sorted(set(processed))
        # one event a layer (interval 0), the last layer's left to the closing event
        assert len(progress) == 1 + 3 * e.mf.spec.n_layer
        assert all(p.total == len(PROMPT) and p.cache == 0 for p in progress)
        row = e.records[0]  # the prompt's pass: its time split (docs/telemetry.md § A prompt's time)
        assert row.pass_tokens == len(PROMPT) and row.req_id == 7
        assert 0 < row.attention_ms < row.compute_ms <= row.wall_ms
        assert [r.pass_tokens for r in e.records[1:]] == [1] * (len(e.records) - 1)
        # before each pass, room for the KV positions it writes (the KV cache's loan): the prompt's, then one a token
        assert e.source.rooms == [len(PROMPT) + i for i in range(len(e.records))]
        # and the rows a pass holds at once (the prompt's loan): the prompt's chunk, then one a token
        assert e.source.rows == [CHUNK] + [1] * (len(e.records) - 1)

        # the next turn reuses the conversation: its progress opens at what the cache holds
        e.events.clear()
        e.records.clear()
        longer = PROMPT + first.tokens + [11, 12, 13]
        second = e.generate(longer, session, req_id=8)
        progress = [p for k, p in e.events if k == "progress"]
        cached = second.timings["prompt_cached"]
        assert cached == len(PROMPT) + len(first.tokens) - 1  # the last reply token was never fed
        assert (progress[0].cache, progress[0].processed, progress[-1].processed) == (cached, cached, len(longer))
        assert e.records[0].pass_tokens == len(longer) - cached
        assert e.source.rooms[-len(e.records)] == len(longer)
    finally:
        e.close()


def test_the_prompt_s_freed_heap_goes_back_before_the_reply_s_first_pass(models, monkeypatch):
    """A prompt chunk's arrays stay in compute's heap for its layers (shared/heap.py); a dense
    set read through the file mapping needs those pages during the reply (DeepSeek-V4-Flash
    after a long prompt: docs/benchmarks.md § Deep cuts of the largest families on a phone's
    memory), so they go back after the prompt's pass, not only when the request ends — and
    when the prompt is stopped half way too."""
    from moe_pipe.procs import metered as metered_module

    e = Engine(models["qwen3moe"])
    given_back: list[int] = []  # the passes recorded when the heap gave its pages back
    monkeypatch.setattr(metered_module.heap, "give_back", lambda: given_back.append(len(e.records)))
    try:
        e.generate(PROMPT, Session())
        assert given_back == [1] and len(e.records) > 1  # after the prompt's pass, before the reply's
        stopped = Engine(models["qwen3moe"], stop_at=3)
        given_back.clear()
        with pytest.raises(GenerationAborted):
            stopped.generate(PROMPT, Session())
        assert len(given_back) == 1
        stopped.close()
    finally:
        e.close()


def _rows(cache, n: int) -> list[np.ndarray]:
    """Positions 0..n-1 of every KV part, and a hybrid model's recurrent state."""
    rows = [np.array(p[:, :n]) for p in cache.parts()]
    if cache.state is not None:
        rows += [a.copy() for a in (*cache.state.conv.values(), *cache.state.delta.values())]
    return rows


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])  # KV only; hybrid (recurrent state updated in place)
def test_a_stop_mid_prompt_leaves_the_chunks_done_and_the_next_request_reuses_them_exactly(models, arch):
    fresh = Engine(models[arch])
    try:
        reference = fresh.generate(PROMPT, Session(), metered=False).tokens  # the watch never armed: a plain run
        held = fresh.model.new_cache(N_CTX)
        fresh.model.prefill(PROMPT[:CHUNK], held, batch=CHUNK)  # what the prompt's first chunk leaves
        expected = _rows(held, CHUNK)
    finally:
        fresh.close()

    n_layer = 4
    e = Engine(models[arch], stop_at=n_layer + 3)  # the second chunk, after its third layer
    try:
        assert e.mf.spec.n_layer == n_layer
        session = Session()
        with pytest.raises(GenerationAborted):
            e.generate(PROMPT, session)
        assert session.n == CHUNK and session.tokens == PROMPT[:CHUNK]  # the chunk done, none of the one stopped
        assert e.source.abandoned == 1 and not e.watch.armed
        assert not [k for k, _ in e.events if k == "text"]
        for got, want in zip(_rows(session.cache, CHUNK), expected, strict=True):
            assert np.array_equal(got, want)

        e.events.clear()
        again = e.generate(PROMPT, session)  # no Stop this time (its check count is past)
        assert again.timings["prompt_cached"] == CHUNK
        assert again.tokens == reference
        progress = [p for k, p in e.events if k == "progress"]
        assert (progress[0].cache, progress[-1].processed) == (CHUNK, len(PROMPT))
    finally:
        e.close()


def test_a_decode_step_stopped_half_way_on_a_hybrid_model_leaves_an_empty_cache(models):
    """A decode step's state cannot be put back (it is not copied for every
    token): the cache starts over, consistent and empty."""
    with open_model(models["qwen35moe"]) as mf:
        cache = load_model(mf).new_cache(N_CTX)

    def decode_one(token, c):
        c.advance(0)
        next(iter(c.state.delta.values()))[:] = 1.0  # a layer ran
        raise GenerationAborted(m.Code.IO_ERROR, "expert 3 of layer 1: read failed")

    model = SimpleNamespace(stage=Stages(), decode_one=decode_one)
    source = Counters()
    metered = MeteredModel(model, source, SimpleNamespace(send=lambda rec: None))
    cache.advance(5)
    with pytest.raises(GenerationAborted):
        metered.decode_one(9, cache)
    assert cache.n == 0 and all(not a.any() for a in (*cache.state.conv.values(), *cache.state.delta.values()))
    assert source.abandoned == 1


class CountingExperts(FileExperts, Counters):
    """The file's experts, each one asked for counted as a lookup (a miss: nothing is cached
    here), as compute's SlabExperts counts hits + misses."""

    def __init__(self, mf) -> None:
        FileExperts.__init__(self, mf)
        Counters.__init__(self)

    def experts(self, layer, ids):
        for expert in FileExperts.experts(self, layer, ids):
            self.misses += 1
            yield expert


def test_a_pass_counts_the_expert_uses_another_row_s_lookup_served(models):
    """`experts_shared`: the (row, expert) pairs a pass's routers chose minus the distinct
    experts each layer looked up; none on a decode row alone, some across the rows of
    several sequences in one pass and within a prompt's chunk (procs/metered.py RouteCount)."""
    from moe_pipe.procs.metered import RouteCount
    from moe_pipe.shared.model.batch import BatchPart

    mf = open_model(models["qwen3moe"])
    try:
        routings: list[np.ndarray] = []
        routes = RouteCount(lambda layer, routing: routings.append(routing.ids.copy()))  # as it hands them to a route tracer
        source = CountingExperts(mf)
        model = load_model(mf, experts=source, options=ModelOptions(route_observer=routes))
        records: list[m.TokenRecord] = []
        metered = MeteredModel(model, source, SimpleNamespace(send=records.append), routes=routes)

        def shared_by_hand() -> int:
            out = sum(ids.size - len(np.unique(ids)) for ids in routings)  # each layer's routing [T, K]
            routings.clear()
            return out

        caches = [model.new_cache(N_CTX) for _ in range(3)]
        firsts = []
        for i, cache in enumerate(caches):
            firsts.append(int(np.argmax(metered.prefill(PROMPT[i:], cache, batch=CHUNK))))
            assert records[-1].experts_shared == shared_by_hand() > 0  # a prompt's rows share within each chunk
        metered.decode_one(firsts[0], caches[0])
        assert records[-1].experts_shared == shared_by_hand() == 0  # one row: nothing to share
        _, rec = metered.forward_batch([BatchPart([t], c) for t, c in zip(firsts, caches)], [1, 2, 3])
        assert rec.pass_tokens == 3 and rec.experts_shared == shared_by_hand() > 0  # three sequences' rows, one lookup each expert
        assert rec.experts_shared + rec.hits + rec.misses == 3 * model.top_k * sum("router" in L for L in model.layers)
    finally:
        mf.close()
