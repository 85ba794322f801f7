"""A conversation's state between generations: a KV cache and the token ids it
holds, so the next request computes only what it does not share with them
(prefix reuse), a context shift when the cache fills, and the versioned file a
session is saved to and restored from (docs/conversations.md).

    session.reuse(prompt)        keep the common prefix, return its length
    session.feed(model, ids)     run ids at the next positions, remembering them
    session.shift(model, keep)   drop half of what lies past `keep`, recompute the rest
    save_session(path, session, identity)   /   load_session(path, model, n_ctx, identity)

Invariant: `ids[:cache.n]` are the tokens whose K and V the cache holds. A
step records its ids before it runs and the cache counts a batch only once
every layer has stored it, so a step that fails half way (a cancel, a read
error) leaves a consistent session: the positions it did not finish are
simply not held. On a sliding-window ring such a step may have overwritten
rows the held positions' window needs (a chunk longer than one prompt
block): the cache then says it cannot go on from them (KVCache.can_truncate),
and the next request starts from position 0 rather than read those rows.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import UserError
from .blocks import KVCache

SESSION_MAGIC = b"MOEPSESS"
SESSION_VERSION = 2  # 2: a sliding-window layer keeps its ring's positions (docs/conversations.md § Saved sessions)
_PREAMBLE = struct.Struct("<8sII")  # magic, version, header bytes
MAX_HEADER_BYTES = 1 << 20  # the JSON header is a few hundred bytes; more is not a session file
MIN_KEEP_FREE = 4  # a shift always frees some positions (llama.cpp clamps n_keep to n_ctx - 4)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Session:
    """One KV cache and the token ids it holds, kept across generations."""

    def __init__(self, cache: KVCache | None = None, ids: Sequence[int] = ()):
        self.cache = cache
        self.ids: list[int] = list(ids)
        # Speculative decoding (shared/text/speculate.py): where the last verify pass began and, on a
        # recurrent model, the state there; and the accepted tokens a rollback put back to be run again.
        self._verify_from = 0
        self._verify_state: tuple | None = None
        self.redo: list[int] = []
        # What a drafter keeps with this conversation across requests (the MTP block's own KV
        # cache: shared/text/speculate.py MtpDrafter); None until one is made.
        self.drafter_state: object | None = None
        # The width chooser's measures (shared/text/speculate.py WidthChooser): a pass's cost by its
        # rows, and how often a costly drafter's drafts are kept, carried from one request to the next.
        self.width_chooser: object | None = None

    @property
    def n(self) -> int:
        return self.cache.n if self.cache is not None else 0

    @property
    def held(self) -> int:
        """Positions its cache keeps in memory (KVCache.held; 0 without a cache)."""
        return self.cache.held if self.cache is not None else 0

    @property
    def own(self) -> int:
        """Of them, those in memory of its own (KVCache.own): a prefix held by reference is not."""
        return self.cache.own if self.cache is not None else 0

    @property
    def tokens(self) -> list[int]:
        """The ids the cache holds, position by position."""
        return self.ids[: self.n]

    def cache_for(self, model, n_ctx: int):
        """The cache, made on first use (or when the context size changed)."""
        if self.cache is None or self.cache.n_ctx != n_ctx:
            self.cache, self.ids = model.new_cache(n_ctx), []
        return self.cache

    def truncate(self, n: int) -> None:
        if self.cache is not None and n < self.cache.n:
            self.cache.truncate(n)
        del self.ids[max(n, 0) :]
        self.redo, self._verify_state = [], None

    def reset(self) -> None:
        """Forget everything (the cache's memory is kept for the next request)."""
        self.truncate(0)

    def reuse(self, prompt: Sequence[int], enabled: bool = True, align: int = 1) -> int:
        """Keep the longest prefix the cache shares with `prompt` and drop the
        rest; return how many prompt tokens need no computing. At most
        len(prompt) - 1: the last prompt token always runs, so there are
        logits to sample the first new token from. Cut down to a multiple of
        `align` (generate passes the prefill batch for a q8_0 cache, whose
        batched attention rounds unlike a single row's: positions a prompt
        computed are then recomputed in the batches a fresh run uses;
        docs/conversations.md § Prefix reuse).
        Disabled, nothing in common, or a prefix whose sliding-window rows were
        overwritten (KVCache.can_truncate): start from position 0."""
        self.truncate(self.reusable(prompt, enabled, align))
        return self.n

    def reusable(self, prompt: Sequence[int], enabled: bool = True, align: int = 1) -> int:
        """How many positions `reuse` would keep for `prompt`, changing nothing."""
        keep = min(common_prefix(self.tokens, prompt), len(prompt) - 1) if enabled else 0
        if self.cache is not None and self.cache.state is not None:
            # A recurrent state cannot be rewound: all of the cache goes on, or none of it.
            keep = self.n if keep >= self.n else 0
        else:
            keep -= keep % max(align, 1)
        if self.cache is not None and not self.cache.can_truncate(keep):
            # A sliding-window ring no longer holds the window before `keep` (the cache went
            # on more than a prompt block past it, or a prompt stopped part way overwrote it):
            # no shorter prefix has its window either, so the prompt runs from position 0.
            keep = 0
        return max(keep, 0)

    def share_from(self, other: Session, n: int, model, n_ctx: int) -> None:
        """Hold `other`'s first n positions in this session's cache (made if need be), as if it
        had computed them: its KV rows (whole pages by reference) and recurrent state (KVCache.share_prefix_from)
        and its ids, so that `reuse` keeps them (docs/batching.md § Prompt prefixes shared
        across slots). Refused with a ValueError, this session unchanged, when `other`'s cache
        cannot share them."""
        if other.cache is None:
            raise ValueError("the other session holds nothing to share")
        self.cache_for(model, n_ctx).share_prefix_from(other.cache, n)
        self.ids = other.ids[:n]
        self.redo, self._verify_state = [], None

    def feed(self, model, ids: Sequence[int], batch: int = 0) -> np.ndarray:
        """Run `ids` at the next positions: a prompt's batches of `batch`, or
        with batch 0 one decoded token; the last position's logits [V]. Tokens a
        rollback put back (`redo`) run first, in the same pass."""
        if self.redo:
            return self.verify(model, ids)[-1]
        self.ids[self.n :] = [int(t) for t in ids]
        if batch == 0:
            return model.decode_one(int(ids[0]), self.cache)
        return model.prefill(list(ids), self.cache, batch=batch)

    def verify(self, model, ids: Sequence[int]) -> np.ndarray:
        """Run a decoded token and its drafts at the next positions in one pass (with any
        `redo` tokens before them); their logits [len(ids), V]. `rollback` undoes the
        drafts found wrong: a recurrent state is copied here, once per pass, to go back to."""
        if self.cache is None:
            raise ValueError("verify needs the session's cache (Session.cache_for)")
        run = self.redo + [int(t) for t in ids]
        certain = min(len(self.redo) + 1, len(run))  # the redo rows and the decoded token: never rolled back
        self._verify_from = self.n + certain
        state = self.cache.state
        if state is not None and certain < len(run):  # each scan copies its state as it passes the certain rows
            state.mark, state.kept = certain, ({}, {})
        self.ids[self.n :] = run
        self.redo = []
        self.cache.rows_alone = True  # q8_0 attention: each row as a decode step computes it
        try:
            return model.verify(run, self.cache, len(run) - len(ids))[len(run) - len(ids) :]
        finally:
            self.cache.rows_alone = False
            if state is not None:
                self._verify_state, state.mark = (state.kept if state.mark else None), 0

    def rollback(self, n: int) -> None:
        """Forget the last `n` positions, a verify pass's drafts found wrong. KV rows are
        simply not counted; a recurrent state, which cannot be rewound, goes back to where
        the pass's certain rows left it (copied inside the pass, RecurrentState.mark) and
        the drafts kept since then wait in `redo` for the next pass, which runs them as
        extra rows (no pass of their own)."""
        if n <= 0:
            return
        keep = self.n - n
        if self.cache is None or self.cache.state is None:
            self.truncate(keep)
            return
        if self._verify_state is None or keep < self._verify_from:
            raise ValueError(f"cannot roll back {n} positions: the last verify pass's certain rows end at {self._verify_from}")
        redo, snap = self.ids[self._verify_from : keep], self._verify_state
        self.cache.rewind(self._verify_from, snap)
        del self.ids[self._verify_from :]
        self.redo, self._verify_state = redo, None

    def settle(self, model) -> None:
        """Run any `redo` tokens now, so the cache holds every token it names (the end of a
        generation: the next request's prefix reuse compares against `tokens`)."""
        if self.redo:
            self.verify(model, [])
            self._verify_state = None

    def shift(self, model, n_keep: int, batch: int) -> int:
        """The cache is full: keep its first `n_keep` positions, drop half of
        the rest (the oldest), and recompute the kept tail from its ids at its
        new positions, as if the kept ids had been the prompt (so the result
        equals a fresh run on them, for every RoPE variant and sliding window:
        docs/conversations.md § Context shift). Returns the positions freed, 0
        when nothing can be dropped."""
        self.settle(model)  # tokens a rollback put back are held first: the shift keeps them
        n = self.n
        n_ctx = self.cache.n_ctx if self.cache is not None else n
        keep = max(0, min(n_keep, n_ctx - MIN_KEEP_FREE, n))
        discard = (n - keep) // 2
        if discard <= 0:
            return 0
        tail = self.ids[keep + discard : n]
        if self.cache is not None and not self.cache.can_truncate(keep):
            # A recurrent state cannot be rewound to `keep`: recompute the kept head too.
            tail = self.ids[:keep] + tail
            keep = 0
        self.truncate(keep)
        self.feed(model, tail, batch)  # never empty: discard <= (n - keep) / 2
        return discard


# ----------------------------------------------------------------- saved sessions


def _parts_layout(cache: KVCache) -> list[list]:
    """Per stored array (per layer: K, its q8_0 scales, V, its scales; then a compressing layer's
    entries): kv heads, width, dtype, window (0: whole context), and for rows of one entry per
    `stride` positions (deepseek4's) the stride."""
    return [[int(a.shape[0]), int(a.shape[2]), a.dtype.str, r.window, *_stride(r)] for r in cache.rows() for a in r.arrays()]


def _stride(rows) -> list[int]:
    """[stride] for rows of one entry per `stride` positions, [] for one row per position: the
    files of every other kind of rows stay as they were."""
    return [rows.stride] if rows.stride > 1 else []


def _part(layout: list, first: int) -> list:
    """A header part: [heads, width, dtype, window, first] and, for entry rows, their stride."""
    return [*layout[:4], first, *layout[4:]]


def _layout_of(part: list) -> list:
    """A header part's layout (`_parts_layout`'s entry) without its first held position (part[4])."""
    return [*part[:4], *part[5:]]


def _per_array(cache: KVCache, per_rows: list[int]) -> list[int]:
    return [x for r, x in zip(cache.rows(), per_rows) for _ in r.arrays()]


def _first_held(cache: KVCache, n: int) -> list[int]:
    """Per rows of `cache.rows()`, the first of the positions 0..n-1 a file keeps: 0, or a ring's oldest held."""
    return [min(r.lo, n) if r.window else 0 for r in cache.rows()]


def save_session(path: str | os.PathLike, session: Session, identity: Sequence[str], arch: str = "") -> int:
    """Write the session to `path` (a temporary file renamed over it, so a
    crash never leaves half a session under the name); the bytes written.
    Each array keeps the positions its rows hold: all N on a whole-context
    layer, a sliding-window layer's ring from its oldest held position."""
    if session.cache is None:
        raise UserError("there is no session to save yet: generate something first")
    if session.cache.state is not None:
        # The file format holds KV rows only; a hybrid model's recurrent state would be lost.
        raise UserError(
            f"saving a session is not supported for {arch or 'this model'}: its linear-attention state is not in the file format"
        )
    cache, n = session.cache, session.n
    if not cache.can_truncate(n):
        raise UserError(
            "there is no session to save: the last prompt stopped part way and overwrote sliding-window rows it needed; "
            "send a request first"
        )
    firsts = _first_held(cache, n)
    header = {
        "model": list(identity),
        "arch": arch,
        "kv_type": cache.kv_type,
        "n_ctx": cache.n_ctx,
        "n_tokens": n,
        "parts": [_part(layout, first) for layout, first in zip(_parts_layout(cache), _per_array(cache, firsts))],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(_PREAMBLE.pack(SESSION_MAGIC, SESSION_VERSION, len(head)))
            fh.write(head)
            fh.write(np.asarray(session.tokens, "<i4").tobytes())
            for rows, first in zip(cache.rows(), firsts):
                for part in rows.export(first, n):
                    fh.write(part.tobytes())
            fh.flush()
            os.fsync(fh.fileno())
            written = fh.tell()
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write the session file {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written


def _expected_bytes(header: dict, head_len: int) -> int:
    """The file's length by its header; a part that is not [heads, width, dtype, window, first]
    (and a stride > 1 for entry rows, one per `stride` positions) with 0 <= first <= N (0 on a
    whole-context layer) is a ValueError (a corrupt header)."""
    n = header["n_tokens"]
    size = _PREAMBLE.size + head_len + 4 * n
    for part in header["parts"]:
        hk, width, dtype, window, first, *rest = part
        stride = rest[0] if len(rest) == 1 else 1
        if (
            len(rest) > 1
            or not all(isinstance(x, int) and x >= 0 for x in (hk, width, window, first, stride))
            or first > n
            or (first and not window)
            or stride < 1
        ):
            raise ValueError(f"part {part}")
        size += hk * (n // stride - first // stride) * width * np.dtype(dtype).itemsize
    return size


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The header of a session file and where its data starts, checked for
    the magic, the version, and the file's length against the header."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            pre = fh.read(_PREAMBLE.size)
            if len(pre) < _PREAMBLE.size or not pre.startswith(SESSION_MAGIC):
                if SESSION_MAGIC.startswith(pre[: len(SESSION_MAGIC)]) and len(pre) < _PREAMBLE.size:
                    raise UserError(f"the session file {path} is truncated ({len(pre)} bytes)")
                raise UserError(f"{path} is not a moe-pipe session file")
            _, version, head_len = _PREAMBLE.unpack(pre)
            if version != SESSION_VERSION:
                raise UserError(f"the session file {path} is version {version}; this moe-pipe reads version {SESSION_VERSION}")
            if head_len > MAX_HEADER_BYTES:
                raise UserError(f"{path} is not a moe-pipe session file (a {head_len}-byte header)")
            raw = fh.read(head_len)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise UserError(f"cannot read the session file {path}: {exc.strerror or exc}") from None
    if len(raw) < head_len:
        raise UserError(f"the session file {path} is truncated ({size} bytes, inside its header)")
    try:
        header = json.loads(raw)
        n = header["n_tokens"]
        want = _expected_bytes(header, head_len)
        if not (isinstance(n, int) and n >= 0 and isinstance(header["model"], list) and isinstance(header["kv_type"], str)):
            raise ValueError(n)
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"the session file {path} has a corrupt header ({type(exc).__name__})") from None
    if size < want:
        raise UserError(f"the session file {path} is truncated ({size} bytes; its header says {want})")
    if size > want:
        raise UserError(f"the session file {path} is corrupt ({size - want} bytes after its end)")
    return header, _PREAMBLE.size + head_len


def load_session(path: str | os.PathLike, model, n_ctx: int, identity: Sequence[str], into: KVCache | None = None) -> Session:
    """A session read from `path` into a cache of `n_ctx` positions for
    `model` (`into`, when it is one, so a restore never holds two caches),
    refused with one line if it belongs to another model file, was stored as
    another kv_type, is truncated, of another version or does not fit. Every
    check comes before `into` is touched: a refused file leaves it as it was."""
    header, data_at = read_header(path)
    if list(header["model"]) != list(identity):
        arch = f" ({header.get('arch')})" if header.get("arch") else ""
        raise UserError(
            f"the session file {path} was saved with another model file{arch}; a session only restores on the model it was made with"
        )
    if header["kv_type"] != model.kv_type:
        raise UserError(
            f"the session file {path} stores its KV cache as {header['kv_type']} but this model runs with {model.kv_type}; "
            f"set compute.kv_type = {header['kv_type']} to restore it"
        )
    n = header["n_tokens"]
    if n >= n_ctx:
        raise UserError(f"the session file {path} holds {n} tokens, more than fit a context of {n_ctx}; raise compute.ctx_size")
    reuse = into is not None and into.n_ctx == n_ctx and into.kv_type == model.kv_type
    cache = into if reuse and into is not None else model.new_cache(n_ctx)
    if [_layout_of(p) for p in header["parts"]] != _parts_layout(cache):
        raise UserError(f"the session file {path} does not match this model's KV cache shapes; it was saved with another model")
    firsts = _first_held(cache, n)  # per rows; the file's must be the same for K's values and scales, and hold the window
    at = 0
    for i, rows in enumerate(cache.rows()):
        count, first = len(rows.arrays()), header["parts"][at][4]
        if [p[4] for p in header["parts"][at : at + count]] != [first] * count or (rows.window and first > max(0, n - rows.window + 1)):
            raise UserError(
                f"the session file {path} is corrupt (a sliding-window layer's rows do not hold the window before its last token)"
            )
        firsts[i], at = first, at + count
    cache.truncate(0)  # from here a failure leaves an empty cache, never a mix of two sessions
    cache.release(0)  # its pages, a prefix held by reference included, are the file's from here
    try:
        with open(path, "rb") as fh:
            fh.seek(data_at)
            ids = np.fromfile(fh, "<i4", n)
            for rows, first in zip(cache.rows(), firsts):
                keep = max(first, n - rows.cap)  # a smaller ring (a shorter context) keeps the newest positions
                held = []
                for part in rows.arrays():
                    hk, _, width = part.shape
                    count = rows.count(first, n)
                    saved = np.fromfile(fh, part.dtype, hk * count * width).reshape(hk, count, width)
                    held.append(saved[:, rows.count(first, keep) :])
                rows.restore(keep, n, held)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the session file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if n and (ids.min() < 0 or ids.max() >= model.spec.n_vocab):
        raise UserError(f"the session file {path} is corrupt (a token id out of the vocabulary)")
    cache.advance(n)
    return Session(cache, ids.tolist())


def slot_action(session: Session, action: str, path: str, model, n_ctx: int, identity: Sequence[str]) -> dict[str, int | float]:
    """llama.cpp's slot actions on `session`: save it to `path`, restore it
    from `path`, or erase it; the figures its server reports."""
    t0 = time.perf_counter()
    if action == "save":
        written = save_session(path, session, identity, getattr(model, "arch", ""))
        return {"n_saved": session.n, "n_written": written, "save_ms": round((time.perf_counter() - t0) * 1e3, 3)}
    if action == "restore":
        restored = load_session(path, model, n_ctx, identity, into=session.cache)
        session.cache, session.ids = restored.cache, restored.ids
        return {"n_restored": session.n, "n_read": os.path.getsize(path), "restore_ms": round((time.perf_counter() - t0) * 1e3, 3)}
    if action == "erase":
        n = session.n
        session.reset()
        return {"n_erased": n}
    raise UserError(f"unknown slot action {action!r} (save, restore or erase)")
