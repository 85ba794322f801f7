"""The peer engine of `moe-pipe bench --vs llama.cpp`: the same GGUF through
llama-cpp-python with its default loading (mmap: the page cache holds the
weights, which is what a device larger model than RAM thrashes on).

Run as its own process so that it can be put in the benchmark's memory
cgroup and killed if it crawls:

    python -m moe_pipe.shared.analysis.peer_llama MODEL.gguf REQUEST.json OUT.csv

REQUEST.json: {"prompt_tokens": [...], "n": N, "threads": T, "n_ctx": C, "repack": R}.

`repack` false turns off llama.cpp's CPU weight repacking (its `--no-repack`,
`use_extra_bufts` in the model params). With repacking on, the default, x86
builds copy every Q4_K/Q4_0 tensor into anonymous memory in an interleaved
layout at load, so the file is *not* served from the page cache: a model
larger than the memory limit is killed while loading. Off, the weights stay
in the mapped file and the page cache thrashes under the limit, which is how
llama.cpp runs on an ARM phone (its ARM build does not repack these quant
types).
The generation is greedy over the same prompt token ids moe-pipe uses (argmax
of the logits after each eval, end-of-generation ignored, as moe-pipe's
`--ignore-eos`), so the two engines' tokens can be compared. OUT.csv gets one
line per token as it is produced (`step,wall_ms,token`, step 1 = the prompt
eval and its first token), flushed, so a run killed by the memory limit
still leaves what it did; the last line `# done load_s=... majflt=...
peak_rss=...` marks a run that finished.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def run(model: str, request: dict, out: Path) -> int:
    t0 = time.perf_counter()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python; it builds llama.cpp, 7-20 min)", file=sys.stderr)
        return 3
    prompt = [int(t) for t in request["prompt_tokens"]]
    set_repack(bool(request.get("repack", True)))
    n, threads = int(request["n"]), int(request["threads"])
    llm = llama_cpp.Llama(
        model,
        n_ctx=int(request.get("n_ctx") or len(prompt) + n + 8),
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    with open(out, "w") as f:
        f.write("step,wall_ms,token\n")
        f.flush()
        llm.reset()
        batch = prompt
        for step in range(1, n + 1):
            t = time.perf_counter()
            llm.eval(batch)
            token = int(last_logits(llama_cpp, llm).argmax())
            f.write(f"{step},{(time.perf_counter() - t) * 1e3:.3f},{token}\n")
            f.flush()
            batch = [token]
        ru = resource.getrusage(resource.RUSAGE_SELF)
        f.write(f"# done load_s={load_s:.3f} majflt={ru.ru_majflt} peak_rss={ru.ru_maxrss * 1024}\n")
    llm.close()
    return 0


def set_repack(on: bool) -> None:
    """The wrapper has no keyword for `use_extra_bufts`; it builds its model
    params from `llama_model_default_params`, so that is where it is set."""
    from llama_cpp import llama as wrapper

    default = wrapper.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = on
        return p

    wrapper.llama_cpp.llama_model_default_params = params


def last_logits(llama_cpp, llm):
    """The logits of the last evaluated token, straight from llama.cpp (the
    wrapper's `scores` array is filled only with logits_all=True, which would
    also run the output head on every prompt token)."""
    import numpy as np

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def read_result(path: Path) -> dict:
    """What a (possibly killed) peer run left: per-token walls and tokens, and
    the closing figures if it finished."""
    walls, tokens, done = [], [], {}
    if path.exists():
        for line in path.read_text().splitlines()[1:]:
            if line.startswith("# done"):
                done = {k: float(v) for k, v in (kv.split("=") for kv in line.split()[2:])}
                continue
            parts = line.split(",")
            if len(parts) == 3:
                walls.append(float(parts[1]))
                tokens.append(int(parts[2]))
    return {"wall_ms": walls, "tokens": tokens, "finished": bool(done), **done}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return run(argv[0], json.loads(Path(argv[1]).read_text()), Path(argv[2]))


if __name__ == "__main__":
    sys.exit(main())
