"""Chat templates: each made model's framing, the thinking switch, the
fallback, and untrusted templates refused or stopped (one test per attack
class: Python objects, files, endless loops, gigantic strings, memory,
compile-time bombs), then `moe-pipe run` on a model with a hostile template."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.reader import GGUFFile
from moe_pipe.shared.makemodel.maker import chat_template, make_model
from moe_pipe.shared.text import template_sandbox as sandbox
from moe_pipe.shared.text.chat import (
    TemplateRefused,
    TemplateRejected,
    chat_prompt_tokens,
    encode_prompt,
    plain_chat,
    render_chat,
    render_template,
    use_chat_template,
)
from moe_pipe.shared.text.tokenizer import Tokenizer

ARCHS = ("qwen3moe", "gpt-oss", "gemma4")
USER = [{"role": "user", "content": 'Hi <b> & "you"'}]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Grüße, 世界"},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "find <things>",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "Straße & 中"}}},
    },
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {arch: GGUFFile(make_model(arch, "tiny", root / f"{arch}.gguf")) for arch in ARCHS}


# --- framing -----------------------------------------------------------------


def test_qwen_chatml(files):
    out = render_chat(files["qwen3moe"], USER)
    assert out == '<|im_start|>user\nHi <b> & "you"<|im_end|>\n<|im_start|>assistant\n'
    full = render_chat(files["qwen3moe"], CHAT)
    assert full.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n")
    assert full.endswith("<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nGrüße, 世界<|im_end|>\n<|im_start|>assistant\n")


def test_harmony(files):
    out = render_chat(files["gpt-oss"], USER)
    assert out.startswith("<|start|>system<|message|>")
    assert "Reasoning: medium" in out
    assert out.endswith('<|start|>user<|message|>Hi <b> & "you"<|end|><|start|>assistant')
    full = render_chat(files["gpt-oss"], CHAT)
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in full
    assert "<|start|>assistant<|channel|>final<|message|>4<|end|>" in full


def test_gemma_turns(files):
    out = render_chat(files["gemma4"], USER)
    assert out.startswith('<bos><|turn>user\nHi <b> & "you"<turn|>\n<|turn>model\n')
    full = render_chat(files["gemma4"], CHAT)
    assert full.startswith("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\n2+2?<turn|>\n<|turn>model\n4<turn|>\n")


@pytest.mark.parametrize("arch", ARCHS)
def test_without_generation_prompt(files, arch):
    with_prompt = render_chat(files[arch], CHAT)
    without = render_chat(files[arch], CHAT, add_generation_prompt=False)
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)


@pytest.mark.parametrize("arch", ARCHS)
def test_tools_render_as_plain_json(files, arch):
    out = render_chat(files[arch], USER, tools=[TOOL])
    assert "lookup" in out
    assert '"Straße & 中"' in out and "find <things>" in out  # tojson like HF: no HTML escaping, no \u escapes


@pytest.mark.parametrize("arch", ARCHS)
def test_rendered_prompt_tokenizes_to_control_tokens(files, arch):
    tok = Tokenizer.from_gguf(files[arch])
    text = render_chat(tok, USER)
    assert text == render_chat(files[arch], USER)  # a Tokenizer is as good a source as the file
    ids = tok.encode(text, add_bos=not text.startswith(tok.token_text(tok.bos_id)))
    assert ids.count(tok.bos_id) <= 1 if arch == "gemma4" else True
    frame = {"qwen3moe": "<|im_start|>", "gpt-oss": "<|start|>", "gemma4": "<|turn>"}[arch]
    assert tok.encode(frame, add_bos=False)[0] in ids
    assert tok.decode(ids).endswith(text)


# --- thinking ----------------------------------------------------------------


def test_no_think_qwen(files):
    on = render_chat(files["qwen3moe"], USER)
    off = render_chat(files["qwen3moe"], USER, no_think=True)
    assert off == on + "<think>\n\n</think>\n\n"


def test_no_think_harmony(files):
    off = render_chat(files["gpt-oss"], USER, no_think=True)
    assert "Reasoning: low" in off and "Reasoning: medium" not in off
    assert "Reasoning: high" in render_chat(files["gpt-oss"], USER, no_think=True, reasoning_effort="high")  # kwargs win


def test_no_think_gemma(files):
    on = render_chat(files["gemma4"], USER, enable_thinking=True)
    assert "<|think|>" in on and not on.endswith("<|channel>thought\n<channel|>")
    off = render_chat(files["gemma4"], USER, no_think=True)
    assert "<|think|>" not in off and off.endswith("<|turn>model\n<|channel>thought\n<channel|>")


def test_no_think_without_a_switch_is_a_no_op():
    src = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert render_chat(src, USER, no_think=True) == render_chat(src, USER)


# --- missing template -------------------------------------------------------------


def test_missing_template_needs_the_fallback_asked_for():
    with pytest.raises(UserError, match="no tokenizer.chat_template"):
        render_chat("", CHAT)
    out = render_chat("", CHAT, fallback=True)
    assert out == "system: Be brief.\nuser: 2+2?\nassistant: 4\nuser: Grüße, 世界\nassistant:"
    assert out == plain_chat(CHAT)


# --- HF globals --------------------------------------------------------------------


def test_hf_globals():
    src = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ add_generation_prompt }}|{{ strftime_now('%Y') | length }}|{{ messages | tojson }}"
    )
    out = render_chat(src, USER)
    assert out == '||None|True|4|[{"role": "user", "content": "Hi <b> & \\"you\\""}]'
    with pytest.raises(UserError, match="rejected the conversation: roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", USER)
    assert (
        render_chat(
            "{% generation %}x{% endgeneration %}{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}", USER
        )
        == "x0"
    )


# --- untrusted templates: one test per attack class --------------------------------
#
# Each must end in a one-line UserError within about 2 s that names what
# happened and says how to fall back to the plain template.

FALLBACK = "--chat-template plain"


def refused(src: str, *, time_limit_s: float = 0.5, match: str = "") -> str:
    """The one-line error `src` ends in, checked for the common promises."""
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        render_chat(src, USER, time_limit_s=time_limit_s)
    assert time.monotonic() - start < 2.0, src
    msg = str(err.value)
    assert "\n" not in msg and FALLBACK in msg, msg
    assert re.search(match, msg), (match, msg)
    return msg


PYTHON_OBJECTS = {
    "__class__": "{{ ''.__class__ }}",
    "__mro__": "{{ ''.__class__.__mro__ }}",
    "mro()": "{{ ''.__class__.mro() }}",
    "__subclasses__": "{{ ().__class__.__base__.__subclasses__() }}",
    "cycler globals": "{{ cycler.__init__.__globals__ }}",
    "joiner globals": "{{ joiner.__init__.__globals__ }}",
    "namespace globals": "{{ namespace.__init__.__globals__ }}",
    "lipsum globals": "{{ lipsum.__globals__ }}",
    "our globals": "{{ raise_exception.__globals__ }}",
    "code object": "{{ strftime_now.__code__ }}",
    "subscript": "{{ ''['__class__'] }}",
    "attr filter": "{{ '' | attr('__class__') }}",
    "attr filter built name": "{{ '' | attr('_' * 2 ~ 'class' ~ '_' * 2) }}",
    "map attribute": "{{ messages | map(attribute='__class__') | list }}",
    "sort attribute": "{{ messages | sort(attribute='__class__') | list }}",
    "format attribute": "{{ '{0.__class__}'.format('') }}",
    "format deep": "{{ '{0.__class__.__mro__[1].__subclasses__}'.format(messages) }}",
    "format item then attribute": "{{ '{0[0].__class__}'.format(messages) }}",
    "format_map": "{{ '{x.__class__}'.format_map({'x': 1}) }}",
    "format via subscript": "{{ '{0.__class__}'['format'](1) }}",
    "format method kept": "{% set f = '{0.__init__}'.format %}{{ f(cycler) }}",
    "percent format": "{{ '%s' % messages.__class__ }}",
    "generator frame": "{{ (messages | map('string')).gi_frame }}",
    "template self": "{{ self.__init__.__globals__ }}",
    "template context": "{{ self._TemplateReference__context }}",
    "loop object": "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
    "macro function": "{% macro m() %}{% endmacro %}{{ m._func }}",
    "namespace attrs": "{% set ns = namespace() %}{{ ns._Namespace__attrs }}",
    "mutate list": "{% set x = messages.append(1) %}",
    "mutate dict": "{{ messages[0].update({'role': 'system'}) }}",
}


@pytest.mark.parametrize("name", sorted(PYTHON_OBJECTS))
def test_python_objects_are_refused(name):
    refused(PYTHON_OBJECTS[name], match="^chat template refused: it tried to reach Python internals")


def test_format_still_formats():
    """The sandboxed str.format is a real one (templates use it for tool signatures)."""
    src = "{{ '{}-{x}'.format(1, x=2) }} {{ '{0[role]}/{0.content}'.format(messages[0]) }} {{ '{a:>3}'.format_map({'a': 7}) }}"
    assert render_chat(src, USER) == '1-2 user/Hi <b> & "you"   7'


FILES = {
    "include": "{% include '/etc/passwd' %}",
    "include list": "{% include ['/nope', '/etc/passwd'] ignore missing %}",
    "import": "{% import '/etc/passwd' as p %}",
    "from import": "{% from '/etc/passwd' import x %}",
    "extends": "{% extends '/etc/passwd' %}",
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_reading_files_is_refused(name):
    refused(FILES[name], match=r"^chat template refused: it tried to read the file '/(etc/passwd|nope)'")


def test_no_builtins_to_open_files():
    for src in (
        "{{ open('/etc/passwd').read() }}",
        "{{ __builtins__.open('/etc/passwd') }}",
        "{{ self.__init__.__globals__.__builtins__.open('/etc/passwd') }}",
    ):
        msg = refused(src, match="^chat template (failed: UndefinedError|refused)")
        assert "root:" not in msg
    assert render_chat("{{ __builtins__ }}{{ config }}{{ environment }}", USER) == ""  # undefined names


LOOPS = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "macro recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "macro fan-out": "{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
    "recursive loop": "{% set l = [[1]] %}{% for x in l recursive %}{{ loop(l) }}{% endfor %}",
    "lipsum": "{{ lipsum(10 ** 9) }}",
    "huge range": "{{ range(10 ** 12) | list | length }}",
}


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_endless_loops_are_stopped(name):
    refused(
        LOOPS[name],
        match=r"^chat template stopped: (it took longer than 0.5 s \(an endless loop\?\)|it nests or "
        r"recurses too deeply|Range too big)",
    )


BIG_STRINGS = {
    "repeat": "{{ 'x' * 10**10 }}",
    "repeat reversed": "{{ 10**10 * 'x' }}",
    "list repeat": "{{ (messages * 10**9) | length }}",
    "power": "{{ 2 ** (10 ** 10) }}",
    "squaring loop": "{% set ns = namespace(n=2) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n }}",
    "doubling +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "doubling ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling set block": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}",
    "doubling list": "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}",
    "join filter": "{{ range(10000) | map('string') | join('x' * 1000) }}",
    "join method": "{{ ('x' * 1000).join(range(10000) | map('string')) }}",
    "replace filter": "{{ ('a' * 100000) | replace('a', 'b' * 1000) }}",
    "replace method": "{{ ('a' * 100000).replace('a', 'b' * 1000) }}",
    "replace empty": "{{ ('a' * 1000000).replace('', 'bbbbbbbb') }}",
    "percent width": "{{ '%999999999s' % 'a' }}",
    "percent star width": "{{ '%*s' % (999999999, 'a') }}",
    "percent precision": "{{ '%.999999999f' % 1.0 }}",
    "percent in format filter": "{{ '%999999999s' | format('a') }}",
    "format width": "{{ '{:>999999999}'.format('a') }}",
    "format width from argument": "{{ '{:>{}}'.format('a', 999999999) }}",
    "format_map width": "{{ '{a:>999999999}'.format_map({'a': 1}) }}",
    "center method": "{{ 'a'.center(999999999) }}",
    "ljust": "{{ 'a'.ljust(999999999) }}",
    "rjust": "{{ 'a'.rjust(999999999) }}",
    "zfill": "{{ 'a'.zfill(999999999) }}",
    "center filter": "{{ 'a' | center(999999999) }}",
    "indent": "{{ ('\n' * 1000000) | indent(1000) }}",
    "wordwrap": "{{ ('a' * 1000000) | wordwrap(1, wrapstring='x' * 1000) }}",
    "expandtabs": "{{ ('\t' * 100000).expandtabs(100000) }}",
    "truncate end": "{{ 'a' | truncate(10, end='x' * 10**9) }}",
    "slice": "{{ range(10) | slice(10**9) | list }}",
    "tojson indent": "{{ messages | tojson(indent=1000000000) }}",
    "shared refs printed": "{% set d = dict.fromkeys(range(100000), 'x' * 1000000) %}{{ d }}",
    "shared refs tojson": "{% set d = dict.fromkeys(range(100000), 'x' * 1000000) %}{{ d | tojson }}",
    "shared refs string": "{% set d = dict.fromkeys(range(100000), 'x' * 1000000) %}{{ d | string | length }}",
    "shared refs concat": "{% set l = ['x' * 1000000] * 100 %}{{ l ~ '' }}",
    "shared list printed": "{% set l = [['x' * 1000000]] * 100 %}{{ l }}",
    "nested doubling printed": "{% set ns = namespace(l=[]) %}{% for i in range(30) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
    "shared refs join": "{{ range(100) | map('string') | map('center', 100000) | join }}",  # 10 M characters, built fast even on a busy machine
    "shared refs sum": "{{ (range(1000) | map('string') | map('list') | list | sum(start=[]) | list) ~ ('x' * 3999999) }}",
    "huge output": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(BIG_STRINGS))
def test_gigantic_strings_are_stopped_before_they_are_built(name):
    refused(BIG_STRINGS[name], match=r"^chat template stopped: .*(too large|would be [\d,]+ long|passed [\d,]+ characters)")


def test_many_values_each_under_the_size_limit_are_stopped_by_memory():
    """Before the memory watch this template grew the process by 2.5 GB in 2 s:
    every string is under the size limit, there are just a thousand of them."""
    src = (
        "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
        "{% set ns.l = ns.l + [('x' * 3999990) ~ i] %}{% endfor %}{{ ns.l | length }}"
    )
    rss = psutil.Process().memory_info
    before = rss().rss
    with pytest.raises(TemplateRefused, match=r"^chat template stopped: it used \d+ MiB of memory \(limit 64 MiB\)"):
        render_template(src, {}, time_limit_s=2.0, max_memory_mb=64)
    assert rss().rss - before < 64 * 2**20  # and it was given back


COMPILE = {
    "too long": "{{ 'x' }}" * 30000,
    "deep parentheses": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "deep ifs": "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000,
    "nested fors": "".join(f"{{% for i{i} in [1] %}}" for i in range(30)) + "x" + "{% endfor %}" * 30,
    "nested ifs": "{% if true %}" * 200 + "x" + "{% endif %}" * 200,
}


@pytest.mark.parametrize("name", sorted(COMPILE))
def test_templates_that_would_not_compile_are_refused(name):
    """These escaped as RecursionError / SyntaxError tracebacks before (compiling ran outside the guards)."""
    refused(
        COMPILE[name],
        match=r"^chat template (refused: it is [\d,]+ characters long|stopped: it nests or recurses "
        r"too deeply|refused: it nests too deeply to compile)",
    )


def test_a_refused_compile_is_remembered():
    src = "{% if true %}" * 200 + "y" + "{% endif %}" * 200
    first = refused(src)
    assert src in sandbox._compiled and refused(src) == first


def test_syntax_error_is_one_line():
    msg = refused("ok\n{% for %}", match="syntax error at line 2")
    assert msg.startswith("chat template has a syntax error")


def test_raise_exception_is_the_templates_own_refusal():
    """A template refusing the conversation is not a broken template: no fallback hint."""
    with pytest.raises(TemplateRejected) as err:
        render_chat("{{ raise_exception('roles must alternate') }}", USER)
    assert str(err.value) == "chat template rejected the conversation: roles must alternate"


def test_the_error_names_the_model_file(files, tmp_path):
    path = with_template(files["qwen3moe"].path, tmp_path / "hostile.gguf", PYTHON_OBJECTS["__mro__"])
    with GGUFFile(path) as f, pytest.raises(UserError) as err:
        render_chat(f, USER)
    assert str(err.value).startswith(f"{path}: chat template refused") and FALLBACK in str(err.value)


# --- the fallback ---------------------------------------------------------------------


def with_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of the made model `src` whose tokenizer.chat_template is `template`.

    The new text is padded with a Jinja comment to the old one's byte length,
    so every offset after it in the file stays right."""
    data = src.read_bytes()
    with GGUFFile(src) as f:
        arch = f.meta("general.architecture")
    old = chat_template(arch).encode()
    assert data.count(old) == 1
    new = template.encode()
    filler = len(old) - len(new) - len("{##}")
    assert filler >= 0, "template longer than the one it replaces"
    new += b"{#" + b" " * filler + b"#}"
    dst.write_bytes(data.replace(old, new))
    return dst


