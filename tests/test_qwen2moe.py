"""qwen2moe (Qwen1.5-MoE / Qwen2-MoE): attention with q/k/v biases, NEOX RoPE, softmax
top-k renormalized only when `norm_topk_prob` (Qwen1.5-MoE: not), and a shared expert
behind a sigmoid gate.

Oracles: transformers on tiny random models converted by `moe-pipe convert` (the
published per-expert layout and transformers 5's fused one; norm_topk_prob false and
true; biases and none), llama.cpp on the same converted GGUFs and on a made model.
Then what is refused, the shape preset, and the streaming pipeline (in tests/test_family_pipelines.py) against the
resident reference (docs/models.md § qwen2moe).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.text.tokenizer import Tokenizer

from . import hfmodels

N_GREEDY = 32


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


def _llama_greedy(llm, ids, n):
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


# -- transformers ----------------------------------------------------------------

CONFIGS = {
    "plain": dict(),  # Qwen1.5-MoE's routing (no renormalization), biases, GQA, per-expert checkpoint
    "norm-fused": dict(norm_topk_prob=True, fused=True),  # Qwen2-style renormalized top-k; transformers 5's fused experts
    "nobias-mha": dict(qkv_bias=False, num_key_value_heads=4, num_experts_per_tok=4),  # zero biases written; MHA as Qwen1.5
}


@pytest.fixture(
    scope="module", params=["plain", pytest.param("norm-fused", marks=pytest.mark.slow), pytest.param("nobias-mha", marks=pytest.mark.slow)]
)
def pair(request, tmp_path_factory):
    pytest.importorskip("torch", reason="oracle tests need torch (pip install '.[oracle]')")
    pytest.importorskip("transformers", reason="oracle tests need transformers (pip install '.[oracle]')")
    from moe_pipe.shared.convert.converter import convert

    root = tmp_path_factory.mktemp(f"qwen2moe-{request.param}")
    hf_dir = hfmodels.build("qwen2moe", root / "hf", **CONFIGS[request.param])
    ref = hfmodels.load_model(hf_dir)
    ggufs = {"f32": convert(hf_dir, root / "m-f32.gguf", outtype="f32")}  # q8_0: converted by its (slow) test
    prompts = [Tokenizer.from_gguf(open_model(ggufs["f32"]).gguf).encode(t) for t in hfmodels.SAMPLES]
    return request.param, hf_dir, ref, ggufs, prompts


@pytest.mark.oracle
def test_f32_logits_match_transformers(pair):
    """Every position's logits on the 3 prompts, and (CI time) 8 greedy tokens on the first."""
    name, _, ref, ggufs, prompts = pair
    with open_model(ggufs["f32"]) as mf:
        s = mf.spec
        assert s.arch == "qwen2moe" and s.expert_weights_norm == (name == "norm-fused") and s.n_ff_shexp == 96
        model = load_model(mf)
        for ids in prompts:
            want = hfmodels.hf_logits(ref, ids)
            got = model.forward(ids, model.new_cache(128), all_logits=True)
            rel = np.abs(got - want).max() / np.abs(want).max()
            assert rel < 1e-4, f"{name}: logits differ by {rel:.2e} relative (prompt {ids[:5]}...)"
        assert ours_greedy(model, prompts[0], 8) == hfmodels.hf_greedy(ref, prompts[0], 8), f"{name}: greedy tokens differ"


@pytest.mark.oracle
@pytest.mark.slow
def test_f32_greedy_matches_transformers_for_32_tokens(pair):
    name, _, ref, ggufs, prompts = pair
    with open_model(ggufs["f32"]) as mf:
        model = load_model(mf)
        for ids in prompts:
            assert ours_greedy(model, ids, N_GREEDY) == hfmodels.hf_greedy(ref, ids, N_GREEDY), f"{name}: greedy tokens differ"


@pytest.mark.oracle
@pytest.mark.slow
def test_renormalization_is_what_separates_the_configs(pair):
    """The flag matters on these models: flipping transformers' norm_topk_prob moves its
    logits far beyond the 1e-4 both settings are matched to above."""
    _, _, ref, _, prompts = pair
    gates = [layer.mlp.gate for layer in ref.model.layers]
    want = hfmodels.hf_logits(ref, prompts[0])
    for g in gates:
        g.norm_topk_prob = not g.norm_topk_prob
    try:
        flipped = hfmodels.hf_logits(ref, prompts[0])
    finally:
        for g in gates:
            g.norm_topk_prob = not g.norm_topk_prob
    assert np.abs(flipped - want).max() / np.abs(want).max() > 1e-2


