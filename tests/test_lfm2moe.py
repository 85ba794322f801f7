"""lfm2moe (LFM2-8B-A1B): short-conv + attention hybrid, leading dense layers,
sigmoid routing with a selection-only expert bias.

Oracles: transformers on tiny random models converted by `moe-pipe convert`
(the conv/attention pattern, leading dense layers, the expert bias on and off,
the published per-expert checkpoint layout and the fused one), llama.cpp on the same GGUFs and on
a made model. Then the conv state (batches, reuse rules, budget), the made shape
preset, and the streaming pipeline (in tests/test_family_pipelines.py) against the resident reference, on the
make-model tiny preset (docs/models.md § lfm2moe).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.spec import kv_cache_bytes, recurrent_state_bytes
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

from . import hfmodels

PROMPTS = [
    [1, *range(3, 40, 3)],
    [1, 5, 17, 2, 99, 140, 7, 7, 7, 30],
    [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
]
N_GREEDY = 32

# name -> (config overrides, slow?): the default one has a dense layer 0, conv/attention
# alternating and the expert bias; the others turn the bias off, put attention first
# and two dense layers, or fuse the experts. transformers 5.24 saves them one by one as
# the published checkpoint does (w1, w3, w2 per expert); the fused form is its in-memory one.
CONFIGS = {
    "bias": ({}, False),
    "nobias-dense2": (
        dict(use_expert_bias=False, num_dense_layers=2, layer_types=["full_attention", "conv", "conv", "full_attention", "conv"]),
        True,
    ),
    "fused": ({}, True),
}


def ours_greedy(model, ids, n):
    cache = model.new_cache(len(ids) + n + 1)
    logits, out = model.prefill(ids, cache), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode_one(out[-1], cache)
    return out


def _fuse_experts(hf_dir, n_layer: int, lead: int) -> None:
    """Rewrite the saved per-expert w1 (gate), w3 (up), w2 (down) tensors as transformers
    5's fused `gate_up_proj` (X, 2F, D), gate rows first, and `down_proj` (X, D, F)."""
    from safetensors.numpy import load_file, save_file

    path = hf_dir / "model.safetensors"
    sd = load_file(path)
    n_expert = json.loads((hf_dir / "config.json").read_text())["num_experts"]
    for i in range(lead, n_layer):
        e = f"model.layers.{i}.feed_forward.experts."
        per = [[sd.pop(f"{e}{x}.{w}.weight") for w in ("w1", "w3", "w2")] for x in range(n_expert)]
        sd[e + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u, _ in per])
        sd[e + "down_proj"] = np.stack([d for _, _, d in per])
    save_file(sd, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=[pytest.param(k, marks=[pytest.mark.slow] if slow else []) for k, (_, slow) in CONFIGS.items()])
def pair(request, tmp_path_factory):
    torch = pytest.importorskip("torch", reason="oracle tests need torch (pip install '.[oracle]')")
    pytest.importorskip("transformers", reason="oracle tests need transformers (pip install '.[oracle]')")
    from moe_pipe.shared.convert.converter import convert

    # One torch thread: this model's ops are tiny, and two threads on a loaded 2-core
    # machine made transformers' decode ~10x slower (0.3 s a token, 0.03 s on one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    name = request.param
    root = tmp_path_factory.mktemp(f"lfm2-{name}")
    hf_dir = hfmodels.build("lfm2moe", root / "hf", **CONFIGS[name][0])
    ref = hfmodels.load_model(hf_dir)
    if name == "fused":
        cfg = json.loads((hf_dir / "config.json").read_text())
        _fuse_experts(hf_dir, cfg["num_hidden_layers"], cfg["num_dense_layers"])
    try:
        yield name, ref, convert(hf_dir, root / "m-f32.gguf", outtype="f32"), hf_dir
    finally:
        torch.set_num_threads(threads)


