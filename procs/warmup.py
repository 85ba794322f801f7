"""Kernel warm-up: compile (or load from numba's disk cache) every kernel a
model needs before its first request, one named step at a time.

numba compiles a kernel on its first call with a new type signature, so
without this a run's first prompt pays 10-15 s of compiling (the tiny model:
a dozen kernels of 0.3-2.3 s each) and its timings say so. The steps, from
the model's tensor types:

  - per quant type of a weight matrix: its matmul (the int8 kernel on the
    int8-activation types while int8 activations are on, else the float
    tile) and, on the int8-activation types, the int8 matvec (the same
    kernel, already compiled by then);
  - per type of an embedding table: the row decoder (`dequantize_rows`);
  - one forward pass (a 2-token prompt, then one decoded token) of the real
    model over zero-filled experts laid out as compute's slabs lay them out,
    which compiles the rest (norms, RoPE, routing, attention) with exactly
    the argument types a run gives them, without reading one expert.

Used by the compute process (its progress goes to the front end as
`Progress` messages), by `run --no-stream` and by `moe-pipe warmup`. Imports
numba: only processes that compute may import this module.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numba.core import event as numba_event

from ..shared import quant
from ..shared.experts.placement import expert_view, placement_for
from ..shared.gguf.model_file import ModelFile
from ..shared.model.batch import PromptSlice
from ..shared.model.fused import PARALLEL_ROWS
from ..shared.model.load import ModelOptions, load_model
from ..shared.model.weights import Expert

STAGE = "kernels"
# (step, total, item) as each step starts
Report = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Step:
    label: str  # what the progress line names: "Q4_K int8 matvec"
    run: Callable[[], object]  # its result is dropped


@dataclass(frozen=True)
class WarmupResult:
    steps: int
    seconds: float
    compiled: int  # kernels numba compiled (0: all came from its disk cache)


class CompileCounter(numba_event.Listener):
    """Counts numba's compiles while registered (a load from the disk cache is not one)."""

    def __init__(self) -> None:
        self.count = 0

    def on_start(self, event) -> None:
        pass

    def on_end(self, event) -> None:
        self.count += 1

    def __enter__(self) -> CompileCounter:
        numba_event.register("numba:compile", self)
        return self

    def __exit__(self, *exc: object) -> None:
        numba_event.unregister("numba:compile", self)


def _zeros(n_rows: int, row_bytes: int) -> np.ndarray:
    w = np.zeros((n_rows, row_bytes), np.uint8)
    w.flags.writeable = False  # as the file mapping and the slabs hand weights out
    return w


def _matmul_step(qt: quant.QType) -> Step:
    fmt = quant.block_format(qt)
    # Two rows: the int8 kernel on the int8 types (int8 on), the float tile otherwise.
    X = np.zeros((2, fmt.block_size), np.float32)
    return Step(f"{fmt.name} matmul", lambda: quant.matmul(qt, _zeros(2, fmt.type_size), X))


def _matvec_step(qt: quant.QType) -> Step:
    fmt = quant.block_format(qt)
    x = np.zeros(fmt.block_size, np.float32)
    return Step(f"{fmt.name} int8 matvec", lambda: quant.matvec(qt, _zeros(2, fmt.type_size), x))


def _rows_step(qt: quant.QType) -> Step:
    fmt = quant.block_format(qt)
    return Step(f"{fmt.name} rows", lambda: quant.dequantize_rows(qt, _zeros(2, fmt.type_size), [0]))


