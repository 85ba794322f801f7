"""`moe-pipe chat [MODEL|CONFIG] [--url URL]`: an interactive chat in the terminal.

A client of the service's OpenAI-compatible gateway, nothing more: each line
you type is a user message; the whole conversation goes to
`POST /v1/chat/completions` (stream: true) so the server's chat template sees
every turn, and the reply is printed as its tokens arrive and appended to the
history. Standard library HTTP only, so chat adds no dependency.

Which server, first that applies:

    --url URL              that server (any OpenAI-compatible one)
    a running service      its gateway (gateway.json in its runtime dir)
    MODEL|CONFIG given     `moe-pipe up MODEL --detach --port 0` now, and
                           `moe-pipe down` when the chat ends

The model's reasoning (the server's `reasoning_content`: Qwen3's think
block, gpt-oss's analysis channel, Gemma 4's thought channel) is shown dimmed
before the answer when stdout is a terminal, and left out otherwise, or with
--hide-reasoning or --no-think; it is never sent back in the history.

While the server computes the prompt (minutes, for a long conversation on a
model bigger than RAM), the request's `return_progress` (llama.cpp's field)
brings its progress, shown on stderr when that is a terminal as one line,
"prompt 1,536 / 3,664 tokens · 41 s left", erased when the reply starts.

Lines: `/reset` clears the history (the --system message stays), `/exit` or
end of input ends, `/help` lists the commands; an unknown `/word` is not sent. Ctrl-C during a reply stops that reply; at the prompt, ends.
A conversation that outgrows the server's context loses its oldest turns
(the --system message stays), with a note the first time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..shared.errors import UserError

GATEWAY_START_TIMEOUT_S = 30
# /v1/models answers at once from a live gateway. A completion gets no read
# timeout: prefilling a long conversation on a model bigger than RAM can take
# minutes before the first token, and Ctrl-C stops a reply that takes too long.
MODELS_TIMEOUT_S = 10
# What turns thinking off in the chat templates we know: Qwen3 and Gemma 4
# read enable_thinking, gpt-oss reads reasoning_effort (shared/text/chat.py
# thinking_off). A template ignores the variable it does not use.
NO_THINK_TEMPLATE_KWARGS = {"enable_thinking": False, "reasoning_effort": "low"}
DIM, PLAIN = "\x1b[2m", "\x1b[0m"  # SGR faint and reset: reasoning shown dimmed on a terminal
ERASE_LINE = "\r\x1b[K"  # back to the line's start, erase it: the prompt's progress is redrawn in place
REASONING, CONTENT, PROGRESS = "reasoning", "content", "progress"


class RequestFailed(Exception):
    """The server refused or broke off one request; the chat goes on. `code`
    is the error's code in OpenAI's shape ("context_length_exceeded"), if any."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


# The error code of a request whose prompt and reply do not fit the context
# (shared/serve/openai_api.py fit_max_tokens; OpenAI uses the same one).
CONTEXT_EXCEEDED = "context_length_exceeded"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL_OR_CONFIG",
        help="a GGUF file, TOML config or catalog name to start a service for, if none is running",
    )
    p.add_argument("--url", metavar="URL", help="the server's base URL (default: the running service's gateway)")
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="sent as `Authorization: Bearer KEY` (default: $MOE_PIPE_API_KEY, else the running service's own key)",
    )
    from .status_cmd import add_selector_arguments

    add_selector_arguments(p, "the service to chat with")
    p.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    p.add_argument(
        "--temp",
        "--temperature",
        dest="temperature",
        type=float,
        default=None,
        metavar="T",
        help="sampling temperature in [0, 2] (default: the server's)",
    )
    p.add_argument(
        "--top-k",
        dest="top_k",
        type=int,
        default=None,
        metavar="K",
        help="sample among the K most likely tokens, 0 = off (default: the server's)",
    )
    p.add_argument(
        "-n", "--max-tokens", dest="max_tokens", type=int, default=None, metavar="N", help="longest reply in tokens (default: the server's)"
    )
    p.add_argument("--no-think", action="store_true", help="ask the model not to think before answering (and show no reasoning)")
    p.add_argument(
        "--hide-reasoning",
        action="store_true",
        help="let the model think but show only its answers (reasoning is shown dimmed on a terminal)",
    )


# --------------------------------------------------------------------- server


