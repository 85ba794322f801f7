"""Rendering an untrusted Jinja2 template: a GGUF's `tokenizer.chat_template`.

A chat template is code that came with a downloaded file. It runs in Jinja's
`ImmutableSandboxedEnvironment` with these guards on top:

* Python internals (`''.__class__`, `cycler.__init__.__globals__`,
  `'{0.__class__}'.format(x)`, `|attr('__class__')`, `messages.append`) raise
  at once instead of rendering an empty string the way plain Jinja does.
* Files: `include`, `import`, `extends` are refused by a loader that reads
  nothing; there is no `open` or any other builtin in the template's globals.
* Time: the compile and the render run in their own thread under a tracer
  that stops them after `time_limit_s` (default 2 s; real templates take about
  1 ms to render, 20 ms to compile). Templates longer than 256 KiB, or that
  compile to more than 1 MiB of Python, are refused before Python's own
  compiler (a C call the tracer cannot stop) sees them: on this machine a
  1 MiB module compiles in ~0.5 s, the largest real templates are ~20 KiB.
* Size: the output may not pass `max_chars` (default 4M characters, far above
  any context window), and so may no single value the template builds: `+`,
  `*`, `**`, `%`, `~`, `{% set %}` blocks and the string methods and filters
  that can multiply a size (center, ljust, format, replace, join, indent,
  wordwrap, batch, slice, tojson's indent…) are checked *before* they
  allocate; so is every str() of a container (printing it, `~`, `%`,
  filters), by estimating its text size without building it.
* Memory: many values each under the size limit can still add up (a loop
  appending 4 MB strings reaches 2.5 GB in 2 s without this guard), so the tracer
  also samples the process's resident size every 2 ms and stops the render
  once it has grown by more than `max_memory_mb` (default 256 MiB).

Every refusal becomes a one-line `TemplateRefused` (a `UserError`); the
template's own `raise_exception(msg)` becomes `TemplateRejected`. What this
does not give: a hard memory cap (one C call between two samples can still
allocate up to a few times `max_chars`), or a way to stop a C call that runs
past the deadline (the thread is left behind and the caller gets an error).
A process-level guarantee would need a child process with RLIMIT_AS.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ..errors import UserError

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MAX_CHARS = 4_000_000
DEFAULT_MAX_MEMORY_MB = 256
MAX_TEMPLATE_CHARS = 256 * 1024  # the largest templates on the Hub are ~20 KiB
MAX_CODE_CHARS = 1 << 20  # Python source Jinja makes of a template: ~3x its size; compiles in ~0.5 s here
MAX_NESTING = 64  # blocks and brackets open at once; chat templates on the Hub stay under ~12
MEMORY_SAMPLE_S = 0.002  # a resident-size read costs ~25 us: ~1 % of the render at this rate
_MAX_INT_BITS = 1 << 16  # ints past 65536 bits only appear when a template computes a bomb
_MAX_INDENT = 64

_STR_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill"}
_STR_CHECKED_METHODS = _STR_WIDTH_METHODS | {"format", "format_map", "replace", "join", "expandtabs"}
_NUMBER = re.compile(r"\d+")
# filters that never build text from their arguments (the rest get a size check)
_CHEAP_FILTERS = frozenset(
    {
        "length",
        "count",
        "first",
        "last",
        "default",
        "d",
        "int",
        "float",
        "abs",
        "round",
        "attr",
        "select",
        "reject",
        "selectattr",
        "rejectattr",
        "map",
        "list",
        "items",
        "dictsort",
        "unique",
        "min",
        "max",
        "reverse",
        "sort",
        "groupby",
        "random",
        "batch",
        "slice",
        "sum",
        "tojson",
        "center",
        "indent",
        "wordwrap",
        "format",
        "join",
        "replace",
    }
)


class TemplateRefused(UserError):
    """The template was refused or stopped: unsafe, too slow, too big, or broken."""


class TemplateRejected(UserError):
    """The template called raise_exception(message): it refuses the conversation, not the other way round."""


class TemplateTooBig(Exception):
    """A value or the output passed the size limit."""


class _Stopped(BaseException):
    """Raised by the tracer. A BaseException so that no `except Exception` in
    Jinja (its constant folder has several) can swallow it."""


class TemplateTimeout(_Stopped):
    """The compile or render passed its time limit."""


class TemplateMemory(_Stopped):
    """The process grew past the render's memory allowance."""


