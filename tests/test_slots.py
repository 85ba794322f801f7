"""Compute's slots (procs/slots.py): `moe-pipe up --parallel 3` on the tiny model decodes
several requests at once, each reply exactly the one it gets alone, a cancelled one
leaving the others' untouched; and the step's pure choices (which rows, which slot)."""

from __future__ import annotations

import gc
import json
import threading
import time
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from moe_pipe.procs.slots import Ask, Pace, Slot, Steps, pick_rows, pick_slot
from moe_pipe.shared.model.session import Session
from moe_pipe.shared.wire import messages as m

# -- the step's choices ----------------------------------------------------------------


def _ask(slot: int, order: int, n: int) -> Ask:
    return Ask(slot, order, list(range(n)), cache=None)  # type: ignore[arg-type]  # no pass runs here


def _slots_of(rows: list[Ask], chunk: Ask | None) -> tuple[list[int], int | None]:
    return [a.slot for a in rows], chunk.slot if chunk is not None else None


def test_a_step_takes_every_decode_row_and_the_oldest_prompt_s_chunk():
    asks = [_ask(0, 5, 64), _ask(1, 2, 1), _ask(2, 3, 64), _ask(3, 9, 1)]
    assert _slots_of(*pick_rows(asks)) == ([1, 3], 2)  # decode rows, and the chunk of request 3 (older than 5)
    assert _slots_of(*pick_rows([_ask(0, 1, 1)])) == ([0], None)
    assert _slots_of(*pick_rows([_ask(0, 4, 7), _ask(1, 3, 7)])) == ([], 1)  # two prompts: one chunk at a time
    verify = Ask(2, 8, [1, 2, 3, 4], cache=None, all_logits=True)  # type: ignore[arg-type]  # a token and its drafts
    assert _slots_of(*pick_rows([_ask(0, 4, 7), verify, _ask(1, 3, 1)])) == ([2, 1], 0)  # rows of a decode step, not a chunk


def test_a_chunk_takes_what_fits_beside_the_decode_rows_and_about_a_second_when_nothing_decodes():
    pace = Pace(share=1.0, alone_s=1.0)
    assert pace.layers(True, 48) == 1  # nothing measured yet: a layer a step
    assert pace.layers(False, 30) == 30  # nobody waits, a layer's cost unknown: all that are left
    # No step of decode rows alone yet (prompts back to back): 48 layers, the decode rows 1/96 s
    # a layer (0.5 s a pass); 2 of them with the chunk, which adds 0.24 s to each
    inside = 2 * (0.24 + 1 / 96)
    pace.took(inside + 46 / 96, decoding=True, layers=2, inside_s=inside, outside_s=46 / 96, rest=46)
    assert (pace.decode_s, pace.layer_s) == pytest.approx((0.5, 0.24))
    assert pace.layers(True, 48) == 2  # two layers fit in the decode rows' pass, three do not
    assert pace.layers(True, 1) == 1
    assert pace.layers(False, 30) == 4  # nobody waits: a second's worth, so a Stop is seen within it
    pace.took(0.6, decoding=True)  # a step of decode rows alone: their pass, measured
    assert pace.decode_s == pytest.approx(0.7 * 0.5 + 0.3 * 0.6)
    for _ in range(5):
        pace.took(3 * 0.05, decoding=False, layers=3, inside_s=3 * 0.05)  # cached experts: the layers grow cheap
    assert pace.layers(True, 48) > 2
    pace.took(0.5 + 40.0, decoding=True, layers=1, inside_s=40.0, outside_s=47 / 96, rest=47)  # a slow layer (its reads)
    assert pace.layers(True, 48) == 1


def test_a_request_takes_its_conversation_s_slot_else_one_that_loses_nothing_else_the_least_recently_used():
    slots = [Slot(i, Session()) for i in range(3)]
    for s, ids, order in zip(slots, ([1, 2, 3, 4], [1, 2, 9], []), (5, 2, 7)):
        s.session.ids, s.order = ids, order
        s.session.cache = type("C", (), {"n": len(ids), "state": None})()  # tokens = ids[:n]
    assert pick_slot(slots, set(), [1, 2, 3, 4, 5]).id == 0  # its earlier turn: all of slot 0 is its prefix
    assert pick_slot(slots, set(), [1, 2, 3, 7]).id == 2  # another conversation's [.., 4] stays; the empty slot takes it
    assert pick_slot(slots, set(), [8]).id == 2
    assert pick_slot(slots, {2}, [1, 2, 3, 7]).id == 1  # every idle slot holds another conversation: used longest ago
    assert pick_slot(slots, {1, 2}, [1, 2, 3, 4, 5]).id == 0
    assert pick_slot(slots, {0, 1, 2}, [8]) is None


def _asking_thread(steps: Steps, asks: int, errors: list[BaseException]) -> threading.Thread:
    """Slot 0's thread asking `asks` times for a step, each failure kept in `errors`; started."""

    def slot_thread() -> None:
        for _ in range(asks):
            try:
                steps.ask(0, 1, [5], cache=None)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

    t = threading.Thread(target=slot_thread)
    t.start()
    return t


