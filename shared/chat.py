"""Chat prompts: render a GGUF's `tokenizer.chat_template` (Jinja2) safely.

A chat template is code that came with a downloaded file, so it runs in
Jinja's `ImmutableSandboxedEnvironment` with the globals HF's
`apply_chat_template` gives (`messages`, `add_generation_prompt`, `tools`,
`bos_token`, `eos_token`, `raise_exception`, `strftime_now`, a `tojson`
that does not HTML-escape), plus these guards:

* Reaching for Python internals (`''.__class__`, `cycler.__init__.__globals__`,
  `messages.append`) raises at once instead of rendering an empty string the
  way plain Jinja does, and becomes a one-line `UserError`.
* Time: the render runs in its own thread under a line tracer that stops it
  after `time_limit_s` (default 2 s; real templates take about 1 ms).
* Size: the output may not pass `max_chars` (default 4M characters, far above
  any context window), and so may no single value the template builds: `+`,
  `*`, `**`, `%`, `~`, `{% set %}` blocks and the string methods and filters
  that can multiply a size (center, ljust, format, replace, join, indent,
  wordwrap, batch, tojson's indent…) are checked *before* they allocate;
  so is every str() of a container (printing it, `~`, `%`, filters), by
  estimating its text size without building it.

These are in-process guards against the known ways a template grows or
loops; they are not a memory limit. A process-level guarantee would need a
child process with RLIMIT_AS, which this module does not use.

Thinking control (`no_think=True`) sets whichever variable the template reads:
`enable_thinking=False` (Qwen3, Gemma 4) or `reasoning_effort="low"`
(gpt-oss harmony). A template that reads neither has no switch and is
rendered unchanged. Explicit keyword arguments always win.

With no template in the file, `render_chat` refuses unless the caller passes
`fallback=True`; the fallback is plain text, one `role: content` line per
message and `assistant:` as the generation prompt.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

from .errors import UserError

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MAX_CHARS = 4_000_000
_MAX_INT_BITS = 1 << 16  # ints past 65536 bits only appear when a template computes a bomb
_MAX_INDENT = 64

_STR_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill"}
_STR_CHECKED_METHODS = _STR_WIDTH_METHODS | {"format", "format_map", "replace", "join", "expandtabs"}
_NUMBER = re.compile(r"\d+")
# filters that never build text from their arguments (the rest get a size check)
_CHEAP_FILTERS = frozenset({
    "length", "count", "first", "last", "default", "d", "int", "float", "abs", "round", "attr", "select", "reject",
    "selectattr", "rejectattr", "map", "list", "items", "dictsort", "unique", "min", "max", "reverse", "sort",
    "groupby", "random", "batch", "slice", "sum", "tojson", "center", "indent", "wordwrap", "format", "join", "replace",
})


class TemplateTooBig(Exception):
    """A value or the output passed the size limit."""


class TemplateTimeout(Exception):
    """The render passed its time limit."""


class RaisedByTemplate(Exception):
    """The template called raise_exception(message)."""


# --- the guarded environment ---------------------------------------------------


def _limits() -> "_Limit":
    return _render_limits.current


class _Limits(threading.local):
    """Per-render limits, read by the guards (each render runs in its own thread)."""

    def __init__(self):
        self.current = _Limit(DEFAULT_MAX_CHARS)


class _Limit:
    def __init__(self, max_chars: int):
        self.max_chars = max_chars

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise TemplateTooBig(f"{what} would be {n:,} long (limit {self.max_chars:,})")


_render_limits = _Limits()


def _seq_len(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple, bytes)) else None


def _estimate(value: Any, budget: int) -> int:
    """About len(str(value)) (an upper bound for str, list, tuple, dict, namespace),
    computed without building it; stops counting once past `budget`.

    A list can hold 100 000 references to one 4 MB string at no cost, and
    only its str() explodes; this is the check in front of such str() calls.
    """
    from jinja2.utils import Namespace

    # No "seen" set: str() prints a shared container once per reference, so
    # must we. A cycle (namespace holding itself) just counts up to the budget.
    total, stack = 0, [value]
    while stack and total <= budget:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 4  # quotes, separator
        elif isinstance(v, (list, tuple, set, frozenset, dict, Namespace)):
            if isinstance(v, Namespace):
                v = v._Namespace__attrs  # its repr shows them
            total += 2 + 2 * len(v)
            if total <= budget:
                stack.extend(v.keys() if isinstance(v, dict) else v)
                if isinstance(v, dict):
                    stack.extend(v.values())
        else:
            total += 24
    return total


def _check_values(values, what: str) -> None:
    lim = _limits()
    total = 0
    for v in values:
        if not isinstance(v, (int, float, bool)) and v is not None:
            total += _estimate(v, lim.max_chars - total)
            lim.size(total, what)


def _check_binop(op: str, a: Any, b: Any) -> None:
    lim = _limits()
    if op == "*":
        for seq, n in ((a, b), (b, a)):
            if _seq_len(seq) is not None and isinstance(n, int):
                lim.size(len(seq) * max(n, 0), "a repeated value")
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > _MAX_INT_BITS:
            raise TemplateTooBig("an integer product is too large")
    elif op == "**":
        if isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > 0 and b * a.bit_length() > _MAX_INT_BITS:
            raise TemplateTooBig("an integer power is too large")
    elif op == "+":
        if _seq_len(a) is not None and _seq_len(b) is not None:
            lim.size(len(a) + len(b), "a concatenation")
    elif op == "%" and isinstance(a, str):
        _check_format(a, b if isinstance(b, tuple) else (b,), {})


def _check_format(fmt: str, args: Sequence[Any], kwargs: dict) -> None:
    """Refuse format strings whose widths or precisions could build a huge string."""
    lim = _limits()
    for m in _NUMBER.findall(fmt):
        if len(m) > 9 or int(m) > lim.max_chars:
            raise TemplateTooBig(f"a format width of {m} is too large")
    _check_values([*args, *kwargs.values()], "a formatted string")
    if "*" in fmt or "{" in fmt:  # widths may come from the arguments
        for v in [*args, *kwargs.values()]:
            if isinstance(v, int) and not isinstance(v, bool) and v > lim.max_chars:
                raise TemplateTooBig(f"a format width of {v} is too large")


def _checked_str_method(s: str, name: str, method):
    def call(*args, **kwargs):
        lim = _limits()
        if name in _STR_WIDTH_METHODS:
            width = args[0] if args else kwargs.get("width", 0)
            if isinstance(width, int):
                lim.size(width, f"str.{name}")
        elif name in ("format", "format_map"):
            _check_format(s, args, kwargs if name == "format" else (args[0] if args and isinstance(args[0], dict) else {}))
        elif name == "replace":
            old, new = (list(args) + [None, None])[:2]
            if isinstance(old, str) and isinstance(new, str):
                hits = len(s) + 1 if old == "" else s.count(old)
                lim.size(len(s) + hits * max(len(new) - len(old), 0), "str.replace")
        elif name == "join":
            items = list(args[0]) if args else []
            lim.size(len(s) * max(len(items) - 1, 0), "str.join")
            _check_values(items, "str.join")
            return method(items)
        elif name == "expandtabs":
            size = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(size, int):
                lim.size(len(s) + s.count("\t") * max(size, 0), "str.expandtabs")
        return method(*args, **kwargs)

    return call


def _guarded_join(pieces) -> str:
    """`~` and block captures ({% set x %}…{% endset %}, macro bodies)."""
    pieces = list(pieces)
    _check_values(pieces, "a joined string")
    return "".join(p if isinstance(p, str) else str(p) for p in pieces)


def _finalize(value):
    """Every {{ expression }} before Jinja calls str() on it."""
    if not isinstance(value, str):
        _check_values([value], "a printed value")
    return value


def _make_environment():
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class GuardedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):
            if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
                return super().visit_Concat(node, frame)
            self.write("environment.guarded_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class GenerationTag(Extension):
        """HF's `{% generation %}…{% endgeneration %}` (marks assistant text for
        training masks); rendering ignores it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class GuardedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = GuardedCodeGenerator
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def unsafe_undefined(self, obj, attribute):
            # plain Jinja returns an Undefined that prints as "", hiding the attempt
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed")

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def getattr(self, obj, attribute):
            value = super().getattr(obj, attribute)
            if isinstance(obj, str) and attribute in _STR_CHECKED_METHODS and callable(value):
                return _checked_str_method(obj, attribute, value)
            return value

        def getitem(self, obj, argument):
            value = super().getitem(obj, argument)
            if isinstance(obj, str) and isinstance(argument, str) and argument in _STR_CHECKED_METHODS and callable(value):
                return _checked_str_method(obj, argument, value)
            return value

    env = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag], finalize=_finalize)
    env.guarded_join = _guarded_join
    env.concat = _guarded_join
    _guard_filters(env.filters)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _guard_filters(filters: dict) -> None:
    """Size checks in front of the built-in filters that can multiply a size."""

    def wrap(name, check):
        inner = filters[name]

        def guarded(*args, **kwargs):
            check(*args, **kwargs)
            return inner(*args, **kwargs)

        guarded.__dict__.update(inner.__dict__)  # keep pass_context/pass_eval_context markers
        filters[name] = guarded

    def center(value, width=80, *a, **k):
        _limits().size(width if isinstance(width, int) else 0, "center")

    def indent(s, width=4, first=False, blank=False, *a, **k):
        pad = width if isinstance(width, int) else len(str(width))
        _limits().size(len(str(s)) + (str(s).count("\n") + 1) * pad, "indent")

    def wordwrap(env, s, width=79, break_long_words=True, wrapstring=None, *a, **k):
        lines = len(str(s)) // max(int(width) if isinstance(width, int) else 1, 1) + 1
        _limits().size(len(str(s)) + lines * len(wrapstring or "\n"), "wordwrap")

    def fmt(value, *args, **kwargs):
        _check_format(str(value), args, kwargs)

    def replace(ctx, s, old, new, count=None):
        s, old, new = str(s), str(old), str(new)
        hits = len(s) + 1 if old == "" else s.count(old)
        _limits().size(len(s) + hits * max(len(new) - len(old), 0), "replace")

    def count_arg(what):
        def check(value, n, *a, **k):
            if isinstance(n, int):
                _limits().size(n, what)
        return check

    wrap("center", center)
    wrap("indent", indent)
    wrap("wordwrap", wordwrap)
    wrap("format", fmt)
    # every other filter that may turn its arguments into text: check their size first
    for name in list(filters):
        if name not in _CHEAP_FILTERS:
            wrap(name, lambda *a, **k: _check_values([*a, *k.values()], "a filter argument"))
    inner_sum = filters["sum"]

    def total(env, iterable, attribute=None, start=0):
        items = list(iterable)  # a generator can only be read once
        _check_values(items, "sum")
        return inner_sum(env, items, attribute, start)

    total.__dict__.update(inner_sum.__dict__)
    filters["sum"] = total
    inner_join = filters["join"]

    def join(eval_ctx, value, d="", attribute=None):
        items = [value] if isinstance(value, str) else list(value)  # a generator can only be read once
        _limits().size(len(str(d)) * max(len(items) - 1, 0), "join")
        _check_values(items, "join")  # with `attribute` the whole objects: an over-estimate
        return inner_join(eval_ctx, value if isinstance(value, str) else items, d, attribute)

    join.__dict__.update(inner_join.__dict__)
    filters["join"] = join
    wrap("replace", replace)
    wrap("batch", count_arg("batch"))
    wrap("slice", count_arg("slice"))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """HF's tojson: json.dumps, no HTML escaping (unlike Jinja's own filter)."""
    if isinstance(indent, int) and indent > _MAX_INDENT or isinstance(indent, str) and len(indent) > _MAX_INDENT:
        raise TemplateTooBig(f"tojson indent {indent!r} is too large")
    _check_values([value], "tojson")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise RaisedByTemplate(str(message))