class RaisedByTemplate(Exception):
    """The template called raise_exception(message)."""


# --- per-render limits ---------------------------------------------------------


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


def _limits() -> _Limit:
    return _render_limits.current


class _Watch:
    """The render thread's tracer: stops it at the deadline, or once the process
    has grown by more than the memory allowance since the render began."""

    def __init__(self, time_limit_s: float, max_memory_mb: float):
        import psutil

        self.time_limit_s, self.max_memory_mb = time_limit_s, max_memory_mb
        self.deadline = time.monotonic() + time_limit_s
        self.process = psutil.Process()  # made here, not at import: a forked child must read its own size
        self.rss0 = self.process.memory_info().rss
        self.next_sample = 0.0
        # While compiling, only calls are checked: Jinja's parser makes a call per
        # token or two, and tracing every line made a 25 KB template take 2 s to compile.
        self.compiling = True

    def check(self) -> None:
        now = time.monotonic()
        if now > self.deadline:
            raise TemplateTimeout(
                f"took longer than {self.time_limit_s:g} s" + (" to compile" if self.compiling else " (an endless loop?)")
            )
        if now >= self.next_sample:
            self.next_sample = now + MEMORY_SAMPLE_S
            grown = self.process.memory_info().rss - self.rss0
            if grown > self.max_memory_mb * 2**20:
                raise TemplateMemory(f"it used {grown / 2**20:.0f} MiB of memory (limit {self.max_memory_mb:g} MiB)")

    def on_call(self, frame, event, arg):
        self.check()
        if self.compiling or frame.f_code.co_filename == __file__:
            return None  # the guards here are bounded loops; tracing their lines would only slow them 5-10x
        return self.on_line

    def on_line(self, frame, event, arg):
        if event == "line":
            self.check()
        return self.on_line


# --- size checks ---------------------------------------------------------------


def _seq_len(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple, bytes)) else None


def _estimate(value: Any, budget: int) -> int:
    """About len(str(value)) (an upper bound for str, list, tuple, dict, namespace),
    computed without building it; stops counting once past `budget`.

    A list can hold 100 000 references to one 4 MB string at no cost, and
    only its str() explodes; this is the check in front of such str() calls.
    str() prints a shared container once per reference, so this counts it
    once per reference too, but measures it only once (`sizes`): thirty
    nested `[l, l]` are 2**30 leaves to print and thirty containers to count.
    """
    from jinja2.utils import Namespace

    total = 0  # everything counted so far: never more than the final size, so past budget is past for good
    sizes: dict[int, int] = {}  # id -> size of a container already measured (all alive: `value` holds them)
    open_ids: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, -1)]  # (object, -1) to count, (container, total when opened) to close
    while stack and total <= budget:
        v, opened_at = stack.pop()
        if opened_at >= 0:
            sizes[id(v)] = total - opened_at
            open_ids.discard(id(v))
            continue
        if isinstance(v, Namespace):
            v = v._Namespace__attrs  # its repr shows them
        if isinstance(v, str):
            total += len(v) + 4  # quotes, separator
        elif isinstance(v, (list, tuple, set, frozenset, dict)):
            key = id(v)
            if key in sizes:
                total += sizes[key]
            elif key in open_ids:
                return budget + 1  # a container inside itself (a namespace holding itself): refuse
            else:
                open_ids.add(key)
                stack.append((v, total))
                total += 2 + 2 * len(v)
                if total > budget:
                    break
                stack.extend((c, -1) for c in (v if not isinstance(v, dict) else [*v.keys(), *v.values()]))
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


# --- the guarded environment ---------------------------------------------------