def test_a_cancel_answers_a_waiting_ask_and_refuses_the_next():
    steps = Steps()
    steps.join(0)
    errors: list[BaseException] = []
    t = _asking_thread(steps, 2, errors)
    assert [a.slot for a in steps.gather(5.0)] == [0]  # every busy slot asked
    steps.cancel(0)
    t.join(5.0)
    assert not t.is_alive() and [getattr(e, "code", None) for e in errors] == ["cancelled", "cancelled"]


def test_a_step_answers_each_slot_its_own_row():
    steps = Steps()
    got: dict[int, np.ndarray] = {}
    for i in range(2):
        steps.join(i)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, steps.ask(i, i, [i], cache=None).logits)) for i in range(2)]  # type: ignore[arg-type]
    for t in threads:
        t.start()
    asks = steps.gather(5.0)
    while len(asks) < 2:
        asks = steps.gather(5.0)
    for a in asks:
        steps.answer(a, logits=np.full(3, a.slot))
    for t in threads:
        t.join(5.0)
    assert {i: v.tolist() for i, v in got.items()} == {0: [0, 0, 0], 1: [1, 1, 1]}


def test_only_a_slot_waiting_for_a_step_is_read_by_another_request():
    # A busy slot's thread changes its session between steps (reuse, a context shift); one that
    # has asked holds still until the loop answers it: only such a slot gives a prefix away.
    steps = Steps()
    for i in range(2):
        steps.join(i)
    errors: list[BaseException] = []
    t = _asking_thread(steps, 1, errors)
    busy, waiting = steps.settle(0.2)
    while not waiting:
        busy, waiting = steps.settle(0.2)
    assert (busy, waiting) == ({0, 1}, {0})  # slot 1 never asked: the wait ends at its timeout
    steps.cancel(0)
    t.join(5.0)
    assert [getattr(e, "code", None) for e in errors] == ["cancelled"]
    steps.leave(0)
    steps.leave(1)
    assert steps.settle(5.0) == (set(), set())  # nothing busy: at once


def test_the_slots_states_go_to_telemetry_at_each_change_and_now_and_then_between():
    from types import SimpleNamespace

    from moe_pipe.procs.slots import SLOT_STATES_S, Slots
    from moe_pipe.shared.config import Config, apply_overrides

    sent: list[m.SlotStates] = []
    metered = SimpleNamespace(telemetry=SimpleNamespace(send=sent.append))
    slots = Slots(apply_overrides(Config(), {"gateway.parallel": 2}), metered, None, None, None, None, ())  # type: ignore[arg-type]

    def report(t: float) -> list[tuple]:
        before = len(sent)
        slots.report_states(clock=lambda: t)
        return [tuple((r["state"], r["processed"], r["decoded"]) for r in s.rows()) for s in sent[before:]]

    assert report(0.0) == [(("idle", 0, 0), ("idle", 0, 0))]  # a compute's first word: every slot idle
    assert report(0.01) == []  # nothing changed
    s0 = slots.slots[0]
    s0.req_id, s0.total, s0.processed = 5, 40, 0
    slots.steps.join(0)
    assert report(0.02) == [(("prompt", 0, 0), ("idle", 0, 0))]  # a slot took a request: at once
    s0.processed = 16
    assert report(0.03) == []  # its progress: not before SLOT_STATES_S
    assert report(0.02 + SLOT_STATES_S) == [(("prompt", 16, 0), ("idle", 0, 0))]
    s0.processed, s0.decoded = 40, 1
    assert report(0.03 + SLOT_STATES_S) == [(("decoding", 40, 1), ("idle", 0, 0))]  # prompt -> decoding: at once
    slots.steps.leave(0)
    assert report(0.04 + SLOT_STATES_S) == [(("idle", 0, 0), ("idle", 0, 0))]


# -- a request's figures, the serving loop in this process ---------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moe_pipe.shared.makemodel.maker import make_model

    return make_model("qwen3moe", "tiny", tmp_path_factory.mktemp("slots") / "qwen3moe.gguf", quant="F32")


