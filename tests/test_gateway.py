"""The HTTP gateway (`procs/gateway.py`) as `moe-pipe up` runs it: `main()` in a
spawned process, in front of a FAKE compute that speaks the real wire
(Hello, Generate -> Token... Done, Cancel) from the runtime dir's sockets.

The fake compute is this file run as a script (see the bottom): for a request
of max_tokens N it sends the pieces "w0 ", "w1 ", ... "w{N-1} " and Done with
finish_reason "length"; it can wait between pieces, pad them, and SIGKILL
itself after a number of pieces, send its prompt's progress first (as
compute's PromptProgress, `progress` steps), and logs every frame it gets as
a JSON line.
A small thread plays the supervisor: when a fake compute dies, it starts the
next one.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

import moe_pipe

pytestmark = pytest.mark.integration  # the gateway and its fake computes are processes
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------- fake compute


def fake_compute(
    runtime_dir: str,
    log_path: str,
    delay_s: float,
    die_after: int,
    die_on: int,
    pad: int = 0,
    script: list | None = None,
    progress: int = 0,
    progress_s: float = 0.0,
) -> None:
    """Serve Generate frames like procs/compute.py does, with made-up text;
    SIGKILL itself after `die_after` pieces of its `die_on`-th request (from 0);
    `pad` characters of "." after each piece. With a `script` (a list of
    replies, each a list of text pieces), request k gets reply k (the last
    one again after that) and Done "eog", as a model that stopped itself.
    With `progress` N, a prompt first: N+1 PromptProgress frames, `progress_s`
    apart, processed 0, total/N, ..., total (the prompt's length), a Cancel
    looked for between them."""
    import zmq

    from moe_pipe.shared.wire import ipc
    from moe_pipe.shared.wire import messages as m

    def note(**event) -> None:
        with open(log_path, "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "t": time.time(), **event}) + "\n")

    ctx = zmq.Context()
    ep = ipc.Endpoints(Path(runtime_dir))
    requests = ipc.bind(ctx, ep, "requests")
    tokens = ipc.connect(ctx, ep, "tokens")
    ipc.send(tokens, m.Hello("compute", os.getpid(), time.time_ns()))
    note(event="hello")
    for served in range(1 << 62):
        msg = ipc.recv(requests, None, expect=(m.Generate, m.Cancel, m.Shutdown))
        if isinstance(msg, m.Shutdown):
            return
        if isinstance(msg, m.Cancel):  # for a request that already ended: ignored
            note(event="late-cancel", req_id=msg.req_id)
            continue
        note(
            event="generate",
            req_id=msg.req_id,
            max_tokens=msg.max_tokens,
            sampling=msg.sampling,
            stop=list(msg.stop),
            n_prompt=len(msg.prompt_tokens),
            prompt=list(msg.prompt_tokens),
        )
        total = len(msg.prompt_tokens)
        cancelled = False
        for k in range(progress + 1) if progress else ():
            if k:
                time.sleep(progress_s)
            cancel = ipc.recv(requests, 0, expect=(m.Cancel,))
            if cancel is not None and cancel.req_id == msg.req_id:
                note(event="cancel", req_id=msg.req_id, during="prompt")
                ipc.send(tokens, m.Done(msg.req_id, False, code=m.Code.CANCELLED, error="cancelled"))
                cancelled = True
                break
            ipc.send(tokens, m.PromptProgress(msg.req_id, total, 0, total * k // progress, int(k * progress_s * 1e3)))
        if cancelled:
            continue
        if script:
            for piece in script[min(served, len(script) - 1)]:
                ipc.send(tokens, m.Token(msg.req_id, piece))
            ipc.send(tokens, m.Done(msg.req_id, True, "eog", tuple(range(len(script[min(served, len(script) - 1)])))))
            continue
        t0 = time.perf_counter()
        for i in range(msg.max_tokens):
            if i == die_after and served == die_on:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(delay_s)
            cancel = ipc.recv(requests, 0, expect=(m.Cancel,))
            if cancel is not None and cancel.req_id == msg.req_id:
                note(event="cancel", req_id=msg.req_id)
                ipc.send(tokens, m.Done(msg.req_id, False, tokens=tuple(range(i)), code=m.Code.CANCELLED, error="cancelled"))
                break
            ipc.send(tokens, m.Token(msg.req_id, f"w{i} " + "." * pad))
        else:
            ms = (time.perf_counter() - t0) * 1e3 + 1e-3
            n = msg.max_tokens
            ipc.send(
                tokens,
                m.Done(
                    msg.req_id, True, "length", tuple(range(n)), {"predicted_n": n, "predicted_ms": ms, "predicted_tok_s": 1e3 * n / ms}
                ),
            )


def words(n: int) -> str:
    return "".join(f"w{i} " for i in range(n))


class FakeComputes:
    """Plays the supervisor for fake computes: runs `plans` one after another,
    starting the next when one dies. A plan: {"delay_s", "die_after", "die_on",
    "pad", "script", "progress", "progress_s"} (the arguments of fake_compute)."""

    def __init__(self, runtime_dir: Path, log_path: Path, plans: list[dict]):
        self.runtime_dir, self.log_path, self.plans = runtime_dir, log_path, list(plans)
        self.procs: list[subprocess.Popen] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for plan in self.plans:
            if self.stopping.is_set():
                return
            p = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "fake-compute",
                    str(self.runtime_dir),
                    str(self.log_path),
                    str(plan.get("delay_s", 0.0)),
                    str(plan.get("die_after", -1)),
                    str(plan.get("die_on", 0)),
                    str(plan.get("pad", 0)),
                    json.dumps(plan.get("script", [])),
                    str(plan.get("progress", 0)),
                    str(plan.get("progress_s", 0.0)),
                ],
                cwd=REPO,
            )
            self.procs.append(p)
            while p.poll() is None and not self.stopping.is_set():
                time.sleep(0.02)

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.log_path.exists():
            return []
        rows = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r["event"] == kind]

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
            p.wait(10)


# -------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_path() -> Path:
    from moe_pipe.shared.makemodel.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from moe_pipe.procs.gateway import load_tokenizer

    return load_tokenizer(str(model_path))


class Service:
    """A gateway process and its fake computes over one runtime dir."""

    def __init__(self, rt, proc, url: str, log_path: Path, key: str | None):
        self.rt, self.proc, self.url, self.log_path, self.key = rt, proc, url, log_path, key
        self.computes: list[FakeComputes] = []
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)

    def start_computes(self, *plans: dict) -> FakeComputes:
        fc = FakeComputes(self.rt.path, self.log_path, list(plans) or [{}])
        self.computes.append(fc)
        return fc

    def wait_ready(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.request("GET", "/health")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError("the gateway never reported a ready compute")

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 30):
        """(status, headers, parsed JSON or text) of one HTTP request."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        hdrs = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        hdrs.update(headers or {})
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
            hdrs.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw.decode()
        return resp.status, dict(resp.getheaders()), data

    def chat(self, content: str = "hello", **fields):
        return self.request("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields})

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key or "none", max_retries=0, timeout=30)


def defaults(config: dict | None = None):
    """What the gateway fills in for what a request leaves out, from a config with these dotted keys set."""
    from moe_pipe.procs.gateway import ConfigDefaults
    from moe_pipe.shared.config import Config, apply_overrides

    return ConfigDefaults(apply_overrides(Config(), config or {}), "tiny")


def gateway_of(tokenizer, model_path: Path, config: dict | None = None):
    """A Gateway in this process (no sockets, no listener) over a config with these dotted keys set."""
    from moe_pipe.procs.gateway import Gateway
    from moe_pipe.procs.run_facts import RunFacts
    from moe_pipe.shared.config import Config, apply_overrides

    facts = RunFacts(runtime_dir="/nonexistent", model_path=str(model_path), model_name="tiny")
    return Gateway(apply_overrides(Config(), config or {}), facts, tokenizer)


@pytest.fixture
def start_gateway(tmp_path_factory, model_path):
    """start_gateway({dotted config key: value}, **http_limits) -> Service; everything is stopped and checked after."""
    from moe_pipe.procs import gateway
    from moe_pipe.procs.run_facts import RunFacts
    from moe_pipe.shared.config import Config, apply_overrides
    from moe_pipe.shared.serve import service
    from moe_pipe.shared.wire import ipc

    started: list[Service] = []
    rts = []

    def start(config: dict | None = None, **http_limits) -> Service:
        rt = ipc.RuntimeDir.create(base=tmp_path_factory.mktemp("rt"))
        rts.append(rt)
        cfg = apply_overrides(Config(), {"gateway.port": 0, **(config or {})})
        facts = RunFacts(runtime_dir=str(rt.path), model_path=str(model_path), model_name="tiny")
        limits = replace(gateway.HttpLimits(restart_wait_s=10.0), **http_limits)
        proc = multiprocessing.get_context("spawn").Process(target=gateway.main, args=(cfg, facts, limits), daemon=True)
        proc.start()
        deadline = time.monotonic() + 30
        while (addr := service.read_gateway_address(rt.path)) is None:
            assert proc.is_alive(), f"the gateway exited with {proc.exitcode}"
            assert time.monotonic() < deadline, "the gateway did not write gateway.json"
            time.sleep(0.02)
        assert addr.pid == proc.pid
        svc = Service(rt, proc, addr.url, Path(rt.path.parent / "compute.log"), cfg.gateway.api_key)
        started.append(svc)
        return svc

    yield start

    problems = []  # everything is stopped and removed first, then judged
    for svc in started:
        for fc in svc.computes:
            fc.stop()
        if svc.proc.is_alive():
            svc.proc.terminate()  # SIGTERM, as the supervisor stops it
        svc.proc.join(15)
        if svc.proc.is_alive():
            svc.proc.kill()
            svc.proc.join()
            problems.append("the gateway did not stop on SIGTERM")
        elif svc.proc.exitcode != 0:
            problems.append(f"the gateway exited with {svc.proc.exitcode} on SIGTERM")
        if service.read_gateway_address(svc.rt.path) is not None:
            problems.append("gateway.json outlived the gateway")
    for rt in rts:
        rt.remove()
        if rt.path.exists():
            problems.append(f"{rt.path} was not removed")
    if our_children():
        problems.append(f"child processes left running: {our_children()}")
    assert not problems, problems


def our_children() -> list:
    """Child processes, less multiprocessing's own resource tracker (it
    lives as long as the test process, whoever started it)."""
    kids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                kids.append(child)
        except psutil.NoSuchProcess:
            pass
    return kids


def wait_for(predicate, timeout_s: float = 10, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def sse_events(raw: str) -> list:
    """The data of each SSE event ([DONE] as the string)."""
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ------------------------------------------------------------ the OpenAI client


def test_openai_client_chat_completions_models(start_gateway, tokenizer):
    from moe_pipe.shared.text.chat import chat_prompt_tokens, encode_prompt

    svc = start_gateway({"gateway.api_key": "sekrit", "generate.max_tokens": 5, "compute.ctx_size": 512})
    computes = svc.start_computes({})
    svc.wait_ready()
    client = svc.openai()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    n_prompt = len(chat_prompt_tokens(tokenizer, messages))

    assert [m.id for m in client.models.list().data] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"

    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.5, top_p=0.9, seed=7, stop=["zz"])
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == words(6)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 6, n_prompt + 6)
    # llama.cpp's extras beside OpenAI's fields: the request's timings (compute's Done figures) and its slot
    assert r.model_extra["timings"]["predicted_n"] == 6 and r.model_extra["timings"]["predicted_ms"] > 0 and r.model_extra["id_slot"] == 0
    gen = computes.events("generate")[-1]
    assert gen["max_tokens"] == 6 and gen["stop"] == ["zz"] and gen["n_prompt"] == n_prompt
    assert gen["sampling"] == {"temperature": 0.5, "top_p": 0.9, "top_k": 0, "seed": 7}

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == words(4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = [c for c in chunks if c.choices][-1]  # the finish chunk carries the timings, as llama.cpp's last chunk
    assert last.model_extra["timings"]["predicted_n"] == 4 and last.model_extra["id_slot"] == 0
    assert not any("timings" in c.model_extra for c in chunks if c is not last)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)

    r = client.completions.create(model="tiny", prompt="Once upon a time")  # max_tokens: the configured default
    assert r.object == "text_completion" and r.choices[0].text == words(5) and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(encode_prompt(tokenizer, "Once upon a time"))
    assert computes.events("generate")[-1]["sampling"]["temperature"] == 0.0  # the configured default

    text = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="Hi", max_tokens=3, stream=True))
    assert text == words(3)
    # sampling without a seed gets one drawn, so that a retry after a crash repeats the text
    client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=1.0)
    assert isinstance(computes.events("generate")[-1]["sampling"]["seed"], int)


