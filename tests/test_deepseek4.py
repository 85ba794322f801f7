"""deepseek4 (DeepSeek-V4): hyper-connection streams, compressed sparse attention with a
lightning indexer (CSA), heavily compressed attention (HCA), a sliding window with sinks,
sqrt-softplus and hash routing.

Its checkpoints are held to transformers and llama.cpp with every family's checks in
tests/test_families_oracle.py (its entry in tests/oracle.py), the streaming pipeline in
tests/test_family_pipelines.py, prompt chunks against decode steps in tests/test_prefill.py.
Here: that those checks reach the sparse parts, the compact cache (the window's keys and
the rows a fold reads in rings, one entry per window folded once: prompts in any blocks,
prefix reuse and truncation, a draft's rollback, a saved session, a shared prefix, its
budget), the made hash table, and what the converter refuses (docs/models.md § deepseek4).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.experts.directio import model_identity
from moe_pipe.shared.families.deepseek4.convert import ARCHES
from moe_pipe.shared.families.deepseek4.model import angles, fold_entries, no_window
from moe_pipe.shared.gguf.model_file import open_header_model, open_model
from moe_pipe.shared.gguf.spec import KV_TYPE_BYTES, kv_cache_bytes
from moe_pipe.shared.makemodel.maker import make_header, make_model
from moe_pipe.shared.model.blocks import KVCache
from moe_pipe.shared.model.load import ModelOptions, load_model
from moe_pipe.shared.model.session import Session, load_session, read_header, save_session

from . import hfmodels, oracle

PROMPT = list(oracle.IDS[2])  # 21 tokens: past the window (8), 5 CSA entries (3 kept), 2 HCA-8 entries


# The compact cache's checks: the tiny model with HCA by 8 (sliding, CSA by 4, HCA by 8, CSA; a
# window of 8) and rings for prompt blocks of 4, so a prompt of 60 wraps every ring many times and
# completes 15 CSA and 7 HCA windows.
BLOCK = 4
LONG = [int(t) for t in np.random.default_rng(11).integers(4, 2048, 60)]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model("deepseek4", "tiny", tmp_path_factory.mktemp("ds4") / "tiny.gguf", quant="F32")


@pytest.fixture(scope="module")
def hca8(tmp_path_factory):
    """(model, model file path, identity) of the tiny F32 model with HCA by 8, kept loaded for the module."""
    path = make_model("deepseek4", "tiny", tmp_path_factory.mktemp("ds4c") / "hca8.gguf", quant="F32", _overrides={"hca_ratio": 8})
    with open_model(path) as mf:
        yield load_model(mf, options=ModelOptions(kv_type="f32")), path, model_identity(mf.gguf.paths)


@pytest.fixture(scope="module")
def decoded(hca8) -> np.ndarray:
    """LONG's logits [60, V], one decode step at a time on the rings: what every other way of running it must give."""
    model, _, _ = hca8
    return rows_of(model, LONG, rings(model), 1)


def rings(model, n_ctx: int = 256, kv_type: str = "f32") -> KVCache:
    return KVCache.for_spec(model.spec, n_ctx, kv_type, prompt_block=BLOCK)


def rows_of(model, tokens, cache: KVCache, batch: int) -> np.ndarray:
    """Every position's logits [T, V], the tokens run in passes of `batch`."""
    return np.concatenate([model.forward(tokens[s : s + batch], cache, all_logits=True) for s in range(0, len(tokens), batch)])


def test_the_cache_keeps_the_windows_keys_the_rows_a_fold_reads_and_one_entry_per_window(hca8):
    """Keys: a ring of the window (8 - 1 + a block) on every layer; compressor rows: a ring of
    what a fold reads (CSA: its window and the one before, 8; HCA: its window, 8) on the
    compressing layers; entries: one per window, the entry and on CSA the indexer's key."""
    model, _, _ = hca8
    c = rings(model)
    assert [r.cap for r in c.k] == [11] * 4 and [r.window for r in c.k] == [8] * 4
    assert [(r.cap, r.window, r.data.shape[2]) for r in c.v] == [(256, 0, 0), (11, 8, 768), (11, 8, 256), (11, 8, 768)]
    assert c.entries[0] is None
    assert [(e.stride, e.rows.data.shape[1:]) for e in c.entries[1:]] == [(4, (64, 192)), (8, (32, 128)), (4, (64, 192))]
    rows_of(model, LONG, c, 7)
    assert [r.lo for r in c.k] == [60 - 11] * 4  # the rings wrapped