def test_a_parallel_request_s_done_carries_its_own_figures_as_one_alone_does(tiny):
    """Each request in a slot gets the Done figures compute.handle gives it alone (docs/telemetry.md
    § Run summary), summarised from the records of the passes its rows were in: one a token, a
    prompt read in chunks beside other rows counted as its one pass."""
    from types import SimpleNamespace

    from moe_pipe.procs.compute import handle
    from moe_pipe.procs.metered import MeteredModel, RouteCount
    from moe_pipe.procs.slots import Slots
    from moe_pipe.shared.config import Config, apply_overrides
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model.base import ModelOptions
    from moe_pipe.shared.model.load import load_model
    from moe_pipe.shared.text.tokenizer import Tokenizer
    from moe_pipe.shared.wire import messages as m

    from .test_metered import CountingExperts

    config = apply_overrides(Config(), {"gateway.parallel": 3, "compute.ctx_size": 256, "compute.prefill_chunk": 16})
    prompts = [[(7 * i + 3 * k) % 200 + 5 for i in range(40 + 5 * k)] for k in range(3)]  # 40-50 tokens: three or four chunks
    reqs = [m.Generate(k + 1, tuple(p), 12, {"temperature": 0.0}) for k, p in enumerate(prompts)]
    with open_model(tiny) as mf:
        routes, source, passes = RouteCount(), CountingExperts(mf), []
        model = load_model(mf, experts=source, options=ModelOptions(route_observer=routes, stage_timing=True))
        tok = Tokenizer.from_gguf(mf.gguf)
        metered = MeteredModel(model, source, SimpleNamespace(send=passes.append), routes=routes)

        def together(reqs: list[m.Generate]) -> dict[int, m.Done]:
            """Slots.serve's steps 1-3 without its sockets: every request in a slot at once."""
            slots = Slots(config, metered, tok, None, None, None, ())  # type: ignore[arg-type]
            for slot, req in zip(slots.slots, reqs):
                slots.start(slot, req)
            done: dict[int, m.Done] = {}
            while len(done) < len(reqs):
                asks = slots.steps.gather(5.0)
                if asks:
                    slots.step(asks)
                done.update((d.req_id, d) for d in slots.steps.take_outbox() if isinstance(d, m.Done))
            return done

        frames: list[list[bytes]] = []
        out = SimpleNamespace(send_multipart=lambda f, flags=0: frames.append(f))
        handle(reqs[0], metered, tok, apply_overrides(config, {"gateway.parallel": 1}), out)  # type: ignore[arg-type]
        solo = m.decode(frames[-1][-1])
        assert isinstance(solo, m.Done) and solo.ok

        passes.clear()
        (alone,) = together(reqs[:1]).values()  # in a slot, alone: every pass is its own
        assert alone.tokens == solo.tokens and set(alone.timings) == set(solo.timings) | {"id_slot", "prompt_shared"}
        t = alone.timings
        assert t["tokens"] == t["predicted_n"] == len(alone.tokens) == solo.timings["tokens"]  # its prompt's 3 chunks: one token
        assert len(passes) == 3 + len(alone.tokens) - 1
        assert t["mean_tok_s"] == pytest.approx(t["tokens"] / sum(r.wall_ms for r in passes) * 1e3)
        assert t["final_hit_pct"] == passes[-1].cache_hit_pct and t["late_compiles"] == 0

        passes.clear()
        done = together(reqs)
        for req in reqs:
            d = done[req.req_id]
            assert d.ok and set(d.timings) == set(alone.timings) and d.timings["tokens"] == d.timings["predicted_n"] == len(d.tokens)
            # the passes' figures, shared with the rows beside it: its passes are some of them
            assert 0 < d.timings["mean_tok_s"] and d.timings["first5_wall_ms"] > 0
        assert done[1].tokens == alone.tokens
        assert max(r.pass_tokens for r in passes) > 16 and sum(r.experts_shared for r in passes) > 0  # chunks beside decode rows


def _in_process(path, **settings):
    """Compute's Slots on `path` without sockets: (slots, the model, the tokenizer, a function that
    starts a request in a slot, and one that runs steps 2-3 until a condition on the Dones holds)."""
    from types import SimpleNamespace

    from moe_pipe.procs.metered import MeteredModel
    from moe_pipe.procs.slots import Slots
    from moe_pipe.shared.config import Config, apply_overrides
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model.load import load_model
    from moe_pipe.shared.text.tokenizer import Tokenizer

    from .test_metered import CountingExperts

    mf = open_model(path)
    source = CountingExperts(mf)
    model = load_model(mf, experts=source)
    metered = MeteredModel(model, source, SimpleNamespace(send=lambda _: None))
    config = apply_overrides(Config(), {"compute.ctx_size": 256, **settings})
    slots = Slots(config, metered, Tokenizer.from_gguf(mf.gguf), None, SimpleNamespace(pending=[]), None, ())  # type: ignore[arg-type]
    done: dict[int, m.Done] = {}
    sent: list[m.Message] = []  # every frame the slots made, in order (serve.sent)

    def start(slot: int, req: m.Generate) -> None:
        slots.start(slots.slots[slot], req)

    def serve(until, each_step=lambda: None) -> dict[int, m.Done]:
        while not until(done):
            assert slots.steps.busy or slots.steps.outbox, f"nothing runs and the wait is not over: {done}"
            asks = slots.steps.gather(5.0)
            if asks:
                slots.step(asks)
                each_step()
            out = slots.steps.take_outbox()
            sent.extend(out)
            done.update((d.req_id, d) for d in out if isinstance(d, m.Done))
        return done

    serve.sent = sent  # type: ignore[attr-defined]

    return slots, model, start, serve


def _greedy(req_id: int, prompt: list[int], n: int) -> m.Generate:
    return m.Generate(req_id, tuple(prompt), n, {"temperature": 0.0})


def _alone(path, req: m.Generate) -> m.Done:
    _, _, start, serve = _in_process(path, **{"gateway.parallel": 1, "compute.prefill_chunk": 16})
    start(0, req)
    return serve(lambda d: req.req_id in d)[req.req_id]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from moe_pipe.shared.makemodel.maker import make_model

    return make_model("qwen35moe", "tiny", tmp_path_factory.mktemp("slots") / "qwen35moe.gguf", quant="F32")