@pytest.mark.oracle
def test_f32_logits_and_greedy_match_transformers(pair):
    """Prefill logits, and 32 tokens decoded one at a time (transformers' cached conv
    path against our conv state)."""
    name, ref, f32, _ = pair
    with open_model(f32) as mf:
        s = mf.spec
        layer_types = CONFIGS[name][0].get("layer_types") or hfmodels.lfm2moe_config(64)["layer_types"]
        assert s.recurrent_layers == tuple(t == "conv" for t in layer_types)
        assert s.n_dense_lead == CONFIGS[name][0].get("num_dense_layers", 1) and s.expert_gating == "sigmoid"
        # without the expert bias the file carries zeros (llama.cpp requires the tensor)
        bias = mf.gguf.view("blk.4.exp_probs_b.bias").view(np.float32)
        assert bool(bias.any()) == CONFIGS[name][0].get("use_expert_bias", True)
        model = load_model(mf)
        for ids in PROMPTS:
            want = hfmodels.hf_logits(ref, ids)
            got = model.forward(ids, model.new_cache(64), all_logits=True)
            rel = np.abs(got - want).max() / np.abs(want).max()
            assert rel < 1e-4, f"{name}: logits differ by {rel:.2e} relative (prompt {ids[:5]}...)"
        # the other prompts' greedy runs are slow-tier (CI time)
        ids = PROMPTS[0]
        assert ours_greedy(model, ids, N_GREEDY) == hfmodels.hf_greedy(ref, ids, N_GREEDY), f"{name}: greedy tokens differ"


@pytest.mark.oracle
@pytest.mark.slow
def test_f32_greedy_matches_transformers_on_the_other_prompts(pair):
    name, ref, f32, _ = pair
    with open_model(f32) as mf:
        model = load_model(mf)
        for ids in PROMPTS[1:]:
            assert ours_greedy(model, ids, N_GREEDY) == hfmodels.hf_greedy(ref, ids, N_GREEDY), f"{name}: greedy tokens differ"


@pytest.mark.oracle
@pytest.mark.slow
def test_q8_0_logits_stay_close_to_transformers(pair, tmp_path):
    """q8_0 weights: within the 0.1 relative bound the first families state, or, where
    rounding flips a near-tied expert choice (nobias-dense2's third prompt: 0.28, in
    llama.cpp as much), no further from transformers than llama.cpp's q8_0 of the file."""
    from moe_pipe.shared.convert.converter import convert

    name, ref, _, hf_dir = pair
    path = convert(hf_dir, tmp_path / "m-q8_0.gguf", outtype="q8_0")
    with open_model(path) as mf:
        model = load_model(mf)
        for ids in PROMPTS:
            want = hfmodels.hf_logits(ref, ids)[-1]
            ours = np.abs(model.forward(ids, model.new_cache(64))[-1] - want).max() / np.abs(want).max()
            if ours < 0.1:
                continue
            llama_cpp = pytest.importorskip("llama_cpp", reason=f"{name}: q8_0 off by {ours:.2f}; llama.cpp would say if it is too")
            llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0, flash_attn=False)
            try:
                llm.eval(ids)
                theirs = np.abs(np.array(llm.scores[len(ids) - 1]) - want).max() / np.abs(want).max()
            finally:
                llm.close()
            assert ours <= 1.1 * theirs, f"{name}: q8_0 off by {ours:.3f}, llama.cpp's by {theirs:.3f}"


@pytest.mark.oracle
def test_llama_cpp_greedy_tokens_and_tokenizer_match_ours_on_converted_model(pair):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional extra)")
    from moe_pipe.shared.text.tokenizer import Tokenizer

    name, _, f32, _ = pair
    llm = llama_cpp.Llama(str(f32), n_ctx=128, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0, flash_attn=False)
    try:
        with open_model(f32) as mf:
            model, tok = load_model(mf), Tokenizer.from_gguf(mf.gguf)
            assert mf.gguf.meta("tokenizer.ggml.pre") == "lfm2"
            for text in hfmodels.SAMPLES:  # llama.cpp's lfm2 pre-split (llama3's, 1-3 digit groups) and its BOS
                assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=False), text
            for ids in PROMPTS:
                llm.reset()
                llm.eval(ids)
                theirs = []
                for _ in range(16):
                    theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                    llm.eval([theirs[-1]])
                assert ours_greedy(model, ids, 16) == theirs, f"{name}: greedy tokens differ from llama.cpp"
    finally:
        llm.close()