def test_chat_template_kwargs_reach_the_chat_template(start_gateway, tokenizer):
    """`moe-pipe chat --no-think` sends chat_template_kwargs; the prompt compute
    gets changes exactly as chat_prompt_tokens(..., enable_thinking=False) does."""
    from moe_pipe.shared.text.chat import chat_prompt_tokens

    svc = start_gateway()
    computes = svc.start_computes({})
    svc.wait_ready()
    client = svc.openai()
    messages = [{"role": "user", "content": "Say something."}]
    plain = chat_prompt_tokens(tokenizer, messages)
    no_think = chat_prompt_tokens(tokenizer, messages, enable_thinking=False)
    assert plain != no_think  # the tiny model's template reads enable_thinking

    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert computes.events("generate")[-1]["prompt"] == plain
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "low"}},
    )
    assert r.choices[0].message.content == words(2)
    assert computes.events("generate")[-1]["prompt"] == no_think
    assert r.usage.prompt_tokens == len(no_think)


def test_the_service_uses_the_chat_template_the_config_chose(start_gateway, tokenizer):
    """generate.chat_template = "plain" (the fallback for a model whose own
    template is refused) reaches the gateway: prompts are rendered with it."""
    from moe_pipe.shared.text.chat import TEMPLATE_PLAIN, chat_prompt_tokens, use_chat_template

    svc = start_gateway({"generate.chat_template": TEMPLATE_PLAIN})
    computes = svc.start_computes({})
    svc.wait_ready()
    messages = [{"role": "user", "content": "Say something."}]
    plain = chat_prompt_tokens(use_chat_template(tokenizer, TEMPLATE_PLAIN), messages)
    assert plain != chat_prompt_tokens(tokenizer, messages)
    svc.openai().chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert computes.events("generate")[-1]["prompt"] == plain


def test_health_says_loading_until_compute_says_hello(start_gateway):
    svc = start_gateway()
    status, _, body = svc.request("GET", "/health")
    assert (status, body) == (503, {"status": "loading", "version": moe_pipe.__version__})
    # a request made while compute loads waits for it instead of failing
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=svc.chat(max_tokens=2)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()
    svc.start_computes({})
    svc.wait_ready()
    assert svc.request("GET", "/health")[2] == {"status": "ok", "version": moe_pipe.__version__}
    assert svc.request("GET", "/v1/models")[2]["data"][0]["version"] == moe_pipe.__version__
    waiter.join(20)
    status, _, body = result["r"]
    assert status == 200 and body["choices"][0]["message"]["content"] == words(2)


# ------------------------------------------------------------------ bad requests


