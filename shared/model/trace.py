"""Route traces: which experts each token was routed to, layer by layer.

The format is the one BigMoeOnEdge records on phones (`route_trace v1`), so
its published traces and ours replay through the same code:

    # route_trace v1
    # model=PATH arch=ARCH n_layer=L n_expert=E n_expert_used=K
    # layer=0 expert_bytes=B dense_bytes=D        one line per layer, 0..L-1
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
    0,0,0,0,0,49,0.221297,0,3059712               one row per routed expert

Rows: `turn` a request; `phase` 0 = prompt, 1 = decode; `step` the token's
position in the turn (prompt tokens 0..P-1, then one per generated token);
`slot` the expert's rank in the token's top-k (0 = its first choice; the
format's name, kept so that traces stay interchangeable); `weight` its gating weight
(printf %g: 6 significant digits); `residency` 1 if the recording engine had it cached;
`expert_bytes` the bytes that engine read for this row: the layer's expert
size on a miss, 0 on a hit *and* for a repeat within one prompt batch (a
batch reads each expert once).

Order: a prompt batch is recorded layer by layer (all of the batch's tokens
at layer 0, then at layer 1, ...), because that is how a batched prefill
runs; a decoded token is recorded layer by layer too. The phone traces
record the prompt as one batch, and their last layer only for the prompt's
last token (llama.cpp computes only that row there).

    read_trace(path) -> Trace             header + columns as numpy arrays
    TraceWriter(path)                     write_header, write_routing per layer
    write_trace(path, trace)              a whole Trace (tests, conversions)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError

MAGIC = "# route_trace v1"
COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes")
HEADER_ROW = ",".join(COLUMNS)
PROMPT, DECODE = 0, 1
_MODEL_RE = re.compile(
    r"# model=(?P<model>.*?) arch=(?P<arch>\S+) n_layer=(?P<n_layer>\d+) "
    r"n_expert=(?P<n_expert>\d+) n_expert_used=(?P<n_expert_used>\d+)"
)
_LAYER_RE = re.compile(r"# layer=(?P<layer>\d+) expert_bytes=(?P<expert_bytes>\d+) dense_bytes=(?P<dense_bytes>\d+)")


class TraceError(UserError):
    """A route trace that cannot be read: names the file, the line and the problem."""

    def __init__(self, path, line: int | None, problem: str):
        self.path, self.line, self.problem = str(path), line, problem
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class TraceHeader:
    model: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    expert_bytes: tuple[int, ...]  # per layer
    dense_bytes: tuple[int, ...]  # per layer

    def __post_init__(self):
        if len(self.expert_bytes) != self.n_layer or len(self.dense_bytes) != self.n_layer:
            raise ValueError(
                f"a trace header needs {self.n_layer} per-layer sizes, got "
                f"{len(self.expert_bytes)} expert and {len(self.dense_bytes)} dense"
            )
        if any(c in self.model for c in "\r\n"):
            raise ValueError("the model name of a trace header must be one line")

    @classmethod
    def from_layout(cls, model: str, layout, top_k: int | None = None) -> TraceHeader:
        """The header for a run of `layout`'s model (shared.layout.Layout) with
        `top_k` experts per token (None: the model's own). Dense bytes are not
        split by layer in a Layout: spread evenly, for reference only."""
        spec = layout.spec
        dense = layout.dense_bytes // max(1, spec.n_layer)
        return cls(
            str(model),
            spec.arch,
            spec.n_layer,
            spec.n_expert,
            spec.n_expert_used if top_k is None else top_k,
            tuple(layout.expert_bytes(i) for i in range(spec.n_layer)),
            (dense,) * spec.n_layer,
        )

    @property
    def max_expert_bytes(self) -> int:
        return max(self.expert_bytes)

    def text(self) -> str:
        lines = [
            MAGIC,
            f"# model={self.model} arch={self.arch} n_layer={self.n_layer} n_expert={self.n_expert} n_expert_used={self.n_expert_used}",
        ]
        lines += [f"# layer={i} expert_bytes={b} dense_bytes={d}" for i, (b, d) in enumerate(zip(self.expert_bytes, self.dense_bytes))]
        return "\n".join(lines + [HEADER_ROW]) + "\n"


@dataclass(frozen=True, eq=False)
class Trace:
    """A whole trace; one numpy array per column, all of length N (rows)."""

    path: str
    header: TraceHeader
    turn: np.ndarray  # int64 [N]
    phase: np.ndarray  # int64 [N]
    step: np.ndarray  # int64 [N]
    layer: np.ndarray  # int64 [N]
    slot: np.ndarray  # int64 [N]
    expert: np.ndarray  # int64 [N]
    weight: np.ndarray  # float64 [N], as written (%g, 6 significant digits)
    residency: np.ndarray  # int64 [N]
    expert_bytes: np.ndarray  # int64 [N]
    first_row_line: int = 0  # the file line of row 0 (1-based), for messages

    def __len__(self) -> int:
        return int(self.turn.shape[0])

    def column(self, name: str) -> np.ndarray:
        return getattr(self, name)

    def line_of(self, row: int) -> int:
        return self.first_row_line + row


# ---------------------------------------------------------------- reading


def _parse_header(path, lines: list[str]) -> tuple[TraceHeader, int]:
    """The header from the first lines; returns it and the index of the first row line."""
    if not lines or lines[0].rstrip() != MAGIC:
        got = lines[0].strip()[:60] if lines else "an empty file"
        raise TraceError(path, 1, f"not a route trace: expected {MAGIC!r} as the first line, got {got!r}")
    m = _MODEL_RE.fullmatch(lines[1].rstrip()) if len(lines) > 1 else None
    if m is None:
        raise TraceError(path, 2, "expected '# model=... arch=... n_layer=N n_expert=N n_expert_used=N'")
    n_layer, n_expert, k = int(m["n_layer"]), int(m["n_expert"]), int(m["n_expert_used"])
    if not (n_layer >= 1 and n_expert >= 1 and 1 <= k <= n_expert):
        raise TraceError(path, 2, f"impossible model shape: n_layer={n_layer} n_expert={n_expert} n_expert_used={k}")
    expert_bytes, dense_bytes = [], []
    for i in range(n_layer):
        line_no = 3 + i
        lm = _LAYER_RE.fullmatch(lines[line_no - 1].rstrip()) if len(lines) >= line_no else None
        if lm is None:
            raise TraceError(path, line_no, f"expected '# layer={i} expert_bytes=B dense_bytes=D' (n_layer={n_layer} such lines)")
        if int(lm["layer"]) != i:
            raise TraceError(
                path, line_no, f"layer lines must run 0..{n_layer - 1} in order; got layer={lm['layer']} where layer={i} belongs"
            )
        if int(lm["expert_bytes"]) <= 0:
            raise TraceError(path, line_no, f"layer {i} has expert_bytes=0; every MoE layer's experts have a size")
        expert_bytes.append(int(lm["expert_bytes"]))
        dense_bytes.append(int(lm["dense_bytes"]))
    row_line = 3 + n_layer
    if len(lines) < row_line or lines[row_line - 1].strip() != HEADER_ROW:
        got = lines[row_line - 1].strip()[:80] if len(lines) >= row_line else "end of file"
        raise TraceError(path, row_line, f"expected the column row {HEADER_ROW!r}, got {got!r}")
    header = TraceHeader(m["model"], m["arch"], n_layer, n_expert, k, tuple(expert_bytes), tuple(dense_bytes))
    return header, row_line


def _bad_row(path, line_no: int, text: str, header: TraceHeader) -> TraceError | None:
    """Why one row line is malformed, or None: the slow path that names the line."""
    fields = text.split(",")
    if len(fields) != len(COLUMNS):
        return TraceError(
            path, line_no, f"expected {len(COLUMNS)} comma-separated fields ({HEADER_ROW}), got {len(fields)}: {text.strip()[:80]!r}"
        )
    values = {}
    for name, field in zip(COLUMNS, fields):
        try:
            values[name] = float(field) if name == "weight" else int(field)
        except ValueError:
            kind = "a number" if name == "weight" else "an integer"
            return TraceError(path, line_no, f"column {name} must be {kind}, got {field.strip()[:30]!r}")
    limits = {
        "turn": (0, None),
        "phase": (0, 1),
        "step": (0, None),
        "layer": (0, header.n_layer - 1),
        "slot": (0, header.n_expert_used - 1),
        "expert": (0, header.n_expert - 1),
        "residency": (0, 1),
        "expert_bytes": (0, None),
    }
    for name, (lo, hi) in limits.items():
        v = values[name]
        if v < lo or (hi is not None and v > hi):
            allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            return TraceError(
                path,
                line_no,
                f"column {name} = {v} is out of range (allowed {allowed} "
                f"for n_layer={header.n_layer} n_expert={header.n_expert} "
                f"n_expert_used={header.n_expert_used})",
            )
    return None


def _read_lines(path: Path, header_only: bool = False) -> list[str]:
    """The file's lines; with `header_only`, up to the column row (the first line not a comment)."""
    try:
        if not header_only:
            return path.read_text().splitlines()
        lines = []
        with open(path) as f:
            for line in f:
                lines.append(line.rstrip("\n"))
                if not line.startswith("#"):
                    break
        return lines
    except FileNotFoundError:
        raise TraceError(path, None, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, None, "is a directory, not a route trace") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, None, f"cannot read: {exc}") from None


