"""glm4moe (GLM-4.5 / GLM-4.5-Air): leading dense layers, sigmoid routing with a
selection bias and expert groups, a shared expert, q/k/v biases, optional
qk-norm, partial rotary; its NextN/MTP blocks are never loaded or streamed.

Its checkpoints are held to transformers and llama.cpp with every family's
checks in tests/test_families_oracle.py (its entry in tests/oracle.py). Here:
the converted spec, the made model's layout and tokenizer, the NextN blocks,
the shape preset; the streaming pipeline is in tests/test_family_pipelines.py
(docs/models.md § glm4moe).
"""

from __future__ import annotations

import pytest

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model

from . import hfmodels, oracle
from .realheaders import assert_published, made_header

ck = oracle.checkpoints("glm4moe")


@pytest.mark.oracle
def test_converted_spec_has_the_configs_dense_layers_groups_and_rotary(ck):
    """Each config of GLM-4.5-Air's structure (tests/hfmodels.py glm4moe_config) as the spec reads it."""
    cfg = hfmodels.glm4moe_config(64, **ck.config.build)
    with open_model(ck.gguf()) as mf:
        s = mf.spec
        assert (s.n_layer, s.n_dense_lead, s.n_layer_nextn) == (cfg["num_hidden_layers"], cfg["first_k_dense_replace"], 0)
        assert (s.expert_gating, s.expert_groups, s.expert_groups_used) == ("sigmoid", cfg["n_group"], cfg["topk_group"])
        assert s.rope.dim == 16 and s.n_ff_shexp == cfg["moe_intermediate_size"]


# -- made models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model("glm4moe", "tiny", tmp_path_factory.mktemp("glm") / "tiny.gguf")


def test_dense_layers_and_shared_expert_stay_resident_only_routed_experts_stream(made):
    with open_model(made) as mf:
        s, names = mf.spec, mf.layout.expert_tensor_names
        assert s.n_dense_lead == 1 and s.moe_layers == (1, 2, 3)
        assert names == {f"blk.{i}.ffn_{p}_exps.weight" for i in (1, 2, 3) for p in ("gate", "up", "down")}
        assert mf.layout.expert_bytes(0) == 0 and mf.layout.min_cache_bytes() == 3 * s.n_expert_used * mf.layout.slab_bytes


