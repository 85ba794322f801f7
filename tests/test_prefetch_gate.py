"""Next-layer prefetch switches itself off per layer where its guesses stop
paying (procs/compute.py GuessGate), and comes back to try again."""

from __future__ import annotations

from moe_pipe.procs.compute import GuessGate
from moe_pipe.shared.wire.messages import TokenRecord


def test_a_layer_whose_guesses_are_wasted_stops_guessing_then_tries_again():
    gate = GuessGate(window=8, min_used=0.25, pause=3)
    for _ in range(3):  # 6 guessed experts, 1 used: not judged before 8
        assert gate.allow(5)
        gate.score(5, 2, 0 if _ else 1)
    assert gate.allow(5) and gate.switched_off == 0
    gate.score(5, 2, 0)  # 8 issued, 1 used < a quarter: off
    assert gate.switched_off == 1
    assert [gate.allow(5) for _ in range(4)] == [False, False, False, True]  # its next 3 guesses skipped, then again
    assert gate.allow(4)  # other layers are judged on their own


def test_a_layer_whose_guesses_pay_keeps_guessing():
    gate = GuessGate(window=8, min_used=0.25, pause=3)
    for _ in range(20):
        assert gate.allow(1)
        gate.score(1, 4, 1)  # exactly a quarter used
    assert gate.switched_off == 0


def test_a_layer_is_judged_afresh_after_its_pause():
    gate = GuessGate(window=4, min_used=0.5, pause=1)
    gate.score(0, 4, 0)
    assert not gate.allow(0) and gate.allow(0)
    gate.score(0, 4, 3)  # the old misses do not count against it
    assert gate.allow(0) and gate.switched_off == 1


def test_skipped_guesses_are_a_telemetry_column():
    assert TokenRecord(1, 1.0, 1.0, 0.0, 0, 0.0, 0.0, 0.0, 0, 1.0, prefetch_paused=2).prefetch_paused == 2
