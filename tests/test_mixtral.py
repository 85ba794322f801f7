"""mixtral (GGUF arch `llama` with experts): Llama attention with llama.cpp's
permuted q/k and adjacent-pair RoPE, softmax top-k routing renormalized, a
SentencePiece tokenizer.

Its checkpoints (transformers 5's fused experts and the published per-expert
layout) are held to transformers and llama.cpp with every family's checks in
tests/test_families_oracle.py (its entry in tests/oracle.py). Here: the
converted file's arch, the tokenizer against both, what is refused, the shape
preset; the streaming pipeline is in tests/test_family_pipelines.py
(docs/models.md § mixtral).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import GGUFError, UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.text.tokenizer import Tokenizer

from . import hfmodels, oracle
from . import oracle_checks as checks

TEXTS = (*hfmodels.SAMPLES, "ü€ 😀 naïve café\n", "[INST] hi [/INST]</s><s>x", " leading  spaces", "")

ck = oracle.checkpoints("mixtral")


# -- converted checkpoints --------------------------------------------------------


@pytest.mark.oracle
def test_converted_file_is_llama_with_the_checkpoints_experts(ck):
    with open_model(ck.gguf()) as mf:
        assert mf.spec.arch == "llama" and mf.spec.n_expert == ck.config.build["experts"]


@pytest.mark.oracle
def test_tokenizer_matches_transformers_and_llama_cpp(ck):
    """The tokenizer (SentencePiece, or byte-level BPE): our ids = transformers' on the checkpoint = llama.cpp's on the GGUF."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ck.hf_dir)
    tok = Tokenizer.from_gguf(open_model(ck.gguf()).gguf)
    llm = checks.llama(ck.gguf())
    try:
        for text in TEXTS:
            ours = tok.encode(text)
            assert ours == llm.tokenize(text.encode(), add_bos=True, special=True), repr(text)
            assert tok.encode(text, special=False) == llm.tokenize(text.encode(), add_bos=True, special=False), repr(text)
            if "<s>" not in text:  # transformers' added-token splitting differs from llama.cpp's around specials
                assert ours == hf.encode(text), repr(text)
            if "</s>" not in text and not ck.config.build.get(
                "byte_level"
            ):  # (after a special token llama.cpp adds the dummy prefix again)
                assert tok.decode(ours[1:]) == (" " + text if text else "")  # SentencePiece's dummy prefix shows
    finally:
        llm.close()


@pytest.mark.oracle
def test_a_byte_level_bpe_tokenizer_converts_as_llama_cpps_llama_bpe(tmp_path_factory):
    """A Mixtral checkpoint with a Llama-3-style tokenizer.json (byte-level BPE): written as
    llama.cpp's converter writes it ("gpt2", pre-split "llama-bpe", merges, BOS added); our
    ids = transformers' = llama.cpp's, and greedy tokens are transformers'."""
    from transformers import AutoTokenizer

    ck = oracle.checkpoint("mixtral", "x4k2-byte-level", tmp_path_factory)
    hf = AutoTokenizer.from_pretrained(ck.hf_dir)
    with open_model(ck.gguf()) as mf:
        f = mf.gguf
        assert (f.meta("tokenizer.ggml.model"), f.meta("tokenizer.ggml.pre")) == ("gpt2", "llama-bpe")
        assert f.has("tokenizer.ggml.merges") and not f.has("tokenizer.ggml.scores")
        tok = Tokenizer.from_gguf(f)
        model = load_model(mf)
        ids = tok.encode(hfmodels.SAMPLES[0])[:12]
        greedy = checks.ours_greedy(model, ids, 8)
    llm = checks.llama(ck.gguf())
    try:
        for text in (*TEXTS, "<|begin_of_text|>hi<|eot_id|>x", "12345 3.14"):
            ours = tok.encode(text)
            assert ours == hf.encode(text), repr(text)
            assert ours == llm.tokenize(text.encode(), add_bos=True, special=True), repr(text)
            assert tok.decode(tok.encode(text, special=False)[1:]) == text
    finally:
        llm.close()
    assert greedy == ck.hf_greedy(ids, 8)


