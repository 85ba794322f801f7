"""Chat templates: each made model's framing, the thinking switch, the
fallback, and untrusted templates refused or stopped."""
from __future__ import annotations

import time

import pytest

from moe_pipe.shared.chat import plain_chat, render_chat
from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf_file import GGUFFile
from moe_pipe.shared.makemodel import make_model
from moe_pipe.shared.tokenizer import Tokenizer

ARCHS = ("qwen3moe", "gpt-oss", "gemma4")
USER = [{"role": "user", "content": "Hi <b> & \"you\""}]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Grüße, 世界"},
]
TOOL = {"type": "function", "function": {"name": "lookup", "description": "find <things>", "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "Straße & 中"}}}}}


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
    src = "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ add_generation_prompt }}|{{ strftime_now('%Y') | length }}|{{ messages | tojson }}"
    out = render_chat(src, USER)
    assert out == '||None|True|4|[{"role": "user", "content": "Hi <b> & \\"you\\""}]'
    with pytest.raises(UserError, match="rejected the conversation: roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", USER)
    assert render_chat("{% generation %}x{% endgeneration %}{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}", USER) == "x0"


# --- untrusted templates ----------------------------------------------------------

REFUSED = {
    "mro": "{{ ''.__class__.__mro__ }}",
    "globals": "{{ cycler.__init__.__globals__ }}",
    "subscript": "{{ ''['__class__'] }}",
    "mutate": "{% set x = messages.append(1) %}",
}
STOPPED = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "doubling +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "doubling ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling set block": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}",
    "repeat": "{{ 'x' * 10**10 }}",
    "list repeat": "{{ (messages * 10**9) | length }}",
    "power": "{{ 2 ** (10 ** 10) }}",
    "center filter": "{{ 'a' | center(10000000000) }}",
    "center method": "{{ 'a'.center(10000000000) }}",
    "percent width": "{{ '%099999999999d' % 1 }}",
    "format width": "{{ '{:>9999999999}'.format(1) }}",
    "join": "{{ range(10000) | map('string') | join('x' * 1000) }}",
    "replace": "{{ ('a' * 100000) | replace('a', 'b' * 1000) }}",
    "tojson indent": "{{ messages | tojson(indent=1000000000) }}",
    "shared refs printed": "{% set d = dict.fromkeys(range(100000), 'x' * 1000000) %}{{ d }}",
    "shared refs tojson": "{% set d = dict.fromkeys(range(100000), 'x' * 1000000) %}{{ d | tojson }}",
    "shared refs string": "{% set d = dict.fromkeys(range(100000), 'x' * 1000000) %}{{ d | string | length }}",
    "shared refs concat": "{% set l = ['x' * 1000000] * 100 %}{{ l ~ '' }}",
    "shared list printed": "{% set l = [['x' * 1000000]] * 100 %}{{ l }}",
    "shared refs join": "{{ range(100) | map('string') | map('center', 1000000) | join }}",
    "shared refs sum": "{{ (range(1000) | map('string') | map('list') | list | sum(start=[]) | list) ~ ('x' * 3999999) }}",
    "huge output": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_reaching_python_internals_is_refused(name):
    with pytest.raises(UserError, match="refused") as err:
        render_chat(REFUSED[name], USER)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", sorted(STOPPED))
def test_runaway_templates_are_stopped(name):
    start = time.monotonic()
    with pytest.raises(UserError, match="stopped") as err:
        render_chat(STOPPED[name], USER, time_limit_s=0.5)
    assert time.monotonic() - start < 2.0
    assert "\n" not in str(err.value)


def test_syntax_error_is_one_line():
    with pytest.raises(UserError, match="syntax error at line 2"):
        render_chat("ok\n{% for %}", USER)
