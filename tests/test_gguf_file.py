"""The GGUF layer: opening, split sets, and the one-line errors for bad files."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.reader import GGUFFile

from .ggufgen import patch, patch_tensor_info, write_qwen_like


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_qwen_like(tmp_path_factory.mktemp("m") / "small.gguf")


def _copy(src, tmp_path, name="copy.gguf"):
    dst = tmp_path / name
    shutil.copyfile(src, dst)
    return dst


def _one_line_error(path, match):
    with pytest.raises(GGUFError) as exc:
        open_model(path)
    msg = str(exc.value)
    assert "\n" not in msg
    assert str(path) in msg
    assert match in msg, msg
    return msg


def test_tensors_match_gguf_reader(small):
    ref = GGUFReader(small)
    with GGUFFile(small) as f:
        assert len(f.tensors) == len(ref.tensors)
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info.offset == t.data_offset
            assert info.nbytes == t.n_bytes
            assert info.shape == tuple(reversed([int(d) for d in t.shape]))
            assert info.qtype == t.tensor_type
            assert np.array_equal(f.view(t.name), t.data)


def test_spec_from_metadata(small):
    with open_model(small) as mf:
        s = mf.spec
        assert (s.arch, s.n_layer, s.n_embd, s.n_expert, s.n_expert_used, s.n_ff_exp) == ("qwen3moe", 2, 64, 4, 2, 32)
        assert s.n_head == 4 and s.n_head_kv == (2, 2) and s.head_dim_k == (16, 16)
        assert s.n_vocab == 96 and not s.tied_output
        assert s.rope.freq_base == 1e6 and s.rms_eps == pytest.approx(1e-6)


def test_garbage_file(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(np.random.default_rng(0).bytes(4096))
    _one_line_error(p, "not a GGUF file")


def test_empty_and_missing_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _one_line_error(p, "empty file")
    _one_line_error(tmp_path / "nope.gguf", "no such file")


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_data(small, tmp_path, keep):
    p = _copy(small, tmp_path)
    size = p.stat().st_size
    with open(p, "r+b") as fh:
        fh.truncate(int(size * keep))
    msg = _one_line_error(p, "truncated")
    assert "needs bytes" in msg


def test_truncated_header(small, tmp_path):
    p = _copy(small, tmp_path)
    with open(p, "r+b") as fh:
        fh.truncate(200)
    _one_line_error(p, "truncated or corrupt")


def test_unknown_tensor_type(small, tmp_path):
    p = _copy(small, tmp_path)
    patch_tensor_info(p, "blk.0.ffn_up_exps.weight", raw_type=250)
    _one_line_error(p, "unknown ggml type id 250")


def test_offset_past_end(small, tmp_path):
    p = _copy(small, tmp_path)
    patch_tensor_info(p, "output.weight", rel_offset=1 << 40)
    _one_line_error(p, "needs bytes")


def test_misaligned_offset(small, tmp_path):
    p = _copy(small, tmp_path)
    patch_tensor_info(p, "output.weight", rel_offset=3)
    _one_line_error(p, "not aligned")


def test_overlapping_tensors(small, tmp_path):
    p = _copy(small, tmp_path)
    patch_tensor_info(p, "blk.1.ffn_up_exps.weight", rel_offset=0)
    _one_line_error(p, "overlap")


def test_bad_magic_in_place(small, tmp_path):
    p = _copy(small, tmp_path)
    patch(p, 0, b"GGML")
    _one_line_error(p, "bad magic")


def test_metadata_wrong_type(tmp_path):
    p = write_qwen_like(tmp_path / "badmeta.gguf", block_count_as_string=True)
    _one_line_error(p, "qwen3moe.block_count")


def test_expert_count_mismatch(tmp_path):
    p = write_qwen_like(tmp_path / "mismatch.gguf", meta_expert_count=8)
    _one_line_error(p, "8 experts")


def test_unsupported_architecture(small, tmp_path):
    p = _copy(small, tmp_path)
    data = p.read_bytes()
    at = data.index(b"qwen3moe")  # general.architecture value, same length
    patch(p, at, b"mistral3")
    _one_line_error(p, "not supported")


def test_split_set(tmp_path):
    first = write_qwen_like(tmp_path / "split.gguf", split_max_tensors=7)
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) >= 3 and first == shards[0]
    single = write_qwen_like(tmp_path / "single.gguf")
    with open_model(first) as a, open_model(shards[-1]) as b, open_model(single) as c:
        assert len(a.gguf.paths) == len(shards)
        assert a.spec == b.spec == c.spec.__class__(**{**c.spec.__dict__, "name": a.spec.name})
        assert set(a.gguf.tensors) == set(c.gguf.tensors)
        for name in c.gguf.tensors:  # same bytes, wherever they landed
            assert np.array_equal(a.gguf.view(name), c.gguf.view(name))
        shards_used = {t.shard for t in a.gguf.tensors.values()}
        assert shards_used == set(range(len(shards)))
        assert a.gguf.file_bytes == sum(p.stat().st_size for p in shards)


def test_split_set_missing_shard(tmp_path):
    first = write_qwen_like(tmp_path / "split.gguf", split_max_tensors=7)
    missing = sorted(tmp_path.glob("split-*-of-*.gguf"))[1]
    missing.unlink()
    msg = _one_line_error(first, "missing")
    assert missing.name in msg


def test_split_shard_mismatch(tmp_path):
    write_qwen_like(tmp_path / "split.gguf", split_max_tensors=7)
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    shutil.copyfile(shards[0], shards[1])  # shard 2 replaced by a copy of shard 1
    with pytest.raises(GGUFError, match="split metadata|more than one shard"):
        open_model(shards[0])
