"""A decode step of a model timed on this machine, with stand-in weights.

    StandIn(mf, top_k).step(threads, miss) -> StepTime   the real forward pass, no file read

`moe-pipe doctor` times the kernels one matrix at a time; what a token costs
besides them (attention, norms, RoPE, routing, the MoE block's bookkeeping,
the Python between kernel calls) depends on the family and its shapes: 0.05 ms
a layer on the tiny model, ~0.4 ms on qwen30b-shape. Rather than a constant,
the doctor builds the model's own forward pass (shared/model/load.py) over
weights of the file's exact types and shapes, filled with random valid blocks
(shared/quant/blocks.py `random_blocks`) instead of read from the file, and
times decode steps. Nothing of the file is read, so it works before the
weights are here as long as the header is; what it allocates is the dense set
once and a pool of experts twice the L3 (each step reads its experts from
DRAM, as a cache's would be).

Random weights route at random: the experts a step multiplies differ every
step, as a real router's mostly do. Norm weights are ones and biases zeros,
so activations stay finite; the numbers mean nothing, only the time does.
"""

from __future__ import annotations

import mmap
import random
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

POOL_BYTES = 256 << 20  # distinct experts, 8× the 32 MB L3: random routing over a pool twice the L3 still found half its experts there
TILE_WEIGHTS = 1 << 16  # random blocks made once per type and repeated: making 1 GB of them would take seconds
PROMPT = tuple(range(3, 19))  # token ids every vocabulary holds
STEPS = 6  # at least; more while MIN_SECONDS last, up to MAX_STEPS
MIN_SECONDS = 0.3
MAX_STEPS = 200


@dataclass(frozen=True)
class StepTime:
    seconds: float  # median decode step (one token, every layer), kernels included
    steps: int
    setup_s: float  # building the stand-in and its prompt


def _float_fill(name: str, shape: tuple[int, ...], dtype, rng: np.random.Generator) -> np.ndarray:
    if len(shape) <= 1 or shape[0] == 1:
        # norms, scales, biases, sinks: ones for what multiplies, zeros for what adds
        value = 1.0 if any(w in name for w in ("norm", "scale", "freq")) else 0.0
        return np.full(shape, value, dtype=dtype)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)


def small_pages(nbytes: int) -> np.ndarray:
    """`nbytes` of uint8 in an anonymous mapping of the system's small pages. numpy asks for huge
    pages for a large array (madvise), and the weights a run multiplies sit in the file mapping
    or the cache's shared memory on small ones: the TLB's misses are part of what a step costs
    (the stand-in ran 100 ms a step on huge pages where the model itself took 116, qwen30b-shape)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


class StandInWeights:
    """A `dense_view` (shared/model/weights.py Weights) serving each tensor's shape and dtype
    as the file would, filled with random valid values."""

    def __init__(self, mf, rng: np.random.Generator):
        self._mf, self._rng = mf, rng
        self._tiles: dict[str, np.ndarray] = {}
        self._made: dict[str, np.ndarray] = {}

    def _tile(self, qtype) -> np.ndarray:
        from ..quant.blocks import block_format, random_blocks

        fmt = block_format(qtype)
        tile = self._tiles.get(fmt.name)
        if tile is None:
            n = max(fmt.block_size, TILE_WEIGHTS // fmt.block_size * fmt.block_size)
            tile = self._tiles[fmt.name] = random_blocks(qtype, n, self._rng).reshape(-1)
        return tile

    def quantized(self, qtype, nbytes: int) -> np.ndarray:
        """`nbytes` of valid blocks of `qtype`, uint8."""
        tile = self._tile(qtype)
        out = small_pages(nbytes)
        whole = nbytes // tile.size * tile.size
        out[:whole].reshape(-1, tile.size)[:] = tile  # the tile again and again: whole blocks, as both sizes are
        out[whole:] = tile[: nbytes - whole]
        return out

    def __call__(self, name: str) -> np.ndarray:
        out = self._made.get(name)
        if out is not None:
            return out
        t = self._mf.gguf.tensor(name)
        shape, dtype = _file_shape(self._mf, name)
        if np.issubdtype(dtype, np.integer) and dtype != np.uint8:
            out = np.zeros(shape, dtype)  # index tables (hash routing): id 0 is always valid
        elif dtype == np.uint8:
            out = self.quantized(t.qtype, int(np.prod(shape))).reshape(shape)
        else:
            filled = _float_fill(name, shape, dtype, self._rng)
            out = small_pages(filled.nbytes).view(filled.dtype).reshape(shape)
            out[...] = filled
        self._made[name] = out
        return out


# the tensor types gguf-py hands out as arrays of their own element; every other type is rows of bytes
_NATIVE = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _file_shape(mf, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype gguf-py's view of `name` has, from the tensor table alone (so a
    header-only file, before the download, times the same as the whole file)."""
    t = mf.gguf.tensor(name)
    native = _NATIVE.get(t.qtype.name)
    if native is not None:
        return t.shape, np.dtype(native)
    return (*t.shape[:-1], t.row_bytes), np.dtype(np.uint8)