def test_bad_requests_get_openai_errors(start_gateway):
    svc = start_gateway({"gateway.api_key": "sekrit", "compute.ctx_size": 64})
    svc.start_computes({})
    svc.wait_ready()

    def error(status_body, status, *needles):
        got, headers, body = status_body
        assert got == status, body
        assert set(body["error"]) >= {"message", "type", "code"}, body
        for needle in needles:
            assert needle in body["error"]["message"], body
        return body["error"]

    # the key: needed on /v1/*, not on /health and /metrics
    assert error(svc.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)["code"] == "invalid_api_key"
    svc.key = None
    error(svc.request("GET", "/v1/models"), 401)
    assert svc.request("GET", "/health")[0] == 200 and svc.request("GET", "/metrics")[0] == 200
    svc.key = "sekrit"

    post = lambda body, path="/v1/chat/completions": svc.request("POST", path, body)  # noqa: E731
    msgs = [{"role": "user", "content": "hi"}]
    error(post(b"{not json"), 400, "not valid JSON")
    error(post(b"[1, 2]"), 400, "JSON object")
    error(post({"model": "tiny"}), 400, "'messages'")
    error(post({"model": "tiny", "messages": []}), 400, "'messages'")
    error(post({"model": "tiny", "messages": "hi"}), 400, "'messages'")
    error(post({"model": "tiny", "messages": [{"content": "hi"}]}), 400, "'messages[0]'", "role")
    error(post({"model": "tiny", "messages": [{"role": "user", "content": 5}]}), 400, "'messages[0].content'")
    error(post({"model": "tiny", "messages": msgs, "max_tokens": "5"}), 400, "'max_tokens'", "integer")
    error(post({"model": "tiny", "messages": msgs, "max_tokens": 0}), 400, "'max_tokens'")
    error(post({"model": "tiny", "messages": msgs, "n": 2}), 400, "'n'")
    error(post({"model": "tiny", "messages": msgs, "temperature": 2.5}), 400, "'temperature'", "[0, 2]")
    error(post({"model": "tiny", "messages": msgs, "temperature": True}), 400, "'temperature'")
    error(post({"model": "tiny", "messages": msgs, "top_p": 0}), 400, "'top_p'", "(0, 1]")
    error(post({"model": "tiny", "messages": msgs, "stream": "yes"}), 400, "'stream'")
    err = error(
        post({"model": "tiny", "messages": msgs, "chat_template_kwargs": {"enable_thinking": [False]}}),
        400,
        "'chat_template_kwargs.enable_thinking'",
        "string, number, boolean or null",
    )
    assert err["param"] == "chat_template_kwargs.enable_thinking"
    error(post({"model": "tiny", "messages": msgs, "chat_template_kwargs": "enable_thinking=false"}), 400, "'chat_template_kwargs'")
    error(post({"model": "tiny", "messages": msgs, "reasoning_effort": "max"}), 400, "'reasoning_effort'", '"low"')
    error(post({"model": "tiny", "messages": msgs, "stop": [1]}), 400, "'stop'")
    error(post({"model": "tiny", "messages": msgs, "seed": -1}), 400, "'seed'")
    error(post({"model": "tiny", "prompt": ""}, "/v1/completions"), 400, "'prompt'")
    error(post({"model": "tiny", "prompt": ["a", "b"]}, "/v1/completions"), 400, "'prompt'")
    long_prompt = "the river ran past the old mill " * 20
    err = error(post({"model": "tiny", "prompt": long_prompt}, "/v1/completions"), 400, "context holds 64")
    assert err["code"] == "context_length_exceeded"
    error(post({"model": "tiny", "prompt": "hi", "max_tokens": 100}, "/v1/completions"), 400, "max_tokens (100)", "context of 64")
    assert error(post({"model": "gpt-4o", "messages": msgs}), 404, "gpt-4o")["code"] == "model_not_found"
    error(post({"model": 5, "messages": msgs}), 400, "'model'")  # optional, but a string when given
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (4 << 20)}]})
    assert error(post(big), 413, "limit")["code"] == "body_too_large"
    error(svc.request("GET", "/v1/nowhere"), 404)
    error(svc.request("GET", "/v1/chat/completions"), 405)
    error(post({"model": "tiny", "messages": [{"role": "", "content": "x"}]}), 400, "'messages[0]'")
    garbage = socket.create_connection((svc.host, svc.port), timeout=10)  # not HTTP at all: aiohttp's plain 400
    garbage.sendall(b"\x16\x03\x01 GARBAGE\r\n\r\n")
    assert re.match(rb"HTTP/1.[01] 400 ", garbage.recv(100))
    garbage.close()
    # bound to loopback: a rebound DNS name or a page of another site is refused, local pages are not
    assert error(svc.request("GET", "/v1/models", headers={"Host": "evil.example:80"}), 403)["code"] == "host_not_allowed"
    assert (
        error(
            svc.request("POST", "/v1/chat/completions", {"model": "tiny", "messages": msgs}, headers={"Origin": "https://evil.example"}),
            403,
        )["code"]
        == "origin_not_allowed"
    )
    error(svc.request("GET", "/metrics", headers={"Origin": "null"}), 403)
    for host in ("localhost:1", "[::1]:8080", "127.0.0.2"):
        assert svc.request("GET", "/health", headers={"Host": host, "Origin": f"http://{host}"})[0] == 200, host
    # after all that, it still serves
    status, _, body = svc.chat(max_tokens=3)
    assert status == 200 and body["choices"][0]["message"]["content"] == words(3)


def test_full_queue_answers_429(start_gateway):
    svc = start_gateway({"gateway.queue_size": 1})
    svc.start_computes({"delay_s": 0.05})
    svc.wait_ready()
    results = []
    slow = [threading.Thread(target=lambda: results.append(svc.chat(max_tokens=30))) for _ in range(2)]
    for t in slow:  # the first runs on compute, the second waits in the queue
        t.start()
        time.sleep(0.3)
    status, headers, body = svc.chat(max_tokens=1)
    assert status == 429 and headers["Retry-After"].isdigit() and body["error"]["code"] == "queue_full"
    for t in slow:
        t.join(20)
    assert [r[0] for r in results] == [200, 200]


# ------------------------------------------------------------ client going away


