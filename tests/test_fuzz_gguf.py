"""Hostile model files: every malformed GGUF ends in a one-line GGUFError that
names the problem, with memory bounded, and every file that does open has a
self-consistent byte-range map.

Three kinds of test:
- targeted: one test per malformation (huge counts and lengths, offsets past
  the end, overlap, misalignment, wrong key types, unknown and unsupported
  quant types, shapes that disagree with the metadata, non-UTF-8, split sets,
  a header cut at every byte) built by re-encoding a real seed;
- fuzz: hypothesis mutates the header of the project's own tiny models
  (make_model, every architecture) and `check_one` must hold for each input;
- corpus: every input in tests/fuzz_corpus/ (found by bench/fuzz_gguf.py,
  which loads this module for its target) is replayed as a regression test.

This module imports nothing relative (no `.ggufgen`) so that the bench runner
can load it by path and fuzz the very same target.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_pipe.cli.inspect_cmd import summary
from moe_pipe.cli.main import main
from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.reader import MAX_ARRAY_ELEMENTS, MAX_KEYS, MAX_TENSORS, GGUFFile
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
ARCHS = ("qwen3moe", "gpt-oss", "gemma4")
# A message that reached gguf_file's safety net instead of a check of its own.
_NET = "unreadable GGUF"
# An input that takes this long is a hang, whatever the machine (a seed opens, builds and runs in ~5 ms).
HANG_S = 30


# ---------------------------------------------------------------- the target


def make_seeds(folder: Path, quant: str = "Q8_0") -> dict[str, Path]:
    """The project's own models (tokenizer, chat template and all), shrunk to
    ~70-80 KB so a mutated copy is cheap to write: headers are 14-18 KB."""
    seeds = {}
    for arch in ARCHS:
        ov = dict(vocab_size=512, n_bpe=8, n_embd=32, n_ff_exp=32, n_ff=32, n_expert=2, n_expert_used=1, n_head=2, n_head_kv=1, head_dim=32)
        if arch == "gemma4":
            ov.update(head_dim_full=32, n_head_kv_full=1)
        if arch == "gpt-oss":
            ov.update(sliding_window=16)
        seeds[arch] = make_model(arch, "tiny", folder / f"seed-{arch}-{quant}.gguf", layers=2, quant=quant, _overrides=ov)
        _compile_kernels(seeds[arch])
    return seeds


def _compile_kernels(seed: Path) -> None:
    """Run the seed once outside any time limit: the first run of a kernel compiles it (seconds
    with a cold numba cache on a busy machine), which is not a hang of the loader's."""
    with open_model(seed) as mf:
        model = load_model(mf)
        model.decode_one(0, model.new_cache(2))


class Broken(AssertionError):
    """The loader broke its contract on an input (what a fuzzer reports)."""


