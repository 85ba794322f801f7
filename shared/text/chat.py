"""Chat prompts: a conversation rendered by a GGUF's `tokenizer.chat_template`.

The template is untrusted code from a downloaded file: it runs in the guarded
Jinja sandbox of `template_sandbox` (no Python internals, no files, time,
size and memory limits), with the globals HF's `apply_chat_template` gives
(`messages`, `add_generation_prompt`, `tools`, `bos_token`, `eos_token`,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape).

Which template, by `generate.chat_template` (`--chat-template`), applied
once to the tokenizer with `use_chat_template`:

    "model"    the GGUF's own (the default)
    "plain"    one "role: content" line per message, "assistant:" last; for a
               model whose template is missing or refused
    FILE       a Jinja template file of the user's (sandboxed all the same)

A refused template's error says how to switch to "plain".

Thinking control (`no_think=True`) sets whichever variable the template reads:
`enable_thinking=False` (Qwen3, Gemma 4) or `reasoning_effort="low"`
(gpt-oss harmony). A template that reads neither has no switch and is
rendered unchanged. Explicit keyword arguments always win.

With no template in the file, `render_chat` refuses unless the caller passes
`fallback=True`, which renders the plain format.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import UserError
from .template_sandbox import (
    DEFAULT_MAX_CHARS,
    DEFAULT_TIME_LIMIT_S,
    MAX_TEMPLATE_CHARS,
    TemplateRefused,
    TemplateRejected,
    render_template,
)

__all__ = [
    "render_chat",
    "render_template",
    "plain_chat",
    "thinking_off",
    "use_chat_template",
    "encode_prompt",
    "chat_prompt_tokens",
    "TemplateRefused",
    "TemplateRejected",
    "PLAIN_TEMPLATE",
]

TEMPLATE_FROM_MODEL, TEMPLATE_PLAIN = "model", "plain"  # the words of generate.chat_template (shared/config.py)
# plain_chat as a template, so that "plain" goes through the one rendering path
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m.role or 'user' }}: {{ m.content or '' }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
FALLBACK_HINT = 'to use a plain "role: content" prompt instead, pass --chat-template plain (generate.chat_template = "plain")'


def render_chat(
    source,
    messages: Sequence[dict],
    add_generation_prompt: bool = True,
    no_think: bool = False,
    *,
    fallback: bool = False,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    max_chars: int = DEFAULT_MAX_CHARS,
    **kwargs,
) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

    `source` is a `GGUFFile`, a `Tokenizer` (uses its `chat_template`), or
    the template text itself. Extra keyword arguments (`tools`,
    `enable_thinking`, `reasoning_effort`, `current_date`, ...) become
    template variables and win over what `no_think` sets. (The gateway
    passes a client's variables here: a new parameter of this function must
    also be reserved in openai_api.RESERVED_TEMPLATE_VARS.)

    The result is text: encode it with `special=True` (the framing tokens
    must become control tokens) and `add_bos=False` when it already starts
    with the BOS token's text.
    """
    template, bos, eos, where = _template_of(source)
    if not template:
        if not fallback:
            raise UserError(
                f"{where or 'chat template'}: has no tokenizer.chat_template; {FALLBACK_HINT}, "
                "or --chat-template FILE.jinja for a template of your own"
            )
        return plain_chat(messages, add_generation_prompt)
    context: dict[str, Any] = {
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "tools": None,
        "bos_token": bos,
        "eos_token": eos,
    }
    if no_think:
        context.update(thinking_off(template))
    context.update(kwargs)
    try:
        return render_template(template, context, time_limit_s=time_limit_s, max_chars=max_chars)
    except TemplateRefused as exc:
        hint = "" if template == PLAIN_TEMPLATE else f"; {FALLBACK_HINT}"
        raise TemplateRefused(f"{where + ': ' if where else ''}{exc}{hint}") from None


def thinking_off(template: str) -> dict[str, Any]:
    """The variables that turn thinking off in `template` ({} if it has no switch)."""
    out: dict[str, Any] = {}
    if "enable_thinking" in template:  # Qwen3 hybrid, Gemma 4
        out["enable_thinking"] = False
    if "reasoning_effort" in template:  # gpt-oss harmony
        out["reasoning_effort"] = "low"
    return out