def base_url(url: str) -> str:
    """The server root. A trailing /v1 is dropped because OpenAI clients take
    their base_url with it, and people paste what they have."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@contextmanager
def chat_server(args: argparse.Namespace) -> Iterator[str]:
    """The base URL to talk to, bringing a service up (and down again) if needed."""
    from ..shared.serve.service import NoService, find_service, live_services

    if args.url:
        yield base_url(args.url)
        return
    running = live_services()
    if running or not args.model:
        if not running:
            raise NoService(
                "no moe-pipe service is running; give a MODEL or CONFIG to start one "
                "(`moe-pipe chat MODEL`), start one with `moe-pipe up CONFIG`, or pass --url"
            )
        info = find_service(name=args.name, port=args.port)  # the one, or a one-line error naming those that run
        if args.model:
            print(f"[a service is already running ({info.model_name or info.model}); chatting with it]", file=sys.stderr)
        yield attach(info, args)
        return
    with service_brought_up(args.model) as info:
        yield attach(info, args)


def attach(info, args: argparse.Namespace) -> str:
    """The service's gateway URL, once it listens; with no --api-key, the
    service's own key (its private runtime folder, same user), never shown."""
    from ..shared.serve.service import read_api_key, wait_for_gateway

    if args.api_key is None:
        args.api_key = read_api_key(info)
    return wait_for_gateway(info, GATEWAY_START_TIMEOUT_S).url


def _moe_pipe(*argv: str) -> list[str]:
    # This interpreter, not whatever `moe-pipe` is first on PATH.
    return [sys.executable, "-m", "moe_pipe.cli.main", *argv]


@contextmanager
def service_brought_up(model: str) -> Iterator[Any]:
    """`moe-pipe up MODEL --detach` for the length of the chat. Port 0: the
    kernel picks a free one, so a chat never collides with another server;
    the gateway writes the port it got to gateway.json."""
    import subprocess

    from ..shared.hub.resolve import catalog_entry, pulled_path
    from ..shared.serve.service import find_service

    if entry := catalog_entry(model):  # misspelt or not pulled: its one line, before anything starts
        pulled_path(entry)
    print(f"[starting a service for {model}]", file=sys.stderr, flush=True)
    name = f"chat-{os.getpid()}"  # its own name: never confused with a service started meanwhile
    up = subprocess.run(_moe_pipe("up", model, "--detach", "--port", "0", "--name", name))
    if up.returncode != 0:
        raise UserError(f"could not start a service for {model}: `moe-pipe up` exited {up.returncode} (its error is above)")
    try:
        yield find_service(name=name)
    finally:
        subprocess.run(_moe_pipe("down", "--name", name))


# ----------------------------------------------------------------------- HTTP


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def error_message(body: bytes, fallback: str) -> str:
    """The server's own words from an error body, on one line. OpenAI's shape
    is {"error": {"message": ...}}; plain text and other shapes are taken as is."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data)
        text = str(err.get("message") or err) if isinstance(err, dict) else str(err)
    return " ".join(text.split()) or fallback


def error_code(body: bytes) -> str:
    """The `code` of an error body in OpenAI's shape ({"error": {"code": ...}}); "" if none."""
    try:
        err = json.loads(body.decode("utf-8", "replace")).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(err.get("code") or "") if isinstance(err, dict) else ""


def open_request(url: str, api_key: str | None, body: dict | None = None, timeout_s: float | None = None):
    """The HTTP response (a file of lines). An HTTP error status is
    RequestFailed; a server that cannot be reached is a UserError (exit 2)."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=_headers(api_key), method="POST" if data else "GET")
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        with exc:
            reply = exc.read()
            raise RequestFailed(f"{exc.code}: {error_message(reply, exc.reason)}", error_code(reply)) from None
    except urllib.error.URLError as exc:
        reason = exc.reason.strerror if isinstance(exc.reason, OSError) and exc.reason.strerror else exc.reason
        raise UserError(f"cannot reach {url}: {reason}") from None
    except (TimeoutError, ConnectionError) as exc:
        raise UserError(f"cannot reach {url}: {exc}") from None


def first_model_id(url: str, api_key: str | None) -> str:
    try:
        with open_request(f"{url}/v1/models", api_key, timeout_s=MODELS_TIMEOUT_S) as resp:
            models = json.loads(resp.read()).get("data") or []
    except RequestFailed as exc:
        raise UserError(f"{url}/v1/models refused: {exc}") from None
    except (ValueError, AttributeError):
        raise UserError(f"{url}/v1/models: not an OpenAI-compatible answer") from None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise UserError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


def sse_content(lines) -> Iterator[str]:
    """The answer's text pieces of an OpenAI chat stream (delta.content)."""
    return (text for kind, text in sse_deltas(lines) if kind == CONTENT)


