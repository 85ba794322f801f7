"""The byte-range map, checked against an independent computation from gguf-py's tensor offsets."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from moe_pipe.shared.gguf.alignment import PAGE_SIZE as PAGE
from moe_pipe.shared.gguf.layout import Extent, aligned
from moe_pipe.shared.gguf.model_file import open_model

from .ggufgen import write_qwen_like


def independent_expert_ranges(path):
    """{(layer, expert): [(offset, length), ...]} from gguf-py alone."""
    out = {}
    for t in GGUFReader(path).tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or not parts[2].endswith("_exps") or parts[3] not in ("weight", "bias"):
            continue
        n_expert = int(t.shape[-1])
        per = t.n_bytes // n_expert
        for e in range(n_expert):
            out.setdefault((int(parts[1]), e), []).append((t.data_offset + e * per, per))
    return out


@pytest.mark.parametrize("qtype,alignment", [(QT.Q8_0, None), (QT.Q4_0, 64), (QT.F16, 256)])
def test_expert_extents_match_reader(tmp_path, qtype, alignment):
    p = write_qwen_like(tmp_path / "m.gguf", expert_qtype=qtype, alignment=alignment)
    want = independent_expert_ranges(p)
    with open_model(p) as mf:
        got = {
            (l, e): sorted((x.offset, x.length) for x in mf.layout.expert_extents(l, e))
            for l in range(mf.spec.n_layer)
            for e in range(mf.spec.n_expert)
        }
        assert got == {k: sorted(v) for k, v in want.items()}
        if alignment:
            assert mf.gguf.readers[0].alignment == alignment


def test_dense_is_the_complement(tmp_path):
    """The dense set is everything but the experts and the tensors read by row (the untied token
    embedding): with those, it tiles the data section exactly."""
    p = write_qwen_like(tmp_path / "m.gguf")
    with open_model(p) as mf:
        f, layout = mf.gguf, mf.layout
        assert "output.weight" in f.tensors and layout.row_tensor_names == {"token_embd.weight"}
        assert layout.row_bytes == f.tensors["token_embd.weight"].nbytes
        expert = [x for l in layout.layers for e in range(mf.spec.n_expert) for x in l.extents(e)]
        rows = [(f.tensors[n].offset, f.tensors[n].end) for n in layout.row_tensor_names]
        covered = sorted([(x.offset, x.end) for x in expert] + [(x.offset, x.end) for x in layout.dense] + rows)
        # dense + experts + by-row tensors tile the data section exactly: no gap, no overlap
        assert covered[0][0] == f.data_start(0) and covered[-1][1] == f.file_sizes[0]
        for (_, a1), (b0, _) in zip(covered, covered[1:]):
            assert a1 == b0
        dense = [t for t in f.tensors.values() if t.name not in layout.expert_tensor_names | layout.row_tensor_names]
        assert layout.dense_bytes == sum(t.nbytes for t in dense)
        for t in dense:  # every dense tensor lies inside one dense extent
            assert any(d.offset <= t.offset and t.end <= d.end for d in layout.dense), t.name
        emb = f.tensors["token_embd.weight"]
        assert not any(d.offset < emb.end and emb.offset < d.end for d in layout.dense)  # no byte of it is read whole


def test_a_tied_embedding_stays_in_the_dense_set(tmp_path):
    """A file without its own output head multiplies every token by the embedding: kept whole."""
    from moe_pipe.shared.makemodel.maker import make_model

    p = make_model("gemma4", "tiny", tmp_path / "g.gguf")
    with open_model(p) as mf:
        assert "output.weight" not in mf.gguf.tensors and mf.spec.tied_output
        assert mf.layout.row_tensor_names == frozenset() and mf.layout.row_bytes == 0
        emb = mf.gguf.tensors["token_embd.weight"]
        assert any(d.offset <= emb.offset and emb.end <= d.end for d in mf.layout.dense)


def test_sizes_and_working_set(tmp_path):
    p = write_qwen_like(tmp_path / "m.gguf", n_layer=3, n_expert=4, n_used=2, n_embd=64, n_ff=32)
    with open_model(p) as mf:
        lay = mf.layout
        per_expert = 3 * (32 * 64 // 32 * 34)  # gate + up + down, Q8_0
        assert lay.expert_bytes(0) == per_expert == lay.max_expert_bytes
        assert lay.routed_bytes_per_token() == 3 * 2 * per_expert
        assert lay.routed_bytes_per_token(top_k=1) == 3 * per_expert
        assert lay.total_expert_bytes == 3 * 4 * per_expert
        assert lay.slab_bytes % PAGE == 0 and per_expert <= lay.slab_bytes <= per_expert + 3 * 2 * PAGE
        assert lay.min_cache_bytes() == 3 * 2 * lay.slab_bytes


def test_leading_dense_layers_hold_no_experts_and_no_cache(tmp_path):
    from dataclasses import replace

    from moe_pipe.shared.errors import GGUFError
    from moe_pipe.shared.experts.budget import CacheFloor
    from moe_pipe.shared.gguf.layout import build_layout
    from moe_pipe.shared.gguf.model_file import read_spec
    from moe_pipe.shared.gguf.reader import GGUFFile

    q = write_qwen_like(tmp_path / "e.gguf", n_layer=3)  # the same model with experts in every layer
    with GGUFFile(q) as f:
        spec = replace(read_spec(f), n_dense_lead=1)
        with pytest.raises(GGUFError, match="layer 0 is a dense layer .* but has expert tensors"):
            build_layout(f, spec)
    p = write_qwen_like(tmp_path / "m.gguf", n_layer=3, dense_lead=1)
    with GGUFFile(p) as f:
        with pytest.raises(GGUFError, match="layer 0 lacks expert tensors"):
            build_layout(f, replace(spec, n_dense_lead=0))
        lay = build_layout(f, spec)
        per_expert = 3 * (32 * 64 // 32 * 34)
        assert lay.layers[0].parts == () and lay.expert_bytes(0) == 0 and lay.expert_bytes(1) == per_expert
        assert lay.routed_bytes_per_token() == 2 * 2 * per_expert  # two MoE layers x top-2
        assert lay.min_cache_bytes() == 2 * 2 * lay.slab_bytes == CacheFloor.of(lay).bytes
        assert not any(n.startswith("blk.0.") for n in lay.expert_tensor_names)
        assert any(d.offset <= f.tensor("blk.0.ffn_up.weight").offset < d.end for d in lay.dense)


@pytest.mark.parametrize("offset,length", [(0, 1), (4095, 2), (4096, 4096), (123456, 884736), (32, 4406400)])
def test_aligned_read_covers_extent(offset, length):
    start, n, skip = aligned(Extent(0, offset, length), PAGE)
    assert start % PAGE == 0 and n % PAGE == 0
    assert start + skip == offset and skip + length <= n and skip < PAGE
    assert n - (skip + length) < PAGE


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "gemma4"])
def test_made_model_expert_extents_match_reader(arch, tmp_path):
    """Every expert of a made model (gpt-oss biases, gemma4 fused gate_up included)."""
    from moe_pipe.shared.makemodel.maker import make_model

    p = make_model(arch, "tiny", tmp_path / "m.gguf")
    want = independent_expert_ranges(p)
    with open_model(p) as mf:
        assert len(want) == mf.spec.n_layer * mf.spec.n_expert
        for (layer, e), ranges in want.items():
            got = [(x.offset, x.length) for x in mf.layout.expert_extents(layer, e)]
            assert sorted(got) == sorted(ranges), (layer, e)
            assert mf.layout.expert_bytes(layer) == sum(n for _, n in ranges)
        parts = {p.name for p in mf.layout.layers[0].parts}
        expected = {
            "qwen3moe": {"gate", "up", "down"},
            "gpt-oss": {"gate", "up", "down", "gate_bias", "up_bias", "down_bias"},
            "gemma4": {"gate_up", "down"},
        }[arch]
        assert parts == expected
        # the slices hold exactly the expert's bytes of the stacked tensor
        name = mf.layout.layers[1].parts[0].tensor.name
        stack = mf.gguf.view(name)
        ext = mf.layout.expert_extents(1, 3)[0]
        raw = np.memmap(p, mode="r")[ext.offset : ext.end]
        assert np.array_equal(raw, stack[3].reshape(-1).view(np.uint8))


def test_n_expert_used_other_than_the_models_own_is_labelled_lossy(tmp_path):
    """compute.n_expert_used: the model's own is silent; another count is one LOSSY warning line;
    more than the model has is a one-line refusal naming the flag."""
    from moe_pipe.shared.errors import UserError
    from moe_pipe.shared.gguf.spec import experts_per_token, lossy_expert_count

    with open_model(write_qwen_like(tmp_path / "m.gguf")) as mf:
        spec = mf.spec
    own = spec.n_expert_used
    assert lossy_expert_count(spec, None) == lossy_expert_count(spec, own) == ""
    assert experts_per_token(spec, None) == own and experts_per_token(spec, 1) == 1
    line = lossy_expert_count(spec, 1)
    assert line == (
        f"warning: --n-expert-used 1 differs from the model's own {own}: LOSSY, faster and the outputs change (leave it out for the model's own)"
    )
    with pytest.raises(UserError, match=f"^--n-expert-used {spec.n_expert + 1} is out of range: this model has {spec.n_expert} experts"):
        experts_per_token(spec, spec.n_expert + 1)
