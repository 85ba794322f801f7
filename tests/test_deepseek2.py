"""deepseek2 (DeepSeek-V2/V3): multi-head latent attention with the absorbed
up-projections, leading dense layers, shared experts, softmax (V2) or sigmoid
+ correction bias + grouped top-k (V3) routing.

Its checkpoints (saved as deepseek_v3 and as deepseek_v2) are held to
transformers and llama.cpp with every family's checks in
tests/test_families_oracle.py (its entry in tests/oracle.py). Here: llama.cpp
on V2-Lite's form and on made files of both forms (their logits, quant mix and
tokenizer pre-splits), the latent cache and its budget, what the converter
refuses; the streaming pipeline is in tests/test_family_pipelines.py
(docs/models.md § deepseek2).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.spec import kv_cache_bytes
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

from . import hfmodels, oracle
from . import oracle_checks as checks

PROMPTS = [list(p) for p in oracle.IDS]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """The V3 checkpoint (q_lora, a dense layer, groups, a shared expert), converted."""
    return oracle.checkpoint("deepseek2", "v3", tmp_path_factory)


def test_a_file_with_the_mtp_block_opens_and_never_reads_it(made, tmp_path, monkeypatch):
    """A deepseek2 file whose block_count counts a NextN/MTP block after the decoder's
    layers (llama.cpp's converter writes one for GLM-4.7-Flash; it skips V3's) opens: the
    block is checked, kept out of the dense set and the experts, never read, and the tokens
    are the plain file's."""
    from moe_pipe.shared.gguf.reader import GGUFFile

    from .ggufgen import with_nextn_block

    path = with_nextn_block(made, tmp_path / "mtp.gguf")
    with open_model(made) as mf:
        want = checks.ours_greedy(load_model(mf), PROMPTS[1], 6)
    viewed: list[str] = []
    real_view = GGUFFile.view
    monkeypatch.setattr(GGUFFile, "view", lambda self, name: viewed.append(name) or real_view(self, name))
    with open_model(path) as mf:
        n = mf.spec.n_layer
        assert (mf.spec.n_layer_nextn, len(mf.layout.layers)) == (1, n)
        block = mf.layout.nextn_tensor_names
        assert block == {t for t in mf.gguf.tensors if t.startswith(f"blk.{n}.")} and mf.layout.nextn_bytes > 0
        assert mf.layout.expert_tensor_names.isdisjoint(block)
        got = checks.ours_greedy(load_model(mf), PROMPTS[1], 6)
    assert got == want and f"blk.{n - 1}.ffn_gate_exps.weight" in viewed and block.isdisjoint(viewed)


@pytest.mark.oracle
def test_v2_group_limited_routing_scores_a_group_by_its_best_expert(tmp_path_factory):
    """V2's group_limited_greedy (softmax, 2 groups, the best 1 kept), converted: the file
    says softmax gating, read as V2's rule (a group's best expert), and the logits and
    greedy tokens are transformers'. V3's rule (a group's top-2 sum, llama.cpp's graph) on
    the same file picks other groups on this prompt: its logits are far off."""
    from dataclasses import replace

    from moe_pipe.shared.gguf.model_file import ModelFile

    ck = oracle.checkpoint("deepseek2", "v2-groups", tmp_path_factory)
    ids = PROMPTS[1]
    with open_model(ck.gguf()) as mf:
        s = mf.spec
        assert (s.expert_gating, s.expert_groups, s.expert_groups_used, s.expert_group_score) == ("softmax", 2, 1, "max")
        model = load_model(mf)
        got = model.forward(ids, model.new_cache(32), all_logits=True)
        greedy = checks.ours_greedy(model, ids, 8)
        top2 = load_model(ModelFile(mf.gguf, replace(s, expert_group_score="top2"), mf.layout))
        other = top2.forward(ids, top2.new_cache(32), all_logits=True)
    want = ck.hf_logits(ids)
    assert checks.rel_err(got, want) < 1e-4
    assert checks.rel_err(other, want) > 1e-2
    assert greedy == ck.hf_greedy(ids, 8)