def _raw_request(svc: Service, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection((svc.host, svc.port), timeout=10)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return sock


def test_client_disconnect_cancels_on_compute(start_gateway):
    svc = start_gateway()
    computes = svc.start_computes({"delay_s": 0.05})
    svc.wait_ready()
    msgs = [{"role": "user", "content": "hi"}]
    waiting = lambda: parse_prometheus(svc.request("GET", "/metrics")[2])["moe_pipe_queue_waiting"]  # noqa: E731

    streamed = _raw_request(svc, {"model": "tiny", "messages": msgs, "max_tokens": 400, "stream": True})
    got = b""
    while b'"content":"w1 "' not in got:  # some text has streamed
        got += streamed.recv(4096)
    queued = _raw_request(svc, {"model": "tiny", "messages": msgs, "max_tokens": 400})
    wait_for(lambda: waiting() == 1, what="the second request to wait in the queue")
    queued.close()  # leaves while it waits: dropped, never sent to compute
    wait_for(lambda: waiting() == 0, what="the queue to drop the request")
    streamed.close()
    cancels = wait_for(lambda: computes.events("cancel"), what="a Cancel at the fake compute")
    assert cancels[0]["req_id"] == computes.events("generate")[-1]["req_id"]

    running = _raw_request(svc, {"model": "tiny", "messages": msgs, "max_tokens": 400})  # not streamed
    wait_for(lambda: len(computes.events("generate")) == 2, what="the request to reach compute")
    running.close()
    wait_for(lambda: len(computes.events("cancel")) == 2, what="a second Cancel")

    status, _, body = svc.chat(max_tokens=3)  # the next request is served as usual
    assert status == 200 and body["choices"][0]["message"]["content"] == words(3)
    assert len(computes.events("generate")) == 3
    metrics = parse_prometheus(svc.request("GET", "/metrics")[2])
    assert metrics['moe_pipe_requests_total{outcome="cancelled"}'] == 3


# ------------------------------------------------------------- prompt progress


def _progress(events: list) -> list[tuple[int, dict]]:
    """(index in the stream, prompt_progress) of every chunk that carries one."""
    return [(i, e["prompt_progress"]) for i, e in enumerate(events) if isinstance(e, dict) and "prompt_progress" in e]


def test_a_stream_that_asks_gets_its_prompt_s_progress_in_order_before_any_text(start_gateway, tokenizer):
    from moe_pipe.shared.text.chat import chat_prompt_tokens, encode_prompt

    svc = start_gateway()
    svc.start_computes({"progress": 4})
    svc.wait_ready()
    msgs = [{"role": "user", "content": "Tell me about the old mill by the river."}]
    total = len(chat_prompt_tokens(tokenizer, msgs))
    status, headers, raw = svc.chat(msgs[0]["content"], max_tokens=3, stream=True, return_progress=True)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = sse_events(raw)
    progress = _progress(events)
    assert [p["processed"] for _, p in progress] == [total * k // 4 for k in range(5)]  # in order, the last == total
    assert all(set(p) == {"total", "cache", "processed", "time_ms"} and p["total"] == total for _, p in progress)  # llama.cpp's fields
    first_text = next(i for i, e in enumerate(events) if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content"))
    assert progress[-1][0] < first_text  # all of it before the first token
    for i, _ in progress:  # shaped as llama.cpp's server shapes them
        chunk = events[i]
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == events[0]["id"]
        assert chunk["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict) and e["choices"]) == words(3)
    assert events[-1] == "[DONE]"

    # a completion's chunks: text_completion, empty text
    prompt = "Once upon a time"
    status, _, raw = svc.request(
        "POST", "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True, "return_progress": True}
    )
    events = sse_events(raw)
    progress = _progress(events)
    assert status == 200 and progress[-1][1]["processed"] == progress[-1][1]["total"] == len(encode_prompt(tokenizer, prompt))
    assert all(events[i]["object"] == "text_completion" and events[i]["choices"][0]["text"] == "" for i, _ in progress)
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)) == words(2)

    # not asked for, or not streamed (as llama.cpp's server): no progress
    assert _progress(sse_events(svc.chat(max_tokens=2, stream=True)[2])) == []
    status, _, body = svc.chat(max_tokens=2, return_progress=True)
    assert status == 200 and "prompt_progress" not in body and body["choices"][0]["message"]["content"] == words(2)
    status, _, body = svc.chat(max_tokens=2, stream=True, return_progress="yes")
    assert status == 400 and body["error"]["param"] == "return_progress" and "true or false" in body["error"]["message"]


@pytest.mark.slow  # CI time (27 s): a Stop mid-prompt is in the default tier through the pipeline (tests/test_pipeline.py)
def test_a_client_that_leaves_mid_prompt_is_cancelled_within_a_second(start_gateway):
    svc = start_gateway()
    computes = svc.start_computes({"progress": 400, "progress_s": 0.05})  # a 20-second prompt
    svc.wait_ready()
    sock = _raw_request(svc, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "return_progress": True})
    got = b""
    while got.count(b"prompt_progress") < 3:  # the prompt is under way
        got += sock.recv(4096)
    left = time.time()
    sock.close()
    cancel = wait_for(lambda: computes.events("cancel"), what="a Cancel at the fake compute")[0]
    assert cancel["during"] == "prompt" and cancel["t"] - left < 1.0, cancel["t"] - left
    status, _, body = svc.chat(max_tokens=2)  # and the next request is served
    assert status == 200 and body["choices"][0]["message"]["content"] == words(2)


# ------------------------------------------------------------- hostile clients

POST_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def _trickle(sock: socket.socket, piece: bytes, for_s: float) -> tuple[bytes, float | None]:
    """Send `piece` every 0.1 s (b"": send nothing) for up to `for_s`, keeping
    what the server sends: (the bytes, seconds until it hung up, or None)."""
    sock.settimeout(0.1)
    got, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < for_s:
        try:
            if piece:
                sock.sendall(piece)
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return got, time.monotonic() - t0
        if not chunk:
            return got, time.monotonic() - t0
        got += chunk
    return got, None


def _status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_field_types_and_ranges_are_checked():
    """Every field we act on, each wrong in each way a client gets it wrong:
    a 400 naming the field (param), never a 500 or a silent default."""
    import math

    from moe_pipe.shared.serve.openai_api import ApiError, parse_request

    settings = defaults()
    msgs = [{"role": "user", "content": "hi"}]
    bad = {
        "model": [5, ["tiny"], True],
        "messages": ["hi", {}, [], None],
        "messages[0]": [[1], [{"content": "hi"}], [{"role": 1, "content": "x"}], [{"role": "", "content": "x"}]],
        "messages[0].content": [
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": {"text": "x"}}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ],
        "max_tokens": [-1, 0, 1.5, 5.0, True, "5", 1e30, 1 << 64, [5]],
        "max_completion_tokens": [-3, 2.5, False],
        "temperature": [-0.1, 2.01, math.nan, math.inf, -math.inf, "0.5", True, [0.5]],
        "top_p": [0, 1.5, math.nan, math.inf, "1", False],
        "top_k": [-1, 1.5, "40", True, (1 << 20) + 1],
        "n": [0, 2, "1", 1.0, True],
        "stop": [5, [None], {"a": 1}, ["x"] * 17, ["x" * 257], [1]],
        "seed": ["7", 1.5, True, -1, 1 << 64],
        "stream": ["yes", 1],
        "stream_options": ["x", [], 0, {"include_usage": 1}],
        "speculative.n_max": [-1, 9, 1.0, "2", True],
    }
    for field, values in bad.items():
        for value in values:
            top = field.split("[")[0]
            body = {"model": "tiny", "messages": msgs, top: value}
            with pytest.raises(ApiError) as err:
                parse_request(body, True, settings)
            e = err.value
            assert (e.status, e.code, e.param) == (400, "invalid_value", field), (field, value, e.message)
            assert f"'{field}'" in e.message and e.message.count("\n") == 0, e.message
    for value in (5, [], ["a"], None, ""):
        with pytest.raises(ApiError) as err:
            parse_request({"model": "tiny", "prompt": value}, False, settings)
        assert (err.value.status, err.value.param) == (400, "prompt")
    # the edges are allowed
    ok = parse_request(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "max_tokens": 1,
            "temperature": 2,
            "top_p": 1,
            "seed": (1 << 64) - 1,
            "n": 1,
            "stop": ["x" * 256] * 16,
            "stream": None,
            "stream_options": None,
        },
        True,
        settings,
    )
    assert (ok.max_tokens, ok.sampling["temperature"], ok.sampling["seed"], len(ok.stop)) == (1, 2.0, (1 << 64) - 1, 16)


def test_speculative_n_max_is_the_requests_draft_width_as_llama_cpps_server():
    """`speculative.n_max` (llama.cpp's field) sets this request's drafts per pass; left out, compute.draft."""
    from moe_pipe.shared.serve.openai_api import parse_request

    msgs = [{"role": "user", "content": "hi"}]
    assert parse_request({"messages": msgs}, True, defaults()).draft is None
    assert parse_request({"messages": msgs, "speculative.n_max": 0}, True, defaults()).draft == 0
    assert parse_request({"prompt": "x", "speculative.n_max": 8}, False, defaults()).draft == 8


def test_model_is_optional_as_in_llama_cpps_server():
    from moe_pipe.shared.serve.openai_api import ApiError, parse_request

    msgs = [{"role": "user", "content": "hi"}]
    assert parse_request({"messages": msgs}, True, defaults()).messages  # left out: the served model
    assert parse_request({"model": None, "prompt": "x"}, False, defaults()).prompt == "x"
    with pytest.raises(ApiError) as err:
        parse_request({"model": "other", "messages": msgs}, True, defaults())
    assert (err.value.status, err.value.code) == (404, "model_not_found")


def test_top_k_is_sampling_top_k_as_llama_cpps_server():
    """`top_k` in a request is llama.cpp's sampling field; left out, generate.top_k (`up --top-k`)."""
    from moe_pipe.shared.serve.openai_api import parse_request

    body = {"model": "tiny", "prompt": "hi"}
    assert parse_request(body, False, defaults()).sampling["top_k"] == 0
    assert parse_request(body, False, defaults({"generate.top_k": 40})).sampling["top_k"] == 40
    assert parse_request(body | {"top_k": 5}, False, defaults({"generate.top_k": 40})).sampling["top_k"] == 5


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tokenizer, model_path):
    """A prompt far over a 64-token context is refused on its length, untokenized
    (4 MB would take seconds of the one tokenizing thread); one nearer the
    limit is tokenized and refused with its exact token count."""
    from moe_pipe.procs.gateway import longest_token_bytes
    from moe_pipe.shared.serve.openai_api import ApiError, fit_max_tokens, parse_request
    from moe_pipe.shared.text.chat import encode_prompt

    gateway = gateway_of(tokenizer, model_path, {"compute.ctx_size": 64})
    settings = gateway.defaults
    longest = longest_token_bytes(tokenizer)
    assert 1 < longest < 64
    try:

        def refusal(body: dict, chat: bool) -> ApiError:
            req = parse_request({"model": "tiny", **body}, chat, settings)
            with pytest.raises(ApiError) as err:
                fit_max_tokens(req, len(asyncio.run(gateway.tokenize(req))), settings)
            assert (err.value.status, err.value.code) == (400, "context_length_exceeded"), err.value.message
            return err.value

        huge = "the river ran past the old mill " * 400  # 12,800 characters: > 64 tokens even at 4 x 20 a token
        err = refusal({"prompt": huge}, chat=False)
        assert err.param == "prompt" and "at least" in err.message and "context holds 64" in err.message
        assert int(re.search(r"at least ([\d,]+) tokens", err.message).group(1).replace(",", "")) <= len(
            encode_prompt(tokenizer, huge)
        )  # a true floor
        err = refusal({"messages": [{"role": "user", "content": huge}]}, chat=True)
        assert err.param == "messages" and "at least" in err.message
        near = "the river ran past the old mill " * 20  # over 64 tokens, under the floor's reach
        err = refusal({"prompt": near}, chat=False)
        assert f"the prompt is {len(encode_prompt(tokenizer, near))} tokens" in err.message
    finally:
        gateway.tokenize_pool.shutdown()