@pytest.mark.parametrize("kv_type", list(KV_TYPE_BYTES))
def test_the_budget_counts_what_the_cache_allocates(hca8, kv_type):
    """kv_cache_bytes (the budget's, doctor's) is the compact cache as KVCache.for_spec allocates it:
    f32 per position, past the rings, (128 + 64)/4 values on each CSA layer and 128/8 on the HCA one."""
    model, _, _ = hca8
    for n_ctx in (256, 4096):
        c = KVCache.for_spec(model.spec, n_ctx, kv_type)
        assert sum(a.nbytes for a in c.parts()) == kv_cache_bytes(model.spec, n_ctx, kv_type)
    if kv_type == "f32":
        assert kv_cache_bytes(model.spec, 8192, "f32") - kv_cache_bytes(model.spec, 4096, "f32") == 4096 * 4 * (2 * 192 // 4 + 128 // 8)


def test_the_flash_shape_keeps_llama_cpps_bytes_per_position(tmp_path):
    """DeepSeek-V4-Flash's shape (43 layers: 2 sliding, 21 CSA, 20 HCA by 128; head_dim 512,
    indexer keys 128, window 128) at f16: per position 21·(512 + 128)/4 + 20·512/128 values,
    6,880 bytes, llama.cpp's compact cache; beside it fixed rings (keys: 127 + 512 rows on every
    layer; rows: 7 + 512 on CSA, 127 + 512 on HCA layers). Before, every layer kept each
    position's key and compressor rows: 192,512 bytes per position, 28× more."""
    size = make_header("deepseek4", "deepseek-v4-flash-shape", tmp_path / "flash.header")
    with open_header_model([(tmp_path / "flash.header", size)]) as mf:
        spec = mf.spec
    per_position = (kv_cache_bytes(spec, 32768, "f16") - kv_cache_bytes(spec, 4096, "f16")) / (32768 - 4096)
    assert per_position == 2 * (21 * (512 + 128) / 4 + 20 * 512 / 128) == 6880
    rings_bytes = 2 * (43 * 639 * 512 + 21 * 519 * (4 * 512 + 4 * 128) + 20 * 639 * 2 * 512)
    assert kv_cache_bytes(spec, 4096, "f16") == rings_bytes + 2 * 4096 * (21 * (512 + 128) // 4 + 20 * 512 // 128)


def test_folding_windows_one_at_a_time_gives_the_bits_of_folding_them_together():
    """A window completes in a prompt's block beside others or alone in a decode step: each entry
    must come out the same whatever else is folded with it (per-entry reductions only)."""
    rng = np.random.default_rng(5)
    eps = 1e-6
    for ratio, overlap, w in ((4, True, 256), (8, False, 128)):
        windows = 9
        kv, gate = (rng.standard_normal((windows * ratio, w)).astype(np.float32) for _ in range(2))
        ape, norm = rng.standard_normal((ratio, w)).astype(np.float32), rng.standard_normal(w // 2 if overlap else w).astype(np.float32)
        if overlap:  # entry 0 reads the rows before window 0
            pad = no_window(ratio, 2 * w)
            kv, gate = np.concatenate([pad[:, :w], kv]), np.concatenate([pad[:, w:], gate])
        together = fold_entries(kv, gate, ape, norm, ratio, overlap, eps)
        span = 2 * ratio if overlap else ratio
        alone = [
            fold_entries(kv[m * ratio : m * ratio + span], gate[m * ratio : m * ratio + span], ape, norm, ratio, overlap, eps)
            for m in range(windows)
        ]
        assert together.shape[0] == windows and np.array_equal(together, np.concatenate(alone))
        inv = np.float32(1) / np.float32(160000) ** (np.arange(32, dtype=np.float32) / 32)
        at = np.arange(windows) * ratio
        assert all(np.array_equal(np.stack(angles(inv, at))[:, m], np.stack(angles(inv, at[m : m + 1]))[:, 0]) for m in range(windows))


def test_a_long_prompt_in_any_blocks_is_its_decode_steps_bit_for_bit(hca8, decoded):
    """Decode steps, passes of 7 and one pass of 60 (15 blocks of 4) on the rings, and one pass on
    a cache whose rings never wrap: every position's logits alike, windows completing inside a
    block or in a step."""
    model, _, _ = hca8
    for got in (
        rows_of(model, LONG, rings(model), 7),
        rows_of(model, LONG, rings(model), 60),
        rows_of(model, LONG, model.new_cache(256), 60),
    ):
        assert np.array_equal(got, decoded)


def test_a_prefix_is_kept_while_the_rings_hold_what_going_on_from_it_reads(hca8, decoded):
    """After 40 positions the rings hold 29..39: going on from 36..40 (a block back) reads keys and
    rows they hold, and continues as a fresh run, entries of windows the cut left incomplete
    folded again; from 35 the window's first key is gone, so the prefix is recomputed (only 0)."""
    model, _, _ = hca8
    for keep in (37, 36, 40 - BLOCK):
        cache = rings(model)
        rows_of(model, LONG[:40], cache, 8)
        assert cache.can_truncate(keep) and cache.can_share(keep)
        cache.truncate(keep)
        assert np.array_equal(rows_of(model, LONG[keep:], cache, 5), decoded[keep:])
    cache = rings(model)
    rows_of(model, LONG[:40], cache, 8)
    assert not cache.can_truncate(35) and not cache.can_share(35) and cache.can_truncate(0)
    with pytest.raises(ValueError, match="no longer hold"):
        cache.truncate(35)


def test_a_shared_prefix_continues_as_its_donor(hca8, decoded):
    """share_prefix_from (slots sharing a prompt prefix): the rings' held rows and the entries
    complete by the prefix's end."""
    model, _, _ = hca8
    donor = rings(model)
    rows_of(model, LONG[:40], donor, 8)
    other = rings(model)
    rows_of(model, LONG[::-1], other, 8)  # holding another sequence: every ring and entry written over
    for into in (rings(model), other):
        into.share_prefix_from(donor, 38)
        assert into.n == 38 and np.array_equal(rows_of(model, LONG[38:], into, 3), decoded[38:])


def test_a_rejected_draft_that_completed_windows_leaves_what_plain_decoding_leaves(hca8):
    """A verify pass at positions 30..33 completes a CSA window (28..31) and the HCA window
    (24..31) with wrong drafts; rolled back to 31, the entries are folded again from the kept
    rows when the right tokens complete them, and every later logit is plain decoding's."""
    model, _, _ = hca8
    plain = Session(rings(model))
    plain.feed(model, LONG[:30], batch=8)
    want = [plain.feed(model, [t]) for t in LONG[30:50]]
    spec = Session(rings(model))
    spec.feed(model, LONG[:30], batch=8)
    rows = spec.verify(model, [LONG[30], 5, 6, 7])
    assert np.array_equal(rows[0], want[0])
    spec.rollback(3)
    assert spec.n == 31
    got = [spec.feed(model, [t]) for t in LONG[31:50]]
    assert all(np.array_equal(g, w) for g, w in zip(got, want[1:]))
    for a, b in zip(spec.cache.rows(), plain.cache.rows()):  # the held rows and entries, as plain decoding's
        lo = a.lo if a.window else 0
        assert all(np.array_equal(x, y) for x, y in zip(a.export(lo, 50), b.export(lo, 50)))


def test_a_saved_session_holds_the_rings_and_entries_and_continues_exactly(hca8, decoded, tmp_path):
    model, _, identity = hca8
    session = Session(rings(model))
    session.feed(model, LONG[:42], batch=8)
    path = tmp_path / "s.bin"
    written = save_session(path, session, identity, "deepseek4")
    header, _ = read_header(path)
    assert [p[5] for p in header["parts"] if len(p) == 6] == [4, 8, 4]  # each compressing layer's entries, one per window
    assert written < sum(a.nbytes for a in session.cache.parts())  # the rings' held rows and 10 + 5 + 10 entries
    for into in (None, rings(model)):  # the engine's cache (its rings do not wrap at 256), or rings of 4-blocks
        restored = load_session(path, model, 256, identity, into=into)
        assert restored.tokens == LONG[:42]
        assert np.array_equal(rows_of(model, LONG[42:], restored.cache, 1), decoded[42:])


@pytest.mark.oracle
@pytest.mark.slow  # CI time: builds the checkpoint when run alone
def test_the_oracle_prompt_reaches_the_indexer_the_window_and_hca(tmp_path_factory):
    """The transformers check would pass a model that ignored the indexer's choice, the
    window or the HCA entries if the prompt were too short for them: each changes the logits
    (HCA by 1000 compresses nothing yet)."""
    ck = oracle.checkpoint("deepseek4", "hca8", tmp_path_factory)
    with open_model(ck.gguf()) as mf:
        model = load_model(mf)
        base, facts = model.forward(PROMPT, model.new_cache(64), all_logits=True), model.v4
        for change in (dict(index_top_k=100), dict(window=1000), dict(compress_ratios=(0, 4, 1000, 4))):
            model.v4 = dataclasses.replace(facts, **change)
            other = model.forward(PROMPT, model.new_cache(64), all_logits=True)
            assert np.abs(other - base).max() > 0.1, change


def test_a_truncated_cache_continues_as_a_fresh_one(made):
    """Compressed entries are folded from per-position rows: rewinding the cache into the
    middle of a window and going on gives what a fresh run gives."""
    with open_model(made) as mf:
        model = load_model(mf)
        cache = model.new_cache(64, "f32")
        model.prefill(PROMPT, cache, batch=8)
        cache.truncate(13)  # inside a CSA window (12..15)
        resumed = model.prefill(PROMPT[13:], cache, batch=8)
        fresh = model.prefill(PROMPT, model.new_cache(64, "f32"), batch=8)
    assert np.array_equal(resumed, fresh)


def test_a_file_as_llama_cpps_converter_writes_it_from_deepseeks_config(made, tmp_path):
    """llama.cpp's converter writes nextn_predict_layers from the config but skips the MTP
    tensors, and DeepSeek's compress_ratios has an entry for the MTP block; made files are
    written so. As llama.cpp's loader, the decoder is every block, the ratios its first
    entries: the same logits as a file without the MTP's count and entry."""
    from gguf import GGUFValueType

    from .ggufgen import with_metadata

    changes = {
        "deepseek4.nextn_predict_layers": (0, GGUFValueType.UINT32),
        "deepseek4.attention.compress_ratios": ([0, 4, 128, 4], GGUFValueType.ARRAY),
    }
    path = with_metadata(made, tmp_path / "no-mtp-keys.gguf", changes)
    logits = []
    for p in (made, path):
        with open_model(p) as mf:
            assert (mf.spec.n_layer, mf.spec.n_layer_nextn) == (4, 0)
            model = load_model(mf)
            logits.append(model.forward(PROMPT, model.new_cache(64), all_logits=True))
    with open_model(made) as mf:
        assert mf.gguf.meta("deepseek4.nextn_predict_layers") == 1
        assert list(mf.gguf.meta("deepseek4.attention.compress_ratios")) == [0, 4, 128, 4, 0]
    assert np.array_equal(*logits)


@pytest.mark.oracle
def test_convert_writes_the_mtp_keys_as_llama_cpps_converter_and_skips_its_tensors(tmp_path_factory, tmp_path):
    """llama.cpp's converter (conversion/deepseek.py, `DeepseekV4Model`, as of ggml-org/llama.cpp
    01a723d): block_count is num_hidden_layers, `nextn_predict_layers` the config's
    num_nextn_predict_layers (set_gguf_parameters), `compress_ratios` the config's list with the
    MTP's entry, swiglu_clamp_exp one limit per decoder layer, and every `mtp.*` tensor skipped
    (modify_tensors; `--no-mtp` changes nothing). The file runs as the one without the MTP's
    count and entry."""
    import json
    import shutil

    from gguf import GGUFValueType
    from safetensors.numpy import save_file

    from moe_pipe.shared.convert.converter import convert

    from .ggufgen import with_metadata

    ck = oracle.checkpoint("deepseek4", "hca8", tmp_path_factory)
    hf = shutil.copytree(ck.hf_dir, tmp_path / "hf")
    assert json.loads((hf / "config.json").read_text())["num_nextn_predict_layers"] == 1  # transformers saves V4's 1
    D = 64  # DeepSeek's release names the MTP block mtp.0.* (a layer with its e/h projections and norms)
    mtp = {"mtp.0.e_proj.weight": np.ones((D, D), np.float32), "mtp.0.enorm.weight": np.ones(D, np.float32)}
    save_file(mtp | {"mtp.0.attn.wq_a.weight": np.ones((64, D), np.float32)}, str(hf / "mtp.safetensors"), metadata={"format": "pt"})
    files = [convert(hf, tmp_path / "m.gguf", "f32"), convert(hf, tmp_path / "no-mtp.gguf", "f32", mtp=False)]
    for path in files:
        with open_model(path) as mf, open_model(ck.gguf()) as ref:
            g = mf.gguf
            assert (g.meta("deepseek4.block_count"), g.meta("deepseek4.nextn_predict_layers")) == (4, 1)
            assert list(g.meta("deepseek4.attention.compress_ratios")) == [0, 4, 8, 4, 0]
            assert len(g.meta("deepseek4.swiglu_clamp_exp")) == 4 and g.meta("deepseek4.hash_layer_count") == 1
            assert sorted(g.tensors) == sorted(ref.gguf.tensors) and not any(n.startswith("blk.4.") for n in g.tensors)
            assert (mf.spec.n_layer, mf.spec.n_layer_nextn) == (4, 0)  # no MTP tensors: the decoder is every block
    changes = {
        "deepseek4.nextn_predict_layers": (0, GGUFValueType.UINT32),
        "deepseek4.attention.compress_ratios": ([0, 4, 8, 4], GGUFValueType.ARRAY),
    }
    logits = []
    for p in (files[0], with_metadata(files[0], tmp_path / "no-mtp-keys.gguf", changes)):
        with open_model(p) as mf:
            model = load_model(mf)
            logits.append(model.forward(PROMPT, model.new_cache(64), all_logits=True))
    assert np.array_equal(*logits)


def test_made_hash_table_gives_each_token_distinct_experts(made):
    with open_model(made) as mf:
        table = np.array(mf.gguf.view("blk.0.ffn_gate_tid2eid.weight")).reshape(mf.spec.n_vocab, mf.spec.n_expert_used)
        assert "blk.1.ffn_gate_tid2eid.weight" not in mf.gguf.tensors and "blk.1.exp_probs_b.bias" in mf.gguf.tensors
        n_expert = mf.spec.n_expert
    assert table.min() >= 0 and table.max() < n_expert
    assert all(len(set(row)) == len(row) for row in table.tolist())


def test_made_chat_template_and_tokenizer_keep_deepseeks_specials_whole(made):
    """V3's turn markers, each one token; the BOS leads every prompt."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(made) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        template = str(mf.gguf.meta("tokenizer.chat_template"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(template).render(
        messages=msgs, bos_token="", eos_token="<\uff5cend\u2581of\u2581sentence\uff5c>", add_generation_prompt=True
    )
    assert (
        text == "Be brief.<\uff5cUser\uff5c>Hi<\uff5cAssistant\uff5c>Hello.<\uff5cend\u2581of\u2581sentence\uff5c><\uff5cAssistant\uff5c>"
    )
    ids = tok.encode(text)
    assert ids[0] == 0 and [ids.count(i) for i in (1, 2, 3)] == [1, 1, 2]  # eos once, User once, Assistant twice
    assert tok.decode(ids[1:]) == text


def _config(**kw) -> dict:
    cfg = hfmodels.deepseek4_config(640, **kw)
    cfg.update(model_type="deepseek_v4", hc_eps=1e-6)  # as transformers saves it
    return cfg


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}), "must be 4"),
        (dict(mlp_layer_types=["moe", "hash_moe", "moe", "moe"]), "hash_moe layers first"),
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(swiglu_limit=0.0), "swiglu_limit"),
        (dict(scoring_func="sigmoid"), "scoring_func"),
        (dict(n_shared_experts=2), "n_shared_experts"),
        (dict(layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]), "layer_types"),
    ],
)
def test_convert_refuses_what_llama_cpp_would_compute_otherwise(change, words):
    with pytest.raises(UserError) as e:
        ARCHES["deepseek_v4"].hparams(_config(**change))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_convert_reads_deepseeks_own_config_form():
    """DeepSeek's config.json: compress_ratios (one per layer, the MTP's last), num_hash_layers,
    qk_rope_head_dim, a flat rope_scaling for the compressing layers."""
    cfg = _config()
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor"):
        cfg.pop(key)
    cfg.update(compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1, qk_rope_head_dim=64, num_nextn_predict_layers=1)
    cfg["rope_scaling"] = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
    hp = ARCHES["deepseek_v4"].hparams(cfg)
    assert (hp["ratios"], hp["hash"], hp["rope_dim"], hp["rope"]["rope_type"]) == ([0, 4, 128, 4], 1, 64, "yarn")
    # llama.cpp's converter writes the list as the config has it, and the MTP count when the config has one
    assert (hp["ratios_written"], hp["nextn"]) == ([0, 4, 128, 4, 0], 1)
    cfg.pop("num_nextn_predict_layers")
    assert ARCHES["deepseek_v4"].hparams(cfg)["nextn"] is None