def _strftime_now(fmt: str) -> str:
    _check_format(str(fmt), (), {})
    return datetime.now().strftime(str(fmt)[:200])


_environment = None
_environment_lock = threading.Lock()


def _env():
    global _environment
    with _environment_lock:
        if _environment is None:
            _environment = _make_environment()
        return _environment


@lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2 import TemplateSyntaxError

    try:
        return _env().from_string(source)
    except TemplateSyntaxError as exc:
        raise UserError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from None


# --- rendering -----------------------------------------------------------------


def render_template(
    source: str, context: dict, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S, max_chars: int = DEFAULT_MAX_CHARS,
) -> str:
    """Render an untrusted Jinja2 template with the guards of this module."""
    template = _compile(source)
    result: list[str] = []
    error: list[BaseException] = []
    deadline = time.monotonic() + time_limit_s

    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"took longer than {time_limit_s:g} s")
        return line_tracer

    def line_tracer(frame, event, arg):
        if event == "line" and time.monotonic() > deadline:
            raise TemplateTimeout(f"took longer than {time_limit_s:g} s")
        return line_tracer

    def run():
        _render_limits.current = _Limit(max_chars)
        sys.settrace(tracer)  # this thread only
        try:
            out: list[str] = []
            n = 0
            for chunk in template.generate(**context):
                n += len(chunk)
                if n > max_chars:
                    raise TemplateTooBig(f"the rendered prompt passed {max_chars:,} characters")
                out.append(chunk)
            result.append("".join(out))
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)
        finally:
            sys.settrace(None)

    worker = threading.Thread(target=run, name="chat-template", daemon=True)
    worker.start()
    # The tracer stops Python code; the grace covers one long C call (all of
    # them are size-checked). A thread still running after that is left behind.
    worker.join(time_limit_s + 1.0)
    if worker.is_alive():
        raise UserError(f"chat template did not finish within {time_limit_s:g} s; refusing it")
    if error:
        raise _as_user_error(error[0]) from None
    return result[0]