def sse_deltas(lines) -> Iterator[tuple[str, str]]:
    """(kind, text) pieces of an OpenAI chat stream: `data: {...}` lines carrying
    choices[0].delta.reasoning_content (REASONING) or .content (CONTENT), or
    llama.cpp's `prompt_progress` (PROGRESS, as one line of text), until
    `data: [DONE]`. Other SSE lines (blank separators, `: keep-alive`
    comments, `event:`) carry no text."""
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            raise RequestFailed(f"the server sent a stream line that is not JSON: {payload[:80]!r}") from None
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:  # failed after the 200 went out: the error comes in the stream
            raise RequestFailed(error_message(json.dumps(chunk).encode(), "the server broke off the reply"))
        progress = progress_text(chunk.get("prompt_progress"))
        if progress:
            yield PROGRESS, progress
            continue
        choices = chunk.get("choices") or []
        delta = (choices[0].get("delta") or {}) if choices and isinstance(choices[0], dict) else {}
        thought, piece = delta.get("reasoning_content"), delta.get("content")
        if thought and isinstance(thought, str):
            yield REASONING, thought
        if piece and isinstance(piece, str):
            yield CONTENT, piece


def progress_text(progress: Any) -> str:
    """A `prompt_progress` object as one line; "" if it is not one (another server's field)."""
    from ..shared.progress import prompt_progress_text

    fields = ("total", "cache", "processed", "time_ms")
    if not isinstance(progress, dict) or not all(type(progress.get(k)) is int and progress[k] >= 0 for k in fields):
        return ""
    return prompt_progress_text(*(progress[k] for k in fields))


class PromptStatus:
    """The prompt's progress, one line redrawn in place on a terminal (nothing
    elsewhere: a log would get a line four times a second); `clear()` erases it."""

    def __init__(self, stream):
        self.stream, self.shown = stream, False
        self.terminal = stream.isatty()

    def show(self, text: str) -> None:
        if self.terminal:
            self.stream.write(ERASE_LINE + text)
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write(ERASE_LINE)
            self.stream.flush()
            self.shown = False


# ----------------------------------------------------------------------- chat


class Chat:
    """The conversation and the requests that carry it."""

    def __init__(self, url: str, model: str, args: argparse.Namespace):
        self.url, self.model, self.api_key = url, model, args.api_key
        self.system = args.system
        self.show_reasoning = not (args.no_think or getattr(args, "hide_reasoning", False))
        self.options: dict = {}
        if args.temperature is not None:
            if not 0 <= args.temperature <= 2:  # the server's range (OpenAI's), said before the first turn
                raise UserError(f"--temp {args.temperature:g}: out of range; allowed: 0 to 2 (OpenAI's range)")
            self.options["temperature"] = args.temperature
        if args.top_k is not None:
            self.options["top_k"] = args.top_k
        if args.max_tokens is not None:
            self.options["max_tokens"] = args.max_tokens
        if args.no_think:
            self.options["chat_template_kwargs"] = dict(NO_THINK_TEMPLATE_KWARGS)
        self.history: list[dict] = []
        self.trimmed = False  # the oldest turns have been dropped to fit the context (said once)
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def request_body(self) -> dict:
        return {"model": self.model, "messages": list(self.history), "stream": True, "return_progress": True, **self.options}

    def say(self, text: str, out, status_stream=None) -> None:
        """Send one user message, print the reply as it streams, keep both.

        A conversation the server's context cannot hold loses its oldest
        turns (the system message stays) until it fits, with a note the first
        time. Another failed request leaves the history as it was. A reply
        stopped with Ctrl-C keeps what was shown (the user saw it; the next
        turn answers from there); one stopped before any text drops the
        question too, so two user turns never follow each other."""
        import http.client

        self.history.append({"role": "user", "content": text})
        pieces: list[str] = []
        shown = Shown(out, self.show_reasoning and out.isatty())
        status = PromptStatus(status_stream if status_stream is not None else sys.stderr)
        try:
            while True:
                try:
                    with open_request(f"{self.url}/v1/chat/completions", self.api_key, self.request_body()) as resp:
                        for kind, piece in sse_deltas(resp):
                            if kind == PROGRESS:
                                status.show(piece)
                                continue
                            status.clear()
                            if kind == CONTENT:
                                pieces.append(piece)  # first: a Ctrl-C during the write still keeps what showed
                            shown.write(kind, piece)
                    break
                except RequestFailed as exc:
                    # The server counts tokens, the client cannot: its refusal is how we learn the history is too long.
                    if pieces or exc.code != CONTEXT_EXCEEDED or not self.drop_oldest_turn():
                        raise
        except KeyboardInterrupt:
            # Leaving the `with` closed the connection: the gateway sees the
            # client go and stops generating (a prompt too, within a second).
            status.clear()
            shown.end()
            out.write("\n")
            print("[reply stopped]", file=sys.stderr, flush=True)
            self._keep_reply(pieces)
            return
        except RequestFailed as exc:
            status.clear()
            shown.end()
            if pieces or shown.thought:
                out.write("\n")
            self.history.pop()
            print(f"moe-pipe: server error {exc}", file=sys.stderr, flush=True)
            return
        except BrokenPipeError:
            raise  # our stdout closed (`| head`): main ends quietly
        except (ConnectionError, http.client.HTTPException) as exc:  # broke mid-reply: the server is gone
            raise UserError(f"lost the connection to {self.url}: {exc or type(exc).__name__}") from None
        finally:
            status.clear()  # never leave a progress line under what comes next
            shown.end()  # never leave the terminal dimmed
        out.write("\n")
        out.flush()
        self._keep_reply(pieces, complete=True)

    def drop_oldest_turn(self) -> bool:
        """Drop the oldest user message and the replies after it, keeping the
        system message and the message being sent; False if nothing is left to drop."""
        start = 1 if self.history and self.history[0]["role"] == "system" else 0
        if len(self.history) - start <= 1:
            return False
        end = start + 1
        while end < len(self.history) - 1 and self.history[end]["role"] != "user":
            end += 1
        del self.history[start:end]
        if not self.trimmed:
            self.trimmed = True
            print(
                "[the conversation outgrew the server's context: dropping the oldest turns to make room "
                "(noted once; /reset clears the history)]",
                file=sys.stderr,
                flush=True,
            )
        return True

    def _keep_reply(self, pieces: list[str], complete: bool = False) -> None:
        if pieces or complete:
            self.history.append({"role": "assistant", "content": "".join(pieces)})
        else:
            self.history.pop()