def test_tokenizer_and_end_of_generation_as_llama_cpp_sets_them(made):
    from moe_pipe.shared.text.chat import render_chat
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(made) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        text = render_chat(mf.gguf, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tok.pre == "glm4" and not tok.add_bos
    assert {tok.token_text(i) for i in tok.eog_ids} == {"<|endoftext|>", "<|user|>", "<|observation|>"}
    assert tok.encode("12345") == tok.encode("123") + tok.encode("45")  # digits in groups of 1-3 (llama3's split)
    assert text == "[gMASK]<sop><|user|>\nHi<|assistant|>"


def test_nextn_blocks_are_not_decoder_layers(tmp_path):
    """make-model --mtp writes GLM-4.5's NextN layer as llama.cpp's converter does: counted in
    block_count, named by nextn_predict_layers, the decoder the blocks before it."""
    from gguf import GGUFValueType

    from moe_pipe.shared.gguf.model_file import read_spec
    from moe_pipe.shared.gguf.reader import GGUFFile

    from .ggufgen import with_metadata

    path = make_model("glm4moe", "tiny", tmp_path / "nextn.gguf", layers=3, mtp=True)
    with GGUFFile(path) as f:
        s = read_spec(f)
        assert f.meta("glm4moe.block_count") == 4 and f.tensors["blk.3.nextn.shared_head_head.weight"].shape == (s.n_vocab, s.n_embd)
    assert (s.n_layer, s.n_layer_nextn, s.moe_layers) == (3, 1, (1, 2))
    bad = with_metadata(path, tmp_path / "bad.gguf", {"glm4moe.nextn_predict_layers": (4, GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match="nextn_predict_layers"), GGUFFile(bad) as f:
        read_spec(f)


def test_nextn_blocks_are_neither_streamed_nor_resident(tmp_path):
    path = make_model("glm4moe", "tiny", tmp_path / "nextn.gguf", layers=3, mtp=True)
    with open_model(path) as mf:
        tensors = mf.gguf.tensors
        nextn_bytes = sum(t.nbytes for n, t in tensors.items() if n.startswith("blk.3."))
        assert len(mf.layout.layers) == 3 and mf.layout.expert_tensor_names.isdisjoint(n for n in tensors if n.startswith("blk.3."))
        assert (
            mf.layout.dense_bytes + mf.layout.row_bytes + mf.layout.total_expert_bytes
            == sum(t.nbytes for t in tensors.values()) - nextn_bytes
        )
        assert mf.layout.nextn_bytes == nextn_bytes
        nextn = [t for n, t in tensors.items() if n.startswith("blk.3.")]
        assert not any(d.offset < t.end and t.offset < d.end for t in nextn for d in mf.layout.dense)  # never read


@pytest.mark.oracle
def test_llama_cpp_loads_the_nextn_block_and_its_tokens_do_not_change(tmp_path):
    from .oracle_checks import llama, llama_greedy

    plain = make_model("glm4moe", "tiny", tmp_path / "plain.gguf", layers=3)
    mtp = make_model("glm4moe", "tiny", tmp_path / "mtp.gguf", layers=3, mtp=True)
    ids = list(oracle.IDS[1])
    assert llama_greedy(llama(mtp), ids, 6) == llama_greedy(llama(plain), ids, 6)


def test_shape_preset_has_the_real_per_expert_bytes(tmp_path):
    """glm45air-shape at full depth (sparse: header and table exact, data a hole):
    GLM-4.5-Air's widths and its Q4_K_M expert bytes. The down projection's rows are
    1408 wide, not a multiple of 256: Q4_K falls back to Q5_0 and Q6_K to Q8_0."""
    path = make_model("glm4moe", "glm45air-shape", tmp_path / "s.gguf", sparse=True)
    with open_model(path) as mf:
        s, lay = mf.spec, mf.layout
        assert (s.n_layer, s.n_embd, s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_ff, s.n_dense_lead) == (46, 4096, 128, 8, 1408, 10944, 1)
        assert (s.n_head, s.n_head_kv[0], s.head_dim_k[0], s.rope.dim, s.n_vocab, s.n_ff_shexp) == (96, 8, 128, 64, 151552, 1408)
        gate = 1408 * 4096 // 256 * 144  # [1408, 4096] Q4_K
        down_q5_0, down_q8_0 = 4096 * 1408 // 32 * 22, 4096 * 1408 // 32 * 34
        assert lay.expert_bytes(0) == 0
        assert {lay.expert_bytes(i) for i in range(1, 46)} == {2 * gate + down_q5_0, 2 * gate + down_q8_0}
        assert lay.routed_bytes_per_token() == sum(8 * lay.expert_bytes(i) for i in range(1, 46))


# What a public load log of a real GLM-4.5-Air GGUF prints of its header (kv 19-31 in
# mostlygeek/llama-swap issue #437).
REAL_AIR_HEADER = {
    "glm4moe.attention.head_count_kv": 8,
    "glm4moe.rope.freq_base": 1000000.0,
    "glm4moe.attention.layer_norm_rms_epsilon": 0.00001,
    "glm4moe.expert_used_count": 8,
    "glm4moe.attention.key_length": 128,
    "glm4moe.attention.value_length": 128,
    "glm4moe.rope.dimension_count": 64,
    "glm4moe.expert_count": 128,
    "glm4moe.expert_feed_forward_length": 1408,
    "glm4moe.expert_shared_count": 1,
    "glm4moe.leading_dense_block_count": 1,
    "glm4moe.expert_gating_func": 2,
    "glm4moe.expert_weights_scale": 1.0,
}


def test_the_air_shape_s_header_has_a_real_file_s_values(tmp_path):
    with made_header("glm4moe", "glm45air-shape", tmp_path) as f:
        assert_published(f, REAL_AIR_HEADER)