def test_plain_fallback_on_a_hostile_template(files):
    tok = Tokenizer.from_gguf(files["qwen3moe"])
    tok.chat_template = BIG_STRINGS["repeat"]
    with pytest.raises(UserError, match=FALLBACK):
        chat_prompt_tokens(tok, CHAT)
    plain = use_chat_template(tok, "plain")
    assert render_chat(plain, CHAT) == plain_chat(CHAT) and tok.chat_template == BIG_STRINGS["repeat"]  # a copy
    assert chat_prompt_tokens(plain, CHAT) == encode_prompt(tok, plain_chat(CHAT))
    assert use_chat_template(tok, "model") is tok


def test_missing_template_says_how_to_fall_back():
    with pytest.raises(UserError, match=f"no tokenizer.chat_template; .*{FALLBACK}"):
        render_chat("", CHAT)


def test_a_template_file_of_ones_own(files, tmp_path):
    tok = Tokenizer.from_gguf(files["qwen3moe"])
    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    assert render_chat(use_chat_template(tok, str(mine)), USER) == '<user>Hi <b> & "you"<assistant>'
    mine.write_text("{{ ''.__class__ }}")  # sandboxed all the same, and the error names the file
    with pytest.raises(UserError, match=f"^{mine}: chat template refused"):
        render_chat(use_chat_template(tok, str(mine)), USER)
    for path, want in ((tmp_path / "absent.jinja", "no such file"), (tmp_path, "is a folder")):
        with pytest.raises(UserError, match=want):
            use_chat_template(tok, str(path))
    bad = tmp_path / "bad.jinja"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(UserError, match="not UTF-8"):
        use_chat_template(tok, str(bad))