def read_trace_header(path) -> TraceHeader:
    """Only a trace's header (shape, k, sizes), without reading its rows."""
    path = Path(path)
    return _parse_header(path, _read_lines(path, header_only=True))[0]


def read_trace(path) -> Trace:
    """Read a route trace; one-line TraceError (file:line: problem) if it is malformed."""
    path = Path(path)
    lines = _read_lines(path)
    header, row_line = _parse_header(path, lines)
    body = lines[row_line:]
    while body and not body[-1].strip():  # a trailing blank line is harmless
        body.pop()
    n = len(body)
    # Fast path: one split and one conversion per column; on any failure the
    # slow path walks the lines to name the first bad one.
    flat = ",".join(body).split(",") if n else []
    cols = None
    if len(flat) == n * len(COLUMNS):
        table = np.array(flat, dtype=object).reshape(n, len(COLUMNS)) if n else np.empty((0, len(COLUMNS)), object)
        try:
            cols = {name: table[:, i].astype(np.float64 if name == "weight" else np.int64) for i, name in enumerate(COLUMNS)}
        except (ValueError, TypeError):
            cols = None
    if cols is not None:
        ok = (
            (cols["turn"] >= 0)
            & (cols["step"] >= 0)
            & ((cols["phase"] == 0) | (cols["phase"] == 1))
            & (cols["layer"] >= 0)
            & (cols["layer"] < header.n_layer)
            & (cols["slot"] >= 0)
            & (cols["slot"] < header.n_expert_used)
            & (cols["expert"] >= 0)
            & (cols["expert"] < header.n_expert)
            & ((cols["residency"] == 0) | (cols["residency"] == 1))
            & (cols["expert_bytes"] >= 0)
        )
        bad = np.flatnonzero(~ok)
        if bad.size:
            i = int(bad[0])
            raise _bad_row(path, row_line + 1 + i, body[i], header) or TraceError(path, row_line + 1 + i, "bad row")
        return Trace(str(path), header, **cols, first_row_line=row_line + 1)
    for i, line in enumerate(body):
        err = _bad_row(path, row_line + 1 + i, line, header)
        if err is not None:
            raise err
    raise TraceError(path, None, "malformed rows")  # unreachable: the slow path names the line


