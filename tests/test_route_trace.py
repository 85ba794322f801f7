"""Route traces recorded by the engine, replayed by the simulator, and used
for a warm start: the engine and the simulator count the same hits."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from moe_pipe.procs.pipeline import start_pipeline
from moe_pipe.shared.analysis.replay import MIB, Replayer, slab_bytes
from moe_pipe.shared.config import load_config
from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.default_model import default_model_path
from moe_pipe.shared.model.trace import read_trace
from moe_pipe.shared.telemetry import read_csv
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.tokenizer import Tokenizer

PROMPTS = ["The old mill by the river", "Once upon a time there was", "A quiet night in the city of"]
N = 12


def _prompts():
    with open_model(default_model_path()) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        return [tok.encode(p) for p in PROMPTS], mf.spec


def _serve(tmp_path: Path, **over) -> tuple[list, int]:
    """Run every prompt through one pipeline; (CSV records, n_slabs)."""
    prompts, _ = _prompts()
    cfg = load_config(None, {"model.path": str(default_model_path()), "telemetry.csv": str(tmp_path / "run.csv"), **over})
    with start_pipeline(cfg, default_model_path()) as pipe:
        dones = [pipe.generate(p, asdict(SamplingParams()), N, ignore_eos=True) for p in prompts]
        n_slabs = pipe.resolved.n_slabs
    return dones, n_slabs


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_replaying_the_engines_trace_gives_the_engines_hit_rate(tmp_path, policy):
    trace_path = tmp_path / "run.trace"
    # no prompt read-ahead: the replay models demand reads only; and every miss through the reader:
    # the replay models its cache of n_slabs (slabs lent to compute are not the cache's while lent)
    over = {
        "cache.cache_mb": 1.2,
        "cache.policy": policy,
        "telemetry.route_trace": str(trace_path),
        "compute.prefetch": "none",
        "io.compute_reads": 0,
    }
    dones, n_slabs = _serve(tmp_path, **over)
    trace = read_trace(trace_path)
    _, spec = _prompts()
    assert sorted(set(trace.turn.tolist())) == [0, 1, 2]
    decode_rows = (trace.phase == 1).sum()
    assert decode_rows == len(PROMPTS) * (N - 1) * spec.n_layer * spec.n_expert_used
    # The engine's own count, from its per-token CSV (the last request's records:
    # the CSV holds the run, each request restarting the step count).
    _, recs = read_csv(tmp_path / "run.csv")
    engine_hits = sum(r.hits for r in recs)
    engine_lookups = sum(r.hits + r.misses for r in recs)
    budget_mb = n_slabs * slab_bytes(trace) / MIB  # exactly the engine's slab count
    result = Replayer(trace).run(budget_mb, policy)
    assert result.n_slabs == n_slabs
    assert sum(result.lookups) == engine_lookups
    assert sum(result.hits) == engine_hits


@pytest.mark.integration
def test_warm_start_from_a_trace_beats_a_cold_start(tmp_path):
    trace_path = tmp_path / "old.trace"
    _serve(tmp_path, **{"cache.cache_mb": 64, "telemetry.route_trace": str(trace_path)})
    prompts, _ = _prompts()
    hit = {}
    for label, over in (("cold", {}), ("warm", {"cache.warm_from": str(trace_path)})):
        cfg = load_config(None, {"model.path": str(default_model_path()), "cache.cache_mb": 64, **over})
        with start_pipeline(cfg, default_model_path()) as pipe:
            import time

            time.sleep(1.0)  # the warm reads run in the reader's lanes while it serves
            hit[label] = pipe.generate(prompts[0], asdict(SamplingParams()), N, ignore_eos=True).timings["final_hit_pct"]
    assert hit["warm"] > hit["cold"]
    assert hit["warm"] == 100.0  # the tiny model's experts all fit: the trace named every one used


def test_a_warm_start_trace_of_another_model_is_refused(tmp_path):
    bad = tmp_path / "bad.trace"
    bad.write_text(
        "# route_trace v1\n# model=x arch=qwen3moe n_layer=1 n_expert=4 n_expert_used=2\n"
        "# layer=0 expert_bytes=10 dense_bytes=10\nturn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n"
    )
    cfg = load_config(None, {"model.path": str(default_model_path()), "cache.warm_from": str(bad)})
    with pytest.raises(UserError, match="cannot warm"):
        start_pipeline(cfg, default_model_path())
