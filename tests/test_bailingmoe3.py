"""bailingmoe3 (Ling 3.0): Kimi Delta Attention with a recurrent state on most layers,
deepseek2's latent attention with a gate per head on the rest, DeepSeek-V3 routing.

Its checkpoints are held to transformers and llama.cpp with every family's checks in
tests/test_families_oracle.py (its entry in tests/oracle.py); the streaming pipeline is
in tests/test_family_pipelines.py, a prompt in one chunk, in several and token by token
in tests/test_prefill.py. Here: the layer kinds and the KDA tensors as the converter
writes them, the cache's and the recurrent state's size, a layer past the config's MTP
count left out (the MTP block itself: tests/test_convert_mtp.py; make-model --mtp's here), and what the
converter refuses (docs/models.md § bailingmoe3).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.families.bailingmoe3.convert import hparams
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.spec import kv_cache_bytes, recurrent_state_bytes
from moe_pipe.shared.makemodel.maker import make_model

from . import hfmodels, oracle
from .realheaders import assert_published, made_header


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """make-model's tiny preset: KDA on layers 0 and 2, MLA on 1 and 3."""
    return make_model("bailingmoe3", "tiny", tmp_path_factory.mktemp("bailingmoe3") / "tiny.gguf")


# What the public load logs of a real Ling-3.0 GGUF (the 42-layer, 2,560-wide one llama.cpp
# calls 124B-A5.1B) print of its header: kv 6-14 in AtomicBot-ai/atomic-llama-cpp-turboquant
# issue #75, the tokenizer's kv 40-48 in ikawrakow/ik_llama.cpp pull request #2295.
REAL_FLASH_HEADER = {
    "bailingmoe3.block_count": 42,
    "bailingmoe3.context_length": 131072,
    "bailingmoe3.embedding_length": 2560,
    "bailingmoe3.feed_forward_length": 6144,
    "bailingmoe3.attention.head_count": 32,
    "bailingmoe3.rope.freq_base": 6000000.0,
    "bailingmoe3.attention.layer_norm_rms_epsilon": 0.000001,
    "bailingmoe3.expert_count": 512,
    "tokenizer.ggml.pre": "bailingmoe2",
    "tokenizer.ggml.bos_token_id": 156891,
    "tokenizer.ggml.eos_token_id": 156895,
    "tokenizer.ggml.padding_token_id": 156892,
    "tokenizer.ggml.add_bos_token": False,
    "tokenizer.ggml.add_eos_token": False,
}
REAL_FLASH_HEAD_COUNT_KV_START = [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1]  # the log's first twelve of 42
REAL_FLASH_VOCAB = 157184  # its tokens (ours are made: only the count and the specials' places are held)


def test_the_flash_shape_s_header_has_a_real_ling_3_file_s_values(tmp_path):
    with made_header("bailingmoe3", "ling-3-flash-shape", tmp_path) as f:
        assert_published(f, REAL_FLASH_HEADER)
        assert list(f.meta("bailingmoe3.attention.head_count_kv")[:12]) == REAL_FLASH_HEAD_COUNT_KV_START
        tokens = f.meta("tokenizer.ggml.tokens")
        assert len(tokens) == REAL_FLASH_VOCAB
        assert [tokens[i] for i in (156891, 156892, 156895)] == ["<|startoftext|>", "<|endoftext|>", "<|role_end|>"]


def test_layer_kinds_and_state_come_from_head_count_kv(tiny):
    with open_model(tiny) as mf:
        s = mf.spec
        assert s.n_head_kv == (0, 1, 0, 1) and s.recurrent_layers == (True, False, True, False)
        assert (s.ssm_heads, s.ssm_state, s.ssm_conv_channels, s.kda_gate_lower_bound) == (4, 64, 3 * 4 * 64, -5.0)
        # two latent rows of 128 + 32 values per position, the two KDA layers' fixed state beside them
        state = 2 * 4 * (3 * 4 * 64 * 3 + 4 * 64 * 64)
        assert recurrent_state_bytes(s) == state
        assert kv_cache_bytes(s, 100, "f32") == 2 * 100 * 160 * 4 + state


