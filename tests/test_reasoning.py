"""The reply splitter (shared/text/reasoning.py): reasoning, answer and tool
calls cut out of each architecture's real framing, the same however the text
is cut into streamed pieces, starting where the real templates' generation
prompts leave off; and the facts it relies on: the decoder renders control
tokens as their text, and gpt-oss's <|call|> ends generation."""

from __future__ import annotations

import pytest

from moe_pipe.shared.makemodel.maker import chat_template, make_model
from moe_pipe.shared.text.chat import render_chat
from moe_pipe.shared.text.reasoning import (
    CONTENT,
    GEMMA4,
    HARMONY,
    MAX_HEADER_CHARS,
    NONE,
    REASONING,
    THINK,
    TOOL,
    OutputSplitter,
    framing_for,
    next_marker,
)
from moe_pipe.shared.text.tokenizer import Tokenizer

ARCHS = ("qwen3moe", "gpt-oss", "gemma4")
FRAMING = {"qwen3moe": THINK, "gpt-oss": HARMONY, "gemma4": GEMMA4}
USER = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from moe_pipe.shared.gguf.reader import GGUFFile

    root = tmp_path_factory.mktemp("reasoning")
    return {arch: Tokenizer.from_gguf(GGUFFile(make_model(arch, "tiny", root / f"{arch}.gguf"))) for arch in ARCHS}


def prompt_tail(arch: str, **kwargs) -> str:
    return render_chat(chat_template(arch), USER, bos_token="<bos>", **kwargs)[-200:]


# What each architecture writes after its generation prompt, and what it means.
CASES = {
    "qwen3moe": (
        "<think>\nThe user adds. 2 and 2 make 4.\n</think>\n\nIt is 4.",
        [(REASONING, "The user adds. 2 and 2 make 4."), (CONTENT, "It is 4.")],
    ),
    "gpt-oss": (
        "<|channel|>analysis<|message|>Simple sum: 4.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
        [(REASONING, "Simple sum: 4."), (CONTENT, "It is 4.")],
    ),
    "gemma4": (
        "<|channel>thought\nSimple sum: 4.<channel|>It is 4.",
        [(REASONING, "Simple sum: 4."), (CONTENT, "It is 4.")],
    ),
}


