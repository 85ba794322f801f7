"""What a child process is started with beside the frozen Config: the facts
the parent resolved at start-up that no config key says — where the shared
memory and the sockets are, which model file and its identity, the cache's
shape. Built by the parent (procs/children.py `Launch.facts`), sent to each
spawned child with the config, read by the reader, compute, telemetry and
gateway. Every setting a child needs it reads from the config itself
(`config.<table>.<key>`); nothing here repeats one.

Stdlib only, so the parent builds it without importing compute's model code
(numba, LLVM).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunFacts:
    runtime_dir: str  # the run's private folder: the ipc sockets, error files, gateway.json
    model_path: str  # the model file itself (model.path resolved: the embedded tiny model made, a pulled file found)
    model_name: str  # what the API and the errors call it: model.name, else the file's stem
    slab_arena: str = ""  # the expert cache's shared-memory segment (shared/experts/shm.py SlabArena)
    slab_bytes: int = 0  # one slab: the largest expert, aligned (shared/gguf/layout.py)
    n_slabs: int = 0  # slabs in the arena: the resolved budget over slab_bytes, and the KV cache's loan
    lent_slabs: int = 0  # of them, those compute takes back as its context grows (docs/architecture.md § The KV cache's loan)
    prompt_lent_slabs: int = 0  # of them, those held back while compute warms up and before a long prompt pass (§ The prompt's loan)
    index_arena: str = ""  # the residency index's segment (shared/experts/residency.py)
    dense_arena: str = ""  # the dense set's segment; "" unless io.dense_weights = "anon"
    model_identity: tuple[str, ...] = ()  # directio.model_identity at start-up: a child refuses any other file
    io_align: int = 0  # the parent's Layout.align (shared/gguf/alignment.py); 0 = resolve in the child
    reader_pid: int = 0  # the reader's pid once it runs (0 before): compute watches for its death
    hot_set: str = ""  # the service's hot-set file (shared/experts/hotset.py); "" for `run`: nothing saved or read
