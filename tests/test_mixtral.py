"""mixtral (GGUF arch `llama` with experts): Llama attention with llama.cpp's
permuted q/k and adjacent-pair RoPE, softmax top-k routing renormalized, a
SentencePiece tokenizer.

Oracles: transformers on tiny random models converted by `moe-pipe convert`
(transformers 5's fused experts and the published per-expert layout),
llama.cpp on the same converted GGUFs and on made models (tokens and
tokenizer). Then what is refused, the shape preset, and the streaming pipeline
(tests/test_family_pipelines.py) against the resident reference (docs/models.md § mixtral).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import GGUFError, UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.text.tokenizer import Tokenizer

from . import hfmodels

N_GREEDY = 32
TEXTS = (*hfmodels.SAMPLES, "ü€ 😀 naïve café\n", "[INST] hi [/INST]</s><s>x", " leading  spaces", "")


def ours_greedy(model, ids, n):
    cache = model.new_cache(len(ids) + n + 1)
    logits, out = model.prefill(ids, cache), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode_one(out[-1], cache)
    return out


def _llama(path, **kw):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional extra)")
    return llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0, flash_attn=False, **kw)


# -- transformers ----------------------------------------------------------------

CONFIGS = {
    "x4k2": dict(experts=4, used=2),  # GQA, 2 of 4
    "x8k4-per-expert": dict(experts=8, used=4, per_expert=True),  # 4 of 8, the published checkpoint layout
}


@pytest.fixture(scope="module", params=["x4k2", pytest.param("x8k4-per-expert", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    pytest.importorskip("torch", reason="oracle tests need torch (pip install '.[oracle]')")
    pytest.importorskip("transformers", reason="oracle tests need transformers (pip install '.[oracle]')")
    from moe_pipe.shared.convert.converter import convert

    root = tmp_path_factory.mktemp(f"mixtral-{request.param}")
    hf_dir = hfmodels.build("mixtral", root / "hf", **CONFIGS[request.param])
    ref = hfmodels.load_model(hf_dir)
    ggufs = {t: convert(hf_dir, root / f"m-{t}.gguf", outtype=t) for t in ("f32", "q8_0")}
    prompts = [Tokenizer.from_gguf(open_model(ggufs["f32"]).gguf).encode(t)[:12] for t in hfmodels.SAMPLES]  # short: CI time
    return request.param, hf_dir, ref, ggufs, prompts


@pytest.mark.oracle
def test_f32_logits_and_greedy_match_transformers(pair):
    name, _, ref, ggufs, prompts = pair
    with open_model(ggufs["f32"]) as mf:
        assert mf.spec.arch == "llama" and mf.spec.n_expert == CONFIGS[name]["experts"]
        model = load_model(mf)
        for ids in prompts:
            want = hfmodels.hf_logits(ref, ids)
            got = model.forward(ids, model.new_cache(128), all_logits=True)
            rel = np.abs(got - want).max() / np.abs(want).max()
            assert rel < 1e-4, f"{name}: logits differ by {rel:.2e} relative (prompt {ids[:5]}...)"
            assert ours_greedy(model, ids, N_GREEDY) == hfmodels.hf_greedy(ref, ids, N_GREEDY), f"{name}: greedy tokens differ"


@pytest.mark.oracle
@pytest.mark.slow
def test_q8_0_logits_stay_close_to_transformers(pair):
    """q8_0 weights, f32 activations: within the 0.1 relative bound of the original families (tests/test_convert.py)."""
    name, _, ref, ggufs, prompts = pair
    with open_model(ggufs["q8_0"]) as mf:
        model = load_model(mf)
        for ids in prompts:
            want = hfmodels.hf_logits(ref, ids)[-1]
            got = model.forward(ids, model.new_cache(128))[-1]
            assert np.abs(got - want).max() / np.abs(want).max() < 0.1, name
            assert int(np.argmax(got)) == int(np.argmax(want)), name


@pytest.mark.oracle
def test_tokenizer_matches_transformers_and_llama_cpp(pair):
    """The SentencePiece tokenizer: our ids = transformers' on the checkpoint = llama.cpp's on the GGUF."""
    from transformers import AutoTokenizer

    _, hf_dir, _, ggufs, _ = pair
    hf = AutoTokenizer.from_pretrained(hf_dir)
    tok = Tokenizer.from_gguf(open_model(ggufs["f32"]).gguf)
    llm = _llama(ggufs["f32"])
    try:
        for text in TEXTS:
            ours = tok.encode(text)
            assert ours == llm.tokenize(text.encode(), add_bos=True, special=True), repr(text)
            assert tok.encode(text, special=False) == llm.tokenize(text.encode(), add_bos=True, special=False), repr(text)
            if "<s>" not in text:  # transformers' added-token splitting differs from llama.cpp's around specials
                assert ours == hf.encode(text), repr(text)
            if "</s>" not in text:  # (after a special token llama.cpp adds the dummy prefix again)
                assert tok.decode(ours[1:]) == (" " + text if text else "")  # SentencePiece's dummy prefix shows
    finally:
        llm.close()


@pytest.mark.oracle
def test_llama_cpp_greedy_tokens_match_ours_on_converted_model(pair):
    name, _, _, ggufs, prompts = pair
    llm = _llama(ggufs["f32"])
    try:
        with open_model(ggufs["f32"]) as mf:
            model = load_model(mf)
            for ids in prompts:
                llm.reset()
                llm.eval(ids)
                theirs = []
                for _ in range(16):
                    theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                    llm.eval([theirs[-1]])
                assert ours_greedy(model, ids, 16) == theirs, f"{name}: greedy tokens differ from llama.cpp"
    finally:
        llm.close()


def test_convert_refuses_a_sliding_window(tmp_path):
    from moe_pipe.shared.convert.mixtral import hparams

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


@pytest.mark.oracle
@pytest.mark.slow
def test_llama_cpp_agrees_on_made_f32_model(tmp_path):
    path = make_model("llama", "tiny", tmp_path / "m.gguf", quant="F32")
    ids = Tokenizer.from_gguf(open_model(path).gguf).encode(hfmodels.SAMPLES[0])
    with open_model(path) as mf:
        model = load_model(mf)
        ours = model.forward(ids, model.new_cache(64), all_logits=True)
    llm = _llama(path)
    try:
        llm.eval(ids)
        ref = np.asarray(llm.scores[: len(ids)])
    finally:
        llm.close()
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


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
