"""`moe-pipe convert` writes a checkpoint's NextN/MTP block as llama.cpp's converter does
(shared/convert/converter.py; docs/models.md § The MTP/NextN block), and `--no-mtp`
leaves it out.

transformers does not save the MTP layer of Qwen3.5-MoE (`mtp.*`, ignored on load), of
GLM-4.5 or of Ling 3.0 (`model.layers.{L}`), so the tiny checkpoints get one added as the
published checkpoints name it (tests/hfmodels.py `with_mtp_block`). The file with the block opens,
its block is checked and never read, and every token is the one of the file without it,
in moe-pipe and in llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from moe_pipe.shared.convert.converter import convert
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.model.load import load_model

from . import hfmodels, oracle


def _nextn(*names: str) -> set[str]:
    return {f"nextn.{n}.weight" for n in names}


# family, its tiny checkpoint, the decoder's layers, the block's own tensors (beside its decoder layer's).
# bailingmoe3's as llama.cpp's converter names them (conversion/bailingmoe3.py `BailingMoeV3Model` maps
# Ling's eh_proj / enorm / hnorm / final_layernorm through gguf-py's tensor_mapping) and its loader loads
# them (src/models/bailingmoe3.cpp `load_arch_tensors`: NEXTN_EH_PROJ, NEXTN_ENORM, NEXTN_HNORM and
# LAYER_OUT_NORM for the layers past n_layer), both as of zsogitbe/llama.cpp 3733366 (the
# conversion/bailingmoe3.py the search index holds; ggml-org's own copy is not in it).
# The tensors src/models/bailingmoe3.cpp `load_arch_tensors` creates for a block past n_layer
# (zsogitbe/llama.cpp 3733366), with no q_lora_rank (the tiny checkpoint's: attn_q, not attn_q_a/_b).
LING_MTP_BLOCK = {
    f"{t}.{'bias' if t == 'exp_probs_b' else 'weight'}"
    for t in (
        "attn_norm", "attn_q", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_gate", "attn_output",
        "ffn_norm", "ffn_gate_inp", "exp_probs_b", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
        "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
        "nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "layer_output_norm",
    )
}  # fmt: skip
CASES = [
    ("qwen35moe", "text", 4, _nextn("eh_proj", "enorm", "hnorm", "shared_head_norm")),
    ("glm4moe", "air", 3, _nextn("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head")),
    ("bailingmoe3", "default", 4, _nextn("eh_proj", "enorm", "hnorm") | {"layer_output_norm.weight"}),
]


@dataclass(frozen=True)
class Pair:
    family: str
    n_layer: int  # the decoder's
    own: set[str]  # the block's own tensors (nextn.*, bailingmoe3's layer_output_norm)
    hf: Path  # the checkpoint with the MTP layer
    with_block: Path  # converted as llama.cpp does by default
    plain: Path  # converted with --no-mtp
    prompt: list[int]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request, tmp_path_factory) -> Pair:
    family, config, n_layer, own = request.param
    base = oracle.checkpoint(family, config, tmp_path_factory)
    d = tmp_path_factory.mktemp(f"{family}-mtp")
    hf = hfmodels.with_mtp_block(base.hf_dir, d / "hf", family)
    with_block, plain = convert(hf, d / "mtp.gguf", "f32"), convert(hf, d / "plain.gguf", "f32", mtp=False)
    return Pair(family, n_layer, own, hf, with_block, plain, list(base.prompts[0]))


@pytest.mark.oracle
def test_the_block_is_written_after_the_decoder_and_no_mtp_leaves_it_out(pair):
    from safetensors.numpy import load_file

    family, n_layer, own, hf, with_block, plain = pair.family, pair.n_layer, pair.own, pair.hf, pair.with_block, pair.plain
    with open_model(with_block) as b, open_model(plain) as a:
        assert b.gguf.meta(f"{family}.block_count") == n_layer + 1 and b.gguf.meta(f"{family}.nextn_predict_layers") == 1
        assert a.gguf.meta(f"{family}.block_count") == n_layer
        assert a.gguf.meta(f"{family}.nextn_predict_layers", 0) == 0  # qwen35moe: absent, as llama.cpp; glm4moe: 0
        assert (b.spec.n_layer, b.spec.n_layer_nextn, a.spec.n_layer_nextn) == (n_layer, 1, 0)
        block = {n for n in b.gguf.tensors if n.startswith(f"blk.{n_layer}.")}
        assert block == b.layout.nextn_tensor_names
        assert set(a.gguf.tensors) == set(b.gguf.tensors) - block
        # a whole decoder layer (qwen35moe's a full-attention one, glm4moe's a routed one,
        # bailingmoe3's a gated-MLA one as its last) and its own tensors
        last = {n.split(".", 2)[2] for n in a.gguf.tensors if n.startswith(f"blk.{n_layer - 1}.")}
        assert {n.split(".", 2)[2] for n in block} == last | own
        assert all(np.array_equal(np.asarray(a.gguf.view(n)), np.asarray(b.gguf.view(n))) for n in a.gguf.tensors)
        mtp = load_file(hf / "mtp.safetensors")
        view = lambda t: np.asarray(b.gguf.view(f"blk.{n_layer}.nextn.{t}.weight"))  # noqa: E731
        if family == "qwen35moe":  # mtp.fc as is; its norms scale by 1 + w, stored as 1 + w
            assert np.array_equal(view("eh_proj"), mtp["mtp.fc.weight"])
            assert np.array_equal(view("enorm"), mtp["mtp.pre_fc_norm_embedding.weight"] + np.float32(1))
            assert np.array_equal(view("shared_head_norm"), mtp["mtp.norm.weight"] + np.float32(1))
            assert np.array_equal(np.asarray(b.gguf.view("blk.4.attn_q.weight")), mtp["mtp.layers.0.self_attn.q_proj.weight"])
        elif family == "glm4moe":
            assert np.array_equal(view("eh_proj"), mtp["model.layers.3.eh_proj.weight"])
            assert np.array_equal(view("shared_head_norm"), mtp["model.layers.3.shared_head.norm.weight"])
        else:  # Ling's MTP layer is an MLA layer (head_count_kv 1), final_layernorm its layer_output_norm
            assert {n.split(".", 2)[2] for n in block} == LING_MTP_BLOCK  # what llama.cpp's loader creates for it
            assert list(b.gguf.meta(f"{family}.attention.head_count_kv")) == [0, 1, 0, 1, 1]
            assert list(a.gguf.meta(f"{family}.attention.head_count_kv")) == [0, 1, 0, 1]
            assert np.array_equal(view("eh_proj"), mtp["model.layers.4.eh_proj.weight"])
            assert np.array_equal(view("hnorm"), mtp["model.layers.4.hnorm.weight"])
            assert np.array_equal(np.asarray(b.gguf.view("blk.4.layer_output_norm.weight")), mtp["model.layers.4.final_layernorm.weight"])
            assert np.array_equal(np.asarray(b.gguf.view("blk.4.attn_gate.weight")), mtp["model.layers.4.attention.g_proj.weight"])


@pytest.mark.oracle
def test_the_block_is_never_read_and_changes_no_token(pair, monkeypatch):
    """Greedy tokens with the block are the --no-mtp file's, in moe-pipe (which never views a
    tensor of the block) and in llama.cpp, which loads the block and runs the decoder alone."""
    from moe_pipe.shared.gguf.reader import GGUFFile

    from .oracle_checks import llama, llama_greedy, ours_greedy

    n_layer, with_block, plain, prompt = pair.n_layer, pair.with_block, pair.plain, pair.prompt
    with open_model(plain) as mf:
        want = ours_greedy(load_model(mf), prompt, 8)
    viewed: list[str] = []
    real_view = GGUFFile.view
    monkeypatch.setattr(GGUFFile, "view", lambda self, name: viewed.append(name) or real_view(self, name))
    with open_model(with_block) as mf:
        got = ours_greedy(load_model(mf), prompt, 8)
        block = mf.layout.nextn_tensor_names
    assert got == want
    assert f"blk.{n_layer - 1}.ffn_gate_exps.weight" in viewed  # the count sees the reads
    assert block and block.isdisjoint(viewed)
    assert llama_greedy(llama(with_block), prompt, 8) == llama_greedy(llama(plain), prompt, 8)
