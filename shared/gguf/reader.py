"""Opening GGUF files: one file or a split set, checked against the bytes on disk.

Parsing is gguf-py's (`GGUFReader`, a zero-copy memmap); what this module adds
is what the engine needs before it trusts a downloaded file:

- the fixed header is read first and every count it declares (tensors, keys)
  is checked against a cap and against the bytes the file has, *before* any
  loop or allocation sized by it; so is every length, dimension count and
  array size met while parsing. A file that says "2**60 tensors" or "a
  2**40-byte string" costs what parsing its header up to the lie costs
  (5-100 KiB for the test models), and parsing itself is capped;
- every tensor's bytes lie inside its own file, at an aligned offset, and no
  two tensors overlap, checked *before* gguf-py builds its views, so a
  truncated file is reported as "tensor X needs bytes [a, b), file has n"
  rather than as a numpy reshape error;
- keys the engine reads (general.*, split.*, tokenizer.*) have the type the
  GGUF spec gives them, so no caller meets `int("qwen3moe")`;
- a split set (`name-00001-of-00003.gguf`) is found from any of its shards,
  and a missing or mismatched shard is named;
- every failure is a `GGUFError`: one line naming the file and the problem.

A file's header alone opens too (`GGUFFile.from_headers`): the first bytes
of each shard, as a range request fetches them before the download
(shared/hub/header.py), with the whole file's size declared. Every check
above runs against the declared size; a record that runs past the bytes at
hand but not past the declared size is a `HeaderIncomplete` (how many bytes
it needs), so the fetcher asks for more; tensors carry no data views.

Tensor shapes here are numpy order (ne reversed): a ggml ne = [in, out, E]
expert stack is shape (E, out, in).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor

from ..errors import GGUFError

_U64 = struct.Struct("<Q")
_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

# What a header may declare. gguf-py keeps a few numpy views per record:
# measured with tracemalloc, ~3 KB per key and ~5 KB per tensor (with our
# TensorInfo), ~90 µs each to parse. The caps bound that to ~12 MB + ~80 MB
# and ~1.5 s whatever the file says; real models sit far below them
# (Llama-3.1-405B holds 1,138 tensors, DeepSeek-V3 ~1,200, files ~50 keys).
MAX_TENSORS = 1 << 14
MAX_KEYS = 1 << 12
# All metadata arrays of a file together: string arrays cost 16 B (start, length)
# and ~0.4 µs of scanning per element (all 4 M: ~2 s). The largest vocabularies (262,144
# tokens; 128k tokens + 280k merges) come to ~1 M elements with types and scores.
MAX_ARRAY_ELEMENTS = 1 << 22
MAX_KEY_BYTES = 256  # real keys are under 64 bytes; a key is decoded and may be quoted in a message
MAX_TENSOR_NAME_BYTES = 63  # llama.cpp rejects names of GGML_MAX_NAME (64) bytes or more
_VERSIONS = (2, 3)
_HEADER_BYTES = 24  # magic, version u32, tensor count u64, key count u64
# The smallest records a count can stand for, so "count × smallest > bytes
# left" proves a count false before anything loops over it.
_MIN_KEY_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset


class HeaderIncomplete(GGUFError):
    """A header-only file whose header runs past the bytes at hand (not past the file's declared size)."""

    def __init__(self, path, needed: int, have: int):
        self.needed, self.have = needed, have
        super().__init__(path, f"the header runs past the {have:,} bytes fetched (needs at least {needed:,})")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: last axis is ne0 (contiguous)
    shard: int  # index into GGUFFile.paths
    offset: int  # absolute byte offset in its shard
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size


_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


class ArrayField(ReaderField):
    """A metadata array parsed in one pass: numbers as one numpy view, strings as
    start and length arrays, decoded only when asked for.

    gguf-py builds two numpy views per array element, which takes ~10 s for a
    150k-token vocabulary; this keeps opening a real model well under a second.
    """

    # Set by _CheckedReader right after construction (an attribute, not a tuple
    # field: the NamedTuple's fields stay gguf-py's): the numbers, or for strings
    # (file bytes, start of each string, length of each string).
    values: np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        values = self.values
        if isinstance(values, np.ndarray):
            return values[index_or_slice].tolist()
        data, starts, lengths = values
        if isinstance(index_or_slice, int):
            start, n = int(starts[index_or_slice]), int(lengths[index_or_slice])
            return bytes(data[start : start + n]).decode("utf-8")
        pairs = zip(starts[index_or_slice].tolist(), lengths[index_or_slice].tolist())
        return [bytes(data[a : a + n]).decode("utf-8") for a, n in pairs]

    def n_elements(self) -> int:
        """The array's length, without decoding it (len() is the NamedTuple's)."""
        values = self.values
        return len(values) if isinstance(values, np.ndarray) else len(values[1])  # (data, starts, lengths)


def _show(name: str, limit: int = 60) -> str:
    """A name from the file for a message: quoted, and short even if the file's is not."""
    return repr(name if len(name) <= limit else name[:limit] + "…")


def _check_preamble(path: Path, declared_bytes: int | None = None) -> None:
    """The fixed 24-byte header, read with plain file IO before gguf-py maps the
    file: magic, version, byte order, and both counts against the file size
    (`declared_bytes` for a header-only file: the whole file's)."""
    have = path.stat().st_size
    size = have if declared_bytes is None else declared_bytes
    if size == 0:
        raise GGUFError(path, "empty file, not a GGUF model")
    with open(path, "rb") as fh:
        head = fh.read(_HEADER_BYTES)
    if len(head) < min(size, _HEADER_BYTES):
        raise HeaderIncomplete(path, _HEADER_BYTES, have)
    if len(head) < 4 and b"GGUF".startswith(head):
        raise GGUFError(path, f"truncated GGUF header: the file has {size} bytes, the fixed header alone needs {_HEADER_BYTES}")
    if head[:4] != b"GGUF":
        raise GGUFError(path, "not a GGUF file (bad magic number)")
    if len(head) < _HEADER_BYTES:
        raise GGUFError(path, f"truncated GGUF header: the file has {size} bytes, the fixed header alone needs {_HEADER_BYTES}")
    version = int.from_bytes(head[4:8], "little")
    if version not in _VERSIONS:
        if int.from_bytes(head[4:8], "big") in _VERSIONS:
            # gguf-py would read it, but quantized blocks keep their scales in
            # the file's byte order and the kernels read little-endian ones.
            raise GGUFError(path, "big-endian GGUF files are not supported; use the little-endian build of this model")
        raise GGUFError(path, f"GGUF version {version} is not supported (versions {' and '.join(map(str, _VERSIONS))} are)")
    n_tensors, n_keys = int.from_bytes(head[8:16], "little"), int.from_bytes(head[16:24], "little")
    for n, what, cap, smallest in (
        (n_keys, "metadata keys", MAX_KEYS, _MIN_KEY_BYTES),
        (n_tensors, "tensors", MAX_TENSORS, _MIN_TENSOR_INFO_BYTES),
    ):
        if n > cap:
            raise GGUFError(path, f"corrupt GGUF header: it declares {n} {what} (at most {cap})")
        need = _HEADER_BYTES + (n_keys * _MIN_KEY_BYTES if what == "tensors" else 0) + n * smallest
        if need > size:
            raise GGUFError(
                path, f"truncated or corrupt GGUF header: it declares {n} {what}, which need at least {need} bytes, and the file has {size}"
            )


class _CheckedReader(GGUFReader):
    """gguf-py's reader with every read bounds-checked before it is made, fast
    metadata arrays, and the tensor table validated before views are built.

    gguf-py's own loops trust the counts and lengths in the file (a short read
    becomes an IndexError far from its cause); these overrides replace its
    metadata and tensor-info loops and raise a GGUFError naming the record.
    """

    def __init__(self, path: Path, declared_bytes: int | None = None):
        self._path = path
        self._declared = declared_bytes  # a header-only file: the whole file's size
        self._array_budget = MAX_ARRAY_ELEMENTS
        _check_preamble(path, declared_bytes)
        super().__init__(path)

    @property
    def file_bytes(self) -> int:
        """The file's size: the bytes here, or the declared size of a header-only file."""
        return int(self.data.shape[0]) if self._declared is None else self._declared

    def _past_end(self, end: int, problem: str) -> GGUFError:
        """Running past the bytes at hand (`problem` says what did): more to fetch (header-only,
        inside the declared size) or a truncated file."""
        if self._declared is not None and end <= self._declared:
            return HeaderIncomplete(self._path, end, int(self.data.shape[0]))
        return self._fail(f"truncated or corrupt GGUF header: {problem}")

    # -- bounded reads ----------------------------------------------------
    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        """gguf-py's `_get` on a plain ndarray view of the same pages: numpy's
        memmap subclass costs ~5 µs per slice (__array_finalize__), 70 % of
        opening a header through it; the views still keep the mapping alive."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = np.asarray(self.data)
        count = int(count)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _fail(self, problem: str) -> GGUFError:
        return GGUFError(self._path, problem)

    def _read(self, offs: int, dtype, count: int, what: str) -> np.ndarray:
        """`count` values at `offs`, or a GGUFError if the file ends first."""
        end = offs + np.dtype(dtype).itemsize * count
        if end > self.data.shape[0]:
            raise self._past_end(end, f"{what} runs past the end of the file (needs bytes up to {end}, the file has {self.file_bytes})")
        return self._get(offs, dtype, count)

    def _read_str(self, offs: int, what: str, max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """(length, bytes, offset after) of a length-prefixed string."""
        n_raw = self._read(offs, np.uint64, 1, what)
        n = int(n_raw[0])
        if max_bytes is not None and n > max_bytes:
            raise self._fail(f"corrupt GGUF header: {what} is {n} bytes long (at most {max_bytes})")
        return n_raw, self._read(offs + 8, np.uint8, n, what), offs + 8 + n

    def _utf8(self, raw: np.ndarray, what: str) -> str:
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail(f"corrupt GGUF header: {what} is not UTF-8 ({bytes(raw)[:40]!r})") from None

    def _value_type(self, raw: np.ndarray, key: str) -> GGUFValueType:
        try:
            return GGUFValueType(int(raw[0]))
        except ValueError:
            raise self._fail(f"corrupt GGUF header: metadata key {_show(key)} has unknown value type id {int(raw[0])}") from None

    # -- metadata ---------------------------------------------------------
    def _build_fields(self, offs: int, count: int) -> int:
        for i in range(int(count)):
            orig = offs
            klen, kdata, offs = self._read_str(offs, f"metadata key #{i} (byte {orig})", MAX_KEY_BYTES)
            name = self._utf8(kdata, f"metadata key #{i} (byte {orig})")
            if name in self.fields:
                raise self._fail(f"corrupt GGUF header: metadata key {_show(name)} appears twice")
            raw_type = self._read(offs, np.uint32, 1, f"metadata key {_show(name)}")
            offs += 4
            vtype = self._value_type(raw_type, name)
            head = [klen, kdata, raw_type]
            if vtype == GGUFValueType.ARRAY:
                field, offs = self._array_field(orig, name, head, offs)
            elif vtype == GGUFValueType.STRING:
                slen, sdata, offs = self._read_str(offs, f"the value of metadata key {_show(name)}")
                field = ReaderField(orig, name, [*head, slen, sdata], [4], [vtype])
            else:
                value = self._read(offs, self.gguf_scalar_to_np[vtype], 1, f"the value of metadata key {_show(name)}")
                field = ReaderField(orig, name, [*head, value], [3], [vtype])
                offs += _SCALAR_SIZES[vtype]
            self._push_field(field, skip_sum=True)
        self._check_alignment()
        return offs

    def _check_alignment(self) -> None:
        """general.alignment checked here, before gguf-py reads it, so its errors
        name the key. 2**30 bounds the padding it adds (a larger power of two is
        no layout a writer makes)."""
        field = self.fields.get("general.alignment")
        if field is None:
            return
        if field.types != [GGUFValueType.UINT32]:
            kind = "an array" if field.types[0] == GGUFValueType.ARRAY else field.types[0].name
            raise self._fail(f"metadata key 'general.alignment' is {kind}, expected UINT32")
        value = int(field.parts[-1][0])
        if not 0 < value <= 1 << 30 or value & (value - 1):
            raise self._fail(f"metadata key 'general.alignment' must be a power of two up to {1 << 30}, not {value}")

    def _array_field(self, orig: int, name: str, head: list, offs: int) -> tuple[ReaderField, int]:
        itype_raw = self._read(offs, np.uint32, 1, f"metadata array {_show(name)}")
        n_raw = self._read(offs + 4, np.uint64, 1, f"metadata array {_show(name)}")
        itype, n = self._value_type(itype_raw, name), int(n_raw[0])
        offs += 12
        if n > self._array_budget:  # checked before any allocation or loop sized by n
            raise self._fail(
                f"corrupt GGUF header: metadata array {_show(name)} claims {n} elements "
                f"(at most {MAX_ARRAY_ELEMENTS} in all arrays together)"
            )
        self._array_budget -= n
        parts = [*head, itype_raw, n_raw]
        field = ArrayField(orig, name, parts, [], [GGUFValueType.ARRAY, itype])
        if itype in _SCALAR_SIZES:
            field.values = self._read(offs, self.gguf_scalar_to_np[itype], n, f"metadata array {_show(name)}")
            return field, offs + n * _SCALAR_SIZES[itype]
        if itype == GGUFValueType.STRING:
            self._read(offs, np.uint64, n, f"metadata array {_show(name)}")  # n lengths at least: bounds n by the file
            starts, lengths, offs = self._scan_strings(offs, n, name)
            field.values = (self.data, starts, lengths)
            return field, offs
        raise self._fail(f"metadata array {_show(name)} has elements of type {itype.name}, which no model uses")

    def _scan_strings(self, offs: int, n: int, name: str) -> tuple[np.ndarray, np.ndarray, int]:
        """Start and length of each of n length-prefixed strings, and the offset after them.

        The one loop a file can make long (n ≤ the array cap, checked by the
        caller): struct and array.array run it at ~0.4 µs a string, 2.7× the
        speed of numpy item assignment, 16 bytes a string."""
        end = int(self.data.shape[0])
        buf = self.data.data  # the mapped bytes as a memoryview (numpy's stubs know no buffer protocol on 3.11)
        unpack = _U64.unpack_from  # little-endian: _check_preamble refused the other order
        starts, lengths = array("q"), array("q")
        for _ in range(n):
            if offs + 8 > end:
                raise self._past_end(offs + 8, f"metadata array {_show(name)} runs past the end of the file")
            (length,) = unpack(buf, offs)
            offs += 8
            if offs + length > end:
                raise self._past_end(offs + length, f"metadata array {_show(name)} has a string running past the end of the file")
            starts.append(offs)
            lengths.append(length)
            offs += length
        return np.frombuffer(starts, np.int64), np.frombuffer(lengths, np.int64), offs

    # -- tensor table -----------------------------------------------------
    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[ReaderField]]:
        fields, names = [], set()
        for i in range(int(count)):
            orig = offs
            name_len, name_data, offs = self._read_str(offs, f"the name of tensor #{i}", MAX_TENSOR_NAME_BYTES)
            name = self._utf8(name_data, f"the name of tensor #{i}")
            label = _show(name) if name else f"#{i} (empty name)"
            if name in names:
                raise self._fail(f"corrupt GGUF header: tensor {label} appears twice")
            names.add(name)
            n_dims = self._read(offs, np.uint32, 1, f"tensor {label}")
            if not 1 <= int(n_dims[0]) <= _MAX_DIMS:  # before reading dims: n_dims sizes that read
                raise self._fail(f"tensor {label} has {int(n_dims[0])} dimensions (1 to {_MAX_DIMS} allowed)")
            dims = self._read(offs + 4, np.uint64, int(n_dims[0]), f"tensor {label}")
            offs += 4 + 8 * int(n_dims[0])
            raw_type = self._read(offs, np.uint32, 1, f"tensor {label}")
            rel_offset = self._read(offs + 4, np.uint64, 1, f"tensor {label}")
            offs += 12
            # The same parts and data indices as gguf-py's own tensor-info field.
            fields.append(ReaderField(orig, name, [name_len, name_data, n_dims, dims, raw_type, rel_offset], [1, 3, 4, 5]))
        return offs, fields

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            self._check_tensor_info(field, start_offs)
        if self._declared is None:
            super()._build_tensors(start_offs, fields)
        else:
            self.tensors = [self._tensor_without_data(f, start_offs) for f in fields]

    def _tensor_without_data(self, field: ReaderField, start_offs: int) -> ReaderTensor:
        """A header-only file's tensor: gguf-py's record, with its sizes and offset and no bytes."""
        _name_len, _name_data, _n_dims, dims, raw_type, rel_offset = field.parts
        qtype = GGMLQuantizationType(int(raw_type[0]))
        block, size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod([int(d) for d in dims], dtype=object))
        offset = start_offs + int(rel_offset[0])
        return ReaderTensor(field.name, qtype, dims, n, n // block * size, offset, np.empty(0, np.uint8), field)

    def _check_tensor_info(self, field: ReaderField, data_start: int) -> None:
        _name_len, _name_data, _n_dims, dims, raw_type, rel_offset = field.parts
        name = field.name
        try:
            qtype = GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise self._fail(f"tensor {_show(name)} has unknown ggml type id {int(raw_type[0])}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        ne = [int(d) for d in dims]
        if any(d <= 0 for d in ne):
            raise self._fail(f"tensor {_show(name)} has an empty dimension {ne}")
        if ne[0] % block:
            raise self._fail(f"tensor {_show(name)}: row length {ne[0]} is not a multiple of the {qtype.name} block size {block}")
        n_elements = 1
        for d in ne:  # Python ints: a lying count cannot overflow into a small size
            n_elements *= d
        nbytes = n_elements // block * size
        rel, alignment = int(rel_offset[0]), int(self.alignment)
        if rel % alignment:
            raise self._fail(f"tensor {_show(name)} offset {rel} is not aligned to {alignment}")
        start, file_bytes = data_start + rel, self.file_bytes
        if start + nbytes > file_bytes:
            raise self._fail(
                f"truncated or corrupt: tensor {_show(name)} needs bytes [{start}, {start + nbytes}) but the file has {file_bytes}"
            )


def _reader_error(path: Path, exc: Exception) -> GGUFError:
    """A safety net for whatever gguf-py (or a future version of it) raises
    past the checks above: still one line and exit code 2. The fuzz tests
    treat reaching it as a finding: each case deserves its own check."""
    return GGUFError(path, f"unreadable GGUF ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")


def _open_reader(path: Path, declared_bytes: int | None = None) -> _CheckedReader:
    if not path.exists():
        raise GGUFError(path, "no such file")
    if path.is_dir():
        raise GGUFError(path, "is a directory, not a GGUF file")
    try:
        return _CheckedReader(path, declared_bytes)
    except GGUFError:
        raise
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError, MemoryError) as exc:
        raise _reader_error(path, exc) from None
    except OSError as exc:
        raise GGUFError(path, f"cannot read: {exc.strerror or exc}") from None


def split_paths(path: Path) -> list[Path]:
    """All shards of the split set `path` belongs to, or [path] for one file."""
    m = _SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1 or int(m["no"]) < 1 or int(m["no"]) > count:
        raise GGUFError(path, f"split file name says part {int(m['no'])} of {count}")
    names = [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    try:  # one listing, not one stat per part: a name may claim 99999 parts (~2 s of stats)
        present = set(os.listdir(path.parent))
    except OSError:
        present = set()
    missing = [n for n in names if n not in present]
    if missing:
        # A name can claim up to 99999 parts: name a few, count the rest, keep the line short.
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise GGUFError(path, f"split set is incomplete: missing {', '.join(missing[:3])}{more}")
    return [path.with_name(n) for n in names]


def _field_value(path: Path, field) -> Any:
    """A metadata field as plain Python (scalars, str, lists)."""
    try:
        return field.contents()
    except UnicodeDecodeError:
        raise GGUFError(path, f"metadata key {_show(field.name)} holds a string that is not UTF-8") from None


INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_STRING = frozenset({GGUFValueType.STRING})
_BOOL = frozenset({GGUFValueType.BOOL})
# Keys read outside spec.py (which checks the per-architecture ones itself):
# (what the value is, allowed element types; arrays say "array of ...").
# Integer keys take any integer width: the value becomes a Python int.
_KNOWN_KEYS: dict[str, tuple[str, frozenset]] = {
    "general.architecture": ("a string", _STRING),
    "general.name": ("a string", _STRING),
    "split.no": ("an integer", INT_TYPES),
    "split.count": ("an integer", INT_TYPES),
    "split.tensors.count": ("an integer", INT_TYPES),
    "tokenizer.ggml.model": ("a string", _STRING),
    "tokenizer.ggml.pre": ("a string", _STRING),
    "tokenizer.ggml.tokens": ("an array of strings", _STRING),
    "tokenizer.ggml.merges": ("an array of strings", _STRING),
    "tokenizer.ggml.token_type": ("an array of integers", INT_TYPES),
    "tokenizer.ggml.scores": ("an array of numbers", FLOAT_TYPES | INT_TYPES),
    "tokenizer.ggml.add_bos_token": ("a bool", _BOOL),
    "tokenizer.ggml.add_eos_token": ("a bool", _BOOL),
    "tokenizer.chat_template": ("a string", _STRING),
    **{
        f"tokenizer.ggml.{t}_token_id": ("an integer", INT_TYPES)
        for t in ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "mask")
    },
}


def _check_known_keys(path: Path, fields) -> None:
    """Known keys of the wrong type fail here, named, instead of as a TypeError
    in whatever code reads them first (tokenizer, chat, split checks)."""
    for key, (what, allowed) in _KNOWN_KEYS.items():
        field = fields.get(key)
        if field is None:
            continue
        types = field.types
        is_array = types[0] == GGUFValueType.ARRAY
        if is_array != what.startswith("an array") or types[-1] not in allowed:
            kind = f"an array of {types[-1].name}" if is_array else types[0].name
            raise GGUFError(path, f"metadata key {key!r} is {kind}, expected {what}")


class GGUFFile:
    """A GGUF model: metadata from the first shard, tensors from every shard."""

    def __init__(self, path: str | os.PathLike, *, _declared_bytes: Sequence[int] | None = None, _paths: Sequence[Path] | None = None):
        self.path = Path(path)
        self.paths = list(_paths) if _paths is not None else split_paths(self.path)
        self.header_only = _declared_bytes is not None  # no tensor bytes here: a forecast's header (from_headers)
        self.readers: list[_CheckedReader] = []
        self._meta_cache: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._views: dict[str, np.ndarray] = {}
        try:
            for i, p in enumerate(self.paths):
                self.readers.append(_open_reader(p, None if _declared_bytes is None else _declared_bytes[i]))
                _check_known_keys(p, self.readers[-1].fields)
            self.file_sizes = [int(r.file_bytes) for r in self.readers]
            for shard, reader in enumerate(self.readers):
                self._add_shard_tensors(shard, reader)
            if len(self.paths) > 1:
                self._check_split_set()
            self._check_no_overlap()
        except BaseException:
            self.close()  # unmap what was opened: a failed open leaves nothing mapped
            raise

    @classmethod
    def from_headers(cls, headers: Sequence[tuple[Path, int]]) -> GGUFFile:
        """A model from its header alone: for each shard in order, a file holding its first
        bytes (at least its whole header and tensor table) and the whole shard's size.
        Everything but the tensors' bytes is there: metadata, names, types, shapes, offsets."""
        if not headers:
            raise ValueError("from_headers: no shards")
        paths = [Path(p) for p, _ in headers]
        return cls(paths[0], _declared_bytes=[int(n) for _, n in headers], _paths=paths)

    # -- metadata ---------------------------------------------------------
    @property
    def fields(self):
        return self.readers[0].fields

    def has(self, key: str) -> bool:
        return key in self.fields

    def meta(self, key: str, default: Any = None) -> Any:
        if key not in self.fields:
            return default
        if key not in self._meta_cache:
            self._meta_cache[key] = _field_value(self.path, self.fields[key])
        return self._meta_cache[key]

    def meta_type(self, key: str) -> tuple[GGUFValueType, ...]:
        return tuple(self.fields[key].types)

    def meta_len(self, key: str) -> int:
        """Elements of an array key (1 for a scalar), without decoding it, so a
        caller can check a length before paying for the list."""
        field = self.fields[key]
        return field.n_elements() if isinstance(field, ArrayField) else 1

    @property
    def arch(self) -> str:
        arch = self.meta("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError(self.path, "metadata has no general.architecture string")
        return arch

    # -- tensors ----------------------------------------------------------
    def _add_shard_tensors(self, shard: int, reader: GGUFReader) -> None:
        for t in reader.tensors:
            if t.name in self.tensors:
                raise GGUFError(self.paths[shard], f"tensor {t.name!r} appears in more than one shard")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, GGMLQuantizationType(t.tensor_type), shape, shard, int(t.data_offset), int(t.n_bytes))
            self._views[t.name] = t.data

    def _check_split_set(self) -> None:
        count = len(self.paths)
        for i, reader in enumerate(self.readers):
            f_no, f_count = reader.fields.get("split.no"), reader.fields.get("split.count")
            no = _field_value(self.paths[i], f_no) if f_no is not None else None  # integers: _check_known_keys
            n = _field_value(self.paths[i], f_count) if f_count is not None else None
            if no != i or n != count:
                raise GGUFError(self.paths[i], f"split metadata says part {no} of {n}, expected part {i} of {count} (0-based)")
        f_total = self.readers[0].fields.get("split.tensors.count")
        total = _field_value(self.path, f_total) if f_total is not None else None
        if total is not None and total != len(self.tensors):
            raise GGUFError(self.path, f"split set holds {len(self.tensors)} tensors but split.tensors.count says {total}")

    def _check_no_overlap(self) -> None:
        by_shard: dict[int, list[TensorInfo]] = {}
        for t in self.tensors.values():
            by_shard.setdefault(t.shard, []).append(t)
        for shard, infos in by_shard.items():
            infos.sort(key=lambda t: t.offset)
            for a, b in zip(infos, infos[1:]):
                if b.offset < a.end:
                    raise GGUFError(self.paths[shard], f"tensors {a.name!r} and {b.name!r} overlap (bytes {b.offset}..{a.end})")

    def data_start(self, shard: int = 0) -> int:
        return int(self.readers[shard].data_offset)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(self.path, f"missing tensor {name!r}") from None

    def view(self, name: str) -> np.ndarray:
        """Zero-copy view of a tensor's bytes (uint8 rows for quantized types)."""
        self.tensor(name)
        if self.header_only:
            raise GGUFError(self.path, f"only the header is here: tensor {name!r} has no bytes (pull the model to run it)")
        return self._views[name]

    def view_by_rows(self, name: str) -> np.ndarray:
        """`view(name)` for a tensor read a few rows at a time (the token embedding): the
        mapping's pages under it are read one at a time as rows are touched, not with the
        read-around a fault normally brings (MADV_RANDOM; several MiB on a disk whose
        readahead is large), so its page cache holds the rows used and little more."""
        view = self.view(name)
        t = self.tensors[name]
        mm = getattr(self.readers[t.shard].data, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_RANDOM"):
            lo = t.offset - t.offset % mmap.PAGESIZE
            try:
                mm.madvise(mmap.MADV_RANDOM, lo, t.end - lo)
            except (OSError, ValueError):
                pass  # advice only: the rows read the same either way
        return view

    @property
    def file_bytes(self) -> int:
        return sum(self.file_sizes)

    def close(self) -> None:
        for r in self.readers:
            mm = getattr(r.data, "_mmap", None)
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view is still alive; the GC closes it later
                    pass
        self.readers = []
        self._views = {}

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
