"""convert: tiny random HF checkpoints -> GGUF, checked against the HF side.

Expected tensors are rebuilt here from the safetensors with the mapping
written out from docs/models.md § From Hugging Face names (not from the families' convert parts), and every
GGUF tensor is read back with gguf-py and dequantized with gguf.quants.
llama.cpp (oracle marker) must load the files, tokenize like the HF
tokenizer and predict the same greedy next token as transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

from moe_pipe.shared.convert.converter import convert, tensor_qtype
from moe_pipe.shared.convert.plan import Out
from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model

torch = pytest.importorskip("torch", reason="the tiny HF checkpoints are built with torch")
transformers = pytest.importorskip("transformers", reason="the tiny HF checkpoints are built with transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from .hfmodels import ARCHES, SAMPLES, build, gpt_oss_mxfp4_pair, load_model  # noqa: E402

CASES = [(a, t) for a in ARCHES for t in ("f32", "q8_0")] + [("qwen3moe", "f16"), ("qwen3moe", "bf16")]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hf")
    out = {a: build(a, d / a) for a in ARCHES}
    out["gemma4-text"] = build("gemma4", d / "gemma4-text", multimodal=False)
    return out


@pytest.fixture(scope="module")
def gguf(hf, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, outtype: str) -> Path:
        if (arch, outtype) not in cache:
            cache[arch, outtype] = convert(hf[arch], d / f"{arch}-{outtype}.gguf", outtype)
        return cache[arch, outtype]

    return get


def config(hf_dir: Path) -> dict:
    cfg = json.loads((hf_dir / "config.json").read_text())
    return cfg.get("text_config") or cfg


# --- the documented HF -> GGUF mapping, written out independently ---------------------


def expected_tensors(arch: str, hf_dir: Path) -> dict[str, np.ndarray]:
    sd = safetensors_numpy.load_file(hf_dir / "model.safetensors")
    cfg = config(hf_dir)
    if arch == "gemma4":
        pre = "model.language_model." if "model.language_model.embed_tokens.weight" in sd else "model."
    else:
        pre = "model."
    E = {"token_embd.weight": sd[pre + "embed_tokens.weight"], "output_norm.weight": sd[pre + "norm.weight"]}
    if not cfg.get("tie_word_embeddings", arch == "gemma4"):
        E["output.weight"] = sd["lm_head.weight"]
    if arch == "gemma4":
        d_full = 64  # global_head_dim; proportional rope rotates 0.25 of its pairs
        E["rope_freqs.weight"] = np.array([1.0] * (d_full // 8) + [1e30] * (d_full // 2 - d_full // 8), np.float32)
    for i in range(cfg["num_hidden_layers"]):
        b, h = f"blk.{i}.", f"{pre}layers.{i}."
        g = lambda n, h=h: sd[h + n]  # noqa: E731
        E[b + "attn_norm.weight"] = g("input_layernorm.weight")
        for gg, hfn in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            if h + f"self_attn.{hfn}.weight" in sd:
                E[f"{b}{gg}.weight"] = g(f"self_attn.{hfn}.weight")
        if arch == "qwen3moe":
            X = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
            E[b + "attn_q_norm.weight"] = g("self_attn.q_norm.weight")
            E[b + "attn_k_norm.weight"] = g("self_attn.k_norm.weight")
            E[b + "ffn_norm.weight"] = g("post_attention_layernorm.weight")
            E[b + "ffn_gate_inp.weight"] = g("mlp.gate.weight")
            for p in ("gate", "up", "down"):
                E[f"{b}ffn_{p}_exps.weight"] = np.stack([g(f"mlp.experts.{x}.{p}_proj.weight") for x in range(X)])
        elif arch == "gpt-oss":
            for gg, hfn in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                E[f"{b}{gg}.bias"] = g(f"self_attn.{hfn}.bias")
            E[b + "attn_sinks.weight"] = g("self_attn.sinks")
            E[b + "post_attention_norm.weight"] = g("post_attention_layernorm.weight")
            E[b + "ffn_gate_inp.weight"] = g("mlp.router.weight")
            E[b + "ffn_gate_inp.bias"] = g("mlp.router.bias")
            gu, gub = g("mlp.experts.gate_up_proj"), g("mlp.experts.gate_up_proj_bias")  # (X, D, 2F), (X, 2F)
            E[b + "ffn_gate_exps.weight"] = gu[:, :, 0::2].transpose(0, 2, 1)
            E[b + "ffn_up_exps.weight"] = gu[:, :, 1::2].transpose(0, 2, 1)
            E[b + "ffn_gate_exps.bias"] = gub[:, 0::2]
            E[b + "ffn_up_exps.bias"] = gub[:, 1::2]
            E[b + "ffn_down_exps.weight"] = g("mlp.experts.down_proj").transpose(0, 2, 1)
            E[b + "ffn_down_exps.bias"] = g("mlp.experts.down_proj_bias")
        else:
            names = {
                "attn_q_norm.weight": "self_attn.q_norm.weight",
                "attn_k_norm.weight": "self_attn.k_norm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "ffn_gate.weight": "mlp.gate_proj.weight",
                "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight",
                "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
                "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
                "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                "ffn_gate_inp.weight": "router.proj.weight",
                "ffn_gate_inp.scale": "router.scale",
                "ffn_gate_up_exps.weight": "experts.gate_up_proj",
                "ffn_down_exps.weight": "experts.down_proj",
                "ffn_down_exps.scale": "router.per_expert_scale",
                "layer_output_scale.weight": "layer_scalar",
            }
            for gg, hfn in names.items():
                E[b + gg] = g(hfn)
    return E


def read_tensors(path: Path) -> dict[str, tuple[Q, np.ndarray, np.ndarray]]:
    """name -> (type, raw data as stored, dequantized float32 in numpy order)."""
    out = {}
    for t in GGUFReader(path).tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        qt = Q(t.tensor_type)
        out[t.name] = (qt, np.asarray(t.data), dequantize(np.asarray(t.data), qt).reshape(shape).astype(np.float32))
    return out


def fields(path: Path) -> dict:
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items()}


# --- layout and values ------------------------------------------------------------


@pytest.mark.parametrize("arch,outtype", CASES)
def test_tensors_equal_hf_after_rearrangement(arch, outtype, hf, gguf):
    path = gguf(arch, outtype)
    want = expected_tensors(arch, hf[arch])
    got = read_tensors(path)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        qt, raw, deq = got[name]
        assert deq.shape == w.shape, name
        matrix = w.ndim >= 2 and name.endswith(".weight") and "ffn_gate_inp" not in name  # 2-D expert biases stay F32
        if outtype == "f32" or not matrix:
            assert qt == Q.F32, name
            np.testing.assert_array_equal(deq, w, err_msg=name)
            continue
        assert qt == {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype], name
        # Bit-exact with ggml's reference quantizer, and within its error bound.
        assert raw.tobytes() == np.ascontiguousarray(quantize(np.ascontiguousarray(w), qt)).tobytes(), name
        if qt == Q.Q8_0:
            amax = np.abs(w.reshape(-1, 32)).max(-1, keepdims=True)
            err = np.abs(deq.reshape(-1, 32) - w.reshape(-1, 32))
            assert (err <= amax / 127 * 0.51 + amax * 2e-3 + 1e-12).all(), name
        else:
            np.testing.assert_allclose(deq, w, rtol=1e-2 if qt == Q.BF16 else 1e-3, atol=1e-6, err_msg=name)


def test_gemma4_text_only_config_converts_the_same(hf, gguf, tmp_path):
    path = convert(hf["gemma4-text"], tmp_path / "g.gguf", "f32")
    want = expected_tensors("gemma4", hf["gemma4-text"])
    got = read_tensors(path)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name][2], w, err_msg=name)
    with open_model(path) as mf:
        assert mf.spec.arch == "gemma4" and mf.spec.tied_output


# --- spec and metadata ------------------------------------------------------------


@pytest.mark.parametrize("arch,outtype", CASES)
def test_spec_matches_hf_config(arch, outtype, hf, gguf):
    cfg = config(hf[arch])
    L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    with open_model(gguf(arch, outtype)) as mf:
        s = mf.spec
        assert mf.layout.total_expert_bytes > 0
    assert (s.n_layer, s.n_embd, s.n_head, s.n_vocab) == (L, cfg["hidden_size"], H, cfg["vocab_size"])
    assert s.rms_eps == pytest.approx(cfg["rms_norm_eps"])
    assert s.n_ctx_train == cfg["max_position_embeddings"]
    if arch == "qwen3moe":
        assert (s.n_expert, s.n_expert_used, s.n_ff_exp) == (
            cfg.get("num_experts") or cfg["num_local_experts"],
            cfg["num_experts_per_tok"],
            cfg["moe_intermediate_size"],
        )
        assert s.n_head_kv == (cfg["num_key_value_heads"],) * L and s.head_dim_k == (cfg["head_dim"],) * L
        assert s.rope.freq_base == cfg["rope_parameters"]["rope_theta"] and s.rope.scaling == "none"
        assert not s.tied_output and s.sliding_window == 0 and not any(s.swa_layers)
    elif arch == "gpt-oss":
        rp = cfg["rope_parameters"]
        assert (s.n_expert, s.n_expert_used, s.n_ff_exp) == (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"])
        assert s.n_head_kv == (cfg["num_key_value_heads"],) * L and s.head_dim_k == (cfg["head_dim"],) * L
        assert (s.rope.freq_base, s.rope.scaling, s.rope.factor, s.rope.orig_ctx) == (
            rp["rope_theta"],
            "yarn",
            rp["factor"],
            rp["original_max_position_embeddings"],
        )
        assert s.sliding_window == cfg["sliding_window"]
        assert s.swa_layers == tuple(t == "sliding_attention" for t in cfg["layer_types"])
        assert s.expert_bias and not s.tied_output
    else:
        swa = tuple(t == "sliding_attention" for t in cfg["layer_types"])
        full = cfg["per_layer_config"][str(swa.index(False))]
        assert (s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_ff) == (
            cfg["num_experts"],
            cfg["top_k_experts"],
            cfg["moe_intermediate_size"],
            cfg["intermediate_size"],
        )
        assert s.swa_layers == swa and s.sliding_window == cfg["sliding_window"]
        assert s.n_head_kv == tuple(cfg["num_key_value_heads"] if w else full["num_key_value_heads"] for w in swa)
        assert s.head_dim_k == s.head_dim_v == tuple(cfg["head_dim"] if w else full["head_dim"] for w in swa)
        rp = cfg["rope_parameters"]
        assert s.rope.freq_base == rp["full_attention"]["rope_theta"] and s.rope.freq_base_swa == rp["sliding_attention"]["rope_theta"]
        assert (s.rope.dim, s.rope.dim_swa) == (full["head_dim"], cfg["head_dim"])
        assert s.final_logit_softcap == cfg["final_logit_softcapping"] and s.tied_output and s.fused_gate_up


@pytest.mark.parametrize("arch", ARCHES)
def test_tokenizer_and_chat_template_carried(arch, hf, gguf):
    tj = json.loads((hf[arch] / "tokenizer.json").read_text())
    f = fields(gguf(arch, "f32"))
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    n_vocab = config(hf[arch])["vocab_size"]
    assert len(tokens) == len(types) == n_vocab
    for t, i in tj["model"]["vocab"].items():
        assert tokens[i] == t
    for a in tj["added_tokens"]:
        assert tokens[a["id"]] == a["content"]
        if arch == "gemma4" and a["content"] in (
            "<|channel>",
            "<channel|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            '<|"|>',
        ):
            assert types[a["id"]] == 4  # kept visible, as llama.cpp's converter does
        elif a["content"] != "<unk>":
            assert types[a["id"]] == (3 if a["special"] else 4), a["content"]
    n_def = len(set(tj["model"]["vocab"].values()) | {a["id"] for a in tj["added_tokens"]})
    assert tokens[n_def:] == [f"[PAD{i}]" for i in range(n_def, n_vocab)] and set(types[n_def:]) <= {5}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert f["tokenizer.ggml.merges"] == merges
    ht = transformers.AutoTokenizer.from_pretrained(hf[arch])
    assert f["tokenizer.chat_template"] == ht.chat_template
    model, pre = {"qwen3moe": ("gpt2", "qwen2"), "gpt-oss": ("gpt2", "gpt-4o"), "gemma4": ("gemma4", "gemma4")}[arch]
    assert (f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"]) == (model, pre)
    for key, tok in (("bos", ht.bos_token), ("eos", ht.eos_token), ("padding", ht.pad_token)):
        if tok is not None:
            assert f[f"tokenizer.ggml.{key}_token_id"] == ht.convert_tokens_to_ids(tok)
    assert f["tokenizer.ggml.add_bos_token"] == (arch == "gemma4")
    if arch == "gemma4":
        assert types[tokens.index("<0x41>")] == 6 and types[tokens.index("<unk>")] == 2


# --- outtype rules, streaming, sharding -------------------------------------------


def test_outtype_rules_per_tensor():
    def o(name, shape, matrix=True):
        return Out(name, shape, matrix, lambda: iter([]))

    assert tensor_qtype(o("blk.0.ffn_up_exps.weight", (4, 64, 64)), Q.Q8_0) == Q.Q8_0
    assert tensor_qtype(o("blk.0.attn_q.weight", (64, 48)), Q.Q8_0) == Q.F16  # rows not a multiple of 32
    assert tensor_qtype(o("blk.0.attn_q.weight", (64, 48)), Q.BF16) == Q.BF16
    assert tensor_qtype(o("blk.0.ffn_gate_inp.weight", (4, 64), False), Q.Q8_0) == Q.F32
    assert tensor_qtype(o("blk.0.attn_norm.weight", (64,), False), Q.F16) == Q.F32
    assert tensor_qtype(o("token_embd.weight", (96, 64)), Q.F32) == Q.F32


def test_progress_and_part_file(hf, tmp_path):
    calls = []
    out = convert(hf["qwen3moe"], tmp_path / "m.gguf", "q8_0", progress=lambda d, t: calls.append((d, t)))
    assert out.is_file() and not (tmp_path / "m.gguf.part").exists()
    done = [d for d, _ in calls]
    assert done == sorted(done) and calls[0][0] == 0 and calls[-1][0] == calls[-1][1] > 0
    assert calls[-1][1] == sum(t.n_bytes for t in GGUFReader(out).tensors)


def test_sharded_checkpoint_gives_the_same_tensors(hf, gguf, tmp_path):
    src = hf["gpt-oss"]
    d = tmp_path / "gpt-oss"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("model.safetensors"))
    sd = safetensors_numpy.load_file(src / "model.safetensors")
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in shards.items():
        safetensors_numpy.save_file({n: sd[n] for n in part}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = read_tensors(convert(d, tmp_path / "sharded.gguf", "q8_0")), read_tensors(gguf("gpt-oss", "q8_0"))
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n][0] == b[n][0] and a[n][1].tobytes() == b[n][1].tobytes(), n


def test_bf16_checkpoint_widens_exactly(hf, tmp_path):
    src = hf["qwen3moe"]
    d = tmp_path / "qwen-bf16"
    shutil.copytree(src, d)
    sd = safetensors_numpy.load_file(src / "model.safetensors")
    # Store bf16 bits (truncate) through torch, which safetensors.numpy cannot write.
    from safetensors.torch import save_file

    tsd = {n: torch.from_numpy(v).to(torch.bfloat16) for n, v in sd.items()}
    save_file(tsd, str(d / "model.safetensors"), metadata={"format": "pt"})
    got = read_tensors(convert(d, tmp_path / "bf16.gguf", "f32"))
    np.testing.assert_array_equal(got["blk.1.attn_q.weight"][2], tsd["model.layers.1.self_attn.q_proj.weight"].float().numpy())


def test_gpt_oss_mxfp4_checkpoint_repacks_losslessly(hf, tmp_path):
    mx, twin = gpt_oss_mxfp4_pair(hf["gpt-oss"], tmp_path / "mx", tmp_path / "twin")
    a = read_tensors(convert(mx, tmp_path / "mx.gguf", "q8_0"))
    b = read_tensors(convert(twin, tmp_path / "twin.gguf", "f32"))
    assert sorted(a) == sorted(b)
    for n in a:
        if "_exps.weight" in n:
            assert a[n][0] == Q.MXFP4, n
            # gguf.quants' MXFP4 decoder on our repack == transformers' decoder on the HF blocks
            np.testing.assert_array_equal(a[n][2], b[n][2], err_msg=n)
    with open_model(tmp_path / "mx.gguf") as mf:
        assert mf.quant_types()["experts"] == {"MXFP4": 6, "F32": 6}  # weights + expert biases


# --- errors -----------------------------------------------------------------------


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_errors_are_one_line_and_name_the_culprit(hf, tmp_path):
    with pytest.raises(UserError) as e:
        convert(tmp_path, tmp_path / "x.gguf")
    assert "config.json" in _one_line(e)

    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError) as e:
        convert(d, tmp_path / "x.gguf")
    assert "'llama'" in _one_line(e) and "qwen3_moe" in str(e.value)

    with pytest.raises(UserError) as e:
        convert(hf["qwen3moe"], tmp_path / "x.gguf", "q4_k")
    assert "q4_k" in _one_line(e)

    # a missing tensor
    d = tmp_path / "missing"
    shutil.copytree(hf["qwen3moe"], d)
    sd = safetensors_numpy.load_file(d / "model.safetensors")
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    del sd[gone]
    safetensors_numpy.save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(UserError) as e:
        convert(d, tmp_path / "x.gguf")
    assert gone in _one_line(e)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()

    # a shape mismatch (config disagrees with the weights)
    d = tmp_path / "shape"
    shutil.copytree(hf["gemma4"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        convert(d, tmp_path / "x.gguf")
    assert "experts.gate_up_proj" in _one_line(e) and "shape" in str(e.value)

    # tensors the arch does not map (e.g. per-layer embeddings) are not silently dropped
    d = tmp_path / "extra"
    shutil.copytree(hf["qwen3moe"], d)
    sd = safetensors_numpy.load_file(d / "model.safetensors")
    sd["model.layers.0.mlp.shared_expert.up_proj.weight"] = np.zeros((32, 64), np.float32)
    safetensors_numpy.save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(UserError) as e:
        convert(d, tmp_path / "x.gguf")
    assert "shared_expert" in _one_line(e)

    # no tokenizer
    d = tmp_path / "notok"
    shutil.copytree(hf["qwen3moe"], d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(UserError) as e:
        convert(d, tmp_path / "x.gguf")
    assert "tokenizer.json" in _one_line(e)


@pytest.mark.parametrize("model_type", [["qwen3_moe"], {"name": "qwen3_moe"}, None, 3])
def test_model_type_that_is_not_a_name_is_a_user_error(model_type, tmp_path):
    # a list or object used to reach a dict lookup and crash with "unhashable type"
    config = {} if model_type is None else {"model_type": model_type}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        convert(tmp_path, tmp_path / "x.gguf")
    assert f"model_type {model_type!r} is not supported" in _one_line(e) and "qwen3_moe, gpt_oss, gemma4" in str(e.value)


# --- llama.cpp as the oracle --------------------------------------------------------


def _llama(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHES)
def test_llama_cpp_tokenizes_like_hf(arch, hf, gguf):
    ht = transformers.AutoTokenizer.from_pretrained(hf[arch])
    llm = _llama(gguf(arch, "q8_0"))
    try:
        chat = ht.apply_chat_template([{"role": "user", "content": SAMPLES[0]}], tokenize=False, add_generation_prompt=True)
        for text in (*SAMPLES, chat):
            add_bos = arch == "gemma4" and text is not chat  # the gemma chat template writes <bos> itself
            want = ht(text, add_special_tokens=add_bos).input_ids
            got = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
            assert got == want, text
    finally:
        llm.close()


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHES)
def test_llama_cpp_greedy_next_token_matches_transformers(arch, hf, gguf):
    ht = transformers.AutoTokenizer.from_pretrained(hf[arch])
    model = load_model(hf[arch])
    llm = _llama(gguf(arch, "f32"))
    try:
        for text in SAMPLES:
            ids = ht(text).input_ids
            with torch.no_grad():
                want = model(torch.tensor([ids])).logits[0, -1].numpy()
            llm.reset()
            llm.eval(ids)
            got = np.asarray(llm.scores[len(ids) - 1])
            assert int(got.argmax()) == int(want.argmax()), (
                f"{text!r}: llama.cpp {got.argmax()} vs HF {want.argmax()}, max |diff| {np.abs(got - want).max():.4f}"
            )
    finally:
        llm.close()


@pytest.mark.oracle
def test_llama_cpp_runs_the_mxfp4_conversion_like_the_dequantized_twin(hf, tmp_path):
    mx, twin = gpt_oss_mxfp4_pair(hf["gpt-oss"], tmp_path / "mx", tmp_path / "twin")
    path = convert(mx, tmp_path / "mx.gguf", "f32")
    ht = transformers.AutoTokenizer.from_pretrained(twin)
    model = load_model(twin)
    llm = _llama(path)
    try:
        for text in SAMPLES:
            ids = ht(text).input_ids
            with torch.no_grad():
                want = model(torch.tensor([ids])).logits[0, -1].numpy()
            llm.reset()
            llm.eval(ids)
            got = np.asarray(llm.scores[len(ids) - 1])
            assert int(got.argmax()) == int(want.argmax()), f"{text!r}: max |diff| {np.abs(got - want).max():.4f}"
    finally:
        llm.close()


def test_row_slabs_do_not_change_the_bytes(hf, gguf, tmp_path, monkeypatch):
    from moe_pipe.shared.convert import plan as convert_plan

    monkeypatch.setattr(convert_plan, "_SLAB_ELEMS", 100)  # 2-D tensors in 1-2 row slabs
    a, b = read_tensors(convert(hf["gemma4"], tmp_path / "slabs.gguf", "q8_0")), read_tensors(gguf("gemma4", "q8_0"))
    for n in b:
        assert a[n][1].tobytes() == b[n][1].tobytes(), n
