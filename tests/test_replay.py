"""The policy simulator: the reader's order, both budget accountings, agreement
with the live reader's code, the published curves of the phone traces, and
the `moe-pipe replay` command."""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from moe_pipe.shared.analysis.replay import ByteTable, Replayer, ReplayError, fetches, slab_bytes, split_fetches, sweep
from moe_pipe.shared.experts.cache import SlabTable
from moe_pipe.shared.experts.policies import DEFAULT_POLICY, LIVE_POLICIES, POLICIES
from moe_pipe.shared.model.trace import DECODE, PROMPT, TraceHeader, TraceWriter, read_trace
from moe_pipe.shared.wire import messages as m

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def traces_dir() -> Path | None:
    """The phone traces: $MOE_PIPE_ROUTE_TRACES, else shared/data/route-traces in the repo's parent folder (outside the repo)."""
    for d in (os.environ.get("MOE_PIPE_ROUTE_TRACES"), ROOT.parent / "shared" / "data" / "route-traces"):
        if d and (Path(d) / "qwen.route.csv").is_file() and (Path(d) / "gptoss.route.csv").is_file():
            return Path(d)
    return None


def phone_trace(name: str) -> Path:
    d = traces_dir()
    if d is None:
        pytest.skip("the phone route traces are not here (set MOE_PIPE_ROUTE_TRACES to their folder)")
    return d / f"{name}.route.csv"


def published(name: str) -> dict[tuple[int, str], dict[str, float]]:
    path = phone_trace(name).with_name(f"{name}-replay-curve.csv")
    return {
        (int(r["budget_mib"]), r["policy"]): {k: float(v) for k, v in r.items() if k not in ("budget_mib", "policy")}
        for r in csv.DictReader(path.open())
    }


def small_trace(tmp_path, decode_tokens, prompt=None, n_layer=1, n_expert=8, k=2, sizes=None) -> Path:
    """A trace from lists: prompt [T, K] per layer (one batch), decode tokens [K] per layer."""
    h = TraceHeader("m", "qwen3moe", n_layer, n_expert, k, tuple(sizes or [MIB] * n_layer), (0,) * n_layer)
    p = tmp_path / "t.csv"
    with TraceWriter(p) as w:
        w.write_header(h)
        if prompt is not None:
            for layer in range(n_layer):
                w.write_routing(0, PROMPT, 0, layer, prompt, np.ones(np.shape(prompt)), np.zeros(np.shape(prompt)))
        step = 0 if prompt is None else len(prompt)
        for i, ids in enumerate(decode_tokens):
            for layer in range(n_layer):
                w.write_routing(0, DECODE, step + i, layer, ids, [1.0] * k, [0] * k)
    return p


# -- the fetches: what the reader is asked --------------------------------------------


def test_a_prompt_batch_is_one_fetch_per_layer_deduplicated(tmp_path):
    t = read_trace(small_trace(tmp_path, [[1, 2], [2, 3]], prompt=[[5, 6], [6, 7], [5, 1]], n_layer=2))
    fs = fetches(t)
    assert [(f.phase, f.layer, [e for _, e in f.keys]) for f in fs] == [
        (PROMPT, 0, [5, 6, 7, 1]),
        (PROMPT, 1, [5, 6, 7, 1]),
        (DECODE, 0, [1, 2]),
        (DECODE, 1, [1, 2]),
        (DECODE, 0, [2, 3]),
        (DECODE, 1, [2, 3]),
    ]
    # compute splits a batch that routes to more experts than slabs
    assert [len(f.keys) for f in split_fetches(fs, 3)] == [3, 1, 3, 1, 2, 2, 2, 2]


def test_hits_are_refreshed_before_misses_are_admitted(tmp_path):
    # 2 slabs of 1 MiB. After [0, 1] (LRU order 0, 1) comes [2, 0]: the reader
    # refreshes and pins 0 first, so 2 evicts 1, and 0 hits again in [1, 0].
    # In routing order 2 would evict 0, and 0 would then evict 1: one hit.
    t = read_trace(small_trace(tmp_path, [[0, 1], [2, 0], [1, 0]], k=2))
    r = Replayer(t).run(2, "lru")
    assert r.n_slabs == 2
    assert r.hits == (0, 2) and r.lookups == (0, 6)


