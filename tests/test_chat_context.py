"""A chat longer than the context: the server names the real cause (the
prompt, not max_tokens) and `moe-pipe chat` drops its oldest turns to go on,
against a real service whose context fills in a few turns."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from moe_pipe.shared.serve.openai_api import ApiError, fit_max_tokens, parse_request

from .servicehelp import terminate

CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")
CTX = 96  # tokens: a few turns of the tiny model's chat template and 12-token replies


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("max_tokens", [None, 8, 500])
def test_a_prompt_that_fills_the_context_is_named_as_the_cause(chat, max_tokens):
    settings = SimpleNamespace(model_name="m", ctx_size=64, max_tokens=16, temperature=0.0, top_k=0, seed=None, no_think=False)
    body = {"model": "m", "max_tokens": max_tokens} if max_tokens else {"model": "m"}
    body |= {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    req = parse_request(body, chat, settings)
    with pytest.raises(ApiError) as err:
        fit_max_tokens(req, 70, settings)
    e = err.value
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "messages" if chat else "prompt")
    assert f"{'conversation' if chat else 'prompt'} is 70 tokens and the context holds 64" in e.message
    assert "max_tokens" not in e.message and "at most" not in e.message


def test_an_explicit_max_tokens_over_the_room_left_names_both():
    settings = SimpleNamespace(model_name="m", ctx_size=64, max_tokens=16, temperature=0.0, top_k=0, seed=None, no_think=False)
    req = parse_request({"model": "m", "prompt": "x", "max_tokens": 20}, False, settings)
    with pytest.raises(ApiError) as err:
        fit_max_tokens(req, 50, settings)
    assert err.value.param == "max_tokens" and "at most 14 tokens" in err.value.message
    assert fit_max_tokens(req, 44, settings) == 20


@pytest.mark.slow  # ~20-50 s: kept out of the default tier's 10 minutes
@pytest.mark.integration
def test_a_long_chat_drops_its_oldest_turns_and_goes_on():
    base = Path(tempfile.mkdtemp(prefix="mpc", dir="/tmp"))  # short: unix socket paths <= 107 bytes
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base)}
    pid = None
    try:
        up = subprocess.run(
            [*CLI, "up", TINY, "--detach", "--port", "0", "--set", f"compute.ctx_size={CTX}", "--set", "supervisor.start_secs=0.5"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert up.returncode == 0, up.stderr
        st = json.loads(subprocess.run([*CLI, "status", "--json"], capture_output=True, text=True, env=env, timeout=60, check=True).stdout)
        pid, url = st["pid"], st["url"]
        lines = [f"tell me about the river number {i}" for i in range(12)]
        chat = subprocess.run(
            [*CLI, "chat", "--url", url, "-n", "12", "--system", "be brief"],
            input="\n".join(lines) + "\n",
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert chat.returncode == 0, chat.stderr
        assert "server error" not in chat.stderr, chat.stderr  # every message answered
        assert chat.stderr.count("dropping the oldest turns") == 1, chat.stderr  # the context did fill, and it was said once
        assert "/reset" in chat.stderr
        assert len(chat.stdout.splitlines()) == len(lines), chat.stdout  # one reply line per message
    finally:
        if pid is not None and psutil.pid_exists(pid):
            subprocess.run([*CLI, "down"], env=env, capture_output=True, timeout=120)
            terminate(pid)  # `down` could not stop it: SIGTERM releases its memory too
        shutil.rmtree(base, ignore_errors=True)