@pytest.mark.oracle
@pytest.mark.slow
def test_llama_cpp_runs_v2_lite_form(tmp_path):
    """V2-Lite's attention (plain attn_q, no q_lora_rank key): llama.cpp 0.3.36 recognizes
    it by the layer count (27), so the tiny model gets 27 layers here."""
    pytest.importorskip("llama_cpp", reason=oracle.LLAMA_CPP_REASON)
    pytest.importorskip("transformers", reason="oracle tests need transformers (pip install '.[oracle]')")
    from moe_pipe.shared.convert.converter import convert

    hf_dir = hfmodels.build("deepseek2", tmp_path / "hf", v3=False, num_hidden_layers=27, first_k_dense_replace=1)
    path = convert(hf_dir, tmp_path / "m.gguf", outtype="f32")
    llm = checks.llama(path, 64)
    try:
        with open_model(path) as mf:
            model = load_model(mf)
            ids = PROMPTS[1]
            llm.eval(ids)
            ref = np.asarray(llm.scores[: len(ids)])
            ours = model.forward(ids, model.new_cache(32), all_logits=True)
    finally:
        llm.close()
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


# -- the latent cache ----------------------------------------------------------------


@pytest.fixture(scope="module")
def v3_gguf(v3):
    return v3.gguf()


def test_cache_holds_one_latent_row_per_position_and_the_budget_counts_it(v3_gguf):
    """MLA caches kv_lora_rank + rope values per position and layer (V is a view of
    them): the KV budget is that, not per-head K and V."""
    with open_model(v3_gguf) as mf:
        s = mf.spec
        assert (s.kv_lora_rank, s.rope.dim, s.head_dim_k_mla, s.head_dim_v_mla) == (64, 32, 64, 32)
        assert s.n_head_kv == (1,) * s.n_layer and s.head_dim_k == (96,) * s.n_layer and s.head_dim_v == (0,) * s.n_layer
        model = load_model(mf)
        cache = model.new_cache(100, "f32")
        assert kv_cache_bytes(s, 100, "f32") == 100 * s.n_layer * 96 * 4 == sum(a.nbytes for a in cache.parts())
        assert kv_cache_bytes(s, 100, "q8_0") == 100 * s.n_layer * 96 * 34 // 32


@pytest.mark.parametrize("kv_type,tol", [("f16", 5e-3), ("q8_0", 2e-2)])
def test_stored_latent_types_stay_close_to_f32(v3_gguf, kv_type, tol):
    """f16 reads V as a view of the stored K rows (the fused loops); q8_0 takes the numpy path."""
    with open_model(v3_gguf) as mf:
        model = load_model(mf)
        ids = PROMPTS[2]
        exact = model.forward(ids, model.new_cache(32, "f32"), all_logits=True)
        cache = model.new_cache(32, kv_type)
        steps = np.stack([model.decode_one(t, cache) for t in ids])
    assert np.abs(steps - exact).max() / np.abs(exact).max() < tol


@pytest.mark.slow  # CI time: the pipeline test's resident reference prefills and decodes the made model
def test_batches_and_decode_steps_equal_one_prefill(v3_gguf):
    with open_model(v3_gguf) as mf:
        model = load_model(mf)
        ids = PROMPTS[1]
        whole = model.forward(ids, model.new_cache(32), all_logits=True)
        batched = model.prefill(ids, model.new_cache(32), batch=4)
        cache = model.new_cache(32)
        steps = np.stack([model.decode_one(t, cache) for t in ids])
    np.testing.assert_allclose(batched, whole[-1], rtol=0, atol=1e-4 * np.abs(whole).max())
    np.testing.assert_allclose(steps, whole, rtol=0, atol=1e-4 * np.abs(whole).max())


