"""shared/model/weights.py with shared/gguf/layout.py: NVFP4 tensors and their second-level
scales (`.scale` sidecars), as llama.cpp's converter writes them for NVIDIA's FP4 checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from moe_pipe.shared import quant
from moe_pipe.shared.errors import GGUFError, UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

from .ggufgen import with_nvfp4_dequantized
from .oracle_checks import llama, rel_err

PROMPT = [1, 5, 9, 200, 33, 7, 88, 1000, 3]


def _logits(path: Path) -> np.ndarray:
    with open_model(path) as mf:
        model = load_model(mf)
        return model.forward(PROMPT, model.new_cache(64), all_logits=True)


@pytest.fixture
def float_activations():
    """Int8 activations off: every product of the NVFP4 file and of its F32 twin on the same
    float activations (the int8 kernels are held to gguf's dequantizer in tests/test_quant.py)."""
    before = quant.int8_activations()
    quant.set_int8_activations(False)
    yield
    quant.set_int8_activations(before)


@pytest.fixture(scope="module")
def nvfp4_files(tmp_path_factory) -> dict[str, Path]:
    """Tiny qwen3moes: NVFP4 experts beside F32 (for llama.cpp: no int8 rounding elsewhere), and
    every layer matrix NVFP4 (sidecars [1] a tensor, [n_expert] an expert tensor)."""
    d = tmp_path_factory.mktemp("nvfp4")
    return {
        "experts": make_model("qwen3moe", "tiny", d / "experts.gguf", quant="F32", experts="NVFP4"),
        "all": make_model("qwen3moe", "tiny", d / "all.gguf", quant="NVFP4"),
    }


def test_nvfp4_experts_logits_are_the_dequantized_model_times_its_scales(nvfp4_files, tmp_path, float_activations):
    """Every NVFP4 tensor decoded by gguf-py and multiplied by its sidecar (one an expert) into an
    F32 file: the same logits at every position."""
    src = nvfp4_files["experts"]
    assert rel_err(_logits(src), _logits(with_nvfp4_dequantized(src, tmp_path / "twin.gguf"))) < 2e-5


FAMILIES = ("qwen3moe", "deepseek2", "glm4moe", "qwen35moe", "gpt-oss", "lfm2moe", "bailingmoe3", "deepseek4", "llama", "qwen2moe")


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_reads_nvfp4_layers_as_their_dequantized_twin(arch, tmp_path, float_activations):
    """--quant NVFP4: every layer matrix NVFP4, with the sidecars llama.cpp reads ([1] a tensor,
    [n_expert] an expert tensor) and none elsewhere (MLA's per-head k_b/v_b, fused experts, the
    embedding and head): the logits of the F32 twin (measured 5e-7 to 4e-6)."""
    src = make_model(arch, "tiny", tmp_path / "nv.gguf", quant="NVFP4")
    assert rel_err(_logits(src), _logits(with_nvfp4_dequantized(src, tmp_path / "twin.gguf"))) < 2e-5


def test_a_family_tensor_named_as_the_sidecar_is_refused_when_making(tmp_path):
    """gemma4's own per-expert down scale is `ffn_down_exps.scale`, the NVFP4 sidecar's name."""
    with pytest.raises(UserError, match=r"blk\.0\.ffn_down_exps\.scale, a tensor this family has already"):
        make_model("gemma4", "tiny", tmp_path / "g.gguf", experts="NVFP4")


def test_the_made_file_carries_the_sidecars_llama_cpp_reads(nvfp4_files):
    r = GGUFReader(nvfp4_files["all"])
    t = {x.name: x for x in r.tensors}
    n_expert = int(r.fields["qwen3moe.expert_count"].contents())
    assert t["blk.0.ffn_gate_exps.weight"].tensor_type == QT.NVFP4
    for stem, n in (("blk.0.ffn_down_exps", n_expert), ("blk.1.attn_q", 1), ("blk.0.attn_output", 1)):
        scale, inp = t[stem + ".scale"], t[stem + ".input_scale"]
        assert scale.tensor_type == inp.tensor_type == QT.F32 and list(scale.shape) == list(inp.shape) == [n]
        assert np.all(np.asarray(scale.data) > 0)
    assert len(set(np.asarray(t["blk.0.ffn_down_exps.scale"].data).tolist())) == n_expert  # one an expert
    assert "token_embd.scale" not in t and "output.scale" not in t  # llama.cpp reads a layer's only
    assert int(r.fields["general.file_type"].contents()) == 39  # LLAMA_FTYPE_MOSTLY_NVFP4


def test_llama_cpp_reads_the_same_model(nvfp4_files):
    """llama.cpp multiplies each product by the sidecar too: logits within its activation rounding
    (2.5 % measured; with the scales left out of ours they differ by 130 %)."""
    llm = llama(nvfp4_files["experts"], n_ctx=64)
    llm.eval(PROMPT)
    assert rel_err(_logits(nvfp4_files["experts"]), np.asarray(llm.scores[: len(PROMPT)])) < 0.1


def test_a_sidecar_of_the_wrong_shape_is_refused(nvfp4_files, tmp_path):
    from gguf import GGUFWriter

    src = nvfp4_files["experts"]
    r = GGUFReader(src)
    arch = "qwen3moe"
    dst = tmp_path / "bad.gguf"
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.1.ffn_up_exps.scale":
            data = data[:3]
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up_exps\.scale.*expert scales must be F32 \[8\]"):
        open_model(dst)