def merged(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, text in pieces:
        if out and out[-1][0] == kind and kind != TOOL:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def split_in(framing, tail: str, pieces: list[str], tools: bool = False) -> list[tuple[str, str]]:
    s = OutputSplitter(framing, tail, tools)
    out = [p for piece in pieces for p in s.feed(piece)]
    return merged(out + s.finish())


def every_cut(framing, tail: str, text: str, tools: bool = False) -> list[tuple[str, str]]:
    """The split of `text`, checked equal whether it comes whole, one character
    at a time, or in two pieces cut at every possible place."""
    whole = split_in(framing, tail, [text], tools)
    assert split_in(framing, tail, list(text), tools) == whole
    for i in range(1, len(text)):
        assert split_in(framing, tail, [text[:i], text[i:]], tools) == whole, i
    return whole


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_splits_the_same_at_every_cut(arch):
    text, expected = CASES[arch]
    thinking = {"enable_thinking": True} if arch == "gemma4" else {}  # gemma's template pre-closes the channel otherwise
    assert every_cut(FRAMING[arch], prompt_tail(arch, **thinking), text) == expected


def test_the_start_state_comes_from_the_prompt_tail():
    # Qwen3 with thinking off: the template closed an empty think block, so a
    # later <think> is answer text; a template that pre-opens the block (the
    # 2507 thinking models) starts the output inside it.
    off = prompt_tail("qwen3moe", enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert every_cut(THINK, off, "It is <think> 4.") == [(CONTENT, "It is <think> 4.")]
    opened = prompt_tail("qwen3moe") + "<think>\n"
    assert every_cut(THINK, opened, "Adding.\n</think>\n\nIt is 4.") == [(REASONING, "Adding."), (CONTENT, "It is 4.")]
    # Gemma 4 with thinking off: the template writes an empty thought channel
    off = prompt_tail("gemma4")
    assert off.endswith("<|channel>thought\n<channel|>")
    assert every_cut(GEMMA4, off, "It is 4.") == [(CONTENT, "It is 4.")]
    # gpt-oss: the prompt opened the header with <|start|>assistant
    assert prompt_tail("gpt-oss").endswith("<|start|>assistant")
    pre = "<|start|>assistant<|channel|>analysis<|message|>"  # a template that opens the analysis message itself
    assert every_cut(HARMONY, pre, "Sum.<|end|><|start|>assistant<|channel|>final<|message|>4") == [(REASONING, "Sum."), (CONTENT, "4")]


def test_reasoning_only_opens_at_the_start_of_the_answer():
    assert split_in(THINK, prompt_tail("qwen3moe"), ["Four. <think>x</think>"]) == [(CONTENT, "Four. <think>x</think>")]
    # cut off while thinking (max_tokens): what there is, is reasoning
    assert split_in(THINK, prompt_tail("qwen3moe"), ["<think>\nstill thin", "king"]) == [(REASONING, "still thinking")]


def test_text_that_is_not_harmony_is_the_answer():
    tail = prompt_tail("gpt-oss")
    assert every_cut(HARMONY, tail, "random words <|message|") == [(CONTENT, "random words <|message|")]
    long = "x" * (MAX_HEADER_CHARS + 10)
    s = OutputSplitter(HARMONY, tail)
    assert merged(s.feed(long)) == [(CONTENT, long)]  # not held to the end: a header this long is not one
    # commentary without a recipient (a preamble to the user) is answer text
    text = "<|channel|>commentary<|message|>Let me look.<|end|>"
    assert every_cut(HARMONY, tail, text) == [(CONTENT, "Let me look.")]
    assert every_cut(NONE, "", "<think>a</think>b") == [(CONTENT, "<think>a</think>b")]


def test_tool_markup_is_cut_out_only_when_tools_were_given():
    tail = prompt_tail("qwen3moe", enable_thinking=False)
    text = 'Looking it up.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert every_cut(THINK, tail, text, tools=True) == [(CONTENT, "Looking it up."), (TOOL, '\n{"name": "f", "arguments": {"a": 1}}\n')]
    assert every_cut(THINK, tail, text) == [(CONTENT, text)]
    # an unclosed call (cut off by max_tokens) is answer text, as written
    assert split_in(THINK, tail, ["<tool_call>\n{"], tools=True) == [(CONTENT, "<tool_call>\n{")]


def test_next_marker_holds_only_what_may_become_a_marker():
    assert next_marker("ab<thi", ("<think>",), final=False) == (2, None)
    assert next_marker("ab<x", ("<think>",), final=False) == (4, None)
    assert next_marker("ab<thi", ("<think>",), final=True) == (6, None)
    assert next_marker("a<|channel>tho", ("<|channel>thought", "<|channel>"), final=False) == (1, None)  # the longer may still come
    assert next_marker("a<|channel>x", ("<|channel>thought", "<|channel>"), final=False) == (1, "<|channel>")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_framing_is_found_from_the_vocabulary(toks, arch):
    assert framing_for(toks[arch]) is FRAMING[arch]
    assert framing_for(object()) is NONE


@pytest.mark.parametrize("arch", ARCHS)
def test_the_stream_decoder_renders_control_tokens_as_text(toks, arch):
    """The splitter reads the framing from compute's Token text, which is
    StreamDecoder output: the control tokens must be in it."""
    tok = toks[arch]
    text, _ = CASES[arch]
    ids = tok.encode(text, add_bos=False, special=True)
    marker = {"qwen3moe": "<think>", "gpt-oss": "<|channel|>", "gemma4": "<|channel>"}[arch]
    assert tok.encode(marker, add_bos=False, special=True)[0] in ids  # one control (or user-defined) token
    stream = tok.stream()
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == text


def test_harmony_call_ends_generation_and_end_does_not(toks):
    tok = toks["gpt-oss"]
    call, end, ret = (tok.encode(t, add_bos=False, special=True) for t in ("<|call|>", "<|end|>", "<|return|>"))
    assert len(call) == len(end) == 1
    assert call[0] in tok.eog_ids and ret[0] in tok.eog_ids and end[0] not in tok.eog_ids
