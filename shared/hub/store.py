"""Where pulled models live and how they are found again.

`moe-pipe pull` writes into `$MOE_PIPE_MODELS` (default
`$XDG_CACHE_HOME/moe-pipe/models/`, beside the embedded tiny model), one
folder per repository (`org--name/`), keeping the repository's own paths, or
into the `--dir` it is given. Every complete, verified pull is recorded in
`pulled.json` in moe-pipe's cache folder: repository, quant, the first file of
the set and the files' sizes. That record is how `moe-pipe up NAME`, a
recipe's `model.catalog` and `moe-pipe models` find a pulled model wherever it
was written; an entry whose files are gone or changed size is ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..makemodel.default_model import cache_dir

RECORD_NAME = "pulled.json"


def models_dir() -> Path:
    return Path(os.environ.get("MOE_PIPE_MODELS") or cache_dir() / "models")


def repo_dir(repo: str) -> Path:
    return models_dir() / repo.replace("/", "--")


def record_path() -> Path:
    return cache_dir() / RECORD_NAME


@dataclass(frozen=True)
class Pulled:
    repo: str
    quant: str
    path: Path  # the first file of the set: what `up` and the reader open
    files: tuple[tuple[str, int], ...]  # (path, bytes) of every file of the set
    revision: str
    pulled_at: float

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.files)

    def intact(self) -> bool:
        """Every file still there at the size it was pulled at."""
        try:
            return all(os.stat(p).st_size == n for p, n in self.files)
        except OSError:
            return False


def _load_records() -> list[dict]:
    try:
        data = json.loads(record_path().read_text())
    except (OSError, ValueError):
        return []  # none yet, or unreadable: a new pull writes a fresh one
    return [e for e in data.get("pulled", []) if isinstance(e, dict)] if isinstance(data, dict) else []


def _entry(e: dict) -> Pulled | None:
    try:
        return Pulled(
            str(e["repo"]),
            str(e["quant"]),
            Path(e["path"]),
            tuple((str(p), int(n)) for p, n in e["files"]),
            str(e.get("revision", "")),
            float(e.get("pulled_at", 0.0)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def pulled() -> list[Pulled]:
    """Every recorded pull whose files are all still there, newest first."""
    out = [p for p in map(_entry, _load_records()) if p is not None and p.intact()]
    return sorted(out, key=lambda p: -p.pulled_at)


def find_pulled(repo: str, quant: str) -> Pulled | None:
    for p in pulled():
        if p.repo.lower() == repo.lower() and p.quant.lower() == quant.lower():
            return p
    return None


def record(repo: str, quant: str, files: list[Path], revision: str) -> Pulled:
    """Record a complete, verified pull (replacing an earlier one of the same first file)."""
    first = files[0].resolve()
    entry = {
        "repo": repo,
        "quant": quant,
        "path": str(first),
        "files": [[str(f.resolve()), f.stat().st_size] for f in files],
        "revision": revision,
        "pulled_at": time.time(),
    }
    kept = [e for e in _load_records() if e.get("path") != str(first)]
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole and renamed: a pull killed while writing leaves the old record, never half of one
    fd, tmp = tempfile.mkstemp(prefix=".pulled-", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump({"pulled": [entry, *kept]}, fh, indent=1)
    os.replace(tmp, path)
    result = _entry(entry)
    assert result is not None
    return result