@pytest.mark.parametrize("which", ["tiny", "hybrid"])
def test_a_prompt_beside_a_decoding_slot_goes_a_few_layers_a_step_and_each_reply_is_its_own(which, request):
    """A 48-token prompt (three chunks of 16) arrives while another slot decodes: its chunks go
    through the layers over several steps, the decoding slot getting a token every step, and
    both replies are the ones each gets alone (a recurrent model's state folding each chunk
    layer by layer included)."""
    path = request.getfixturevalue(which)
    slots, model, start, serve = _in_process(path, **{"gateway.parallel": 2, "compute.prefill_chunk": 16})
    slots.pace.share = 0.0  # one layer a step whatever the walls (a tiny model's are noise)
    a, b = _greedy(1, [5, 6, 7], 40), _greedy(2, [(11 * i) % 200 + 3 for i in range(48)], 6)
    start(0, a)
    serve(lambda d: slots.slots[0].decoded >= 3)  # a decodes
    start(1, b)
    midway: list[tuple[int, int]] = []  # (a's tokens, the chunk's next layer) after each step that left it part way

    def look() -> None:
        if slots.sliced is not None:
            midway.append((slots.slots[0].decoded, slots.sliced.piece.next_layer))

    done = serve(lambda d: {1, 2} <= d.keys(), look)
    assert done[1].tokens == _alone(path, a).tokens and done[2].tokens == _alone(path, b).tokens
    assert midway and all(0 < layer < model.spec.n_layer for _, layer in midway)
    decoded = [n for n, _ in midway]
    assert len(set(decoded)) == len(decoded)  # a token for the decoding slot at every one of those steps
    # the prompt's progress comes a layer slice at a time, not only at each chunk's end
    progress = [f.processed for f in serve.sent if isinstance(f, m.PromptProgress) and f.req_id == 2]  # type: ignore[attr-defined]
    assert progress == sorted(set(progress)) and progress[0] == 0 and progress[-1] == 48
    assert any(p % 16 for p in progress)


def test_each_chunk_s_freed_heap_goes_back_once_it_is_through_the_last_layer(tiny, monkeypatch):
    """As alone (tests/test_metered.py): a chunk's arrays the heap kept for its layers go back
    when the chunk is through, not only when compute is next idle, so the other slots'
    decoding does not run with them held."""
    from moe_pipe.procs import slots as slots_module

    slots, _, start, serve = _in_process(tiny, **{"gateway.parallel": 2, "compute.prefill_chunk": 16})
    given_back: list[int] = []  # the decoding slot's tokens each time
    monkeypatch.setattr(slots_module.heap, "give_back", lambda: given_back.append(slots.slots[0].decoded))
    start(0, _greedy(1, [5, 6, 7], 30))
    serve(lambda d: slots.slots[0].decoded >= 2)
    start(1, _greedy(2, [(11 * i) % 200 + 3 for i in range(48)], 4))
    serve(lambda d: {1, 2} <= d.keys())
    assert len(given_back) == 1 + 3  # the first slot's 3-token prompt, then the three chunks of 16
    assert given_back == sorted(given_back) and given_back[-1] < 30  # while the first slot still decoded


def test_a_request_that_ends_while_its_chunk_is_part_way_leaves_its_slot_as_before_the_chunk(hybrid):
    """Cancelled while its second chunk is in the first layers: the slot's cache holds the first
    chunk, and the recurrent state is the one those 16 positions give (put back: the layers the
    second chunk went through had folded it in), so the same prompt again reuses them and
    gets the reply it gets alone."""
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model.load import load_model

    slots, model, start, serve = _in_process(hybrid, **{"gateway.parallel": 2, "compute.prefill_chunk": 16})
    slots.pace.share = 0.0  # one layer a step
    prompt = [(13 * i) % 200 + 3 for i in range(48)]
    a, b = _greedy(1, [5, 6, 7], 60), _greedy(2, prompt, 6)
    start(0, a)
    serve(lambda d: slots.slots[0].decoded >= 2)
    start(1, b)
    cancelled: list[int] = []

    def cancel_in_the_second_chunk() -> None:
        sl = slots.sliced
        if not cancelled and sl is not None and sl.ask.cache.n == 16 and 0 < sl.piece.next_layer:
            cancelled.append(sl.piece.next_layer)
            slots.cancel(2)

    done = serve(lambda d: 2 in d, cancel_in_the_second_chunk)
    assert cancelled and not done[2].ok and done[2].code == m.Code.CANCELLED
    session = slots.slots[1].session
    assert session.tokens == prompt[:16]
    with open_model(hybrid) as mf:
        fresh = load_model(mf)
        cache = fresh.new_cache(256)
        fresh.prefill(prompt[:16], cache, batch=16)
    for mine, theirs in zip(session.cache.state.snapshot(), cache.state.snapshot()):
        assert mine.keys() == theirs.keys() and all(np.array_equal(mine[i], theirs[i]) for i in mine)
    serve(lambda d: 1 in d)
    c = _greedy(3, prompt, 6)
    start(1, c)
    again = serve(lambda d: 3 in d)[3]
    assert again.timings["prompt_cached"] == 16 and again.tokens == _alone(hybrid, b).tokens