def test_byte_accounting_fits_by_size(tmp_path):
    # layer 0 experts are 3 MiB, layer 1 experts 1 MiB; a 4 MiB budget holds one of each
    # (bytes) but only one slab of 3 MiB (slabs accounting), so a 1-token cycle hits in bytes only.
    p = small_trace(tmp_path, [[1], [1], [1]], n_layer=2, k=1, sizes=[3 * MIB, MIB])
    t = read_trace(p)
    by_bytes = Replayer(t, "bytes").run(4, "lru")
    by_slabs = Replayer(t, "slabs").run(4, "lru")
    assert by_bytes.hits == (0, 4) and by_slabs.hits == (0, 0)
    assert by_slabs.n_slabs == 1 and by_bytes.read_bytes == (0, 4 * MIB)
    assert by_slabs.read_mib == 3 * (3 + 1)


def test_byte_table_evicts_until_the_newcomer_fits():
    from moe_pipe.shared.experts.policies import LRU

    t = ByteTable(10, LRU())
    for key, size in (("a", 4), ("b", 3), ("c", 3)):
        t.admit(key, size)
    t.pin("a")
    assert t.admit("d", 6) == (0, "c") and "b" not in t and "a" in t  # b and c go, a is pinned
    assert t.used == 10


def test_replay_agrees_with_the_live_reader(tmp_path):
    """The reader's own code (procs/reader.py on_fetch / on_read_done /
    on_release) driven with the trace's fetches as compute sends them gives
    the replay's counts: a layer whose experts are all cached sends nothing
    and its hits reach the reader later (`touched`, in the next Fetch or the
    token's Release), which must not change what the policy decides."""
    from moe_pipe.procs.reader import Reader
    from moe_pipe.shared.experts.hotset import Heat

    t = read_trace(ROOT / "shared" / "data" / "traces" / "gptoss.route.csv")  # the shipped copy: runs in CI too
    n_slabs = 160
    for policy in LIVE_POLICIES:
        rd = Reader.__new__(Reader)  # no sockets, files or arena: just its bookkeeping
        rd.table = SlabTable(n_slabs, policy)
        rd.inflight, rd.pinned, rd.guess_io, rd.blocked, rd.limit_waiting = {}, defaultdict(list), [0, 0], [], None
        rd.heat, rd.warm = Heat(4 * n_slabs), None  # the hot set's heat is kept apart from the policy: no warm start here
        rd.layout = type(
            "L",
            (),
            {
                "layers": range(t.header.n_layer),
                "expert_bytes": lambda s, i: t.header.expert_bytes[i],
                "spec": type("S", (), {"n_expert": t.header.n_expert})(),
            },
        )()
        # the residency index: what the reader writes to it (slabs, and the pinned / in-flight states) is not compared here
        rd.index = type(
            "I",
            (),
            {
                "clear": lambda s, k: None,
                "publish": lambda s, k, slab: None,
                "mark_pinned": lambda s, k, on: None,
                "mark_inflight": lambda s, k, on: None,
            },
        )()
        reads = []
        rd.lanes = type(
            "X",
            (),
            {"submit": lambda s, key, slab, priority=0, reads=reads: reads.append((key, slab)), "withdraw_guesses": lambda s, keep=(): []},
        )()
        sent = []
        rd.send = sent.append
        rd.send_ready = lambda req, key, slab, hit, io_ns, sent=sent: sent.append(("ready", key, hit))
        done, touched, last_layer, quiet = [], [], -1, 0
        for req, f in enumerate(fetches(t), 1):
            if f.layer <= last_layer:  # a new token: the last one's Release
                rd.on_release(m.Release(tuple(done), tuple(touched)))
                done, touched = [], []
            last_layer = f.layer
            resident = tuple(e for _, e in f.keys if (f.layer, e) in rd.table)  # what the index shows
            missing = tuple(e for _, e in f.keys if (f.layer, e) not in rd.table)
            if not missing:
                touched += [(f.layer, e) for e in resident]
                quiet += 1
                continue
            rd.on_fetch(m.Fetch(req, f.layer, missing, resident, tuple(done), tuple(touched)))
            done, touched = [req], []
            while reads:  # every read lands before compute is done with the layer
                rd.on_read_done(*reads.pop(0), 0, (), None)
        rd.on_release(m.Release(tuple(done), tuple(touched)))
        assert quiet > 0  # the trace has all-hit layers: the deferral is exercised
        assert not any(isinstance(x, m.FetchFailed) for x in sent)
        assert not any(rd.table.pins(k) for k in rd.table.resident())
        r = Replayer(t).run(n_slabs * slab_bytes(t) / MIB, policy)
        assert r.n_slabs == n_slabs
        assert (rd.table.stats.hits, rd.table.stats.misses) == (sum(r.hits), sum(r.lookups) - sum(r.hits)), policy


