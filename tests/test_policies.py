"""The two-clock policy `nextmix` (shared/experts/policies.py): its eviction
order on hand-built accesses where it parts from lru and nextuse, the router
scores it can read, a replay's exact hit count, and the config's policy list."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.analysis.replay import Replayer, ReplayError
from moe_pipe.shared.config import load_config
from moe_pipe.shared.errors import ConfigError
from moe_pipe.shared.experts.cache import SlabTable
from moe_pipe.shared.experts.policies import DEFAULT_POLICY, LIVE_POLICIES, LRU, POLICIES, NextMix, NextUse
from moe_pipe.shared.model.trace import DECODE, TraceHeader, TraceWriter, read_trace

A, B, C, D = ((0, e) for e in range(4))
X = (1, 0)  # layer 1's one expert: makes every token two passes, layer 0 then layer 1


def tokens(layer0: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """One fetch per layer per token, as the reader sees decode: [key at layer 0], [X]."""
    return [f for key in layer0 for f in ([key], [X])]


def evictions(policy, fetches, n_slabs: int) -> list:
    """Drive a SlabTable in the reader's order; the evicted keys, in order."""
    t = SlabTable(n_slabs, policy)
    out = []
    for fetch in fetches:
        missed = [k for k in fetch if t.lookup(k) is None]
        for k in fetch:
            if k not in missed:
                t.pin(k)
        for k in missed:
            evicted = t.admit(k, pin=True)[1]
            if evicted is not None:
                out.append(evicted)
        for k in fetch:
            t.unpin(k)
    return out


def test_nextmix_keeps_the_frequent_key_lru_drops():
    # A three times, then B, C once each; D needs a slab. LRU drops A, the oldest;
    # nextmix drops B: one use, and older than C's.
    seq = tokens([A, A, A, B, C, D])
    assert evictions(LRU(), seq, 4) == [A]
    assert evictions(NextMix(4), seq, 4) == [B]


def test_nextmix_short_clock_keeps_the_recently_busy_key_nextuse_drops():
    # A six times long ago, C four times, then B three times, then D.
    # lru: A (oldest). nextuse (one slow clock): B, the fewest uses. nextmix:
    # B's three uses are the last three tokens, so its short clock keeps it; C goes.
    seq = tokens([A] * 6 + [C] * 4 + [B] * 3 + [D])
    assert evictions(LRU(), seq, 4) == [A]
    assert evictions(NextUse(4, half_life=64), seq, 4) == [B]
    assert evictions(NextMix(4, half_life=64), seq, 4) == [C]


def test_nextmix_reads_the_routers_scores():
    # A, B, C used once each at layer 0 (X between them at layer 1); D comes. Without
    # scores the oldest of equals goes (A); the router gave A 0.9 and C 0.1 for this
    # token and B nothing, so with scores B goes.
    def victim(scores) -> tuple:
        pol = NextMix(4, score_weight=0.5)
        t = SlabTable(4, pol)
        for key in (A, X, B, X, C, X):
            if t.lookup(key) is None:
                t.admit(key)
        if scores is not None:
            pol.on_scores(0, scores, 1)
        return t.admit(D)[1]

    assert victim(None) == A
    assert victim(np.array([0.9, 0.0, 0.1, 0.0])) == B


def test_nextmix_respects_pins_and_answers_none_when_all_is_pinned():
    t = SlabTable(2, NextMix(2))
    t.admit(A, pin=True)
    t.admit(B, pin=True)
    assert t.policy.victim(t._evictable) is None
    t.unpin(A)
    assert t.admit(C)[1] == A


def test_nextmix_needs_layer_expert_keys():
    with pytest.raises(TypeError, match=r"nextmix keys are \(layer, expert\) pairs, got 'a'"):
        NextMix(2).on_admit("a")


# -- a replay's exact count ------------------------------------------------------------


def short_trace(tmp_path):
    """2 layers, top-2 of 6, 1 MiB experts, 12 decoded tokens of a fixed pattern."""
    h = TraceHeader("m", "qwen3moe", 2, 6, 2, (1 << 20,) * 2, (0, 0))
    pattern = [[0, 1], [0, 2], [0, 1], [3, 4], [0, 1], [5, 2], [0, 3], [0, 1], [4, 5], [0, 1], [2, 3], [0, 1]]
    p = tmp_path / "t.csv"
    with TraceWriter(p) as w:
        w.write_header(h)
        for step, ids in enumerate(pattern):
            for layer in range(2):
                w.write_routing(0, DECODE, step, layer, ids, [0.5, 0.5], [0, 0])
    return read_trace(p)


def reference_lru_hits(fetches, n_slabs: int) -> int:
    """LRU in the reader's order, from scratch: hits refreshed first, then misses admitted."""
    order: list = []  # coldest first
    hits = 0
    for keys in fetches:
        resident = [k for k in keys if k in order]
        hits += len(resident)
        for k in resident:
            order.remove(k)
            order.append(k)
        for k in keys:
            if k not in resident:
                victim = next(v for v in order if v not in keys) if len(order) == n_slabs else None
                if victim is not None:
                    order.remove(victim)
                order.append(k)
    return hits


def test_replay_of_a_short_trace_gives_known_hit_counts(tmp_path):
    # 48 lookups (12 tokens x 2 layers x top-2) through 5 slabs of 1 MiB. lru is checked
    # against a from-scratch simulation; the rest are this code's counts, held so that a
    # change in any policy shows (belady, the optimum, above all).
    t = short_trace(tmp_path)
    rp = Replayer(t)
    got = {p: rp.run(5, p).hits[DECODE] for p in ("lru", "nextuse", "nextmix", "belady")}
    assert got["lru"] == reference_lru_hits([f.keys for f in rp.fetches_for(5)], 5) == 6
    assert got == {"lru": 6, "nextuse": 19, "nextmix": 19, "belady": 20}
    assert rp.run(5, "nextmix").lookups == (0, 48)


def test_replay_hands_the_router_scores_to_the_policy(tmp_path):
    t = short_trace(tmp_path)
    seen = []

    class Spy(NextMix):
        def on_scores(self, layer, probs, top_k):
            seen.append((layer, int(np.argmax(probs)), top_k))
            super().on_scores(layer, probs, top_k)

    scores = np.eye(6)[np.arange(24) % 6]  # decode fetch i: all mass on expert i % 6
    Replayer(t, scores=scores).run(5, ("spy", lambda n: Spy(n, score_weight=0.3)))
    assert seen == [(i % 2, i % 6, 2) for i in range(24)]
    with pytest.raises(ReplayError, match="23 rows of router scores for 24 decode fetches"):
        Replayer(t, scores=scores[:23])


# -- the config ------------------------------------------------------------------------


def test_config_accepts_every_live_policy_and_refuses_others_in_one_line(tmp_path):
    assert "nextmix" in LIVE_POLICIES and DEFAULT_POLICY in LIVE_POLICIES
    p = tmp_path / "c.toml"
    for name in LIVE_POLICIES:
        p.write_text(f'[cache]\npolicy = "{name}"\n')
        assert load_config(p).cache.policy == name
    for bad in ("nextmax", "belady"):
        p.write_text(f'[cache]\npolicy = "{bad}"\n')
        with pytest.raises(ConfigError) as exc:
            load_config(p)
        msg = str(exc.value)
        assert "\n" not in msg and bad in msg and "allowed:" in msg, msg
        assert all(f'"{name}"' in msg for name in LIVE_POLICIES), msg
    assert set(LIVE_POLICIES) < set(POLICIES)
