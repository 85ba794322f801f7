"""Opening GGUF files: one file or a split set, checked against the bytes on disk.

Parsing is gguf-py's (`GGUFReader`, a zero-copy memmap); what this module adds
is what the engine needs before it trusts a downloaded file:

- every tensor's bytes lie inside its own file, at an aligned offset, and no
  two tensors overlap — checked *before* gguf-py builds its views, so a
  truncated file is reported as "tensor X needs bytes [a, b), file has n"
  rather than as a numpy reshape error;
- a split set (`name-00001-of-00003.gguf`) is found from any of its shards,
  and a missing or mismatched shard is named;
- every failure is a `GGUFError`: one line naming the file and the problem.

Tensor shapes here are numpy order (ne reversed): a ggml ne = [in, out, E]
expert stack is shape (E, out, in).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from .errors import GGUFError

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MAX_DIMS = 4


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
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


class ArrayField(ReaderField):
    """A metadata array parsed in one pass: numbers as one numpy view, strings as
    (start, length) pairs decoded only when asked for.

    gguf-py builds two numpy views per array element, which takes ~10 s for a
    150k-token vocabulary; this keeps opening a real model well under a second.
    """

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        values = self.values  # set by _CheckedReader
        if isinstance(values, np.ndarray):
            return values[index_or_slice].tolist()
        data, spans = values
        if isinstance(index_or_slice, int):
            start, n = spans[index_or_slice]
            return bytes(data[start : start + n]).decode("utf-8")
        return [bytes(data[a : a + n]).decode("utf-8") for a, n in spans[index_or_slice].tolist()]


class _CheckedReader(GGUFReader):
    """gguf-py's reader with fast metadata arrays and the tensor table validated
    before views are built."""

    def _build_fields(self, offs: int, count: int) -> int:
        end = int(self.data.shape[0])
        for _ in range(int(count)):
            orig = offs
            klen, kdata = self._get_str(offs)
            if offs + 8 + int(klen[0]) > end:
                raise ValueError(f"metadata key at byte {offs} runs past the end of the file")
            offs += 8 + int(klen[0])
            raw_type = self._get(offs, np.uint32)
            offs += 4
            name = bytes(kdata).decode("utf-8")
            if int(raw_type[0]) == GGUFValueType.ARRAY:
                field, offs = self._array_field(orig, name, [klen, kdata, raw_type], offs, end)
            else:
                size, parts, idxs, types = self._get_field_parts(offs, int(raw_type[0]))
                field = ReaderField(orig, name, [klen, kdata, raw_type, *parts], [i + 3 for i in idxs], types)
                offs += size
            self._push_field(field, skip_sum=True)
        return offs

    def _array_field(self, orig: int, name: str, head: list, offs: int, end: int) -> tuple[ReaderField, int]:
        itype_raw = self._get(offs, np.uint32)
        n_raw = self._get(offs + 4, np.uint64)
        itype, n = GGUFValueType(int(itype_raw[0])), int(n_raw[0])
        offs += 12
        parts = [*head, itype_raw, n_raw]
        if itype in _SCALAR_SIZES:
            size = _SCALAR_SIZES[itype]
            if offs + n * size > end:  # checked before any allocation sized by n
                raise ValueError(f"metadata array {name!r} claims {n} elements, more than the file holds")
            dtype = self.gguf_scalar_to_np[itype]
            field = ArrayField(orig, name, parts, [], [GGUFValueType.ARRAY, itype])
            field.values = self._get(offs, dtype, n)
            return field, offs + n * size
        if itype == GGUFValueType.STRING:
            if offs + n * 8 > end:
                raise ValueError(f"metadata array {name!r} claims {n} strings, more than the file holds")
            spans, offs = _scan_strings(self.data, offs, n, end, name)
            field = ArrayField(orig, name, parts, [], [GGUFValueType.ARRAY, itype])
            field.values = (self.data, spans)
            return field, offs
        raise ValueError(f"metadata array {name!r} has elements of type {itype.name}, which no model uses")

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        file_bytes = int(self.data.shape[0])
        for field in fields:
            _check_tensor_info(field, start_offs, self.alignment, file_bytes)
        super()._build_tensors(start_offs, fields)


def _scan_strings(data: np.ndarray, offs: int, n: int, end: int, name: str) -> tuple[np.ndarray, int]:
    """(start, length) of each of n length-prefixed strings, and the offset after them."""
    buf = memoryview(data)
    spans = np.empty((n, 2), np.int64)
    for i in range(n):
        if offs + 8 > end:
            raise ValueError(f"metadata array {name!r} runs past the end of the file")
        length = int.from_bytes(buf[offs : offs + 8], "little")
        offs += 8
        if offs + length > end:
            raise ValueError(f"metadata array {name!r} has a string running past the end of the file")
        spans[i] = offs, length
        offs += length
    return spans, offs


def _check_tensor_info(field, data_start: int, alignment: int, file_bytes: int) -> None:
    _name_len, name_data, n_dims, dims, raw_type, rel_offset = field.parts
    name = bytes(name_data).decode("utf-8", errors="replace")
    if int(n_dims[0]) > _MAX_DIMS or len(dims) != int(n_dims[0]):
        raise ValueError(f"tensor {name!r} has {int(n_dims[0])} dimensions (at most {_MAX_DIMS})")
    try:
        qtype = GGMLQuantizationType(int(raw_type[0]))
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown ggml type id {int(raw_type[0])}") from None
    block, size = GGML_QUANT_SIZES[qtype]
    ne = [int(d) for d in dims]
    if any(d <= 0 for d in ne):
        raise ValueError(f"tensor {name!r} has an empty or negative dimension {ne}")
    if ne[0] % block:
        raise ValueError(f"tensor {name!r}: row length {ne[0]} is not a multiple of the {qtype.name} block size {block}")
    n_elements = 1
    for d in ne:  # Python ints: a lying count cannot overflow into a small size
        n_elements *= d
    nbytes = n_elements // block * size
    start = data_start + int(rel_offset[0])
    if int(rel_offset[0]) % alignment:
        raise ValueError(f"tensor {name!r} offset {int(rel_offset[0])} is not aligned to {alignment}")
    if start + nbytes > file_bytes:
        raise ValueError(f"truncated or corrupt: tensor {name!r} needs bytes [{start}, {start + nbytes}) but the file has {file_bytes}")


def _reader_error(path: Path, exc: Exception) -> GGUFError:
    msg = str(exc)
    if "magic" in msg.lower():
        return GGUFError(path, "not a GGUF file (bad magic number)")
    if "empty file" in msg:
        return GGUFError(path, "empty file, not a GGUF model")
    if msg.startswith("truncated"):
        return GGUFError(path, msg)
    if "larger dtype" in msg or "cannot reshape" in msg or isinstance(exc, (IndexError, OverflowError)):
        msg = "a read ran past the end of the file"  # numpy's words for a short memmap slice
    if "past the end" in msg or "file holds" in msg:
        return GGUFError(path, f"truncated or corrupt GGUF header: {msg}")
    return GGUFError(path, f"invalid GGUF: {msg}")


def _open_reader(path: Path) -> GGUFReader:
    if not path.exists():
        raise GGUFError(path, "no such file")
    if path.is_dir():
        raise GGUFError(path, "is a directory, not a GGUF file")
    try:
        return _CheckedReader(path)
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
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise GGUFError(path, f"split set is incomplete: missing {', '.join(missing)}")
    return paths


def _field_value(field) -> Any:
    """A metadata field as plain Python (scalars, str, lists)."""
    try:
        return field.contents()
    except UnicodeDecodeError:
        raise ValueError(f"metadata key {field.name!r} holds a string that is not UTF-8") from None


class GGUFFile:
    """A GGUF model: metadata from the first shard, tensors from every shard."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.paths = split_paths(self.path)
        self.readers = [_open_reader(p) for p in self.paths]
        self.file_sizes = [int(r.data.shape[0]) for r in self.readers]
        self._meta_cache: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._views: dict[str, np.ndarray] = {}
        for shard, reader in enumerate(self.readers):
            self._add_shard_tensors(shard, reader)
        if len(self.paths) > 1:
            self._check_split_set()
        self._check_no_overlap()

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
            try:
                self._meta_cache[key] = _field_value(self.fields[key])
            except ValueError as exc:
                raise GGUFError(self.path, str(exc)) from None
        return self._meta_cache[key]

    def meta_type(self, key: str) -> tuple[GGUFValueType, ...]:
        return tuple(self.fields[key].types)

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
            no = _field_value(f_no) if f_no is not None else None
            n = _field_value(f_count) if f_count is not None else None
            if no != i or n != count:
                raise GGUFError(self.paths[i], f"split metadata says part {no} of {n}, expected part {i} of {count} (0-based)")
        f_total = self.readers[0].fields.get("split.tensors.count")
        if f_total is not None and _field_value(f_total) != len(self.tensors):
            raise GGUFError(self.path, f"split set holds {len(self.tensors)} tensors but split.tensors.count says {_field_value(f_total)}")

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
        return self._views[name]

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

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
