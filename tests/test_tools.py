"""Tool calls (shared/text/tools.py, shared/serve/openai_api.py): for each
architecture, a conversation with tool calls rendered through its real chat
template and the assistant's part parsed back, whole and streamed in pieces;
tool results (`role: "tool"`) rendered; `tools` and `tool_choice` checked."""

from __future__ import annotations

import json

import pytest

from moe_pipe.shared.makemodel.maker import chat_template
from moe_pipe.shared.serve.openai_api import ApiError, ChatOutput, parse_request
from moe_pipe.shared.text.chat import render_chat
from moe_pipe.shared.text.reasoning import GEMMA4, HARMONY, THINK, OutputSplitter
from moe_pipe.shared.text.tools import parse_call

ARCHS = ("qwen3moe", "gpt-oss", "gemma4")
FRAMING = {"qwen3moe": THINK, "gpt-oss": HARMONY, "gemma4": GEMMA4}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich, \\"CH\\"", "days": 3}'}},
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
USER = {"role": "user", "content": "Weather in Zürich, and the time?"}


class Settings:
    model_name, ctx_size, max_tokens, temperature, top_k, seed = "tiny", 4096, 64, 0.0, 0, None


def request(**body):
    return parse_request({"model": "tiny", "messages": [USER], **body}, True, Settings())


def rendered(arch: str, messages, **kwargs) -> str:
    return render_chat(chat_template(arch), messages, bos_token="<bos>", **kwargs)


def assistant_part(arch: str, calls: list[dict], content: str = "") -> tuple[str, str]:
    """(prompt tail, what the model writes): the template's rendering of an
    assistant message with `calls`, less the generation prompt before it and
    the end-of-generation token after it (never in the generated text)."""
    req = request(messages=[USER, {"role": "assistant", "content": content, "tool_calls": calls}], tools=[WEATHER, TIME])
    msgs, tools = list(req.messages), list(req.tools)
    full = rendered(arch, msgs, add_generation_prompt=False, tools=tools)
    if arch == "gemma4":  # its generation prompt pre-closes an empty thought channel, which a rendered turn does not have
        prompt = rendered(arch, msgs[:1], tools=tools)
        body = full[full.rindex("<|turn>model\n") + len("<|turn>model\n") :].removesuffix("<turn|>\n")
        return prompt, body
    prompt = rendered(arch, msgs[:1], tools=tools)
    assert full.startswith(prompt)
    body = full[len(prompt) :]
    return prompt, body.removesuffix("<|im_end|>\n").removesuffix("<|call|>")


def calls_of(output: ChatOutput) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in output.calls]


EXPECTED = [("get_weather", {"city": 'Zürich, "CH"', "days": 3}), ("get_time", {})]


@pytest.mark.parametrize("arch", ARCHS)
def test_calls_the_template_renders_parse_back(arch):
    tail, text = assistant_part(arch, CALLS)
    out = ChatOutput(FRAMING[arch], tail, tools=True)
    deltas = out.feed(text) + out.finish()
    assert calls_of(out) == EXPECTED
    assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0, 1]
    assert all(d["tool_calls"][0]["id"].startswith("call_") for d in deltas if "tool_calls" in d)
    msg = out.message()
    assert msg["content"] is None and [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_a_call_split_across_streamed_pieces_parses_the_same(arch):
    tail, text = assistant_part(arch, CALLS[:1])
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text[cut:]], [text[:cut], text[cut : cut + 3], text[cut + 3 :]]):
            out = ChatOutput(FRAMING[arch], tail, tools=True)
            for piece in pieces:
                out.feed(piece)
            out.finish()
            assert calls_of(out) == EXPECTED[:1], (cut, pieces)
            assert "".join(out.content).strip() == "", (cut, out.content)


def test_gemma4_native_argument_syntax():
    """The real Gemma 4 template writes strings between <|"|> tokens and keys bare."""
    text = 'call:get_weather{city:<|"|>Zürich, "CH"<|"|>,days:3,opts:{units:<|"|>metric<|"|>,alerts:false},hours:[6, 12]}'
    call = parse_call(GEMMA4, text)
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": 'Zürich, "CH"', "days": 3, "opts": {"units": "metric", "alerts": False}, "hours": [6, 12]}
    for bad in ('call:f{a:<|"|>open}', "call:f{a:1} trailing", "call:{a:1}", "f{a:1}", "call:f{a 1}"):
        assert parse_call(GEMMA4, bad) is None, bad


