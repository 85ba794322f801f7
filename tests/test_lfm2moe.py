"""lfm2moe (LFM2-8B-A1B): short-conv + attention hybrid, leading dense layers,
sigmoid routing with a selection-only expert bias.

Its checkpoints (the conv/attention pattern, leading dense layers, the expert bias
on and off, the published per-expert layout and the fused one) are held to
transformers and llama.cpp with every family's checks in
tests/test_families_oracle.py (its entry in tests/oracle.py). Here: the converted
spec, the tokenizer against llama.cpp, what the converter refuses, the conv state
(batches, reuse rules, budget), the made shape preset; the streaming pipeline is
in tests/test_family_pipelines.py (docs/models.md § lfm2moe).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.spec import kv_cache_bytes, recurrent_state_bytes
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

from . import hfmodels, oracle
from . import oracle_checks as checks

PROMPTS = [list(p) for p in oracle.ORACLES["lfm2moe"].prompts.ids]

ck = oracle.checkpoints("lfm2moe")


# -- converted checkpoints --------------------------------------------------------


@pytest.mark.oracle
def test_converted_spec_has_the_configs_layers_and_expert_bias(ck):
    build = ck.config.build
    with open_model(ck.gguf()) as mf:
        s = mf.spec
        layer_types = build.get("layer_types") or hfmodels.lfm2moe_config(64)["layer_types"]
        assert s.recurrent_layers == tuple(t == "conv" for t in layer_types)
        assert s.n_dense_lead == build.get("num_dense_layers", 1) and s.expert_gating == "sigmoid"
        # without the expert bias the file carries zeros (llama.cpp requires the tensor)
        bias = mf.gguf.view("blk.4.exp_probs_b.bias").view(np.float32)
        assert bool(bias.any()) == build.get("use_expert_bias", True)


@pytest.mark.oracle
def test_tokenizer_matches_llama_cpp_on_converted_model(ck):
    """llama.cpp's lfm2 pre-split (llama3's, 1-3 digit groups) and its BOS."""
    from moe_pipe.shared.text.tokenizer import Tokenizer

    llm = checks.llama(ck.gguf())
    try:
        with open_model(ck.gguf()) as mf:
            tok = Tokenizer.from_gguf(mf.gguf)
            assert mf.gguf.meta("tokenizer.ggml.pre") == "lfm2"
        for text in hfmodels.SAMPLES:
            assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=False), text
    finally:
        llm.close()


def test_converter_refuses_what_llama_cpp_cannot_express():
    from moe_pipe.shared.families.lfm2moe.convert import hparams

    base = hfmodels.lfm2moe_config(128)
    for change, word in (
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(routed_scaling_factor=2.0), "routed_scaling_factor"),
        (dict(conv_bias=True), "conv_bias"),
        (dict(layer_types=["conv"] * 4), "layer_types"),
        (dict(layer_types=["conv"] * 5), "full_attention"),
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
