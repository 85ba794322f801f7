"""qwen2moe (Qwen1.5-MoE / Qwen2-MoE): attention with q/k/v biases, NEOX RoPE, softmax
top-k renormalized only when `norm_topk_prob` (Qwen1.5-MoE: not), and a shared expert
behind a sigmoid gate.

Its checkpoints (the published per-expert layout and transformers 5's fused one;
norm_topk_prob false and true; biases and none) are held to transformers and llama.cpp
with every family's checks in tests/test_families_oracle.py (its entry in
tests/oracle.py). Here: the converted spec, that the renormalization flag matters, the
tokenizer, what is refused, the shape preset; the streaming pipeline is in
tests/test_family_pipelines.py (docs/models.md § qwen2moe).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.text.tokenizer import Tokenizer

from . import hfmodels, oracle
from . import oracle_checks as checks

ck = oracle.checkpoints("qwen2moe")


# -- converted checkpoints --------------------------------------------------------


@pytest.mark.oracle
def test_converted_spec_says_whether_to_renormalize(ck):
    with open_model(ck.gguf()) as mf:
        s = mf.spec
        assert s.arch == "qwen2moe" and s.expert_weights_norm == (ck.config.name == "norm-fused") and s.n_ff_shexp == 96


@pytest.mark.oracle
@pytest.mark.slow
def test_renormalization_is_what_separates_the_configs(ck):
    """The flag matters on these models: flipping transformers' norm_topk_prob moves its
    logits far beyond the 1e-4 both settings are matched to (tests/test_families_oracle.py)."""
    gates = [layer.mlp.gate for layer in ck.ref.model.layers]
    want = ck.hf_logits(ck.prompts[0])
    for g in gates:
        g.norm_topk_prob = not g.norm_topk_prob
    try:
        flipped = ck.hf_logits(ck.prompts[0])
    finally:
        for g in gates:
            g.norm_topk_prob = not g.norm_topk_prob
    assert np.abs(flipped - want).max() / np.abs(want).max() > 1e-2


@pytest.mark.oracle
@pytest.mark.slow
def test_tokenizer_matches_transformers_and_llama_cpp(ck):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ck.hf_dir)
    with open_model(ck.gguf()) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        assert mf.gguf.meta("tokenizer.ggml.pre") == "qwen2"
    llm = checks.llama(ck.gguf())
    try:
        for text in (*hfmodels.SAMPLES, "ü€ 😀 naïve café\n", "<|im_start|>user\nhi<|im_end|>", ""):
            ours = tok.encode(text)
            assert ours == hf.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), repr(text)
    finally:
        llm.close()


def test_convert_refuses_dense_layers_sliding_windows_and_no_shared_expert():
    from moe_pipe.shared.families.qwen2moe.convert import hparams

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