# ---------------------------------------------------------------- writing


def _row_text(turn, phase, step, layer, slot, expert, weight, residency, nbytes) -> str:
    return f"{turn},{phase},{step},{layer},{slot},{expert},{weight:g},{residency},{nbytes}\n"


class TraceWriter:
    """Appends routing to a trace file, flushed once per token (after its last
    layer), so a trace survives a killed run up to the last whole token.

    An existing trace is appended to: `write_header` then checks that the
    header is the same model's, and `next_turn` is the first unused turn."""

    def __init__(self, path):
        self.path = Path(path)
        self.header: TraceHeader | None = None
        self.next_turn = 0
        self._existing: TraceHeader | None = None
        if self.path.exists() and self.path.stat().st_size > 0:
            old = read_trace(self.path)
            self._existing = old.header
            self.next_turn = int(old.turn.max()) + 1 if len(old) else 0
        self._f = open(self.path, "a", encoding="utf-8")

    def write_header(self, header: TraceHeader) -> None:
        if self._existing is not None:
            if header != self._existing:
                raise TraceError(
                    self.path,
                    None,
                    f"cannot append: the file's header is for "
                    f"{self._existing.model} ({self._existing.arch}), not this run's "
                    f"{header.model} ({header.arch}) with the same sizes and top-k",
                )
        else:
            self._f.write(header.text())
            self._f.flush()
        self.header = header

    def write_routing(self, turn: int, phase: int, step: int, layer: int, experts, weights, residency, read_bytes=None) -> None:
        """One layer's routing for one token ([K] arrays, at `step`) or a prompt
        batch ([T, K], tokens step..step+T-1). `residency` (same shape): 1 where
        the expert was a cache hit. `read_bytes` (same shape) defaults to the
        layer's expert size on a miss, once per expert per call (a batch reads
        each expert once), else 0."""
        if self.header is None:
            raise RuntimeError("write_header first")
        experts = np.atleast_2d(np.asarray(experts, np.int64))  # [T, K]
        weights = np.atleast_2d(np.asarray(weights, np.float64)).reshape(experts.shape)  # [T, K]
        residency = np.atleast_2d(np.asarray(residency)).astype(np.int64).reshape(experts.shape)  # [T, K]
        if read_bytes is None:
            read_bytes = np.zeros(experts.shape, np.int64)
            seen: set[int] = set()
            eb = self.header.expert_bytes[layer]
            for (t, k), e in np.ndenumerate(experts):
                if e not in seen:
                    seen.add(int(e))
                    read_bytes[t, k] = 0 if residency[t, k] else eb
        else:
            read_bytes = np.atleast_2d(np.asarray(read_bytes, np.int64)).reshape(experts.shape)
        out = []
        for t in range(experts.shape[0]):
            for k in range(experts.shape[1]):
                out.append(
                    _row_text(
                        turn,
                        phase,
                        step + t,
                        layer,
                        k,
                        int(experts[t, k]),
                        float(weights[t, k]),
                        int(residency[t, k]),
                        int(read_bytes[t, k]),
                    )
                )
        self._f.write("".join(out))
        if layer == self.header.n_layer - 1:  # a token's last layer: it is whole, make it durable
            self._f.flush()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_trace(path, trace: Trace) -> None:
    """Write a whole Trace (a new file): the exact rows, expert_bytes as recorded."""
    cols = [trace.column(c).tolist() for c in COLUMNS]
    with open(path, "w", encoding="utf-8") as f:
        f.write(trace.header.text())
        f.write("".join(_row_text(*row) for row in zip(*cols)))
