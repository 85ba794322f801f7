"""Expert gate and up weights stored either way, fused (`ffn_gate_up_exps`,
gate rows first, with `ffn_gate_up_exps.bias` on gpt-oss) or separate, run on
every architecture, read from the file mapping and from slabs as the
pipeline's compute reads them, and compute exactly what the other layout
computes. (The layout check accepts both for any architecture; a fused
gpt-oss file used to fail with a TypeError at its first expert.)"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from moe_pipe.shared.experts.placement import expert_view, placement_for
from moe_pipe.shared.gguf.layout import aligned_bytes
from moe_pipe.shared.gguf.model_file import ModelFile, open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.model.weights import Expert

PROMPT = [1, 5, 9, 20, 33, 70, 100, 200]
N = 6


def restack_gate_up(src, dst) -> None:
    """Rewrite `src` with its experts' gate and up (and their biases) stored the
    other way: separate ones fused into one gate_up tensor, gate rows first
    (llama.cpp's fused layout), or a fused one split in two. Every other tensor
    and key is copied as is."""
    r = GGUFReader(src)
    w = GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":  # the writer adds these
            continue
        vtype = f.types[0]
        w.add_key_value(f.name, f.contents(), vtype, sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        data = np.asarray(t.data)  # [E, rows, ...]
        if "ffn_up_exps" in t.name:
            continue  # folded into gate_up below
        if "ffn_gate_exps" in t.name:
            up = tensors[t.name.replace("ffn_gate_exps", "ffn_up_exps")]
            assert up.tensor_type == t.tensor_type
            fused = np.concatenate([data, np.asarray(up.data)], axis=1)  # gate rows first
            w.add_tensor(t.name.replace("ffn_gate_exps", "ffn_gate_up_exps"), fused, raw_dtype=t.tensor_type)
        elif "ffn_gate_up_exps" in t.name:
            f = data.shape[1] // 2
            w.add_tensor(t.name.replace("ffn_gate_up_exps", "ffn_gate_exps"), data[:, :f].copy(), raw_dtype=t.tensor_type)
            w.add_tensor(t.name.replace("ffn_gate_up_exps", "ffn_up_exps"), data[:, f:].copy(), raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class SlabExperts:
    """Experts as the pipeline's compute sees them: each expert's extents copied
    into a slab where the reader would place them, then viewed with expert_view."""

    held_together = 1 << 30  # a fresh slab per expert: every view stays usable

    def __init__(self, mf: ModelFile):
        self.mf = mf

    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[Expert]:
        lay = self.mf.layout.layers[layer]
        for e in ids:
            extents = lay.extents(e)
            slab = np.zeros(aligned_bytes(extents, lay_align := self.mf.layout.align), np.uint8)
            for part, (at, n) in zip(lay.parts, placement_for(extents, lay_align).regions):
                slab[at : at + n] = np.asarray(self.mf.gguf.view(part.tensor.name)[e]).reshape(-1).view(np.uint8)
            yield expert_view(lay, e, slab, placement_for(extents, lay_align))

    def resident(self, layer: int, ids: Sequence[int]) -> list[bool]:
        return [True] * len(ids)

    def prefetch(self, layer: int, ids: Sequence[int]) -> None:
        pass


def greedy(mf: ModelFile, experts=None) -> tuple[list[int], np.ndarray]:
    model = load_model(mf, experts=experts)
    cache = model.new_cache(64)
    logits = model.prefill(PROMPT, cache)
    tokens, rows = [], [logits]
    for _ in range(N):
        tokens.append(int(np.argmax(logits)))
        logits = model.decode_one(tokens[-1], cache)
        rows.append(logits)
    return tokens, np.stack(rows)


# The file each architecture is made with, and the parts of the other layout.
RESTACKED = {
    "gpt-oss": ["gate_up", "gate_up_bias", "down", "down_bias"],
    "qwen3moe": ["gate_up", "down"],
    "gemma4": ["gate", "up", "down"],
}


@pytest.fixture(scope="module", params=list(RESTACKED))
def pair(request, tmp_path_factory):
    """(as made, restacked) model files, open for the whole module: a failure's
    report shows views of their mappings, which must still be mapped then."""
    d = tmp_path_factory.mktemp("restack")
    made = make_model(request.param, "tiny", d / "made.gguf", layers=2)
    restacked = d / "restacked.gguf"
    restack_gate_up(made, restacked)
    with open_model(made) as a, open_model(restacked) as b:
        yield a, b


def test_the_restacked_file_has_the_other_layout(pair):
    made, restacked = pair
    assert [p.name for p in restacked.layout.layers[0].parts] == RESTACKED[made.spec.arch]


@pytest.mark.parametrize("source", ["file", "slab"])
def test_either_layout_computes_the_same(pair, source):
    made, restacked = pair
    want_tokens, want_logits = greedy(made)
    tokens, logits = greedy(restacked, SlabExperts(restacked) if source == "slab" else None)
    assert tokens == want_tokens
    # Each output row of a matrix product is its own dot product, so gate and
    # up computed as one 2F-row product are the same floats as two F-row ones.
    np.testing.assert_array_equal(logits, want_logits)
