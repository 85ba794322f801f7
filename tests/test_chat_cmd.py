"""`moe-pipe chat`: a real CLI process against a fake OpenAI-compatible server.

The fake streams its replies as the gateway does (SSE over chunked HTTP/1.1)
and records every request, so the tests can read the history that was sent.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_pipe.cli.chat_cmd import DIM, ERASE_LINE, PLAIN, Chat, base_url, error_message, sse_content, sse_deltas

TIMEOUT_S = 15
MODEL_ID = "fake-moe"


class FakeOpenAI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked streaming, like the real gateway

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.seen.append(("GET", self.path, dict(self.headers), None))
        if self.path != "/v1/models":
            return self._json(404, {"error": {"message": f"no route {self.path}"}})
        self._json(200, {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(("POST", self.path, dict(self.headers), body))
        last = body["messages"][-1]["content"]
        if last == "bad":
            return self._json(400, {"error": {"message": "prompt rejected:\nbad word", "type": "invalid_request_error"}})
        n = sum(1 for m in body["messages"] if m["role"] == "user")
        if last == "slow":  # a reply that never ends: for Ctrl-C
            return self._stream(["partial "] + ["more "] * 1000, delay_s=0.05)
        if last == "think":  # a model that reasons first (delta.reasoning_content)
            return self._stream(["The ", "answer."], reasoning=["Pon", "dering."])
        if last == "long" and body.get("return_progress"):  # a long prompt: its progress first, as llama.cpp's server sends it
            return self._stream(["Done."], progress=[(0, 0), (1536, 29_700), (3664, 88_000)])
        self._stream(["Reply ", f"{n} ", "to ", last])

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(
        self, pieces: list[str], delay_s: float = 0.0, reasoning: list[str] | None = None, progress: list[tuple[int, int]] = ()
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
        events += [
            {
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}],
                "prompt_progress": {"total": 3664, "cache": 0, "processed": n, "time_ms": ms},
            }
            for n, ms in progress
        ]
        events += [{"choices": [{"index": 0, "delta": {"reasoning_content": p}}]} for p in reasoning or []]
        events += [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
        events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        try:
            self._chunk(b": keep-alive\n\n")
            for e in events:
                self._chunk(f"data: {json.dumps(e)}\n\n".encode())
                time.sleep(delay_s)
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.server.disconnects += 1

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    srv.daemon_threads = True
    srv.seen, srv.disconnects = [], 0
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def chat(args: list[str], stdin: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", "chat", *args], input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )


def posts(srv) -> list[dict]:
    return [body for method, _, _, body in srv.seen if method == "POST"]


# ------------------------------------------------------------------ pure parts


def test_sse_content_reads_deltas_until_done():
    lines = [
        b": keep-alive\n",
        b"\n",
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n',
        b"\n",
        b'data: {"choices":[{"delta":{"content":"Hel"}}]}\r\n',
        b'data:{"choices":[{"delta":{"content":"lo"}}]}\n',
        b"event: ping\n",
        b"data: [DONE]\n",
        b'data: {"choices":[{"delta":{"content":"after"}}]}\n',
    ]
    assert list(sse_content(lines)) == ["Hel", "lo"]


def test_sse_deltas_tell_reasoning_from_answer():
    lines = [
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n',
        b'data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}\n',
        b'data: {"choices":[{"delta":{"content":"Hi","tool_calls":null}}]}\n',
        b"data: [DONE]\n",
    ]
    assert list(sse_deltas(lines)) == [("reasoning", "hmm"), ("content", "Hi")]
    assert list(sse_content(lines)) == ["Hi"]


class Terminal(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def say_think(server, tty: bool, *flags: str) -> tuple[str, list[dict]]:
    import argparse

    from moe_pipe.cli.chat_cmd import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    chat = Chat(server.url, MODEL_ID, p.parse_args(["--url", server.url, *flags]))
    out = Terminal(tty)
    chat.say("think", out)
    return out.getvalue(), chat.history


def test_reasoning_is_dimmed_on_a_terminal_and_left_out_otherwise(server):
    shown, history = say_think(server, True)
    assert shown == DIM + "Pondering." + PLAIN + "\n" + "The answer." + "\n"
    assert history[-1] == {"role": "assistant", "content": "The answer."}  # reasoning is never sent back
    for tty, flags in ((False, ()), (True, ("--hide-reasoning",)), (True, ("--no-think",))):
        shown, history = say_think(server, tty, *flags)
        assert shown == "The answer.\n", (tty, flags)
        assert history[-1] == {"role": "assistant", "content": "The answer."}


def test_sse_deltas_read_a_prompt_s_progress_as_one_line():
    lines = [
        b'data: {"choices":[{"delta":{"role":"assistant","content":null}}],'
        b'"prompt_progress":{"total":3664,"cache":0,"processed":1536,"time_ms":29700}}\n',
        b'data: {"choices":[],"prompt_progress":{"total":"3664"}}\n',  # not llama.cpp's shape: no line
        b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n',
    ]
    assert list(sse_deltas(lines)) == [("progress", "prompt 1,536 / 3,664 tokens · 41 s left"), ("content", "Hi")]
    assert list(sse_content(lines)) == ["Hi"]


def _say(server, message: str, tty: bool) -> tuple[str, str, list[dict]]:
    import argparse

    from moe_pipe.cli.chat_cmd import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    chat = Chat(server.url, MODEL_ID, p.parse_args(["--url", server.url]))
    out, status = Terminal(tty), Terminal(tty)
    chat.say(message, out, status)
    return out.getvalue(), status.getvalue(), chat.history


def test_a_long_prompt_s_progress_is_a_line_on_the_terminal_erased_when_the_reply_starts(server):
    shown, status, history = _say(server, "long", tty=True)
    assert posts(server)[-1]["return_progress"] is True
    assert status == (
        ERASE_LINE
        + "prompt 0 / 3,664 tokens"
        + ERASE_LINE
        + "prompt 1,536 / 3,664 tokens · 41 s left"
        + ERASE_LINE
        + "prompt 3,664 / 3,664 tokens · done in 1 min 28 s"
        + ERASE_LINE  # erased before the reply
    )
    assert shown == "Done.\n" and history[-1] == {"role": "assistant", "content": "Done."}
    shown, status, _ = _say(server, "long", tty=False)  # not a terminal: no progress lines in a log
    assert (shown, status) == ("Done.\n", "")


def test_error_message_takes_the_servers_words_on_one_line():
    assert error_message(b'{"error": {"message": "too\\nlong", "code": 400}}', "x") == "too long"
    assert error_message(b'{"error": "plain"}', "x") == "plain"
    assert error_message(b"Bad Gateway\n", "x") == "Bad Gateway"
    assert error_message(b"", "Not Found") == "Not Found"


def test_base_url_drops_a_trailing_v1():
    assert base_url("http://h:1/v1/") == base_url("http://h:1/") == "http://h:1"


# ------------------------------------------------------------- the real command


@pytest.mark.integration
def test_multi_turn_history_and_reset(server):
    r = chat(["--url", server.url, "--temp", "0.5", "-n", "32"], "hello\nhow are you\n/reset\nagain\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["Reply 1 to hello", "Reply 2 to how are you", "Reply 1 to again"]
    first, second, third = posts(server)
    assert first["model"] == MODEL_ID and first["stream"] is True
    assert (first["temperature"], first["max_tokens"]) == (0.5, 32)
    assert first["messages"] == [{"role": "user", "content": "hello"}]
    assert second["messages"] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Reply 1 to hello"},
        {"role": "user", "content": "how are you"},
    ]
    assert third["messages"] == [{"role": "user", "content": "again"}]
    assert "> " not in r.stdout  # no prompt when stdin is not a terminal


@pytest.mark.integration
def test_system_message_survives_reset_and_no_think_is_sent(server):
    r = chat(["--url", server.url + "/v1", "--system", "be brief", "--no-think"], "hi\n/reset\nyo\n")
    assert r.returncode == 0, r.stderr
    for body in posts(server):
        assert body["messages"][0] == {"role": "system", "content": "be brief"}
        assert body["chat_template_kwargs"]["enable_thinking"] is False
    assert len(posts(server)[1]["messages"]) == 2
    assert "temperature" not in posts(server)[0]  # the server's default unless given


@pytest.mark.integration
def test_api_key_is_sent(server):
    r = chat(["--url", server.url, "--api-key", "sekrit"], "hello\n")
    assert r.returncode == 0, r.stderr
    assert [h.get("Authorization") for _, _, h, _ in server.seen] == ["Bearer sekrit", "Bearer sekrit"]
    r = chat(["--url", server.url], "hello\n")
    assert "Authorization" not in server.seen[-1][2]


@pytest.mark.integration
def test_a_server_error_prints_its_message_and_the_chat_goes_on(server):
    r = chat(["--url", server.url], "hello\nbad\nthen\n/exit\nnever sent\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == ["moe-pipe: server error 400: prompt rejected: bad word"]
    assert r.stdout.splitlines() == ["Reply 1 to hello", "Reply 2 to then"]
    # The refused message is not in the history; /exit ended before "never sent".
    assert [m["content"] for m in posts(server)[-1]["messages"]] == ["hello", "Reply 1 to hello", "then"]
    assert len(posts(server)) == 3


@pytest.mark.integration
def test_connection_refused_is_one_line_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    r = chat(["--url", f"http://127.0.0.1:{port}"], "hello\n")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-pipe: error: cannot reach") and "refused" in lines[0]


@pytest.mark.integration
def test_no_server_and_no_model_is_one_line_exit_2():
    with tempfile.TemporaryDirectory(prefix="mpc") as xdg:
        r = chat([], "hello\n", env=dict(os.environ, XDG_RUNTIME_DIR=xdg))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no moe-pipe service is running" in lines[0]


@pytest.mark.integration
def test_ctrl_c_stops_the_reply_and_keeps_the_chat(server):
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_pipe.cli.main", "chat", "--url", server.url],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        proc.stdin.write("slow\n")
        proc.stdin.flush()
        assert proc.stdout.read(len("partial ")) == "partial "  # the reply is streaming
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("hello\n")
        out, err = proc.communicate(timeout=TIMEOUT_S)  # closes stdin: end of input after "hello"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "[reply stopped]" in err and "Traceback" not in err
    assert out.splitlines()[-1] == "Reply 2 to hello"
    # The next turn carries what was shown of the stopped reply.
    stopped = posts(server)[-1]["messages"][1]
    assert stopped["role"] == "assistant" and stopped["content"].startswith("partial ")
    deadline = time.monotonic() + 5
    while server.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.disconnects == 1  # closing the response told the server


def test_chat_commands_are_never_sent_to_the_model():
    """/help, /reset, /exit and their aliases are the chat's; an unknown /word is refused, not sent;
    a line that only starts with / (a path, //escaped) is a message."""
    from moe_pipe.cli.chat_cmd import chat_command

    assert [chat_command(t) for t in ("/help", "/?", "/HELP", "/reset", "/clear", "/exit", "/quit", "/bye")] == [
        "/help",
        "/help",
        "/help",
        "/reset",
        "/reset",
        "/exit",
        "/exit",
        "/exit",
    ]
    assert chat_command("/halp") == "/halp"  # unknown: refused by converse, never sent
    assert [chat_command(t) for t in ("hello", "/usr/bin is a folder", "/usr/bin", "//help", "/2")] == [None] * 5


@pytest.mark.integration
def test_help_and_an_unknown_command_are_answered_by_the_chat(server):
    r = chat(["--url", server.url], "/help\n/halp\nhello\n")
    assert r.returncode == 0, r.stderr
    assert "/reset" in r.stderr and "/exit" in r.stderr and "[unknown command /halp: not sent" in r.stderr
    assert [m["content"] for m in posts(server)[-1]["messages"]] == ["hello"] and len(posts(server)) == 1
