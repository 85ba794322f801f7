"""Route traces: read → write round trips (bit-exact on the phone traces), the
writer's append and flush behaviour, and one-line errors naming file:line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from moe_pipe.shared.model.trace import COLUMNS, DECODE, HEADER_ROW, PROMPT, TraceError, TraceHeader, TraceWriter, read_trace, write_trace

from .test_replay import phone_trace

HEADER = TraceHeader("/models/tiny moe.gguf", "qwen3moe", 3, 8, 2, (4096, 8192, 4096), (100, 200, 100))


def write_small(path, header=HEADER, turn=0) -> None:
    """A prompt batch of 3 tokens, then 2 decoded tokens, every layer."""
    rng = np.random.default_rng(turn)
    with TraceWriter(path) as w:
        w.write_header(header)
        prompt = rng.integers(0, header.n_expert, (3, 2))  # [T, K]; repeats across tokens on purpose
        prompt[1] = prompt[0]
        for layer in range(header.n_layer):
            w.write_routing(turn, PROMPT, 0, layer, prompt, np.full((3, 2), 0.5), np.zeros((3, 2), int))
        for step in (3, 4):
            for layer in range(header.n_layer):
                ids = rng.choice(header.n_expert, 2, replace=False)
                w.write_routing(turn, DECODE, step, layer, ids, rng.random(2), [1, 0])


def test_writer_round_trips_with_the_reader(tmp_path):
    p = tmp_path / "t.csv"
    write_small(p)
    t = read_trace(p)
    assert t.header == HEADER
    assert len(t) == 3 * (3 * 2) + 2 * 3 * 2
    assert t.first_row_line == 3 + 3 + 1  # magic, model, 3 layer lines, column row
    prompt = t.phase == PROMPT
    assert t.step[prompt].tolist() == [s for _ in range(3) for s in (0, 0, 1, 1, 2, 2)]
    assert t.slot.tolist()[:4] == [0, 1, 0, 1]
    # read bytes: once per expert per prompt batch, 0 on a hit
    layer0 = prompt & (t.layer == 0)
    first = {}
    for e, b in zip(t.expert[layer0].tolist(), t.expert_bytes[layer0].tolist()):
        assert b == (0 if e in first else 4096)
        first[e] = True
    dec = ~prompt
    assert (t.expert_bytes[dec] == np.where(t.residency[dec] == 1, 0, np.array(HEADER.expert_bytes)[t.layer[dec]])).all()
    # writing what was read gives the same bytes
    q = tmp_path / "again.csv"
    write_trace(q, t)
    assert q.read_bytes() == p.read_bytes()


def test_phone_traces_round_trip_bit_exact(tmp_path):
    for name in ("qwen", "gptoss"):
        src = phone_trace(name)
        t = read_trace(src)
        out = tmp_path / f"{name}.csv"
        write_trace(out, t)
        assert out.read_bytes() == src.read_bytes()


def test_the_writer_records_what_the_phone_engine_recorded(tmp_path):
    """Fed the phone trace group by group (a prompt batch per layer, a token per
    layer), the writer computes the same expert_bytes and writes the same file."""
    src = phone_trace("gptoss")
    t = read_trace(src)
    k = t.header.n_expert_used
    out = tmp_path / "w.csv"
    with TraceWriter(out) as w:
        w.write_header(t.header)
        change = np.flatnonzero(np.diff(t.layer) != 0) + 1
        for a, b in zip([0, *change.tolist()], [*change.tolist(), len(t)]):
            for c in range(a, b, k if t.phase[a] == DECODE else b - a):  # decode: one token at a time
                end = b if t.phase[a] == PROMPT else c + k
                w.write_routing(
                    int(t.turn[c]),
                    int(t.phase[c]),
                    int(t.step[c]),
                    int(t.layer[c]),
                    t.expert[c:end].reshape(-1, k),
                    t.weight[c:end].reshape(-1, k),
                    t.residency[c:end].reshape(-1, k),
                )
    assert out.read_bytes() == src.read_bytes()


def test_appending_keeps_one_header_and_counts_turns(tmp_path):
    p = tmp_path / "t.csv"
    write_small(p, turn=0)
    w = TraceWriter(p)
    assert w.next_turn == 1
    w.close()
    write_small(p, turn=1)
    t = read_trace(p)
    assert sorted(set(t.turn.tolist())) == [0, 1]
    assert p.read_text().count("# route_trace v1") == 1
    other = TraceHeader("other.gguf", "gpt-oss", 3, 8, 2, (1, 2, 3), (0, 0, 0))
    with TraceWriter(p) as w, pytest.raises(TraceError, match="cannot append"):
        w.write_header(other)


def test_a_token_is_on_disk_after_its_last_layer(tmp_path):
    p = tmp_path / "t.csv"
    w = TraceWriter(p)
    w.write_header(HEADER)
    for layer in range(HEADER.n_layer):
        w.write_routing(0, DECODE, 0, layer, [1, 2], [0.6, 0.4], [0, 0])
    assert len(read_trace(p)) == 6  # not closed yet: a killed run keeps its whole tokens
    w.close()


def test_header_from_a_layout():
    spec = SimpleNamespace(arch="qwen3moe", n_layer=2, n_expert=4, n_expert_used=2)
    layout = SimpleNamespace(spec=spec, dense_bytes=1000, expert_bytes=lambda i: (300, 500)[i])
    h = TraceHeader.from_layout("m.gguf", layout, top_k=1)
    assert (h.n_expert_used, h.expert_bytes, h.dense_bytes, h.max_expert_bytes) == (1, (300, 500), (500, 500), 500)


# -- errors: one line, file:line, the problem ---------------------------------------


def lines_of_small(tmp_path) -> list[str]:
    p = tmp_path / "ok.csv"
    write_small(p)
    return p.read_text().splitlines()


@pytest.mark.parametrize(
    "line_no, new, problem",
    [
        (1, "# route_trace v2", "not a route trace"),
        (2, "# model=x arch=y n_layer=3", "expected '# model="),
        (2, "# model=x arch=y n_layer=3 n_expert=8 n_expert_used=9", "impossible model shape"),
        (4, "# layer=2 expert_bytes=1 dense_bytes=1", "in order"),
        (5, "# layer=2 expert_bytes=0 dense_bytes=1", "expert_bytes=0"),
        (6, "turn,phase,step,layer,expert,slot,weight,residency,expert_bytes", "column row"),
        (7, "0,0,0,0,0,1,0.5,0", "expected 9 comma-separated fields"),
        (8, "0,0,0,0,0,x,0.5,0,0", "column expert must be an integer"),
        (9, "0,0,0,0,0,1,abc,0,0", "column weight must be a number"),
        (10, "0,0,0,0,0,8,0.5,0,0", "column expert = 8 is out of range (allowed 0..7"),
        (11, "0,2,0,0,0,1,0.5,0,0", "column phase = 2"),
        (12, "0,0,0,3,0,1,0.5,0,0", "column layer = 3"),
        (13, "0,0,0,0,2,1,0.5,0,0", "column slot = 2"),
        (14, "0,0,0,0,0,1,0.5,0,-1", "column expert_bytes = -1"),
    ],
)
def test_malformed_traces_name_the_line(tmp_path, line_no, new, problem):
    lines = lines_of_small(tmp_path)
    lines[line_no - 1] = new
    p = tmp_path / "bad.csv"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as err:
        read_trace(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}:{line_no}: ") and problem in msg and "\n" not in msg


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(TraceError, match=":1: not a route trace"):
        read_trace(tmp_path / "empty.csv")
    (tmp_path / "hdr.csv").write_text(HEADER.text())
    t = read_trace(tmp_path / "hdr.csv")  # a header and no rows is a valid, empty trace
    assert len(t) == 0 and t.header == HEADER and HEADER_ROW == ",".join(COLUMNS)


def test_the_header_alone_is_the_whole_reads_header(tmp_path):
    from moe_pipe.shared.analysis.fit import TRACE_DIR
    from moe_pipe.shared.model.trace import read_trace_header

    for name in ("qwen.route.csv", "gptoss.route.csv"):  # the shipped traces
        assert read_trace_header(TRACE_DIR / name) == read_trace(TRACE_DIR / name).header
    bad = tmp_path / "bad.csv"
    bad.write_text("# route_trace v1\nnot a model line\n")
    with pytest.raises(TraceError, match="bad.csv:2"):
        read_trace_header(bad)
    with pytest.raises(TraceError, match="no such file"):
        read_trace_header(tmp_path / "missing.csv")