def _make_environment():
    from jinja2 import BaseLoader, nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter, SecurityError
    from markupsafe import Markup

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

    class NoFiles(BaseLoader):
        """include / import / extends: a template may not read files."""

        def get_source(self, environment, template):
            raise SecurityError(f"it tried to read the file {str(template)[:200]!r} (include, import and extends are not allowed)")

    class GuardedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = GuardedCodeGenerator
        intercepted_binops = frozenset({"+", "*", "**", "%"})
        # What GuardedCodeGenerator's `~` calls, and what Jinja joins a rendered template
        # and block captures with (its default: "".join, unchecked).
        guarded_join = staticmethod(_guarded_join)
        concat = staticmethod(_guarded_join)

        def unsafe_undefined(self, obj, attribute):
            # plain Jinja returns an Undefined that prints as "", hiding the attempt
            raise SecurityError(f"it tried to reach Python internals (attribute {attribute!r} of a {type(obj).__name__} object)")

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def getattr(self, obj, attribute):
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                return _checked_str_method(obj, attribute, self._sandboxed_format(obj, attribute))
            value = super().getattr(obj, attribute)
            if isinstance(obj, str) and attribute in _STR_CHECKED_METHODS and callable(value):
                return _checked_str_method(obj, attribute, value)
            return value

        def getitem(self, obj, argument):
            if isinstance(obj, str) and argument in ("format", "format_map"):
                return _checked_str_method(obj, argument, self._sandboxed_format(obj, argument))
            value = super().getitem(obj, argument)
            if isinstance(obj, str) and isinstance(argument, str) and argument in _STR_CHECKED_METHODS and callable(value):
                return _checked_str_method(obj, argument, value)
            return value

        def _sandboxed_format(self, s, name):
            # '{0.__class__.__mro__}'.format(x) reads attributes inside str.format, out of the
            # sandbox's sight: run it through the sandbox's own formatter, which checks each one.
            # Done here, not left to Jinja: before 3.1.5 its check sat in call(), and the size
            # check's wrapper around the method would have hidden the method from it.
            formatter = SandboxedEscapeFormatter(self, escape=s.escape) if isinstance(s, Markup) else SandboxedFormatter(self)

            def fmt(*args, **kwargs):
                if name == "format_map":
                    if kwargs or len(args) != 1:
                        raise TypeError("format_map() takes exactly one argument, a mapping")
                    return type(s)(formatter.vformat(s, (), args[0]))
                return type(s)(formatter.vformat(s, args, kwargs))

            return fmt

        def _compile(self, source, filename):
            # Python's compile() is one C call: neither the deadline nor the memory watch can stop it
            if len(source) > MAX_CODE_CHARS:
                raise TemplateTooBig(f"it compiles to {len(source):,} characters of Python (limit {MAX_CODE_CHARS:,})")
            return super()._compile(source, filename)

    env = GuardedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag], finalize=_finalize, loader=NoFiles()
    )
    _guard_filters(env.filters)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _guard_filters(filters: dict) -> None:
    """Size checks in front of the built-in filters that can multiply a size."""
    from jinja2.utils import _PassArg

    def wrap(name, check):
        """Run check(value, *args) before the filter; the context, eval context or
        environment Jinja passes first to some filters is not given to it."""
        inner = filters[name]
        skip = 0 if _PassArg.from_obj(inner) is None else 1

        def guarded(*args, **kwargs):
            check(*args[skip:], **kwargs)
            return inner(*args, **kwargs)

        guarded.__dict__.update(inner.__dict__)  # keep pass_context/pass_eval_context markers
        filters[name] = guarded

    def center(value, width=80, *a, **k):
        _limits().size(width if isinstance(width, int) else 0, "center")

    def indent(s, width=4, first=False, blank=False, *a, **k):
        pad = width if isinstance(width, int) else len(str(width))
        _limits().size(len(str(s)) + (str(s).count("\n") + 1) * pad, "indent")

    def wordwrap(s, width=79, break_long_words=True, wrapstring=None, *a, **k):
        lines = len(str(s)) // max(int(width) if isinstance(width, int) else 1, 1) + 1
        _limits().size(len(str(s)) + lines * len(wrapstring or "\n"), "wordwrap")

    def fmt(value, *args, **kwargs):
        _check_format(str(value), args, kwargs)

    def replace(s, old, new, count=None):
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


# Compiled templates, and the refusals of the ones that would not compile: a
# hostile template in a served model is refused once, not at the cost of a
# full time limit on every request.
_compiled: OrderedDict[str, Any] = OrderedDict()
_compiled_lock = threading.Lock()
_COMPILED_KEEP = 16


