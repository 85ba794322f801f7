"""Generation: stop strings, end-of-generation, limits, streaming equals the final text; and `moe-pipe run`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moe_pipe.cli.main import main
from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.text.generate import GenerationConfig, _StopScanner, generate
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.tokenizer import Tokenizer


class ScriptedCache:
    """What a session asks of a cache, with nothing stored: positions only."""

    def __init__(self, n_ctx):
        self.n, self.n_ctx, self.kv_type, self.state = 0, n_ctx, "f32", None

    def can_truncate(self, n):
        return True

    def truncate(self, n):
        self.n = max(0, min(self.n, n))


class ScriptedModel:
    """Emits a fixed token sequence: logits put all mass on the next scripted id."""

    def __init__(self, script, n_vocab):
        self.script, self.n_vocab, self.i = list(script), n_vocab, 0

    def new_cache(self, n_ctx):
        return ScriptedCache(n_ctx)

    def _logits(self):
        z = np.zeros(self.n_vocab, np.float32)
        z[self.script[min(self.i, len(self.script) - 1)]] = 10.0
        self.i += 1
        return z

    def prefill(self, tokens, cache, batch=64):
        cache.n += len(tokens)
        return self._logits()

    def decode_one(self, token, cache):
        cache.n += 1
        return self._logits()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model("qwen3moe", "tiny", tmp_path_factory.mktemp("g") / "tiny.gguf")


@pytest.fixture(scope="module")
def tok(tiny_path):
    with open_model(tiny_path) as mf:
        return Tokenizer.from_gguf(mf.gguf)


def test_stop_string_cuts_text_and_is_never_streamed(tok):
    ids = tok.encode("alpha beta STOP gamma", add_bos=False, special=False)
    model = ScriptedModel(ids, tok.n_vocab)
    pieces = []
    out = generate(model, tok, [1, 2], SamplingParams(), GenerationConfig(max_tokens=50, stop=("STOP",)), on_text=pieces.append)
    assert out.finish_reason == "stop"
    assert out.text == "alpha beta " and "".join(pieces) == out.text


def test_eog_token_ends_generation_and_is_not_in_text(tok):
    eog = min(tok.eog_ids)
    ids = tok.encode("one two", add_bos=False, special=False) + [eog, 5, 6]
    out = generate(ScriptedModel(ids, tok.n_vocab), tok, [1], SamplingParams(), GenerationConfig(max_tokens=50))
    assert out.finish_reason == "eog" and out.text == "one two" and eog not in out.tokens


def test_max_tokens_and_context_limits(tok):
    model = ScriptedModel([7] * 100, tok.n_vocab)
    out = generate(model, tok, [1, 2, 3], SamplingParams(), GenerationConfig(max_tokens=5))
    assert out.finish_reason == "length" and len(out.tokens) == 5
    out = generate(ScriptedModel([7] * 100, tok.n_vocab), tok, [1, 2, 3], SamplingParams(), GenerationConfig(max_tokens=50, n_ctx=8))
    # 3 prompt + 5 fed tokens fill the 8 positions; the 6th is sampled from the last logits, never fed.
    assert out.finish_reason == "context" and len(out.tokens) == 6
    with pytest.raises(UserError, match="context holds"):
        generate(model, tok, list(range(10)), SamplingParams(), GenerationConfig(n_ctx=8))


def test_stop_scanner_holds_back_possible_prefix():
    s = _StopScanner(("</s>",))
    assert s.safe_end("abc</") == 2 and s.find("abc</s>x", 0) == 3


def test_streamed_text_equals_result_on_a_real_model(tiny_path, tok):
    with open_model(tiny_path) as mf:
        model = load_model(mf)
        pieces = []
        out = generate(model, tok, tok.encode("The river"), SamplingParams(), GenerationConfig(max_tokens=20), on_text=pieces.append)
        again = generate(model, tok, tok.encode("The river"), SamplingParams(), GenerationConfig(max_tokens=20))
    assert "".join(pieces) == out.text == tok.decode(out.tokens)
    assert again.tokens == out.tokens  # greedy is deterministic


@pytest.mark.integration
def test_run_json(tiny_path, capsys):
    assert main(["run", str(tiny_path), "-p", "Hello there", "-n", "6", "--output-format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"prompt_tokens", "tokens", "text", "timings"}
    assert len(out["tokens"]) == 6 and out["prompt_tokens"]
    assert out["timings"]["predicted_n"] == 6


@pytest.mark.integration
def test_run_chat_seeded_sampling_is_reproducible(tiny_path, capsys):
    args = ["run", str(tiny_path), "-p", "Hi", "--chat", "--no-think", "-n", "8", "--temp", "0.9", "--seed", "5", "--output-format", "json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == first["tokens"]
    assert first["prompt_tokens"][-1] != first["prompt_tokens"][0]


@pytest.mark.integration
def test_run_text_streams_and_reports(tiny_path):
    r = subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", "run", str(tiny_path), "-p", "Once", "-n", "5"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "generated" in r.stderr and r.stdout.endswith("\n")
    # one cache size, and the budget named as such: the tiny model's experts all fit, in less than it
    [line] = [x for x in r.stderr.splitlines() if x.startswith("[expert cache ")]
    assert "(every expert of the model, under the budget " in line and "; cache " not in line, line


@pytest.mark.integration
@pytest.mark.parametrize(
    "extra,needle", [(["--temp", "-1"], "temperature"), (["--n-expert-used", "99"], "n-expert-used"), (["-t", "999"], "threads")]
)
def test_run_bad_values_exit_2(tiny_path, extra, needle):
    r = subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", "run", str(tiny_path), "-p", "x", *extra], capture_output=True, text=True
    )
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.integration
def test_run_refuses_a_100k_token_prompt_in_one_line(tiny_path, tmp_path):
    """A prompt past the context: the same one-line context error, exit 2, before compute
    sees it (its ids once hung the run at the wire's 65,536-item array cap)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("x" * 100_000)
    r = subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", "run", str(tiny_path), "-f", str(prompt), "-n", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("moe-pipe: ") or "error" in line.lower()]
    assert any("tokens but the context holds 4,096; shorten it or raise the context size (-c)" in line for line in lines), r.stderr
    assert "Traceback" not in r.stderr and "frame" not in r.stderr
