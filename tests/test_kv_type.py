"""compute.kv_type: the KV cache stored as f32, f16 or q8_0 (shared/model/blocks.py
KVCache), attention still float32, and the memory budget counting the stored size;
a sliding-window layer's rows kept as a ring of its window and one prompt block,
which gives every position the numbers of a whole-context cache."""

from __future__ import annotations

import math
import mmap
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from moe_pipe.shared.config import KEYS, load_config
from moe_pipe.shared.errors import ConfigError, UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.spec import KV_TYPE_BYTES, SWA_PROMPT_BLOCK, kv_cache_bytes, kv_rows, kv_windows
from moe_pipe.shared.model.blocks import KVCache, attention, quantize_q8_0
from moe_pipe.shared.model.load import ModelOptions, load_model

MiB = 1 << 20


def _random_kv(rng, t=20, hk=2, d=64):
    return rng.standard_normal((t, hk, d), dtype=np.float32), rng.standard_normal((t, hk, d), dtype=np.float32)


def _filled(kv_type, k, v, n_ctx=32):
    """A one-layer cache holding k, v, stored in two writes (a prompt, then more tokens)."""
    t, hk, d = k.shape
    c = KVCache(n_ctx, (hk,), (d,), (v.shape[2],), kv_type)
    c.store(0, k[:12], v[:12])
    c.advance(12)
    c.store(0, k[12:], v[12:])
    c.advance(t - 12)
    return c


# ---------------------------------------------------------------- q8_0 blocks


def _roundf(y: float) -> float:
    """C's roundf: halves away from zero (exact in double for |y| <= 127)."""
    return math.copysign(math.floor(abs(y) + 0.5), y)


def test_q8_0_is_llama_cpps_block_bit_for_bit():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 64), dtype=np.float32) * np.float32(3)
    x[0, 0, :32] = 0  # an all-zero block: scale 0, values 0
    # A block whose scale is exactly 1: halves must round away from zero (roundf), not to even.
    x[1, 2, :32] = np.array([127, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.25] * 26, np.float32)
    q, scale = quantize_q8_0(x)
    assert q.dtype == np.int8 and q.shape == x.shape
    assert scale.dtype == np.float16 and scale.shape == (2, 3, 2)
    assert q[1, 2, :6].tolist() == [127, 3, -4, 1, -1, 2]

    # gguf-py's reference, which states it is bit-exact with ggml-quants.c: [d fp16][32 × int8] per block
    ref = quantize(x.reshape(-1, 64), GGMLQuantizationType.Q8_0).reshape(-1, 34)
    assert np.array_equal(scale.reshape(-1), ref[:, :2].copy().view(np.float16).reshape(-1))
    assert np.array_equal(q.reshape(-1, 32), ref[:, 2:].view(np.int8))

    # The formula itself, one value at a time, on a few blocks: d = max|x|/127, q = roundf(x·(1/d)) in float32.
    blocks = x.reshape(-1, 32)
    for b in (1, 5, 11):
        d = np.float32(np.abs(blocks[b]).max()) / np.float32(127)
        inv = np.float32(1) / d if d else np.float32(0)
        assert scale.reshape(-1)[b] == np.float16(d)
        assert q.reshape(-1, 32)[b].tolist() == [_roundf(float(np.float32(v) * inv)) for v in blocks[b]]

    # And what the cache reads back is the reference dequantization: q · float(fp16 d).
    k = x.transpose(1, 0, 2)  # [T, Hk, d] as the model stores it
    c = KVCache(8, (2,), (64,), (64,), "q8_0")
    c.store(0, k, k)
    c.advance(3)
    want = dequantize(ref.reshape(-1), GGMLQuantizationType.Q8_0).reshape(2, 3, 64)
    assert np.array_equal(c.keys(0, 0, 3), want) and c.keys(0, 0, 3).dtype == np.float32


# ---------------------------------------------------------------- attention on each storage