@pytest.mark.oracle
@pytest.mark.slow
def test_q8_0_logits_stay_close_to_transformers(pair, tmp_path):
    """q8_0 weights, f32 activations: within the 0.1 relative bound of the original families (tests/test_convert.py)."""
    from moe_pipe.shared.convert.converter import convert

    name, hf_dir, ref, _, prompts = pair
    with open_model(convert(hf_dir, tmp_path / "m-q8_0.gguf", outtype="q8_0")) as mf:
        model = load_model(mf)
        for ids in prompts:
            want = hfmodels.hf_logits(ref, ids)[-1]
            got = model.forward(ids, model.new_cache(128))[-1]
            assert np.abs(got - want).max() / np.abs(want).max() < 0.1, name
            assert int(np.argmax(got)) == int(np.argmax(want)), name


@pytest.mark.oracle
def test_llama_cpp_greedy_tokens_match_ours_on_converted_model(pair):
    """llama.cpp's qwen2moe graph never renormalizes: a file that says expert_weights_norm
    (norm-fused) runs differently there, so only the others are compared."""
    name, _, _, ggufs, prompts = pair
    if name == "norm-fused":
        pytest.skip("llama.cpp ignores expert_weights_norm for qwen2moe (docs/models.md § qwen2moe)")
    llm = _llama(ggufs["f32"])
    try:
        with open_model(ggufs["f32"]) as mf:
            model = load_model(mf)
            for ids in prompts:
                assert ours_greedy(model, ids, 16) == _llama_greedy(llm, ids, 16), f"{name}: greedy tokens differ from llama.cpp"
    finally:
        llm.close()


@pytest.mark.oracle
@pytest.mark.slow
def test_tokenizer_matches_transformers_and_llama_cpp(pair):
    from transformers import AutoTokenizer

    _, hf_dir, _, ggufs, _ = pair
    hf = AutoTokenizer.from_pretrained(hf_dir)
    with open_model(ggufs["f32"]) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        assert mf.gguf.meta("tokenizer.ggml.pre") == "qwen2"
    llm = _llama(ggufs["f32"])
    try:
        for text in (*hfmodels.SAMPLES, "ü€ 😀 naïve café\n", "<|im_start|>user\nhi<|im_end|>", ""):
            ours = tok.encode(text)
            assert ours == hf.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), repr(text)
    finally:
        llm.close()


def test_convert_refuses_dense_layers_sliding_windows_and_no_shared_expert():
    from moe_pipe.shared.convert.qwen2moe import hparams

    cfg = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=128, num_experts=4, num_experts_per_tok=2)
    cfg.update(moe_intermediate_size=32, shared_expert_intermediate_size=96, intermediate_size=96)
    hp = hparams({**cfg, "decoder_sparse_step": 1, "mlp_only_layers": []})
    assert (hp["F"], hp["Fs"], hp["norm"], hp["bias"]) == (32, 96, False, True)
    with pytest.raises(UserError, match="dense layers.*1 of 4 layers"):
        hparams({**cfg, "mlp_only_layers": [2]})
    with pytest.raises(UserError, match="dense layers.*2 of 4 layers"):
        hparams({**cfg, "decoder_sparse_step": 2})
    with pytest.raises(UserError, match="sliding-window"):
        hparams({**cfg, "use_sliding_window": True})
    with pytest.raises(UserError, match="without a shared expert"):
        hparams({**cfg, "shared_expert_intermediate_size": 0})


# -- made models -------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model("qwen2moe", "tiny", tmp_path_factory.mktemp("qwen2moe") / "tiny.gguf")


@pytest.mark.oracle
@pytest.mark.slow
def test_llama_cpp_agrees_on_made_f32_model(tmp_path):
    path = make_model("qwen2moe", "tiny", tmp_path / "m.gguf", quant="F32")
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


