"""The OpenAI wire format: parsing and validating request bodies into a frozen
CompletionRequest, and shaping responses and SSE chunks.

    body bytes ─parse_body─► dict ─parse_request─► CompletionRequest ─fit_max_tokens─► max_tokens
    text pieces, finish ─ResponseShape─► chat.completion[.chunk] / text_completion ─sse─► b"data: ...\\n\\n"
    a prompt's progress ─ResponseShape.progress_chunk─► a chunk with llama.cpp's `prompt_progress`

No sockets, no processes, no HTTP server here: procs/gateway.py reads the
request, calls these, and writes what they return. Every refusal is an
`ApiError` that carries the HTTP status and OpenAI's error body, with `param`
naming the field, so a client library shows the user which field was wrong.
"""

from __future__ import annotations

import math
import random
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from ..config import MAX_DRAFT, MAX_PARALLEL
from ..text.constrain import GrammarError, grammar_for
from ..text.reasoning import REASONING, TOOL, Framing, OutputSplitter
from ..text.tools import ToolCall, messages_for_template, parse_call, tools_for_template

MAX_STOPS = 16
# A stop string is held back from the stream while it may still match, so a
# long one delays every token by its length (and one of megabytes would not fit
# the Generate frame to compute).
MAX_STOP_CHARS = 256
MAX_TOKENS_FIELD = (1 << 31) - 1  # above any context; what fits is checked against ctx_size after tokenizing
MAX_TOP_K = 1 << 20  # top_k: generate.top_k's bound; above any vocabulary
MAX_TEMPLATE_VARS = 32  # far above the two or three switches a chat template reads
REASONING_EFFORTS = ("low", "medium", "high")  # what gpt-oss's template knows
MAX_TOOLS = 128  # OpenAI's own limit on `tools`
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")
# Names a client may not pass in chat_template_kwargs: shared.chat's own
# arguments (time_limit_s and max_chars guard against a hostile template, and
# a duplicate argument would be a TypeError) and the template context the
# server sets itself. tests/test_gateway.py checks this against the signatures.
RESERVED_TEMPLATE_VARS = frozenset(
    {
        "tok",
        "source",
        "messages",
        "no_think",
        "add_generation_prompt",
        "fallback",
        "time_limit_s",
        "max_chars",
        "tools",
        "bos_token",
        "eos_token",
    }
)
# Finish reasons of shared.generate -> OpenAI's (eog is the model's own stop).
FINISH_REASONS = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}

Scalar = str | int | float | bool | None


# ------------------------------------------------------------------- errors


