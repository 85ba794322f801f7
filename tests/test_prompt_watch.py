"""A prompt's pass, watched (shared/model/prompt_watch.py): `processed` counts
token-layers over the layers, so it grows after every layer of a layer-major
chunk and reaches `total` exactly at the last chunk's last layer; events come
in order, at most four a second plus the opening and closing ones; the Stop
check is asked at most every POLL_INTERVAL_S, only while a prompt runs; a
stopped pass puts a recurrent state back to its last chunk's end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_pipe.shared.model.blocks import RecurrentState
from moe_pipe.shared.model.prompt_watch import POLL_INTERVAL_S, PROGRESS_INTERVAL_S, PromptProgress, PromptWatch


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def run_chunks(watch: PromptWatch, chunks: list[int], n_layer: int, clock: Clock | None = None, step_s: float = 0.0) -> None:
    """What `MoEModel.prefill` does with the watch as its layer observer: each chunk through every layer."""
    for t in chunks:
        for i in range(n_layer):
            if clock is not None:
                clock.t += step_s
            watch.layer_done(i, t)


def test_processed_grows_layer_by_layer_and_is_total_only_at_the_end():
    sent: list[PromptProgress] = []
    watch = PromptWatch(4, sent.append, interval_s=0.0)
    watch.begin(total=14, cached=2)  # 12 tokens to compute: chunks of 8 and 4
    run_chunks(watch, [8, 4], 4)
    watch.end()
    assert [p.processed for p in sent] == [
        2,  # the opening event: processed == cached
        2 + 8 * 1 // 4,
        2 + 8 * 2 // 4,
        2 + 8 * 3 // 4,
        2 + 8,  # the first chunk's last layer: its 8 tokens are done
        2 + 8 + 4 * 1 // 4,
        2 + 8 + 4 * 2 // 4,
        2 + 8 + 4 * 3 // 4,
        14,  # the closing event: the last layer's own event is left to it, so total comes once, last
    ]
    assert all(p.total == 14 and p.cache == 2 for p in sent)


def test_events_come_at_most_four_a_second_in_order_and_end_at_total():
    clock = Clock()
    sent: list[PromptProgress] = []
    watch = PromptWatch(48, sent.append, clock=clock)
    watch.begin(total=3664, cached=0)
    run_chunks(watch, [2048, 1616], 48, clock, step_s=0.02)  # a layer every 20 ms: 96 layers, 1.92 s
    watch.end()
    times = [p.time_ms for p in sent]
    processed = [p.processed for p in sent]
    assert processed[0] == 0 and processed[-1] == 3664 and sent[-1].time_ms == 1920
    assert processed == sorted(set(processed))  # strictly growing
    middle = times[1:-1]
    assert all(b - a >= PROGRESS_INTERVAL_S * 1e3 - 1 for a, b in zip(middle, middle[1:]))
    assert len(sent) <= 2 + 1.92 / PROGRESS_INTERVAL_S + 1
    # the rate they show: the first chunk's 2,048 tokens over 48 layers of 20 ms each
    assert sent[1].processed == 2048 * round(sent[1].time_ms / 20) // 48


def test_a_short_prompt_sends_its_opening_and_closing_events_only():
    clock = Clock()
    sent: list[PromptProgress] = []
    watch = PromptWatch(4, sent.append, clock=clock)
    watch.begin(total=7, cached=3)
    run_chunks(watch, [4], 4, clock, step_s=0.001)
    watch.end()
    assert [(p.cache, p.processed) for p in sent] == [(3, 3), (3, 7)]


def test_the_stop_check_is_asked_at_most_every_poll_interval_and_only_for_a_prompt():
    clock = Clock()
    asked: list[float] = []
    watch = PromptWatch(4, lambda p: None, check=lambda: asked.append(clock.t), clock=clock)
    run_chunks(watch, [1], 4, clock, step_s=1.0)  # a decoded token: not a prompt
    watch.poll()
    assert asked == []
    watch.begin(total=100, cached=0)
    for _ in range(100):  # experts every 10 ms
        clock.t += 0.01
        watch.poll()
    assert len(asked) == int(1.0 / POLL_INTERVAL_S)
    assert all(b - a >= POLL_INTERVAL_S - 1e-9 for a, b in zip(asked, asked[1:]))
    watch.end()
    clock.t += 1.0
    watch.poll()
    assert len(asked) == int(1.0 / POLL_INTERVAL_S)  # disarmed


class Stop(Exception):
    pass


def test_a_stop_puts_a_recurrent_state_back_to_its_last_chunk_s_end():
    """The layers update the state in place (here: each adds its chunk's size);
    a Stop in the second chunk's third layer leaves the state the first chunk made."""
    state = RecurrentState([0, 2], kernel=3, channels=3, heads=1, d_k=2, d_v=2)
    cache = SimpleNamespace(state=state)
    calls = {"n": 0}

    def check() -> None:
        calls["n"] += 1
        if calls["n"] == 4 + 3:  # chunk 2, layer 2
            raise Stop

    watch = PromptWatch(4, lambda p: None, check=check, poll_s=0.0)
    watch.begin(total=12, cached=0, cache=cache)
    with pytest.raises(Stop):
        for t in (8, 4):
            for i in range(4):
                for a in (*state.conv.values(), *state.delta.values()):
                    a += t  # layer i's in-place update
                watch.layer_done(i, t)
    watch.abort()
    assert all((a == 8 * 4).all() for a in (*state.conv.values(), *state.delta.values()))  # the first chunk's four layers
    assert not watch.armed


def test_a_stop_in_the_first_chunk_puts_back_the_state_the_prompt_started_from():
    state = RecurrentState([1], kernel=2, channels=3, heads=1, d_k=1, d_v=2)
    state.conv[1][:] = 5.0
    state.delta[1][:] = 7.0
    watch = PromptWatch(2, lambda p: None, check=lambda: (_ for _ in ()).throw(Stop()), poll_s=0.0)
    watch.begin(total=4, cached=1, cache=SimpleNamespace(state=state))
    state.conv[1] += 1
    state.delta[1] *= 3
    with pytest.raises(Stop):
        watch.layer_done(0, 3)
    watch.abort()
    assert (state.conv[1] == 5.0).all() and (state.delta[1] == 7.0).all()