def test_only_routed_experts_stream(v3_gguf):
    """The leading dense layer has no experts; the shared experts stay in the dense set."""
    with open_model(v3_gguf) as mf:
        names = mf.layout.expert_tensor_names
        s = mf.spec
        assert s.n_dense_lead == 1 and s.moe_layers == (1, 2)
        assert names == {f"blk.{i}.ffn_{p}_exps.weight" for i in (1, 2) for p in ("gate", "up", "down")}
        assert (s.expert_gating, s.expert_groups, s.expert_groups_used, s.expert_weights_norm) == ("sigmoid", 4, 2, True)
        assert s.expert_weights_scale == pytest.approx(1.5)


def test_converter_refuses_what_the_oracles_would_compute_differently(tmp_path):
    pytest.importorskip("transformers", reason="oracle tests need transformers (pip install '.[oracle]')")
    import json

    from moe_pipe.shared.convert.converter import convert

    hf_dir = hfmodels.build("deepseek2", tmp_path / "hf", v3=False)
    cfg_path = hf_dir / "config.json"
    base = json.loads(cfg_path.read_text())
    for change, words in (
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"attention_bias": True}, "attention_bias"),
    ):
        cfg_path.write_text(json.dumps({**base, **change}))
        with pytest.raises(UserError, match=words):
            convert(hf_dir, tmp_path / "x.gguf", outtype="f32")
    assert not (tmp_path / "x.gguf").exists()


# -- made models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model("deepseek2", "tiny", tmp_path_factory.mktemp("ds2") / "tiny.gguf")


# V3's form on the tiny preset: q_lora, sigmoid + selection bias, 2 of 4 groups, scale 2.5, renormalized
V3_FORM = dict(q_lora_rank=96, expert_gating_sigmoid=True, expert_groups=4, expert_groups_used=2, expert_weights_scale=2.5)


def test_made_tiny_is_v2_lites_form(made):
    """The tiny preset as make-model writes it: V2-Lite's plain attn_q, softmax, no renormalization, no YaRN."""
    with open_model(made) as mf:
        s = mf.spec
    assert (s.q_lora_rank, s.expert_gating, s.expert_weights_norm, s.rope.scaling) == (0, "softmax", False, "none")


@pytest.mark.oracle
@pytest.mark.slow  # the default tier's llama.cpp check is the converted model's
@pytest.mark.parametrize("form", ["v3", "v2-lite-yarn"])
def test_llama_cpp_loads_made_model_in_the_other_forms_and_agrees_on_f32(tmp_path, form):
    """Made files in V3's form and with V2-Lite's YaRN load in llama.cpp at 4 layers, with
    the same tensor bytes, and give its logits (V2-Lite's own form: tests/test_families_oracle.py)."""
    overrides = {"v3": V3_FORM, "v2-lite-yarn": dict(yarn_factor=40.0, yarn_orig_ctx=1024, yarn_log_mul=0.0707)}[form]
    path = make_model("deepseek2", "tiny", tmp_path / "m.gguf", quant="F32", _overrides=overrides)
    with open_model(path) as mf:
        s = mf.spec
        assert (s.q_lora_rank, s.expert_gating, s.expert_weights_norm) == ((96, "sigmoid", True) if form == "v3" else (0, "softmax", False))
        assert s.rope.scaling == ("yarn" if form == "v2-lite-yarn" else "none")
    checks.check_made_f32(path, PROMPTS[1], oracle.ORACLES["deepseek2"].made.tol)