class StandInExperts:
    """An ExpertSource over a pool of random experts of each layer's exact parts: expert e of
    layer l is pool entry (l·E + e) mod P, P experts in POOL_BYTES."""

    held_together = 1 << 30

    def __init__(self, mf, weights: StandInWeights, miss: float = 0.0, seed: int = 0):
        from ..model.weights import expert_from_bytes

        self._mf = mf
        self.miss = miss
        self._rng = random.Random(seed)
        self._pools: dict[tuple, list[dict[str, np.ndarray]]] = {}
        self._layers = {}
        for lay in mf.layout.layers:
            if not lay.parts:
                continue
            key = tuple((p.name, p.tensor.qtype, p.stride) for p in lay.parts)
            pool = self._pools.get(key)
            if pool is None:
                # as many as POOL_BYTES hold, but no more than the model has (a tiny model's all sit in cache)
                n = min(max(2, POOL_BYTES // max(1, lay.expert_bytes)), mf.spec.n_expert * len(mf.layout.layers))
                pool = self._pools[key] = [{p.name: _part_bytes(weights, p) for p in lay.parts} for _ in range(n)]
            self._layers[lay.layer] = (lay, pool)
        self._build = expert_from_bytes
        self._n_expert = mf.spec.n_expert
        self._views: dict[tuple[int, int], object] = {}

    def experts(self, layer: int, ids: Iterable[int]) -> Iterator:
        lay, pool = self._layers[layer]
        for e in ids:
            expert = self._views.get((layer, int(e)))
            if expert is None:  # built once and kept, as the cache keeps its views (procs/compute.py SlabExperts)
                expert = self._views[(layer, int(e))] = self._build(lay, int(e), pool[(layer * self._n_expert + int(e)) % len(pool)])
            yield expert

    def resident(self, layer: int, ids: Sequence[int]) -> list[bool]:
        """Each expert "in memory" but a `miss` share of them at random: a decode step computes
        the experts in memory together and each miss alone as it lands (shared/model/moe.py),
        and that split is part of what a step costs at a hit rate."""
        return [self._rng.random() >= self.miss for _ in ids]

    def prefetch(self, layer: int, ids: Sequence[int]) -> None:
        """Every stand-in expert is in memory."""


def _part_bytes(weights: StandInWeights, part) -> np.ndarray:
    if part.name.endswith("_bias"):
        return np.zeros(part.stride, np.uint8)  # float32 zeros
    return weights.quantized(part.tensor.qtype, part.stride)  # its own memory: distinct DRAM


class StandIn:
    """`mf`'s forward pass over stand-in weights, built once and timed at several points."""

    def __init__(self, mf, top_k: int | None, seed: int = 0):
        from ..model.load import load_model

        t0 = time.perf_counter()
        self.weights = StandInWeights(mf, np.random.default_rng(seed))
        self.experts = StandInExperts(mf, self.weights, 0.0, seed)
        self.model = load_model(mf, top_k=top_k, experts=self.experts, dense_view=self.weights)
        self.build_s = time.perf_counter() - t0

    def step(self, threads: int, miss: float = 0.0, steps: int = STEPS) -> StepTime:
        """The median wall of at least `steps` decode steps (more while MIN_SECONDS last) on
        `threads` numba threads, at the context's start (attention over a few hundred
        positions, where a reply's steady tokens are, costs a small share of a step), with a
        `miss` share of each layer's experts computed one by one as a cache's misses are."""
        from .. import quant

        t0 = time.perf_counter()
        before = quant.get_threads()
        quant.set_threads(threads)
        self.experts.miss = miss
        try:
            cache = self.model.new_cache(MAX_STEPS + 8)
            for token in PROMPT[:2]:  # the first steps' one-time work (allocations, compiles) outside the timing
                self.model.decode_one(token, cache)
            setup = time.perf_counter() - t0
            walls: list[float] = []
            stop = time.perf_counter() + MIN_SECONDS
            while len(walls) < steps or (
                time.perf_counter() < stop and len(walls) < MAX_STEPS
            ):  # a small model's steps are noisy: more of them
                t = time.perf_counter()
                self.model.decode_one(PROMPT[len(walls) % len(PROMPT)], cache)
                walls.append(time.perf_counter() - t)
        finally:
            quant.set_threads(before)
        return StepTime(statistics.median(walls), len(walls), setup)


def step_seconds(mf, top_k: int | None, threads: int, steps: int = STEPS, seed: int = 0, miss: float = 0.0) -> StepTime:
    """One point of a fresh StandIn (tests; the doctor keeps one for all its points)."""
    return StandIn(mf, top_k, seed).step(threads, miss, steps)
