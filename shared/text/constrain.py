"""Constrained decoding: the OpenAI `response_format` (`json_object`,
`json_schema`) enforced while sampling, with llguidance (docs/api.md
§ Structured output says why this library, with the overhead figures).

Two halves, in two processes:

* the gateway turns a request's `response_format` into a grammar
  (`grammar_for`: llguidance's grammar JSON, a string that travels in
  `Generate.grammar`) and has the library check it, so a schema it refuses
  is a 400 before compute sees it (`GrammarError`, the library's message);
* compute builds one `TokenAdapter` from the model's tokenizer (once per
  process: the token trie of a 150k vocabulary takes a while) and one
  `JsonConstraint` per constrained generation, which the Sampler asks for
  the allowed tokens before each draw and tells the chosen token after.

llguidance is imported inside the functions that need it: only a process
that serves a constrained request pays for it.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np

from ..errors import UserError
from .tokenizer import BYTE, NORMAL, Tokenizer

# llguidance marks a token as special (never produced by a grammar's text,
# only by name) by this first byte: 0xFF never occurs in UTF-8.
_SPECIAL_MARKER = b"\xff"

# JSON written without free whitespace: `{"a": 1, "b": [2, 3]}`. Free
# whitespace (the JSON grammar's default) lets a sampled model pad forever
# with spaces and newlines and never close the object; one fixed separator
# keeps every reply as short as its content.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# The grammar rides in one Generate frame (1 MiB, shared/wire/messages.py)
# beside up to 65,536 prompt ids; half of it leaves room for those.
MAX_GRAMMAR_BYTES = 512 * 1024


class GrammarError(UserError):
    """A `response_format` the gateway or the library refuses; `param` names the field."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