@pytest.mark.parametrize("kv_type, tol", [("f16", 1e-3), ("q8_0", 2e-2)])
def test_attention_on_a_smaller_cache_stays_close_to_f32(kv_type, tol):
    # Relative L2 error of the attention output against the f32 cache, on unit-normal K and V:
    # f16 rounds each value to 11 significant bits (≤ 2^-11 relative), measured ~2.5e-4; q8_0 to
    # within max|block|/254 (~0.4 % of a block's largest value), measured ~7e-3. A cache that
    # mixed up positions or heads, or lost a scale, is off by O(1).
    rng = np.random.default_rng(2)
    k, v = _random_kv(rng)
    q = rng.standard_normal((20, 8, 64), dtype=np.float32)
    exact, small = _filled("f32", k, v), _filled(kv_type, k, v)
    scale = 1 / math.sqrt(64)
    sinks = rng.standard_normal(8).astype(np.float32)
    for args in [dict(), dict(window=7), dict(sinks=sinks)]:
        want = attention(q, exact, 0, 0, scale, **args)  # prefill: all 20 queries, causal mask
        got = attention(q, small, 0, 0, scale, **args)
        assert got.dtype == np.float32
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= tol
        want1 = attention(q[-1:], exact, 0, 19, scale, **args)  # decode: the last position
        got1 = attention(q[-1:], small, 0, 19, scale, **args)
        assert np.linalg.norm(got1 - want1) / np.linalg.norm(want1) <= tol
    assert small.keys(0, 0, 20).dtype == np.float32
    assert small.k[0].data.dtype == {"f16": np.float16, "q8_0": np.int8}[kv_type]