def test_qwen_xml_function_form():
    """Qwen3-Coder's and Qwen3.5's calls: <function=NAME> with one <parameter=KEY> per argument."""
    text = "\n<function=get_weather>\n<parameter=city>\nZürich, CH\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
    call = parse_call(THINK, text)
    assert call is not None and (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Zürich, CH", "days": 3})
    out = ChatOutput(THINK, rendered("qwen3moe", [USER]), tools=True)
    for ch in f"<tool_call>{text}</tool_call>":
        out.feed(ch)
    out.finish()
    assert calls_of(out) == [("get_weather", {"city": "Zürich, CH", "days": 3})]
    assert parse_call(THINK, "<function=f>stray<parameter=a>1</parameter></function>") is None


def test_harmony_recipient_before_or_after_the_channel():
    for header in (
        "assistant<|channel|>commentary to=functions.get_time <|constrain|>json",
        "assistant to=functions.get_time<|channel|>commentary json",
    ):
        call = parse_call(HARMONY, header + '<|message|>{"tz": "UTC"}')
        assert call is not None and (call.name, json.loads(call.arguments)) == ("get_time", {"tz": "UTC"})
    assert parse_call(HARMONY, "assistant<|channel|>final<|message|>{}") is None


def test_a_call_that_does_not_parse_is_shown_as_written():
    tail = rendered("qwen3moe", [USER])
    out = ChatOutput(THINK, tail, tools=True)
    text = "Here: <tool_call>\n{not json}\n</tool_call>"
    out.feed(text)
    out.finish()
    assert out.calls == [] and out.message() == {"role": "assistant", "content": "Here:<tool_call>\n{not json}\n</tool_call>"}
    assert out.finish_reason("stop") == "stop"


@pytest.mark.parametrize("arch", ARCHS)
def test_tool_results_are_accepted_and_rendered(arch):
    result = '{"temp_c": 21}'
    msgs = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
    req = request(messages=msgs, tools=[WEATHER])
    assert req.messages[2]["name"] == "get_weather"  # from the call it answers
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": 'Zürich, "CH"', "days": 3}
    text = rendered(arch, list(req.messages), tools=list(req.tools))
    framed = {
        "qwen3moe": f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>",
        "gpt-oss": f"<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{result}<|end|>",
        "gemma4": f"<|turn>tool\n<|tool_response>{result}<tool_response|><turn|>",
    }[arch]
    assert framed in text
    assert "get_weather" in text.split(framed)[0]  # the call it answers comes before it


def test_tools_and_tool_choice_reach_the_template():
    assert request().tools == ()
    assert [t["function"]["name"] for t in request(tools=[WEATHER, TIME]).tools] == ["get_weather", "get_time"]
    assert request(tools=[WEATHER, TIME], tool_choice="none").tools == ()  # "none": not shown, not parsed
    assert [t["function"]["name"] for t in request(tools=[WEATHER, TIME], tool_choice="required").tools] == ["get_weather", "get_time"]
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [t["function"]["name"] for t in named.tools] == ["get_time"]
    assert request(tool_choice="none").tools == () and request(tool_choice="auto").tools == ()
    # what the template gets: OpenAI's shape, without fields it does not read
    strict = {"type": "function", "function": {**TIME["function"], "strict": True}}
    assert request(tools=[strict]).tools == (TIME,)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER] * 129}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": {"id": "x"}}]}, "messages[1].tool_calls"),
        (
            {"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tools_and_tool_messages_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        parse_request({"model": "tiny", "messages": [USER], **body}, True, Settings())
    assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_value", param), err.value.message


def test_without_tools_tool_markup_stays_in_the_answer():
    tail = rendered("qwen3moe", [USER])
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    out = ChatOutput(THINK, tail, tools=False)
    out.feed(text)
    out.finish()
    assert out.calls == [] and out.message()["content"] == text
    assert OutputSplitter(THINK, tail, tools=True).split_all(text)[0][0] == "tool"