# -- the published curves --------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen", "gptoss"])
def test_lru_and_belady_match_the_published_curves(name):
    """BigMoeOnEdge counted each expert at its own size (bytes): we match it to
    0.1 point. The engine's equal slabs (slabs accounting) hold fewer Qwen experts
    (3,059,712 and 2,654,208-byte layers share 3,059,712-byte slabs): up to
    2.2 points lower, still within 2.5."""
    t = read_trace(phone_trace(name))
    pub = published(name)
    for accounting, tolerance in (("bytes", 0.1), ("slabs", 2.5)):
        rp = Replayer(t, accounting)
        for budget in (2000, 3000, 4000):
            for policy in ("lru", "belady"):
                r = rp.run(budget, policy)
                want = pub[(budget, policy)]
                assert abs(r.hit_pct_decode - want["hit_pct_decode"]) <= tolerance, (accounting, budget, policy, r.row())
                if accounting == "bytes":
                    assert abs(r.hit_pct_cum - want["hit_pct_cum"]) <= tolerance
                    assert abs(r.read_mib - want["read_mib"]) / want["read_mib"] < 0.002


def test_replaying_the_phone_engines_own_lru_gives_the_hit_rate_it_recorded():
    """Qwen was recorded with that engine's LRU at 4000 MiB (byte budget): its
    residency column is our replay's hits, to the expert."""
    t = read_trace(phone_trace("qwen"))
    r = Replayer(t, "bytes").run(4000, "lru")
    assert r.hits[DECODE] == int(t.residency[t.phase == DECODE].sum()) == 29597
    assert r.read_bytes[PROMPT] == int(t.expert_bytes[t.phase == PROMPT].sum())


@pytest.mark.parametrize("name", ["qwen", "gptoss"])
def test_the_default_policy_beats_lru(name):
    t = read_trace(phone_trace(name))
    for accounting in ("slabs", "bytes"):
        rp = Replayer(t, accounting)
        for budget in (2000, 3000, 4000):
            lru, best = rp.run(budget, "lru"), rp.run(budget, DEFAULT_POLICY)
            assert best.hit_pct_decode > lru.hit_pct_decode + 1.0, (accounting, budget, lru.row(), best.row())


def test_belady_is_the_ceiling_on_the_phone_traces():
    t = read_trace(phone_trace("gptoss"))
    results = sweep(t, [1500, 3000])
    for budget in (1500, 3000):
        rows = {r.policy: r for r in results if r.budget_mb == budget}
        assert max(rows.values(), key=lambda r: sum(r.hits)).policy == "belady"


# -- errors --------------------------------------------------------------------------------