def test_a_prompt_of_70k_tokens_reaches_compute(start_gateway):
    """A prompt's ids are capped by the wire frame alone, not by an array length:
    70,000 tokens (over msgpack's default 65,536 items) reach compute whole."""
    svc = start_gateway({"compute.ctx_size": 200_000})
    computes = svc.start_computes({})
    svc.wait_ready()
    status, _, body = svc.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x" * 70_000, "max_tokens": 2})
    assert status == 200, body
    (generate,) = computes.events("generate")
    assert generate["n_prompt"] >= 70_000


def test_a_prompt_past_the_frame_cap_is_one_context_error():
    """More ids than one Generate frame carries (1 MiB, a few bytes an id): the
    gateway refuses it in one line, never compute's decoder text, never a hang."""
    from moe_pipe.procs.gateway import check_wire
    from moe_pipe.procs.gateway_worker import Job
    from moe_pipe.shared.serve.openai_api import ApiError

    check_wire(Job([1000] * 100_000, 2, {}, ()), "prompt")  # 100k ids pass
    with pytest.raises(ApiError) as e:
        check_wire(Job([1000] * 400_000, 2, {}, ()), "prompt")
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert e.value.message == "the prompt is 400,000 tokens, more than one request to compute carries (about 200,000); shorten it"


def test_a_huge_body_is_413_on_its_length(start_gateway):
    svc = start_gateway()
    svc.start_computes({})
    svc.wait_ready()
    sock = socket.create_connection((svc.host, svc.port), timeout=10)
    sock.sendall(POST_HEAD + b'Content-Length: %d\r\n\r\n{"model": ' % (1 << 30))
    got, hung_up = _trickle(sock, b"", 8)  # the other GiB never comes: the answer must not wait for it
    sock.close()
    status, err = _status_and_error(got)
    assert status == 413 and err["code"] == "body_too_large" and hung_up is not None
    status, _, body = svc.chat(max_tokens=2)
    assert status == 200 and body["choices"][0]["message"]["content"] == words(2)


def test_slow_clients_are_cut_off_without_holding_compute(start_gateway):
    """Slowloris: headers trickled, a body trickled, a connection that says
    nothing. Each is closed (or answered 408) after its timeout, while other
    requests are served as usual."""
    svc = start_gateway(idle_timeout_s=1.0, body_timeout_s=1.0)
    svc.start_computes({})
    svc.wait_ready()
    silent = socket.create_connection((svc.host, svc.port), timeout=10)
    headers = socket.create_connection((svc.host, svc.port), timeout=10)
    headers.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nX-Slow: ")
    body = socket.create_connection((svc.host, svc.port), timeout=10)
    body.sendall(POST_HEAD + b"Content-Length: 1000\r\n\r\n{")

    served = {}
    other = threading.Thread(target=lambda: served.update(r=svc.chat(max_tokens=3)))
    other.start()
    got_headers, headers_cut = _trickle(headers, b"a", 8)
    got_body, body_cut = _trickle(body, b" ", 8)
    got_silent, silent_cut = _trickle(silent, b"", 8)
    other.join(10)
    for sock in (silent, headers, body):
        sock.close()
    assert got_headers == b"" and headers_cut is not None, "a trickle of headers was not cut off"
    status, err = _status_and_error(got_body)
    assert status == 408 and err["code"] == "body_timeout" and body_cut is not None
    assert got_silent == b"" and silent_cut is not None, "an idle connection was not closed"
    assert served["r"][0] == 200 and served["r"][2]["choices"][0]["message"]["content"] == words(3)
    open_now = lambda: parse_prometheus(svc.request("GET", "/metrics")[2])["moe_pipe_connections_open"]  # noqa: E731
    wait_for(lambda: open_now() == 1, what="only the /metrics connection to be open")


def test_connections_past_the_limit_get_503_until_idle_ones_close(start_gateway):
    svc = start_gateway(max_connections=4, idle_timeout_s=3.0)
    svc.start_computes({})
    svc.wait_ready()
    idle = [socket.create_connection((svc.host, svc.port), timeout=10) for _ in range(4)]
    status, headers, body = svc.chat(max_tokens=2)
    assert status == 503 and body["error"]["code"] == "too_many_connections" and headers["Retry-After"].isdigit()
    flood = [socket.create_connection((svc.host, svc.port), timeout=10) for _ in range(10)]
    for sock in flood:  # 4 refusals wait for their client to hang up; past that they close at once, still answered
        got, hung_up = _trickle(sock, b"", 8)
        assert got.startswith(b"HTTP/1.1 503 ") and hung_up is not None, got
        sock.close()
    for sock in idle:  # the idle timeout frees their places
        assert _trickle(sock, b"", 8)[1] is not None
        sock.close()
    status, _, body = wait_for(lambda: (r := svc.chat(max_tokens=2))[0] == 200 and r, what="a place to free up")
    assert body["choices"][0]["message"]["content"] == words(2)
    metrics = parse_prometheus(svc.request("GET", "/metrics")[2])
    assert metrics["moe_pipe_connections_refused_total"] >= 11