def kernel_steps(mf: ModelFile, forward: Callable[[], object]) -> list[Step]:
    """The steps for `mf`, the forward pass (`forward_pass`) last."""
    # The NextN/MTP block is never loaded: a type only it has compiles nothing that runs.
    # An I32 index table (deepseek4's token → experts) is looked up, never multiplied.
    used = [t for t in mf.gguf.tensors.values() if t.name not in mf.layout.nextn_tensor_names and t.qtype.name != "I32"]
    matrix_types = sorted({quant.QType(int(t.qtype)) for t in used if len(t.shape) >= 2}, key=int)
    # Embedding tables are looked up by rows (shared/model/weights.py QWeight.rows).
    row_types = sorted({quant.QType(int(t.qtype)) for t in used if "token_embd" in t.name}, key=int)
    steps = [_matmul_step(qt) for qt in matrix_types]
    if quant.int8_activations():
        steps += [_matvec_step(qt) for qt in matrix_types if qt in quant.INT8_ACTIVATION_TYPES]
    steps += [_rows_step(qt) for qt in row_types]
    steps.append(Step("forward pass (norms, RoPE, routing, attention)", forward))
    return steps


class ZeroExperts:
    """An ExpertSource of zero-filled experts, each a view into one zero slab
    exactly as compute's `SlabExperts` views a cached one: the warm-up's
    forward pass gets the real argument types and reads nothing."""

    held_together = sys.maxsize  # one zero slab, never overwritten

    def __init__(self, mf: ModelFile):
        self.layout = mf.layout
        self.slab = np.zeros(mf.layout.slab_bytes, np.uint8)
        self.slab.flags.writeable = False  # compute maps the slab arena read-only

    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[Expert]:
        lay = self.layout.layers[layer]
        for e in ids:
            yield expert_view(lay, int(e), self.slab, placement_for(lay.extents(int(e)), self.layout.align))

    def resident(self, layer: int, ids: Sequence[int]) -> list[bool]:
        return [True] * len(ids)

    def prefetch(self, layer: int, ids: Sequence[int]) -> None:
        """Nothing to read."""


# A prompt chunk's kernels on numba's threads (fused.py, from PARALLEL_ROWS rows) compile in a
# chunk's pass through this many layers: every family's kinds of layer come within its first
# eight (a dense first layer, gemma4's five sliding layers to a full one, qwen35moe's three
# recurrent to an attention one), and the whole depth would cost a start ~2 s at 48 layers.
WARM_CHUNK_LAYERS = 8


def forward_pass(mf: ModelFile, top_k: int | None, dense_view=None, kv_type: str = "f16") -> Callable[[], object]:
    """A short prompt and one decoded token through `mf`'s model on zero experts, and a
    chunk of PARALLEL_ROWS tokens through its first WARM_CHUNK_LAYERS layers."""

    def run() -> None:
        model = load_model(mf, top_k=top_k, experts=ZeroExperts(mf), dense_view=dense_view, options=ModelOptions(kv_type=kv_type))
        cache = model.new_cache(8)
        model.prefill([0, 1], cache)
        model.decode_one(1, cache)
        chunk = PromptSlice(np.ones(PARALLEL_ROWS, np.int64), model.new_cache(PARALLEL_ROWS))
        model.forward_batch([], prompt=chunk, layers=min(WARM_CHUNK_LAYERS, model.spec.n_layer))

    return run


def warm_up(steps: Sequence[Step], report: Report | None = None) -> WarmupResult:
    """Run every step, telling `report` which one starts; the result says how it went."""
    t0 = time.perf_counter()
    # On one numba thread: what compiles does not depend on the thread count, and
    # the compute process populates its arenas on a thread meanwhile. The forward
    # pass is thousands of small kernel calls; run on every core, each call waits
    # for the core the populate holds (measured on qwen30b-shape, 48 layers,
    # 2 cores: 8-28 s beside an 18 GiB populate, against 0.4 s alone).
    threads = quant.get_threads()
    quant.set_threads(1)
    try:
        with CompileCounter() as counter:
            for i, step in enumerate(steps):
                if report:
                    report(i + 1, len(steps), step.label)
                step.run()
    finally:
        quant.set_threads(threads)
    return WarmupResult(len(steps), time.perf_counter() - t0, counter.count)