class Shown:
    """What one reply prints: reasoning dimmed (when shown at all), then the
    answer on its own line; `end()` leaves the terminal's attributes reset."""

    def __init__(self, out, reasoning: bool):
        self.out, self.reasoning = out, reasoning
        self.dim = False  # the terminal is in faint mode
        self.thought = False  # some reasoning was shown

    def write(self, kind: str, text: str) -> None:
        if kind == REASONING:
            if not self.reasoning:
                return
            if not self.dim:
                self.out.write(DIM)
                self.dim = self.thought = True
        elif self.dim:
            self.out.write(PLAIN + "\n")  # the answer starts on a line of its own
            self.dim = False
        self.out.write(text)
        self.out.flush()

    def end(self) -> None:
        if self.dim:
            self.out.write(PLAIN)
            self.out.flush()
            self.dim = False


def read_line(prompt: str) -> str | None:
    """The next input line; None at end of input."""
    try:
        return input(prompt)
    except EOFError:
        return None


# The chat's own commands, never sent to the model; the others are what llama.cpp's and Ollama's CLIs call them.
CHAT_COMMANDS = {"/help": ("/?",), "/reset": ("/clear",), "/exit": ("/quit", "/bye")}
HELP_TEXT = (
    "[/reset (or /clear) clears the history, the --system message stays; /exit (or /quit, /bye, Ctrl-D) ends; "
    "/help (or /?) shows this; Ctrl-C stops a reply; a line starting with // is sent with one / less]"
)


def chat_command(text: str) -> str | None:
    """The command a line is ("/help", "/reset", "/exit", or the unknown "/word" itself), or None
    for a message: a command is one word of letters after "/", so "/usr/bin?" is a message."""
    word = text.split()[0]
    if len(text.split()) != 1 or not (word == "/?" or (word.startswith("/") and word[1:].isalpha())):
        return None
    word = word.lower()
    return next((c for c, aliases in CHAT_COMMANDS.items() if word == c or word in aliases), word)


def converse(chat: Chat, interactive: bool) -> int:
    prompt = "> " if interactive else ""
    while True:
        try:
            line = read_line(prompt)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        if line is None:
            if interactive:
                print(file=sys.stderr)  # end the prompt's line
            return 0
        text = line.strip()
        if not text:
            continue
        command = chat_command(text)
        if command is None:
            chat.say(text[1:] if text.startswith("//") else text, sys.stdout)
        elif command == "/exit":
            return 0
        elif command == "/reset":
            chat.reset()
            print("[history cleared]", file=sys.stderr, flush=True)
        elif command == "/help":
            print(HELP_TEXT, file=sys.stderr, flush=True)
        else:
            print(f"[unknown command {command}: not sent; /help lists the commands]", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if args.api_key is None:  # as `up` reads it: the key stays out of the process list
        args.api_key = os.environ.get("MOE_PIPE_API_KEY") or None
    with chat_server(args) as url:
        model = first_model_id(url, args.api_key)
        if interactive:
            print(f"[{model} at {url}; /help lists the commands, /exit or Ctrl-D ends]", file=sys.stderr)
        return converse(Chat(url, model, args), interactive)
