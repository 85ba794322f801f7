"""The model families moe-pipe runs, one `Family` each: the one table every
shared layer looks a family up in (docs/adding-a-family.md).

A family's code lives in its folder under shared/families/, one part per layer it
plugs into, and each part keeps that layer's place in the import stack
(tests/test_layering.py):

| part         | layer it plugs into | what it holds                                             |
|--------------|---------------------|-----------------------------------------------------------|
| `spec.py`    | gguf                | the GGUF metadata reader and the tensors each layer needs |
| `model.py`   | model               | the forward pass (`Model`)                                |
| `convert.py` | convert             | the Hugging Face rules of `moe-pipe convert`              |
| `plan.py`    | makemodel           | the make-model tensor plan, presets, vocabulary, template |

This module is a leaf: it names the families and loads a part only when a
layer asks for it (`Family.part`), so no layer imports another layer's code
through it, and `moe-pipe --help` loads none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from types import ModuleType

PARTS = ("spec", "model", "convert", "plan")


@dataclass(frozen=True)
class Family:
    """One model family: its folder, the GGUF architecture llama.cpp writes for
    it, and the Hugging Face `model_type`s that `moe-pipe convert` reads."""

    name: str  # its folder, shared/families/<name>/, and the name people use
    arch: str  # GGUF general.architecture
    hf_model_types: tuple[str, ...]

    def part(self, part: str) -> ModuleType:
        """The family's module for one layer (PARTS), shared/families/<name>/<part>.py, imported on first use."""
        if part not in PARTS:
            raise ValueError(f"no family part {part!r} (parts: {', '.join(PARTS)})")
        return import_module(f"{__package__}.families.{self.name}.{part}")

    @property
    def label(self) -> str:
        """How the CLI and docs list it: the GGUF arch, with the family's own name where they differ."""
        return self.arch if self.name == self.arch else f"{self.arch} ({self.name})"


# The families, in the order the CLI, the docs and the tests list them. Adding one: a folder and a line here.
FAMILIES: tuple[Family, ...] = (
    Family("qwen3moe", "qwen3moe", ("qwen3_moe",)),
    Family("gpt_oss", "gpt-oss", ("gpt_oss",)),
    Family("gemma4", "gemma4", ("gemma4", "gemma4_text")),
    Family("qwen35moe", "qwen35moe", ("qwen3_5_moe", "qwen3_5_moe_text")),
    Family("mixtral", "llama", ("mixtral",)),
    Family("glm4moe", "glm4moe", ("glm4_moe",)),
    Family("lfm2moe", "lfm2moe", ("lfm2_moe",)),
    Family("deepseek2", "deepseek2", ("deepseek_v2", "deepseek_v3")),
    Family("qwen2moe", "qwen2moe", ("qwen2_moe",)),
    Family("bailingmoe3", "bailingmoe3", ("bailing_hybrid",)),
    Family("deepseek4", "deepseek4", ("deepseek_v4",)),
)

ARCHES: tuple[str, ...] = tuple(f.arch for f in FAMILIES)
_BY_ARCH = {f.arch: f for f in FAMILIES}
_BY_NAME = {f.name: f for f in FAMILIES}


def by_arch(arch: str) -> Family | None:
    """The family whose GGUF files say `general.architecture = arch`."""
    return _BY_ARCH.get(arch)


def by_name(name: str) -> Family | None:
    """The family by its GGUF arch or its own name (`mixtral` and `llama` are one family)."""
    return _BY_ARCH.get(name) or _BY_NAME.get(name.replace("-", "_"))


def by_hf_model_type(model_type: str) -> Family | None:
    """The family that converts a Hugging Face checkpoint of this `model_type`."""
    return next((f for f in FAMILIES if model_type in f.hf_model_types), None)