def plain_chat(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The documented fallback: "role: content" per line, then "assistant:"."""
    lines = [f"{m.get('role') or 'user'}: {m.get('content') or ''}\n" for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "".join(lines)


def use_chat_template(tok, choice: str):
    """`tok` with the chat template `choice` (generate.chat_template) in place of
    the model's: "model" (tok itself), "plain", or a template file's path.

    A copy, so the model's own tokenizer object is never edited; errors in
    rendering then name the file the template came from.
    """
    if choice == TEMPLATE_FROM_MODEL:
        return tok
    out = copy.copy(tok)
    if choice == TEMPLATE_PLAIN:
        out.chat_template, out.chat_template_source = PLAIN_TEMPLATE, "plain chat template"
        return out
    out.chat_template, out.chat_template_source = read_template_file(choice), str(choice)
    return out


def read_template_file(path: str | Path) -> str:
    """A user's Jinja template file, checked for what render_template would refuse anyway."""
    where = f"generate.chat_template = {str(path)!r}"
    allowed = 'allowed: "model" (the GGUF\'s own), "plain" or a Jinja template file'
    p = Path(path)
    try:
        if not p.is_file():  # a folder, a FIFO (reading it could block for ever), nothing
            raise UserError(f"{where}: {'is a folder' if p.is_dir() else 'not a file' if p.exists() else 'no such file'}; {allowed}")
        size = p.stat().st_size
        if size > MAX_TEMPLATE_CHARS * 4:  # 4 bytes per character at most in UTF-8
            raise UserError(f"{where}: the file is {size:,} bytes; a chat template is at most {MAX_TEMPLATE_CHARS:,} characters")
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: not UTF-8 text at byte {exc.start}; a chat template is a Jinja text file") from None
    except OSError as exc:
        raise UserError(f"{where}: cannot read it: {exc.strerror or exc}") from None


def _template_of(source) -> tuple[str | None, str, str, str | None]:
    """(template, bos text, eos text, name for messages) of a GGUFFile, Tokenizer or str."""
    if isinstance(source, str):
        return source, "", "", None
    if hasattr(source, "token_text") and hasattr(source, "chat_template"):  # Tokenizer
        bos = source.token_text(source.bos_id) if source.bos_id is not None else ""
        eos = source.token_text(source.eos_id) if source.eos_id is not None else ""
        return source.chat_template, bos, eos, getattr(source, "chat_template_source", None) or source.source
    if hasattr(source, "meta"):  # GGUFFile
        tokens = source.meta("tokenizer.ggml.tokens") or []

        def text(key: str) -> str:
            i = source.meta(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

        return (
            source.meta("tokenizer.chat_template"),
            text("tokenizer.ggml.bos_token_id"),
            text("tokenizer.ggml.eos_token_id"),
            str(source.path),
        )
    raise TypeError(f"render_chat needs a GGUFFile, Tokenizer or template text, not {type(source).__name__}")


def encode_prompt(tok, text: str) -> list[int]:
    """Token ids of a prompt text, rendered or plain, as `run` and the gateway
    both feed the model: control tokens in the text become control tokens,
    and BOS is added only if the text does not already start with it."""
    starts_with_bos = tok.bos_id is not None and text.startswith(tok.token_text(tok.bos_id))
    return tok.encode(text, add_bos=False if starts_with_bos else None, special=True)


def chat_prompt_tokens(tok, messages: Sequence[dict], no_think: bool = False, **template_vars) -> list[int]:
    """Token ids of a conversation in the model's chat template, ending with the
    assistant's turn opened (what `run --chat` and /v1/chat/completions send).
    `template_vars` (e.g. enable_thinking=False) become template variables.
    Pass a tokenizer from `use_chat_template` to honour generate.chat_template."""
    return encode_prompt(tok, render_chat(tok, messages, add_generation_prompt=True, no_think=no_think, **template_vars))
