"""The hot set: which experts a service's cache held, hottest first, kept
across `down`/`up`, crashes and reboots so the next start of the same model
can read them back before anyone asks (docs/architecture.md § Warm restarts).

    $XDG_STATE_HOME/moe-pipe/hot/<digest>.json     (default ~/.local/state/...)

    {"format": "moe-pipe hot set", "version": 1,
     "model": [identity of each shard], "name": "qwen3-30b-a3b",
     "n_layer": 48, "n_expert": 128, "saved_at": 1764752400.0,
     "experts": [[layer, expert], ...]}            hottest first

One file per model file: <digest> is a hash of the file's identity
(directio.model_identity: its size and sampled bytes), so a file moved or
renamed keeps its hot set and a different file never reads another's. It is
written whole (a temporary file, fsync, rename), so a crash leaves the last
complete one. A file that cannot be read, or is of another model or shape,
is `Unusable` with the reason: the service starts cold and says why.

Heat is the reader's own measure, the same for every eviction policy:
each use it is told of (a miss, a hit compute pins, a hit reported later as
`touched`) adds to the expert's count, decayed with a half-life in uses, so
the order is recent popularity. A next-layer guess or a warm-up read is no
use. `Heat.seed` gives the experts of a hot set read back their old order
below one use, so experts warmed but not yet used keep their rank and any
real use outranks them.

What a warm start reads: a hot set, or a route trace's most used experts
(`hottest_experts`, cache.warm_from); how it goes (`WarmStart`, the reader's
bookkeeping) lives in `warm.json` in the runtime folder (`WarmProgress`), for
`status`, `tail`, /metrics and the web page.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UserError
from ..pids import pid_alive

FORMAT = "moe-pipe hot set"
VERSION = 1
MAX_FILE_BYTES = 16 << 20  # far above any model's (a few hundred KB for 100k experts): a bigger file is not ours
PROGRESS_FILE = "warm.json"

ExpertKey = tuple[int, int]  # (layer, expert)


class Unusable(ValueError):
    """A hot-set file that cannot warm this model: its message says why."""


@dataclass(frozen=True)
class HotSet:
    model: tuple[str, ...]  # the model file's identity (directio.model_identity)
    n_layer: int
    n_expert: int
    experts: tuple[ExpertKey, ...]  # hottest first
    name: str = ""  # the model's name, for whoever opens the file
    saved_at: float = 0.0  # unix time


# -- where ---------------------------------------------------------------------------------


def hot_sets_dir() -> Path:
    """$XDG_STATE_HOME/moe-pipe/hot (default ~/.local/state/...): state that outlives a
    service, beside its kept logs; the runtime folder goes with the service."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "moe-pipe" / "hot"


def hot_set_path(identity: Sequence[str], folder: Path | None = None) -> Path:
    """The hot-set file of the model whose identity is `identity`."""
    digest = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:20]
    return (folder or hot_sets_dir()) / f"{digest}.json"


# -- writing and reading ------------------------------------------------------------------