def test_a_client_that_stops_reading_its_stream_is_cancelled(start_gateway):
    """A stream whose client reads nothing more: once the socket buffers are
    full, the write waits write_timeout_s, then the request is cancelled on
    compute (instead of generating to the end for nobody) and the service goes on."""
    svc = start_gateway({"compute.ctx_size": 300_000}, write_timeout_s=1.0)
    computes = svc.start_computes({"delay_s": 0.0002, "pad": 4000})  # 4 KB a token: the buffers (MBs) fill in seconds
    svc.wait_ready()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    sock.settimeout(10)
    sock.connect((svc.host, svc.port))
    data = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200_000, "stream": True}).encode()
    sock.sendall(POST_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    assert sock.recv(100).startswith(b"HTTP/1.1 200")  # then it reads nothing more
    cancels = wait_for(lambda: computes.events("cancel"), timeout_s=40, what="a Cancel for the stalled stream")
    sock.close()
    assert cancels[0]["req_id"] == computes.events("generate")[0]["req_id"]
    status, _, body = svc.chat(max_tokens=2)
    assert status == 200 and body["choices"][0]["message"]["content"].replace(".", "") == words(2)


def test_hanging_up_mid_body_or_while_compute_loads_leaves_nothing_behind(start_gateway):
    svc = start_gateway()
    waiting = lambda: parse_prometheus(svc.request("GET", "/metrics")[2])  # noqa: E731
    half = socket.create_connection((svc.host, svc.port), timeout=10)
    half.sendall(POST_HEAD + b'Content-Length: 500\r\n\r\n{"model": "tiny", ')
    time.sleep(0.2)
    half.close()
    wait_for(lambda: waiting()['moe_pipe_requests_total{outcome="cancelled"}'] == 1, what="the half body to count")
    # no compute yet (the model loads): the request waits, its client leaves, it must never reach compute
    early = _raw_request(svc, {"model": "tiny", "messages": [{"role": "user", "content": "early"}], "max_tokens": 5})
    time.sleep(0.5)
    early.close()
    wait_for(lambda: waiting()['moe_pipe_requests_total{outcome="cancelled"}'] == 2, what="the early request to go")
    computes = svc.start_computes({})
    svc.wait_ready()
    status, _, body = svc.chat(max_tokens=2)
    assert status == 200 and body["choices"][0]["message"]["content"] == words(2)
    assert len(computes.events("generate")) == 1
    assert svc.request("GET", "/metrics")[0] == 200


# ---------------------------------------------------------------- compute dies


def test_compute_killed_mid_request_is_retried(start_gateway):
    svc = start_gateway()
    # the first dies in the streamed request; the second serves its retry, then dies in the next one
    computes = svc.start_computes({"die_after": 3, "delay_s": 0.02}, {"die_after": 2, "die_on": 1}, {})
    svc.wait_ready()
    client = svc.openai()
    msgs = [{"role": "user", "content": "hi"}]
    # streamed: the text the first compute sent is not sent twice
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == words(8)
    assert chunks[-1].choices[0].finish_reason == "length"
    # not streamed: the whole text from the retry
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5)
    assert r.choices[0].message.content == words(5) and r.usage.completion_tokens == 5
    gens = computes.events("generate")
    assert len({g["pid"] for g in gens}) == 3 and len({g["req_id"] for g in gens}) == 4


def test_compute_killed_twice_is_503_not_a_hang(start_gateway):
    svc = start_gateway()
    svc.start_computes(*[{"die_after": 2, "delay_s": 0.05}] * 4, {})
    svc.wait_ready()
    t0 = time.monotonic()
    status, _, body = svc.chat(max_tokens=6)
    assert status == 503 and body["error"]["code"] == "compute_unavailable" and "twice" in body["error"]["message"]
    # streamed: the status went out with the first text, so the error is an event
    conn = http.client.HTTPConnection(svc.host, svc.port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}),
    )
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = sse_events(resp.read().decode())
    conn.close()
    assert events[-1]["error"]["code"] == "compute_unavailable"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text and words(2).startswith(text)  # a frame sent just before a kill -9 may be lost
    assert time.monotonic() - t0 < 20
    status, _, body = svc.chat(max_tokens=2)  # the fifth compute is healthy
    assert status == 200 and body["choices"][0]["message"]["content"] == words(2)


def test_no_restart_in_time_is_503(start_gateway):
    svc = start_gateway(restart_wait_s=1.0)
    svc.start_computes({"die_after": 1})
    svc.wait_ready()
    t0 = time.monotonic()
    status, _, body = svc.chat(max_tokens=4)
    assert status == 503 and "waited 1 s" in body["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert svc.request("GET", "/health")[0] == 503


# --------------------------------------------------------------------- metrics

PROM_LINE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})? '
    r"(-?[0-9.eE+-]+|NaN|\+Inf|-Inf)$"
)


def parse_prometheus(text: str) -> dict[str, float]:
    """name{labels} -> value; every line must be a comment or a sample."""
    samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = PROM_LINE.match(line)
        assert match, f"not Prometheus text: {line!r}"
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(4))
    return samples


def test_metrics_are_prometheus_text(start_gateway):
    import zmq

    from moe_pipe.shared.serve import service
    from moe_pipe.shared.wire import ipc
    from moe_pipe.shared.wire import messages as m

    svc = start_gateway()
    svc.start_computes({})
    svc.wait_ready()
    for n in (3, 5):
        assert svc.chat(max_tokens=n)[0] == 200
    svc.chat(temperature=9)
    # a telemetry publisher and a supervisor that answers `status`
    ctx = zmq.Context()
    pub = ipc.bind(ctx, svc.rt.endpoints, "telemetry_pub")
    control = ipc.bind(ctx, svc.rt.endpoints, "control")
    service.write_service_info(service.ServiceInfo(os.getpid(), str(svc.rt.path), "", "tiny", "tiny", time.time()))
    stop = threading.Event()

    def supervise():
        while not stop.is_set():
            try:
                envelope, cmd = ipc.recv_routed(control, 50)
            except m.ProtocolError:
                continue
            if cmd is not None:
                ipc.send(
                    control,
                    m.Status.success(processes=[{"name": "compute", "state": "RUNNING", "pid": 1, "restarts": 2}]),
                    envelope=envelope,
                )

    supervisor = threading.Thread(target=supervise)
    supervisor.start()
    try:
        record = m.TokenRecord(1, 10.0, 8.0, 3.0, 4096, 75.0, 1.5, 0.5, 0, 9.0)

        def published() -> dict | None:
            ipc.DroppingSender(pub).send(record)  # PUB drops until the gateway's SUB has joined
            samples = parse_prometheus(svc.request("GET", "/metrics")[2])
            return samples if samples["moe_pipe_cache_hit_percent"] == 75.0 else None

        samples = wait_for(published, what="telemetry in /metrics")
    finally:
        stop.set()
        supervisor.join()
        pub.close(0)
        control.close(0)
        ctx.term()
    status, headers, _ = svc.request("GET", "/metrics")
    assert headers["Content-Type"].startswith("text/plain")
    assert samples["moe_pipe_generated_tokens_total"] == 8
    assert samples['moe_pipe_requests_total{outcome="ok"}'] == 2
    assert samples['moe_pipe_requests_total{outcome="invalid"}'] == 1
    assert samples["moe_pipe_decode_tokens_per_second_last"] > 0 and samples["moe_pipe_decode_tokens_per_second_mean"] > 0
    assert samples["moe_pipe_read_bytes_total"] >= 4096 and samples["moe_pipe_read_bytes_total"] % 4096 == 0
    assert samples["moe_pipe_stall_ms_total"] >= 1.5
    assert samples['moe_pipe_process_restarts_total{process="compute"}'] == 2
    assert samples["moe_pipe_compute_ready"] == 1 and samples["moe_pipe_queue_waiting"] == 0


# ----------------------------------------------------------------------- load


