"""response_format: JSON enforced while sampling (shared/text/constrain.py).

Replies always validate (100 sampled generations on the tiny model), special
tokens are never allowed inside the JSON, a reply cut by max_tokens is
"length" and unfinished, bad formats are refused with the library's message,
and the official openai client's `parse` helper works against `moe-pipe up`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.serve.openai_api import ApiError, parse_request
from moe_pipe.shared.text.constrain import GrammarError, TokenAdapter, compile_schema, constraint_for, grammar_for
from moe_pipe.shared.text.generate import GenerationConfig, generate
from moe_pipe.shared.text.sampling import Sampler, SamplingParams
from moe_pipe.shared.text.tokenizer import Tokenizer

from .servicehelp import terminate

CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")
# A reply to Pick is at most ~45 characters of fixed text plus 12 label
# characters (each at most a 6-character \u escape): under 120 tokens even
# one character a token, so 160 always lets the grammar finish.
ENOUGH = 160


class Pick(BaseModel):
    """A schema of bounded length: an enum, a small integer, a short string."""

    model_config = ConfigDict(extra="forbid")
    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    label: str = Field(pattern=r"^[a-z ]{1,12}$")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from moe_pipe.shared import quant

    # One kernel thread: the tiny model's matrices are too small to share,
    # and on a busy machine two threads waiting on each other cost 10x.
    before = quant.get_threads()
    quant.set_threads(1)
    try:
        with open_model(tiny_model) as mf:
            yield Tokenizer.from_gguf(mf.gguf), load_model(mf)
    finally:
        quant.set_threads(before)


def _generate(tiny, grammar: str, seed: int, max_tokens: int = ENOUGH, temperature: float = 1.0):
    tok, model = tiny
    prompt = tok.encode("Pick a colour and answer in JSON:")
    params = SamplingParams(temperature=temperature, seed=seed)
    return generate(model, tok, prompt, params, GenerationConfig(max_tokens=max_tokens, n_ctx=512), constraint=constraint_for(tok, grammar))


def test_json_schema_replies_always_validate(tiny):
    grammar = compile_schema(Pick.model_json_schema())
    texts = set()
    for seed in range(100):
        out = _generate(tiny, grammar, seed)
        assert out.finish_reason == "eog", (seed, out.text)
        Pick.model_validate_json(out.text, strict=True)  # raises on anything the schema does not allow
        texts.add(out.text)
    assert len(texts) > 50  # sampled at temperature 1: the replies differ, the format does not


def test_json_object_replies_parse_and_a_cut_reply_is_length(tiny):
    grammar = grammar_for({"type": "json_object"})
    ended = 0
    for seed in range(12):
        out = _generate(tiny, grammar, seed, max_tokens=64)
        if out.finish_reason == "eog":
            assert isinstance(json.loads(out.text), dict), out.text
            ended += 1
        else:  # cut short: honest about it, the text is an unfinished object
            assert out.finish_reason == "length" and len(out.tokens) == 64 and out.text.startswith("{")
            with pytest.raises(json.JSONDecodeError):
                json.loads(out.text)
    assert ended >= 1
    out = _generate(tiny, compile_schema(Pick.model_json_schema()), 0, max_tokens=5)
    assert out.finish_reason == "length" and len(out.tokens) == 5
    with pytest.raises(ValidationError):
        Pick.model_validate_json(out.text)


def test_special_tokens_are_never_allowed_and_end_only_when_complete(tiny):
    tok, _ = tiny
    special = [i for i in range(tok.n_vocab) if tok.is_special(i) or tok.token_type(i) not in (1, 6)]
    assert len(special) > 20 and set(tok.eog_ids) <= set(special)
    grammar = compile_schema(Pick.model_json_schema())
    rng = np.random.default_rng(0)
    for _ in range(5):
        c = constraint_for(tok, grammar)
        for _step in range(ENOUGH):
            allowed = ~c.disallowed()
            assert not allowed[[i for i in special if i not in tok.eog_ids]].any()
            eog_ok = bool(allowed[sorted(tok.eog_ids)].any())
            assert eog_ok == c.complete
            choices = np.flatnonzero(allowed)
            token = int(rng.choice(choices))
            c.accept(token)
            if token in tok.eog_ids:
                break
            if c.matcher.is_stopped():  # complete and nothing may follow: end-of-generation alone
                assert set(np.flatnonzero(~c.disallowed()).tolist()) == set(tok.eog_ids)
        else:
            raise AssertionError("the grammar never finished")


class _OnlyThreeAndFive:
    def __init__(self):
        self.told: list[int] = []

    def mask(self, z):
        keep = z[[3, 5]].copy()
        z[:] = -np.inf
        z[[3, 5]] = keep

    def accept(self, token):
        self.told.append(token)


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=1.5, top_k=4, seed=1), SamplingParams(temperature=1, top_p=0.5)]
)
def test_the_sampler_draws_only_what_the_constraint_allows_and_tells_it(params):
    c = _OnlyThreeAndFive()
    sampler = Sampler(params, c)
    logits = np.arange(16, dtype=np.float32)  # 15 is the favourite, but not allowed
    drawn = [sampler(logits, [5, 5, 5]) for _ in range(50)]
    assert set(drawn) <= {3, 5} and c.told == drawn
    if params.greedy:
        assert set(drawn) == {5}


SETTINGS = SimpleNamespace(model_name="m", ctx_size=64, max_tokens=16, temperature=0.0, top_k=0, seed=None, no_think=False)


def _refusal(response_format, **extra) -> ApiError:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": response_format, **extra}
    with pytest.raises(ApiError) as err:
        parse_request(body, True, SETTINGS)
    assert err.value.status == 400 and err.value.code == "invalid_value"
    return err.value


def test_bad_response_formats_are_400_with_a_clear_message():
    e = _refusal({"type": "xml"})
    assert e.param == "response_format.type" and '"json_object"' in e.message and '"xml"' in e.message
    e = _refusal("json")
    assert e.param == "response_format" and "must be an object" in e.message
    e = _refusal({"type": "json_schema"})
    assert e.param == "response_format.json_schema"
    e = _refusal({"type": "json_schema", "json_schema": {"name": "x", "schema": ["not", "an", "object"]}})
    assert e.param == "response_format.json_schema.schema" and "JSON Schema object" in e.message
    e = _refusal({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert "not supported" in e.message and "strin" in e.message  # the library's own words
    e = _refusal({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}})
    assert "gone" in e.message
    e = _refusal({"type": "json_object"}, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert "tools" in e.message


def test_a_good_response_format_becomes_a_grammar_and_turns_thinking_off():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse_request(body, True, SETTINGS).grammar == ""
    assert parse_request(body | {"response_format": {"type": "text"}}, True, SETTINGS).grammar == ""
    schema = {"type": "json_schema", "json_schema": {"name": "Pick", "schema": Pick.model_json_schema(), "strict": True}}
    req = parse_request(body | {"response_format": schema}, True, SETTINGS)
    assert json.loads(req.grammar)["grammars"] and req.template_vars["enable_thinking"] is False
    kept = parse_request(body | {"response_format": schema, "chat_template_kwargs": {"enable_thinking": True}}, True, SETTINGS)
    assert kept.template_vars["enable_thinking"] is True  # the request's own choice wins
    with pytest.raises(GrammarError, match="too large"):
        compile_schema({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(4000)}})


def test_the_adapter_marks_every_non_text_token_special(tiny):
    tok, _ = tiny
    adapter = TokenAdapter(tok)
    assert adapter.ll.vocab_size == tok.n_vocab and sorted(adapter.ll.eos_tokens) == sorted(tok.eog_ids)
    think = tok.encode("<think>", add_bos=False)
    assert len(think) == 1 and adapter.ll.is_special_token(think[0])  # user-defined: not text to a grammar
    assert not adapter.ll.is_special_token(tok.encode("{", add_bos=False)[0])


@pytest.mark.integration
def test_openai_parse_helper_against_a_running_service():
    openai = pytest.importorskip("openai")
    base = Path(tempfile.mkdtemp(prefix="mpj", dir="/tmp"))  # short: unix socket paths <= 107 bytes
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base)}
    pid = None
    try:
        up = subprocess.run(
            [*CLI, "up", TINY, "--detach", "--port", "0", "--set", "supervisor.start_secs=0.5"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert up.returncode == 0, up.stderr
        st = json.loads(subprocess.run([*CLI, "status", "--json"], capture_output=True, text=True, env=env, timeout=60, check=True).stdout)
        pid = st["pid"]
        client = openai.OpenAI(base_url=st["url"] + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Pick a colour."}]
        for seed in (1, 2):
            done = client.chat.completions.parse(
                model="moe-pipe-tiny", messages=messages, response_format=Pick, max_tokens=ENOUGH, temperature=1.0, seed=seed
            )
            choice = done.choices[0]
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pick), choice.message.content
        stream = client.chat.completions.create(
            model="moe-pipe-tiny", messages=messages, response_format={"type": "json_object"}, max_tokens=ENOUGH, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text.startswith("{")
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="moe-pipe-tiny",
                messages=messages,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            )
        assert err.value.status_code == 400 and "strin" in str(err.value)
    finally:
        terminate(pid)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.integration
def test_llguidance_loads_only_where_a_grammar_is_used():
    code = (
        "import sys; import moe_pipe.procs.gateway, moe_pipe.procs.compute, moe_pipe.cli.main; "
        "from moe_pipe.shared.serve.openai_api import parse_request; "
        "assert 'llguidance' not in sys.modules, 'imported at start-up'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
