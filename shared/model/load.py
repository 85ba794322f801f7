"""Which forward pass runs a GGUF: the family's model part, and `load_model`.

The family comes from the registry (shared/family_registry.py) by the file's
`general.architecture`; its `model.py` part is imported only then, so a process
loads the forward pass of the one family it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import numpy as np

from ..errors import GGUFError
from ..family_registry import ARCHES, by_arch
from ..gguf.model_file import ModelFile
from .base import ModelOptions, MoEModel
from .weights import ExpertSource

__all__ = ["ModelOptions", "ModelPart", "load_model", "model_class"]


class ModelPart(Protocol):
    """What a family's model part (`shared/families/<family>/model.py`) exports."""

    Model: type[MoEModel]
    """The family's forward pass: a `MoEModel` subclass, built as
    `Model(mf, top_k=, experts=, dense_view=, options=)` (base.py says what it overrides)."""


def model_class(mf: ModelFile) -> type[MoEModel]:
    """The forward pass of `mf`'s architecture; a GGUFError naming the supported ones if none runs it."""
    family = by_arch(mf.spec.arch)
    if family is None:
        raise GGUFError(mf.gguf.path, f"architecture {mf.spec.arch!r} has no forward pass (supported: {', '.join(ARCHES)})")
    return cast(ModelPart, family.part("model")).Model


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
    return model_class(mf)(mf, top_k=top_k, experts=experts, dense_view=dense_view, options=options)