def test_200_concurrent_requests_all_answered(start_gateway):
    import aiohttp

    svc = start_gateway({"gateway.queue_size": 64})
    svc.start_computes({})
    svc.wait_ready()

    async def one(session, gate, i):
        async with gate:
            body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 1 + i % 4, "stream": i % 2 == 0}
            async with session.post(svc.url + "/v1/completions", json=body) as resp:
                raw = await resp.text()
                if body["stream"]:
                    text = "".join(e["choices"][0]["text"] for e in sse_events(raw)[:-1])
                else:
                    text = json.loads(raw)["choices"][0]["text"]
                return resp.status, text, body["max_tokens"]

    async def all_of_them():
        gate = asyncio.Semaphore(20)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await asyncio.gather(*(one(session, gate, i) for i in range(200)))

    results = asyncio.run(all_of_them())
    assert [(s, t) for s, t, _ in results] == [(200, words(n)) for _, _, n in results]


# ------------------------------------------------------------------- shutdown


def test_sigterm_fails_waiting_requests_and_exits_0(start_gateway):
    svc = start_gateway()
    svc.start_computes({"delay_s": 0.05})
    svc.wait_ready()
    results = []
    clients = [threading.Thread(target=lambda: results.append(svc.chat(max_tokens=200))) for _ in range(3)]
    for t in clients:
        t.start()
    wait_for(lambda: "moe_pipe_queue_waiting 2" in svc.request("GET", "/metrics")[2], what="two waiting requests")
    os.kill(svc.proc.pid, signal.SIGTERM)
    for t in clients:
        t.join(20)
    assert sorted(r[0] for r in results) == [503, 503, 503]
    assert all(r[2]["error"]["code"] == "shutting_down" for r in results)
    svc.proc.join(15)
    assert svc.proc.exitcode == 0


# --------------------------------------------------------------- pure pieces


def test_finish_reasons_and_failures_map_to_openai():
    from moe_pipe.procs.gateway_worker import LOST, Failed, Finished, Job, Metrics, Worker
    from moe_pipe.shared.wire import messages as m

    worker = Worker(None, None, None, Metrics())
    cases = [
        (m.Done(1, True, "eog", (1, 2)), Finished("stop", 2)),
        (m.Done(1, True, "context", (1,)), Finished("length", 1)),
        (m.Done(1, True, "stop"), Finished("stop", 0)),
        (m.Done(1, True, "length", (5,)), Finished("length", 1)),
        (m.Done(1, False, code="bad_argument", error="no"), Failed(400, "no", "bad_argument", "invalid_request_error")),
        (m.Done(1, False, code="io_error", error="disk"), Failed(500, "generation failed (io_error): disk", "io_error")),
        (m.Done(1, False, code="busy", error="the slots' KV pool is full"), Failed(503, "the slots' KV pool is full", "busy")),
    ]
    for done, expected in cases:
        job = Job([1], 4, {}, ())
        assert worker.finish(job, done) is None and list(job.events) == [expected]
    assert worker.finish(Job([1], 4, {}, ()), m.Done(1, False, code="peer_gone", error="reader died")) == LOST


def test_timings_take_llama_cpps_shape_from_computes_figures():
    from moe_pipe.shared.serve.openai_api import slot_of, timings_of

    done = {"prompt_n": 120, "prompt_cached": 100, "prompt_ms": 40.0, "predicted_n": 8, "predicted_ms": 400.0, "id_slot": 2}
    t = timings_of(done)
    # prompt_n counts the tokens computed, cache_n those the cache gave (llama.cpp's result_timings)
    assert (t["cache_n"], t["prompt_n"], t["prompt_per_token_ms"], t["prompt_per_second"]) == (100, 20, 2.0, 500.0)
    assert (t["predicted_n"], t["predicted_per_token_ms"], t["predicted_per_second"]) == (8, 50.0, 20.0)
    assert "draft_n" not in t and slot_of(done) == 2
    drafted = timings_of({**done, "draft_n": 10, "draft_accepted": 7})
    assert (drafted["draft_n"], drafted["draft_n_accepted"]) == (10, 7)
    # a request with no prompt computed and no tokens (stopped at once) divides by nothing
    empty = timings_of({"prompt_n": 5, "prompt_cached": 5})
    assert (empty["prompt_n"], empty["prompt_per_second"], empty["predicted_per_token_ms"]) == (0, 0.0, 0.0)
    assert slot_of({}) == 0  # one request at a time: compute names no slot, slot 0 serves


def test_a_chat_template_error_is_a_400(tokenizer, model_path):
    import copy

    from moe_pipe.shared.serve.openai_api import ApiError, parse_request

    tok = copy.copy(tokenizer)
    tok.chat_template = "{{ raise_exception('only user turns, please') }}"
    gateway = gateway_of(tok, model_path)
    req = parse_request({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, True, gateway.defaults)
    with pytest.raises(ApiError) as err:
        asyncio.run(gateway.tokenize(req))
    assert err.value.status == 400 and "only user turns, please" in err.value.message


def test_retry_text_skips_what_was_sent():
    from moe_pipe.procs.gateway_worker import Job

    job = Job([1], 4, {}, ())
    job.offer_text("w0 w1 ")
    job.offer_text("w0 ")  # the retry, catching up
    job.offer_text("w0 w1 w2 ")
    assert list(job.events) == ["w0 w1 ", "w2 "]


def test_template_vars_are_parsed_and_checked():
    from moe_pipe.shared.serve.openai_api import ApiError, parse_request

    settings = defaults()
    msgs = [{"role": "user", "content": "hi"}]

    def template_vars(prompt: bool = False, **fields):
        body = {"model": "tiny", **({"prompt": "hi"} if prompt else {"messages": msgs}), **fields}
        return parse_request(body, not prompt, settings).template_vars

    assert template_vars() == {}
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "n": 3, "x": 0.5, "date": "2025-01-01", "y": None}
    assert template_vars(chat_template_kwargs=kwargs) == kwargs
    assert template_vars(reasoning_effort="high") == {"reasoning_effort": "high"}
    # the explicit template variable wins over the top-level field
    assert template_vars(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}) == {"reasoning_effort": "low"}
    assert template_vars(prompt=True, chat_template_kwargs={"enable_thinking": [1]}) == {}  # completions: ignored

    def refused(param: str, **fields) -> str:
        with pytest.raises(ApiError) as err:
            template_vars(**fields)
        assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_value", param), err.value.message
        return err.value.message

    assert "got list" in refused("chat_template_kwargs.enable_thinking", chat_template_kwargs={"enable_thinking": [0]})
    refused("chat_template_kwargs.opts", chat_template_kwargs={"opts": {"a": 1}})
    refused("chat_template_kwargs", chat_template_kwargs=["enable_thinking"])
    refused("chat_template_kwargs", chat_template_kwargs={f"v{i}": i for i in range(100)})
    refused("chat_template_kwargs.enable-thinking", chat_template_kwargs={"enable-thinking": False})
    for reserved in ("messages", "add_generation_prompt", "time_limit_s", "bos_token", "no_think"):
        assert "set by the server" in refused(f"chat_template_kwargs.{reserved}", chat_template_kwargs={reserved: 1})
    refused("reasoning_effort", reasoning_effort="max")
    refused("reasoning_effort", reasoning_effort=1)


def test_reserved_template_vars_cover_the_chat_functions():
    """A template variable named like an argument of shared.chat would be a
    TypeError (or override a guard such as time_limit_s): all are refused."""
    import inspect

    from moe_pipe.shared.serve.openai_api import RESERVED_TEMPLATE_VARS
    from moe_pipe.shared.text import chat

    for fn in (chat.chat_prompt_tokens, chat.render_chat):
        named = {p.name for p in inspect.signature(fn).parameters.values() if p.kind != p.VAR_KEYWORD}
        assert named <= RESERVED_TEMPLATE_VARS, (fn.__name__, named - RESERVED_TEMPLATE_VARS)