def test_converter_refuses_what_llama_cpp_cannot_express():
    from moe_pipe.shared.convert.lfm2moe import hparams

    base = hfmodels.lfm2moe_config(128)
    for change, word in (
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(routed_scaling_factor=2.0), "routed_scaling_factor"),
        (dict(conv_bias=True), "conv_bias"),
        (dict(layer_types=["conv"] * 4), "layer_types"),
        (dict(layer_types=["conv", "sliding_attention", "conv", "conv", "conv"]), "sliding_attention"),
    ):
        with pytest.raises(UserError, match=word):
            hparams({**base, **change})
    cfg = {k: v for k, v in base.items() if k != "layer_types"}
    assert hparams({**cfg, "full_attn_idxs": [1, 3]})["conv"] == [True, False, True, False, True]


# -- the conv state ----------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """make-model's tiny preset: conv, attention, conv, attention; layer 0 dense; Q4_K_M mix."""
    return make_model("lfm2moe", "tiny", tmp_path_factory.mktemp("lfm2-made") / "tiny.gguf")


@pytest.mark.slow
def test_batches_and_decode_steps_equal_one_prefill(made):
    """The conv state carries across prompt batches and decode steps: logits of one
    batch = batches of 4 = decode steps one at a time."""
    ids = PROMPTS[2]
    with open_model(made) as mf:
        model = load_model(mf)
        whole = model.forward(ids, model.new_cache(32), all_logits=True)
        batched = model.prefill(ids, model.new_cache(32), batch=4)
        cache = model.new_cache(32)
        steps = [model.decode_one(t, cache) for t in ids]
    np.testing.assert_allclose(batched, whole[-1], rtol=0, atol=1e-4 * np.abs(whole).max())
    np.testing.assert_allclose(np.stack(steps), whole, rtol=0, atol=1e-4 * np.abs(whole).max())


@pytest.mark.slow
def test_budget_counts_the_conv_state_and_kv_of_attention_layers_only(made):
    with open_model(made) as mf:
        s = mf.spec
        assert s.recurrent_layers == (True, False, True, False) and s.n_dense_lead == 1
        cache = load_model(mf).new_cache(100, "f32")
        attn = [i for i in range(s.n_layer) if not s.is_recurrent(i)]
        kv = 100 * sum(s.n_head_kv[i] * (s.head_dim_k[i] + s.head_dim_v[i]) for i in attn) * 4
        # 2 conv layers, each the last L-1 = 2 inputs of its 256 channels, float32
        assert recurrent_state_bytes(s) == 2 * 2 * 256 * 4 == cache.state.nbytes
        assert kv_cache_bytes(s, 100, "f32") == kv + cache.state.nbytes
        assert kv == sum(a.nbytes for a in cache.parts())
        # nothing of the dense layer 0 streams
        assert mf.layout.expert_tensor_names == {f"blk.{i}.ffn_{p}_exps.weight" for i in range(1, 4) for p in ("gate", "up", "down")}