@pytest.mark.parametrize("which", ["tiny", "hybrid"])
def test_slots_that_draft_give_the_replies_of_plain_decoding_alone(which, request, tmp_path):
    """Speculative decoding in slots (--draft 3 every pass): two requests decode together, their
    tokens and drafts verified in shared passes (`all_logits` asks), beside a third that does not
    draft; each reply is the one plain greedy decoding gives it alone. The drafts replay request
    1's own reply with a third of them made wrong (compute.draft_replay: random weights' n-grams
    rarely repeat), so request 1 keeps some and rolls others back (a recurrent model's state
    included) and request 2, whose reply they are not, rolls back nearly all. /slots' count of
    tokens (`decoded`) is the reply's."""
    path = request.getfixturevalue(which)
    reqs = [_greedy(1, [5, 6, 7, 8] * 6, 24), _greedy(2, [9, 10, 11] * 7, 20), replace(_greedy(3, [12, 13, 14], 12), draft=0)]
    alone = [_alone(path, req).tokens for req in reqs]
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"tokens": list(alone[0]), "accuracy": 0.7, "seed": 3}))
    settings = {"gateway.parallel": 3, "compute.prefill_chunk": 16, "compute.draft": 3, "compute.draft_adapt": False}
    slots, _, start, serve = _in_process(path, **settings, **{"compute.draft_replay": str(replay)})
    for i, req in enumerate(reqs):
        start(i, req)
    done = serve(lambda d: {1, 2, 3} <= d.keys())
    for i, req in enumerate(reqs):
        d = done[req.req_id]
        assert d.ok and d.tokens == alone[i], req.req_id
        assert slots.slots[i].decoded == len(d.tokens)
    t1, t2 = done[1].timings, done[2].timings
    assert 0 < t1["draft_accepted"] < t1["draft_n"] and t2["draft_n"] > 0 and "draft_n" not in done[3].timings
    assert t1["drafted"] == t1["draft_n"] and t1["accepted"] == t1["draft_accepted"]  # the request's records count its drafts


def test_a_slot_drafts_ngrams_but_not_from_the_mtp_block(tiny, caplog):
    from moe_pipe.procs.slots import slot_drafter
    from moe_pipe.shared.config import Config, apply_overrides
    from moe_pipe.shared.text.speculate import NGramDrafter

    assert isinstance(slot_drafter(Config(), 3, 100), NGramDrafter) and slot_drafter(Config(), 0, 100) is None
    assert slot_drafter(apply_overrides(Config(), {"compute.draft_source": "mtp"}), 3, 100) is None
    for source, warned in (("ngram", False), ("mtp", True)):  # compute says so once, as the slots start
        caplog.clear()
        _in_process(tiny, **{"gateway.parallel": 2, "compute.draft": 2, "compute.draft_source": source})
        assert ("drafts only with one slot" in caplog.text) == warned, source


def test_a_prefix_two_slots_take_from_a_third_is_held_once_and_each_reply_is_its_own(tiny):
    """Three slots, a 100-token prompt decoded in slot 0; two requests that begin with it take it
    from slot 0 (share_prefix) by reference: all three caches map one page file, the pool counts
    its positions once (slot_states: each slot's own positions, the prefix apart), and each reply
    is the one it gets alone. Emptied, the slots let the file go."""
    from moe_pipe.procs.slots import shared_positions, slot_states

    from .test_kv_pages import _memfd_open

    slots, _, start, serve = _in_process(tiny, **{"gateway.parallel": 3, "compute.prefill_chunk": 16})
    prefix = [(7 * i) % 200 + 3 for i in range(100)]
    reqs = [_greedy(1, prefix + [5, 6], 6), _greedy(2, prefix + [9, 10, 11], 6), _greedy(3, prefix + [12], 6)]
    start(0, reqs[0])
    serve(lambda d: 1 in d)
    for i, req in enumerate(reqs[1:], 1):
        shared = slots.share_prefix(slots.slots[i], req)
        assert shared == 100
        slots.start(slots.slots[i], req, shared)
    done = serve(lambda d: {2, 3} <= d.keys())
    for req in reqs:
        assert done[req.req_id].tokens == _alone(tiny, req).tokens
        assert done[req.req_id].timings["prompt_shared"] == (100 if req.req_id > 1 else 0)
    caches = [s.session.cache for s in slots.slots]
    (file,) = caches[0].page_files()
    assert all(c.page_files() == {file} for c in caches) and file.positions == 100 == shared_positions(slots.slots)
    states = slot_states(slots.slots, set(), slots.pool)
    assert states.shared == 100 and states.held == tuple(c.held - 100 for c in caches)
    assert states.pool_held == sum(c.held for c in caches) - 2 * 100  # the prefix once, not three times
    fd, alive = file.fd, weakref.ref(file)
    assert _memfd_open(fd)
    del file
    for s in slots.slots:
        slots.evict(s)
    assert shared_positions(slots.slots) == 0 and slot_states(slots.slots, set(), slots.pool).pool_held == 0
    gc.collect()
    assert alive() is None  # let go with the last slot that held it: its descriptor closed