def test_template_vars_win_over_no_think_and_reach_gpt_oss_style_templates(tokenizer, model_path):
    import copy

    from moe_pipe.shared.serve.openai_api import parse_request
    from moe_pipe.shared.text.chat import chat_prompt_tokens, encode_prompt

    msgs = [{"role": "user", "content": "hi"}]

    def prompt(tok, no_think: bool, **fields) -> list[int]:
        gateway = gateway_of(tok, model_path, {"generate.no_think": no_think})
        req = parse_request({"model": "tiny", "messages": msgs, **fields}, True, gateway.defaults)
        try:
            return asyncio.run(gateway.tokenize(req))
        finally:
            gateway.tokenize_pool.shutdown()

    # generate.no_think turns thinking off; a request can turn it back on
    assert prompt(tokenizer, True) == chat_prompt_tokens(tokenizer, msgs, enable_thinking=False)
    thinking = chat_prompt_tokens(tokenizer, msgs)
    assert prompt(tokenizer, True, chat_template_kwargs={"enable_thinking": True}) == thinking
    # reasoning_effort as gpt-oss's template reads it
    tok = copy.copy(tokenizer)
    tok.chat_template = "Reasoning: {{ reasoning_effort or 'medium' }}{% for m in messages %} {{ m.content }}{% endfor %}"
    assert prompt(tok, False) == encode_prompt(tok, "Reasoning: medium hi")
    assert prompt(tok, False, reasoning_effort="high") == encode_prompt(tok, "Reasoning: high hi")
    assert prompt(tok, True) == encode_prompt(tok, "Reasoning: low hi")  # no_think's gpt-oss switch


# --------------------------------------------- reasoning and tool calls (scripted compute)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# What the tiny model (qwen3moe framing) would write to think and then call a
# tool, cut inside its markers as a stream can be; then an answer.
THINK_AND_CALL = [
    "<thi",
    "nk>\nLet me ",
    "check.\n</th",
    "ink>\n\n",
    "<tool_",
    'call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n</tool',
    "_call>",
]
ANSWER = ["It is ", "sunny in ", "Paris."]


def test_reasoning_and_tool_calls_in_responses_streamed_and_not(start_gateway, tokenizer):
    """A scripted compute writes Qwen3's think block and a <tool_call>: the
    response carries reasoning_content and tool_calls, not the markup; without
    `tools` the call stays answer text."""
    from moe_pipe.shared.text.chat import chat_prompt_tokens

    svc = start_gateway()
    computes = svc.start_computes({"script": [THINK_AND_CALL]})
    svc.wait_ready()
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"model": "tiny", "messages": msgs, "tools": [WEATHER_TOOL]}

    status, _, r = svc.request("POST", "/v1/chat/completions", body)
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None and msg["reasoning_content"] == "Let me check."
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert computes.events("generate")[-1]["prompt"] == chat_prompt_tokens(tokenizer, msgs, tools=[WEATHER_TOOL])

    status, _, raw = svc.request("POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me check."
    assert "".join(d.get("content") or "" for d in deltas) == ""
    [streamed] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert streamed[0]["index"] == 0 and streamed[0]["function"] == call["function"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"

    status, _, r = svc.request("POST", "/v1/chat/completions", {**body, "tools": None})
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "Let me check." and msg["content"].startswith("<tool_call>") and "tool_calls" not in msg
    assert r["choices"][0]["finish_reason"] == "stop"
    assert computes.events("generate")[-1]["prompt"] == chat_prompt_tokens(tokenizer, msgs)  # no tools in the prompt


def test_openai_client_tool_calling_loop(start_gateway, tokenizer):
    """The official client's loop: tools -> tool_calls -> a role "tool" reply
    -> the final answer; the result reaches compute through the template."""
    from moe_pipe.shared.text.chat import chat_prompt_tokens

    svc = start_gateway()
    computes = svc.start_computes({"script": [THINK_AND_CALL, ANSWER, THINK_AND_CALL]})
    svc.wait_ready()
    client = svc.openai()
    messages: list = [{"role": "user", "content": "Weather in Paris?"}]

    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra.get("reasoning_content") == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    messages.append(choice.message)  # the client's own message object, as its docs do it
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'})
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    prompt = computes.events("generate")[-1]["prompt"]
    sent = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call.id, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    assert prompt == chat_prompt_tokens(tokenizer, sent, tools=[WEATHER_TOOL])
    text = tokenizer.decode(prompt)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in text

    stream = client.chat.completions.create(model="tiny", messages=messages[:1], tools=[WEATHER_TOOL], stream=True)
    calls = [tc for chunk in stream for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [(0, "get_weather", {"city": "Paris"})]


if __name__ == "__main__" and sys.argv[1:2] == ["fake-compute"]:
    _, _, rt_dir, log_file, delay, die_after, die_on, pad, script, progress, progress_s = sys.argv
    fake_compute(
        rt_dir, log_file, float(delay), int(die_after), int(die_on), int(pad), json.loads(script), int(progress), float(progress_s)
    )


def test_slots_lists_one_slot_by_default_and_it_is_busy_while_a_request_runs(start_gateway):
    svc = start_gateway()
    svc.start_computes({"delay_s": 0.05})
    svc.wait_ready()
    status, _, slots = svc.request("GET", "/slots")
    assert status == 200 and slots == [
        {"id": 0, "id_task": -1, "n_ctx": 4096, "is_processing": False, "state": 0, "n_prompt_tokens": 0, "n_decoded": 0}
    ]
    running = _raw_request(svc, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True})
    got = b""
    while b'"content":"w1 "' not in got:  # it is decoding
        got += running.recv(4096)
    busy = svc.request("GET", "/slots")[2]
    assert len(busy) == 1 and busy[0]["is_processing"] and busy[0]["state"] == 1 and busy[0]["id_task"] > 0
    assert busy[0]["n_prompt_tokens"] > 0 and busy[0]["n_decoded"] >= 1
    metrics = parse_prometheus(svc.request("GET", "/metrics")[2])
    assert metrics["moe_pipe_slots"] == 1 and metrics["moe_pipe_slots_busy"] == 1
    running.close()
    wait_for(lambda: not svc.request("GET", "/slots")[2][0]["is_processing"], what="the slot to be idle after its client left")


def test_slots_shows_a_prompts_progress_then_its_decoding(start_gateway):
    """GET /slots during a long prompt: the slot's phase is "prompt" and its prompt_progress
    (the stream's shape) grows; once tokens come it is "decoding", the whole prompt processed."""
    svc = start_gateway()
    svc.start_computes({"progress": 40, "progress_s": 0.05, "delay_s": 0.05})  # a 2-second prompt
    svc.wait_ready()
    running = _raw_request(svc, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True})
    seen: list[dict] = []

    def prompt_done() -> bool:
        seen.append(svc.request("GET", "/slots")[2][0])
        return seen[-1].get("phase") == "decoding"

    wait_for(prompt_done, what="the prompt to end")
    during = [s["prompt_progress"]["processed"] for s in seen if s.get("phase") == "prompt"]
    assert all(set(s["prompt_progress"]) == {"total", "cache", "processed", "time_ms"} for s in seen if "prompt_progress" in s)
    assert len(set(during)) >= 2 and during == sorted(during)  # it grows as the prompt runs
    assert all(0 <= p < seen[-1]["prompt_progress"]["total"] for p in during)
    got = b""
    while b'"content":"w1 "' not in got:  # it is decoding
        got += running.recv(4096)
    decoding = svc.request("GET", "/slots")[2][0]
    assert decoding["phase"] == "decoding" and decoding["prompt_progress"]["processed"] == decoding["prompt_progress"]["total"]
    running.close()
    wait_for(lambda: not svc.request("GET", "/slots")[2][0]["is_processing"], what="the slot to be idle after its client left")
    assert "phase" not in svc.request("GET", "/slots")[2][0] and "prompt_progress" not in svc.request("GET", "/slots")[2][0]