def test_make_model_mtp_writes_the_block_llama_cpps_converter_writes(tiny, tmp_path, monkeypatch):
    """make-model --mtp: block 4 is the gated-MLA MoE layer with eh_proj, enorm, hnorm and
    layer_output_norm that llama.cpp's converter writes for Ling's MTP layer and its loader
    creates (tests/test_convert_mtp.py LING_MTP_BLOCK), counted in block_count,
    nextn_predict_layers and head_count_kv; the decoder's tensors are the plain file's bytes; the
    block is never read and changes no token, here or in llama.cpp, which loads it."""
    from moe_pipe.shared.gguf.reader import GGUFFile
    from moe_pipe.shared.model.load import load_model

    from .oracle_checks import llama, llama_greedy, ours_greedy
    from .test_convert_mtp import LING_MTP_BLOCK

    mtp = make_model("bailingmoe3", "tiny", tmp_path / "mtp.gguf", mtp=True)
    with open_model(tiny) as a, open_model(mtp) as b:
        meta = b.gguf.meta
        assert (meta("bailingmoe3.block_count"), meta("bailingmoe3.nextn_predict_layers")) == (5, 1)
        assert list(meta("bailingmoe3.attention.head_count_kv")) == [0, 1, 0, 1, 1]
        assert (b.spec.n_layer, b.spec.n_layer_nextn, b.spec.n_head_kv) == (4, 1, a.spec.n_head_kv)
        block = {n for n in b.gguf.tensors if n.startswith("blk.4.")}
        assert {n.split(".", 2)[2] for n in block} == LING_MTP_BLOCK and block == b.layout.nextn_tensor_names
        assert set(a.gguf.tensors) == set(b.gguf.tensors) - block
        assert all(np.array_equal(np.asarray(a.gguf.view(n)), np.asarray(b.gguf.view(n))) for n in a.gguf.tensors)
        prompt = [int(t) for t in np.random.default_rng(3).integers(0, a.spec.n_vocab, 12)]
        want = ours_greedy(load_model(a), prompt, 8)
    viewed: list[str] = []
    real_view = GGUFFile.view
    monkeypatch.setattr(GGUFFile, "view", lambda self, name: viewed.append(name) or real_view(self, name))
    with open_model(mtp) as mf:
        assert ours_greedy(load_model(mf), prompt, 8) == want
        assert "blk.3.ffn_gate_exps.weight" in viewed and mf.layout.nextn_tensor_names.isdisjoint(viewed)
    assert llama_greedy(llama(mtp), prompt, 8) == llama_greedy(llama(tiny), prompt, 8)


@pytest.mark.parametrize(
    "key,value,named",
    [
        ("bailingmoe3.swiglu_clamp_exp", [0.0, 7.0, 7.0, 7.0], "clamped SwiGLU"),
        ("bailingmoe3.kda.gate_lower_bound", 0.5, "must be negative"),
        ("bailingmoe3.attention.head_count_kv", [0, 0, 0, 0], "no MLA layer"),
    ],
)
def test_files_the_forward_pass_would_misread_are_refused(tiny, tmp_path, key, value, named):
    from gguf import GGUFValueType as T

    from moe_pipe.shared.errors import GGUFError

    from .ggufgen import with_metadata

    path = with_metadata(tiny, tmp_path / "m.gguf", {key: (value, T.ARRAY if isinstance(value, list) else T.FLOAT32)})
    with pytest.raises(GGUFError, match=named):
        open_model(path)


def _config(**kw) -> dict:
    cfg = hfmodels.bailingmoe3_config(640)
    cfg.update(num_experts=cfg.pop("num_local_experts"), num_shared_experts=cfg.pop("n_shared_experts"), **kw)
    return cfg


def test_the_kda_width_is_linear_head_dim_when_transformers_wrote_the_config():
    assert hparams(_config(head_dim=128))["d"] == 128  # Ling's own config.json
    assert hparams(_config(head_dim=16, linear_head_dim=32))["d"] == 32  # transformers' save: head_dim is the rope width


def test_layer_kinds_follow_layer_types_else_the_group_rule():
    assert hparams(_config(num_hidden_layers=6, layer_group_size=3))["mla"] == [False, False, True] * 2
    types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    assert hparams(_config(layer_types=types))["mla"] == [True, False, False, True]