class ApiError(Exception):
    """A request that fails with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_field(name: str, allowed: str, got: Any) -> ApiError:
    if type(got) is int or type(got) is float and not math.isfinite(got):
        shown = repr(got)  # orjson refuses ints past 64 bits and writes NaN as null
    elif isinstance(got, (str, float, bool, type(None))):
        shown = orjson.dumps(got).decode()
    else:
        shown = type(got).__name__
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return ApiError(400, f"'{name}' must be {allowed}; got {shown}", "invalid_value", param=name)


# ----------------------------------------------------------- the request body


class RequestDefaults(Protocol):
    """What the server fills in for fields a request leaves out (procs/gateway.py ConfigDefaults: the config's generate and compute tables)."""

    @property
    def model_name(self) -> str: ...
    @property
    def ctx_size(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def seed(self) -> int | None: ...


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool
    messages: tuple[dict, ...]  # chat
    prompt: str  # text completion
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the configured default (fitted to the context)
    sampling: dict[str, Any]
    stop: tuple[str, ...]
    template_vars: dict[str, Scalar]  # chat: chat_template_kwargs and reasoning_effort, for the template
    tools: tuple[dict, ...] = ()  # chat: the tools the template shows (after tool_choice); none: no tool calls parsed
    grammar: str = ""  # response_format as llguidance's grammar JSON (shared/text/constrain.py); "" = free text
    cache_prompt: bool = True  # llama.cpp's field: false = compute the whole prompt, reusing no cached prefix
    return_progress: bool = False  # llama.cpp's field: a stream carries the prompt's progress (prompt_progress chunks)
    draft: int | None = None  # llama.cpp's speculative.n_max: drafts per verify pass for this request; None = compute.draft
    id_slot: int | None = None  # llama.cpp's field: the compute slot to run in (-1 or absent: any); the gateway checks its range


def parse_body(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}", "invalid_json")
    return body


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    # isfinite: JSON cannot carry NaN, but a NaN passes every comparison, so never rely on the parser alone
    if type(value) not in (int, float) or not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        raise bad_field(name, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", value)
    return float(value)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:  # type() is: true is not 1 here
        raise bad_field(name, str(lo) if lo == hi else f"an integer in [{lo}, {hi}]", value)
    return value


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, null, or an array of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad_field(where, "a string or an array of text parts", content)


def parse_messages(value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise bad_field("messages", "a non-empty array of {role, content} objects", value)
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not msg["role"]:
            raise bad_field(f"messages[{i}]", "an object with a string 'role'", msg)
        out.append(_message(i, msg))
    return tuple(messages_for_template(out))


def _message(i: int, msg: dict) -> dict:
    """One message with the fields templates read: an assistant's `tool_calls`
    and `reasoning_content`, a tool result's `tool_call_id` and `name`."""
    where = f"messages[{i}]"
    out: dict[str, Any] = {"role": msg["role"], "content": _text_of(msg.get("content"), f"{where}.content")}
    if msg["role"] == "assistant":
        if msg.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))  # llama.cpp's and vLLM's names
        if isinstance(reasoning, str) and reasoning:
            out["reasoning_content"] = reasoning
    elif msg["role"] == "tool":
        call_id, name = msg.get("tool_call_id"), msg.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise bad_field(f"{where}.tool_call_id", "the id of the tool call this result answers", call_id)
        out["tool_call_id"] = call_id
        if name is not None:
            if not isinstance(name, str):
                raise bad_field(f"{where}.name", "a string", name)
            out["name"] = name
    return out


def _tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's calls, {"id", "type": "function", "function": {"name", "arguments"}};
    the arguments a JSON object (OpenAI's JSON text of one, or the object)."""
    if not isinstance(value, list):
        raise bad_field(where, 'an array of {"id", "type": "function", "function": {"name", "arguments"}} objects', value)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or call.get("type", "function") != "function":
            raise bad_field(at, 'an object {"id", "type": "function", "function": {"name", "arguments"}}', call)
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_field(f"{at}.function.name", "a function name", f.get("name"))
        args = f.get("arguments", "{}")
        try:
            parsed = orjson.loads(args) if isinstance(args, str) else args
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_field(f"{at}.function.arguments", "a JSON object (as text)", args)
        call_id = call.get("id")
        calls.append(
            {"id": call_id if isinstance(call_id, str) else "", "type": "function", "function": {"name": f["name"], "arguments": parsed}}
        )
    return calls


def parse_tools(body: dict) -> tuple[dict, ...]:
    """`tools` and `tool_choice`, checked; the tools the template is to show.

    tool_choice "none": none (and no tool calls are parsed from the output);
    "auto" (the default with tools) and "required": all; a named function
    ({"type": "function", "function": {"name"}}): that one alone. Nothing
    forces the model to call: "required" and a named function are prompts, not
    constraints (docs/api.md § Tool calls)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    one = '{"type": "function", "function": {"name", "description", "parameters"}}'
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_field("tools", f"an array of at most {MAX_TOOLS} {one} objects", tools)
    out: list[dict[str, Any]] = []
    for j, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(f, dict) or tool.get("type") != "function":
            raise bad_field(f"tools[{j}]", f"an object {one}", tool)
        if not isinstance(f.get("name"), str) or not TOOL_NAME.fullmatch(f["name"]):
            raise bad_field(f"tools[{j}].function.name", "1 to 64 letters, digits, _ or -", f.get("name"))
        if not isinstance(f.get("description", ""), (str, type(None))):
            raise bad_field(f"tools[{j}].function.description", "a string", f["description"])
        if not isinstance(f.get("parameters", {}), (dict, type(None))):
            raise bad_field(f"tools[{j}].function.parameters", "a JSON Schema object", f["parameters"])
        out.append({"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None}})
    names = [t["function"]["name"] for t in out]
    if choice is None:
        choice = "auto" if out else "none"
    if isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) and choice.get("type") == "function" else None
        if name not in names:
            allowed = f"one of the tools' names ({', '.join(names[:8])})" if names else "a tool given in 'tools' (there are none)"
            raise bad_field("tool_choice.function.name" if isinstance(name, str) else "tool_choice", allowed, name if name else choice)
    elif choice not in TOOL_CHOICES:
        raise bad_field("tool_choice", '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}', choice)
    elif choice == "required" and not out:
        raise ApiError(400, "'tool_choice' is \"required\" but the request has no 'tools'", "invalid_value", param="tool_choice")
    return tuple(tools_for_template(out, choice) or ())


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad_field("stop", f"a string or an array of at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", value)
    return tuple(s for s in stops if s)


def parse_template_vars(body: dict) -> dict[str, Scalar]:
    """`chat_template_kwargs` (the vLLM / llama.cpp-server field, e.g.
    {"enable_thinking": false}) and OpenAI's `reasoning_effort`, as template
    variables; the explicit kwargs win. Only flat scalars: the values reach an
    untrusted template, and nothing a thinking switch needs is nested."""
    out: dict[str, Scalar] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_field("reasoning_effort", " or ".join(f'"{e}"' for e in REASONING_EFFORTS), effort)
        out["reasoning_effort"] = effort
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return out
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_VARS:
        raise bad_field(
            "chat_template_kwargs",
            f'an object of at most {MAX_TEMPLATE_VARS} template variables, like {{"enable_thinking": false}}',
            kwargs,
        )
    for key, value in kwargs.items():
        where = f"chat_template_kwargs.{key if len(key) <= 40 else key[:37] + '...'}"
        if not key.isidentifier():  # a template could never read it: most likely a typo like enable-thinking
            raise ApiError(400, f"'{where}' is not a template variable name (letters, digits, _)", "invalid_value", param=where)
        if key in RESERVED_TEMPLATE_VARS:
            raise ApiError(400, f"'{where}' is set by the server and cannot be passed", "invalid_value", param=where)
        if not isinstance(value, (str, int, float, bool, type(None))):
            raise bad_field(where, "a string, number, boolean or null", value)
        out[key] = value
    return out


def parse_request(body: dict, chat: bool, settings: RequestDefaults) -> CompletionRequest:
    """Every field we act on, checked; fields we do not know are ignored."""
    model = body.get("model")  # optional, as in llama.cpp's server: this server serves one model
    if model is not None and not isinstance(model, str):
        raise bad_field("model", "a string (see GET /v1/models)", model)
    if model is not None and model != settings.model_name:
        raise ApiError(
            404, f"the model '{model}' does not exist; this server serves '{settings.model_name}'", "model_not_found", param="model"
        )
    messages: tuple[dict, ...] = ()
    prompt = ""
    template_vars: dict[str, Scalar] = {}
    tools: tuple[dict, ...] = ()
    if chat:
        messages = parse_messages(body.get("messages"))
        template_vars = parse_template_vars(body)
        tools = parse_tools(body)
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise bad_field("prompt", "a non-empty string", text)
        prompt = text
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_field("stream", "true or false", stream)
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad_field("stream_options", 'an object like {"include_usage": true}', options)
    _int(body, "n", 1, 1)  # one choice only: compute serves one sequence at a time
    max_tokens = _int(body, "max_completion_tokens", 1, MAX_TOKENS_FIELD) if chat else None
    max_tokens = _int(body, "max_tokens", 1, MAX_TOKENS_FIELD) if max_tokens is None else max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, MAX_TOP_K)  # llama.cpp's server field: sampling top-k, 0 = off
    seed = _int(body, "seed", 0, (1 << 64) - 1)
    temperature = settings.temperature if temperature is None else temperature
    seed = settings.seed if seed is None else seed
    if seed is None and temperature > 0:
        # Random all the same, but fixed now: a retry after a compute crash
        # repeats the same text, so a stream can skip what it already sent.
        seed = random.getrandbits(63)
    sampling = {
        "temperature": temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": settings.top_k if top_k is None else top_k,
        "seed": seed,
    }
    grammar = parse_response_format(body.get("response_format"))
    if grammar and tools:
        raise ApiError(
            400,
            "'response_format' with 'tools' is not supported: the format covers the whole reply, so no tool call could be made",
            "invalid_value",
            param="response_format",
        )
    if grammar and chat:
        # The reply is JSON from its first token, so a thinking model's
        # reasoning could not be written: render the template's no-thinking
        # turn (Qwen3, Gemma 4 read this), unless the request says otherwise.
        template_vars.setdefault("enable_thinking", False)
    return CompletionRequest(
        chat,
        messages,
        prompt,
        bool(stream),
        options.get("include_usage", False),
        max_tokens,
        sampling,
        parse_stop(body.get("stop")),
        template_vars,
        tools=tools,
        grammar=grammar,
        cache_prompt=_flag(body, "cache_prompt", True),
        return_progress=_flag(body, "return_progress", False),
        draft=_int(body, "speculative.n_max", 0, MAX_DRAFT),
        id_slot=_id_slot(body),
    )


def _id_slot(body: dict) -> int | None:
    """llama.cpp's `id_slot`: -1 (or absent) for any slot, else a slot's number (its upper bound,
    gateway.parallel, is the gateway's to check)."""
    value = _int(body, "id_slot", -1, MAX_PARALLEL - 1)
    return None if value is None or value < 0 else value


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_field(name, "true or false", value)
    return value


def parse_response_format(value: Any) -> str:
    """OpenAI's `response_format` as a grammar for compute ("" = free text):
    refused here, with the library's own message, when it is malformed or the
    library cannot enforce the schema, so compute only sees what it can run."""
    if value is None:
        return ""
    try:
        return grammar_for(value)
    except GrammarError as exc:
        raise ApiError(400, str(exc), "invalid_value", param=exc.param) from None


def refuse_unfit_text(text: str, longest_token_bytes: int, settings: RequestDefaults, where: str) -> None:
    """A prompt text that cannot fit the context, refused before it is
    tokenized (4 MiB takes seconds of the one tokenizing thread). No token
    stands for more than `longest_token_bytes` bytes, hence for no more
    characters, so len(text) / longest is a floor on its token count; the 4 is
    headroom for a normalizer that shrinks text before splitting it (NFC makes
    one 3-byte Hangul syllable of a 9-byte jamo triple)."""
    floor = len(text) // (4 * max(longest_token_bytes, 1))
    if floor > settings.ctx_size:
        raise ApiError(
            400,
            f"the prompt is {len(text):,} characters, at least {floor:,} tokens, but the context holds {settings.ctx_size}; shorten it",
            "context_length_exceeded",
            param=where,
        )


def fit_max_tokens(req: CompletionRequest, n_prompt: int, settings: RequestDefaults) -> int:
    """max_tokens that fits the context; an explicit one that does not is an error."""
    ctx, where = settings.ctx_size, "messages" if req.chat else "prompt"
    if n_prompt < 1:
        raise ApiError(400, f"'{where}' is empty after tokenization", "invalid_value", param=where)
    if n_prompt >= ctx:  # no room for one token whatever max_tokens says: the prompt is the cause, name it
        what = "conversation" if req.chat else "prompt"
        raise ApiError(
            400,
            f"the {what} is {n_prompt} tokens and the context holds {ctx}, leaving no room for a reply; "
            f"shorten it{' or drop earlier messages' if req.chat else ''}",
            "context_length_exceeded",
            param=where,
        )
    if req.max_tokens is None:
        return settings.max_tokens if _shifts(settings) else min(settings.max_tokens, ctx - n_prompt)
    if n_prompt + req.max_tokens > ctx and not _shifts(settings):
        raise ApiError(
            400,
            f"the prompt ({n_prompt} tokens) plus max_tokens ({req.max_tokens}) is over the context "
            f"of {ctx} tokens; shorten the prompt or ask for at most {max(ctx - n_prompt, 0)} tokens",
            "context_length_exceeded",
            param="max_tokens",
        )
    return req.max_tokens


# ------------------------------------------------------------- response shapes


def _shifts(settings: RequestDefaults) -> bool:
    """generate.context_shift: a reply may run past the context (docs/conversations.md)."""
    return bool(getattr(settings, "context_shift", False))


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:  # of prompt_tokens, reused from the KV cache of earlier requests
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def timings_of(done: dict) -> dict:
    """A request's timings in llama.cpp's server shape (its `result_timings`: the final
    response's and the stream's last chunk's `timings`) from compute's Done figures.
    `prompt_n` counts the prompt tokens computed, `cache_n` those reused from the cache;
    `draft_n` and `draft_n_accepted` are there when the request drafted."""

    def num(key: str) -> float:
        v = done.get(key, 0)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0

    cached = int(num("prompt_cached"))
    prompt_n, prompt_ms = max(0, int(num("prompt_n")) - cached), float(num("prompt_ms"))
    predicted_n, predicted_ms = int(num("predicted_n")), float(num("predicted_ms"))
    t: dict[str, Any] = {
        "cache_n": cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
    }
    if num("draft_n") > 0:
        t.update(draft_n=int(num("draft_n")), draft_n_accepted=int(num("draft_accepted")))
    return t


def slot_of(done: dict) -> int:
    """The compute slot that served a request (llama.cpp's `id_slot`): slot 0 when compute
    serves one request at a time, which names no slot."""
    v = done.get("id_slot", 0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


class ChatOutput:
    """One chat reply's text as OpenAI's message fields: reasoning, answer and
    tool calls (shared/text/reasoning.py splits, shared/text/tools.py parses).

    `feed` and `finish` give stream deltas — `{"reasoning_content": ...}`,
    `{"content": ...}`, or `{"tool_calls": [one whole call, with its index]}`
    as llama.cpp's server and vLLM send them — and keep the totals for `message`.
    """

    def __init__(self, framing: Framing, prompt_tail: str, tools: bool):
        self.framing = framing
        self.splitter = OutputSplitter(framing, prompt_tail, tools)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.splitter.feed(text))

    def finish(self) -> list[dict]:
        return self._deltas(self.splitter.finish())

    def _deltas(self, pieces: list[tuple[str, str]]) -> list[dict]:
        out: list[dict] = []
        for kind, text in pieces:
            if kind == TOOL:
                call = parse_call(self.framing, text)
                if call is not None:
                    self.calls.append(call)
                    out.append({"tool_calls": [call.as_openai(len(self.calls) - 1)]})
                    continue
                kind, text = "content", self.framing.tool_markup(text)  # not a call after all: show what the model wrote
            if kind == REASONING:
                self.reasoning.append(text)
                out.append({"reasoning_content": text})
            else:
                self.content.append(text)
                out.append({"content": text})
        return out

    def finish_reason(self, finish_reason: str) -> str:
        return "tool_calls" if self.calls and finish_reason == "stop" else finish_reason

    def message(self) -> dict:
        """The non-streamed message: content null when the reply is only calls, as OpenAI's."""
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [c.as_openai() for c in self.calls]
        return msg


class ResponseShape:
    """OpenAI's JSON for one endpoint: the whole response and stream chunks.
    With `output` (chat), the text is split into reasoning, answer and tool calls."""

    def __init__(self, chat: bool, model: str, include_usage: bool, output: ChatOutput | None = None):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.output = output
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }

    def _choice(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": ""}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [self._choice(text, finish_reason, first)], **extra)

    def opening(self) -> list[dict]:
        return [self.chunk(None, first=True)] if self.chat else []

    def _delta_chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk", [choice], **extra)

    def chunks(self, text: str) -> list[dict]:
        """The stream chunks of one text piece (none while a marker is held back)."""
        if self.output is None:
            return [self.chunk(text)]
        return [self._delta_chunk(d) for d in self.output.feed(text)]

    def closing(self, finish_reason: str, done: dict | None = None) -> list[dict]:
        """What the splitter still held, then the chunk with the finish reason, which carries
        the request's `timings` and `id_slot` from compute's Done figures `done` (llama.cpp's
        last chunk carries its timings the same way)."""
        if self.output is None:
            last = self.chunk(None, finish_reason)
            held = []
        else:
            held = [self._delta_chunk(d) for d in self.output.finish()]
            last = self._delta_chunk({}, self.output.finish_reason(finish_reason))
        if done is not None:
            last.update(timings=timings_of(done), id_slot=slot_of(done))
        return held + [last]

    def progress_chunk(self, total: int, cache: int, processed: int, time_ms: int) -> dict:
        """A chunk with no text and llama.cpp's `prompt_progress` beside its
        choices, shaped as its server's (tools/server: a chat delta of
        {"role": "assistant", "content": null}, a completion's empty text)."""
        progress = {"total": total, "cache": cache, "processed": processed, "time_ms": time_ms}
        extra = {"usage": None} if self.include_usage else {}
        if self.chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}
            return self._envelope("chat.completion.chunk", [choice], **extra, prompt_progress=progress)
        return self._envelope("text_completion", [self._choice("", None)], **extra, prompt_progress=progress)

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)

    def whole(self, text: str, finish_reason: str, usage: dict, done: dict | None = None) -> dict:
        """The whole response; with compute's Done figures `done`, also the request's
        `timings` and the `id_slot` that served it, as llama.cpp's server adds them."""
        extra = {} if done is None else {"timings": timings_of(done), "id_slot": slot_of(done)}
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.output is not None:
                self.output.feed(text)
                self.output.finish()
                message, finish_reason = self.output.message(), self.output.finish_reason(finish_reason)
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion", [choice], usage=usage, **extra)
        return self._envelope("text_completion", [self._choice(text, finish_reason)], usage=usage, **extra)


def sse(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
