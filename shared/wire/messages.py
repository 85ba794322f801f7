"""The wire, declared once: every message between moe-pipe's processes.

A message is a frozen dataclass; its kind is a small integer (`Kind`). On the
wire it is one msgpack array, kind tag first, then the fields in declaration
order (positional, like vLLM's array_like structs: no field names on the
wire, so a 50-field token record costs bytes, not keys):

    frame := msgpack [ kind:int, field_1, field_2, ... ]        len(frame) <= MAX_FRAME_BYTES

Big tensors never cross ZeroMQ: a `Ready` names a slab (its index, `slab`) of the
shared-memory arena and where the expert's parts sit inside it.

Validation happens in the constructor, so a message that exists is valid on
both sides: the sender finds its own bug where it builds the message, and
`decode` is "check the frame, unpack, `cls(*fields)`". Anything that is not a
well-formed message of a known kind -- junk bytes, a truncated frame, an
unknown kind, a missing, extra or mistyped field, a frame above the cap --
raises `ProtocolError` (defined here, not in errors.py: it is a wire fault
between our own processes, never a user's input, so it is not a UserError).
The receiving loop logs it and drops the frame; it never crashes a process.

Field types (the annotation names the checker, see `_CHECKERS`):
    int     unsigned, 0 <= v < 2**64 (ids, counts, bytes, ns: none is negative)
    float   a float; an int is accepted and stored as float
    bool    exactly True/False (an int is not a bool on this wire)
    str     utf-8 text
    tuple[int, ...]              e.g. expert ids; a list is stored as a tuple
    tuple[str, ...]              e.g. stop strings
    tuple[tuple[int, int], ...]  pairs of uints: (offset, length), (layer, expert)
    dict[str, Scalar]            flat str -> str|int|float|bool|None
    dict[str, Any]               str keys, msgpack values nested <= _MAX_DEPTH
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, ClassVar

import msgpack

# Largest frame either side accepts. The biggest real message is a RunInfo or a
# status reply with a process table: a few KiB. 1 MiB leaves room and still
# bounds what a broken or hostile peer can make us allocate.
MAX_FRAME_BYTES = 1 << 20
# Bumped when a message's fields change; carried in Hello so mixed versions
# (an old compute talking to a new reader after an upgrade) are refused.
PROTOCOL_VERSION = 11
DRAFT_FROM_CONFIG = 255  # Generate.draft: no width of the request's own, compute.draft's (the wire's ints are unsigned)
ANY_SLOT = 0xFFFF  # Generate.slot: no slot of the request's own, compute picks (llama.cpp's id_slot -1)

_MAX_DEPTH = 8  # nesting inside a dict[str, Any] value (status payloads)
_MAX_U64 = (1 << 64) - 1


class ProtocolError(ValueError):
    """A frame that is not a valid message: log it, drop it, carry on."""

    # The bad frame's routing frames, set by ipc.recv_routed so that a ROUTER can
    # still answer the request; empty where there are none.
    envelope: tuple[bytes, ...] = ()


class Kind(IntEnum):
    # lifecycle, any direction
    HELLO = 1
    SHUTDOWN = 2
    # compute <-> reader
    FETCH = 10
    READY = 11
    FETCH_FAILED = 12
    RELEASE = 13
    GUESSED = 14
    CACHE_LIMIT = 15
    CACHE_LIMITED = 16
    SPARES = 17
    SPARE_SLABS = 18
    # compute -> telemetry -> tails
    RUN_INFO = 20
    TOKEN_RECORD = 21
    RUN_SUMMARY = 22
    SLOT_STATES = 23
    # control socket (cli <-> supervisor)
    COMMAND = 30
    STATUS = 31
    # generation requests (front end <-> compute)
    GENERATE = 40
    TOKEN = 41
    DONE = 42
    CANCEL = 43
    PROGRESS = 44
    SLOT = 45
    PROMPT_PROGRESS = 46


class Code(StrEnum):
    """Status and failure codes. The wire carries plain str, so a newer peer's
    code still decodes; these are the ones this version produces."""

    OK = "ok"
    BAD_MESSAGE = "bad_message"  # the request frame did not decode
    UNKNOWN_COMMAND = "unknown_command"
    BAD_ARGUMENT = "bad_argument"
    BUSY = "busy"  # queue full; try later
    NOT_RUNNING = "not_running"
    TIMEOUT = "timeout"
    IO_ERROR = "io_error"  # a read failed (FetchFailed)
    PEER_GONE = "peer_gone"  # the process that owed an answer died
    INTERNAL = "internal"
    CANCELLED = "cancelled"  # the front end cancelled the request (its client went away)


# -- field checkers: (value, field name) -> the value to store, or ProtocolError


def _fail(name: str, want: str, value: Any) -> ProtocolError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ProtocolError(f"field {name!r}: expected {want}, got {type(value).__name__} {shown}")


def _uint(v: Any, name: str) -> int:
    if type(v) is not int or not 0 <= v <= _MAX_U64:  # type() is: bool is not an int here
        raise _fail(name, "an unsigned int", v)
    return v


def _float(v: Any, name: str) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)
    raise _fail(name, "a float", v)


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise _fail(name, "a bool", v)
    return v


def _str(v: Any, name: str) -> str:
    if type(v) is str:
        return v
    if not isinstance(v, str):
        raise _fail(name, "a str", v)
    return str.__str__(v)  # a StrEnum (Code.OK) is stored as the plain str the peer will see


def _uints(v: Any, name: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise _fail(name, "a list of unsigned ints", v)
    for x in v:
        _uint(x, name)
    return tuple(v)


def _strs(v: Any, name: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)):
        raise _fail(name, "a list of str", v)
    return tuple(_str(x, name) for x in v)


def _tuples(width: int) -> Callable[[Any, str], tuple[tuple[int, ...], ...]]:
    """A checker of a list of `width`-tuples of unsigned ints."""
    what = {2: "pair", 3: "triple"}[width]

    def check(v: Any, name: str) -> tuple[tuple[int, ...], ...]:
        if not isinstance(v, (list, tuple)):
            raise _fail(name, f"a list of {what}s of unsigned ints", v)
        out = []
        for p in v:
            if not isinstance(p, (list, tuple)) or len(p) != width:
                raise _fail(name, f"a {what} of unsigned ints", p)
            out.append(tuple(_uint(x, name) for x in p))
        return tuple(out)

    return check


_SCALARS = (str, int, float, bool, type(None))


def _scalar_dict(v: Any, name: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(name, "a dict", v)
    for k, x in v.items():
        if not isinstance(k, str):
            raise _fail(name, "str keys", k)
        if not isinstance(x, _SCALARS) or (type(x) is int and not -(1 << 63) <= x <= _MAX_U64):
            raise _fail(f"{name}.{k}", "a str, int, float, bool or None", x)
    return v


def _any_value(x: Any, name: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise _fail(name, f"nesting at most {_MAX_DEPTH} deep", "...")
    if isinstance(x, _SCALARS):
        if type(x) is int and not -(1 << 63) <= x <= _MAX_U64:
            raise _fail(name, "an int that fits 64 bits", x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _any_value(y, name, depth + 1)
    elif isinstance(x, dict):
        for k, y in x.items():
            if not isinstance(k, str):
                raise _fail(name, "str keys", k)
            _any_value(y, f"{name}.{k}", depth + 1)
    else:
        raise _fail(name, "a msgpack value", x)


def _any_dict(v: Any, name: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(name, "a dict", v)
    _any_value(v, name, 1)
    return v


# Annotation text -> checker. A field whose annotation is not here fails at
# import, so a new message cannot ship with an unchecked field.
_CHECKERS: dict[str, Callable[[Any, str], Any]] = {
    "int": _uint,
    "float": _float,
    "bool": _bool,
    "str": _str,
    "tuple[int, ...]": _uints,
    "tuple[str, ...]": _strs,
    "tuple[tuple[int, int], ...]": _tuples(2),
    "tuple[tuple[int, int, int], ...]": _tuples(3),
    "dict[str, Scalar]": _scalar_dict,
    "dict[str, Any]": _any_dict,
}
Scalar = str | int | float | bool | None


class _Message:
    """Base of every message: validates (and normalises) fields on construction."""

    __slots__ = ()
    KIND: ClassVar[Kind]
    _CHECKS: ClassVar[tuple[tuple[str, Callable[[Any, str], Any]], ...]]

    def __post_init__(self) -> None:
        for name, check in self._CHECKS:
            value = getattr(self, name)
            stored = check(value, name)
            if stored is not value:  # list -> tuple, int -> float
                object.__setattr__(self, name, stored)


# Filled by @_wire; typed as the closed union (declared below) so that `decode`
# returns a `Message`, not the bare base class.
_BY_KIND: dict[int, type[Message]] = {}


def _wire(kind: Kind):
    """Register a message class under its kind and resolve its field checkers."""

    def register(cls):
        assert kind not in _BY_KIND, f"{kind!r} declared twice"
        cls.KIND = kind
        checks = []
        for f in dataclasses.fields(cls):
            if f.type not in _CHECKERS:
                raise TypeError(f"{cls.__name__}.{f.name}: no wire checker for {f.type!r}")
            checks.append((f.name, _CHECKERS[f.type]))
        cls._CHECKS = tuple(checks)
        _BY_KIND[kind] = cls
        return cls

    return register


# ---------------------------------------------------------------- lifecycle


@_wire(Kind.HELLO)
@dataclass(frozen=True, slots=True)
class Hello(_Message):
    """First message a process sends on a link. `epoch` changes on every start
    (e.g. time.time_ns()), so the peer can tell a restart: the reader drops the
    pins and pending fetches of an older compute epoch; compute ignores Ready
    frames whose req_id it never issued."""

    role: str  # reader | compute | telemetry | gateway | supervisor | tail
    pid: int
    epoch: int
    protocol: int = PROTOCOL_VERSION


@_wire(Kind.SHUTDOWN)
@dataclass(frozen=True, slots=True)
class Shutdown(_Message):
    """Drain and exit. Sent by the supervisor (or the run parent)."""

    reason: str = ""


# ------------------------------------------------------------ compute <-> reader


@_wire(Kind.FETCH)
@dataclass(frozen=True, slots=True)
class Fetch(_Message):
    """compute -> reader: make these experts of `layer` resident and pin them
    until compute says it is done with `req_id` (a later Fetch's `released`,
    or a Release). The reader answers one Ready (or FetchFailed) per expert in
    `experts`. Compute sends a Fetch for a layer with misses; a layer whose
    experts are all in the residency index costs no message (its hits travel
    in the next message's `touched`) unless it carries guesses: then
    `experts` is empty and the reader answers one Guessed once they are
    admitted.

    The reader handles the fields in this order: `released` (unpin), `touched`
    (the eviction policy sees those hits, in order, before anything is
    evicted), `resident` (pin), `experts` (admit and read the misses), then
    `guesses` (speculative reads of layer `guess_layer`, after the misses, may
    evict; never answered)."""

    req_id: int
    layer: int
    experts: tuple[int, ...]
    # Experts compute found resident in the shared index and is already using:
    # pin them first, answer nothing (only `experts` get a Ready each).
    resident: tuple[int, ...] = ()
    released: tuple[int, ...] = ()  # earlier req_ids compute is done with
    touched: tuple[tuple[int, int], ...] = ()  # (layer, expert) hits served from the index since the last message
    guess_layer: int = 0
    guesses: tuple[int, ...] = ()  # next-layer prefetch: experts of guess_layer, best first


@_wire(Kind.READY)
@dataclass(frozen=True, slots=True)
class Ready(_Message):
    """reader -> compute: one expert's bytes are in slab `slab` of the arena.

    `parts` are (offset, length) inside the slab, one per expert tensor in the
    layout's part order (gate/up/down or gate_up/down, then biases); offsets
    are past the O_DIRECT alignment padding. `io_ns` is this expert's read
    time (0 on a hit). `guess_bytes` and `guess_io_ns` are what the reads of
    guesses that landed with nobody waiting cost since the reader's last
    answer (compute counts them in the token's read_bytes and io_ms)."""

    req_id: int
    layer: int
    expert: int
    slab: int
    parts: tuple[tuple[int, int], ...]
    hit: bool
    io_ns: int = 0
    guess_bytes: int = 0
    guess_io_ns: int = 0


@_wire(Kind.FETCH_FAILED)
@dataclass(frozen=True, slots=True)
class FetchFailed(_Message):
    """reader -> compute: this expert could not be made resident. A bad request
    (e.g. an expert id out of range) or an I/O error: the request fails with
    `code`; the reader keeps running."""

    req_id: int
    layer: int
    expert: int
    code: str
    error: str


@_wire(Kind.RELEASE)
@dataclass(frozen=True, slots=True)
class Release(_Message):
    """compute -> reader, once per token: done with these fetches (unpin their
    slabs), and these hits were served from the index since the last message
    (what a Fetch carries in `released` and `touched`, for a token whose last
    layers needed no Fetch)."""

    released: tuple[int, ...] = ()
    touched: tuple[tuple[int, int], ...] = ()


@_wire(Kind.GUESSED)
@dataclass(frozen=True, slots=True)
class Guessed(_Message):
    """reader -> compute: the guesses of Fetch `req_id` (one with no misses)
    are admitted — whatever they evict is gone from the index — so compute
    may look at the index again. The guess_ fields: as in Ready."""

    req_id: int
    guess_bytes: int = 0
    guess_io_ns: int = 0


@_wire(Kind.CACHE_LIMIT)
@dataclass(frozen=True, slots=True)
class CacheLimit(_Message):
    """compute -> reader, between passes: hold the expert cache to `slabs` slabs
    from now on (docs/architecture.md § The KV cache's loan). Fewer than it
    holds: the reader evicts and gives the slabs' pages back to the system
    before it answers, so compute may then write that much more KV cache;
    more: the slabs are the cache's again. Answered by one CacheLimited."""

    req_id: int
    slabs: int


@_wire(Kind.CACHE_LIMITED)
@dataclass(frozen=True, slots=True)
class CacheLimited(_Message):
    """reader -> compute: CacheLimit `req_id` is carried out; the cache holds at
    most `slabs` slabs and the pages of the others are free."""

    req_id: int
    slabs: int


@_wire(Kind.SPARES)
@dataclass(frozen=True, slots=True)
class Spares(_Message):
    """compute -> reader, at the end of a token instead of its Release (docs/architecture.md §
    compute's own reads): what a Release says, then the experts compute read into slabs the
    reader lent it (`installed`: (layer, expert, slab); the reader adopts and publishes them, or
    takes the slab back when the expert is resident already), the lent slabs compute gives back
    unused (`returned`), and how many more slabs to lend it (`want`, evicting for them).
    Answered by one SpareSlabs; compute reads the index again only after it."""

    req_id: int
    want: int
    released: tuple[int, ...] = ()
    touched: tuple[tuple[int, int], ...] = ()
    installed: tuple[tuple[int, int, int], ...] = ()
    returned: tuple[int, ...] = ()


@_wire(Kind.SPARE_SLABS)
@dataclass(frozen=True, slots=True)
class SpareSlabs(_Message):
    """reader -> compute: Spares `req_id` is carried out (installed experts are in the
    index, whatever was evicted for `slabs` is gone from it); `slabs` are lent to compute."""

    req_id: int
    slabs: tuple[int, ...] = ()


# ------------------------------------------------------------------ telemetry


@_wire(Kind.RUN_INFO)
@dataclass(frozen=True, slots=True)
class RunInfo(_Message):
    """compute -> telemetry, once per run, before the first token: what the
    CSV preamble records. `config` is the resolved config flattened to dotted
    keys ("cache.cache_mb": 4000); `model` describes the file (path, arch,
    layers, experts, top_k, file_bytes, ...)."""

    run_id: str
    started_unix: float
    config: dict[str, Scalar]
    model: dict[str, Scalar]
    budget_bytes: int
    load_seconds: float
    compile_seconds: float = 0.0  # compute's kernel warm-up, apart from load_seconds (docs/telemetry.md)


@_wire(Kind.TOKEN_RECORD)
@dataclass(frozen=True, slots=True)
class TokenRecord(_Message):
    """compute -> telemetry, one per generated token. Field order IS the CSV
    column order: the first ten are the fixed schema (telemetry.CSV_COLUMNS
    checks that at import), the rest are telemetry.EXTRA_COLUMNS. Meanings and
    units: docs/telemetry.md."""

    step: int
    wall_ms: float
    compute_ms: float
    io_ms: float
    read_bytes: int
    cache_hit_pct: float
    stall_ms: float
    mgmt_ms: float
    majflt: int
    cpu_ms: float
    # extras: after the schema, never before
    hits: int = 0
    misses: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted_bytes: int = 0
    prefetch_paused: int = 0
    wire_ms: float = 0.0
    messages: int = 0
    rss_bytes: int = 0
    req_id: int = 0
    resident_bytes: int = 0
    attention_ms: float = 0.0
    pass_tokens: int = 0
    drafted: int = 0
    accepted: int = 0  # of `drafted`, the ones the output kept: the pass gave 1 + accepted tokens
    experts_shared: int = 0  # expert uses served by a lookup another row of the pass made (docs/telemetry.md)
    cache_slabs: int = 0  # the slabs the expert cache may hold at this pass (the KV cache's loan: docs/telemetry.md)


@_wire(Kind.RUN_SUMMARY)
@dataclass(frozen=True, slots=True)
class RunSummary(_Message):
    """The end-of-run figures (telemetry.summarize builds it)."""

    tokens: int
    load_seconds: float
    mean_tok_s: float
    steady_tok_s: float
    steady_from_step: int  # first step of the steady window (warm-up discarded)
    first5_wall_ms: float
    final_hit_pct: float
    read_bytes: int
    budget_mib: float
    resident_mib: float
    peak_rss_mib: float
    drafted: int = 0  # speculative decoding: drafts verified, and of them kept
    accepted: int = 0


# -------------------------------------------------------------------- control


@_wire(Kind.COMMAND)
@dataclass(frozen=True, slots=True)
class Command(_Message):
    """cli -> supervisor: a control request ("status", "stop", ...)."""

    name: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@_wire(Kind.STATUS)
@dataclass(frozen=True, slots=True)
class Status(_Message):
    """Every control reply, success or not (circus's status envelope): `ok`,
    a `code` a program can switch on, a one-line `message` for people, and the
    command's result in `data`."""

    ok: bool
    code: str
    message: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def success(cls, message: str = "", **data: Any) -> Status:
        return cls(True, Code.OK, message, data)

    @classmethod
    def failure(cls, code: str, message: str, **data: Any) -> Status:
        return cls(False, code, message, data)

    def to_dict(self) -> dict[str, Any]:
        """{"ok", "code", "message", **data}: the JSON shape of a reply."""
        return {**self.data, "ok": self.ok, "code": str(self.code), "message": self.message}


# ----------------------------------------------------------------- generation


@_wire(Kind.GENERATE)
@dataclass(frozen=True, slots=True)
class Generate(_Message):
    """front end -> compute: one generation. `sampling` holds SamplingParams'
    fields (seed None = unseeded); the prompt is already tokenized."""

    req_id: int
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: dict[str, Scalar]
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    cache_prompt: bool = True  # start from the KV compute holds when it shares a prefix with the prompt (docs/conversations.md)
    grammar: str = ""  # llguidance grammar JSON the output must follow (shared/text/constrain.py); "" = free text
    draft: int = DRAFT_FROM_CONFIG  # speculative decoding's drafts per verify pass for this request
    slot: int = ANY_SLOT  # the compute slot it must run in (llama.cpp's id_slot; ANY_SLOT: compute picks)


@_wire(Kind.TOKEN)
@dataclass(frozen=True, slots=True)
class Token(_Message):
    """compute -> front end: text that is now final (held back while it may
    still turn out to be the start of a stop string); the ids come with Done."""

    req_id: int
    text: str


@_wire(Kind.DONE)
@dataclass(frozen=True, slots=True)
class Done(_Message):
    """compute -> front end: the generation ended. ok=False: `code`/`error` say
    why (the request failed; compute keeps serving). `finish_reason` is
    shared.text.generate's: "eog" (an end-of-generation token), "stop" (a stop
    string), "length" (max_tokens) or "context" (the context is full); an
    OpenAI front end maps eog→stop and context→length. `timings` carries
    `prompt_cached`, the prompt tokens reused from compute's KV (not computed).
    Also the answer to a Slot: its figures in `timings`."""

    req_id: int
    ok: bool
    finish_reason: str = ""
    tokens: tuple[int, ...] = ()
    timings: dict[str, Scalar] = dataclasses.field(default_factory=dict)
    code: str = ""
    error: str = ""


@_wire(Kind.CANCEL)
@dataclass(frozen=True, slots=True)
class Cancel(_Message):
    """front end -> compute (on the requests link): stop generation `req_id`
    (its client went away). Compute checks for it between tokens, and while a
    prompt runs after every layer and between experts (at most every 50 ms),
    and ends the request with Done(ok=False, code="cancelled"); a Cancel for a
    request that already ended is ignored."""

    req_id: int


@_wire(Kind.PROGRESS)
@dataclass(frozen=True, slots=True)
class Progress(_Message):
    """compute -> front end, before its Hello: how far its start has come.
    `step` of `total` is being done now (`item` names it); step == total
    with `item` "" is the end, and `seconds` then the whole stage's time."""

    stage: str  # "kernels": compiling (or loading from numba's cache) what the model needs
    step: int
    total: int
    item: str = ""
    seconds: float = 0.0
    compiled: int = 0  # of the steps so far, how many compiled (the rest came from the cache)


@_wire(Kind.PROMPT_PROGRESS)
@dataclass(frozen=True, slots=True)
class PromptProgress(_Message):
    """compute -> front end and telemetry (-> tails), while a prompt is computed:
    llama.cpp's server `prompt_progress`. Of the prompt's `total` tokens,
    `cache` were reused from the KV cache and `processed` (cache included) are
    done, `time_ms` since its pass began; one with processed == cache opens a
    prompt, one with processed == total closes it, before its first Token.
    How processed advances under layer-major prefill: shared/model/prompt_watch.py."""

    req_id: int
    total: int
    cache: int
    processed: int
    time_ms: int


@_wire(Kind.SLOT_STATES)
@dataclass(frozen=True, slots=True)
class SlotStates(_Message):
    """compute -> telemetry (-> tails and the gateway's web page), with gateway.parallel
    above 1: what each of compute's slots is doing, one entry a slot (index = slot id). A
    slot is idle (req_id 0), reading its prompt (processed < total: of `total` tokens,
    `cache` reused from its KV cache and `processed` done, cache included) or decoding
    (`decoded` tokens so far); `held`, `shared` and `pool` say how full the slots' KV pool is. Sent
    as a slot changes state, and now and then between (procs/slots.py SLOT_STATES_S).
    `rows()` says which state each is in."""

    req_ids: tuple[int, ...]
    total: tuple[int, ...]
    cache: tuple[int, ...]
    processed: tuple[int, ...]
    decoded: tuple[int, ...]
    held: tuple[int, ...]  # positions each slot's KV cache keeps in memory of its own (an idle slot's conversation too)
    pool: int  # positions the slots' caches may hold together: the KV pool (docs/batching.md § The KV pool)
    shared: int = 0  # positions of prompt prefixes held once by reference for several slots, apart from `held`

    def rows(self) -> list[dict[str, int | str]]:
        """Each slot as `{id, state, req_id, total, cache, processed, decoded, held}`, state
        "idle", "prompt" or "decoding" (what tails and the web page show); a frame whose
        fields differ in length shows the slots all of them cover."""
        out: list[dict[str, int | str]] = []
        for i, (req, total, cache, processed, decoded, held) in enumerate(
            zip(self.req_ids, self.total, self.cache, self.processed, self.decoded, self.held)
        ):
            state = "idle" if not req else "prompt" if processed < total else "decoding"
            out.append(
                {
                    "id": i,
                    "state": state,
                    "req_id": req,
                    "total": total,
                    "cache": cache,
                    "processed": processed,
                    "decoded": decoded,
                    "held": held,
                }
            )
        return out

    @property
    def pool_held(self) -> int:
        """Positions the slots' caches hold together, of `pool`: each its own, and a shared prefix once."""
        return sum(self.held) + self.shared


@_wire(Kind.SLOT)
@dataclass(frozen=True, slots=True)
class Slot(_Message):
    """front end -> compute (on the requests link): act on a compute slot's session,
    the KV cache and token ids it keeps between generations: "save" it to
    `path`, "restore" it from `path`, or "erase" it (`path` ""). Answered by
    a Done: ok with n_saved / n_restored / n_erased and bytes in `timings`,
    or the error (a refused file is code bad_argument)."""

    req_id: int
    action: str  # save | restore | erase
    path: str = ""
    slot: int = 0  # whose session: compute's slot (0 with gateway.parallel 1)


Message = (
    Hello
    | Shutdown
    | Fetch
    | Ready
    | FetchFailed
    | Release
    | Guessed
    | CacheLimit
    | CacheLimited
    | Spares
    | SpareSlabs
    | RunInfo
    | TokenRecord
    | RunSummary
    | SlotStates
    | Command
    | Status
    | Generate
    | Token
    | Done
    | Cancel
    | Progress
    | Slot
    | PromptProgress
)
assert set(_BY_KIND) == set(Kind), "every Kind needs exactly one message class"


# --------------------------------------------------------------- encode/decode


def encode(msg: Message) -> bytes:
    """One frame: msgpack [kind, *fields]. ProtocolError if above the cap."""
    fields = [getattr(msg, name) for name, _ in msg._CHECKS]
    try:
        frame = msgpack.packb([int(msg.KIND), *fields], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # only if a field was mutated past validation
        raise ProtocolError(f"{type(msg).__name__}: cannot encode: {e}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{type(msg).__name__}: {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame cap")
    return frame


def decode(frame: bytes) -> Message:
    """The message in `frame`, or ProtocolError -- never another exception."""
    try:
        size = len(frame)
    except TypeError:
        raise ProtocolError(f"expected bytes, got {type(frame).__name__}") from None
    if size > MAX_FRAME_BYTES:  # before unpacking: never allocate for an oversize frame
        raise ProtocolError(f"{size}-byte frame exceeds the {MAX_FRAME_BYTES}-byte cap")
    try:
        items = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,  # an element takes at least a byte: a prompt's ids are capped by the frame alone
            max_map_len=min(size, 1 << 12),
            max_ext_len=0,  # no ext types on this wire
        )
    except Exception as e:  # msgpack raises ValueError, TypeError, UnicodeDecodeError, StackError, ...
        raise ProtocolError(f"undecodable frame ({type(e).__name__}: {e})") from None
    if not isinstance(items, list) or not items:
        raise ProtocolError(f"frame is not a [kind, fields...] array: {type(items).__name__}")
    kind = items[0]
    cls = _BY_KIND.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    n = len(cls._CHECKS)
    if len(items) - 1 != n:
        raise ProtocolError(f"{cls.__name__}: expected {n} fields, got {len(items) - 1}")
    try:
        return cls(*items[1:])
    except ProtocolError as e:
        raise ProtocolError(f"{cls.__name__}: {e}") from None
    except (RecursionError, TypeError) as e:
        raise ProtocolError(f"{cls.__name__}: {e}") from None


def as_dict(msg: Message) -> dict[str, Any]:
    """Field name -> value (shallow; tuples stay tuples), for JSON and CSV."""
    return {name: getattr(msg, name) for name, _ in msg._CHECKS}


def field_names(cls: type[_Message]) -> tuple[str, ...]:
    return tuple(name for name, _ in cls._CHECKS)