@pytest.mark.parametrize(
    "change,named",
    [
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope type"),
        (dict(kda_safe_gate=False), "kda_safe_gate"),
        (dict(no_kda_lora=False), "no_kda_lora"),
        (dict(gated_attention_proj_granularity_type="element_wise"), "head_wise"),
        (dict(expert_swiglu_limit_list=[0, 7.0, 7.0, 7.0]), "expert_swiglu_limit_list"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(layer_types=["linear_attention"] * 4), "full_attention"),
        (dict(mlp_layer_types=["sparse"] * 4), "mlp_layer_types"),
        (dict(score_function="softmax"), "sigmoid"),
    ],
)
def test_convert_refuses_what_the_references_compute_differently(change, named):
    with pytest.raises(UserError, match=named):
        hparams(_config(**change))


@pytest.mark.oracle
def test_converted_kda_tensors_are_llama_cpps(tmp_path_factory):
    """Each conv as [1, H·d, 1, kernel], a = exp(A_log) as [H, 1], head_count_kv 0/1 per layer."""
    from safetensors.numpy import load_file

    ck = oracle.checkpoint("bailingmoe3", "default", tmp_path_factory)
    sd = load_file(ck.hf_dir / "model.safetensors")
    with open_model(ck.gguf()) as mf:
        assert mf.spec.n_head_kv == (0, 1, 0, 1)
        conv = np.asarray(mf.gguf.view("blk.0.ssm_conv1d_k.weight"))
        assert mf.gguf.tensor("blk.0.ssm_conv1d_k.weight").shape == (1, 64, 1, 4)
        np.testing.assert_array_equal(conv.reshape(64, 4), sd["model.layers.0.attention.k_conv1d.weight"][:, 0])
        a = np.asarray(mf.gguf.view("blk.2.ssm_a")).reshape(-1)
        np.testing.assert_allclose(a, np.exp(sd["model.layers.2.attention.A_log"]), rtol=1e-6)
        assert "blk.1.attn_gate.weight" in mf.gguf.tensors and "blk.1.ssm_g_a.weight" not in mf.gguf.tensors


@pytest.mark.oracle
def test_a_layer_the_config_does_not_count_is_not_converted(tmp_path_factory, tmp_path):
    """A layer L the config's num_nextn_predict_layers (0 here) does not count is left out;
    the MTP block it counts is written (tests/test_convert_mtp.py)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from moe_pipe.shared.convert.converter import convert

    ck = oracle.checkpoint("bailingmoe3", "default", tmp_path_factory)
    hf = shutil.copytree(ck.hf_dir, tmp_path / "hf")
    sd = load_file(hf / "model.safetensors")
    sd.update({"model.layers.4.eh_proj.weight": np.ones((64, 128), np.float32), "model.layers.4.enorm.weight": np.ones(64, np.float32)})
    save_file(sd, str(hf / "model.safetensors"), metadata={"format": "pt"})
    with open_model(convert(hf, tmp_path / "m.gguf", outtype="f32")) as mf, open_model(ck.gguf()) as ref:
        assert sorted(mf.gguf.tensors) == sorted(ref.gguf.tensors)


@pytest.mark.oracle
def test_the_bailingmoe2_split_gives_llama_cpps_token_ids(tiny):
    """Ling's split keeps one newline per piece (`\\s*[\\r\\n]`, not Qwen2's `[\\r\\n]+`)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=oracle.LLAMA_CPP_REASON)
    from moe_pipe.shared.text.tokenizer import Tokenizer

    texts = (*hfmodels.SAMPLES, "a\n\n\nb  \n\n c", "It's 2024; we'LL see\r\n\r\nok", "<role>HUMAN</role>hi")
    with open_model(tiny) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        assert mf.gguf.meta("tokenizer.ggml.pre") == "bailingmoe2"
    llm = llama_cpp.Llama(str(tiny), n_ctx=64, n_threads=1, verbose=False, vocab_only=True)
    try:
        for text in texts:
            assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=False), text
    finally:
        llm.close()