@pytest.mark.oracle
@pytest.mark.slow
def test_quant_mix_is_llama_cpps_q4_k_m(tmp_path):
    """The deepseek-v2-lite-shape's mix, tensor by tensor, is what llama.cpp's quantizer makes
    of the same model in F16 at Q4_K_M (27 layers, the real widths but n_embd 256 and 2
    experts, so the file stays small; n_embd 256 keeps every row-width fallback the same)."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional extra)")
    from moe_pipe.shared.gguf.reader import GGUFFile

    narrow = dict(n_embd=256, n_expert=2, n_expert_used=1, vocab_size=2048, n_bpe=1600)
    src = make_model("deepseek2", "deepseek-v2-lite-shape", tmp_path / "f16.gguf", quant="F16", _overrides=narrow)
    ours = make_model("deepseek2", "deepseek-v2-lite-shape", tmp_path / "ours.gguf", sparse=True, _overrides=narrow)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(tmp_path / "theirs.gguf").encode(), ctypes.byref(params)) == 0
    with GGUFFile(ours) as a, GGUFFile(tmp_path / "theirs.gguf") as b:
        mine = {n: t.qtype.name for n, t in a.tensors.items()}
        theirs = {n: t.qtype.name for n, t in b.tensors.items()}
    assert mine == theirs
    assert {mine[f"blk.{i}.ffn_down_exps.weight"] for i in range(1, 27)} == {"Q5_0", "Q8_0"}  # 1408-wide rows fall back
    assert mine["blk.1.attn_k_b.weight"] == "Q5_0" and mine["blk.1.attn_v_b.weight"] == "Q4_K"


def test_shape_preset_has_the_real_per_expert_bytes(tmp_path):
    """deepseek-v2-lite-shape at full depth (sparse: header and table exact, data a hole):
    DeepSeek-V2-Lite's widths and its Q4_K_M expert bytes. The down projection's rows are
    1408 wide, not a multiple of 256: Q4_K falls back to Q5_0 and Q6_K to Q8_0."""
    path = make_model("deepseek2", "deepseek-v2-lite-shape", tmp_path / "s.gguf", sparse=True)
    with open_model(path) as mf:
        s, lay = mf.spec, mf.layout
        assert (s.n_layer, s.n_embd, s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_ff, s.n_dense_lead) == (27, 2048, 64, 6, 1408, 10944, 1)
        assert (s.n_head, s.kv_lora_rank, s.q_lora_rank, s.head_dim_k_mla, s.head_dim_v_mla, s.rope.dim) == (16, 512, 0, 192, 128, 64)
        assert (s.n_vocab, s.n_expert_shared, s.n_ff_shexp, s.expert_gating, s.expert_weights_norm) == (102400, 2, 2816, "softmax", False)
        assert s.rope.scaling == "yarn" and s.rope.factor == 40.0
        gate = 1408 * 2048 // 256 * 144  # [1408, 2048] Q4_K
        down_q5_0, down_q8_0 = 2048 * 1408 // 32 * 22, 2048 * 1408 // 32 * 34
        assert lay.expert_bytes(0) == 0
        assert {lay.expert_bytes(i) for i in range(1, 27)} == {2 * gate + down_q5_0, 2 * gate + down_q8_0}
        assert lay.routed_bytes_per_token() == sum(6 * lay.expert_bytes(i) for i in range(1, 27))
        assert kv_cache_bytes(s, 1000, "f16") == 1000 * 27 * (512 + 64) * 2  # the latent cache: no per-head K or V


def test_dense_layer_and_shared_experts_stay_resident_only_routed_experts_stream(made):
    with open_model(made) as mf:
        s, names = mf.spec, mf.layout.expert_tensor_names
        assert s.n_dense_lead == 1 and s.moe_layers == (1, 2, 3) and s.n_expert_shared == 2
        assert names == {f"blk.{i}.ffn_{p}_exps.weight" for i in (1, 2, 3) for p in ("gate", "up", "down")}
        assert mf.layout.expert_bytes(0) == 0 and mf.layout.min_cache_bytes() == 3 * s.n_expert_used * mf.layout.slab_bytes


def test_made_model_tokenizer_and_chat_template_are_deepseek_v2s(made):
    from moe_pipe.shared.text.chat import render_chat
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(made) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        text = render_chat(mf.gguf, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tok.pre == "deepseek-llm" and tok.add_bos
    assert [tok.token_text(i) for i in tok.eog_ids] == ["<｜end▁of▁sentence｜>"]
    assert text == "<｜begin▁of▁sentence｜>User: Hi\n\nAssistant:"
    # deepseek-llm keeps a digit run whole before BPE (\p{N}+), so no merge crosses a letter
    assert tok.encode("ab12345", add_bos=False) == tok.encode("ab", add_bos=False) + tok.encode("12345", add_bos=False)


_SAMPLES = [
    "Hello world! It's 2024-05-17, the price is $1,234.56.",
    "  leading spaces and trailing   \n\nnew lines\r\n\ttabs",
    "中文混合English文本，还有日本語のひらがなとカタカナ。한국어도 있어요",
    "Ελληνικά και русский текст, Ärger über ŒUVRE — ﬁne ｆｕｌｌｗｉｄｔｈ！",
    "def f(x):\n    return x**2  # 12345678 digits 0.001",
    "emoji 🙂 and math ∑ ≤ ∞, quotes “like” ‘these’",
]


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["deepseek-llm", "deepseek-v3"])
def test_pre_splits_tokenize_as_llama_cpp(made, tmp_path, pre):
    """Our PRE_SPLITS for DeepSeek's pre names against llama.cpp's tokenizer on the made
    vocab (deepseek-v3: the same file with only tokenizer.ggml.pre changed)."""
    from moe_pipe.shared.gguf.reader import GGUFFile
    from moe_pipe.shared.text.tokenizer import Tokenizer

    path = made if pre == "deepseek-llm" else _with_pre(made, tmp_path / "v3.gguf", pre)
    llm = checks.llama(path, 64, vocab_only=True)
    try:
        with GGUFFile(path) as f:
            tok = Tokenizer.from_gguf(f)
        assert tok.pre == pre
        for text in _SAMPLES:
            assert tok.encode(text, add_bos=False) == llm.tokenize(text.encode(), add_bos=False, special=True), text
    finally:
        llm.close()


def _with_pre(src, dst, pre: str):
    """`src` with its tokenizer.ggml.pre replaced (tensors and every other key as they are)."""
    from gguf import GGUFValueType

    from .ggufgen import with_metadata

    return with_metadata(src, dst, {"tokenizer.ggml.pre": (pre, GGUFValueType.STRING)})


def test_converter_names_deepseeks_pre_splits(v3, tmp_path):
    """tokenizer.ggml.pre: the split the tokenizer.json says when it is DeepSeek's (V2's
    starts with "[\\r\\n]", V3's with "\\p{N}{1,3}"), else V3 configs deepseek-v3, V2 deepseek-llm."""
    import json
    import shutil

    from moe_pipe.shared.convert.vocab import read_vocab
    from moe_pipe.shared.text.tokenizer import DEEPSEEK_LLM_REGEXES, DEEPSEEK_V3_REGEXES

    hf_dir = v3.hf_dir
    for name, splits, model_type, want in (
        ("v2-split", DEEPSEEK_LLM_REGEXES, "deepseek_v3", "deepseek-llm"),
        ("v3-split", DEEPSEEK_V3_REGEXES, "deepseek_v2", "deepseek-v3"),
        ("other-v3", (r"\p{L}+",), "deepseek_v3", "deepseek-v3"),
        ("other-v2", (r"\p{L}+",), "deepseek_v2", "deepseek-llm"),
    ):
        d = tmp_path / name
        shutil.copytree(hf_dir, d)
        tj = json.loads((d / "tokenizer.json").read_text())
        seq = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in splits]
        tj["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [*seq, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}],
        }
        (d / "tokenizer.json").write_text(json.dumps(tj))
        assert read_vocab(d, "deepseek2", 1024, {"model_type": model_type}).pre == want, name
