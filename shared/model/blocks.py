"""Shared forward-pass blocks: RMSNorm, RoPE (plain, YaRN, per-pair factors),
grouped-query attention over a KV cache (causal, sliding window, sinks); the
cache keeps a sliding-window layer's rows as a ring (`KVCache`, `store_and_attend`).

Everything is float32 numpy; the KV cache may store f16 or q8_0, but its reads
are float32. Legend: T new tokens, N cached positions (including the new
ones), H query heads, Hk kv heads, G = H/Hk, d head width.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..gguf.spec import Q8_0_BLOCK, SWA_PROMPT_BLOCK, ModelSpec, RopeSpec, check_kv_type, kv_entries, kv_rows, kv_v_windows, kv_windows
from . import kv_pages
from .attend import attend
from .fused import _rope_rotate, rms_norm, swiglu  # noqa: F401  (fused loops, part of the blocks' API)

# ---- rotary position embedding --------------------------------------------------


@dataclass(frozen=True)
class Rope:
    """Rotation of the first `n_rot` dims of each head, NEOX (rotate-half) pairs (i, i + n_rot/2)."""

    inv_freq: np.ndarray  # [n_rot/2] radians per position
    attn_factor: float = 1.0  # multiplies cos and sin (YaRN's mscale)

    @property
    def n_rot(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Every layer of a forward pass asks for the same positions: keep the last answer. The
        # key is every position, not the first and the count: a batch of several sequences
        # (shared/model/batch.py) has each row at its own position.
        key = positions.astype(np.int64).tobytes()
        memo = self.__dict__.get("_memo")
        if memo is not None and memo[0] == key:
            return memo[1]
        angles = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [T, n_rot/2]
        f = np.float32(self.attn_factor)
        out = (np.cos(angles) * f, np.sin(angles) * f)
        object.__setattr__(self, "_memo", (key, out))  # a cache, not state: the dataclass stays frozen in meaning
        return out

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, in_place: bool = False) -> np.ndarray:
        """x [T, heads, d] rotated; dims ≥ n_rot pass through. A copy, unless `in_place` and x
        is float32 and C-ordered: then x itself (a prompt chunk's queries: one array, not two,
        as shared/gguf/spec.py prefill_activation_bytes counts). The same numbers either way."""
        if in_place and x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable:
            out = x
        else:
            out = np.array(x, dtype=np.float32, order="C")  # [T, heads, d]
        _rope_rotate(out, np.ascontiguousarray(cos), np.ascontiguousarray(sin), self.inv_freq.shape[0])
        return out


def plain_inv_freq(base: float, n_rot: int, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """θ_i = base^(−2i/n_rot), divided by per-pair factors when the model has them
    (Gemma-4's full layers rotate only the first pairs: factor 1e30 freezes the rest)."""
    inv: np.ndarray = 1.0 / (np.float32(base) ** (np.arange(0, n_rot, 2, dtype=np.float32) / np.float32(n_rot)))
    if freq_factors is not None:
        inv = inv / freq_factors[: inv.shape[0]].astype(np.float32)
    return inv.astype(np.float32)


def yarn_rope(r: RopeSpec, n_rot: int, truncate: bool) -> Rope:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between.

    `truncate` rounds the ramp ends to whole pairs (llama.cpp always does; the
    gpt-oss reference config says truncate=false, so its models pass False).
    """
    base, factor = r.freq_base, r.factor
    orig = r.orig_ctx or 4096

    def correction_dim(rotations: float) -> float:
        return n_rot * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, n_rot - 1)
    if low == high:
        high += 0.001
    extrap = plain_inv_freq(base, n_rot)  # [n_rot/2]
    interp = extrap / np.float32(factor)
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 → extrapolate (high frequency), 0 → interpolate
    inv = interp * (1 - keep) + extrap * keep
    mscale = (0.1 * math.log(factor) + 1.0) if factor > 1 else 1.0
    return Rope(inv.astype(np.float32), mscale * r.attn_factor)


def rope_from_spec(r: RopeSpec) -> Rope:
    """The model's RoPE from its GGUF keys: plain, or YaRN.

    YaRN's ramp ends are rounded to whole dims: that is what a GGUF means, as
    llama.cpp defines it. (The HF gpt-oss config says truncate=false, ~1e-3
    apart in the logits; the GGUF has no key for it, and a GGUF must give the
    same tokens here and in llama.cpp.)
    """
    if r.scaling == "yarn":
        return yarn_rope(r, r.dim, truncate=True)
    return Rope(plain_inv_freq(r.freq_base, r.dim))


# ---- attention ---------------------------------------------------------------


# Rows at least this big are their own anonymous mapping: pages are taken as positions are
# first written and given back by `_Rows.release` (the slots' KV pool, procs/slots.py).
PAGE = mmap.PAGESIZE
MAPPED_ROWS_BYTES = 16 * PAGE
# A shared prefix is held by reference in at most this many page files a cache (each a
# mapping per kv head and layer); positions past them are copied. A donor's positions past
# its files go into a new one only when they are at least SHARE_MIN_POSITIONS.
MAX_PAGE_FILES = 4
SHARE_MIN_POSITIONS = 64


def _zeroed(shape: tuple[int, ...], dtype) -> tuple[np.ndarray, mmap.mmap | None]:
    """A zeroed array and, when it is large, the anonymous mapping it lives in (None: numpy's own)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes < MAPPED_ROWS_BYTES:
        return np.zeros(shape, dtype), None
    # private (a shared one would keep dropped pages in its shmem object), zero-filled, backed page by page as written
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mm, dtype, int(np.prod(shape))).reshape(shape), mm


class _Rows:
    """One layer's K (or V) for every kv head, [Hk, rows, d], stored as `kv_type`:
    f32 and f16 as such; q8_0 as int8 values with one float16 scale per block
    of 32 along d (llama.cpp's q8_0: d = max|x|/127, q = roundf(x/d)).

    Position j lives in row j mod rows. With rows = n_ctx that is row j; a
    sliding-window layer (`window` W > 0) keeps a ring of W - 1 + one prompt
    block (shared/gguf/spec.py kv_rows), where each position overwrites the
    one `rows` before it. `lo` is the oldest position still held: the rows
    hold positions lo..top-1 (top: one past the last written), so a read of
    older ones is refused rather than served from an overwritten row.
    `attend` (shared/model/attend.py) reads the same map in place: base 0."""

    stride = 1  # positions per row (`_Entries` holds one row per `stride`)

    def __init__(self, kv_type: str, hk: int, rows: int, d: int, window: int = 0):
        self.kv_type, self.window, self.lo = kv_type, window, 0
        self.top = 0  # one past the highest position written since the last `release`: the rows whose pages are touched
        dtype = {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}[kv_type]
        self.data, data_map = _zeroed((hk, rows, d), dtype)
        self.maps = [data_map]
        self.scale = None
        if kv_type == "q8_0":
            self.scale, scale_map = _zeroed((hk, rows, d // Q8_0_BLOCK), np.float16)
            self.maps.append(scale_map)
        # Positions 0..hi-1 of a prefix shared by reference: its pages map page files, one
        # segment a file (kv_pages.py), contiguous from position 0.
        self.segments: list[_Segment] = []

    def release(self, n: int) -> None:
        """Give the memory of positions n on back to the system (a whole-context layer's: a ring
        reuses its rows): each head's pages past row n are dropped and read as zeros again, the
        partly used page at row n kept; a shared prefix's pages past n no longer refer to
        their file. Positions n on must not be held: they are written anew before they are read."""
        if self.window or n >= self.top:
            return
        self._unshare(n)
        for a, mm in zip(self.arrays(), self.maps):
            if mm is None:
                continue
            per_head, per_row = a.strides[0], a.strides[1]
            for h in range(a.shape[0]):
                lo = -(-(h * per_head + n * per_row) // PAGE) * PAGE
                hi = (h + 1) * per_head // PAGE * PAGE
                if hi > lo:
                    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        self.top = n

    @property
    def cap(self) -> int:
        return self.data.shape[1]

    def arrays(self) -> list[np.ndarray]:
        """What is stored, [Hk, rows, x]: the values, and q8_0's scales."""
        return [self.data] if self.scale is None else [self.data, self.scale]

    def _at(self, lo: int, hi: int) -> slice | np.ndarray:
        """The rows of positions lo..hi-1 (at most `cap` of them), in position order."""
        r0 = lo % self.cap
        return slice(r0, r0 + hi - lo) if r0 + hi - lo <= self.cap else np.arange(lo, hi) % self.cap

    def count(self, lo: int, hi: int) -> int:
        """Rows positions lo..hi-1 take (what `export(lo, hi)` gives)."""
        return hi - lo

    def holds(self, lo: int, hi: int) -> bool:
        """Whether positions lo..hi-1 are all still in the rows (an empty range always is)."""
        return hi <= lo or (lo >= self.lo and hi - lo <= self.cap)

    def write(self, at: int, x: np.ndarray) -> None:
        """x [Hk, T, d] float32 at positions at..at+T-1: only these rows are converted."""
        t = x.shape[1]
        if t > self.cap:
            raise ValueError(f"{t} positions do not fit {self.cap} rows of KV cache at once")
        rows = self._at(at, at + t)
        if self.scale is None:
            self.data[:, rows] = x  # numpy casts to float16 (round to nearest) for f16
        else:
            self.data[:, rows], self.scale[:, rows] = quantize_q8_0(x)
        self.top = max(self.top, at + t)
        # Positions below at + t - cap were just overwritten; anything at or past `at` was
        # forgotten (a truncation) and is now these rows.
        self.lo = max(min(self.lo, at), at + t - self.cap)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Positions lo..hi-1 as float32 [Hk, hi-lo, d] (a view for f32 rows that do not wrap,
        a converted copy otherwise)."""
        if not self.holds(lo, hi):
            raise ValueError(f"KV positions {lo}..{hi - 1} are not held: these {self.cap} rows keep {self.lo} on")
        rows = self._at(lo, hi)
        data = self.data[:, rows]
        if self.scale is None:
            return data if data.dtype == np.float32 else data.astype(np.float32)
        hk, n, d = data.shape
        blocks = data.reshape(hk, n, d // Q8_0_BLOCK, Q8_0_BLOCK).astype(np.float32)
        return (blocks * self.scale[:, rows, :, None].astype(np.float32)).reshape(hk, n, d)

    def export(self, lo: int, hi: int) -> list[np.ndarray]:
        """Positions lo..hi-1 as stored, one [Hk, hi-lo, x] array per `arrays()` (a saved session)."""
        rows = self._at(lo, hi)
        return [np.ascontiguousarray(a[:, rows]) for a in self.arrays()]

    def restore(self, lo: int, hi: int, stored: list[np.ndarray]) -> None:
        """Put back what `export(lo, hi)` gave (maybe from rows of another size): the rows
        then hold exactly positions lo..hi-1."""
        rows = self._at(lo, hi)
        for a, x in zip(self.arrays(), stored):
            a[:, rows] = x
        self.lo, self.top = lo, max(self.top, hi)

    # -- a prefix shared by reference (kv_pages.py) ----------------------------------------
    def can_map(self) -> bool:
        """Whether these rows can hold a prefix by reference: a whole-context layer's, in mappings."""
        return not self.window and all(mm is not None for mm in self.maps) and kv_pages.supported()

    @property
    def by_reference(self) -> int:
        """Positions 0..n-1 whose pages are held by reference (0: none)."""
        return self.segments[-1].hi if self.segments else 0

    def page_files(self) -> list[kv_pages.PageFile]:
        return [seg.file for seg in self.segments]

    def file_pages(self, n: int) -> int:
        """Bytes of whole pages a page file for positions `by_reference`..n-1 of these rows takes."""
        lo = self.by_reference
        return sum((hi - lo_) * PAGE for a in self.arrays() for h in range(a.shape[0]) for lo_, hi in [_pages(a, h, lo, n)])

    def file_away(self, file: kv_pages.PageFile, at: int, n: int) -> int:
        """Put positions `by_reference`..n-1's whole pages into `file` from byte `at`, and map the
        file over them here (this cache's own pages go back to the system); the bytes written."""
        lo, offsets, start = self.by_reference, [], at
        for a in self.arrays():
            heads = []
            for h in range(a.shape[0]):
                first, last = _pages(a, h, lo, n)
                heads.append(at)
                if last > first:
                    file.write(at, memoryview((ctypes.c_char * ((last - first) * PAGE)).from_address(_address(a) + first * PAGE)))
                    kv_pages.map_file(_address(a) + first * PAGE, (last - first) * PAGE, file.fd, at)
                at += (last - first) * PAGE
            offsets.append(tuple(heads))
        self.segments.append(_Segment(file, lo, n, tuple(offsets)))
        return at - start

    def mappings(self) -> int:
        """About how many mappings holding a segment more by reference takes: one an array and
        kv head, and the split of this cache's own mapping around it."""
        return 2 * sum(a.shape[0] for a in self.arrays())

    def take_prefix(self, other: _Rows, n: int, by_reference: bool = True) -> None:
        """Hold `other`'s positions 0..n-1 (both whole-context rows of one layout): the pages its
        segments hold by reference, mapped here too (unless `by_reference` is False), and the rows
        past them copied; what these rows held by reference before is let go."""
        self._unshare(0)
        for seg in other.segments if by_reference else ():
            if seg.lo >= n:
                break
            hi = min(seg.hi, n)
            for a, offsets in zip(self.arrays(), seg.offsets):
                for h in range(a.shape[0]):
                    first, last = _pages(a, h, seg.lo, hi)
                    if last > first:
                        kv_pages.map_file(_address(a) + first * PAGE, (last - first) * PAGE, seg.file.fd, offsets[h])
            self.segments.append(_Segment(seg.file, seg.lo, hi, seg.offsets))
        shared = self.by_reference
        for a, theirs in zip(self.arrays(), other.arrays()):
            copy_from = _by_reference(a, shared)
            a[:, copy_from:n] = theirs[:, copy_from:n]
        self.lo, self.top = 0, max(self.top, n)

    def _unshare(self, n: int) -> None:
        """Positions n on no longer held by reference: each segment keeps the pages wholly below
        row n, and the rest of its pages leave its file: a page that also holds positions below
        n becomes this cache's own copy, the others map fresh zeros. So every page still mapping
        a file is one its segment counts, and a file let go is mapped nowhere here."""
        for seg in self.segments:
            if seg.hi <= n:
                continue
            for a in self.arrays():
                per_head, per_row = a.strides[0], a.strides[1]
                for h in range(a.shape[0]):
                    first, last = _pages(a, h, seg.lo, seg.hi)
                    keep = _pages(a, h, seg.lo, n)[1] if seg.lo < n else first
                    below = -(-(h * per_head + n * per_row) // PAGE)  # pages from here hold no position below n
                    if keep < min(below, last):
                        _own_copy(_address(a) + keep * PAGE)
                        keep += 1
                    if last > keep:
                        kv_pages.map_zeros(_address(a) + keep * PAGE, (last - keep) * PAGE)
        self.segments = [seg if seg.hi <= n else _Segment(seg.file, seg.lo, n, seg.offsets) for seg in self.segments if seg.lo < n]


@dataclass(frozen=True)
class _Segment:
    """Positions lo..hi-1 of a `_Rows` held by reference: each array's and kv head's whole pages
    among those rows (`_pages`) map `file` from offsets[array][head]."""

    file: kv_pages.PageFile
    lo: int
    hi: int
    offsets: tuple[tuple[int, ...], ...]


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _pages(a: np.ndarray, h: int, lo: int, hi: int) -> tuple[int, int]:
    """The pages (indices into a's mapping) a segment lo..hi of kv head h holds: from the page at
    row lo (the first whole page of the head when lo is 0) to the page at row hi, so that each
    page goes to the segment its first prefix row is in and no page holds another head's rows."""
    per_head, per_row = a.strides[0], a.strides[1]
    head = -(-h * per_head // PAGE)
    first = head if lo == 0 else max(head, (h * per_head + lo * per_row) // PAGE)
    return first, max(first, (h * per_head + hi * per_row) // PAGE)


def _own_copy(page: int) -> None:
    """The page at address `page` keeps its bytes in anonymous memory of its own (a file's page
    it mapped is let go)."""
    held = ctypes.string_at(page, PAGE)
    kv_pages.map_zeros(page, PAGE)
    ctypes.memmove(page, held, PAGE)


def _by_reference(a: np.ndarray, hi: int) -> int:
    """How many of positions 0..hi-1 lie wholly in a's pages that segments up to hi hold: their
    rows need no copy."""
    per_head, per_row = a.strides[0], a.strides[1]
    if any(h * per_head % PAGE for h in range(a.shape[0])):
        return 0  # a head that begins part way into a page: its first rows are copied, so all are
    return min(hi, min((_pages(a, h, 0, hi)[1] * PAGE - h * per_head) // per_row for h in range(a.shape[0])))


class _Entries:
    """A compressing layer's entries (deepseek4): one row of `width` per `stride` positions,
    entry m folded from positions m·stride..(m+1)·stride-1 and written once its window is
    complete, kept as `kv_type` for the whole context (they are few). Seen as positions, as
    what shares and saves rows by position reads them (`share_prefix_from`, a saved session):
    positions lo..hi-1 hold entries lo//stride..hi//stride-1, the ones complete by then; an
    incomplete window's entry is written when the window completes."""

    window = 0  # whole context: nothing is overwritten, the oldest held is always 0
    lo = 0

    def __init__(self, kv_type: str, n_ctx: int, stride: int, width: int):
        self.stride, self.cap = stride, n_ctx  # cap: the positions it covers
        self.rows = _Rows(kv_type, 1, n_ctx // stride, width)

    def arrays(self) -> list[np.ndarray]:
        return self.rows.arrays()

    def count(self, lo: int, hi: int) -> int:
        return hi // self.stride - lo // self.stride

    def write(self, m: int, x: np.ndarray) -> None:
        """Entries m..m+M-1, x [M, width] float32."""
        self.rows.write(m, x[None])

    def read(self, m0: int, m1: int) -> np.ndarray:
        """Entries m0..m1-1 as float32 [m1-m0, width]."""
        if m1 <= m0:
            return np.zeros((0, self.rows.data.shape[2]), np.float32)
        return self.rows.read(m0, m1)[0]

    def export(self, lo: int, hi: int) -> list[np.ndarray]:
        m0, m1 = lo // self.stride, hi // self.stride
        if m1 <= m0:
            return [np.zeros((a.shape[0], 0, a.shape[2]), a.dtype) for a in self.arrays()]
        return self.rows.export(m0, m1)

    def restore(self, lo: int, hi: int, stored: list[np.ndarray]) -> None:
        m0, m1 = lo // self.stride, hi // self.stride
        if m1 > m0:
            self.rows.restore(m0, m1, stored)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., d] float32, d a multiple of 32 → (int8 [..., d], float16 scales [..., d/32]),
    bit for bit llama.cpp's quantize_row_q8_0_ref: the scale is computed and applied in
    float32 and only stored as float16; roundf rounds halves away from zero."""
    blocks = np.asarray(x, np.float32).reshape(*x.shape[:-1], x.shape[-1] // Q8_0_BLOCK, Q8_0_BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    y = blocks * inv
    a = np.abs(y)
    whole = np.floor(a)
    q = np.sign(y) * (whole + np.floor(2 * (a - whole)))  # roundf, not numpy's round-half-to-even
    return q.astype(np.int8).reshape(x.shape), d[..., 0].astype(np.float16)


class KVCache:
    """Keys and values per layer, filled left to right, stored as `kv_type`
    (f32 | f16 | q8_0; shared/gguf/spec.py KV_TYPE_BYTES). Reads come back as
    float32: attention's math is float32 whatever the storage.

    A layer with a window W (`windows`, per layer; 0 or () = the whole context)
    keeps a ring of W - 1 + `prompt_block` rows instead of n_ctx (`for_spec`
    gives a model's: gemma4's and gpt-oss's sliding layers), and takes a prompt
    in blocks of `prompt_block` tokens (`store_and_attend`). The cache can then
    continue from a position only while its rings still hold the W - 1 before
    it: `can_truncate` says where. V may keep its own window (`v_windows`, per
    layer; () = K's), and a compressing layer its entries (`entries`, per layer
    (positions per entry, width), (0, 0) for none: deepseek4's, `_Entries`)."""

    def __init__(
        self,
        n_ctx: int,
        n_head_kv: tuple[int, ...],
        head_dim_k: tuple[int, ...],
        head_dim_v: tuple[int, ...],
        kv_type: str = "f32",
        windows: tuple[int, ...] = (),
        prompt_block: int = SWA_PROMPT_BLOCK,
        v_windows: tuple[int, ...] = (),
        entries: tuple[tuple[int, int], ...] = (),
    ):
        entries = tuple(entries) or ((0, 0),) * len(n_head_kv)
        check_kv_type(kv_type, tuple(head_dim_k) + tuple(head_dim_v) + tuple(w for _, w in entries))
        windows = tuple(windows) or (0,) * len(n_head_kv)
        v_windows = tuple(v_windows) or windows
        if len({len(windows), len(v_windows), len(entries), len(n_head_kv)}) != 1 or prompt_block < 1 or min(windows + v_windows) < 0:
            raise ValueError(f"KVCache: {len(windows)} windows for {len(n_head_kv)} layers, prompt block {prompt_block}")
        self.n_ctx, self.kv_type, self.windows, self.prompt_block = n_ctx, kv_type, windows, prompt_block
        self.v_windows = v_windows
        self.k = [_Rows(kv_type, hk, kv_rows(w, n_ctx, prompt_block), dk, w) for hk, dk, w in zip(n_head_kv, head_dim_k, windows)]
        self.v = [_Rows(kv_type, hk, kv_rows(w, n_ctx, prompt_block), dv, w) for hk, dv, w in zip(n_head_kv, head_dim_v, v_windows)]
        self.entries = [_Entries(kv_type, n_ctx, r, w) if r else None for r, w in entries]
        self.n = 0  # positions filled (all layers advance together)
        # A hybrid model's (qwen35moe) recurrent layers keep their state here, not in K/V.
        self.state: RecurrentState | None = None
        # q8_0 attention takes a pass's queries in blocks, which round unlike one query alone; a
        # verify pass's rows must be what decode steps compute, so it sets this (shared/model/session.py).
        self.rows_alone = False

    # Whether this is several sequences' caches seen as one (shared/model/batch.py BatchCache):
    # attention then runs once per sequence (`per_sequence`).
    batched = False

    def sequences(self, start: int) -> list[tuple[KVCache, int, slice]]:
        """The sequences a pass's rows belong to, as (cache, its first new position, its
        rows): here one, every row from `start`; a BatchCache's, each at its own."""
        return [(self, start, slice(None))]

    @classmethod
    def for_spec(cls, spec: ModelSpec, n_ctx: int, kv_type: str, prompt_block: int = SWA_PROMPT_BLOCK) -> KVCache:
        """A model's cache: a ring on each sliding-window layer, V on its own window and a
        compressing layer's entries when the spec gives them (what kv_cache_bytes counts)."""
        heads = (spec.n_head_kv, spec.head_dim_k, spec.head_dim_v)
        return cls(n_ctx, *heads, kv_type, kv_windows(spec), prompt_block, v_windows=kv_v_windows(spec), entries=kv_entries(spec))

    def store(self, layer: int, k: np.ndarray, v: np.ndarray, at: int | None = None) -> None:
        """k [T, Hk, d], v [T, Hk, dv] at positions at..at+T-1, `at` the next position by
        default (commit with advance()). A ring (K's or V's) must still hold the W - 1 positions before `at`."""
        t, at = k.shape[0], self.n if at is None else at
        if at + t > self.n_ctx:
            raise ValueError(f"context full: {at} + {t} tokens > n_ctx {self.n_ctx}")
        for kept in (self.k[layer], self.v[layer]):
            if at < self.n or not kept.holds(max(0, at - kept.window + 1) if kept.window else at, at):
                raise ValueError(f"layer {layer} cannot store position {at}: the cache holds {self.n}, its rows keep {kept.lo} on")
        self.k[layer].write(at, k.transpose(1, 0, 2))
        self.v[layer].write(at, v.transpose(1, 0, 2))

    def keys(self, layer: int, lo: int, hi: int) -> np.ndarray:
        """Cached keys at positions lo..hi-1, float32 [Hk, hi-lo, d]."""
        return self.k[layer].read(lo, hi)

    def values(self, layer: int, lo: int, hi: int) -> np.ndarray:
        """Cached values at positions lo..hi-1, float32 [Hk, hi-lo, dv]."""
        return self.v[layer].read(lo, hi)

    def entries_of(self, layer: int) -> _Entries:
        """A compressing layer's entries (deepseek4's); a ValueError on a layer the cache keeps none for."""
        e = self.entries[layer]
        if e is None:
            raise ValueError(f"layer {layer} keeps no compressed entries in this cache")
        return e

    def stored(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The layer's K and V arrays as stored, [Hk, rows, d] with position j in row
        j mod rows (attend's base 0), when they are plain float32 or float16 (decode
        attention reads them in place); None for q8_0."""
        k, v = self.k[layer], self.v[layer]
        return None if k.scale is not None else (k.data, v.data)

    def rows(self) -> list[_Rows | _Entries]:
        """Every layer's K and V rows in a fixed order (per layer: K, V), then each compressing
        layer's entries: what a saved session writes and reads back (shared/model/session.py)
        and a shared prefix copies."""
        return [r for kv in zip(self.k, self.v) for r in kv] + [e for e in self.entries if e is not None]

    def advance(self, t: int) -> None:
        self.n += t

    def pooled(self) -> list[_Rows]:
        """The rows that keep the whole context, whose memory grows with the positions written
        (what the slots' KV pool counts); rings, compressed entries and a recurrent state are fixed."""
        return [r for r in self.k + self.v if not r.window]

    @property
    def held(self) -> int:
        """Positions whose rows are in memory: one past the highest written since the last `release`
        (at least `n`; more while a prompt chunk's rows wait to be counted, or after a truncation)."""
        return max((r.top for r in self.pooled()), default=0)

    @property
    def own(self) -> int:
        """Of the positions held, those in memory of its own: not a prefix held by reference."""
        return max(0, self.held - self.by_reference)

    def release(self, n: int) -> None:
        """Give back the memory of the whole-context rows from position n on (n at least the
        positions held, `n`): the slots' pool takes it from an idle slot, or trims what a
        truncation left (procs/slots.py)."""
        if n < self.n:
            raise ValueError(f"cannot release positions from {n} on: the cache holds {self.n}")
        for r in self.pooled():
            r.release(n)

    def holds_window(self, p: int) -> bool:
        """Whether the keys a query at position p sees before itself (p-W+1..p-1 on a
        ring; a whole-context layer keeps everything) are all still held, and V's ring
        the positions before p its window names (deepseek4: the rows a fold still reads)."""
        return all(r.holds(max(0, p - r.window + 1), p) for r in self.k + self.v if r.window)

    def can_truncate(self, n: int) -> bool:
        """Whether `truncate(n)` leaves a cache that can go on from position n (n at or past
        the current length: from where it is). Always to 0. A recurrent state has folded
        every position in and cannot be rewound, so only to 0 or on; a ring only while it
        still holds the window before n: a prefix whose window rows were overwritten is
        recomputed (docs/conversations.md § Prefix reuse)."""
        if n <= 0:
            return True
        if self.state is not None and n < self.n:
            return False
        return self.holds_window(min(n, self.n))

    def truncate(self, n: int) -> None:
        """Forget every position from n on (rows past n are overwritten by the next store)."""
        if not self.can_truncate(n):
            if self.state is not None and n < self.n:
                raise ValueError(f"this model's recurrent state cannot be rewound from {self.n} to {n} positions (only to 0)")
            lo = max(r.lo for r in self.k)
            raise ValueError(
                f"this model's sliding-window rows no longer hold the positions before {n} (they keep {lo} on): only back to 0"
            )
        if self.state is not None and n <= 0:
            self.state.reset()
        self.n = max(0, min(self.n, n))

    def rewind(self, n: int, snap: tuple) -> None:
        """Go back to position n with the recurrent state as `snap` (its `snapshot` taken
        when the cache held n): what `truncate` cannot do on a hybrid model's cache."""
        if self.state is None or not 0 <= n <= self.n or not self.holds_window(n):
            raise ValueError(f"cannot rewind this cache from {self.n} to {n} positions")
        self.state.restore(snap)
        self.n = n

    def can_share(self, n: int) -> bool:
        """Whether another cache can go on from this one's first n positions (`share_prefix_from`):
        they are held (n at most the length), a ring still holds the window before n, and a
        recurrent state, which has folded in every position, has folded in exactly n."""
        if not 0 < n <= self.n:
            return False
        return (self.state is None or n == self.n) and self.holds_window(n)

    @property
    def by_reference(self) -> int:
        """Positions 0..n-1 whose whole-context rows are held by reference, in page files that
        other caches may map too (0: none; kv_pages.py)."""
        return min((r.by_reference for r in self.pooled()), default=0)

    def page_files(self) -> set[kv_pages.PageFile]:
        """The page files its rows map: a shared prefix's, each counted once however many caches map it."""
        return {f for r in self.pooled() for f in r.page_files()}

    def _files_more(self, n: int) -> bool:
        """Whether a share of n positions puts this cache's positions past its page files into a new one."""
        mapped = self.pooled()
        return (
            bool(mapped)
            and all(r.can_map() for r in mapped)
            and n - self.by_reference >= SHARE_MIN_POSITIONS
            and len(mapped[0].segments) < MAX_PAGE_FILES
            and kv_pages.mappings_left() > 2 * (MAX_PAGE_FILES + 1) * sum(r.mappings() for r in mapped)
        )

    def shareable(self, n: int) -> int:
        """About how many of positions 0..n-1 a cache that takes them (`share_prefix_from`) holds
        by reference rather than in memory of its own (a page a kv head is copied): what the
        slots' KV pool need not find room for."""
        if not self.pooled() or not all(r.can_map() for r in self.pooled()):
            return 0
        return n if self._files_more(n) else min(self.by_reference, n)

    def share_prefix_from(self, other: KVCache, n: int) -> None:
        """Hold `other`'s first n positions, as if this cache had computed them: the whole-context
        rows' whole pages by reference where this system allows (other's positions past its page
        files go into a new one, mapped in both: kv_pages.py; the part-used pages are copied),
        every other row copied (q8_0's scales too; a ring's held rows before n, which include the
        window the next position needs), a recurrent state copied, then n positions counted.
        Refused with a ValueError, before anything changes, when `other` cannot share them
        (`can_share`) or is laid out otherwise (another model, kv_type or context)."""
        if other is self:
            raise ValueError("a cache cannot share a prefix with itself")
        if _layout(self) != _layout(other):
            raise ValueError("cannot share KV rows between caches of another layout (model, kv_type or context)")
        if not other.can_share(n):
            if not 0 < n <= other.n:
                why = "it does not hold them"
            elif other.state is not None and n < other.n:
                why = "a recurrent state is only shared whole"
            else:
                why = "its rings no longer hold the window before them"
            raise ValueError(f"cannot share the first {n} of {other.n} positions: {why}")
        if other._files_more(n):
            other._file_away(n)
        segments = max((len(r.segments) for r in other.pooled()), default=0)
        by_reference = kv_pages.mappings_left() > segments * sum(r.mappings() for r in self.pooled())
        for mine, theirs in zip(self.rows(), other.rows()):
            if isinstance(mine, _Rows) and isinstance(theirs, _Rows) and mine.can_map():
                mine.take_prefix(theirs, n, by_reference)
                continue
            lo = max(theirs.lo, n - mine.cap, 0) if theirs.window else 0  # a ring: what it holds of 0..n-1
            mine.restore(lo, n, theirs.export(lo, n))
        if self.state is not None and other.state is not None:
            self.state.restore((other.state.conv, other.state.delta))
        self.n = n

    def _file_away(self, n: int) -> None:
        """Positions `by_reference`..n-1 of every whole-context row into one new page file, mapped
        here. A system that refuses the file (no memory, no descriptors) leaves them as they were:
        a cache taking them copies them."""
        rows = self.pooled()
        try:
            file = kv_pages.PageFile(sum(r.file_pages(n) for r in rows), n - self.by_reference)
        except OSError:
            return
        at = 0
        for r in rows:
            at += r.file_away(file, at, n)

    def parts(self) -> list[np.ndarray]:
        """Every stored array, [Hk, rows, x], in a fixed order (per layer: K, its
        q8_0 scales if any, V, its scales)."""
        return [a for r in self.rows() for a in r.arrays()]


def _layout(cache: KVCache) -> tuple:
    """What two caches must share for one to hold the other's positions: context, kv_type, windows,
    prompt block, the shape of every stored array and of the recurrent state's (None without one)."""
    state = None if cache.state is None else [(i, a.shape) for d in (cache.state.conv, cache.state.delta) for i, a in d.items()]
    return cache.n_ctx, cache.kv_type, cache.windows, cache.v_windows, cache.prompt_block, [a.shape for a in cache.parts()], state


class RecurrentState:
    """A hybrid model's per-sequence state of its linear-attention layers, float32:
    `conv[i]` [kernel-1, channels] (the last inputs of the short causal conv) and
    `delta[i]` [heads, d_k, d_v] (the gated delta rule's matrix). Its size is fixed
    whatever the context (shared/gguf/spec.py recurrent_state_bytes)."""

    def __init__(self, layers: list[int], kernel: int, channels: int, heads: int, d_k: int, d_v: int):
        self.conv = {i: np.zeros((kernel - 1, channels), np.float32) for i in layers}
        self.delta = {i: np.zeros((heads, d_k, d_v), np.float32) for i in layers}
        # A verify pass's certain rows (shared/model/session.py): each layer's scan copies its
        # state as it passes the last of them into `kept`, a snapshot a rollback of the
        # pass's drafts goes back to (0: no copy).
        self.mark = 0
        self.kept: tuple[dict[int, np.ndarray], dict[int, np.ndarray]] = ({}, {})

    def keep_conv(self, i: int, x: np.ndarray) -> None:
        """Before layer i's conv takes this pass's inputs x [T, C]: its state after the first
        `mark` of them (the last kernel-1 inputs by then), into `kept`."""
        if self.mark:
            m = min(self.mark, x.shape[0])
            self.kept[0][i] = np.concatenate([self.conv[i], x[:m]])[m:]

    def reset(self) -> None:
        for a in (*self.conv.values(), *self.delta.values()):
            a.fill(0)

    def snapshot(self) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """A copy of the state, for `restore`: the state cannot be rewound, so a pass that
        may have to be undone (a prompt's chunk, a verify pass's drafts) keeps where it began."""
        return {i: a.copy() for i, a in self.conv.items()}, {i: a.copy() for i, a in self.delta.items()}

    def restore(self, snap: tuple[dict[int, np.ndarray], dict[int, np.ndarray]]) -> None:
        """Put a `snapshot` back, in place (the layers hold these arrays)."""
        conv, delta = snap
        for i, a in conv.items():
            self.conv[i][:] = a
        for i, a in delta.items():
            self.delta[i][:] = a

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.conv.values(), *self.delta.values()))


def per_sequence(cache: KVCache, start: int, fn: Callable[..., np.ndarray], *rows: np.ndarray) -> np.ndarray:
    """fn(cache, start, *rows) for what depends on a sequence's own positions (attention
    over its cache, a recurrent state's scan); over a batch of several sequences
    (shared/model/batch.py), once per sequence with its cache, its first new position
    and its slice of each row array [T, ...], the outputs concatenated in row order."""
    parts = cache.sequences(start)
    if len(parts) == 1 and parts[0][2] == slice(None):
        return fn(parts[0][0], parts[0][1], *rows)
    return np.concatenate([fn(c, s, *(r[sl] for r in rows)) for c, s, sl in parts])


# The q8_0 path's scores are [Hk, G, T', N] float32 for a block of T' queries over N keys: blocks
# keep them near this many elements (16 MiB), where a 4,096-token chunk over a 32k context at once
# would be 8 GiB on Gemma's full layers.
Q8_SCORE_ELEMENTS = 1 << 22


def attention(
    q: np.ndarray, cache: KVCache, layer: int, start: int, scale: float, window: int = 0, sinks: np.ndarray | None = None
) -> np.ndarray:
    """Causal GQA over the cache for T queries at positions start..start+T-1.

    q [T, H, d]; returns [T, H·dv]. Key j is visible to query p when j ≤ p and,
    with a window W, p − W < j. `sinks` [H] adds a per-head logit column that
    takes probability mass and is then dropped (gpt-oss). Every key the queries
    see must be held (a ring keeps W - 1 + prompt_block rows: `store_and_attend`).
    Over a batch of sequences, each sequence's queries over its own cache.
    """
    if cache.batched:
        return per_sequence(cache, start, lambda c, s, q: attention(q, c, layer, s, scale, window, sinks), q)
    t, h, d = q.shape
    n = start + t
    first = max(0, start - window + 1) if window else 0  # the first key any of these queries sees
    kept = cache.k[layer]
    if kept.window and not 0 < window <= kept.window:
        raise ValueError(f"layer {layer} keeps a {kept.window}-position window; attention over {window or 'the whole context'} needs more")
    if not kept.holds(first, n):
        raise ValueError(f"layer {layer}: keys {first}..{n - 1} are not all held (its {kept.cap} rows keep {kept.lo} on)")
    stored = cache.stored(layer)
    if stored is not None:  # f32/f16: every row as a decode step computes it, whatever the batch
        hk = stored[0].shape[0]
        return attend(q.reshape(t, hk, h // hk, d), stored[0], stored[1], 0, start, window, scale, sinks).reshape(t, -1)
    keys, values = cache.keys(layer, first, n), cache.values(layer, first, n)  # float32 [Hk, N, d], [Hk, N, dv]
    hk, dv = keys.shape[0], values.shape[2]
    g = h // hk
    out = np.empty((t, hk, g, dv), np.float32)
    # Queries in blocks (a decode step is one): the same blocks for the same (start, T), so a
    # position's numbers repeat in a fresh run chunked alike (docs/conversations.md § Prefix reuse).
    step = 1 if cache.rows_alone else max(1, Q8_SCORE_ELEMENTS // max(1, h * (n - first)))
    for a in range(0, t, step):
        b = min(t, a + step)
        lo = max(0, start + a - window + 1) if window else 0  # this block's first key
        kb, vb = keys[:, lo - first : start + b - first], values[:, lo - first : start + b - first]  # [Hk, N', d]
        # One matmul per kv head over all its G·T' query rows: [Hk, G·T', d] @ [Hk, d, N'].
        qg = np.ascontiguousarray(q[a:b].reshape(b - a, hk, g, d).transpose(1, 2, 0, 3)).reshape(hk, g * (b - a), d)
        scores = (np.matmul(qg, kb.transpose(0, 2, 1)) * np.float32(scale)).reshape(hk, g, b - a, -1)  # [Hk, G, T', N']
        if b - a > 1:
            pos = np.arange(start + a, start + b)[:, None]  # [T', 1]
            j = np.arange(lo, start + b)[None, :]  # [1, N']
            hidden = j > pos
            if window:
                hidden |= j <= pos - window
            scores = np.where(hidden, np.float32(-np.inf), scores)
        m = scores.max(axis=-1, keepdims=True)
        if sinks is not None:
            s = sinks.reshape(hk, g, 1, 1).astype(np.float32)
            m = np.maximum(m, s)
            e = np.exp(scores - m)
            probs = e / (e.sum(axis=-1, keepdims=True) + np.exp(s - m))
        else:
            e = np.exp(scores - m)
            probs = e / e.sum(axis=-1, keepdims=True)
        out[a:b] = np.matmul(probs.reshape(hk, g * (b - a), -1), vb).reshape(hk, g, b - a, dv).transpose(2, 0, 1, 3)
    return out.reshape(t, -1)  # [T, H·dv]


def store_and_attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cache: KVCache,
    layer: int,
    start: int,
    scale: float,
    window: int = 0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Store the new tokens' k [T, Hk, d] and v [T, Hk, dv] at positions start..start+T-1
    and attend q [T, H, d] over the cache (`attention`): [T, H·dv].

    With a window, a prompt goes in blocks of `cache.prompt_block` tokens: a block's
    rows are stored, then its queries attend, then the next block. So a ring of
    W - 1 + prompt_block rows holds every key a block sees, read in place, with no
    copy; the later blocks overwrite what the earlier ones no longer need. A
    whole-context cache runs the same blocks and gets the same numbers, q8_0's too.
    Over a batch of sequences, each sequence's rows in its own cache.
    """
    if cache.batched:
        return per_sequence(cache, start, lambda c, s, q, k, v: store_and_attend(q, k, v, c, layer, s, scale, window, sinks), q, k, v)
    t = q.shape[0]
    step = cache.prompt_block if window else t
    if t <= step:
        cache.store(layer, k, v, at=start)
        return attention(q, cache, layer, start, scale, window, sinks)
    out = []
    for a in range(0, t, step):
        b = min(t, a + step)
        cache.store(layer, k[a:b], v[a:b], at=start + a)
        out.append(attention(q[a:b], cache, layer, start + a, scale, window, sinks))
    return np.concatenate(out)


# ---- activations -------------------------------------------------------------


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) → inf for very negative x gives the right 0
        return 1.0 / (1.0 + np.exp(-x))


# Rows a time of an elementwise step done in place (silu_in_place): its temporary stays this
# many rows, whatever the chunk.
IN_PLACE_ROWS = 256


def silu_in_place(x: np.ndarray) -> np.ndarray:
    """x ← x·sigmoid(x) for float32 x [T, C], the same operations as `x * sigmoid(x)`,
    IN_PLACE_ROWS rows at a time: a prompt chunk's conv output is [T, C], 128 MiB a copy
    on Qwen3.5 at 4,096 tokens, where the plain expression makes four."""
    for a in range(0, x.shape[0], IN_PLACE_ROWS):
        rows = x[a : a + IN_PLACE_ROWS]
        s = np.negative(rows)
        with np.errstate(over="ignore"):
            np.exp(s, out=s)
        s += np.float32(1.0)
        np.divide(np.float32(1.0), s, out=s)
        rows *= s
    return x


def causal_conv(prev: np.ndarray, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A short causal conv over channels, continuing from earlier inputs: with window =
    [prev; x] (prev [K-1, C] the inputs before x [T, C]), out[t] = Σ_j window[t + j]·w[j]
    summed in j order, w [K, C]; prev then holds the last K-1 inputs (updated in place).
    Each term is taken from prev's or x's rows directly, into one reused temporary, so a
    prompt chunk holds two [T, C] arrays, not a window copy and a sum's chain."""
    p, t = w.shape[0] - 1, x.shape[0]
    out = np.empty((t, x.shape[1]), np.float32)
    tmp = np.empty_like(out)

    def term(j: int, into: np.ndarray) -> None:
        from_prev = min(t, max(0, p - j))  # window rows j .. j+T-1 that are still prev's
        np.multiply(prev[j : j + from_prev], w[j], out=into[:from_prev])
        np.multiply(x[: t - from_prev], w[j], out=into[from_prev:])

    term(0, out)
    for j in range(1, p + 1):
        term(j, tmp)
        out += tmp
    if t >= p:
        prev[:] = x[t - p :]
    else:
        prev[: p - t] = prev[t:].copy()  # overlapping rows: copy first
        prev[p - t :] = x
    return out


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return np.float32(0.5) * x * (1.0 + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
