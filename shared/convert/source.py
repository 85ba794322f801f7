"""The Hugging Face side of `moe-pipe convert`: config, tokenizer files and safetensors.

Safetensors are read by parsing their JSON header and memory-mapping the data
with numpy, so no torch is needed and a tensor is only paged in when it is
converted. The file format (safetensors spec):

    +---------+----------------------------+-------------------------------+
    | u64 LE N| N bytes of JSON header     | data (offsets are relative to |
    |         | {name: {dtype, shape,      | the end of the header)        |
    |         |   data_offsets: [b, e]}}   |                               |
    +---------+----------------------------+-------------------------------+
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError

# safetensors dtype -> (numpy dtype of the stored bits, how to read it as float32)
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_FLOAT = {"F64", "F32", "F16", "BF16"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object at the top level")
    return data


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class Checkpoint:
    """Every tensor of a (possibly sharded) safetensors checkpoint, by name."""

    def __init__(self, hf_dir: Path):
        self.dir = hf_dir
        self.entries: dict[str, _Entry] = {}
        self._maps: dict[Path, np.memmap] = {}
        for file in self._files():
            self._read_header(file)
        if not self.entries:
            raise UserError(f"{hf_dir}: the safetensors files hold no tensors")

    def _files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{index}: has no 'weight_map'")
            files = sorted({self.dir / str(v) for v in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise UserError(f"{f}: shard listed in {index.name} is missing")
            return files
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise UserError(f"{self.dir}: no model.safetensors (or *.safetensors shards) found; only safetensors checkpoints are supported")
        return files

    def _read_header(self, file: Path) -> None:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{file}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise UserError(f"{file}: bad safetensors header length {n}")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise UserError(f"{file}: the safetensors header is not valid JSON") from None
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            if dtype not in _DTYPES:
                raise UserError(f"{file}: tensor {name} has dtype {dtype}, which convert does not read")
            if e - b != int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize or base + e > size:
                raise UserError(
                    f"{file}: tensor {name} has a byte range that does not fit its shape {list(shape)} or the file (truncated download?)"
                )
            if name in self.entries:
                raise UserError(f"{file}: tensor {name} also appears in {self.entries[name].file.name}")
            self.entries[name] = _Entry(file, dtype, shape, base + b, base + e)

    # --- access -------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        return self._entry(name).dtype

    def _entry(self, name: str) -> _Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise UserError(f"{self.dir}: tensor {name} is missing from the checkpoint") from None

    def raw(self, name: str) -> np.ndarray:
        """The stored bits, memory-mapped (BF16 as uint16)."""
        ent = self._entry(name)
        mm = self._maps.get(ent.file)
        if mm is None:
            mm = self._maps[ent.file] = np.memmap(ent.file, dtype=np.uint8, mode="r")
        return mm[ent.begin : ent.end].view(_DTYPES[ent.dtype]).reshape(ent.shape)

    def f32(self, name: str, index: Any = ...) -> np.ndarray:
        """`raw(name)[index]` as a float32 array (a copy; BF16 widened exactly)."""
        ent = self._entry(name)
        if ent.dtype not in _FLOAT:
            raise UserError(f"{ent.file}: tensor {name} has dtype {ent.dtype}, expected a float type")
        return to_f32(self.raw(name)[index], ent.dtype)

    def close(self) -> None:
        self._maps.clear()


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (np.asarray(a, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, np.float32).copy() if a.dtype == np.float32 else np.asarray(a).astype(np.float32)
