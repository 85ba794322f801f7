"""The wire: every kind round-trips; anything malformed is a ProtocolError, never another exception."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_pipe.shared.wire import messages as m
from moe_pipe.shared.wire.messages import Kind, ProtocolError, decode, encode

U64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
FLOATS = st.floats(allow_nan=False)  # NaN != NaN would fail equality, not the wire
TEXT = st.text(max_size=40)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), FLOATS, TEXT)
ANY = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)

STRATEGY_BY_TYPE = {
    "int": U64,
    "float": FLOATS,
    "bool": st.booleans(),
    "str": TEXT,
    "tuple[int, ...]": st.lists(U64, max_size=16),
    "tuple[tuple[int, int], ...]": st.lists(st.tuples(U64, U64), max_size=6),
    "tuple[tuple[int, int, int], ...]": st.lists(st.tuples(U64, U64, U64), max_size=6),
    "tuple[str, ...]": st.lists(st.text(max_size=20), max_size=4),
    "dict[str, Scalar]": st.dictionaries(TEXT, SCALAR, max_size=6),
    "dict[str, Any]": st.dictionaries(TEXT, ANY, max_size=4),
}


def strategy(cls):
    return st.builds(cls, **{f.name: STRATEGY_BY_TYPE[f.type] for f in dataclasses.fields(cls)})


ALL_CLASSES = [m._BY_KIND[k] for k in Kind]
ANY_MESSAGE = st.one_of(*[strategy(c) for c in ALL_CLASSES])


def test_every_kind_has_one_class():
    assert sorted(c.KIND for c in ALL_CLASSES) == sorted(Kind)
    assert len(set(ALL_CLASSES)) == len(Kind)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(strategy(cls))
    frame = encode(msg)
    assert msgpack.unpackb(frame)[0] == cls.KIND  # kind tag first
    back = decode(frame)
    assert type(back) is cls
    assert back == msg


def test_lists_become_tuples_and_ints_floats():
    r = m.Ready(1, 2, 3, 4, [[0, 10], [4096, 20]], True, 5)
    assert r.parts == ((0, 10), (4096, 20))
    t = m.TokenRecord(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert type(t.wall_ms) is float
    assert decode(encode(t)) == t


def test_status_envelope():
    ok = m.Status.success(processes=[{"name": "reader", "state": "RUNNING", "pid": 12, "restarts": 0}])
    assert decode(encode(ok)) == ok
    assert ok.to_dict()["ok"] is True and ok.to_dict()["code"] == "ok"
    bad = m.Status.failure(m.Code.UNKNOWN_COMMAND, "no command 'frob'")
    assert type(bad.code) is str  # the wire's type, whatever the caller passed
    assert decode(encode(bad)).to_dict() == {"ok": False, "code": "unknown_command", "message": "no command 'frob'"}


# ---------------------------------------------------------------- malformed


def frame(*items):
    return msgpack.packb(list(items), use_bin_type=True)


GOOD_FETCH = [int(Kind.FETCH), 7, 3, [1, 2], False]

BAD_FRAMES = {
    "empty": b"",
    "invalid byte": b"\xc1",
    "truncated": encode(m.Fetch(7, 3, (1, 2)))[:-1],
    "trailing data": encode(m.Fetch(7, 3, (1, 2))) + b"\x00",
    "not an array": msgpack.packb({"kind": 10}),
    "empty array": frame(),
    "unknown kind": frame(999, 1, 2),
    "kind is str": frame("FETCH", 7, 3, [1], False),
    "kind is bool": frame(True, "x"),
    "missing field": frame(*GOOD_FETCH[:-1]),
    "extra field": frame(*GOOD_FETCH, 1),
    "str for int": frame(int(Kind.FETCH), "7", 3, [1, 2], False),
    "negative int": frame(int(Kind.FETCH), -1, 3, [1, 2], False),
    "bool for int": frame(int(Kind.FETCH), True, 3, [1, 2], False),
    "int for bool": frame(int(Kind.FETCH), 7, 3, [1, 2], 1),
    "float in int list": frame(int(Kind.FETCH), 7, 3, [1.5], False),
    "list is a map": frame(int(Kind.FETCH), 7, 3, {"a": 1}, False),
    "bad pair": frame(int(Kind.READY), 1, 2, 3, 4, [[1, 2, 3]], True, 0),
    "bad triple": frame(int(Kind.SPARES), 1, 2, [], [], [[1, 2]], []),
    "bytes for str": frame(int(Kind.SHUTDOWN), b"bye"),
    "int map key": frame(int(Kind.COMMAND), "status", {1: 2}),
    "nested value in scalar dict": frame(int(Kind.RUN_INFO), "r", 1.0, {"a": [1]}, {}, 0, 0.0),
    "too deep": frame(int(Kind.COMMAND), "x", {"a": [[[[[[[[[[1]]]]]]]]]]}),
    "ext type": frame(int(Kind.COMMAND), "x", {"a": msgpack.ExtType(1, b"z")}),
    "bad utf8": b"\x92\x02\xa2\xff\xfe",
    "deep nesting": b"\x91" * 5000,
    "huge array header": b"\xdd\xff\xff\xff\xff",
    "huge str header": b"\x92\x02\xdb\xff\xff\xff\xff",
}


@pytest.mark.parametrize("name", BAD_FRAMES)
def test_bad_frames_are_protocol_errors(name):
    with pytest.raises(ProtocolError):
        decode(BAD_FRAMES[name])


def test_oversize_frame_refused_before_unpacking(monkeypatch):
    big = b"\x00" * (m.MAX_FRAME_BYTES + 1)
    # unpacking would be an error of its own; the cap must come first
    monkeypatch.setattr(m.msgpack, "unpackb", lambda *a, **k: pytest.fail("unpacked an oversize frame"))
    with pytest.raises(ProtocolError, match="cap"):
        decode(big)


def test_oversize_message_refused_at_encode():
    with pytest.raises(ProtocolError, match="cap"):
        encode(m.Shutdown("x" * m.MAX_FRAME_BYTES))


def test_not_bytes():
    for junk in (None, 12, 3.5, object()):
        with pytest.raises(ProtocolError):
            decode(junk)


def test_construction_validates():
    with pytest.raises(ProtocolError, match="experts"):
        m.Fetch(1, 2, ["a"])
    with pytest.raises(ProtocolError, match="req_id"):
        m.Fetch(-1, 0, ())
    with pytest.raises(ProtocolError, match="touched.*pair"):
        m.Release((1,), ((2, 3, 4),))
    with pytest.raises(ProtocolError, match="released"):
        m.Release(-1)
    with pytest.raises(ProtocolError, match="installed.*triple"):
        m.Spares(1, 2, installed=((1, 2),))
    assert m.Spares(1, 2, installed=[[1, 2, 3]]).installed == ((1, 2, 3),)
    assert m.Release([1], [[2, 3]]) == m.Release((1,), ((2, 3),))  # lists off the wire become tuples


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_else(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(ANY_MESSAGE, st.data())
def test_mutated_frames_never_raise_anything_else(msg, data):
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        decode(bytes(raw[:cut]))
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ALL_CLASSES), st.lists(ANY, max_size=10))
def test_wrong_field_values_never_raise_anything_else(cls, values):
    try:
        decode(frame(int(cls.KIND), *values))
    except ProtocolError:
        pass


def test_a_generate_of_100k_ids_round_trips():
    """The prompt's ids are capped by the frame alone (no 65,536-item array cap)."""
    msg = m.Generate(1, tuple(range(100_000)), 4, {}, ())
    assert decode(encode(msg)) == msg