def save_hot_set(path: str | os.PathLike, hot: HotSet) -> None:
    """Write `hot` whole to `path`: a temporary file beside it, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = asdict(hot) | {"format": FORMAT, "version": VERSION}
    data["model"], data["experts"] = list(hot.model), [list(k) for k in hot.experts]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(json.dumps(data, separators=(",", ":")))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _remove_dead_temps(path)


def _remove_dead_temps(path: Path) -> None:
    """Temporary files of saves a kill -9 cut short (their writer's pid is gone)."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 : -len(".tmp")]
        if pid.isdigit() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def load_hot_set(path: str | os.PathLike, identity: Sequence[str], n_layer: int, n_expert: int) -> HotSet:
    """The hot set at `path` for this model (identity, shape); Unusable with the
    reason for a file that is missing, unreadable, corrupt, or another model's."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise Unusable(f"it is {path.stat().st_size:,} bytes, not a hot set")
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise Unusable("there is none yet (the first start of this model)") from None
    except OSError as exc:
        raise Unusable(f"cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise Unusable(f"it is not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise Unusable("it is not a moe-pipe hot set")
    if data.get("version") != VERSION:
        raise Unusable(f"it is version {data.get('version')!r}; this moe-pipe reads version {VERSION}")
    if data.get("model") != list(identity):
        raise Unusable("it is another model file's (the model's identity differs)")
    if (data.get("n_layer"), data.get("n_expert")) != (n_layer, n_expert):
        raise Unusable(
            f"it is of a {data.get('n_layer')}-layer, {data.get('n_expert')}-expert model, this one has {n_layer} and {n_expert}"
        )
    experts = data.get("experts")
    if not isinstance(experts, list):
        raise Unusable("its expert list is missing")
    keys: dict[ExpertKey, None] = {}
    for item in experts:
        if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)):
            raise Unusable(f"its expert list holds {str(item)[:40]!r}, not [layer, expert]")
        layer, expert = item
        if not (0 <= layer < n_layer and 0 <= expert < n_expert):
            raise Unusable(f"it names expert {expert} of layer {layer}, which this model does not have")
        keys.setdefault((layer, expert), None)
    name, saved_at = data.get("name", ""), data.get("saved_at", 0.0)
    return HotSet(
        tuple(identity),
        n_layer,
        n_expert,
        tuple(keys),
        name if isinstance(name, str) else "",
        float(saved_at) if isinstance(saved_at, (int, float)) else 0.0,
    )


# -- heat ----------------------------------------------------------------------------------


class Heat:
    """Decayed use counts per (layer, expert): a use at tick t adds 2**(t / half_life),
    which is a count halved every `half_life` uses without touching the other keys
    (as the LFU policy counts). A dict, not an array: a use is one get, one power and
    one set, about 1 µs on this VM's busy core (0.4 ms a token at 48 layers × 8
    experts, in the reader, beside a decode step of 100 ms or more)."""

    def __init__(self, half_life: float):
        self.counts: dict[ExpertKey, float] = {}
        self.half_life = float(half_life)
        self.uses = 0  # told so far: the saver's "anything new?"
        self._origin = 0  # tick the counts are scaled to

    def use(self, key: ExpertKey) -> None:
        self.uses += 1
        t = self.uses - self._origin
        if t > 500 * self.half_life:  # keep 2**x finite
            f = 2.0 ** (-t / self.half_life)
            self.counts = {k: c * f for k, c in self.counts.items()}
            self._origin, t = self.uses, 0
        self.counts[key] = self.counts.get(key, 0.0) + 2.0 ** (t / self.half_life)

    def seed(self, keys: Sequence[ExpertKey]) -> None:
        """An earlier run's order, hottest first, below one use (a use adds at least 1)."""
        n = len(keys)
        for rank, key in enumerate(keys):
            self.counts[key] = max(self.counts.get(key, 0.0), 0.5 * (n - rank) / n)

    def hottest(self, keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        """`keys` hottest first; ties in (layer, expert) order."""
        counts = self.counts
        return sorted(keys, key=lambda k: (-counts.get(k, 0.0), k))


# -- a warm start -------------------------------------------------------------------------


def hottest_experts(trace_path: str, spec, n: int) -> list[ExpertKey]:
    """The `n` (layer, expert) a route trace used most, most used first: by
    decode uses (the steady state), ties and the rest by prompt uses. The
    trace must be of this model's shape."""
    import numpy as np

    from ..model.trace import read_trace

    trace = read_trace(trace_path)
    h = trace.header
    if (h.n_layer, h.n_expert) != (spec.n_layer, spec.n_expert):
        raise UserError(
            f"{trace_path}: a trace of a {h.n_layer}-layer, {h.n_expert}-expert model cannot warm "
            f"this {spec.n_layer}-layer, {spec.n_expert}-expert one"
        )
    keys = trace.layer * spec.n_expert + trace.expert
    size = spec.n_layer * spec.n_expert
    decode = np.bincount(keys[trace.phase == 1], minlength=size)
    prompt = np.bincount(keys[trace.phase != 1], minlength=size)
    order = np.lexsort((-prompt, -decode))[:n]  # last key sorts first: decode uses, then prompt uses
    return [(int(k) // spec.n_expert, int(k) % spec.n_expert) for k in order if decode[k] + prompt[k] > 0]


@dataclass
class WarmStart:
    """The reader's warm start under way (procs/reader.py): the experts to read,
    hottest first, fed to its lanes' background queue a few at a time, so that
    at most that many slabs are held by warm reads when a request needs slabs."""

    keys: list[ExpertKey]
    source: str  # the hot-set file or route trace they came from
    started: float  # monotonic
    next: int = 0  # keys[:next] were started or found cached
    done: int = 0  # of those, now cached (read, or read by a request first)
    reading: set[ExpertKey] = field(default_factory=set)
    state: str = "warming"  # warming | done | stopped
    note: str = ""
    written_at: float = 0.0  # when the progress file was last written

    @property
    def pending(self) -> list[ExpertKey]:
        """The experts not started yet (what a save made now keeps for the next start)."""
        return self.keys[self.next :] if self.state == "warming" else []

    def progress(self, now: float) -> WarmProgress:
        return WarmProgress(self.state, self.done, len(self.keys), self.source, round(now - self.started, 3), self.note)


# -- the warm-up's progress ---------------------------------------------------------------


@dataclass(frozen=True)
class WarmProgress:
    """How the reading of a hot set goes: `warming` while its reads run, then
    `done` (every expert read or already cached) or `stopped` (the cache filled
    first, or a read failed: `note` says which)."""

    state: str  # warming | done | stopped
    done: int  # experts of the plan now cached
    total: int  # experts the warm-up set out to read
    source: str = ""  # the hot-set file (or route trace) read
    seconds: float = 0.0  # since the warm-up began
    note: str = ""

    def text(self) -> str:
        """One line for `tail`, the web page and the log: "warming 812/3,071 experts"."""
        if self.state == "warming":
            return f"warming {self.done:,}/{self.total:,} experts"
        how = f" ({self.note})" if self.note else ""
        return f"warm start: {self.done:,}/{self.total:,} experts in {self.seconds:.1f} s{how}"

    def write(self, runtime_dir: str | os.PathLike) -> None:
        path = Path(runtime_dir) / PROGRESS_FILE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)  # whole or not at all: status and tails read it at any moment


def read_warm_progress(runtime_dir: str | os.PathLike) -> WarmProgress | None:
    """The warm-up's last progress in the runtime folder, or None (no warm-up, or unreadable)."""
    try:
        data = json.loads((Path(runtime_dir) / PROGRESS_FILE).read_text())
        return WarmProgress(**data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None