def _reference_decode(q, stored_k, stored_v, lo, n, scale, sinks=None):
    """float64 softmax(q·K)·V for one query row per head over stored positions lo..n-1."""
    h, d = q.shape
    hk = stored_k.shape[0]
    g = h // hk
    k = stored_k[:, lo:n].astype(np.float64)
    v = stored_v[:, lo:n].astype(np.float64)
    out = np.empty((h, v.shape[2]))
    for head in range(h):
        s = k[head // g] @ q[head].astype(np.float64) * scale
        m = max(s.max(), sinks[head]) if sinks is not None else s.max()
        e = np.exp(s - m)
        total = e.sum() + (np.exp(sinks[head] - m) if sinks is not None else 0.0)
        out[head] = (e / total) @ v[head // g]
    return out.reshape(-1)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_decode_attention_reads_the_stored_cache_in_place(kv_type):
    # A decode step (one query) runs the fused loop over the cache as stored
    # (shared/model/attend.py), converting f16 row by row; it must be
    # softmax(q·K)·V of exactly the stored values: float32 rounding only
    # against a float64 reference, for plain, windowed and sink attention.
    rng = np.random.default_rng(5)
    k, v = _random_kv(rng, t=40, hk=2, d=64)
    cache = _filled(kv_type, k, v, n_ctx=64)
    q = rng.standard_normal((1, 8, 64), dtype=np.float32)
    sinks = rng.standard_normal(8).astype(np.float32)
    scale = 1 / math.sqrt(64)
    stored_k, stored_v = cache.stored(0)
    assert stored_k.dtype == {"f16": np.float16, "f32": np.float32}[kv_type]
    for window, snk, lo in [(0, None, 0), (9, None, 40 - 9), (0, sinks, 0), (9, sinks, 40 - 9)]:
        got = attention(q, cache, 0, 39, scale, window=window, sinks=snk)
        want = _reference_decode(q[0], stored_k, stored_v, lo, 40, scale, snk)
        assert got.shape == (1, 8 * 64) and got.dtype == np.float32
        np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-6 * np.abs(want).max())


# ---------------------------------------------------------------- bytes


def attention_only(**heads) -> SimpleNamespace:
    """The fields kv_cache_bytes reads, for a model whose every layer attends (no recurrent state);
    no sliding window unless `sliding_window` and `swa_layers` say so."""
    n = len(heads["n_head_kv"])
    plain = {"sliding_window": 0, "swa_layers": (False,) * n, "compress_ratios": (), "entry_widths": (), "v_windows": ()}
    return SimpleNamespace(**(plain | heads), n_layer=n, is_recurrent=lambda i: False)


def test_kv_cache_bytes_per_type_by_hand_and_as_allocated():
    spec = attention_only(n_head_kv=(2, 2, 1), head_dim_k=(64, 64, 128), head_dim_v=(64, 64, 128))
    # per position: 2·(64+64) + 2·(64+64) + 1·(128+128) = 768 values; 100 positions = 76,800 values
    assert kv_cache_bytes(spec, 100, "f32") == 307_200
    assert kv_cache_bytes(spec, 100, "f16") == 153_600
    assert kv_cache_bytes(spec, 100, "q8_0") == 81_600  # 2,400 blocks of 32 × (32 int8 + 2-byte scale)
    for kv_type in KV_TYPE_BYTES:  # what the budget counts is what KVCache allocates
        c = KVCache(100, spec.n_head_kv, spec.head_dim_k, spec.head_dim_v, kv_type)
        held = sum(r.data.nbytes + (r.scale.nbytes if r.scale is not None else 0) for r in c.k + c.v)
        assert held == kv_cache_bytes(spec, 100, kv_type)


def test_a_sliding_layer_is_counted_and_allocated_as_its_ring():
    # Layer 0 slides with a window of 100: a ring of 100 - 1 + 512 = 611 rows once the context is
    # longer; below that the ring is the whole context. Layer 1 keeps every position.
    spec = attention_only(n_head_kv=(2, 1), head_dim_k=(64, 128), head_dim_v=(64, 128), sliding_window=100, swa_layers=(True, False))
    assert kv_windows(spec) == (100, 0) and kv_rows(100, 4096) == 611 == 100 - 1 + SWA_PROMPT_BLOCK and kv_rows(100, 300) == 300
    assert kv_cache_bytes(spec, 4096, "f16") == 2 * (611 * 2 * 128 + 4096 * 1 * 256)
    assert kv_cache_bytes(spec, 300, "f32") == 4 * 300 * (2 * 128 + 256)  # nothing wraps: the whole context
    for kv_type in KV_TYPE_BYTES:
        c = KVCache(4096, spec.n_head_kv, spec.head_dim_k, spec.head_dim_v, kv_type, windows=kv_windows(spec))
        assert c.k[0].cap == 611 and c.k[1].cap == 4096
        assert sum(a.nbytes for a in c.parts()) == kv_cache_bytes(spec, 4096, kv_type)


def _ring_and_whole(kv_type, window=8, block=4, n_ctx=64):
    """One layer kept as a ring (window 8, prompt block 4: 11 rows) and the same layer over the whole context."""
    ring = KVCache(n_ctx, (2,), (64,), (64,), kv_type, windows=(window,), prompt_block=block)
    whole = KVCache(n_ctx, (2,), (64,), (64,), kv_type, prompt_block=block)
    return ring, whole


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_a_ring_holds_its_last_rows_exactly_and_refuses_what_it_overwrote(kv_type):
    rng = np.random.default_rng(7)
    k, v = _random_kv(rng, t=40)
    ring, whole = _ring_and_whole(kv_type)
    assert ring.k[0].cap == 11
    steps = [3, 1, 4, 4, 2, 4, 1, 1, 4, 3, 4, 4, 1, 4]  # prompt blocks and decoded tokens, 40 in all
    at = 0
    for t in steps:
        for c in (ring, whole):
            c.store(0, k[at : at + t], v[at : at + t])
            c.advance(t)
        at += t
        lo = max(0, at - 11)
        # Every held position reads back as the whole-context cache stores it, bit for bit.
        assert np.array_equal(ring.keys(0, lo, at), whole.keys(0, lo, at)), at
        assert np.array_equal(ring.values(0, lo, at), whole.values(0, lo, at)), at
        assert ring.k[0].lo == lo
    with pytest.raises(ValueError, match="not held"):
        ring.keys(0, 28, 40)  # position 28 was overwritten by 39
    with pytest.raises(ValueError, match="do not fit"):
        ring.k[0].write(40, np.zeros((2, 12, 64), np.float32))  # more rows than the ring at once
    q = rng.standard_normal((1, 8, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="8-position window"):
        attention(q, ring, 0, 40, 0.125, window=9)


def test_a_ring_continues_only_from_where_it_holds_the_window():
    # After 40 positions the ring (window 8, 11 rows) holds 29..39: a query at p needs p-7..p-1,
    # so the cache can be cut back to 36 (needs 29..35) but not to 35 (needs 28); always to 0.
    rng = np.random.default_rng(8)
    k, v = _random_kv(rng, t=40)
    ring, _ = _ring_and_whole("f32")
    for at in range(0, 40, 4):
        ring.store(0, k[at : at + 4], v[at : at + 4])
        ring.advance(4)
    assert ring.can_truncate(40) and ring.can_truncate(36) and not ring.can_truncate(35) and ring.can_truncate(0)
    with pytest.raises(ValueError, match="sliding-window rows no longer hold the positions before 35"):
        ring.truncate(35)
    ring.truncate(36)
    assert ring.n == 36 and ring.can_truncate(36)
    # A block stored but never counted (a prompt stopped half way) overwrote 29..32, which a
    # query at 36 needs: the cache can no longer go on from 36, and a store there is refused.
    ring.store(0, k[:4], v[:4], at=36)
    ring.store(0, k[:4], v[:4], at=40)
    assert not ring.can_truncate(36) and ring.can_truncate(0)
    with pytest.raises(ValueError, match="cannot store position 36"):
        ring.store(0, k[:1], v[:1])
    ring.truncate(0)
    ring.store(0, k[:4], v[:4])  # from position 0 nothing older is needed
    ring.advance(4)
    assert np.array_equal(ring.keys(0, 0, 4), k[:4].transpose(1, 0, 2))


def test_v_on_its_own_window_decides_where_the_cache_can_go_on_too():
    """deepseek4 keeps V (compressor rows) on a window of its own, whose ring can wrap where K's
    does not: in a context of 11, K (window 8, 8 - 1 + 4 = 11 rows) never wraps, V (window 4,
    7 rows) holds 4..10 after 11 positions and needs p-3..p-1 to go on from p: 7 on, not 6."""
    rng = np.random.default_rng(12)
    k, v = _random_kv(rng, t=11)
    c = KVCache(11, (2,), (64,), (64,), "f32", windows=(8,), prompt_block=4, v_windows=(4,))
    assert (c.k[0].cap, c.v[0].cap) == (11, 7)
    for at in range(0, 11, 4):
        c.store(0, k[at : at + 4], v[at : at + 4])
        c.advance(min(4, 11 - at))
    assert c.k[0].holds(0, 11) and c.can_truncate(7) and not c.can_truncate(6) and not c.can_share(6)
    with pytest.raises(ValueError, match="no longer hold"):
        c.truncate(6)
    spec = attention_only(n_head_kv=(2,), head_dim_k=(64,), head_dim_v=(64,), sliding_window=8, swa_layers=(True,), v_windows=(4,))
    engine = KVCache.for_spec(spec, 4096, "f32")
    assert (engine.k[0].cap, engine.v[0].cap) == (8 - 1 + SWA_PROMPT_BLOCK, 4 - 1 + SWA_PROMPT_BLOCK)
    assert kv_cache_bytes(spec, 4096, "f32") == sum(a.nbytes for a in engine.parts()) == 4 * 2 * 64 * (519 + 515)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_entry_rows_hold_one_row_per_stride_positions_and_copy_and_save_by_position(kv_type):
    """A compressing layer's entries (`_Entries`, deepseek4's): entry m for positions m·4..m·4+3,
    as positions what share_prefix_from and a saved session read: positions 0..n-1 hold the n // 4
    complete entries, stored as the cache's kv_type; the budget counts n_ctx // 4 of them."""
    rng = np.random.default_rng(13)
    k, v = _random_kv(rng, t=18)
    entries = rng.standard_normal((4, 96), dtype=np.float32)
    c = KVCache(30, (2,), (64,), (64,), kv_type, entries=((4, 96),))
    c.store(0, k, v)
    c.advance(18)
    c.entries[0].write(0, entries[:3])
    c.entries[0].write(3, entries[3:])  # entry 3 (positions 12..15); 16..17's is not complete
    e = c.entries[0]
    assert (e.stride, e.count(0, 18), e.count(0, 3), len(c.rows())) == (4, 4, 0, 3)
    assert np.allclose(e.read(0, 4), entries, atol=0.05) and e.read(2, 2).shape == (0, 96)
    copy = KVCache(30, (2,), (64,), (64,), kv_type, entries=((4, 96),))
    copy.share_prefix_from(c, 15)  # three complete entries
    assert [a.shape[1] for a in copy.entries[0].export(0, 15)] == [3] * len(e.arrays())
    assert np.array_equal(copy.entries[0].read(0, 3), e.read(0, 3)) and not copy.entries[0].read(3, 4).any()
    spec = attention_only(n_head_kv=(2,), head_dim_k=(64,), head_dim_v=(64,), compress_ratios=(4,), entry_widths=(96,))
    assert kv_cache_bytes(spec, 30, kv_type) == sum(a.nbytes for a in c.parts())


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("arch", ["gemma4", "gpt-oss"])
def test_sliding_window_kv_equals_full_kv_on_every_position(arch, kv_type, tmp_path):
    """The tiny model with an 8-token window, its sliding layers kept as rings of 11 rows
    (prompt block 4), against the same model with every layer keeping the whole context: a
    40-token prompt in 16-token chunks (longer than the window, the ring and a chunk), then
    greedy decoding; every position's logits and every token are the same, bit for bit."""
    from moe_pipe.shared.makemodel.maker import make_model

    path = make_model(arch, "tiny", tmp_path / "m.gguf", _overrides={"sliding_window": 8})
    prompt = [(7 * i + 3) % 200 + 5 for i in range(40)]
    with open_model(path) as mf:
        model, s = load_model(mf, options=ModelOptions(kv_type=kv_type)), mf.spec
        assert s.sliding_window == 8 and any(s.swa_layers) and not all(s.swa_layers)
        ring = KVCache.for_spec(s, 64, kv_type, prompt_block=4)
        whole = KVCache(64, s.n_head_kv, s.head_dim_k, s.head_dim_v, kv_type, prompt_block=4)
        assert {ring.k[i].cap for i in range(s.n_layer) if s.swa_layers[i]} == {11}
        got = {}
        for name, cache in (("ring", ring), ("whole", whole)):
            logits = [model.forward(prompt[a : a + 16], cache, all_logits=True) for a in range(0, 40, 16)]
            tokens = [int(logits[-1][-1].argmax())]
            for _ in range(16):
                step = model.decode_one(tokens[-1], cache)
                logits.append(step[None])
                tokens.append(int(step.argmax()))
            got[name] = (np.concatenate(logits), tokens)
    assert np.array_equal(got["ring"][0], got["whole"][0]), f"max |diff| {np.abs(got['ring'][0] - got['whole'][0]).max():.3g}"
    assert got["ring"][1] == got["whole"][1]
    assert ring.k[0].lo > 0  # the ring did wrap


def test_q8_0_refuses_a_head_width_not_a_multiple_of_32():
    spec = attention_only(n_head_kv=(2,), head_dim_k=(72,), head_dim_v=(72,))
    for make in (lambda: KVCache(16, (2,), (72,), (72,), "q8_0"), lambda: kv_cache_bytes(spec, 16, "q8_0")):
        with pytest.raises(UserError) as e:
            make()
        msg = str(e.value)
        assert "\n" not in msg and "72 wide" in msg and "q8_0" in msg and "f16" in msg
    assert kv_cache_bytes(spec, 16, "f16") == 2 * 16 * 2 * 144  # the other types take any width
    with pytest.raises(UserError, match="unknown KV cache type 'q4'"):
        KVCache(16, (2,), (64,), (64,), "q4")


# ---------------------------------------------------------------- the config


def test_config_kv_type_default_choices_and_flag():
    from argparse import ArgumentParser

    from moe_pipe.shared.config_flags import add_override_arguments, overrides_from_args

    assert load_config(None).compute.kv_type == "f16"
    assert set(KEYS["compute.kv_type"].spec.choices) == set(KV_TYPE_BYTES)  # the names the byte counts know
    with pytest.raises(ConfigError) as e:
        load_config(None, {"compute.kv_type": "int4"})
    msg = str(e.value)
    assert "\n" not in msg and "compute.kv_type" in msg and all(f'"{t}"' in msg for t in ("f16", "f32", "q8_0"))
    p = ArgumentParser()
    add_override_arguments(p, tables=("compute",))
    assert overrides_from_args(p.parse_args(["--kv-type", "q8_0"]))["compute.kv_type"] == "q8_0"


# ---------------------------------------------------------------- a generation


def test_tiny_model_greedy_tokens_agree_across_kv_types(tiny_model):
    from moe_pipe.shared import quant

    prompt = [1, 5, 9, 20, 33, 70, 100, 200, 7, 300, 11]
    tokens, logits = {}, {}
    # float32 activations throughout (int8 rounding, docs/kernels.md, would turn f16's tiny
    # differences into ~2 % of the logits and flip the random weights' near-ties): the KV type alone
    was = quant.int8_activations()
    quant.set_int8_activations(False)
    try:
        _generate_each(tiny_model, prompt, tokens, logits)
    finally:
        quant.set_int8_activations(was)
    _check_agreement(tokens, logits)


def _generate_each(tiny_model, prompt, tokens, logits):
    from moe_pipe.shared.text.generate import GenerationConfig, generate
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(tiny_model) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        for kv_type in ("f32", "f16", "q8_0"):
            model = load_model(mf, options=ModelOptions(kv_type=kv_type))
            assert model.new_cache(8).kv_type == kv_type  # generate's cache is the model's
            cfg = GenerationConfig(max_tokens=6, n_ctx=64, ignore_eos=True)
            tokens[kv_type] = generate(model, tok, prompt, SamplingParams(temperature=0.0), cfg).tokens
            # Every position's logits over the prompt and f32's continuation, one batch (float32 activations).
            seq = prompt + [903, 1136, 1359, 1944, 903, 71, 1677, 644, 903, 1993, 903, 1235]
            logits[kv_type] = model.forward(seq, model.new_cache(64), all_logits=True)


def _check_agreement(tokens, logits):
    # Six decoded tokens: the same in f16. The seventh is a near-tie on these random weights (f32's
    # top two 0.035 apart) and one-token products round activations to int8 (docs/kernels.md), which
    # turns any small change in the input, f16's included, into ~2 % of the logits: it may flip there.
    assert len(tokens["f32"]) == 6 and tokens["f16"] == tokens["f32"]
    # Hence the logits, on the batch path: measured f16 ≤ 4.9e-3 relative L2 per row (median 8e-4),
    # every row's greedy pick the same; q8_0 ≤ 7.4e-2 (median 2e-2: ~0.4 % per K/V value, through four
    # layers of random weights). A misplaced position or a lost scale moves rows by O(1).
    want = logits["f32"]

    def rel(kv_type):
        return np.linalg.norm(logits[kv_type] - want, axis=-1) / np.linalg.norm(want, axis=-1)

    assert rel("f16").max() <= 1e-2 and np.array_equal(logits["f16"].argmax(-1), want.argmax(-1))
    assert rel("q8_0").max() <= 0.15 and np.median(rel("q8_0")) <= 5e-2


def test_run_no_stream_uses_the_configured_kv_type(monkeypatch, capsys):
    from moe_pipe.cli.main import main
    from moe_pipe.shared.model import base

    made = []

    class Spy(KVCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self.kv_type)

    monkeypatch.setattr(base, "KVCache", Spy)
    assert main(["run", "--no-stream", "--kv-type", "q8_0", "-p", "hello", "-n", "2", "--output-format", "json"]) == 0
    assert made and set(made) == {"q8_0"}  # the run's cache, and the kernel warm-up's (procs/warmup.py) alike
    capsys.readouterr()


# ---------------------------------------------------------------- the budget


def test_the_budget_gains_what_f16_saves(monkeypatch, tiny_model):
    from moe_pipe.procs.compute import model_options
    from moe_pipe.procs.resources import Resources
    from moe_pipe.shared.experts import budget as B

    # Auto budget against a fixed 2 GiB: the same memory for both runs, so only the KV share differs.
    monkeypatch.setattr(B, "probe_memory", lambda: B.MemoryProbe(2048 * MiB, ()))
    monkeypatch.setattr(B, "on_phone", lambda: False)
    got = {}
    for kv_type in ("f32", "f16"):
        cfg = load_config(None, {"compute.kv_type": kv_type, "compute.ctx_size": 4096, "cache.cache_mb": "auto"})
        with Resources.create(cfg, tiny_model) as res:
            got[kv_type] = res.resolved.budget_bytes
            with open_model(tiny_model) as mf:  # what compute makes its cache with, from the config it is sent whole
                assert model_options(cfg.compute, None, mf).kv_type == kv_type
    with open_model(tiny_model) as mf:
        kv32, kv16 = kv_cache_bytes(mf.spec, 4096, "f32"), kv_cache_bytes(mf.spec, 4096, "f16")
    assert kv32 == 2 * kv16 > 0
    assert got["f16"] - got["f32"] == kv32 - kv16


# ---------------------------------------------------------------- a prefix copied from another cache


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_a_copied_prefix_holds_the_same_stored_rows_as_the_donor(kv_type):
    """Another sequence's first n positions copied (KVCache.share_prefix_from): the values as
    stored (q8_0's scales too), its count n, and the donor's own rows untouched by what the
    copy then stores; on a ring, what it holds of 0..n-1, which is the window before n."""
    rng = np.random.default_rng(9)
    k, v = _random_kv(rng, t=20)
    donor = _filled(kv_type, k, v)
    for copy in (KVCache(32, (2,), (64,), (64,), kv_type), _filled(kv_type, v, k)):  # empty, and holding another sequence
        copy.share_prefix_from(donor, 15)
        assert copy.n == 15
        stored = [(c.k[0].export(0, 15), c.v[0].export(0, 15)) for c in (copy, donor)]
        assert all(np.array_equal(a, b) for x, y in zip(*stored) for a, b in zip(x, y))
        copy.store(0, v[:5], k[:5])  # its own positions 15..19
        assert np.array_equal(donor.keys(0, 15, 20), _filled(kv_type, k, v).keys(0, 15, 20))
    ring, _ = _ring_and_whole(kv_type)
    for at in range(0, 20, 4):
        ring.store(0, k[at : at + 4], v[at : at + 4])
        ring.advance(4)
    copy, _ = _ring_and_whole(kv_type)
    copy.share_prefix_from(ring, 18)  # the ring holds 9..19; a query at 18 needs 11..17
    assert copy.n == 18 and copy.k[0].lo == 9 and copy.holds_window(18)
    assert np.array_equal(copy.keys(0, 9, 18), ring.keys(0, 9, 18)) and np.array_equal(copy.values(0, 9, 18), ring.values(0, 9, 18))


def test_a_prefix_is_not_copied_from_a_cache_that_cannot_give_it():
    rng = np.random.default_rng(10)
    k, v = _random_kv(rng, t=40)
    ring, whole = _ring_and_whole("f32")
    for at in range(0, 40, 4):
        ring.store(0, k[at : at + 4], v[at : at + 4])
        ring.advance(4)
    copy, _ = _ring_and_whole("f32")
    copy.share_prefix_from(ring, 36)  # the window before 36 is 29..35: held
    before = [a.copy() for a in copy.parts()]
    with pytest.raises(ValueError, match="cannot share the first 35 of 40 positions: its rings no longer hold the window before them"):
        copy.share_prefix_from(ring, 35)  # needs 28, overwritten by 39
    with pytest.raises(ValueError, match="cannot share the first 41 of 40 positions: it does not hold them"):
        copy.share_prefix_from(ring, 41)
    with pytest.raises(ValueError, match="another layout"):
        copy.share_prefix_from(whole, 0)  # a ring and a whole-context layer
    with pytest.raises(ValueError, match="another layout"):
        copy.share_prefix_from(_ring_and_whole("f16")[0], 0)
    with pytest.raises(ValueError, match="itself"):
        copy.share_prefix_from(copy, 4)
    assert copy.n == 36 and all(np.array_equal(a, b) for a, b in zip(copy.parts(), before))  # a refused copy changes nothing


def _continued(model, prefix_cache, tail, n_decode=6):
    """Every logits row of `tail` run on the cache, then of greedy decoding from it."""
    rows = [model.forward(tail, prefix_cache, all_logits=True)]
    token = int(rows[-1][-1].argmax())
    for _ in range(n_decode):
        rows.append(model.decode_one(token, prefix_cache)[None])
        token = int(rows[-1][-1].argmax())
    return np.concatenate(rows)


@pytest.mark.parametrize("arch", ["gemma4", "gpt-oss"])
def test_a_sequence_continued_from_a_copied_ring_prefix_is_the_sequence_computed_alone(arch, tmp_path):
    """The tiny model with an 8-token window (rings of 11 rows): a donor that read a 20-token
    prefix and 3 tokens of its own gives another cache its first 20 positions; that cache
    continued with another tail gives, bit for bit, the logits of computing prefix and tail
    alone. Once the donor has gone on more than a block past 20, its rings no longer hold the
    window before 20 and the copy is refused."""
    from moe_pipe.shared.makemodel.maker import make_model

    path = make_model(arch, "tiny", tmp_path / "m.gguf", _overrides={"sliding_window": 8})
    prefix = [(7 * i + 3) % 200 + 5 for i in range(20)]
    with open_model(path) as mf:
        model, s = load_model(mf, options=ModelOptions(kv_type="f32")), mf.spec
        donor, copy, alone = (KVCache.for_spec(s, 64, "f32", prompt_block=4) for _ in range(3))
        model.forward(prefix[:16], donor)
        model.forward(prefix[16:] + [11, 12, 13], donor)  # the donor's own tokens overwrite ring rows past 20
        copy.share_prefix_from(donor, 20)
        model.forward(prefix[:16], alone)
        model.forward(prefix[16:], alone)
        tail = [21, 22, 23, 24, 25]
        assert np.array_equal(_continued(model, copy, tail), _continued(model, alone, tail))
        for t in (14, 15, 16):
            model.decode_one(t, donor)  # 26 positions: the rings hold 15..25, the window before 20 needs 13..19
        assert not donor.can_share(20)
        with pytest.raises(ValueError, match="rings no longer hold"):
            KVCache.for_spec(s, 64, "f32", prompt_block=4).share_prefix_from(donor, 20)


def test_a_recurrent_state_is_copied_only_whole(tmp_path):
    """qwen35moe: the donor's linear-attention state has folded in every position it holds, so
    its prefix is copied only when it is all of it (then the copy continues exactly as the
    sequence alone, and the donor goes on unchanged by the copy's steps); a shorter prefix is refused."""
    from moe_pipe.shared.makemodel.maker import make_model

    path = make_model("qwen35moe", "tiny", tmp_path / "q.gguf")
    prefix, tail, other = [5, 17, 29, 41, 53, 65, 77, 89], [101, 113, 125], [7, 9, 11]
    with open_model(path) as mf:
        model = load_model(mf, options=ModelOptions(kv_type="f32"))
        donor, copy, alone = (model.new_cache(32) for _ in range(3))
        model.forward(prefix, donor)
        model.forward(prefix, alone)
        copy.share_prefix_from(donor, len(prefix))
        assert copy.state is not None and copy.state.conv is not donor.state.conv
        assert np.array_equal(_continued(model, copy, tail), _continued(model, alone, tail))
        fresh = model.new_cache(32)
        model.forward(prefix, fresh)
        assert np.array_equal(_continued(model, donor, other), _continued(model, fresh, other))  # the donor's own state
        refused = model.new_cache(32)
        with pytest.raises(ValueError, match="a recurrent state is only shared whole"):
            refused.share_prefix_from(donor, len(prefix))  # it went on past the prefix
        assert refused.n == 0 and not any(a.any() for a in (*refused.state.conv.values(), *refused.state.delta.values()))


def test_the_service_s_budget_counts_a_kv_cache_a_slot_as_doctor_does(monkeypatch, tiny_model):
    """`up --parallel N` holds N KV caches: the budget the service resolves leaves them out of the
    expert cache (it counted one, and a full-depth --parallel 4 was OOM-killed), the same bytes
    `doctor`'s footprint counts."""
    from moe_pipe.procs.resources import Resources
    from moe_pipe.shared.analysis.fit import model_footprint
    from moe_pipe.shared.experts import budget as B

    monkeypatch.setattr(B, "probe_memory", lambda: B.MemoryProbe(2048 * MiB, ()))
    monkeypatch.setattr(B, "on_phone", lambda: False)
    got, footprint = {}, {}
    runs = {(1, None): 4096, (4, None): 4096 + 3 * 1024, (4, 16384): 16384}  # (slots, kv_pool) -> the pool's positions
    for (n, pool), _ in runs.items():
        cfg = load_config(None, {"gateway.parallel": n, "gateway.kv_pool": pool, "compute.ctx_size": 4096, "cache.cache_mb": "auto"})
        with Resources.create(cfg, tiny_model) as res:
            got[n, pool] = res.resolved.budget_bytes
        with open_model(tiny_model) as mf:
            footprint[n, pool] = model_footprint(mf, cfg).kv_bytes
    with open_model(tiny_model) as mf:
        one = kv_cache_bytes(mf.spec, 4096, "f16")
        cache = KVCache.for_spec(mf.spec, 4096, "f16")
    # Counted from the arrays a slot's cache allocates: a position's rows on every layer, and a page a kv head's run.
    per_position = sum(r.data[:, :1].nbytes for r in cache.pooled())
    pages = sum(r.data.shape[0] for r in cache.pooled()) * mmap.PAGESIZE
    want = {key: one if key[0] == 1 else key[0] * pages + positions * per_position for key, positions in runs.items()}
    assert footprint == want
    assert per_position * 4096 == one  # the tiny model keeps every layer whole: nothing is fixed
    assert footprint[4, 16384] > 4 * one > footprint[4, None]  # the pool reserves less than a whole context a slot
    assert got[1, None] - got[4, None] == footprint[4, None] - one
    assert got[4, None] - got[4, 16384] == footprint[4, 16384] - footprint[4, None]