def test_a_request_pinned_to_a_slot_runs_there_and_a_slot_action_takes_any_slot(tiny, tmp_path):
    """llama.cpp's id_slot: a request pinned to slot 2 runs in slot 2 (its session holds the
    prompt after), one pinned to a busy slot waits for it while an unpinned one after it goes
    on; `POST /slots/2?action=save` saves slot 2's session, a restore into slot 1 lets the same
    prompt pinned there reuse it (all but its last token) and get the same reply."""
    slots, _, start, serve = _in_process(tiny, **{"gateway.parallel": 3, "compute.prefill_chunk": 16})
    prompt = [(5 * i) % 200 + 3 for i in range(40)]

    def admit(*msgs: m.Message) -> None:
        """msgs into compute's waiting list, once every slot thread that answered has left its slot
        (a thread posts its Done just before it leaves)."""
        for s in slots.slots:
            if s.req_id in done_ids and s.thread is not None:
                s.thread.join(10)
        slots.interrupts.pending.extend(msgs)
        slots.admit()

    done_ids: set[int] = set()

    admit(m.Generate(1, tuple(prompt), 20, {"temperature": 0.0}, slot=2))
    assert slots.slots[2].req_id == 1 and 2 in slots.busy()
    # pinned to the busy slot 2: waits; the unpinned one after it takes an idle slot at once
    admit(m.Generate(2, (7, 8, 9), 4, {"temperature": 0.0}, slot=2), _greedy(3, [11, 12, 13], 4))
    assert [msg.req_id for msg in slots.interrupts.pending] == [2] and any(s.req_id == 3 for s in slots.slots[:2])
    done = serve(lambda d: {1, 3} <= d.keys())
    done_ids.update(done)
    assert slots.slots[2].session.tokens[:40] == prompt
    admit()  # slot 2 is idle: request 2 goes in now
    assert slots.slots[2].req_id == 2
    done = serve(lambda d: 2 in d)
    done_ids.update(done)
    assert all(done[i].ok for i in (1, 2, 3)) and done[2].timings["id_slot"] == 2
    admit(m.Generate(4, tuple(prompt), 20, {"temperature": 0.0}, slot=2))  # slot 2's conversation again
    done = serve(lambda d: 4 in d)
    done_ids.update(done)
    assert done[4].tokens == done[1].tokens

    sent: list[m.Message] = []
    slots.out = SimpleNamespace()  # what the actions answer, in place of the socket
    from moe_pipe.procs import slots as slots_module

    real_send = slots_module.ipc.send
    slots_module.ipc.send = lambda sock, msg: sent.append(msg) if sock is slots.out else real_send(sock, msg)
    try:
        path = str(tmp_path / "two.bin")
        admit(m.Slot(5, "save", path, slot=2))
        admit(m.Slot(6, "restore", path, slot=1))
        admit(m.Slot(7, "erase", "", slot=9))
    finally:
        slots_module.ipc.send = real_send
    saved, restored, refused = sent
    assert saved.ok and saved.timings["n_saved"] == len(slots.slots[2].session.tokens) > 40
    assert restored.ok and slots.slots[1].session.tokens == slots.slots[2].session.tokens
    assert not refused.ok and refused.code == m.Code.BAD_ARGUMENT and "no slot 9" in refused.error
    admit(m.Generate(8, tuple(prompt), 20, {"temperature": 0.0}, slot=1))
    done = serve(lambda d: 8 in d)
    assert done[8].timings["prompt_cached"] == len(prompt) - 1 and done[8].tokens == done[1].tokens


# -- the service ------------------------------------------------------------------------

pytest.importorskip("openai", reason="the service tests use the openai client: pip install '.[test]'")

from .test_service import CONFIG, MODEL, Service, reference  # noqa: E402

PROMPTS = ["Tell me a story about a cat.", "What is the capital of France?", "Count from one to twenty, please."]
N_LONG = 600  # tokens: a reply that outlasts several of /slots' updates (compute sends them four a second at most)


@pytest.fixture(scope="module")
def svc3():
    from moe_pipe.shared.makemodel.default_model import default_model_path

    default_model_path()
    s = Service("--parallel", "3", "--prefill-chunk", "16", model=CONFIG)  # prompts in several chunks, beside decode rows
    yield s
    s.close()


def _chat(s: Service, content: str, n: int) -> tuple[str, int, int]:
    r = s.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=n, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens


def _slots(s: Service) -> list[dict]:
    with urllib.request.urlopen(s.url + "/slots", timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.integration
def test_concurrent_greedy_requests_each_get_their_solo_reply(svc3):
    alone = [_chat(svc3, p, 48) for p in PROMPTS]
    assert alone[0][0] == reference(PROMPTS[0], 48)  # alone in a slot is `run`'s reply (one request, no slots)
    for _ in range(2):  # the second time, each slot's cache holds a prompt of an earlier round
        with ThreadPoolExecutor(3) as ex:
            together = list(ex.map(lambda p: _chat(svc3, p, 48), PROMPTS))
        assert together == alone
    slots = _slots(svc3)
    assert [s["id"] for s in slots] == [0, 1, 2] and not any(s["is_processing"] for s in slots)
    assert {s["n_ctx"] for s in slots} == {2048}
    with urllib.request.urlopen(svc3.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert "\nmoe_pipe_slots 3\n" in metrics and "\nmoe_pipe_slots_busy 0\n" in metrics
    figures = dict(line.split(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert float(figures["moe_pipe_experts_shared_total"]) > 0 and float(figures["moe_pipe_expert_lookups_total"]) > 0
    # the KV pool (one context and a quarter of one a further slot), held by the idle slots' conversations
    assert figures["moe_pipe_kv_pool_positions"] == "3072"
    assert 3 * 48 < int(figures["moe_pipe_kv_pool_held_positions"]) <= 3072


@pytest.mark.integration
def test_a_request_pinned_to_slot_2_shows_there_in_get_slots(svc3):
    """`id_slot` 2: GET /slots lists compute's slots, so while the request decodes slot 2 is the
    busy one, with its task id (the gateway's first worker sent it), and the others are idle;
    a response says the slot that served it, pinned or not; `id_slot` 3 on three slots is a 400
    that names them."""
    import openai

    client = svc3.client()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=N_LONG,
        temperature=0,
        stream=True,
        extra_body={"id_slot": 2},
    )
    try:
        next(c for c in stream if c.choices and c.choices[0].delta.content)  # it decodes
        deadline = time.monotonic() + 10  # compute's slot states reach the gateway through telemetry
        slots = _slots(svc3)
        while [s["is_processing"] for s in slots] != [False, False, True] and time.monotonic() < deadline:
            time.sleep(0.1)
            slots = _slots(svc3)
        assert [s["id"] for s in slots] == [0, 1, 2] and [s["is_processing"] for s in slots] == [False, False, True], slots
        assert slots[2]["id_task"] > 0 and slots[2]["n_prompt_tokens"] > 0 and slots[2]["phase"] in ("prompt", "decoding")
    finally:
        stream.close()
    # the response says which slot served it (llama.cpp's id_slot), pinned or not
    pinned = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"id_slot": 1}
    )
    assert pinned.model_extra["id_slot"] == 1 and pinned.model_extra["timings"]["predicted_n"] == pinned.usage.completion_tokens
    free = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert free.model_extra["id_slot"] in (0, 1, 2)
    with pytest.raises(openai.BadRequestError, match=r"it has slots 0-2 \(gateway.parallel is 3\)"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"id_slot": 3})