@pytest.fixture(scope="module")
def hostile_model(files, tmp_path_factory):
    return with_template(
        files["qwen3moe"].path,
        tmp_path_factory.mktemp("hostile") / "hostile.gguf",
        "{% for m in messages %}{{ m.__class__.__mro__ }}{% endfor %}",
    )


@pytest.mark.integration
def test_run_refuses_the_hostile_template_and_says_how_to_fall_back(hostile_model):
    r = subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", "run", str(hostile_model), "-p", "hi", "--chat", "--no-stream", "-n", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"moe-pipe: error: {hostile_model}: chat template refused: it tried to reach Python internals")
    assert FALLBACK in lines[0] and r.stdout == ""


def test_run_with_the_plain_fallback_works(hostile_model, capsys):
    from moe_pipe.cli.main import main

    args = ["run", str(hostile_model), "-p", "hi", "--chat", "--no-stream", "-n", "2", "--output-format", "json"]
    assert main(args + ["--chat-template", "plain"]) == 0
    out = json.loads(capsys.readouterr().out)
    with GGUFFile(hostile_model) as f:
        tok = Tokenizer.from_gguf(f)
    assert out["prompt_tokens"] == encode_prompt(tok, "user: hi\nassistant:") and len(out["tokens"]) == 2
    # the same through a config file
    cfg = hostile_model.parent / "plain.toml"
    cfg.write_text(f'[model]\npath = "{hostile_model.name}"\n[generate]\nchat_template = "plain"\nmax_tokens = 2\n')
    assert main(["run", str(cfg), "-p", "hi", "--chat", "--no-stream", "--output-format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == out["prompt_tokens"]