@contextmanager
def time_limit(seconds: float):
    """Turn a hang into a failure instead of a stuck test run (main thread only)."""

    def _alarm(signum, frame):
        raise Broken(f"hang: no answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_error(exc: GGUFError, path: Path) -> str:
    msg = str(exc)
    if "\n" in msg:
        raise Broken(f"multi-line message: {msg!r}")
    if not msg.startswith(str(path.parent)):  # names the file (or, for a split set, its shard)
        raise Broken(f"message does not name the file: {msg!r}")
    if _NET in msg:
        raise Broken(f"reached the safety net, not a named check: {msg}")
    if len(msg) > len(str(path)) + 600:
        raise Broken(f"message of {len(msg)} characters: {msg[:200]!r}...")
    return msg


def check_byte_map(mf) -> None:
    """What the reader and the cache rely on: every tensor inside its file and
    aligned, no overlaps, each expert slab inside its tensor, the dense
    extents the exact complement of the expert tensors inside each data section."""
    f, lay, spec = mf.gguf, mf.layout, mf.spec
    for shard in range(len(f.paths)):
        start, size, align = f.data_start(shard), f.file_sizes[shard], int(f.readers[shard].alignment)
        infos = sorted((t for t in f.tensors.values() if t.shard == shard), key=lambda t: t.offset)
        for t in infos:
            assert start <= t.offset and t.end <= size and t.nbytes > 0, t
            assert (t.offset - start) % align == 0, t
        for a, b in zip(infos, infos[1:]):
            assert a.end <= b.offset, (a, b)
    assert len(lay.layers) == spec.n_layer
    for layer in lay.layers:
        assert {p.tensor.name for p in layer.parts} <= lay.expert_tensor_names
        for p in layer.parts:
            assert p.stride * spec.n_expert == p.tensor.nbytes, p
            first, last = p.extent(0), p.extent(spec.n_expert - 1)
            assert first.offset == p.tensor.offset and last.end == p.tensor.end, p
    dense = [(x.shard, x.offset, x.end) for x in lay.dense]
    assert dense == sorted(dense)
    for (s1, _, e1), (s2, o2, _) in zip(dense, dense[1:]):
        assert s1 != s2 or e1 < o2, "dense extents must be merged: disjoint and not touching"
    apart = lay.expert_tensor_names | lay.row_tensor_names  # streamed, or read by row
    for shard in range(len(f.paths)):  # dense extents, expert tensors and by-row tensors tile each data section exactly
        pieces = sorted(
            [(o, e) for s, o, e in dense if s == shard]
            + [(t.offset, t.end) for t in f.tensors.values() if t.shard == shard and t.name in apart]
        )
        cursor = f.data_start(shard)
        for o, e in pieces:
            assert o == cursor and e > o, (shard, o, e, cursor)
            cursor = e
        assert cursor == f.file_sizes[shard], (shard, cursor)
    assert lay.dense_bytes == sum(t.nbytes for t in f.tensors.values() if t.name not in apart)
    assert lay.row_bytes == sum(f.tensors[n].nbytes for n in lay.row_tensor_names)


def check_one(path: Path) -> str:
    """The fuzz target: open `path` as a model. Returns "opened" or the error
    message; raises Broken (or whatever escaped) when the contract breaks.

    A file that opens must also build and run: what open_model accepts, the
    compute process loads, and a failure there would be a crash loop."""
    with time_limit(HANG_S):
        try:
            mf = open_model(path)
        except GGUFError as exc:
            return check_error(exc, path)
        with mf:
            check_byte_map(mf)
            summary(mf)  # everything `moe-pipe inspect` computes from the map
            model = load_model(mf)  # every tensor the forward pass reads, resolved
            model.decode_one(0, model.new_cache(2))  # and multiplied once (~1 ms on a seed)
    return "opened"


# ------------------------------------------------------------- mutation


# Values that tend to break length and offset arithmetic.
INTERESTING = (
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    16,
    31,
    32,
    33,
    63,
    64,
    127,
    128,
    255,
    256,
    1024,
    4096,
    2**15,
    2**16 - 1,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**60,
    2**63 - 1,
    2**63,
    2**64 - 1,
)


@dataclass(frozen=True)
class Seed:
    data: bytes
    header_bytes: int  # where the data section starts
    numbers: tuple[tuple[int, int], ...]  # (offset, width) of every count, length, type id, value, dim, offset
    strings: tuple[tuple[int, int], ...]  # (offset, length) of every non-empty string body

    def __repr__(self) -> str:  # hypothesis prints its arguments: not 80 KB of bytes
        return f"Seed({len(self.data)} bytes, header {self.header_bytes})"


def parse_seed(path: Path) -> Seed:
    """The header's fields as gguf-py's own reader lays them out: each part is
    a slice of the file, contiguous from the field's offset."""
    r = GGUFReader(path)
    numbers, strings = [(4, 4), (8, 8), (16, 8)], []
    for fld in [f for f in r.fields.values() if not f.name.startswith("GGUF.")] + [t.field for t in r.tensors]:
        offs = fld.offset
        for part in fld.parts:
            n = int(part.nbytes)
            if part.size == 1 and n in (1, 2, 4, 8):
                numbers.append((offs, n))
            elif n:
                strings.append((offs, n))
            offs += n
    return Seed(path.read_bytes(), int(r.data_offset), tuple(numbers), tuple(strings))


def mutate(seed: Seed, ops) -> bytes:
    """Apply (kind, a, b) operations in order; positions are taken modulo what
    they index, and a field an earlier cut removed is left alone."""
    data = bytearray(seed.data)
    for kind, a, b in ops:
        head = min(seed.header_bytes, len(data))
        if kind == "number":  # a structured field set to an extreme value
            offs, width = seed.numbers[a % len(seed.numbers)]
            if offs + width <= len(data):
                data[offs : offs + width] = (b % (1 << 8 * width)).to_bytes(width, "little")
        elif kind == "utf8":  # a byte that is never valid UTF-8 inside a string
            offs, n = seed.strings[a % len(seed.strings)]
            if offs + b % n < len(data):
                data[offs + b % n] = 0xFF
        elif kind == "truncate":
            del data[a % (len(data) + 1) :]
        elif head == 0:
            continue
        elif kind == "byte":
            data[a % head] = b % 256
        elif kind == "delete":
            del data[a % head : a % head + 1 + b % 16]
        elif kind == "insert":
            data[a % head : a % head] = (b % (1 << 64)).to_bytes(8, "little")[: 1 + b % 8]
    return bytes(data)


_pos = st.integers(0, 2**32)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("number"), _pos, st.sampled_from(INTERESTING) | st.integers(0, 2**64 - 1)),
        st.tuples(st.just("utf8"), _pos, _pos),
        st.tuples(st.just("byte"), _pos, st.integers(0, 255)),
        st.tuples(st.just("truncate"), _pos, st.just(0)),
        st.tuples(st.just("delete"), _pos, _pos),
        st.tuples(st.just("insert"), _pos, st.sampled_from(INTERESTING) | st.integers(0, 2**64 - 1)),
    ),
    min_size=1,
    max_size=4,
)