def _as_user_error(exc: BaseException) -> BaseException:
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError

    if isinstance(exc, SecurityError):
        return UserError(f"chat template refused: it tried to reach Python internals ({exc})")
    if isinstance(exc, TemplateTimeout):
        return UserError(f"chat template stopped: it {exc} (an endless loop?)")
    if isinstance(exc, (TemplateTooBig, MemoryError, OverflowError)):
        return UserError(f"chat template stopped: {exc or type(exc).__name__}")
    if isinstance(exc, RaisedByTemplate):
        return UserError(f"chat template rejected the conversation: {exc}")
    if isinstance(exc, RecursionError):
        return UserError("chat template stopped: it recursed too deeply")
    if isinstance(exc, (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError)):
        return UserError(f"chat template failed: {type(exc).__name__}: {exc}")
    return exc  # a bug here, not in the template: keep the traceback


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
    template variables and win over what `no_think` sets.

    The result is text: encode it with `special=True` (the framing tokens
    must become control tokens) and `add_bos=False` when it already starts
    with the BOS token's text.
    """
    template, bos, eos, where = _template_of(source)
    if not template:
        if not fallback:
            raise UserError(f"{where}: has no tokenizer.chat_template; pass a template, or ask for the plain 'role: content' fallback")
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
    return render_template(template, context, time_limit_s=time_limit_s, max_chars=max_chars)


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
    lines = [f"{m.get('role', 'user')}: {m.get('content') or ''}\n" for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "".join(lines)


def _template_of(source) -> tuple[str | None, str, str, str]:
    """(template, bos text, eos text, name for messages) of a GGUFFile, Tokenizer or str."""
    if isinstance(source, str):
        return source, "", "", "chat template"
    if hasattr(source, "token_text") and hasattr(source, "chat_template"):  # Tokenizer
        bos = source.token_text(source.bos_id) if source.bos_id is not None else ""
        eos = source.token_text(source.eos_id) if source.eos_id is not None else ""
        return source.chat_template, bos, eos, source.source
    if hasattr(source, "meta"):  # GGUFFile
        tokens = source.meta("tokenizer.ggml.tokens") or []

        def text(key: str) -> str:
            i = source.meta(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

        return source.meta("tokenizer.chat_template"), text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id"), str(source.path)
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
    `template_vars` (e.g. enable_thinking=False) become template variables."""
    return encode_prompt(tok, render_chat(tok, messages, add_generation_prompt=True, no_think=no_think, **template_vars))
