"""The streaming pipeline on the tiny model of every family added after the first
three: the same tokens as the resident (`--no-stream`) reference across
tests/test_pipeline.py's covering set, and per-token CSV counts equal to an
independent LRU replay of the resident model's expert requests. What stays
resident differs by family (shared experts, leading dense layers, latent or
recurrent state: docs/models.md); the routed experts are what streams.

CI time: one setting per family in the default tier, the rest behind -m slow
(the first three families run the covering set in tests/test_pipeline.py).
"""

from __future__ import annotations

import pytest

from moe_pipe.shared.makemodel.maker import make_model

from .test_pipeline import COVER, _budget_mb, _check_identity, independent_lru, run_pipeline, with_reference

# GGUF arch of each later family (mixtral is `llama`)
FAMILIES = ("qwen35moe", "deepseek2", "glm4moe", "llama", "lfm2moe", "qwen2moe", "bailingmoe3", "deepseek4")


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_pipe(request, tmp_path_factory):
    """(path, prompt, reference tokens, sizes) of tests/test_pipeline.py for the family's made tiny model."""
    return with_reference(make_model(request.param, "tiny", tmp_path_factory.mktemp(request.param) / "tiny.gguf"))


@pytest.mark.integration
@pytest.mark.parametrize(
    "budget,overlap,io_threads,dense,top_k,prefetch",
    [pytest.param(*c, id="-".join(map(str, c)), marks=[pytest.mark.slow] if k else []) for k, c in enumerate(COVER)],
)
def test_pipeline_tokens_equal_resident_reference(tiny_pipe, budget, overlap, io_threads, dense, top_k, prefetch):
    _check_identity(tiny_pipe, budget, overlap, io_threads, dense, top_k, prefetch)


@pytest.mark.integration
@pytest.mark.slow  # CI time: the first three families check the CSV in the default tier
def test_pipeline_csv_counts_agree_with_independent_lru(tiny_pipe, tmp_path):
    from moe_pipe.shared.telemetry import read_csv

    path, prompt, _, sizes = tiny_pipe
    csv = tmp_path / "run.csv"
    _, _, resolved = run_pipeline(
        path,
        prompt,
        # every miss through the reader (io.compute_reads 0): the independent LRU models its admissions
        **{
            "cache.cache_mb": _budget_mb(sizes, "mid", None),
            "telemetry.csv": str(csv),
            "cache.policy": "lru",
            "compute.prefetch": "none",
            "io.compute_reads": 0,
        },
    )
    _, records = read_csv(csv)
    assert [(r.hits, r.misses, r.read_bytes, r.messages) for r in records] == independent_lru(path, prompt, resolved.n_slabs)


@pytest.fixture(
    scope="module",
    params=["IQ2_XXS", "NVFP4", pytest.param("IQ1_S", marks=pytest.mark.slow), pytest.param("IQ3_S", marks=pytest.mark.slow)],
)
def iq_pipe(request, tmp_path_factory):
    """tiny_pipe's tuple for a qwen3moe tiny whose routed experts are an i-quant, or NVFP4 with its
    per-expert scales (the Q4_K_M mix elsewhere), with the reference at top-k None only (the one
    setting run here)."""
    path = make_model("qwen3moe", "tiny", tmp_path_factory.mktemp("iq") / "tiny.gguf", experts=request.param)
    return with_reference(path, top_ks=(None,))


@pytest.mark.integration
def test_an_iq_expert_mix_streams_like_the_resident_model(iq_pipe):
    """Streamed experts in an i-quant (the int8 row kernel and GEMM on slabs read from the file), or NVFP4 (the
    float tiles, each expert's own scale), give the resident reference's tokens; one covering setting, with a cache
    of the least budget so experts are evicted and read again."""
    _check_identity(iq_pipe, *COVER[0])