# ------------------------------------------------------------- re-encoding


def u32(v: int) -> bytes:
    return int(v).to_bytes(4, "little")


def u64(v: int) -> bytes:
    return int(v).to_bytes(8, "little")


def gstr(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return u64(len(b)) + b


def kv(key: bytes | str, vtype: VT, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


@dataclass
class Rebuild:
    """A real GGUF as records we can edit and re-encode: key/value records as
    raw bytes, tensor infos as fields, the data section kept byte for byte
    (tensor offsets are relative to it, so it survives a longer header)."""

    kvs: dict[str, bytes]
    tensors: list[dict]
    data: bytes
    alignment: int = 32
    version: int = 3
    n_tensors: int | None = None  # header counts; None = the true ones
    n_kvs: int | None = None
    extra_kvs: list[bytes] = field(default_factory=list)  # raw records appended as they are

    @classmethod
    def read(cls, path: Path) -> Rebuild:
        r, raw = GGUFReader(path), path.read_bytes()
        kvs = {}
        for f in r.fields.values():
            if not f.name.startswith("GGUF."):
                kvs[f.name] = raw[f.offset : f.offset + sum(int(p.nbytes) for p in f.parts)]
        tensors = [
            dict(name=t.name.encode(), dims=[int(d) for d in t.field.parts[3]], type=int(t.tensor_type), offset=int(t.field.parts[5][0]))
            for t in r.tensors
        ]
        return cls(kvs, tensors, raw[r.data_offset :], int(r.alignment))

    def tensor(self, name: str) -> dict:
        return next(t for t in self.tensors if t["name"] == name.encode())

    def encode(self) -> bytes:
        records = list(self.kvs.values()) + self.extra_kvs
        infos = b"".join(
            u64(t.get("name_len", len(t["name"])))
            + t["name"]
            + u32(t.get("n_dims", len(t["dims"])))
            + b"".join(u64(d) for d in t["dims"])
            + u32(t["type"])
            + u64(t["offset"])
            for t in self.tensors
        )
        head = (
            b"GGUF"
            + u32(self.version)
            + u64(len(self.tensors) if self.n_tensors is None else self.n_tensors)
            + u64(len(records) if self.n_kvs is None else self.n_kvs)
            + b"".join(records)
            + infos
        )
        return head + b"\0" * (-len(head) % self.alignment) + self.data

    def write(self, path: Path) -> Path:
        path.write_bytes(self.encode())
        return path


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def seeds(work) -> dict[str, Path]:
    return make_seeds(work)


@pytest.fixture(scope="module")
def parsed(seeds) -> list[Seed]:
    return [parse_seed(p) for p in seeds.values()]


@pytest.fixture(scope="module")
def f32_seeds(work) -> dict[str, Path]:
    """F32 weights everywhere: a tensor's type can then change to I32 (also
    4 bytes a weight, but no kernel computes on it) without moving any byte."""
    return make_seeds(work, "F32")


def _error(path: Path, match: str) -> str:
    with pytest.raises(GGUFError) as exc:
        open_model(path).close()
    msg = check_error(exc.value, path)
    assert match in msg, msg
    return msg


def _edit(seed: Path, out: Path, change) -> Path:
    g = Rebuild.read(seed)
    change(g)
    return g.write(out)


# ----------------------------------------------------------------- the seeds


def test_seeds_open_and_rebuild_byte_for_byte(seeds, work):
    """The fuzz starts from valid files, and Rebuild without edits is the identity
    (so a targeted test's failure is its edit, not the re-encoding)."""
    for arch, path in seeds.items():
        assert check_one(path) == "opened"
        assert Rebuild.read(path).encode() == path.read_bytes(), arch


# ------------------------------------------------------ counts and lengths

# (what, edit, expected words). Each is run for its message and, below, for
# the memory it costs: no allocation may follow an unchecked count.
HUGE = {
    "tensor count 2**60": (lambda g: setattr(g, "n_tensors", 2**60), "declares 1152921504606846976 tensors"),
    "tensor count over the cap": (lambda g: setattr(g, "n_tensors", MAX_TENSORS + 1), f"(at most {MAX_TENSORS})"),
    "tensor count one too many": (lambda g: setattr(g, "n_tensors", len(g.tensors) + 1), "tensor #27"),
    "key count 2**64-1": (lambda g: setattr(g, "n_kvs", 2**64 - 1), "metadata keys"),
    "key count over the cap": (lambda g: setattr(g, "n_kvs", MAX_KEYS + 1), f"(at most {MAX_KEYS})"),
    "key of 2**40 bytes": (lambda g: g.extra_kvs.append(u64(2**40) + b"k"), "is 1099511627776 bytes long"),
    "string value of 2**40 bytes": (
        lambda g: g.extra_kvs.append(kv("x.s", VT.STRING, u64(2**40) + b"abc")),
        "the value of metadata key 'x.s' runs past the end",
    ),
    "string array of 2**62": (
        lambda g: g.extra_kvs.append(kv("x.a", VT.ARRAY, u32(VT.STRING) + u64(2**62))),
        "claims 4611686018427387904 elements",
    ),
    "uint8 array of 2**62": (lambda g: g.extra_kvs.append(kv("x.a", VT.ARRAY, u32(VT.UINT8) + u64(2**62))), "claims"),
    "arrays over the total cap": (
        lambda g: g.extra_kvs.extend(
            [  # the first holds its bytes, the second only claims them
                kv("x.0", VT.ARRAY, u32(VT.UINT8) + u64(MAX_ARRAY_ELEMENTS // 2 + 1) + bytes(MAX_ARRAY_ELEMENTS // 2 + 1)),
                kv("x.1", VT.ARRAY, u32(VT.UINT8) + u64(MAX_ARRAY_ELEMENTS // 2 + 1)),
            ]
        ),
        "in all arrays together",
    ),
    "string array past the end": (
        lambda g: g.extra_kvs.append(kv("x.a", VT.ARRAY, u32(VT.STRING) + u64(200_000) + gstr("a"))),
        "metadata array 'x.a' runs past the end",
    ),
    "string in an array of 2**40 bytes": (
        lambda g: g.extra_kvs.append(kv("x.a", VT.ARRAY, u32(VT.STRING) + u64(1) + u64(2**40))),
        "has a string running past the end",
    ),
    "tensor name of 2**40 bytes": (lambda g: g.tensors[0].update(name_len=2**40), "is 1099511627776 bytes long (at most 63)"),
    "tensor name of 64 bytes": (lambda g: g.tensors[0].update(name=b"t" * 64), "is 64 bytes long (at most 63)"),
    "n_dims 2**32-1": (lambda g: g.tensors[0].update(n_dims=2**32 - 1), "has 4294967295 dimensions (1 to 4 allowed)"),
    "n_dims 0": (lambda g: g.tensors[0].update(n_dims=0, dims=[]), "has 0 dimensions"),
    "shape product past 2**64": (lambda g: g.tensors[0].update(dims=[2**32, 2**63, 2**63, 2**63]), "needs bytes"),
}


@pytest.mark.parametrize("case", list(HUGE))
def test_huge_counts_and_lengths(seeds, work, case):
    change, words = HUGE[case]
    path = _edit(seeds["qwen3moe"], work / "huge.gguf", change)
    _error(path, words)


def test_huge_counts_cost_no_memory(seeds, work):
    """Rejecting a lying count costs what parsing the header up to the lie
    costs (measured 5-100 KiB here), not what the count says. tracemalloc sees
    Python and numpy allocations alike; 1 MiB is far below what any of the
    large counts would cost if it were trusted."""
    paths = [_edit(seeds["qwen3moe"], work / f"mem-{i}.gguf", change) for i, (change, _) in enumerate(HUGE.values())]
    open_model(seeds["qwen3moe"]).close()  # first-use imports (the quant table) are not the file's cost
    for path, case in zip(paths, HUGE):
        tracemalloc.start()
        try:
            with pytest.raises(GGUFError):
                open_model(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"{case}: peak {peak / 2**20:.1f} MiB"


# ---------------------------------------------------------- tensor records


def _tensor(which: str, **changes):
    return lambda g: g.tensor(which).update(**changes)


def _twin(g: Rebuild, name: str, twin: str) -> None:
    """A copy of tensor `name` under another name, its bytes appended to the data section."""
    t = g.tensor(name)
    block, size = GGML_QUANT_SIZES[QT(t["type"])]
    nbytes = int(np.prod(t["dims"])) // block * size
    at = len(g.data) + -len(g.data) % g.alignment
    g.data = g.data + bytes(at - len(g.data)) + g.data[t["offset"] : t["offset"] + nbytes]
    g.tensors.append({**t, "name": twin.encode(), "offset": at})


TENSOR_CASES = {
    "offset past the end": (_tensor("output.weight", offset=1 << 40), "needs bytes [1099511"),
    "offset 2**64-32": (_tensor("output.weight", offset=2**64 - 32), "needs bytes"),
    "misaligned offset": (_tensor("output.weight", offset=3), "offset 3 is not aligned to 32"),
    "overlapping tensors": (_tensor("blk.1.ffn_up_exps.weight", offset=0), "overlap"),
    "duplicate tensor name": (lambda g: g.tensors[1].update(name=g.tensors[0]["name"]), "appears twice"),
    "non-UTF-8 tensor name": (lambda g: g.tensors[0].update(name=b"tok\xffembd"), "the name of tensor #0 is not UTF-8"),
    "empty dimension": (lambda g: g.tensors[0].update(dims=[0, 512]), "has an empty dimension"),
    "row not whole blocks": (_tensor("token_embd.weight", dims=[33, 16]), "not a multiple of the Q8_0 block size 32"),
    "unknown quant type": (_tensor("blk.0.ffn_up_exps.weight", type=250), "unknown ggml type id 250"),
    "expert stack of the wrong count": (_tensor("blk.0.ffn_up_exps.weight", dims=[32, 32, 1]), "but the model has 2 experts"),
    "router of the wrong count": (_tensor("blk.0.ffn_gate_inp.weight", dims=[32, 1]), "(2 experts, n_embd 32)"),
    "attention of the wrong width": (_tensor("blk.1.attn_q.weight", dims=[32, 32]), "'blk.1.attn_q.weight' has shape [32, 32]"),
    "layer number written twice": (
        lambda g: _twin(g, "blk.1.ffn_up_exps.weight", "blk.01.ffn_up_exps.weight"),
        "both layer 1's up experts",
    ),
    "3-D embedding": (_tensor("token_embd.weight", dims=[32, 256, 2]), "'token_embd.weight' has shape [2, 256, 32]"),
    "missing attention tensor": (
        _tensor("blk.0.attn_k.weight", name=b"blk.0.attn_kx.weight"),
        "missing tensor 'blk.0.attn_k.weight': every qwen3moe layer needs",
    ),
    "expert bias qwen3moe has not": (
        lambda g: _twin(g, "blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_exps.bias"),
        "layer 0 expert biases: has ['up_bias'], which qwen3moe does not use",
    ),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_bad_tensor_records(seeds, work, case):
    change, words = TENSOR_CASES[case]
    _error(_edit(seeds["qwen3moe"], work / "tensor.gguf", change), words)


@pytest.mark.parametrize(
    "name, words",
    [
        ("blk.0.ffn_down_exps.weight", "'blk.0.ffn_down_exps.weight' is I32, which moe-pipe cannot compute on"),
        ("blk.1.ffn_gate_inp.weight", "'blk.1.ffn_gate_inp.weight' is I32, which moe-pipe cannot compute on"),
        ("blk.0.attn_norm.weight", "norms, biases and scales must be F32, F16 or BF16"),
    ],
)
def test_types_the_kernels_cannot_compute_on(f32_seeds, work, name, words):
    """A ggml type gguf-py knows but no kernel computes on fails at open, not
    when the expert is first routed inside the compute process."""
    _error(_edit(f32_seeds["qwen3moe"], work / "i32.gguf", _tensor(name, type=int(QT.I32))), words)


def test_expert_bias_must_be_f32(seeds, work):
    """An F16 bias read as F32 would be a wrong answer, not an error."""
    path = _edit(seeds["gpt-oss"], work / "bias.gguf", _tensor("blk.0.ffn_up_exps.bias", type=int(QT.F16)))
    _error(path, "expert biases must be F32")


def test_expert_bias_missing(seeds, work):
    """gpt-oss adds a bias to every expert projection: without one the expert
    arithmetic met None (found by the fuzzer; a TypeError in the compute process)."""
    path = _edit(seeds["gpt-oss"], work / "nobias.gguf", _tensor("blk.1.ffn_up_exps.bias", name=b"blk.1.ffn_up_exps.biax"))
    _error(path, "layer 1 expert biases: lacks ['up_bias']")


# ------------------------------------------------------------------ metadata


def _set(key: str, vtype: VT, payload: bytes):
    return lambda g: g.kvs.__setitem__(key, kv(key, vtype, payload))


META_CASES = {
    "expert_count as a string": (
        _set("qwen3moe.expert_count", VT.STRING, gstr("2")),
        "'qwen3moe.expert_count' has type STRING, expected an integer",
    ),
    "expert_count disagrees with the tensors": (_set("qwen3moe.expert_count", VT.UINT32, u32(8)), "8 experts"),
    "block_count beyond the tensors": (_set("qwen3moe.block_count", VT.UINT32, u32(3)), "missing tensor 'blk.2.attn_norm.weight'"),
    "block_count 2**32-1": (_set("qwen3moe.block_count", VT.UINT32, u32(2**32 - 1)), "out of range (1..1024)"),
    "NaN epsilon": (_set("qwen3moe.attention.layer_norm_rms_epsilon", VT.FLOAT32, np.float32("nan").tobytes()), "finite"),
    "zero rope base": (_set("qwen3moe.rope.freq_base", VT.FLOAT32, np.float32(0).tobytes()), "out of range"),
    "linear rope scaling": (_set("qwen3moe.rope.scaling.type", VT.STRING, gstr("linear")), "'linear' is not supported (none, yarn)"),
    "negative YaRN context": (
        lambda g: [
            _set("qwen3moe.rope.scaling.type", VT.STRING, gstr("yarn"))(g),
            _set("qwen3moe.rope.scaling.original_context_length", VT.INT32, (-5).to_bytes(4, "little", signed=True))(g),
        ],
        "original_context_length = -5 is out of range",
    ),
    "odd rope dims": (_set("qwen3moe.rope.dimension_count", VT.UINT32, u32(7)), "must be even"),
    "head width 0": (_set("qwen3moe.attention.key_length", VT.UINT32, u32(0)), "key_length = 0 is out of range"),
    "per-layer array of 2**20": (
        _set("qwen3moe.attention.head_count_kv", VT.ARRAY, u32(VT.UINT8) + u64(2**20) + b"\1" * 2**20),
        "must hold 2 int values, one per layer (has 1048576",
    ),
    "architecture as a number": (_set("general.architecture", VT.UINT32, u32(7)), "'general.architecture' is UINT32, expected a string"),
    "tokens as a number": (_set("tokenizer.ggml.tokens", VT.UINT32, u32(7)), "expected an array of strings"),
    "token types as strings": (
        _set("tokenizer.ggml.token_type", VT.ARRAY, u32(VT.STRING) + u64(1) + gstr("x")),
        "is an array of STRING, expected an array of integers",
    ),
    "bos id as a string": (_set("tokenizer.ggml.bos_token_id", VT.STRING, gstr("1")), "expected an integer"),
    "non-UTF-8 name": (_set("general.name", VT.STRING, gstr(b"\xfftiny")), "'general.name' holds a string that is not UTF-8"),
    "non-UTF-8 key": (lambda g: g.extra_kvs.append(kv(b"x.\xff", VT.UINT8, b"\0")), "metadata key #"),
    "unknown value type": (lambda g: g.extra_kvs.append(kv("x.t", 99, b"")), "'x.t' has unknown value type id 99"),
    "array of arrays": (lambda g: g.extra_kvs.append(kv("x.t", VT.ARRAY, u32(VT.ARRAY) + u64(0))), "which no model uses"),
    "duplicate key": (lambda g: g.extra_kvs.append(g.kvs["general.name"]), "'general.name' appears twice"),
    "alignment 0": (_set("general.alignment", VT.UINT32, u32(0)), "must be a power of two up to"),
    "alignment 2**31": (_set("general.alignment", VT.UINT32, u32(2**31)), "not 2147483648"),
    "alignment as a string": (_set("general.alignment", VT.STRING, gstr("32")), "'general.alignment' is STRING, expected UINT32"),
    "unsupported architecture": (_set("general.architecture", VT.STRING, gstr("mamba")), "'mamba' is not supported"),
    "GGUF version 1": (lambda g: setattr(g, "version", 1), "GGUF version 1 is not supported"),
    "big-endian": (lambda g: setattr(g, "version", 3 << 24), "big-endian GGUF files are not supported"),
}


@pytest.mark.parametrize("case", list(META_CASES))
def test_bad_metadata(seeds, work, case):
    change, words = META_CASES[case]
    _error(_edit(seeds["qwen3moe"], work / "meta.gguf", change), words)


def test_non_utf8_token_is_named_when_read(seeds, work):
    """Vocabulary strings are decoded when the tokenizer asks, not at open (a
    262k vocabulary costs ~0.3 s to decode); the error then names the key."""
    raw = seeds["qwen3moe"].read_bytes()
    at = raw.index(gstr("<|im_start|>"))  # a token in tokenizer.ggml.tokens
    path = work / "token.gguf"
    path.write_bytes(raw[: at + 8] + b"\xff" + raw[at + 9 :])
    with GGUFFile(path) as f, pytest.raises(GGUFError, match="'tokenizer.ggml.tokens' holds a string that is not UTF-8"):
        f.meta("tokenizer.ggml.tokens")


# ---------------------------------------------------------------- split sets


def write_split_set(seed: Path, folder: Path, prefix: str, whole_data: bool = False) -> list[Path]:
    """The seed cut into three shards by hand: metadata and 9 tensors in the
    first, 9 in each of the others, each shard its own valid GGUF holding its
    tensors' bytes (or, whole_data, every shard all of them: offsets unchanged)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    g = Rebuild.read(seed)
    paths = []
    for i in range(3):
        part = g.tensors[i * 9 : (i + 1) * 9]  # the writer lays tensors out in this order
        base, end = part[0]["offset"], g.tensors[(i + 1) * 9]["offset"] if i < 2 else len(g.data)
        if whole_data:
            base, end = 0, len(g.data)
        kvs = dict(g.kvs) if i == 0 else {"general.architecture": g.kvs["general.architecture"]}
        kvs["split.no"] = kv("split.no", VT.UINT16, i.to_bytes(2, "little"))
        kvs["split.count"] = kv("split.count", VT.UINT16, (3).to_bytes(2, "little"))
        kvs["split.tensors.count"] = kv("split.tensors.count", VT.INT32, u32(len(g.tensors)))
        shard = Rebuild(kvs, [{**t, "offset": t["offset"] - base} for t in part], g.data[base:end])
        paths.append(shard.write(folder / f"{prefix}-{i + 1:05d}-of-00003.gguf"))
    return paths


@pytest.fixture()
def split_set(seeds, work) -> list[Path]:
    return write_split_set(seeds["qwen3moe"], work / "split", "m")


def test_split_set_opens(split_set):
    assert check_one(split_set[1]) == "opened"
    with open_model(split_set[2]) as mf:
        assert {t.shard for t in mf.gguf.tensors.values()} == {0, 1, 2}


def test_split_set_missing_shard(split_set):
    split_set[1].unlink()
    _error(split_set[0], "split set is incomplete: missing m-00002-of-00003.gguf")


def test_split_name_claiming_99999_parts(split_set):
    path = split_set[0].with_name("m-00001-of-99999.gguf")
    shutil.copyfile(split_set[0], path)
    msg = _error(path, "and 99995 more")
    assert len(msg) < len(str(path)) + 200


def test_split_shard_from_another_set(split_set, work):
    g = Rebuild.read(split_set[1])
    g.kvs["split.count"] = kv("split.count", VT.UINT16, (4).to_bytes(2, "little"))
    g.write(split_set[1])
    _error(split_set[0], "split metadata says part 1 of 4, expected part 1 of 3")


def test_split_shard_with_a_bad_number(split_set):
    g = Rebuild.read(split_set[2])
    g.kvs["split.no"] = kv("split.no", VT.STRING, gstr(b"\xff"))
    g.write(split_set[2])
    _error(split_set[0], "'split.no' is STRING, expected an integer")


def test_split_tensor_count_mismatch(split_set):
    g = Rebuild.read(split_set[0])
    g.kvs["split.tensors.count"] = kv("split.tensors.count", VT.INT32, u32(99))
    g.write(split_set[0])
    _error(split_set[0], "split set holds 27 tensors but split.tensors.count says 99")


# ----------------------------------------------------------------- truncation


def test_truncated_at_every_header_byte(seeds, work):
    """Every cut from 0 bytes to the last tensor's last byte names truncation.
    The gemma4 seed has the most record kinds (strings, numbers, int, bool and
    string arrays, 4 kinds of tensor record); cut to one layer and a
    three-token vocabulary its header is 2.6 KB, ~2.7k opens here (the cost
    grows with the square of the header)."""
    g = Rebuild.read(seeds["gemma4"])
    for key in [k for k in g.kvs if k.startswith("tokenizer.") and k != "tokenizer.ggml.model"]:
        del g.kvs[key]
    arrays = {
        "tokenizer.ggml.tokens": u32(VT.STRING) + u64(3) + gstr("a") + gstr("é") + gstr("<eos>"),
        "tokenizer.ggml.token_type": u32(VT.INT32) + u64(3) + u32(1) + u32(1) + u32(3),
        "gemma4.attention.head_count_kv": u32(VT.INT32) + u64(1) + u32(1),
        "gemma4.attention.sliding_window_pattern": u32(VT.BOOL) + u64(1) + b"\1",
    }
    g.kvs.update({key: kv(key, VT.ARRAY, payload) for key, payload in arrays.items()})
    g.kvs["gemma4.block_count"] = kv("gemma4.block_count", VT.UINT32, u32(1))
    g.tensors = [t for t in g.tensors if not t["name"].startswith(b"blk.1.")]
    path = g.write(work / "cut.gguf")
    assert check_one(path) == "opened"
    with GGUFFile(path) as f:
        header, last_byte = f.data_start(), max(t.end for t in f.tensors.values())
    # Cut from the longest down: shrinking a file is ~6 µs, rewriting one here ~1.7 ms.
    for n in [last_byte - 1, *range(header + 63, -1, -1)]:
        os.truncate(path, n)
        with pytest.raises(GGUFError) as exc:
            open_model(path).close()
        msg = check_error(exc.value, path)
        assert ("truncated" in msg) or (n == 0 and "empty file" in msg), (n, msg)


# ----------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def bad_files(seeds, work) -> dict[str, Path]:
    return {
        "huge tensor count": _edit(seeds["qwen3moe"], work / "cli-huge.gguf", lambda g: setattr(g, "n_tensors", 2**60)),
        "expert_count as a string": _edit(seeds["qwen3moe"], work / "cli-meta.gguf", META_CASES["expert_count as a string"][0]),
    }


@pytest.mark.integration
@pytest.mark.parametrize("command", ["inspect", "run"])
def test_cli_bad_file_is_one_line_exit_2(bad_files, command):
    """The real console entry point in a fresh process: stderr is one line, no traceback."""
    bad = bad_files["huge tensor count"]
    argv = [command, str(bad)] + (["-p", "hi", "-n", "1"] if command == "run" else [])
    r = subprocess.run([sys.executable, "-m", "moe_pipe.cli.main", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("moe-pipe: error: ") and str(bad) in lines[0] and "tensors" in lines[0]


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_cli_wrong_key_type_in_process(bad_files, capsys, command):
    bad = bad_files["expert_count as a string"]
    argv = [command, str(bad)] + (["-p", "hi", "-n", "1"] if command == "run" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'qwen3moe.expert_count' has type STRING" in err[0]


# ----------------------------------------------------------------------- fuzz


def write_new(path: Path, data: bytes) -> None:
    """Replace the file rather than rewrite it: on this disk truncating an
    existing file in place costs ~1.7 ms, a new one ~0.05 ms."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def _fuzz(parsed: list[Seed], path: Path, which: int, ops) -> None:
    write_new(path, mutate(parsed[which % len(parsed)], ops))
    check_one(path)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 2), ops=OPS)
def test_fuzz_header_mutations(parsed, work, which, ops):
    _fuzz(parsed, work / "fuzz.gguf", which, ops)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 2), ops=OPS)
def test_fuzz_header_mutations_long(parsed, work, which, ops):
    _fuzz(parsed, work / "fuzz-long.gguf", which, ops)


@pytest.fixture(scope="module")
def split_seeds(seeds, work) -> list[tuple[Path, Seed]]:
    """Shards that keep every tensor byte, so a mutated offset stays as likely to land as in one file."""
    return [(p, parse_seed(p)) for p in write_split_set(seeds["qwen3moe"], work / "split-fuzz", "s", whole_data=True)]


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(shard=st.integers(0, 2), ops=OPS)
def test_fuzz_one_shard_of_a_split_set(split_seeds, shard, ops):
    """A mutated shard among intact ones, opened from the first shard: the
    split checks, cross-shard duplicates and per-shard bounds all run."""
    for path, seed in split_seeds:
        write_new(path, mutate(seed, ops) if path == split_seeds[shard][0] else seed.data)
    check_one(split_seeds[0][0])


# --------------------------------------------------------------------- corpus


def corpus_files() -> list[Path]:
    return sorted(CORPUS.glob("*.bin"))  # not .gguf: the repository ignores *.gguf


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.stem)
def test_corpus_regression(path, work):
    """Inputs that once broke the loader (crash, hang, wrong message, memory)."""
    copy = work / "corpus" / "input.gguf"  # a plain name: no split-set lookup around the corpus
    copy.parent.mkdir(exist_ok=True)
    shutil.copyfile(path, copy)
    check_one(copy)


def input_name(data: bytes, signature: str) -> str:
    """The corpus file name of an input: what broke, then a content hash."""
    slug = "".join(c if c.isalnum() else "-" for c in signature)[:60].strip("-")
    return f"{slug}-{hashlib.sha1(data).hexdigest()[:10]}.bin"