def _compile(source: str):
    """The compiled template, in the render thread (under its watch)."""
    with _compiled_lock:
        hit = _compiled.get(source)
        if hit is not None:
            _compiled.move_to_end(source)
    if isinstance(hit, str):
        raise TemplateRefused(hit)  # a new exception each time: re-raising one object grows its traceback
    if hit is not None:
        return hit
    try:
        _check_nesting(source)
        template = _env().from_string(source)
    except _Stopped:
        raise  # time or memory: may pass on a quieter machine; not remembered
    except BaseException as exc:
        refusal = _as_user_error(exc)
        if not isinstance(refusal, TemplateRefused):
            raise
        template = str(refusal)
    with _compiled_lock:
        _compiled[source] = template
        while len(_compiled) > _COMPILED_KEEP:
            _compiled.popitem(last=False)
    if isinstance(template, str):
        raise TemplateRefused(template)
    return template


# Jinja's tags that open a block closed by end<tag>, and GenerationTag's (the environment's extension above).
_BLOCK_TAGS = frozenset({"if", "for", "macro", "call", "filter", "block", "with", "autoescape", "generation"})
_OPENING, _CLOSING = frozenset("([{"), frozenset(")]}")


def _check_nesting(source: str) -> None:
    """Refuse a template nested deeper than MAX_NESTING before Jinja parses it.

    Jinja's parser and code generator recurse once per level, so a deep
    template ends in a RecursionError somewhere inside them, and how that
    surfaces depends on how much stack the thread has left (sometimes an
    error inside the error handling). The lexer is a loop: counting there
    gives the same one-line refusal every time.
    """
    depth = 0
    after_block_begin = False
    for _, kind, value in _env().lex(source):
        if kind == "whitespace":
            continue
        if kind == "block_begin":
            after_block_begin = True
            continue
        if after_block_begin and kind == "name":
            depth += value in _BLOCK_TAGS
            depth -= value.startswith("end") and value[3:] in _BLOCK_TAGS
        elif kind == "operator":
            depth += value in _OPENING
            depth -= value in _CLOSING
        after_block_begin = False
        if depth > MAX_NESTING:
            raise TemplateRefused(f"chat template refused: it nests too deeply to compile (over {MAX_NESTING} levels)")


# --- rendering -----------------------------------------------------------------


def render_template(
    source: str,
    context: dict,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_memory_mb: float = DEFAULT_MAX_MEMORY_MB,
) -> str:
    """Render an untrusted Jinja2 template with the guards of this module.

    Raises TemplateRefused (or TemplateRejected) with a one-line message.
    """
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateRefused(f"chat template refused: it is {len(source):,} characters long (limit {MAX_TEMPLATE_CHARS:,})")
    _env()  # built outside the clock: the first build imports jinja2
    result: list[str] = []
    error: list[BaseException] = []
    watch = _Watch(time_limit_s, max_memory_mb)

    def run():
        _render_limits.current = _Limit(max_chars)
        sys.settrace(watch.on_call)  # this thread only
        try:
            template = _compile(source)
            watch.compiling = False
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
        raise TemplateRefused(f"chat template stopped: it did not finish within {time_limit_s:g} s")
    if error:  # popped: the template's frames (and what they built) must not outlive the render
        raise _as_user_error(error.pop()) from None
    return result[0]


def _as_user_error(exc: BaseException) -> BaseException:
    from jinja2 import TemplateError, TemplateSyntaxError
    from jinja2.sandbox import SecurityError

    if isinstance(exc, UserError):
        return exc  # already worded (a refusal remembered by _compile)
    if isinstance(exc, TemplateSyntaxError):
        return TemplateRefused(f"chat template has a syntax error at line {exc.lineno}: {exc.message}")
    if isinstance(exc, SecurityError):
        return TemplateRefused(f"chat template refused: {exc}")
    if isinstance(exc, TemplateTimeout):
        return TemplateRefused(f"chat template stopped: it {exc}")
    if isinstance(exc, (TemplateTooBig, TemplateMemory, MemoryError, OverflowError)):
        return TemplateRefused(f"chat template stopped: {exc or type(exc).__name__}")
    if isinstance(exc, RaisedByTemplate):
        return TemplateRejected(f"chat template rejected the conversation: {exc}")
    if isinstance(exc, RecursionError):
        return TemplateRefused("chat template stopped: it nests or recurses too deeply")
    if isinstance(exc, SyntaxError):  # Python's compiler on Jinja's output: "too many statically nested blocks"
        return TemplateRefused(f"chat template refused: it nests too deeply to compile ({exc.msg})")
    if isinstance(exc, (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError)):
        return TemplateRefused(f"chat template failed: {type(exc).__name__}: {exc}")
    return exc  # a bug here, not in the template: keep the traceback