def test_budget_and_policy_errors(tmp_path):
    t = read_trace(small_trace(tmp_path, [[1, 2]], k=2))
    rp = Replayer(t)
    with pytest.raises(
        ReplayError,
        match=r"t.csv: a budget of 1 MiB holds 1 slab\(s\) of 1.00 MiB, fewer than one layer's top-2 experts; use --budget-mb 2 or more",
    ):
        rp.run(1, "lru")
    with pytest.raises(ReplayError, match="positive number"):
        rp.run(float("nan"), "lru")
    with pytest.raises(ReplayError, match="unknown cache policy 'mru'; allowed: all, lru"):
        sweep(t, [8], ["mru"])
    with pytest.raises(ReplayError, match="unknown accounting"):
        Replayer(t, "pages")


# -- the command -----------------------------------------------------------------------------


def test_replay_command_json(tmp_path, capsys):
    from moe_pipe.cli.main import main

    p = small_trace(tmp_path, [[1, 2], [2, 3], [1, 2]], prompt=[[1, 4]], k=2)
    assert main(["replay", str(p), "--budget-mb", "3", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["default_policy"] == DEFAULT_POLICY
    assert [(r["budget_mb"], r["policy"]) for r in out["rows"]] == [(b, n) for b in (3, 8) for n in POLICIES]
    for r in out["rows"]:
        assert {"budget_mb", "policy", "hit_pct_cum", "hit_pct_decode", "read_mib"} <= set(r)
    assert main(["replay", str(p), "--budget-mb", "8", "--policy", "lru", "belady", "--accounting", "bytes"]) == 0
    table = capsys.readouterr().out
    assert "hit % decode" in table and "belady" in table and "lfu" not in table


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["nope.csv", "--budget-mb", "100"], "nope.csv: no such file"),
        (["TRACE", "--budget-mb", "1"], "fewer than one layer's top-2 experts"),
        (["TRACE", "--budget-mb", "100", "--policy", "fifo"], "unknown cache policy 'fifo'"),
        (["BAD", "--budget-mb", "100"], "bad.csv:5: column expert must be an integer, got 'one'"),
    ],
)
def test_replay_command_errors_are_one_line_exit_2(tmp_path, capsys, argv, problem):
    from moe_pipe.cli.main import main

    good = small_trace(tmp_path, [[1, 2]], k=2)
    bad = tmp_path / "bad.csv"
    bad.write_text(good.read_text().replace("0,1,0,0,0,1,1,0", "0,1,0,0,0,one,1,0"))
    argv = [str({"TRACE": good, "BAD": bad}.get(a, a)) for a in argv]
    assert main(["replay", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-pipe: error: ") and problem in err and "\n" not in err


# -- the drop-cold lever in the simulator -----------------------------------------


def test_drop_cold_skips_only_light_misses(tmp_path):
    from moe_pipe.shared.analysis.replay import TraceFetch, drop_cold_keys
    from moe_pipe.shared.experts.cache import SlabTable

    table = SlabTable(4, "lru")
    table.admit((0, 3))
    f = TraceFetch(DECODE, 0, ((0, 1), (0, 2), (0, 3)), (0.6, 0.3, 0.1))  # even share 1/3
    assert drop_cold_keys(f, table, 0.0) == f.keys
    assert drop_cold_keys(f, table, 1.0) == ((0, 1), (0, 3))  # (0, 2) light and missing; (0, 3) light but cached
    assert drop_cold_keys(TraceFetch(DECODE, 0, ((0, 5), (0, 6)), (0.5, 0.5)), table, 1.01) == ((0, 5),)  # never all
    assert drop_cold_keys(TraceFetch(PROMPT, 0, ((0, 1),), ()), table, 1.0) == ((0, 1),)  # prompts stay exact


def test_drop_cold_on_the_phone_trace_reads_less():
    trace = read_trace(phone_trace("qwen"))
    rp = Replayer(trace)
    exact, lossy = rp.run(2000, "lru"), rp.run(2000, "lru", drop_cold=1.0)
    assert rp.run(2000, "lru", drop_cold=0.0) == exact
    assert lossy.read_mib < exact.read_mib and lossy.lookups[DECODE] < exact.lookups[DECODE]
    assert lossy.hit_pct_decode > exact.hit_pct_decode
