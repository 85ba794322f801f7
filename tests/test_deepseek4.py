"""deepseek4 (DeepSeek-V4): hyper-connection streams, compressed sparse attention with a
lightning indexer (CSA), heavily compressed attention (HCA), a sliding window with sinks,
sqrt-softplus and hash routing.

Its checkpoints are held to transformers and llama.cpp with every family's checks in
tests/test_families_oracle.py (its entry in tests/oracle.py), the streaming pipeline in
tests/test_family_pipelines.py, prompt chunks against decode steps in tests/test_prefill.py.
Here: that those checks reach the sparse parts, the cache's prefix reuse, the made hash
table, and what the converter refuses (docs/models.md § deepseek4).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.families.deepseek4.convert import ARCHES
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

from . import hfmodels, oracle

PROMPT = list(oracle.IDS[2])  # 21 tokens: past the window (8), 5 CSA entries (3 kept), 2 HCA-8 entries


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model("deepseek4", "tiny", tmp_path_factory.mktemp("ds4") / "tiny.gguf", quant="F32")


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
