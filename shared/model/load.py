"""Which forward pass runs a GGUF: the architecture table and `load_model`."""

from __future__ import annotations

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.model_file import ModelFile
from moe_pipe.shared.model import gemma4, gpt_oss, qwen3moe
from moe_pipe.shared.model.base import MoEModel

ARCHITECTURES = {"qwen3moe": qwen3moe.Model, "gpt-oss": gpt_oss.Model, "gemma4": gemma4.Model}


def load_model(mf: ModelFile, top_k: int | None = None, experts=None, dense_view=None) -> MoEModel:
    cls = ARCHITECTURES.get(mf.spec.arch)
    if cls is None:
        raise GGUFError(mf.gguf.path, f"architecture {mf.spec.arch!r} has no forward pass (supported: {', '.join(ARCHITECTURES)})")
    return cls(mf, top_k=top_k, experts=experts, dense_view=dense_view)
