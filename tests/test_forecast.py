"""`moe-pipe doctor`: the fit's header footprint, memory verdicts and hit rates on
header-only full-width models, the per-token arithmetic on hand-made figures, the
measuring part with tiny durations, and the CLI's JSON contract."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moe_pipe.cli.main import main
from moe_pipe.shared.analysis import fit
from moe_pipe.shared.analysis import forecast as fc
from moe_pipe.shared.analysis.standin import StepTime
from moe_pipe.shared.config import load_config
from moe_pipe.shared.experts.budget import MemoryProbe
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.default_model import default_model_path
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.trace import read_trace

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
# A roomy fake host: verdicts must not depend on this machine's free RAM.
HOST = MemoryProbe(64 << 30)


@pytest.fixture(scope="module")
def qwen8(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's width cut to 8 layers (the benchmark model's shape), header only."""
    return make_model("qwen3moe", "qwen30b-shape", tmp_path_factory.mktemp("q") / "q8.gguf", layers=8, sparse=True)


@pytest.fixture(scope="module")
def qwen48(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's full shape (18.5 GB of holes)."""
    return make_model("qwen3moe", "qwen30b-shape", tmp_path_factory.mktemp("q") / "q48.gguf", sparse=True)


def facts_of(path, made: bool = False, **overrides) -> fit.ModelFootprint:
    """The footprint of a made file, as if it were the real model it has the shape of (its
    name not make-model's: the phone traces apply), unless `made`."""
    with open_model(path) as mf:
        f = fit.model_footprint(mf, load_config(None, overrides))
    return f if made else replace(f, name="a real model")


def fit_at(path, mem_limit_mb, **overrides) -> fit.MemoryFit:
    cfg = load_config(None, overrides)
    with open_model(path) as mf:
        return fit.memory_fit(fit.model_footprint(mf, cfg), cfg, fit.limited_probe(mem_limit_mb, HOST))


# ---------------------------------------------------------------- the header


def test_facts_from_the_header_match_the_layout():
    from moe_pipe.shared.gguf.spec import kv_cache_bytes

    path = default_model_path()
    with open_model(path) as mf:
        f = fit.model_footprint(mf, load_config(None, {"compute.ctx_size": 1024}))
        lay, spec = mf.layout, mf.spec
        assert f.floor_bytes == lay.min_cache_bytes()
        assert f.routed_bytes_per_token == lay.routed_bytes_per_token()
        assert f.active_bytes_per_token == lay.dense_bytes + lay.routed_bytes_per_token()
        assert f.expert_bytes_total == lay.total_expert_bytes
        assert f.kv_bytes == kv_cache_bytes(spec, 1024, "f16")  # the default kv_type
        # every expert product of a token, k per layer; the dense products but not the embedding lookup
        experts = sum(spec.n_expert_used * p.shape[0] * p.shape[1] for l in lay.layers for p in l.parts)
        dense = sum(
            t.shape[0] * t.shape[1]
            for t in mf.gguf.tensors.values()
            if len(t.shape) == 2 and t.name not in lay.expert_tensor_names and t.name != "token_embd.weight"
        )
    assert sum(c.weights_per_token for c in f.classes if c.role == "expert") == experts
    assert sum(c.weights_per_token for c in f.classes if c.role == "dense") == dense


def test_the_affordable_context_is_the_longest_whose_kv_takes_at_most_an_eighth():
    from moe_pipe.shared.gguf.spec import kv_cache_bytes

    with open_model(default_model_path()) as mf:
        spec = replace(mf.spec, n_ctx_train=40960)

    def kv(n: int) -> int:
        return kv_cache_bytes(spec, n, "f16")

    assert fit.affordable_context(spec, "f16", 8 * kv(16384)) == 16384
    assert fit.affordable_context(spec, "f16", 8 * kv(16384) - 1) == 8192
    assert fit.affordable_context(spec, "f16", 1 << 40) == 40960  # the trained context is the last step
    assert fit.affordable_context(spec, "f16", 1 << 40, most=fit.RECIPE_CONTEXT) == 32768
    assert fit.affordable_context(spec, "f16", 8 * kv(4096) - 1) == 0
    assert fit.affordable_context(replace(spec, n_ctx_train=2048), "f16", 1 << 40) == 2048


def test_doctor_says_the_context_and_what_this_memory_affords():
    from moe_pipe.cli.doctor_cmd import _context

    f = {"ctx_size": 32768, "ctx_train": 262144, "kv_bytes": 940 * MiB, "available_bytes": 10673 * MiB, "n_layer": 30}
    f |= {"kv_ring_layers": 25, "kv_ring_rows": 1535, "ctx_affordable": 32768}
    text = _context(f)
    assert text.startswith("32,768 tokens, KV 940.0 MiB (8.8 % of the memory here); 25 of 30 layers slide and keep 1,535 positions")
    assert text.endswith("this memory affords up to 32,768 (KV at most 1/8 of it)")
    assert _context(f | {"ctx_affordable": 8192}).endswith(
        "longer than this memory affords: up to 8,192 keeps the KV at most 1/8 of it (-c 8192)"
    )
    assert _context(f | {"ctx_train": 4096}).endswith("longer than the model was trained for (4,096)")


def test_n_expert_used_override_scales_the_floor(qwen8):
    f8, f4 = facts_of(qwen8), facts_of(qwen8, **{"compute.n_expert_used": 4})
    assert (f8.top_k, f4.top_k) == (8, 4)
    assert f4.floor_bytes * 2 == f8.floor_bytes == 8 * 8 * f8.slab_bytes


def test_a_trace_driven_run_is_forecast_at_the_traces_k(qwen8):
    """--route-replay routes the trace's k experts a layer (Qwen's phone trace: 6), not the model's 8."""
    trace = fit.TRACE_DIR / "qwen.route.csv"
    f8, ft = facts_of(qwen8), facts_of(qwen8, **{"compute.route_replay": str(trace)})
    assert (f8.top_k, ft.top_k) == (8, 6)
    assert 6 * f8.routed_bytes_per_token == 8 * ft.routed_bytes_per_token


# ---------------------------------------------------------------- memory


def test_refuses_with_the_limit_that_works_and_fits_at_it(qwen8):
    no = fit_at(qwen8, 1024)
    f = facts_of(qwen8)
    assert not no.fits and not no.resident and "does not fit" in no.refusal
    # dense (anon: resident) + KV + the reserve (reserve_mb, or the processes with a prompt chunk's activations
    # where they need more) + one token's experts
    assert f.engine_bytes > 512 * MiB  # 8 layers of qwen30b-shape width, a 4,096-token chunk: ~600 MiB of activations
    assert no.need_bytes == f.dense_bytes + f.kv_bytes + max(512 * MiB, f.engine_bytes) + f.floor_bytes
    assert no.limit_that_works_mb == -(-no.need_bytes // MiB)
    assert f"{no.limit_that_works_mb:,} MiB" in no.refusal
    yes = fit_at(qwen8, no.limit_that_works_mb)
    assert yes.fits and yes.refusal is None and yes.n_slabs >= f.floor_bytes // f.slab_bytes
    assert not fit_at(qwen8, no.limit_that_works_mb - 1).fits


def test_no_limit_helps_when_the_machine_itself_is_short(qwen8):
    cfg = load_config(None, {})
    with open_model(qwen8) as mf:
        f = fit.model_footprint(mf, cfg)
        verdict = fit.memory_fit(f, cfg, fit.limited_probe(4096, MemoryProbe(1024 * MiB)))
    assert not verdict.fits and verdict.limit_that_works_mb is None and "only 1,024 MiB" in verdict.refusal


def test_resident_when_every_expert_fits_and_streaming_below(qwen8, qwen48):
    assert fit_at(qwen8, None, **{"cache.cache_ceil_mb": 4000}).resident  # 2,790 MiB of experts under a 4000 MiB ceiling
    big = fit_at(qwen48, None, **{"cache.cache_ceil_mb": 4000})
    assert big.fits and not big.resident  # 16.6 GiB of experts: the ceiling keeps it streaming
    assert fit_at(qwen48, None).resident  # the ceiling "auto" off a phone: the 64 GiB host holds them all
    assert not fit_at(qwen8, None, **{"cache.cache_ceil_mb": 100}).fits  # below one token's 187.5 MiB


# ---------------------------------------------------------------- hit rate


def test_hit_rate_comes_from_the_trace_and_rises_with_the_cache(qwen48):
    f = facts_of(qwen48)
    floor = f.floor_bytes // f.slab_bytes
    hits = [fit.hit_rate(f, floor * m, "nextuse") for m in (1, 2, 4)]
    assert all(h.source == "trace" and "qwen.route.csv" in h.note for h in hits)
    pcts = [h.pct for h in hits]
    assert 0 < pcts[0] < pcts[1] < pcts[2] < 100, pcts
    # real routing has locality: better than uniform routing's slabs / experts
    assert all(p > 100 * floor * m / f.all_experts_slabs for p, m in zip(pcts, (1, 2, 4)))
    assert fit.hit_rate(f, f.all_experts_slabs, "nextuse").source == "resident"


def test_the_warm_up_hit_rate_is_a_cold_caches_first_tokens(qwen48):
    """decode_tokens: the trace cut to its prompt and first n decoded tokens, replayed from cold."""
    trace = read_trace(fit.own_trace_path("qwen3moe", 128))
    cut = fit.first_decode_tokens(trace, 49)
    decoded = np.unique(cut.step[cut.phase == 1])
    assert len(decoded) == 49 and decoded[0] == trace.step[trace.phase == 1].min()
    assert (cut.phase == 0).sum() == (trace.phase == 0).sum()  # the whole prompt kept
    f = facts_of(qwen48)
    slabs = 8 * f.floor_bytes // f.slab_bytes
    warm, steady = fit.hit_rate(f, slabs, "nextuse", decode_tokens=49), fit.hit_rate(f, slabs, "nextuse")
    assert warm.source == "trace" and 0 < warm.pct < steady.pct  # a filling cache hits less than a filled one
    assert "first tokens" in warm.note and "last quarter" in steady.note
    # without a trace: uniform routing from cold, below the steady fallback
    g = facts_of(make_model("gpt-oss", "tiny", qwen48.parent / "g.gguf", sparse=True))
    cold = fit.hit_rate(g, g.all_experts_slabs // 4, "nextuse", decode_tokens=49)
    k_over_e = g.top_k / g.n_expert
    want = 100 * sum(min(0.25, 1 - (1 - k_over_e) ** (t - 1)) for t in range(1, 50)) / 49
    assert cold.source == "fallback" and cold.pct == pytest.approx(want) and cold.pct < 25.0


def test_a_shallower_model_replays_the_traces_first_layers(qwen8):
    trace = read_trace(fit.own_trace_path("qwen3moe", 128))
    cut = fit.first_layers(trace, 8)
    assert cut.header.n_layer == 8 and cut.header.expert_bytes == trace.header.expert_bytes[:8]
    assert int(cut.layer.max()) == 7 and len(cut) == int((trace.layer < 8).sum())
    f = facts_of(qwen8)
    h = fit.hit_rate(f, 2 * f.floor_bytes // f.slab_bytes, "lru", trace=trace)
    assert h.source == "trace" and "first 8 of 48" in h.note and 0 < h.pct < 100


def test_fallback_without_a_trace_is_the_cached_fraction(tmp_path):
    f = facts_of(make_model("gpt-oss", "tiny", tmp_path / "g.gguf", sparse=True))
    assert fit.own_trace_path(f.arch, f.n_expert) is None  # 8 experts: no shipped trace
    h = fit.hit_rate(f, f.all_experts_slabs // 4, "nextuse")
    assert h.source == "fallback" and h.pct == pytest.approx(25.0)


def test_an_architecture_without_a_trace_replays_one_with_its_expert_count(qwen48):
    # qwen2moe has no shipped trace; with 128 experts it replays qwen's as a proxy (a real
    # router's reuse), the same figure the qwen trace gives at the same slabs per layer,
    # and says so; steady and warm-up alike.
    qwen = facts_of(qwen48)
    other = replace(qwen, arch="qwen2moe")
    assert fit.own_trace_path("qwen2moe", 128) is None and fit.proxy_trace_path(128).name == "qwen.route.csv"
    slabs = 2 * qwen.floor_bytes // qwen.slab_bytes
    for n in (None, 49):
        own, proxy = fit.hit_rate(qwen, slabs, "nextuse", decode_tokens=n), fit.hit_rate(other, slabs, "nextuse", decode_tokens=n)
        assert proxy.source == "proxy" and "no trace for qwen2moe" in proxy.note and "qwen.route.csv" in proxy.note
        assert proxy.pct == own.pct
    uniform = 100 * slabs / qwen.all_experts_slabs
    assert fit.hit_rate(other, slabs, "nextuse").pct > uniform + 10  # a real router's reuse, not the uniform fallback


def test_gemma4_replays_the_routing_recorded_from_its_benchmark_shape(qwen48):
    # no phone recording of Gemma 4: any gemma4 file replays make-model's gemma26b-shape
    # routing, labelled synthetic, which gives another figure than the Qwen trace would
    gemma = replace(facts_of(qwen48), arch="gemma4", name="Gemma-4-26B-A4B")
    path = fit.own_trace_path("gemma4", 128)
    assert path is not None and path.name in fit.SYNTHETIC_TRACES and path.exists()
    slabs = 2 * gemma.floor_bytes // gemma.slab_bytes
    h = fit.hit_rate(gemma, slabs, "nextuse")
    assert h.source == "synthetic" and "no real gemma4 recording" in h.note and path.name in h.note
    assert h.pct != fit.hit_rate(replace(gemma, arch="qwen3moe"), slabs, "nextuse").pct


def test_a_made_file_replays_its_own_shapes_routing_and_a_real_one_the_phone_trace(qwen48):
    made = facts_of(qwen48, made=True)  # make-model's qwen30b-shape: its routers are make-model's
    assert made.made_preset == "qwen30b-shape"
    slabs = 8 * made.floor_bytes // made.slab_bytes
    h = fit.hit_rate(made, slabs, "nextuse")
    assert h.source == "synthetic" and "a file make-model wrote" in h.note and "made-qwen30b-shape" in h.note
    real = replace(made, name="Qwen3-30B-A3B")
    assert real.made_preset is None
    r = fit.hit_rate(real, slabs, "nextuse")
    assert r.source == "trace" and "qwen.route.csv" in r.note and r.pct != h.pct


# ---------------------------------------------------------------- the arithmetic

CLASSES = (fit.KernelClass("expert", "Q4_K", 768, 2048, 300_000_000), fit.KernelClass("dense", "Q6_K", 151936, 2048, 400_000_000))
RATES = {CLASSES[0].key: 30e9, CLASSES[1].key: 20e9}  # 10 ms + 20 ms of kernels


def test_decode_speed_follows_the_pipeline_layer_by_layer():
    # experts 10 ms, dense 20 + 8 × 0.5 = 24 ms; 8 layers × 4 lookups, 20 % miss: io = 0.2 × 200 MB /
    # 1 GB/s = 40 ms whatever the lanes when every lane count reads at 1 GB/s
    kw = dict(n_layer=8, top_k=4, read_bytes_per_token=200_000_000, overhead_s=0.5e-3, wire_s=1e-3)
    s = fc.decode_speed(CLASSES, RATES, hit_pct=80, read_gbps=1.0, **kw)
    assert s.kernel_s == pytest.approx(0.030)
    assert s.compute_s == pytest.approx(0.034)
    assert s.io_s == pytest.approx(0.040)
    # a layer: P(j misses) of 4 at 0.2; j misses read j × 6.25 MB (6.25 ms), then one expert (0.3125 ms),
    # the hits under the reads, and the trip to the reader; no miss: its experts' 1.25 ms
    p = [math.comb(4, j) * 0.2**j * 0.8 ** (4 - j) for j in range(5)]
    layer = p[0] * 1.25e-3 + sum(p[j] * (max(1.25e-3, j * 6.25e-3 + 0.3125e-3) + 1e-3) for j in range(1, 5))
    assert s.wall_s == pytest.approx(0.024 + 8 * layer)
    assert s.bottleneck == "flash" and s.tok_s == pytest.approx(1 / s.wall_s)
    # the trip to the reader is paid by the layers that miss, not by every layer
    rare = fc.decode_speed(CLASSES, RATES, hit_pct=99, read_gbps=10.0, **kw)
    assert rare.wall_s < 0.024 + 8 * (0.00125 + 0.001)
    # one lane at a time reads slower than four together: a layer's few misses get the few-lane rate
    few = fc.decode_speed(CLASSES, RATES, hit_pct=80, read_gbps={1: 0.5, 2: 0.8, 4: 1.0}, **kw)
    assert few.io_s > s.io_s and few.wall_s > s.wall_s
    assert fc.lane_rate({1: 0.5, 2: 0.8, 4: 1.0}, 3) == 0.8 and fc.lane_rate({1: 0.5, 4: 1.0}, 4) == 1.0


def test_decode_speed_compute_bound_resident_and_memory_bound():
    s = fc.decode_speed(CLASSES, RATES, n_layer=8, top_k=4, hit_pct=100, read_bytes_per_token=200_000_000, read_gbps=1.0, overhead_s=0.5e-3)
    assert s.io_s == 0 and s.overlap_factor == 1.0 and s.wall_s == pytest.approx(0.034)
    assert s.bottleneck == "compute" and s.tok_s == pytest.approx(1 / 0.034)
    s = fc.decode_speed(
        CLASSES, RATES, n_layer=8, top_k=4, hit_pct=95, read_bytes_per_token=200_000_000, read_gbps=2.0, overhead_s=0.5e-3
    )  # io 5 ms < compute 34 ms
    assert s.bottleneck == "compute" and s.wall_s > s.compute_s
    assert (
        fc.decode_speed(CLASSES, RATES, n_layer=8, top_k=4, hit_pct=95, read_bytes_per_token=1, read_gbps=1.0, at_floor=True).bottleneck
        == "memory"
    )


def test_a_timed_step_replaces_the_dense_estimate_and_fill_reads_cost_compute():
    # a stand-in step of 50 ms: dense = 50 − 10 ms of expert kernels + the per-token 0.3 ms
    s = fc.decode_speed(
        CLASSES, RATES, n_layer=8, top_k=4, hit_pct=100, read_bytes_per_token=1, read_gbps=1.0, step_s=0.050, token_s=0.3e-3
    )
    assert s.compute_s == pytest.approx(0.0503) and s.wall_s == pytest.approx(0.0503)
    # a step faster than the dense kernels alone (a quieter minute) is not believed below them
    s = fc.decode_speed(CLASSES, RATES, n_layer=8, top_k=4, hit_pct=100, read_bytes_per_token=1, read_gbps=1.0, step_s=0.005)
    assert s.compute_s == pytest.approx(0.020 + 0.010)
    # reads into fresh slabs: 40 MB a token at 1 s of CPU a GB = 40 ms more of the experts' compute
    plain = fc.decode_speed(CLASSES, RATES, n_layer=8, top_k=4, hit_pct=80, read_bytes_per_token=200_000_000, read_gbps=1.0, step_s=0.05)
    fill = fc.decode_speed(
        CLASSES, RATES, n_layer=8, top_k=4, hit_pct=80, read_bytes_per_token=200_000_000, read_gbps=1.0, step_s=0.05, read_cpu_s_per_gb=1.0
    )
    assert fill.compute_s == pytest.approx(plain.compute_s + 0.040) and fill.wall_s > plain.wall_s


# ---------------------------------------------------------------- measuring (tiny durations)


def test_measure_reads_and_kernels_briefly():
    with open_model(default_model_path()) as mf:
        reads = fc.measure_reads(mf, seconds=0.06)
        f = fit.model_footprint(mf, load_config(None, {}))
    assert reads.source == "measured" and set(reads.gbps) == {1, 2, 4} and all(g > 0 for g in reads.gbps.values())
    assert reads.fresh_gbps is not None and reads.fresh_gbps > 0 and reads.fresh_cpu_s_per_gb >= 0
    rates = fc.measure_kernels(f.classes[:2], [1], seconds=0.02, rotate_bytes=1 * MiB)
    assert set(rates) == {(c.key, 1) for c in f.classes[:2]} and all(r > 0 for r in rates.values())
    with open_model(default_model_path()) as mf:
        tax = fc.measure_read_tax(mf, f.classes[0], 1, 2, seconds=0.08, seed=3)
    assert 0.0 <= tax < math.inf


def test_a_header_only_file_is_not_measured(qwen8):
    with open_model(qwen8) as mf:
        reads = fc.measure_reads(mf, seconds=0.01)
        tax = fc.measure_read_tax(mf, facts_of(qwen8).classes[0], 1, 1, seconds=0.01)
    assert reads.source == "assumed" and reads.gbps[1] == fc.ASSUMED_READ_GBPS
    assert tax == 0.0  # nothing to read: no reads beside the kernel


def test_what_reads_cost_the_compute_is_added_for_every_byte_a_token_reads(qwen8, monkeypatch):
    """The forecast takes the measured loss per GB read into a streaming token's compute:
    its misses' bytes × the tax, and the record says the figure."""
    monkeypatch.setattr(
        fc, "measure_kernels", lambda classes, threads, seconds=2.0, rotate_bytes=0: {(c.key, n): 2e9 * n for c in classes for n in threads}
    )
    monkeypatch.setattr(fc, "time_steps", lambda mf, top_k, points: {p: StepTime(0.01, 6, 0.0) for p in points})
    cfg = load_config(None, {"compute.threads": 2})  # both forecasts alike, however busy the cores are
    records = {}
    for tax in (0.0, 0.5):
        monkeypatch.setattr(fc, "measure_read_tax", lambda mf, c, threads, lanes, seconds=1.0, seed=None, tax=tax: tax)
        with open_model(qwen8) as mf:
            records[tax] = fc.forecast(mf, cfg, mem_limit_mb=2000, memory=HOST, seconds=0.05)
    free, taxed = records[0.0], records[0.5]
    assert not free["resident"] and free["fits"] and free["hit_pct"] < 100, free
    f = facts_of(qwen8)
    read_gb = (1 - free["hit_pct"] / 100) * f.top_k * sum(f.read_bytes_per_expert) / 1e9  # a token's misses
    assert taxed["read_tax_s_per_gb"] == 0.5 and free["read_tax_s_per_gb"] == 0.0
    assert taxed["compute_ms"] - free["compute_ms"] == pytest.approx(read_gb * 0.5 * 1e3, rel=0.02, abs=0.02)
    assert taxed["tok_s"] < free["tok_s"]


# ---------------------------------------------------------------- the CLI


def _documented_keys() -> set[str]:
    doc = (ROOT / "docs" / "cli.md").read_text()
    section = doc.split("\n## doctor\n", 1)[1].split("\n## ", 1)[0]
    table = section.split("`--json` keys", 1)[1]
    return {k for line in table.splitlines() if line.startswith("| `") for k in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1])}


def test_cli_json_has_the_documented_keys(capsys):
    assert main(["doctor", str(default_model_path()), "--json", "--seconds", "0.2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == _documented_keys()
    assert out["fits"] and out["resident"] and out["hit_source"] == "resident" and out["tok_s"] > 0
    assert out["bottleneck"] in ("compute", "flash", "memory")


def test_doctor_says_what_it_does_at_once(capsys):
    """Before the imports, compiles and measuring (8 s of silence on a first run), a line on stderr
    (a spinner on a terminal) says what the doctor is doing; stdout keeps only the JSON."""
    assert main(["doctor", str(default_model_path()), "--json", "--seconds", "0.1"]) == 0
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert lines[0] == "[doctor: loading the forecast's code]" and any("measuring the kernels" in x for x in lines), out.err
    json.loads(out.out)


def test_cli_refusal_exits_1_and_says_what_limit_works(qwen8, capsys):
    assert main(["doctor", str(qwen8), "--mem-limit-mb", "1024", "--seconds", "0.05"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"fits\s+NO: does not fit: .* a memory limit of [\d,]+ MiB or more would work", out), out


def test_cli_missing_model_is_one_line_exit_2(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-pipe: error:") and "\n" not in err and "nope.gguf" in err


def test_integer_tables_are_looked_up_not_measured_as_products(tmp_path):
    """deepseek4's token -> experts hash routing (I32, one per hash layer) is a table: no kernel class."""
    from moe_pipe.shared.gguf.model_file import open_header_model
    from moe_pipe.shared.makemodel.maker import make_header

    size = make_header("deepseek4", "deepseek-v4-flash-shape", tmp_path / "d4.header", layers=4, experts="IQ2_XXS")
    with open_header_model([(tmp_path / "d4.header", size)]) as mf:
        assert any(t.qtype.name == "I32" for t in mf.gguf.tensors.values())
        classes = fit.kernel_classes(mf, mf.spec.n_expert_used)
    assert classes and not any(c.qtype.startswith("I") and not c.qtype.startswith("IQ") for c in classes)