def grammar_for(response_format: Any) -> str:
    """The llguidance grammar (its JSON, as a string) for an OpenAI
    `response_format`; "" for `{"type": "text"}` (no constraint).

    `json_object` is any JSON object; `json_schema` is its `schema` (an
    object; absent: any JSON object). `strict` is accepted either way: the
    schema is always enforced. Unsupported schema keywords are refused (the
    library is not lenient), so what is sent always validates."""
    if not isinstance(response_format, dict):
        raise GrammarError(f'\'response_format\' must be an object like {{"type": "json_object"}}, not {_shown(response_format)}')
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        allowed = ", ".join(f'"{t}"' for t in RESPONSE_FORMAT_TYPES)
        raise GrammarError(f"'response_format.type' must be one of {allowed}, not {_shown(kind)}", "response_format.type")
    if kind == "text":
        return ""
    schema: Any = {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError(
                f"'response_format.json_schema' must be an object with 'name' and 'schema', not {_shown(spec)}",
                "response_format.json_schema",
            )
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarError(
                f"'response_format.json_schema.name' must be a string, not {_shown(name)}", "response_format.json_schema.name"
            )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError(
                f"'response_format.json_schema.strict' must be true or false, not {_shown(strict)}", "response_format.json_schema.strict"
            )
        if "schema" in spec and spec["schema"] is not None:
            schema = spec["schema"]
            if not isinstance(schema, dict):
                raise GrammarError(
                    f"'response_format.json_schema.schema' must be a JSON Schema object, not {_shown(schema)}",
                    "response_format.json_schema.schema",
                )
    return compile_schema(schema, "response_format.json_schema.schema" if kind == "json_schema" else "response_format")


def compile_schema(schema: dict, param: str = "response_format.json_schema.schema") -> str:
    """The grammar of a JSON Schema, checked by llguidance; its refusal is a GrammarError with its message."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"'{param}' is not usable: {_one_line(str(exc))}", param) from None
    if len(grammar.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"'{param}' is too large: its grammar is over {MAX_GRAMMAR_BYTES // 1024} KiB", param)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"'{param}' is not supported: {_one_line(messages[0] if messages else 'refused')}", param)
    return grammar


class TokenAdapter:
    """The model's vocabulary as llguidance sees it: each token's bytes, with
    every token that is not plain text (control, user-defined like Qwen's
    `<think>`, unused placeholders) marked special, so no grammar over text
    can ever choose one; the end-of-generation ids end a complete reply."""

    def __init__(self, tokenizer: Tokenizer):
        import llguidance

        self.n_vocab = tokenizer.n_vocab
        self.eog_ids = sorted(tokenizer.eog_ids)
        if not self.eog_ids:
            raise UserError(f"{tokenizer.source}: the model has no end-of-generation token, so a constrained reply could never end")
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(tokenizer.n_vocab):
            if tokenizer.token_type(i) in (NORMAL, BYTE):
                tokens.append(tokenizer.token_bytes(i))
            else:
                tokens.append(_SPECIAL_MARKER + tokenizer.token_text(i).encode("utf-8"))
                special.append(i)
        source = _Vocabulary(tokenizer, tokens, special, self.eog_ids[0])
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(source), n_vocab=self.n_vocab, eos_token=self.eog_ids)

    def constraint(self, grammar: str) -> JsonConstraint:
        return JsonConstraint(self, grammar)


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: the token table, and an
    encoder (bytes → ids, plain text only) it uses to tokenize forced text."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], special: list[int], eos: int):
        self._tok = tokenizer
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, data: bytes) -> list[int]:
        return self._tok.encode(data.decode("utf-8", "replace"), add_bos=False, special=False)


class JsonConstraint:
    """One generation's grammar state. `mask(z)` sets the logits of the
    tokens the grammar does not allow next to -inf (once the grammar is
    complete only end-of-generation is allowed); `accept(token)` advances it.

    The mask is computed when it is asked for, on the sampling thread, not by
    a helper thread during the next forward pass: on two busy cores that
    handoff costs more than the mask (docs/api.md § Structured output)."""

    def __init__(self, adapter: TokenAdapter, grammar: str):
        from llguidance import LLMatcher

        self.n_vocab = adapter.n_vocab
        self.eog_ids = adapter.eog_ids
        self.matcher = LLMatcher(adapter.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise UserError(f"response_format: {_one_line(self.matcher.get_error())}")
        self._bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)

    def disallowed(self) -> np.ndarray:
        """A bool per vocabulary id: true where it may not come next."""
        if self.matcher.is_stopped():
            bad = np.ones(self.n_vocab, dtype=bool)
            bad[self.eog_ids] = False
            return bad
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {_one_line(self.matcher.get_error())}")
        # The library's mask has a set bit per allowed id, low bit first.
        return np.unpackbits(np.invert(self._bits.view(np.uint8)), count=self.n_vocab, bitorder="little").view(bool)

    def mask(self, z: np.ndarray) -> None:
        """In place: logits of disallowed ids (and of any id past the vocabulary) become -inf."""
        if z.shape[0] > self.n_vocab:
            z[self.n_vocab :] = -np.inf
            z = z[: self.n_vocab]
        np.putmask(z, self.disallowed(), -np.inf)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding: token {token} was refused ({_one_line(self.matcher.get_error())})")

    @property
    def complete(self) -> bool:
        """The text so far is a whole value of the grammar (end-of-generation may follow)."""
        return self.matcher.is_accepting()


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 300 else line[:297] + "..."


# One adapter per tokenizer, for the life of the process (compute has one):
# building it walks the whole vocabulary (~0.3 s at 150k tokens).
_ADAPTERS: weakref.WeakKeyDictionary[Tokenizer, TokenAdapter] = weakref.WeakKeyDictionary()


def constraint_for(tokenizer: Tokenizer, grammar: str) -> JsonConstraint:
    """A fresh constraint for one generation; the tokenizer's adapter is built on first use and kept."""
    adapter = _ADAPTERS.get(tokenizer)
    if adapter is None:
        adapter = _ADAPTERS[tokenizer] = TokenAdapter(tokenizer)
    return adapter.constraint(grammar)
