"""Layer-major prefill: a prompt goes through the model one layer at a time in
chunks (compute.prefill_chunk), each layer's experts applied to all of a chunk's
tokens at once. On every family, in the real files' quant mix and in F32, the
whole prompt in one chunk, the prompt in several chunks and the prompt fed one
token at a time (decode steps) give the same next token, the same logits (to
float32 rounding of the dense products) and the same KV cache."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.family_registry import FAMILIES
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(40)]  # 40 tokens: longer than the 16-token chunks below
N_CTX = 64


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    if not b.size:  # a layer with no KV rows (a recurrent layer; deepseek2's V, which is K's latent)
        return
    scale = max(float(np.abs(b).max()), 1e-6)
    assert float(np.abs(a - b).max()) <= 1e-4 * scale, f"{what}: max |diff| {np.abs(a - b).max():.3g} of {scale:.3g}"


def _kv(cache) -> list[np.ndarray]:
    """The KV rows and, in a hybrid model, the recurrent state (conv inputs and delta-rule matrices)."""
    state = getattr(cache, "state", None)
    recurrent = [*state.conv.values(), *state.delta.values()] if state is not None else []
    return [np.asarray(p, dtype=np.float32) for p in (*cache.parts(), *recurrent)]


@pytest.mark.parametrize("quant", [None, "F32"], ids=["mix", "f32"])
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_one_chunk_several_chunks_and_decode_steps_agree(family, quant, tmp_path):
    path = make_model(family.arch, "tiny", tmp_path / "m.gguf", quant=quant)
    with open_model(path) as mf:
        model = load_model(mf, options=None)
        whole_cache, chunked_cache, steps_cache = (model.new_cache(N_CTX, "f32") for _ in range(3))
        whole = model.prefill(PROMPT, whole_cache, batch=len(PROMPT))  # layer-major: the prompt in one chunk
        chunked = model.prefill(PROMPT, chunked_cache, batch=16)
        steps = [model.decode_one(t, steps_cache) for t in PROMPT][-1]
    assert int(whole.argmax()) == int(chunked.argmax()) == int(steps.argmax())
    _close(whole, steps, "one chunk vs decode steps, logits")
    _close(chunked, steps, "16-token chunks vs decode steps, logits")
    assert whole_cache.n == chunked_cache.n == steps_cache.n == len(PROMPT)
    for i, (a, b, c) in enumerate(zip(_kv(whole_cache), _kv(chunked_cache), _kv(steps_cache))):
        _close(a, c, f"KV part {i}, one chunk vs decode steps")
        _close(b, c, f"KV part {i}, 16-token chunks vs decode steps")


@pytest.mark.parametrize("arch", ["gemma4", "gpt-oss"])
def test_a_prompt_longer_than_the_window_and_a_chunk_on_sliding_window_rings(arch, tmp_path):
    """An 8-token window kept as rings of 11 rows (prompt block 4): the 40-token prompt in one
    chunk, in 16-token chunks and as decode steps gives the same logits and the same ring rows,
    and the one chunk equals the whole-context cache's bit for bit (the chunk goes through each
    sliding layer in blocks of 4; shared/model/blocks.py store_and_attend)."""
    from moe_pipe.shared.model.blocks import KVCache

    path = make_model(arch, "tiny", tmp_path / "m.gguf", _overrides={"sliding_window": 8})
    with open_model(path) as mf:
        model, s = load_model(mf, options=None), mf.spec
        whole_cache, chunked_cache, steps_cache = (KVCache.for_spec(s, N_CTX, "f32", prompt_block=4) for _ in range(3))
        whole = model.prefill(PROMPT, whole_cache, batch=len(PROMPT))
        chunked = model.prefill(PROMPT, chunked_cache, batch=16)
        steps = [model.decode_one(t, steps_cache) for t in PROMPT][-1]
        full = KVCache(N_CTX, s.n_head_kv, s.head_dim_k, s.head_dim_v, "f32", prompt_block=4)
        assert np.array_equal(model.prefill(PROMPT, full, batch=len(PROMPT)), whole)
    assert int(whole.argmax()) == int(chunked.argmax()) == int(steps.argmax())
    _close(whole, steps, "one chunk vs decode steps, logits")
    _close(chunked, steps, "16-token chunks vs decode steps, logits")
    sliding = [i for i in range(s.n_layer) if s.swa_layers[i]]
    assert sliding and all(whole_cache.k[i].cap == 11 and whole_cache.k[i].lo == len(PROMPT) - 11 for i in sliding)
    for i, (a, b, c) in enumerate(zip(_kv(whole_cache), _kv(chunked_cache), _kv(steps_cache))):
        _close(a, c, f"KV part {i}, one chunk vs decode steps")
        _close(b, c, f"KV part {i}, 16-token chunks vs decode steps")


ACTIVATION_TOKENS = 512  # a chunk long enough that per-token arrays outweigh a tiny model's fixed ones
# In the default tier: the families whose chunks outgrew the bound (attention arrays kept through the
# FFNs, a hybrid layer's conv); the rest behind -m slow.
ACTIVATION_DEFAULT_TIER = ("gemma4", "gpt-oss", "qwen35moe", "bailingmoe3")


@pytest.mark.parametrize(
    "family", [pytest.param(f, id=f.name, marks=[] if f.arch in ACTIVATION_DEFAULT_TIER else [pytest.mark.slow]) for f in FAMILIES]
)
@pytest.mark.parametrize("split", [False, True], ids=["outputs-whole", "outputs-split"])
def test_a_chunk_keeps_no_more_arrays_than_the_budget_leaves_it(family, split, tmp_path, monkeypatch):
    """The budget leaves a prompt chunk `prefill_activation_bytes` beside the KV cache and
    weights (shared/experts/budget.py); every numpy array the chunk's pass allocates, at its
    peak (tracemalloc sees numpy's allocations), stays within it, the layers' reused scratch
    included: an undercount is memory the expert cache was given twice. Also with every
    chunk's expert outputs summed in parts of their columns (expert_output_parts: the
    families whose experts are narrower than the model)."""
    from moe_pipe.shared.gguf import spec

    if split:
        monkeypatch.setattr(spec, "SPLIT_OUTPUT_BYTES", 0)
    _check_chunk_peak(make_model(family.arch, "tiny", tmp_path / "m.gguf"))


# Sixteen heads, 512 wide on the full layers (the tiny preset's four of 128), and narrow FFNs:
# the attention phase is a chunk's peak.
WIDE_HEADS = {"gemma4": {"n_embd": 1024, "n_head": 16, "head_dim_full": 512, "n_ff_exp": 64, "n_ff": 64}}


@pytest.mark.parametrize("arch", sorted(WIDE_HEADS))
def test_a_chunk_whose_attention_is_its_peak_keeps_within_the_budget(arch, tmp_path, monkeypatch):
    """A family that keeps one query array (its spec part's ATTENTION_QUERIES = 1: queries
    normed and rotated in place) is held to it where the attention phase binds, on heads
    wide against the model; with none counted the same chunk is over its budget."""
    from moe_pipe.shared.family_registry import by_arch
    from moe_pipe.shared.gguf.spec import prefill_activation_bytes

    assert {f.arch for f in FAMILIES if f.part("spec").ATTENTION_QUERIES == 1} == set(WIDE_HEADS)
    path = make_model(arch, "tiny", tmp_path / "m.gguf", _overrides=WIDE_HEADS[arch])
    peak = _check_chunk_peak(path)
    monkeypatch.setattr(by_arch(arch).part("spec"), "ATTENTION_QUERIES", 0)
    with open_model(path) as mf:
        assert peak > prefill_activation_bytes(mf.spec, ACTIVATION_TOKENS, mf.spec.n_expert_used)


# Kimi Delta Attention's heads wide against the model (the flash shape's 32 of 128 on a 2,560-wide
# model; here 16 of 128 on 256) and narrow FFNs: its recurrent layers are a chunk's peak.
WIDE_RECURRENT = {"bailingmoe3": {"ssm_heads": 16, "ssm_groups": 16, "ssm_state": 128, "n_ff_exp": 64, "n_ff": 64}}


@pytest.mark.parametrize("arch", sorted(WIDE_RECURRENT))
def test_a_chunk_whose_recurrent_layers_are_its_peak_keeps_within_the_budget(arch, tmp_path, monkeypatch):
    """Where a recurrent layer's arrays bind (Ling-3.0-flash's shape: a 4,000-token prompt was
    OOM-killed in an 11 GB limit when the budget counted the gated delta net's four head-sized
    arrays), the family's RECURRENT_ARRAYS holds the chunk; with four counted it is over."""
    from moe_pipe.shared.family_registry import by_arch
    from moe_pipe.shared.gguf.spec import prefill_activation_bytes

    path = make_model(arch, "tiny", tmp_path / "m.gguf", _overrides=WIDE_RECURRENT[arch])
    peak = _check_chunk_peak(path)
    monkeypatch.setattr(by_arch(arch).part("spec"), "RECURRENT_ARRAYS", 4)
    with open_model(path) as mf:
        assert peak > prefill_activation_bytes(mf.spec, ACTIVATION_TOKENS, mf.spec.n_expert_used)