@pytest.mark.integration
@pytest.mark.slow  # ~17 s; the slot states telemetry carries are checked in the default tier by the web page test
def test_a_tail_shows_what_each_slot_is_doing(svc3):
    import subprocess
    import sys

    tail = subprocess.Popen(
        [sys.executable, "-m", "moe_pipe.cli.main", "tail"], env=svc3.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in tail.stdout), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not lines:  # the tail has subscribed once it prints a line: a token of a request sent until then
            assert time.monotonic() < deadline and tail.poll() is None, f"the tail printed nothing: {tail.stderr}"
            _chat(svc3, PROMPTS[0], 2)
        with ThreadPoolExecutor(3) as ex:
            list(ex.map(lambda p: _chat(svc3, p, 48), PROMPTS))
        at_rest = "slots: slot 0 idle · slot 1 idle · slot 2 idle ·"  # then the KV pool's positions
        while not (
            (shown := [x for x in lines if x.startswith("slots: ")])
            and shown[-1].startswith(at_rest)
            and any("decoding" in x for x in shown)
        ):
            assert time.monotonic() < deadline, f"no slots seen decoding, then at rest: {shown[-10:]}"
            time.sleep(0.1)
        assert all(x.count("slot ") == 3 for x in shown)  # a part a slot
    finally:
        tail.kill()
        tail.wait()


@pytest.mark.integration
@pytest.mark.slow  # the default tier's slot tests keep greedy identity and cancellation
def test_seeded_sampling_stays_per_request_beside_other_slots(svc3):
    def sample(prompt: str, seed: int, stop: list[str] | None = None) -> tuple[str, int]:
        r = svc3.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0.9, seed=seed, stop=stop
        )
        return r.choices[0].message.content, r.usage.completion_tokens

    asks = [(PROMPTS[0], 7, None), (PROMPTS[0], 8, None), (PROMPTS[1], 7, ["e"])]  # same prompt, other seeds; a stop string
    alone = [sample(*a) for a in asks]
    with ThreadPoolExecutor(3) as ex:
        together = list(ex.map(lambda a: sample(*a), asks))
    assert together == alone and alone[0] != alone[1]


@pytest.mark.integration
def test_a_cancelled_stream_leaves_the_others_replies_and_frees_its_slot(svc3):
    # replies long enough that /slots shows them decoding: it tells what compute's last SlotStates
    # said (four a second at most), and 64 tiny-model tokens can come and go between two of them
    alone = [_chat(svc3, p, N_LONG) for p in PROMPTS[:2]]
    client = svc3.client()
    leaver = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=1000, temperature=0, stream=True
    )
    next(iter(leaver))  # it is decoding in its slot
    seen: list[list[dict]] = []
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(_chat, svc3, p, N_LONG) for p in PROMPTS[:2]]
        # asked every 50 ms until both have answered, not a count of asks: /slots answers faster
        # than compute's four updates a second, and fifty asks could all fall between two of them
        while not all(f.done() for f in futures) and not any(sum(s["is_processing"] for s in snap) >= 2 for snap in seen):
            seen.append(_slots(svc3))
            time.sleep(0.05)
        leaver.close()  # the client goes away while the others decode
        together = [f.result() for f in futures]
    assert together == alone
    assert any(sum(s["is_processing"] for s in snap) >= 2 for snap in seen)  # they ran beside the leaver
    deadline = time.monotonic() + 20
    while any(s["is_processing"] for s in _slots(svc3)):
        assert time.monotonic() < deadline, "a slot stayed busy after its client left"
        time.sleep(0.1)
    assert _chat(svc3, PROMPTS[0], N_LONG) == alone[0]  # the service goes on as before


