"""shared/analysis/standin.py: a decode step of a model's own forward pass, timed on
stand-in weights of the file's exact types and shapes, with nothing of the file read."""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.analysis import standin
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.quant.blocks import block_format


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "gemma4", "deepseek2"])
def test_a_step_runs_the_families_forward_pass_on_a_file_of_holes(arch, tmp_path):
    # sparse: the tensors' bytes are holes (zeros); a step that read them would still run, so
    # the weights it multiplies are checked to be the stand-in's, not the file's
    path = make_model(arch, "tiny", tmp_path / "m.gguf", sparse=True)
    with open_model(path) as mf:
        t = standin.step_seconds(mf, None, threads=1, steps=3)
        assert 3 <= t.steps <= standin.MAX_STEPS and 0 < t.seconds < 1.0
        weights = standin.StandInWeights(mf, np.random.default_rng(0))
        name = next(n for n, ti in mf.gguf.tensors.items() if "exps" not in n and ti.qtype.name not in ("F32", "F16", "BF16", "I32"))
        made, view = weights(name), mf.gguf.view(name)
        assert made.shape == view.shape and made.dtype == view.dtype
        assert made.any() and not np.shares_memory(made, view)  # random blocks, not the file's zeros


def test_stand_in_experts_are_whole_valid_blocks_of_each_part(tmp_path):
    path = make_model("qwen3moe", "tiny", tmp_path / "m.gguf", sparse=True)
    with open_model(path) as mf:
        weights = standin.StandInWeights(mf, np.random.default_rng(0))
        src = standin.StandInExperts(mf, weights)
        lay = mf.layout.layers[0]
        (expert,) = src.experts(0, [3])
        for part in lay.parts:
            fmt = block_format(part.tensor.qtype)
            assert part.stride % fmt.type_size == 0
        assert src.resident(0, [1, 2]) == [True, True]
        # the same model on stand-in weights decodes finite logits: the fill keeps activations sane
        model = load_model(mf, experts=src, dense_view=weights)
        cache = model.new_cache(8)
        logits = model.decode_one(5, cache)
        assert np.isfinite(logits).all()
        assert expert is not None


def test_the_pool_holds_distinct_experts_up_to_twice_the_l3_and_no_more_than_the_model_has(tmp_path, monkeypatch):
    path = make_model("qwen3moe", "tiny", tmp_path / "m.gguf", sparse=True)
    with open_model(path) as mf:
        weights = standin.StandInWeights(mf, np.random.default_rng(0))
        every = mf.spec.n_expert * len(mf.layout.layers)
        pools = list(standin.StandInExperts(mf, weights)._pools.values())  # one per expert shape and type mix
        assert [len(p) for p in pools] == [every] * len(pools)  # a tiny model's experts all fit: as many as it has
        monkeypatch.setattr(standin, "POOL_BYTES", 3 * max(lay.expert_bytes for lay in mf.layout.layers))
        pool = next(iter(standin.StandInExperts(mf, weights)._pools.values()))
        assert len(pool) >= 3
        a, b = (np.concatenate([v for v in e.values()]) for e in pool[:2])
        assert not np.shares_memory(a, b)


def test_a_header_alone_is_timed_as_the_whole_file(tmp_path):
    # the tensor table is all the stand-in reads: the model before its download runs the same
    # forward pass on the same shapes (the doctor's forecast from a fetched header)
    from moe_pipe.shared.gguf.model_file import open_header_model

    path = make_model("qwen3moe", "tiny", tmp_path / "m.gguf")
    with open_model(path) as mf:
        header = tmp_path / "h"
        header.write_bytes(path.read_bytes()[: mf.gguf.data_start()])  # metadata and tensor table only
    with open_header_model([(header, path.stat().st_size)]) as alone, open_model(path) as whole:
        assert alone.gguf.header_only
        t = standin.step_seconds(alone, None, threads=1, steps=3)
        assert 0 < t.seconds < 1.0
        names = [n for n in whole.gguf.tensors if "exps" not in n]
        a, b = standin.StandInWeights(alone, np.random.default_rng(0)), standin.StandInWeights(whole, np.random.default_rng(0))
        for n in names:
            assert a(n).shape == b(n).shape == whole.gguf.view(n).shape and a(n).dtype == whole.gguf.view(n).dtype
