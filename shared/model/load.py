"""Which forward pass runs a GGUF: the architecture table and `load_model`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.model_file import ModelFile
from moe_pipe.shared.model import deepseek2, gemma4, glm4moe, gpt_oss, lfm2moe, mixtral, qwen2moe, qwen3moe, qwen35moe
from moe_pipe.shared.model.base import ModelOptions, MoEModel
from moe_pipe.shared.model.weights import ExpertSource

__all__ = ["ARCHITECTURES", "ModelOptions", "load_model"]

ARCHITECTURES: dict[str, type[MoEModel]] = {
    "qwen3moe": qwen3moe.Model,
    "gpt-oss": gpt_oss.Model,
    "gemma4": gemma4.Model,
    "qwen35moe": qwen35moe.Model,
    "glm4moe": glm4moe.Model,
    "lfm2moe": lfm2moe.Model,
    "deepseek2": deepseek2.Model,
    "llama": mixtral.Model,
    "qwen2moe": qwen2moe.Model,
}


def load_model(
    mf: ModelFile,
    *,
    top_k: int | None = None,
    experts: ExpertSource | None = None,
    dense_view: Callable[[str], np.ndarray] | None = None,
    options: ModelOptions | None = None,
) -> MoEModel:
    """The forward pass of `mf`'s architecture, every layer's weights resolved.

    top_k: experts per token (default: the model's own); experts: where routed
    experts come from (default: the file mapping); dense_view: where dense
    tensors are read (default: the file mapping); options: everything else
    about how it runs (default: exact and unobserved). All fixed from here on."""
    cls = ARCHITECTURES.get(mf.spec.arch)
    if cls is None:
        raise GGUFError(mf.gguf.path, f"architecture {mf.spec.arch!r} has no forward pass (supported: {', '.join(ARCHITECTURES)})")
    return cls(mf, top_k=top_k, experts=experts, dense_view=dense_view, options=options)