# Each family's real shape (a "-shape" preset: every width as the model has it), cut to 4 layers
# (6 where the first attention layer comes later) of 16 experts so that the file stays small: the tiny presets' own widths can hide which
# phase is a chunk's peak (Ling-3.0-flash's recurrent layers were over the bound; the tiny one's FFN
# was its peak).
REAL_WIDTHS = {"bailingmoe3": ("ling-3-flash-shape", 6)}  # its sixth layer is the first with MLA


@pytest.mark.slow  # ~20-60 s a family: the real widths' dense matrices
@pytest.mark.parametrize("family", [pytest.param(f, id=f.name) for f in FAMILIES])
def test_a_chunk_at_the_real_widths_keeps_within_the_budget(family, tmp_path):
    shape = next(k for k in family.part("plan").PRESETS if k.endswith("-shape"))
    preset, layers = REAL_WIDTHS.get(family.arch, (shape, 4))
    path = make_model(family.arch, preset, tmp_path / "m.gguf", _overrides={"n_layer": layers, "n_expert": 16})
    _check_chunk_peak(path, tokens=1024)


def _check_chunk_peak(path, tokens: int = ACTIVATION_TOKENS) -> int:
    """The traced peak of the arrays one `tokens`-token chunk allocates; fails when it is over
    `prefill_activation_bytes`."""
    import tracemalloc

    from moe_pipe.shared.gguf.spec import prefill_activation_bytes
    from moe_pipe.shared.model import moe
    from moe_pipe.shared.model.fused import PARALLEL_ROWS

    prompt = [(7 * i + 3) % 200 + 5 for i in range(tokens)]
    with open_model(path) as mf:
        model = load_model(mf, options=None)
        cache = model.new_cache(tokens + 8, "f16")
        # lazy weights and tables, and the kernels of a chunk's many rows (numba threads' from PARALLEL_ROWS),
        # compiled here: a compile inside the traced pass would count the compiler's memory
        model.prefill(prompt[:PARALLEL_ROWS], model.new_cache(PARALLEL_ROWS + 8, "f16"), batch=PARALLEL_ROWS)
        moe._SCRATCH.__dict__.clear()  # the outputs' buffer as a process's first chunk finds it: counted
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            model.prefill(prompt, cache, batch=tokens)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        budget = prefill_activation_bytes(mf.spec, tokens, mf.spec.n_expert_used)
    assert peak <= budget, (
        f"{mf.spec.arch}: a {tokens}-token chunk peaked at {peak / 2**20:.1f} MiB of arrays, the budget leaves {budget / 2**20:.1f}"
    )
    return peak
