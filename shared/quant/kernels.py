"""Matrix kernels on raw GGUF quantized blocks.

    y = matvec(qtype, w, x)          w uint8 [R, row_bytes], x [C]     → y float32 [R]
    Y = matmul(qtype, w, X)          X [T, C]                          → Y float32 [T, R]
    E = dequantize_rows(qtype, w, rows)  rows int [N]                  → E float32 [N, C]
    set_threads(n) / get_threads()   numba threads for the row loops

`qtype` is a ggml type id or `gguf.GGMLQuantizationType`; the 23 types of
`blocks.SUPPORTED`. `w` holds each row's blocks back to back in the GGUF
layout (docs/formats.md § Quant blocks) and may be a read-only memmap view or a slice of
a larger buffer: only each row has to be contiguous. Nothing is repacked or
dequantized ahead: each call decodes blocks on the fly, once per call for a
whole group of activation rows (a prompt batch does not decode a block once
per token).

Activations: on Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, MXFP4, IQ4_XS and the i-quants IQ1_S, IQ1_M,
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (`INT8_ACTIVATION_TYPES`)
every call, one activation row (matvec, decode) or several (matmul:
prefill, an expert several tokens route to), rounds each activation row to
int8 per block of 32 (x̂ = dx·xq, dx = amax/127, see _q8) and multiplies on
the integer codes; several rows take an integer GEMM that unpacks each
block's codes once per 4 activation rows. Every other type (F32/F16/BF16
included), and everything after `set_int8_activations(False)` (or
MOE_PIPE_INT8_ACT=0 in the environment), uses the activation as float32 on a
decoded float tile. Either way `effective_activation(x, qtype)` returns
exactly the x̂ the kernels multiply by, and the results differ from float64
`dequantize(w) @ x̂` by float32 rounding only. Each output element depends
only on its weight row and its activation row, whatever the thread split,
and matmul rows equal matvec results bit for bit on every type: the int8
kernels run each activation row's float operations in the one-row order by
construction (_q8ir), and so does the float tiles' product, in sixes of
activation rows or one at a time (_floatir; tests/test_quant.py checks both,
for T = 2, 3, 6, 7, 13, 17, 64).

Kernels compile on first use of a type (numba, cached on disk under
__pycache__ or NUMBA_CACHE_DIR), so a process using three types compiles
three, and the next process start loads them from the cache.

Three builds of the int8 dot (`INT8_DOT`, fixed at import, see _q8ir): "vnni"
(AVX-512 VNNI instructions) when the CPU numba compiles for has them, "sdot"
(the ARM dot-product instructions) on aarch64 CPUs with them, else "portable"
(the same integer sums as target-independent LLVM IR). numba's own
target switch picks the portable one on any machine: `NUMBA_CPU_NAME=generic`
(or `NUMBA_CPU_FEATURES` without +avx512vnni). There is no moe-pipe switch on
purpose: numba's disk cache keys a kernel on the target CPU name and features
but not on our environment, so a moe-pipe switch would let a process load the
other build from the cache; tests/test_quant_portable.py runs the portable
build this way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import numba
import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import _float, _iquant, _kquant, _legacy, _q8
from ._common import F16_TABLE, LANES
from ._floatir import W_ROWS
from .blocks import QK, SUPPORTED, BlockFormat, QType, block_format
from .blocks import qtype_from_name as qtype_from_name  # re-exported: quant.qtype_from_name

# The public names are listed once, in shared/quant/__init__.py's __all__.

_KERNELS = {QType[name]: pair for mod in (_float, _legacy, _kquant, _iquant) for name, pair in mod.KERNELS.items()}
assert set(_KERNELS) == set(SUPPORTED), "every supported type needs kernels"
# Types whose matvec/matmul run on int8 activations (integer block dots, _q8).
_Q8_KERNELS = {QType[name]: pair for name, pair in _q8.KERNELS.items()}
_Q8_GATHER = {QType[name]: driver for name, driver in _q8.GATHER.items()}
assert set(_Q8_GATHER) == set(_Q8_KERNELS), "every int8-activation type needs a gather driver"
_Q8_GROUPED = {QType[name]: driver for name, driver in _q8.GROUPED.items()}
assert set(_Q8_GROUPED) == set(_Q8_KERNELS), "every int8-activation type needs a grouped driver"
INT8_ACTIVATION_TYPES = tuple(_Q8_KERNELS)
# Which build of the int8 dot this process compiles: "vnni", "sdot" or "portable" (module doc).
INT8_DOT = _q8.INT8_DOT
_INT8_ACT = [os.environ.get("MOE_PIPE_INT8_ACT", "1") not in ("", "0")]


def set_int8_activations(on: bool) -> None:
    """Int8 activations for every call on INT8_ACTIVATION_TYPES (default on; process-wide)."""
    _INT8_ACT[0] = bool(on)


def int8_activations() -> bool:
    return _INT8_ACT[0]


# NVFP4's int8 kernel takes whole 256-weight units (4 blocks): a row of 64, 128 or 192 more
# (tiny models only; real files' widths are multiples of 256) multiplies on the float tiles.
_Q8_WHOLE_UNITS = frozenset({QType.NVFP4})


def _uses_q8(qtype, n_cols: int = 0) -> bool:
    """Whether a product of `qtype` on rows `n_cols` wide (0: any width) runs the int8 kernels."""
    return _INT8_ACT[0] and qtype in _Q8_KERNELS and (n_cols % 256 == 0 or qtype not in _Q8_WHOLE_UNITS)


# Float dtypes accepted in place of raw bytes for the unquantized types (what
# gguf-py's reader hands out for F32/F16 tensors).
_NATIVE_DTYPES = {QType.F32: np.float32, QType.F16: np.float16, QType.BF16: np.uint16}

# Float tiles (the types without int8 kernels, or int8 off).
# Bytes of weight rows decoded per tile when there are several activation rows: every
# activation row passes the whole tile while the tile sits in L2 (1 MB a core here), so the
# activations are read once per tile: at 4 rows a tile, a 3,600-token prompt's router read
# its 29 MB of activations 32 times.
_TILE_BYTES = 256 * 1024
_TILE_ROWS_MOST = 32
# With one activation row there is nothing to share: the product's own tile (_floatir.W_ROWS
# rows, ≤ 48 KB for the expert shapes) stays in L1 between its decode and its dot product.
_TILE_ROWS_MATVEC = W_ROWS


def _tile_rows(T: int, C: int) -> int:
    """Weight rows a float driver decodes at a time for T activation rows of C columns."""
    if T == 1:
        return _TILE_ROWS_MATVEC
    return max(W_ROWS, min(_TILE_ROWS_MOST, _TILE_BYTES // (4 * C)) // W_ROWS * W_ROWS)


def set_threads(n: int) -> None:
    """Use n numba threads for the row loops (numba's setting is per calling thread)."""
    n = int(n)
    most = most_threads()
    if not 1 <= n <= most:
        raise ValueError(f"threads must be between 1 and {most} (the cores numba started with), not {n}")
    numba.set_num_threads(n)


def one_blas_thread() -> None:
    """Keep numpy's BLAS (attention's matmuls) to one thread in this process.
    OpenBLAS starts a worker per core for a product above its size threshold
    and leaves it spinning after the call; beside numba's row-loop workers on
    the same cores those spinners doubled a token's CPU time once attention
    grew past ~150 positions (docs/benchmarks.md § The protocol (2026-12-01))."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def most_threads() -> int:
    """The most threads numba started with (NUMBA_NUM_THREADS: every core unless set)."""
    return int(vars(numba.config)["NUMBA_NUM_THREADS"])


def get_threads() -> int:
    return numba.get_num_threads()


def kernels_for(qtype: int | QType):
    """The numba dispatchers (product, rows) of a type; for cache checks and benchmarks.

    `product` is the kernel a matvec/matmul calls: the int8 one on the
    int8-activation types while int8 activations are on (the float tile
    kernel stays available in _KERNELS).
    """
    qt = block_format(qtype).qtype
    if _uses_q8(qt):
        return _Q8_KERNELS[qt][0], _KERNELS[qt][1]
    return _KERNELS[qt]


def effective_activation(x: np.ndarray, qtype: int | QType | None = None) -> np.ndarray:
    """The activation (float32, [C] or [T, C]) exactly as a call of `qtype` with it uses it.

    On the int8-activation types (with int8 activations on): each row x
    rounded to int8 per block of QK = 32 and scaled back (dx·xq, in float32 —
    the products dx·xq are exact), the same for one row and for several. For
    the other types, and with qtype None: x as float32.
    """
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if qtype is None or not _uses_q8(block_format(qtype).qtype, x32.shape[-1]):
        return x32
    X = x32.reshape(-1, x32.shape[-1])
    if X.shape[1] % QK:
        raise ValueError(f"effective_activation: C must be a multiple of {QK}, got {X.shape[1]}")
    xq, dx = _quantize(X)[:2]
    return (xq.reshape(X.shape[0], -1, QK) * dx.reshape(X.shape[0], -1, 1)).astype(np.float32).reshape(x32.shape)


def _quantize(X: np.ndarray):
    """X f32 [T, C] → (xq int8 [T·C], dx f32 [T·C/32], bs16 int32 [T·C/16], bs32 int32 [T·C/32], xs32 f32 [T·C/32])."""
    T, C = X.shape
    xq = np.empty(T * C, np.int8)
    dx = np.empty(T * C // QK, np.float32)
    bs16 = np.empty(T * C // (QK // 2), np.int32)
    bs32 = np.empty(T * C // QK, np.int32)
    xs32 = np.empty(T * C // QK, np.float32)
    if X.size:
        _q8.quantize_q8(X, xq, dx, bs16, bs32, xs32)
    return xq, dx, bs16, bs32, xs32


def _multiply(qtype: QType, flat: np.ndarray, stride: int, X: np.ndarray, out: np.ndarray) -> None:
    """out [T, R] = X @ W.T (T, R ≥ 1): int8 kernels on the int8 types, float tiles otherwise."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    T = X.shape[0]
    if _uses_q8(qtype, X.shape[1]):
        kernel, table = _Q8_KERNELS[qtype]
        kernel(flat, stride, X, table, out)
    else:
        mm, _ = _KERNELS[qtype]
        mm(flat, stride, X, _tile_rows(T, X.shape[1]), F16_TABLE, LANES, out)


def matvec(qtype: int | QType, w: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y[R] = W @ x for raw blocks w [R, row_bytes] and x [C]."""
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"matvec: x must be 1-D [C], got shape {x.shape}")
    fmt, flat, stride, n_rows = _weights("matvec", qtype, w, x.shape[0])
    y = _output("matvec", out, (n_rows,))
    if n_rows:
        _multiply(fmt.qtype, flat, stride, x.reshape(1, -1), y.reshape(1, -1))
    return y


def matmul(qtype: int | QType, w: np.ndarray, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Y[T, R] = X @ W.T for raw blocks w [R, row_bytes] and X [T, C]."""
    X = np.asarray(X)
    if X.ndim != 2:
        raise ValueError(f"matmul: X must be 2-D [T, C], got shape {X.shape}")
    fmt, flat, stride, n_rows = _weights("matmul", qtype, w, X.shape[1])
    Y = _output("matmul", out, (X.shape[0], n_rows))
    if n_rows and X.shape[0]:
        _multiply(fmt.qtype, flat, stride, X, Y)
    return Y


class Prepared(NamedTuple):
    """A weight matrix checked once: what the kernels need, for the hot path."""

    qtype: QType
    flat: np.ndarray  # read-only bytes of all rows
    stride: int
    n_rows: int
    n_cols: int
    # flat's first byte: how gather_apply and grouped_apply pass several matrices to a kernel.
    # Read once here: numpy's `.ctypes.data` builds an object a call (~1 µs a matrix, 16 of
    # them in each of a decode step's two expert calls a layer).
    addr: int
    # What every product is multiplied by after the sum: an NVFP4 tensor's per-tensor (or, of
    # an expert, per-expert) second-level scale, its `.scale` sidecar in the file; 1 otherwise.
    scale: float = 1.0


def prepare(qtype: int | QType, w: np.ndarray, scale: float = 1.0) -> Prepared:
    """Check w [R, row_bytes] once; `apply` then multiplies without re-checking it (and
    multiplies the products by `scale`, the tensor's second-level scale)."""
    fmt, flat, stride, n_rows, n_cols = _whole_rows("prepare", qtype, w)
    return Prepared(fmt.qtype, flat, stride, n_rows, n_cols, flat.ctypes.data, float(scale))


def row_range(p: Prepared, r0: int, r1: int) -> Prepared:
    """Weight rows r0 .. r1-1 of a prepared matrix, as a prepared matrix of their own (a view:
    no bytes move). Each row's product is computed alone in every kernel, so a row gives the
    same number bit for bit in the part as in the whole."""
    if not 0 <= r0 < r1 <= p.n_rows:
        raise ValueError(f"row_range: rows {r0}..{r1} are not inside the matrix's {p.n_rows}")
    return Prepared(p.qtype, p.flat[r0 * p.stride : r1 * p.stride], p.stride, r1 - r0, p.n_cols, p.addr + r0 * p.stride, p.scale)


def apply(p: Prepared, X: np.ndarray) -> np.ndarray:
    """Y[T, R] = X @ W.T for a prepared W: the decode hot path (~1 µs of checks)."""
    if X.ndim != 2 or X.shape[1] != p.n_cols:
        raise ValueError(f"apply: X must be [T, {p.n_cols}], got shape {X.shape}")
    Y = np.empty((X.shape[0], p.n_rows), np.float32)
    if p.n_rows and X.shape[0]:
        _multiply(p.qtype, p.flat, p.stride, X, Y)
        if p.scale != 1.0:
            Y *= np.float32(p.scale)
    return Y


def grouped_qualifies(p: Prepared) -> bool:
    """Whether gather_apply and grouped_apply take this matrix (an int8-activation type, int8
    activations on, some rows)."""
    return _uses_q8(p.qtype, p.n_cols) and p.n_rows > 0


def gather_apply(ps: Sequence[Prepared], X: np.ndarray, act: np.ndarray) -> np.ndarray | None:
    """out[e] = ps[e] applied to activation row X[act[e]], [K, R], in one kernel call, for
    prepared matrices of one int8-activation type and one shape (a decode step's experts);
    each row equals `apply(ps[e], X[act[e]:act[e]+1])` bit for bit. None when the matrices
    do not qualify (other types, int8 activations off, mixed shapes): multiply them one by one."""
    p0 = ps[0]
    if not (grouped_qualifies(p0) and X.ndim == 2 and X.shape[1] == p0.n_cols):
        return None
    if any(p.qtype != p0.qtype or p.stride != p0.stride or p.n_rows != p0.n_rows or p.n_cols != p0.n_cols for p in ps):
        return None
    out = np.empty((len(ps), p0.n_rows), np.float32)
    addrs = np.array([p.addr for p in ps], np.int64)  # the ps keep the bytes alive for the call
    _Q8_GATHER[p0.qtype](
        addrs,
        p0.flat.shape[0],
        p0.stride,
        np.ascontiguousarray(X, dtype=np.float32),
        np.asarray(act, np.int64),
        _Q8_KERNELS[p0.qtype][1],
        out,
    )
    for e, p in enumerate(ps):
        if p.scale != 1.0:
            out[e] *= np.float32(p.scale)
    return out


class Int8Rows(NamedTuple):
    """Activation rows rounded to int8 once (`int8_rows`), for grouped_apply: a prompt layer's
    tokens are rounded once for all the experts they route to, which then take their rows
    where they lie (no gathered copy of a token's row per expert)."""

    xq: np.ndarray
    dx: np.ndarray
    bs16: np.ndarray
    bs32: np.ndarray
    xs32: np.ndarray
    cp: int  # elements a row of xq (the columns padded to whole units)
    n_rows: int
    n_cols: int


def int8_rows(X: np.ndarray) -> Int8Rows:
    """X float32 [T, C] rounded to int8 per 32 as every int8-activation kernel rounds it."""
    if X.ndim != 2:
        raise ValueError(f"int8_rows: X must be [T, C], got shape {X.shape}")
    xq, dx, bs16, bs32, xs32, cp = _q8.round_rows(np.ascontiguousarray(X, dtype=np.float32))
    return Int8Rows(xq, dx, bs16, bs32, xs32, int(cp), X.shape[0], X.shape[1])


def grouped_apply(
    ps: Sequence[Prepared],
    X: np.ndarray | Int8Rows,
    first: np.ndarray,
    count: np.ndarray,
    rows: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray | None:
    """Matrix m on its own run of activation rows, every matrix in one kernel call, for
    prepared matrices of one int8-activation type and one shape (a prompt's experts of a
    layer). The run of matrix m is rows first[m] .. first[m] + count[m] - 1 of X, or with
    `rows`, rows rows[first[m]] .. rows[first[m] + count[m] - 1] of X. X is float32 [A, C]
    or already rounded (int8_rows). The result [Σ count, R] (into `out` when given: float32,
    C-contiguous) holds matrix 0's rows, then matrix 1's, ..., each equal to
    `apply(ps[m], <its rows of X>)` bit for bit. None when the matrices do not qualify (other
    types, int8 activations off, mixed shapes): multiply them one by one."""
    p0 = ps[0]
    if not grouped_qualifies(p0) or any(
        p.qtype != p0.qtype or p.stride != p0.stride or p.n_rows != p0.n_rows or p.n_cols != p0.n_cols for p in ps
    ):
        return None
    if not isinstance(X, Int8Rows):
        if X.ndim != 2 or X.shape[1] != p0.n_cols:
            return None
        X = int8_rows(X)
    if X.n_cols != p0.n_cols:
        return None
    first, count = np.asarray(first, np.int64), np.asarray(count, np.int64)
    rows = np.arange(X.n_rows, dtype=np.int64) if rows is None else np.ascontiguousarray(rows, np.int64)
    if first.shape != (len(ps),) or count.shape != (len(ps),) or count.min() < 0 or (first < 0).any() or (first + count > rows.size).any():
        raise ValueError(f"grouped_apply: each matrix needs a run inside the {rows.size} rows")
    if rows.size and (rows.min() < 0 or rows.max() >= X.n_rows):
        raise ValueError(f"grouped_apply: rows must be in [0, {X.n_rows})")
    at = np.zeros(len(ps), np.int64)
    np.cumsum(count[:-1], out=at[1:])
    shape = (int(count.sum()), p0.n_rows)
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"grouped_apply: out must be float32 {list(shape)}, C-contiguous; got {out.dtype} {list(out.shape)}")
    addrs = np.array([p.addr for p in ps], np.int64)  # the ps keep the bytes alive for the call
    _Q8_GROUPED[p0.qtype](
        addrs,
        p0.flat.shape[0],
        p0.stride,
        *X[:5],
        X.cp,
        X.n_cols // QK,
        rows,
        first,
        count,
        at,
        _Q8_KERNELS[p0.qtype][1],
        out,
    )
    for m, p in enumerate(ps):
        if p.scale != 1.0:
            out[at[m] : at[m] + count[m]] *= np.float32(p.scale)
    return out


def dequantize_rows(qtype: int | QType, w: np.ndarray, rows) -> np.ndarray:
    """float32 [N, C]: rows `rows` of w decoded (embedding lookups)."""
    fmt, flat, stride, n_rows, n_cols = _whole_rows("dequantize_rows", qtype, w)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
        raise ValueError(f"dequantize_rows: row ids must be in [0, {n_rows}), got {rows.min()}..{rows.max()}")
    E = np.empty((rows.size, n_cols), np.float32)  # [N, C]
    if rows.size:
        _, deq = _KERNELS[fmt.qtype]
        deq(flat, stride, np.ascontiguousarray(rows), F16_TABLE, LANES, E)
    return E


# ---- the one dispatch check ----------------------------------------------


def _whole_rows(op: str, qtype: int | QType, w) -> tuple[BlockFormat, np.ndarray, int, int, int]:
    """w [R, row_bytes] checked to be whole blocks per row: (format, flat bytes, stride, rows, columns)."""
    fmt = block_format(qtype)
    w = _as_bytes(op, fmt, w)
    if w.shape[1] % fmt.type_size:
        raise ValueError(f"{op}: a {fmt.name} row is whole {fmt.type_size}-byte blocks; got {w.shape[1]} bytes")
    n_cols = w.shape[1] // fmt.type_size * fmt.block_size
    fmt, flat, stride, n_rows = _weights(op, fmt.qtype, w, n_cols)
    return fmt, flat, stride, n_rows, n_cols


def _as_bytes(op: str, fmt: BlockFormat, w) -> np.ndarray:
    w = np.asarray(w)
    native = _NATIVE_DTYPES.get(fmt.qtype)
    if native is not None and w.dtype == native and w.ndim == 2 and w.strides[-1] == w.itemsize:
        w = w.view(np.uint8)  # [R, C·itemsize]; a view, rows stay in place
    if w.dtype != np.uint8 or w.ndim != 2:
        raise ValueError(f"{op}: {fmt.name} weights must be uint8 [rows, row_bytes] of raw blocks, got {w.dtype} {list(w.shape)}")
    return w


def _weights(op: str, qtype, w, n_cols: int) -> tuple[BlockFormat, np.ndarray, int, int]:
    """Check w against C and return (format, flat read-only bytes, row stride, R).

    The kernels always get the same argument types (1-D read-only C-contiguous
    uint8 + an int64 stride), whatever w was — memmap, read-only view, slice of
    a bigger buffer — so one compiled, cached specialization serves them all.
    """
    fmt = block_format(qtype)
    w = _as_bytes(op, fmt, w)
    if n_cols % fmt.block_size:
        raise ValueError(f"{op}: {fmt.name} needs C to be a multiple of {fmt.block_size}, got C={n_cols}")
    n_rows, row_bytes = w.shape
    if row_bytes != fmt.row_bytes(n_cols):
        raise ValueError(
            f"{op}: {fmt.name} rows of C={n_cols} weights are {fmt.row_bytes(n_cols)} bytes, but w has {row_bytes} bytes per row"
        )
    stride = int(w.strides[0]) if n_rows > 1 else row_bytes
    if w.strides[1] != 1 or stride < 0:
        raise ValueError(f"{op}: each row of w must be contiguous bytes in increasing order (strides {w.strides})")
    if stride == row_bytes and w.flags.c_contiguous:  # the usual case; as_strided costs ~4 µs a call
        flat = w.reshape(-1).view(np.ndarray)
        flat.flags.writeable = False
    else:
        span = (n_rows - 1) * stride + row_bytes if n_rows else 0
        flat = as_strided(w, shape=(span,), strides=(1,), writeable=False)
    return fmt, flat, stride, n_rows


def _output(op: str, out, shape: tuple[int, ...]) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.float32
        or out.shape != shape
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"{op}: out must be a writable C-contiguous float32 array of shape {list(shape)}, got {got}")
    return out