def test_only_routed_experts_stream_and_batches_equal_decode_steps(made):
    ids = Tokenizer.from_gguf(open_model(made).gguf).encode(hfmodels.SAMPLES[1])
    with open_model(made) as mf:
        assert mf.layout.expert_tensor_names == {f"blk.{i}.ffn_{p}_exps.weight" for i in range(4) for p in ("gate", "up", "down")}
        model = load_model(mf)
        whole = model.forward(ids, model.new_cache(64), all_logits=True)
        cache = model.new_cache(64)
        steps = [model.decode_one(t, cache) for t in ids]
    np.testing.assert_array_equal(np.stack(steps), whole)  # attend_rows: a position computes the same alone or in a batch


def test_a_file_from_before_the_expert_width_keys_reads_as_llama_cpp_does(tmp_path):
    """Files llama.cpp's converter wrote before 2024-06 (the official Qwen1.5-MoE GGUFs) have
    no expert_feed_forward_length / expert_shared_feed_forward_length: the experts are then
    feed_forward_length / expert_used_count wide and the shared expert feed_forward_length."""
    from gguf import GGUFReader, GGUFWriter

    src = make_model("qwen2moe", "tiny", tmp_path / "m.gguf", layers=1, quant="Q8_0", _overrides=dict(n_ff=512, n_ff_shexp=512))
    r = GGUFReader(src)
    w = GGUFWriter(str(tmp_path / "old.gguf"), "qwen2moe")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or "_feed_forward_length" in f.name:
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open_model(src) as a, open_model(tmp_path / "old.gguf") as b:
        assert (b.spec.n_ff_exp, b.spec.n_ff_shexp) == (a.spec.n_ff_exp, a.spec.n_ff_shexp) == (128, 512)
        ma, mb = load_model(a), load_model(b)
        ids = [5, 17, 300, 9]
        np.testing.assert_array_equal(ma.forward(ids, ma.new_cache(8)), mb.forward(ids, mb.new_cache(8)))


def test_shape_preset_has_qwen15_moe_widths_and_q4_k_m_bytes(tmp_path):
    """qwen15-moe-shape at full depth (sparse): Qwen1.5-MoE-A2.7B's widths, and llama.cpp's Q4_K_M
    on its 1408-wide experts: gate and up Q4_K; down's 1408-value rows are not whole Q4_K/Q6_K
    blocks, so it falls back to Q5_0, or Q8_0 on the "more bits" layers. inspect prints them."""
    from moe_pipe.cli.inspect_cmd import summary

    path = make_model("qwen2moe", "qwen15-moe-shape", tmp_path / "s.gguf", sparse=True)
    with open_model(path) as mf:
        s, lay, t = mf.spec, mf.layout, mf.gguf.tensors
        assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv[0], s.n_expert, s.n_expert_used) == (24, 2048, 16, 16, 60, 4)
        assert (s.n_ff_exp, s.n_ff_shexp, s.n_vocab, s.expert_weights_norm) == (1408, 5632, 151936, False)
        q4k = 1408 * 2048 // 256 * 144  # gate or up: 1408 rows of 2048
        q5_0, q8_0 = 2048 * 1408 // 32 * 22, 2048 * 1408 // 32 * 34  # down: 2048 rows of 1408
        per_layer = [lay.expert_bytes(i) for i in range(24)]
        assert set(per_layer) == {2 * q4k + q5_0, 2 * q4k + q8_0}
        assert t["blk.0.ffn_down_exps.weight"].qtype.name == "Q8_0" and t["blk.3.ffn_down_exps.weight"].qtype.name == "Q5_0"
        assert t["blk.0.ffn_down_shexp.weight"].qtype.name == "Q6_K" and t["blk.0.ffn_gate_inp_shexp.weight"].qtype.name == "F32"
        assert lay.expert_tensor_names.isdisjoint(n for n in t if "shexp" in n)
        info = summary(mf)  # what `moe-pipe inspect` prints
    assert info["arch"] == "qwen2moe" and info["expert_bytes_per_layer"] == per_layer
    assert info["routed_bytes_per_token"] == 4 * sum(per_layer)


def test_made_model_chat_template_is_qwen15_chatml_and_ends_on_im_end(made):
    from moe_pipe.shared.text.chat import render_chat

    with open_model(made) as mf:
        text = render_chat(mf.gguf, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        tok = Tokenizer.from_gguf(mf.gguf)
    assert text == "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert {tok.decode([i]) for i in tok.eog_ids} >= {"<|im_end|>", "<|endoftext|>"}