@pytest.mark.slow
def test_conversations_reuse_a_whole_cache_or_none_and_sessions_are_refused(made, tmp_path):
    """Prefix reuse (docs/conversations.md): as for qwen35moe, the conv state cannot be
    rewound, so a prompt that extends the whole cache continues from it and one that
    leaves it part way recomputes from 0; each gives the tokens of a fresh run; saving
    a session is refused in one line."""
    from moe_pipe.shared.model.session import Session, save_session
    from moe_pipe.shared.text.generate import GenerationConfig, generate
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    def run(model, tok, prompt, n, session=None):
        cfg = GenerationConfig(max_tokens=n, n_ctx=64, ignore_eos=True, prefill_batch=1)
        return generate(model, tok, prompt, SamplingParams(), cfg, session=session)

    with open_model(made) as mf:
        model, tok = load_model(mf), Tokenizer.from_gguf(mf.gguf)
        first, session = PROMPTS[1], Session()
        turn1 = run(model, tok, first, 6, session)
        extended = first + turn1.tokens + PROMPTS[2][1:]
        turn2 = run(model, tok, extended, 6, session)
        assert turn2.timings["prompt_cached"] == len(first) + len(turn1.tokens) - 1
        assert turn2.tokens == run(model, tok, extended, 6).tokens
        diverged = first[:3] + PROMPTS[0][1:]
        turn3 = run(model, tok, diverged, 6, session)
        assert turn3.timings["prompt_cached"] == 0
        assert turn3.tokens == run(model, tok, diverged, 6).tokens
        with pytest.raises(UserError) as e:
            save_session(tmp_path / "s.bin", session, ("x",), arch="lfm2moe")
        assert "\n" not in str(e.value) and "lfm2moe" in str(e.value)


# -- make-model --------------------------------------------------------------------


@pytest.mark.oracle
@pytest.mark.slow
def test_llama_cpp_loads_made_model_and_agrees_on_f32(tmp_path):
    """The made file is what llama.cpp reads as lfm2moe: per-layer kv heads (0 = short
    conv), token_embd_norm, the tied head, the "lfm2" tokenizer with its BOS."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional extra)")
    from moe_pipe.shared.text.tokenizer import Tokenizer

    path = make_model("lfm2moe", "tiny", tmp_path / "m.gguf", quant="F32")
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0, flash_attn=False)
    try:
        with open_model(path) as mf:
            model, tok = load_model(mf), Tokenizer.from_gguf(mf.gguf)
            text = "The history of the city begins"
            ids = tok.encode(text)
            assert ids[0] == 1 and ids == llm.tokenize(text.encode(), add_bos=True, special=False)
            llm.eval(ids)
            theirs = []
            for _ in range(16):
                theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([theirs[-1]])
            assert ours_greedy(model, ids, 16) == theirs
    finally:
        llm.close()


@pytest.mark.slow
def test_shape_preset_has_the_real_per_expert_bytes(tmp_path):
    """lfm2-8b-shape: LFM2-8B-A1B's 24 layers (attention at 2, 6, 10, 14, 18, 21), two
    dense, 32 experts of 1792 in Q4_K_M: gate and up Q4_K, down Q6_K on llama.cpp's
    more-bits layers; the head tied to a Q6_K token_embd."""
    path = make_model("lfm2moe", "lfm2-8b-shape", tmp_path / "s.gguf", sparse=True)
    with open_model(path) as mf:
        s, lay = mf.spec, mf.layout
        assert s.recurrent_layers == tuple(i not in (2, 6, 10, 14, 18, 21) for i in range(24))
        assert (s.n_dense_lead, s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_ff) == (2, 32, 4, 1792, 7168)
        assert s.tied_output and mf.gguf.tensors["token_embd.weight"].qtype.name == "Q6_K"
        q4 = 1792 * 2048 // 256 * 144  # one Q4_K matrix of 1792 × 2048
        sizes = {i: lay.expert_bytes(i) for i in s.moe_layers}
        assert sizes[3] == 3 * q4 and sizes[2] == 2 * q4 + 2048 * 1792 // 256 * 210  # layer 2: down Q6_K
        assert sorted(i for i, b in sizes.items() if b != 3 * q4) == [2, 5, 8, 11, 14, 17, 20, 21, 22, 23]


def test_made_model_chat_template_and_end_of_generation(made):
    from moe_pipe.shared.text.chat import render_chat
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(made) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        text = render_chat(mf.gguf, [{"role": "user", "content": "Hi"}])
        assert text == "<|startoftext|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert tok.is_eog(7) and tok.encode("Hi")[0] == 1
