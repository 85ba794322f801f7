"""glm4moe (GLM-4.5 / GLM-4.5-Air): leading dense layers, sigmoid routing with a
selection bias and expert groups, a shared expert, q/k/v biases, optional
qk-norm, partial rotary; its NextN/MTP blocks are never loaded or streamed.

Oracles: transformers on tiny random models converted by `moe-pipe convert`,
llama.cpp on the same converted GGUFs and on made models; then the streaming pipeline
(tests/test_family_pipelines.py) against the resident reference (docs/models.md § glm4moe).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

from . import hfmodels

PROMPTS = [
    list(range(3, 40, 3)),
    [5, 17, 2, 99, 140, 7, 7, 7, 30],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
]
N_GREEDY = 32

# The tiny transformers configs (tests/hfmodels.py glm4moe_config varies GLM-4.5-Air's structure):
CONFIGS = {
    # 1 dense layer, 4 groups of 4 experts (best 2 kept), q/k/v biases, no qk-norm, scale 1.5
    "air": {},
    # no dense layer, qk-norm on, no biases, no groups, weights not renormalized
    "qknorm-nogroups": dict(use_qk_norm=True, first_k_dense_replace=0, n_group=1, topk_group=1, attention_bias=False, norm_topk_prob=False),
    # 2 dense layers of 4, one group kept of 2, qk-norm and biases both on
    "deep-dense": dict(num_hidden_layers=4, first_k_dense_replace=2, n_group=2, topk_group=1, use_qk_norm=True, routed_scaling_factor=1.0),
}
DEFAULT_TIER = ("air",)


def ours_greedy(model, ids, n):
    cache = model.new_cache(len(ids) + n + 1)
    logits, out = model.prefill(ids, cache), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode_one(out[-1], cache)
    return out


def _llama(path, n_ctx=128):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional extra)")
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0, flash_attn=False)


# -- transformers ----------------------------------------------------------------


@pytest.fixture(scope="module", params=[c if c in DEFAULT_TIER else pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS])
def pair(request, tmp_path_factory):
    pytest.importorskip("torch", reason="oracle tests need torch (pip install '.[oracle]')")
    pytest.importorskip("transformers", reason="oracle tests need transformers (pip install '.[oracle]')")
    from moe_pipe.shared.convert.converter import convert

    root = tmp_path_factory.mktemp(f"glm-{request.param}")
    hf_dir = hfmodels.build("glm4moe", root / "hf", **CONFIGS[request.param])
    ref = hfmodels.load_model(hf_dir)
    ggufs = {"f32": convert(hf_dir, root / "m-f32.gguf", outtype="f32")}
    return request.param, ref, ggufs, lambda t: ggufs.get(t) or ggufs.setdefault(t, convert(hf_dir, root / f"m-{t}.gguf", outtype=t))


@pytest.mark.oracle
def test_f32_logits_and_greedy_match_transformers(pair):
    name, ref, ggufs, _ = pair
    cfg = hfmodels.glm4moe_config(64, **CONFIGS[name])
    with open_model(ggufs["f32"]) as mf:
        s = mf.spec
        assert (s.n_layer, s.n_dense_lead, s.n_layer_nextn) == (cfg["num_hidden_layers"], cfg["first_k_dense_replace"], 0)
        assert (s.expert_gating, s.expert_groups, s.expert_groups_used) == ("sigmoid", cfg["n_group"], cfg["topk_group"])
        assert s.rope.dim == 16 and s.n_ff_shexp == cfg["moe_intermediate_size"]
        model = load_model(mf)
        for ids in PROMPTS:
            want = hfmodels.hf_logits(ref, ids)
            got = model.forward(ids, model.new_cache(64), all_logits=True)
            rel = np.abs(got - want).max() / np.abs(want).max()
            assert rel < 1e-4, f"{name}: logits differ by {rel:.2e} relative (prompt {ids[:5]}...)"
        # CI time: 8 greedy tokens on one prompt here, the 32 on each prompt behind -m slow
        assert ours_greedy(model, PROMPTS[0], 8) == hfmodels.hf_greedy(ref, PROMPTS[0], 8), f"{name}: greedy tokens differ"


@pytest.mark.oracle
@pytest.mark.slow
def test_f32_32_greedy_tokens_match_transformers_on_every_prompt(pair):
    name, ref, ggufs, _ = pair
    with open_model(ggufs["f32"]) as mf:
        model = load_model(mf)
        for ids in PROMPTS:
            assert ours_greedy(model, ids, N_GREEDY) == hfmodels.hf_greedy(ref, ids, N_GREEDY), f"{name}: greedy tokens differ"


@pytest.mark.oracle
@pytest.mark.slow
def test_q8_0_stays_close_to_transformers(pair):
    """The first families' q8_0 bounds (tests/test_hf_oracle.py): logits within 0.1
    relative, and greedy output agreeing for its first 3 of 8 tokens on 2 of 3 prompts."""
    name, ref, _, converted = pair
    errs, prefixes = [], []
    with open_model(converted("q8_0")) as mf:
        model = load_model(mf)
        for ids in PROMPTS:
            want = hfmodels.hf_logits(ref, ids)[-1]
            got = model.forward(ids, model.new_cache(64))[-1]
            errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
            ours, theirs = ours_greedy(model, ids, 8), hfmodels.hf_greedy(ref, ids, 8)
            prefixes.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), 8))
    assert max(errs) < 0.1, (name, errs)
    assert sum(p >= 3 for p in prefixes) >= 2, (name, prefixes)


@pytest.mark.oracle
def test_llama_cpp_greedy_tokens_match_ours_on_converted_model(pair):
    name, _, ggufs, _ = pair
    llm = _llama(ggufs["f32"])
    try:
        with open_model(ggufs["f32"]) as mf:
            model = load_model(mf)
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


# -- made models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model("glm4moe", "tiny", tmp_path_factory.mktemp("glm") / "tiny.gguf")


@pytest.mark.oracle
@pytest.mark.slow  # the default tier's llama.cpp check is the converted model's
def test_llama_cpp_loads_made_model_and_agrees_on_f32(tmp_path):
    path = make_model("glm4moe", "tiny", tmp_path / "m.gguf", quant="F32")
    with open_model(path) as mf:
        tensor_bytes = sum(t.nbytes for t in mf.gguf.tensors.values())
        assert tensor_bytes == mf.layout.dense_bytes + mf.layout.total_expert_bytes
        model = load_model(mf)
        ours = model.forward(PROMPTS[1], model.new_cache(64), all_logits=True)
    llm = _llama(path, 64)
    try:
        assert llm._model.size() == tensor_bytes
        llm.eval(PROMPTS[1])
        ref = np.asarray(llm.scores[: len(PROMPTS[1])])
    finally:
        llm.close()
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < 1e-5, f"max relative logit error {err:.3g}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


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


def _with_nextn(src, dst, nextn: int):
    """`src` rewritten as llama.cpp's converter writes GLM-4.5: its last `nextn` blocks
    counted in block_count and named by nextn_predict_layers (here they are ordinary
    blocks: what matters is that they are never run, loaded or streamed)."""
    from gguf import GGUFValueType

    from .ggufgen import with_metadata

    return with_metadata(src, dst, {"glm4moe.nextn_predict_layers": (nextn, GGUFValueType.UINT32)})


def test_nextn_blocks_are_not_decoder_layers(made, tmp_path):
    from moe_pipe.shared.gguf.reader import GGUFFile
    from moe_pipe.shared.gguf.spec import read_spec

    path = _with_nextn(made, tmp_path / "nextn.gguf", 1)
    with GGUFFile(path) as f:
        s = read_spec(f)
    assert (s.n_layer, s.n_layer_nextn, s.moe_layers) == (3, 1, (1, 2))
    bad = _with_nextn(made, tmp_path / "bad.gguf", 4)
    with pytest.raises(GGUFError, match="nextn_predict_layers"), GGUFFile(bad) as f:
        read_spec(f)


def test_nextn_blocks_are_neither_streamed_nor_resident(made, tmp_path):
    path = _with_nextn(made, tmp_path / "nextn.gguf", 1)
    with open_model(path) as mf:
        tensors = mf.gguf.tensors
        nextn_bytes = sum(t.nbytes for n, t in tensors.items() if n.startswith("blk.3."))
        assert len(mf.layout.layers) == 3 and mf.layout.expert_tensor_names.isdisjoint(n for n in tensors if n.startswith("blk.3."))
        assert mf.layout.dense_bytes + mf.layout.total_expert_bytes == sum(t.nbytes for t in tensors.values()) - nextn_bytes
        nextn = [t for n, t in tensors.items() if n.startswith("blk.3.")]
        assert not any(d.offset < t.end and t.offset < d.end for t in nextn for d in mf.layout.dense)  # never read


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
