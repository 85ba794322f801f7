"""Tool calls: OpenAI's `tools` into the chat template, and the model's
tool-call syntax back into OpenAI's `tool_calls`.

Into the prompt: the template renders the tools itself (`render_chat(...,
tools=...)`: each made model's template in shared/data/, like the real ones,
reads OpenAI's `{"type": "function", "function": {name, description,
parameters}}` objects); `messages_for_template` puts a conversation's earlier
calls and results in the shape templates read — an assistant message's
`tool_calls[].function.arguments` as an object (OpenAI sends a JSON string;
Gemma 4's real template formats an object key by key, and every template
takes one, as vLLM and llama.cpp pass it), and a `role: "tool"` message's
`name` from the call its `tool_call_id` answers (gpt-oss's and Gemma 4's
templates name the function in the result).

Out of the output: shared/text/reasoning.py cuts one call's text out of the
stream (a TOOL piece); `parse_call` reads it per framing:

    think    {"name": NAME, "arguments": {...}}              (inside <tool_call>...</tool_call>)
             <function=NAME><parameter=KEY>VALUE</parameter>...</function>   (Qwen3-Coder, Qwen3.5)
    harmony  HEADER<|message|>{...}                          (HEADER names to=functions.NAME)
    gemma4   call:NAME{key:<|"|>text<|"|>,n:1,xs:[1,2]}     (inside <|tool_call>...<tool_call|>; JSON works too)

A call that does not parse is None: the caller shows its text as answer
text, as it was written, rather than losing it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .reasoning import GEMMA4, H_CALL, H_MESSAGE, HARMONY, THINK, Framing

_HARMONY_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
GEMMA_QUOTE = '<|"|>'  # Gemma 4's string delimiter, one control token
_GEMMA_SCALAR = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(framing: Framing, text: str) -> ToolCall | None:
    """One call's text (a TOOL piece of the output splitter) as a ToolCall, or None."""
    try:
        if framing is THINK:
            return _parse_json_call(text)
        if framing is HARMONY:
            return _parse_harmony_call(text)
        if framing is GEMMA4:
            return _parse_gemma_call(text)
    except (ValueError, TypeError, RecursionError):
        return None
    return None


def _arguments(value: Any) -> str:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("the arguments are not an object")
    return json.dumps(value, ensure_ascii=False)


def _parse_json_call(text: str) -> ToolCall | None:
    if text.lstrip().startswith("<function="):
        return _parse_xml_call(text)
    obj = json.loads(text)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _NAME.fullmatch(obj["name"]):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], _arguments(args), new_call_id())


def _parse_xml_call(text: str) -> ToolCall | None:
    """Qwen3-Coder's and Qwen3.5's form inside <tool_call>: <function=NAME>
    then <parameter=KEY>VALUE</parameter> per argument; a value that reads as
    JSON is that value, else the text (trimmed of the newlines around it)."""
    found = _XML_FUNCTION.fullmatch(text.strip())
    if found is None or not _NAME.fullmatch(found.group(1)):
        return None
    args: dict[str, Any] = {}
    for key, raw in _XML_PARAMETER.findall(found.group(2)):
        value = raw.strip("\n")
        try:
            args[key] = json.loads(value)
        except ValueError:
            args[key] = value
    if _XML_PARAMETER.sub("", found.group(2)).strip():
        return None  # text between the parameters: not this form
    return ToolCall(found.group(1), json.dumps(args, ensure_ascii=False), new_call_id())


def _parse_harmony_call(text: str) -> ToolCall | None:
    header, sep, body = text.partition(H_MESSAGE)
    found = _HARMONY_RECIPIENT.search(header)
    if not sep or found is None:
        return None
    body = body.removesuffix(H_CALL).strip()
    return ToolCall(found.group(1), _arguments(json.loads(body) if body else {}), new_call_id())


def _parse_gemma_call(text: str) -> ToolCall | None:
    text = text.strip()
    if not text.startswith("call:") or "{" not in text:
        return None
    name, brace, rest = text[len("call:") :].partition("{")
    name = name.strip()
    if not _NAME.fullmatch(name):
        return None
    args = brace + rest
    value, end = _GemmaValues(args).value(0)
    if args[end:].strip():
        return None  # text after the arguments: not one call
    return ToolCall(name, _arguments(value), new_call_id())


class _GemmaValues:
    """Gemma 4's argument syntax: JSON-like, keys bare, strings between <|"|>
    tokens (JSON strings accepted too), numbers, true/false/null, [] and {}."""

    def __init__(self, text: str):
        self.s = text

    def _ws(self, i: int) -> int:
        while i < len(self.s) and self.s[i].isspace():
            i += 1
        return i

    def value(self, i: int) -> tuple[Any, int]:
        i = self._ws(i)
        s = self.s
        if s.startswith(GEMMA_QUOTE, i):
            end = s.find(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            return s[i + len(GEMMA_QUOTE) : end], end + len(GEMMA_QUOTE)
        if s.startswith('"', i):
            return json.JSONDecoder().raw_decode(s, i)
        if s.startswith("{", i):
            return self._container(i + 1, "}", keyed=True)
        if s.startswith("[", i):
            return self._container(i + 1, "]", keyed=False)
        m = _GEMMA_SCALAR.match(s, i)
        if m is None:
            raise ValueError(f"no value at {i}")
        return json.loads(m.group()), m.end()

    def _key(self, i: int) -> tuple[str, int]:
        i = self._ws(i)
        if self.s.startswith(GEMMA_QUOTE, i) or self.s.startswith('"', i):
            key, i = self.value(i)
            return str(key), i
        end = self.s.find(":", i)
        if end < 0 or not self.s[i:end].strip():
            raise ValueError(f"no key at {i}")
        return self.s[i:end].strip(), end

    def _container(self, i: int, close: str, keyed: bool) -> tuple[Any, int]:
        obj: dict[str, Any] = {}
        items: list[Any] = []
        i = self._ws(i)
        if self.s.startswith(close, i):
            return (obj if keyed else items), i + 1
        while True:
            if keyed:
                key, i = self._key(i)
                i = self._ws(i)
                if not self.s.startswith(":", i):
                    raise ValueError(f"no ':' at {i}")
                obj[key], i = self.value(i + 1)
            else:
                item, i = self.value(i)
                items.append(item)
            i = self._ws(i)
            if self.s.startswith(",", i):
                i += 1
            elif self.s.startswith(close, i):
                return (obj if keyed else items), i + 1
            else:
                raise ValueError(f"expected ',' or {close!r} at {i}")


# ----------------------------------------------------------------- into the prompt


def messages_for_template(messages: Sequence[dict]) -> list[dict]:
    """Copies of OpenAI messages in the shape chat templates read (module doc).
    The arguments were checked to be a JSON object when the request was parsed."""
    names: dict[str, str] = {}
    out = []
    for msg in messages:
        msg = dict(msg)
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                f = dict(call["function"])
                if isinstance(f.get("arguments"), str):
                    f["arguments"] = json.loads(f["arguments"])
                calls.append({**call, "function": f})
                if call.get("id"):
                    names[call["id"]] = f["name"]
            msg["tool_calls"] = calls
        if msg.get("role") == "tool" and not msg.get("name") and msg.get("tool_call_id") in names:
            msg["name"] = names[msg["tool_call_id"]]
        out.append(msg)
    return out


def tools_for_template(tools: Sequence[dict], tool_choice: str | dict | None) -> list[dict] | None:
    """The tools the template shows the model: none for tool_choice "none",
    only the named one for a named function, else all of them."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return [t for t in tools if t["function"]["name"] == name]
    return list(tools)
