"""The streaming pipeline: the same tokens as the resident reference under every
setting, a cache that keeps its budget, telemetry that adds up, and nothing
left behind when a process is killed."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import psutil
import pytest

from moe_pipe.procs.pipeline import start_pipeline
from moe_pipe.shared.config import DEFAULT_POLICY, load_config
from moe_pipe.shared.errors import ConfigError
from moe_pipe.shared.experts import directio
from moe_pipe.shared.experts.budget import KVLoan, PromptLoan
from moe_pipe.shared.experts.policies import LIVE_POLICIES
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.base import ModelOptions
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.model.weights import FileExperts
from moe_pipe.shared.telemetry import CSV_COLUMNS, read_csv
from moe_pipe.shared.text.generate import GenerationConfig, generate
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.tokenizer import Tokenizer

pytestmark = pytest.mark.integration  # every test starts processes
ARCHES = ["qwen3moe", "gpt-oss", "gemma4"]
# A process's lifecycle (a child killed, Ctrl-C, SIGTERM) does not depend on the family: the
# default tier runs it on the first, the slow tier on every one.
LIFECYCLE = ("test_killing_a_child_ends_the_run_cleanly", "test_ctrl_c_and_sigterm_release_everything")


def slow_case(name: str, params: dict) -> bool:
    """The cases tests/conftest.py moves to the slow tier (see LIFECYCLE)."""
    return name in LIFECYCLE and params.get("tiny") != ARCHES[0]


PROMPT = "The old mill by the river"
N = 10
MiB = 1 << 20


def leftovers(pids: set[int]) -> set[str]:
    """Shared-memory segments and runtime folders owned by `pids` (names carry
    the owner's pid), so runs of other programs on the machine do not count."""
    shm = {p.name for p in Path("/dev/shm").glob("moe-pipe-*") if _owner(p.name) in pids}
    base = Path(f"/tmp/moe-pipe-{os.getuid()}")
    run = {str(p) for p in base.glob("*") if p.name.isdigit() and int(p.name) in pids} if base.exists() else set()
    return shm | run


def _owner(name: str) -> int:
    parts = name.split("-")
    return int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else -1


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    assert not leftovers({os.getpid()}), f"left behind: {leftovers({os.getpid()})}"


# The resident reference stores its KV cache as the engine does (compute.kv_type's default).
ENGINE_KV = ModelOptions(kv_type=load_config(None, {}).compute.kv_type)


@pytest.fixture(scope="module", params=ARCHES)
def tiny(request, tmp_path_factory):
    return with_reference(make_model(request.param, "tiny", tmp_path_factory.mktemp("p") / f"{request.param}.gguf"))


def with_reference(path, top_ks=(None, 1)):
    """(path, prompt ids, the resident reference's greedy tokens at top-k None and 1 (or `top_ks`),
    the cache sizes the budgets are made of): what the pipeline tests compare against."""
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        prompt = tok.encode(PROMPT)
        reference = {
            k: generate(load_model(mf, top_k=k, options=ENGINE_KV), tok, prompt, SamplingParams(), GenerationConfig(max_tokens=N)).tokens
            for k in top_ks
        }
        sizes = dict(
            min_mb=mf.layout.min_cache_bytes() / MiB,
            slab=mf.layout.slab_bytes,
            all_mb=mf.spec.n_layer * mf.spec.n_expert * mf.layout.slab_bytes / MiB,
            min1_mb=mf.layout.min_cache_bytes(1) / MiB,
        )
    return path, prompt, reference, sizes


def run_pipeline(path, prompt, **overrides):
    cfg = load_config(None, {"model.path": str(path), **overrides})
    with start_pipeline(cfg, path) as pipe:
        done = pipe.generate(prompt, {"temperature": 0.0}, N)
        return list(done.tokens), dict(done.timings), pipe.resolved


# budget × overlap × io_threads × dense × top_k: a covering set here, the full product behind -m slow
COVER = [
    ("min", True, 1, "anon", None, False),
    ("min", False, 4, "warm", None, True),
    ("mid", True, 4, "mmap", None, True),
    ("mid", False, 1, "anon", 1, False),
    ("all", True, 4, "anon", None, False),
    ("all", False, 1, "mmap", 1, True),
    ("min", True, 4, "warm", 1, True),
]
FULL = list(itertools.product(["min", "mid", "all"], [True, False], [1, 4], ["anon", "warm", "mmap"], [None, 1], [False, True]))


def _budget_mb(sizes, which, top_k):
    lo = sizes["min1_mb"] if top_k == 1 else sizes["min_mb"]
    return {"min": lo, "mid": (lo + sizes["all_mb"]) / 2, "all": sizes["all_mb"]}[which] + 1e-6


def _check_identity(tiny, budget, overlap, io_threads, dense, top_k, prefetch):
    path, prompt, reference, sizes = tiny
    extra = {"compute.n_expert_used": top_k} if top_k else {}
    tokens, _, resolved = run_pipeline(
        path,
        prompt,
        **{
            "cache.cache_mb": _budget_mb(sizes, budget, top_k),
            "compute.overlap": overlap,
            "io.io_threads": io_threads,
            "io.dense_weights": dense,
            "compute.prefetch": "next-layer" if prefetch else "none",
            **extra,
        },
    )
    assert tokens == reference[top_k], f"{budget} overlap={overlap} io={io_threads} dense={dense} top_k={top_k} prefetch={prefetch}"
    assert resolved.n_slabs * resolved.slab_bytes <= _budget_mb(sizes, budget, top_k) * MiB


@pytest.mark.parametrize("budget,overlap,io_threads,dense,top_k,prefetch", COVER)
def test_pipeline_tokens_equal_resident_reference(tiny, budget, overlap, io_threads, dense, top_k, prefetch):
    _check_identity(tiny, budget, overlap, io_threads, dense, top_k, prefetch)


@pytest.mark.slow
@pytest.mark.parametrize("budget,overlap,io_threads,dense,top_k,prefetch", FULL)
def test_pipeline_tokens_equal_reference_full_product(tiny, budget, overlap, io_threads, dense, top_k, prefetch):
    _check_identity(tiny, budget, overlap, io_threads, dense, top_k, prefetch)


@pytest.mark.slow  # ~35 s over the three families; io.populate is on in every other pipeline test
@pytest.mark.parametrize("dense", ["anon", "mmap"])
def test_populating_ahead_or_not_gives_the_same_tokens(tiny, dense):
    """io.populate only moves page faults off the reads' path: tokens are the reference's either way."""
    path, prompt, reference, sizes = tiny
    for populate in (True, False):
        tokens, _, _ = run_pipeline(
            path, prompt, **{"cache.cache_mb": _budget_mb(sizes, "min", None), "io.dense_weights": dense, "io.populate": populate}
        )
        assert tokens == reference[None], f"populate={populate} dense={dense}"


# The default policy and lru in the default tier (each run is a whole pipeline on every family); the
# others behind -m slow.
@pytest.mark.parametrize(
    "policy", [pytest.param(p, marks=[] if p in (DEFAULT_POLICY, "lru") else [pytest.mark.slow]) for p in LIVE_POLICIES]
)
def test_every_live_policy_keeps_the_tokens(tiny, policy):
    """Eviction decides what is read, never what is computed: every policy the
    reader can run gives the reference's tokens, at the smallest budget
    (where it evicts most)."""
    path, prompt, reference, sizes = tiny
    tokens, timings, _ = run_pipeline(path, prompt, **{"cache.cache_mb": _budget_mb(sizes, "min", None), "cache.policy": policy})
    assert tokens == reference[None]


def test_budget_below_one_token_is_refused_with_the_number(tiny):
    path, prompt, _, sizes = tiny
    with pytest.raises(ConfigError, match="at least"):
        run_pipeline(path, prompt, **{"cache.cache_mb": sizes["min_mb"] * 0.5})


def independent_lru(path, prompt, n_slabs):
    """Hits and misses per step from the routing alone: the resident model's expert
    requests replayed through a plain LRU of n_slabs."""
    accesses: list[list[tuple[int, int]]] = []

    class Recording(FileExperts):
        def experts(self, layer, ids):
            ids = list(ids)
            accesses[-1].append([(layer, e) for e in ids])
            return super().experts(layer, ids)

    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        model = load_model(mf, experts=Recording(mf), options=ENGINE_KV)

        class Steps:  # one access list per model call = per CSV step
            def new_cache(self, n):
                return model.new_cache(n)

            def prefill(self, t, c, batch=64):
                accesses.append([])
                return model.prefill(t, c, batch=batch)

            def decode_one(self, t, c):
                accesses.append([])
                return model.decode_one(t, c)

        generate(Steps(), tok, prompt, SamplingParams(), GenerationConfig(max_tokens=N))
        bytes_of = [mf.layout.expert_bytes(i) for i in range(mf.spec.n_layer)]
    # The live cache's order within one layer's request: resident experts are
    # refreshed (and pinned) first, then the misses are admitted in routing order.
    # Messages to the reader: one Fetch per group with a miss, one Release per token.
    lru, out = OrderedDict(), []
    for step in accesses:
        hits = misses = read = 0
        messages = 1
        for group in step:
            present = [k for k in group if k in lru]
            for key in present:
                lru.move_to_end(key)
            hits += len(present)
            messages += len(present) < len(group)
            for key in (k for k in group if k not in present):
                misses += 1
                read += bytes_of[key[0]]
                lru[key] = None
                if len(lru) > n_slabs:
                    lru.popitem(last=False)
        out.append((hits, misses, read, messages))
    return out


def test_csv_schema_and_counts_agree_with_independent_lru(tiny, tmp_path):
    path, prompt, _, sizes = tiny
    csv = tmp_path / "run.csv"
    _, _, resolved = run_pipeline(
        path,
        prompt,
        # no prompt read-ahead: the independent LRU models demand reads only
        # and every miss through the reader (io.compute_reads 0): it models the reader's admissions
        **{
            "cache.cache_mb": _budget_mb(sizes, "mid", None),
            "telemetry.csv": str(csv),
            "cache.policy": "lru",
            "compute.prefetch": "none",
            "io.compute_reads": 0,
        },
    )
    preamble, records = read_csv(csv)
    header = next(line for line in csv.read_text().splitlines() if not line.startswith("#"))
    assert header.split(",")[: len(CSV_COLUMNS)] == list(CSV_COLUMNS)
    assert preamble and all(line.startswith("#") for line in csv.read_text().splitlines()[: len(preamble)])
    want = independent_lru(path, prompt, resolved.n_slabs)
    assert [(r.hits, r.misses, r.read_bytes, r.messages) for r in records] == want
    assert any(w[3] == 1 for w in want)  # a token whose experts were all cached sent only its Release
    total_hits = np.cumsum([h for h, _, _, _ in want])
    total = np.cumsum([h + m for h, m, _, _ in want])
    np.testing.assert_allclose([r.cache_hit_pct for r in records], 100 * total_hits / total, atol=1e-3)  # CSV keeps 3 decimals
    assert len(records) == N
    assert csv.with_suffix(".jsonl").exists()


def test_compute_reads_its_own_misses_into_lent_slabs(tiny, tmp_path):
    """io.compute_reads: the slabs lent to compute take the decoded tokens' misses it reads
    itself. The tokens are the resident reference's; each step looks up the same experts as
    with every miss through the reader; a miss is one expert's bytes either way; and the
    tokens whose misses compute read send fewer messages (no Fetch for their layers)."""
    path, prompt, reference, sizes = tiny
    runs = {}
    for reads in (0, 32):
        csv = tmp_path / f"reads{reads}.csv"
        over = {"cache.cache_mb": _budget_mb(sizes, "mid", None), "telemetry.csv": str(csv), "io.compute_reads": reads}
        # no guesses: their reads land unasked and are counted with a later answer's bytes
        tokens, _, resolved = run_pipeline(path, prompt, **over, **{"compute.prefetch": "none"})
        assert tokens == reference[None]
        runs[reads] = read_csv(csv)[1]
    assert resolved.n_slabs > 8  # so that a slab is lent while the rest holds a layer's experts
    with open_model(path) as mf:
        expert_bytes = [mf.layout.expert_bytes(i) for i in range(mf.spec.n_layer)]
    decode = slice(1, None)
    for records in runs.values():
        assert all(r.misses * min(expert_bytes) <= r.read_bytes <= r.misses * max(expert_bytes) for r in records[decode])
    assert [r.hits + r.misses for r in runs[0]] == [r.hits + r.misses for r in runs[32]]
    assert sum(r.misses for r in runs[32][decode]) > 0
    assert sum(r.messages for r in runs[32][decode]) < sum(r.messages for r in runs[0][decode])


def test_a_read_compute_failed_goes_to_the_reader_and_keeps_the_tokens(tiny, tmp_path, monkeypatch):
    """Every read compute makes itself fails (an injected EIO): each of those misses is asked
    of the reader instead (a Fetch), which reads it, so the tokens are the reference's and
    the decoded tokens send their Fetches as they would with io.compute_reads 0."""
    path, prompt, reference, sizes = tiny
    monkeypatch.setenv(directio.FAULT_ENV, "compute:1+")
    csv = tmp_path / "faulty.csv"
    over = {"cache.cache_mb": _budget_mb(sizes, "mid", None), "telemetry.csv": str(csv), "io.compute_reads": 32}
    tokens, _, _ = run_pipeline(path, prompt, **over)
    assert tokens == reference[None]
    decoded = read_csv(csv)[1][1:]
    assert sum(r.misses for r in decoded) > 0
    assert all(r.messages > 1 for r in decoded if r.misses)  # no token's misses were read by compute alone


def _turns(path: Path, over: dict, prompts, csv: Path):
    """Greedy 4-token replies to `prompts`, one after another in one pipeline of `over`'s settings
    (telemetry to `csv`): their tokens, and what start-up resolved."""
    cfg = load_config(None, {"model.path": str(path), **over, "telemetry.csv": str(csv)})
    with start_pipeline(cfg, path) as pipe:
        return [list(pipe.generate(p, {"temperature": 0.0}, 4).tokens) for p in prompts], pipe.resolved


def test_the_kv_caches_loan_goes_back_as_the_context_grows_and_keeps_the_tokens(tiny, tmp_path):
    """cache.lend_kv: an auto budget (held small by its ceiling) also holds the KV rows a
    short context leaves unused; each pass that would write into them takes slabs back
    first (`cache_slabs` falls pass by pass, to the budget alone at the end), and every
    token is the one a run without the loan gives."""
    path, prompt, _, sizes = tiny
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
    first = tok.encode(" ".join(["the mill by the river"] * 120))[:600]
    second = first + tok.encode(" ".join(["and every spring the water rose"] * 120))[:700]
    over = {"cache.cache_mb": "auto", "cache.cache_ceil_mb": sizes["min_mb"] + 4 * sizes["slab"] / MiB, "compute.ctx_size": 4096}

    lent_tokens, lent = _turns(path, {**over, "cache.lend_kv": True}, (first, second), tmp_path / "lent.csv")
    own_tokens, own = _turns(path, {**over, "cache.lend_kv": False}, (first, second), tmp_path / "own.csv")
    assert lent_tokens == own_tokens
    assert own.lent_slabs == 0 and lent.lent_slabs > 0 and lent.n_slabs == own.n_slabs + lent.lent_slabs
    with open_model(path) as mf:
        loan = KVLoan.of(lent.n_slabs, lent.lent_slabs, lent.slab_bytes, mf.spec, "f16")
    records = read_csv(tmp_path / "lent.csv")[1]
    held = [600, 601, 602, 603, len(second), len(second) + 1, len(second) + 2, len(second) + 3]  # the context at each pass
    assert [r.pass_tokens for r in records] == [600, 1, 1, 1, len(second) - len(first), 1, 1, 1]  # the second reuses the first
    slabs = [r.cache_slabs for r in records]
    assert all(s <= loan.slabs_at(n) for s, n in zip(slabs, held))  # taken back before the pass wrote there
    after_first = loan.slabs_at(600 + loan.ahead)  # asked for with room ahead
    after_second = loan.slabs_at(len(second) + loan.ahead) if loan.slabs_at(len(second)) < after_first else after_first
    assert slabs == [after_first] * 4 + [after_second] * 4 and after_first < lent.n_slabs
    assert {r.cache_slabs for r in read_csv(tmp_path / "own.csv")[1]} == {own.n_slabs}


def test_the_prompts_loan_is_the_caches_between_long_passes_and_keeps_the_tokens(tiny, tmp_path):
    """cache.lend_prompt: with an auto budget whose reserve is the engine's own estimate, the
    cache also holds what a long prompt chunk's activations were set aside: a pass of many
    rows gives those slabs back before it runs, every decoded token's pass has them again,
    and every token is the one a run without the loan gives."""
    path, prompt, _, sizes = tiny
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        spec = mf.spec
    long = tok.encode(" ".join(["the mill by the river"] * 120))[:600]
    over = {
        "cache.cache_mb": "auto",
        "cache.cache_ceil_mb": sizes["min_mb"] + 4 * sizes["slab"] / MiB,
        "cache.reserve_mb": 0,  # the engine's estimate is the reserve: the prompt's allowance is in it
        "cache.lend_kv": False,
        "compute.ctx_size": 1024,
    }

    lent_tokens, lent = _turns(path, {**over, "cache.lend_prompt": True}, (long, prompt), tmp_path / "lent.csv")
    own_tokens, own = _turns(path, {**over, "cache.lend_prompt": False}, (long, prompt), tmp_path / "own.csv")
    assert lent_tokens == own_tokens
    assert own.prompt_lent_slabs == 0 and lent.prompt_lent_slabs > 0 and lent.n_slabs == own.n_slabs + lent.prompt_lent_slabs
    loan = PromptLoan(lent.prompt_lent_slabs, lent.slab_bytes, spec, spec.n_expert_used)
    assert loan.slabs_for(len(long)) > 0 and loan.slabs_for(1) == loan.slabs_for(len(prompt)) == 0
    records = read_csv(tmp_path / "lent.csv")[1]
    assert records[0].pass_tokens == len(long) and [r.pass_tokens for r in records[1:4]] == [1, 1, 1] and len(records) == 8
    # the long prompt's pass held the cache below its size; every other pass held all of it
    assert [r.cache_slabs for r in records] == [lent.n_slabs - loan.slabs_for(len(long))] + [lent.n_slabs] * 7
    assert {r.cache_slabs for r in read_csv(tmp_path / "own.csv")[1]} == {own.n_slabs}


def test_prefetch_is_reported(tiny, tmp_path):
    path, prompt, _, sizes = tiny
    csv = tmp_path / "run.csv"
    run_pipeline(
        path, prompt, **{"cache.cache_mb": _budget_mb(sizes, "min", None), "compute.prefetch": "next-layer", "telemetry.csv": str(csv)}
    )
    _, records = read_csv(csv)
    decode = records[1:]
    # A guess is sent only with a layer that misses, and only for experts not cached:
    # at the smallest budget most layers miss, so guesses go out, and each is scored.
    assert sum(r.prefetch_issued for r in decode) > 0, [r.prefetch_issued for r in decode]
    assert all(0 <= r.prefetch_used <= r.prefetch_issued for r in records)
    assert records[0].prefetch_issued > 0  # the prompt's batch guesses too (into an empty cache)


LONG_PROMPT = [(7 * i + 3) % 1500 + 5 for i in range(2000)]
LONG_CHUNK = 8  # compute.prefill_chunk: 250 chunks, so a Stop lands inside one


@pytest.fixture(scope="module")
def long_prompt_reference(tmp_path_factory):
    """(path, min budget MiB, the resident reference's greedy tokens for LONG_PROMPT)."""
    path = make_model("qwen3moe", "tiny", tmp_path_factory.mktemp("long") / "qwen3moe.gguf")
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        reference = generate(load_model(mf, options=ENGINE_KV), tok, LONG_PROMPT, SamplingParams(), GenerationConfig(max_tokens=N)).tokens
        return path, mf.layout.min_cache_bytes() / MiB + 1e-6, reference


def test_a_stop_mid_prompt_ends_it_within_a_second_and_the_next_request_reuses_what_is_held(long_prompt_reference):
    """Through the real processes, at the smallest cache (every layer misses, so the
    Stop can land while a Fetch's reads are under way): the prompt's progress comes
    in order, a Cancel ends the prompt within a second, and the same prompt again
    reuses the chunks done and gives the resident reference's tokens."""
    from moe_pipe.shared.errors import PipelineError
    from moe_pipe.shared.wire import ipc

    path, min_mb, reference = long_prompt_reference
    cfg = load_config(None, {"model.path": str(path), "compute.prefill_chunk": LONG_CHUNK, "cache.cache_mb": min_mb})
    with start_pipeline(cfg, path) as pipe:
        seen: list = []
        cancelled_at: list[float] = []

        def stop_it(p) -> None:
            seen.append(p)
            if not cancelled_at and p.processed >= 2 * LONG_CHUNK:  # some chunks are done, most are not
                ipc.send(pipe.links["requests"], pipe.client.cancel())
                cancelled_at.append(time.monotonic())

        with pytest.raises(PipelineError, match="cancelled"):
            pipe.generate(LONG_PROMPT, {"temperature": 0.0}, N, on_prompt=stop_it)
        assert time.monotonic() - cancelled_at[0] < 1.0
        assert (seen[0].total, seen[0].cache, seen[0].processed) == (len(LONG_PROMPT), 0, 0)
        assert [p.processed for p in seen] == sorted({p.processed for p in seen}) and seen[-1].processed < len(LONG_PROMPT)

        again: list = []
        done = pipe.generate(LONG_PROMPT, {"temperature": 0.0}, N, on_prompt=again.append)
        held = done.timings["prompt_cached"]
        assert 0 < held < len(LONG_PROMPT) and held % LONG_CHUNK == 0  # whole chunks: the one stopped is not held
        assert (again[0].cache, again[0].processed, again[-1].processed) == (held, held, len(LONG_PROMPT))
        assert list(done.tokens) == reference


@pytest.mark.slow  # ~30 s over the three families; the streamed pipeline's tokens are the resident reference's in the tests above
def test_run_cli_pipeline_equals_no_stream(tiny):
    path = tiny[0]
    outs = []
    for extra in ([], ["--no-stream"]):
        r = subprocess.run(
            [sys.executable, "-m", "moe_pipe.cli.main", "run", str(path), "-p", PROMPT, "-n", "8", "--output-format", "json", *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    # (the subprocess's own segments carry its pid; none may outlive it)
    assert not [p for p in Path("/dev/shm").glob("moe-pipe-*") if not psutil.pid_exists(_owner(p.name))]
    assert outs[0]["tokens"] == outs[1]["tokens"] and outs[0]["text"] == outs[1]["text"]


@pytest.mark.parametrize("victim", ["moe-reader", "moe-compute"])
def test_killing_a_child_ends_the_run_cleanly(tiny, victim):
    path = tiny[0]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_pipe.cli.main",
            "run",
            str(path),
            "-p",
            PROMPT,
            "-n",
            "100000",
            "--set",
            "compute.ctx_size=200000",
            "--ignore-eos",
            "--output-format",
            "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        target = None
        while time.monotonic() < deadline and target is None:
            kids = psutil.Process(proc.pid).children(recursive=True)
            target = next((k for k in kids if _name(k) == victim), None)
            time.sleep(0.1)
        assert target is not None, "child never appeared"
        time.sleep(1.0)  # mid-run
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(target.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert "killed by SIGKILL" in lines[-1] or "died" in lines[-1], err
    # Every process the run started is gone (multiprocessing's resource tracker
    # leaves a moment after its last client closes its pipe).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(c) for c in children):
        time.sleep(0.1)
    assert not [c.pid for c in children if _running(c)]
    assert not leftovers({proc.pid} | {c.pid for c in children})


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_release_everything(tiny, sig, code):
    path = tiny[0]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_pipe.cli.main",
            "run",
            str(path),
            "-p",
            PROMPT,
            "-n",
            "100000",
            "--ignore-eos",
            "--set",
            "compute.ctx_size=200000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(_name(k) == "moe-compute" for k in psutil.Process(proc.pid).children()):
            time.sleep(0.1)
        time.sleep(1.5)  # generating
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(c) for c in children):
        time.sleep(0.1)
    assert not [c.pid for c in children if _running(c)]
    assert not leftovers({proc.pid})


class DeadProcess:
    """A child that died as it started (what a real one whose start failed looks like)."""

    pid = 4242
    exitcode = 1

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        raise AssertionError("a dead child is not signalled")

    kill = terminate


def test_a_child_that_dies_at_start_fails_the_start_with_its_error_and_leaves_nothing():
    """start_pipeline with the real telemetry and reader and a compute that
    died at once: the error names compute and its last error line, and the
    real children, sockets, arenas and runtime dir are all gone."""
    from moe_pipe.procs.children import SpawnStarter
    from moe_pipe.procs.lifecycle import error_file
    from moe_pipe.shared.errors import PipelineError
    from moe_pipe.shared.makemodel.default_model import default_model_path

    started: dict = {}

    def starter(launch):
        real = SpawnStarter(launch)

        def start(name, pids):
            if name == "compute":
                assert pids == {n: p.pid for n, p in started.items()}  # it is given its reader's pid
                error_file(launch.res.rt.path, name).write_text("GGUFError: the model is broken\n")
                return DeadProcess()
            started[name] = real(name, pids)
            return started[name]

        return start

    cfg = load_config(None, {"model.path": str(default_model_path())})
    with pytest.raises(PipelineError, match=r"^the compute process exited with code 1 \(GGUFError: the model is broken\); the run"):
        start_pipeline(cfg, default_model_path(), starter=starter)
    assert list(started) == ["telemetry", "reader"]
    assert all(not p.is_alive() and p.exitcode is not None for p in started.values())
