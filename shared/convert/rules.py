"""What a family's convert part (shared/families/<family>/convert.py) gives `moe-pipe convert`,
and how the converter finds it: the family registry maps a config's `model_type` to its family,
whose part maps it to one `Arch` (docs/models.md § From Hugging Face names).

An `Arch` carries the three rules every model type has (config -> hyperparameters, GGUF keys,
tensor plan) and the hooks where one model type differs from the rest, each with a neutral
default so that a family states only what is its own: the multimodal config unwrap
(`text_config`) and the tokenizer facts (`TokenizerFacts`) that shared/convert/vocab.py reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from gguf import GGUFWriter

from ..errors import UserError
from ..family_registry import FAMILIES, by_hf_model_type
from .plan import Out
from .source import Checkpoint


@dataclass(frozen=True)
class TokenizerFacts:
    """How a model type's tokenizer.json becomes `tokenizer.ggml.*` (llama.cpp's choices for it)."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), "gemma4"
    pre: str  # tokenizer.ggml.pre when the tokenizer's own Split regex names none llama.cpp knows
    add_bos: bool  # when neither tokenizer_config.json nor the post-processor says
    # the tokenizer.json spelling of this family's Split regexes -> llama.cpp's pre name for them
    known_pre: Mapping[str, str] = field(default_factory=dict)
    pre_fixed: bool = False  # llama.cpp forces `pre` whatever the tokenizer.json splits by
    # special ids llama.cpp sets by token text ("bos", "eot", "eom" -> the token), over tokenizer_config.json
    specials: Mapping[str, str] = field(default_factory=dict)
    visible: frozenset[str] = frozenset()  # added special tokens kept USER_DEFINED, so chat parsers see them
    byte_pieces: bool = False  # "<0xXX>" pieces are BYTE tokens (byte fallback)
    sentencepiece: bool = False  # a score per piece instead of merges; the dummy prefix read from the tokenizer
    space_prefix: bool | None = None  # tokenizer.ggml.add_space_prefix when not SentencePiece (None: not written)
    # The facts instead when the tokenizer.json is byte-level BPE (a ByteLevel pre-tokenizer, no byte
    # fallback) although these are SentencePiece's: llama.cpp's llama converter takes both kinds
    # (tokenizer.model, else tokenizer.json's BPE as "gpt2" with the pre-split its hash names).
    byte_level: TokenizerFacts | None = None


def whole_config(config: dict[str, Any]) -> dict[str, Any]:
    """The neutral `text_config` hook: the config is the text model's."""
    return config


def nested_text_config(model_type: str, tie_default: bool) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A `text_config` hook for a multimodal config that nests its text model under `text_config`:
    only the text model is converted, with the outer `tie_word_embeddings` where the outer config has it."""

    def unwrap(config: dict[str, Any]) -> dict[str, Any]:
        tc = config.get("text_config")
        if not isinstance(tc, dict):
            raise UserError(f"config.json: model_type {model_type} without a text_config")
        tied = config.get("tie_word_embeddings", tc.get("tie_word_embeddings", tie_default))
        return {**tc, "tie_word_embeddings": tied}

    return unwrap


@dataclass(frozen=True)
class Arch:
    """The conversion rules of one Hugging Face model_type."""

    gguf_arch: str  # general.architecture of the output
    # the text config read into a flat dict; unsupported variants are UserErrors naming the config key.
    # The converter adds hp["mtp"] (False: --no-mtp) for `plan`, then hp["mtp_written"] (the NextN/MTP
    # blocks the plan writes after the decoder's hp["L"]) for `metadata` (converter.py docstring).
    hparams: Callable[[dict], dict[str, Any]]
    metadata: Callable[[GGUFWriter, dict[str, Any]], None]  # the `<arch>.*` keys
    # every output tensor in file order, each shape checked against the checkpoint before anything is written
    plan: Callable[[dict[str, Any], Checkpoint], list[Out]]
    tokenizer: TokenizerFacts
    text_config: Callable[[dict[str, Any]], dict[str, Any]] = whole_config  # config.json -> the text model's config


class ConvertRules(Protocol):
    """What every family's convert part (shared/families/<family>/convert.py) exports.

    A module cannot inherit a Protocol's defaults, so the hooks with neutral defaults
    sit on each `Arch` (its `text_config` and its `TokenizerFacts`' optional fields)."""

    ARCHES: Mapping[str, Arch]
    """The rules for each of the family's Hugging Face model_types (its registry line's
    `hf_model_types`, every one of them): a multimodal model_type has its own `Arch`
    whose `text_config` unwraps the nested text config."""


def supported_model_types() -> str:
    """The model_types convert reads, every family's, as the error messages list them."""
    return ", ".join(mt for f in FAMILIES for mt in f.hf_model_types)


def arch_for(config: dict[str, Any], where: Path | str = "config.json") -> Arch:
    """The rules for `config`'s model_type, from its family's convert part."""
    mt = config.get("model_type")
    if not isinstance(mt, str) or (family := by_hf_model_type(mt)) is None:  # absent, or e.g. a list: no family's name
        raise UserError(f"{where}: model_type {mt!r} is not supported; convert handles {supported_model_types()}")
    arch = cast(ConvertRules, family.part("convert")).ARCHES.get(mt)
    if arch is None:  # the registry line and the part disagree: the project's bug, not the user's
        raise AssertionError(f"shared/families/{family.name}/convert.py has no Arch for its model_type {mt!r}")
    return arch