@pytest.mark.slow  # a compute restart: ~8 s alone, as test_service.py's kill -9 tests (slow beside the other tier)
@pytest.mark.integration
def test_kill9_of_compute_with_three_streams_in_flight_completes_all_three(svc3):
    import os
    import signal

    alone = [_chat(svc3, p, 300)[0] for p in PROMPTS]
    before = svc3.proc("compute")
    streaming = threading.Barrier(len(PROMPTS) + 1, timeout=120)

    def stream(prompt: str) -> str:
        parts = []
        chunks = svc3.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=300, temperature=0, stream=True
        )
        for i, chunk in enumerate(chunks):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if i == 10:
                streaming.wait()  # every stream is mid-reply when compute dies
        return "".join(parts)

    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        futures = [ex.submit(stream, p) for p in PROMPTS]
        streaming.wait()
        os.kill(before["pid"], signal.SIGKILL)
        texts = [f.result() for f in futures]
    assert texts == alone  # each resent to the restarted compute, its stream going on where it was
    after = svc3.wait_state("compute", {"RUNNING"})
    assert after["pid"] != before["pid"]


@pytest.mark.integration
def test_a_prompt_read_in_chunks_beside_decoding_slots_streams_its_progress(svc3):
    long_prompt = " ".join(str(i) for i in range(60))  # 180 tokens in the chat template: 12 chunks of 16
    alone = _chat(svc3, long_prompt, 24)
    body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 24, "temperature": 0}
    body.update(stream=True, return_progress=True, cache_prompt=False)  # computed in full, not reused from the solo run
    with ThreadPoolExecutor(2) as ex:
        others = [ex.submit(_chat, svc3, p, 64) for p in PROMPTS[:2]]
        req = urllib.request.Request(svc3.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
        [f.result() for f in others]
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == alone[0]
    assert progress[-1]["processed"] == progress[-1]["total"] == alone[1]
    done = [p["processed"] for p in progress]
    assert done == sorted(done) and done[0] == progress[0]["cache"] == 0 and len(done) >= 3
    first_text = next(i for i, e in enumerate(events) if e.get("choices") and e["choices"][0]["delta"].get("content"))
    assert first_text > max(i for i, e in enumerate(events) if "prompt_progress" in e)  # progress before any text


SYSTEM = (
    "You are the assistant of a small bakery. Answer in one short paragraph, politely, and never invent prices. "
    "The bakery opens at seven and closes at six, sells bread, cakes and pastries, takes orders a day ahead, "
    "delivers within the town on weekdays, and keeps a gluten-free shelf that changes every morning."
)
QUESTIONS = ["When do you open?", "Do you deliver?", "What is on the gluten-free shelf?", "Can I order a cake?"]


def _ask_with_system(s: Service, question: str, n: int, stream_until_first: threading.Event | None = None) -> tuple[str, int]:
    """A greedy reply to the bakery's system prompt and a question, and its usage's cached_tokens;
    with `stream_until_first`, streamed, the event set once its first text arrives."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    client = s.client()
    if stream_until_first is None:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
    parts, cached = [], -1
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            stream_until_first.set()
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return "".join(parts), cached


@pytest.mark.integration
def test_a_system_prompt_shared_by_four_concurrent_requests_is_computed_once(svc3):
    """Four greedy requests with one long system prompt and different questions on a fresh
    service with four slots: the first computes the system prompt; each later one, arriving
    while it decodes, takes it from a slot's KV cache (usage cached_tokens, /metrics), and
    every reply is the one it gets alone (here: alone in another service's slot).

    Which slot a later request gets depends on arrival order: one that arrives after another
    later request ended takes that request's idle slot (pick_slot: the longest common prefix),
    whose cache already holds the system prompt, and copies nothing. So /metrics' shared count
    is at least one copy from the first slot and at most every cached token, and the cached
    count is exactly the usages' sum."""
    lengths = [200, 32, 32, 32]  # the first decodes on while the others arrive
    alone = [_ask_with_system(svc3, q, n) for q, n in zip(QUESTIONS, lengths)]
    svc4 = Service("--parallel", "4", "--prefill-chunk", "16", model=CONFIG)
    try:
        first_text = threading.Event()
        with ThreadPoolExecutor(4) as ex:
            first = ex.submit(_ask_with_system, svc4, QUESTIONS[0], lengths[0], first_text)
            assert first_text.wait(120), "the first request never streamed"
            later = [ex.submit(_ask_with_system, svc4, q, n) for q, n in zip(QUESTIONS[1:], lengths[1:])]
            together = [first.result()] + [f.result() for f in later]
        assert [t for t, _ in together] == [t for t, _ in alone]
        cached = [c for _, c in together]
        assert cached[0] == 0 and min(cached[1:]) > 60  # the system prompt and the template's head, from a slot's cache

        def counters() -> dict[str, int]:
            with urllib.request.urlopen(svc4.url + "/metrics", timeout=30) as r:
                lines = r.read().decode().splitlines()
            return {k: int(float(v)) for k, v in (line.split() for line in lines if line.startswith("moe_pipe_prompt_tokens"))}

        deadline = time.monotonic() + 10  # a Done is counted as the gateway takes it, which may be just after the stream's end
        while (c := counters())["moe_pipe_prompt_tokens_cached_total"] != sum(cached) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c["moe_pipe_prompt_tokens_cached_total"] == sum(cached), (c, cached)
        assert min(cached[1:]) <= c["moe_pipe_prompt_tokens_shared_total"] <= sum(cached), (c, cached)
    finally:
        svc4.close()
