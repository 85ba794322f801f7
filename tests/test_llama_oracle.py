"""llama.cpp as the format oracle: it must load our made models and agree on their shape and bytes.

Needs llama-cpp-python (an optional extra that builds llama.cpp from source:
`pip install llama-cpp-python`); skipped when it is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.oracle


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "gemma4"])
def test_llama_cpp_loads_made_model(arch, tmp_path):
    path = make_model(arch, "tiny", tmp_path / f"{arch}.gguf")
    with open_model(path) as mf:
        spec, layout = mf.spec, mf.layout
        tensor_bytes = sum(t.nbytes for t in mf.gguf.tensors.values())
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    try:
        assert llm.n_vocab() == spec.n_vocab
        assert llm.n_embd() == spec.n_embd
        # llama.cpp's own sum of tensor sizes equals ours: same tensor table, same type sizes.
        assert llm._model.size() == tensor_bytes == layout.dense_bytes + layout.total_expert_bytes
        tokens = llm.tokenize(b"The river ran past 12 old mills.", add_bos=False)
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: len(tokens)])
        assert np.isfinite(logits).all() and np.abs(logits).max() > 0
    finally:
        llm.close()