def test_convert_refuses_a_sliding_window(tmp_path):
    from moe_pipe.shared.families.mixtral.convert import hparams

    cfg = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128, num_local_experts=4)
    cfg.update(num_experts_per_tok=2, intermediate_size=96, max_position_embeddings=512)
    assert hparams({**cfg, "sliding_window": None})["F"] == 96
    assert hparams({**cfg, "sliding_window": 4096})["Fd"] == 96  # wider than the context: never takes effect
    with pytest.raises(UserError, match="sliding_window 128 is not supported"):
        hparams({**cfg, "sliding_window": 128})


# -- made models, and what is refused ---------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model("llama", "tiny", tmp_path_factory.mktemp("mixtral") / "tiny.gguf")


def _rewrite(src, dst, drop_keys=(), add_tensors=None):
    """A copy of GGUF `src` without `drop_keys`, with `add_tensors` (name -> array) appended."""
    from gguf import GGUFReader, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(str(dst), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in drop_keys:
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, a in (add_tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_a_dense_llama_and_per_expert_tensors_are_refused_by_name(tmp_path):
    src = make_model("llama", "tiny", tmp_path / "m.gguf", layers=1, quant="Q8_0")
    dense = _rewrite(src, tmp_path / "dense.gguf", drop_keys=("llama.expert_count", "llama.expert_used_count"))
    with pytest.raises(GGUFError, match="dense Llama.*Mixture-of-Experts models only") as e:
        open_model(dense)
    assert "\n" not in str(e.value)
    old = _rewrite(src, tmp_path / "old.gguf", add_tensors={"blk.0.ffn_gate.0.weight": np.zeros((256, 256), np.float32)})
    with pytest.raises(GGUFError, match=r"ffn_gate\.E\.weight.*re-convert"):
        open_model(old)


def test_routed_experts_stream_and_the_model_is_deterministic_across_batches(made):
    ids = Tokenizer.from_gguf(open_model(made).gguf).encode(hfmodels.SAMPLES[1])
    with open_model(made) as mf:
        names = mf.layout.expert_tensor_names
        assert names == {f"blk.{i}.ffn_{p}_exps.weight" for i in range(4) for p in ("gate", "up", "down")}
        model = load_model(mf)
        whole = model.forward(ids, model.new_cache(64), all_logits=True)
        cache = model.new_cache(64)
        steps = [model.decode_one(t, cache) for t in ids]
    np.testing.assert_array_equal(np.stack(steps), whole)  # attend_rows: a position computes the same alone or in a batch


def test_shape_preset_has_mixtrals_widths_and_q4_k_m_bytes(tmp_path):
    """mixtral-8x7b-shape at full depth (sparse): Mixtral 8x7B's widths and llama.cpp's
    Q4_K_M for an 8-expert model (attn_k/attn_v Q8_0, attn_output Q5_K)."""
    path = make_model("llama", "mixtral-8x7b-shape", tmp_path / "s.gguf", sparse=True)
    with open_model(path) as mf:
        s, lay, t = mf.spec, mf.layout, mf.gguf.tensors
        assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv[0], s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_vocab) == (
            32,
            4096,
            32,
            8,
            8,
            2,
            14336,
            32000,
        )
        q4k, q6k = 14336 * 4096 // 256 * 144, 14336 * 4096 // 256 * 210  # one [14336, 4096] matrix
        assert {lay.expert_bytes(i) for i in range(32)} == {3 * q4k, 2 * q4k + q6k}
        assert t["blk.0.attn_k.weight"].qtype.name == "Q8_0" and t["blk.0.attn_output.weight"].qtype.name == "Q5_K"


def test_made_model_chat_template_is_mixtrals(made):
    from moe_pipe.shared.text.chat import render_chat

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    with open_model(made) as mf:
        assert render_chat(mf.gguf, messages, add_generation_prompt=True) == "<s>[INST] Hi [/INST]Hello</s>[INST] Bye [/INST]"
        tok = Tokenizer.from_gguf(mf.gguf)
    assert tok.eog_ids == {2}
