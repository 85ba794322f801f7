"""What compute is started with: built by the parent (procs/children.py),
sent to the spawned child, read by procs/compute.py. Its own module so the
parent builds it without importing compute's model code (numba, LLVM).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeConfig:
    model_path: str
    runtime_dir: str
    slab_arena: str
    slab_bytes: int
    n_slots: int
    reader_pid: int
    dense_weights: str = "anon"  # anon | warm | mmap
    dense_arena: str = ""
    index_arena: str = ""
    overlap: bool = True
    prefetch: bool = False  # speculative next-layer prefetch while decoding
    prefetch_prompt: bool = False  # and while a prompt's batch runs
    top_k: int | None = None
    threads: int | None = None
    ctx_size: int = 4096
    kv_type: str = "f16"  # how the KV cache stores K and V: f16 | f32 | q8_0 (shared/model/blocks.py KVCache)
    drop_cold_experts: float = 0.0  # lossy levers (shared.model.levers); 0 = exact
    cache_route: float = 0.0
    route_trace: str = ""  # record routing to this file ("" = no)
    route_replay: str = ""  # route by this trace instead of the router (benchmarks)
    model_identity: tuple[str, ...] = ()  # directio.model_identity at start-up: refuse any other file
    populate: bool = True  # map the slab and dense arenas ahead of first use (shared/experts/populate.py)
    context_shift: bool = False  # generate.context_shift: a full KV cache drops its oldest tokens instead of ending the reply
    n_keep: int = 0  # generate.n_keep: tokens at the start a context shift keeps (-1 = the whole prompt)
    io_align: int = 0  # the parent's Layout.align (shared/gguf/alignment.py); 0 = resolve here
