"""The web page's server side (procs/gateway_events.py; docs/web.md), without a
browser: the static files and their headers, who may fetch them, the event
stream fed from telemetry, and that a browser which stops reading costs a
bounded queue and never holds the feed. The page in a real browser is
tests/test_web_browser.py."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time
from importlib import resources
from types import SimpleNamespace

import pytest
from aiohttp import web

from moe_pipe.procs import gateway_events as ge
from moe_pipe.shared.config import Config
from moe_pipe.shared.wire import messages as m

from . import test_gateway

# the gateway with fake computes of tests/test_gateway.py, and what it needs
start_gateway, model_path, tokenizer = test_gateway.start_gateway, test_gateway.model_path, test_gateway.tokenizer

WEB = resources.files("moe_pipe.shared.serve").joinpath("web")


def record(step: int, **kw) -> m.TokenRecord:
    return m.TokenRecord(step, 10.0 + step, 6.0, 3.0, 4096 * step, 50.0, 1.0, 0.5, 0, 7.0, **kw)


# ------------------------------------------------------------------ static files


def test_the_page_has_no_inline_script_no_eval_and_no_html_insertion():
    html = WEB.joinpath("index.html").read_text()
    js = WEB.joinpath("app.js").read_text()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="/web/' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son[a-z]+\s*=", html, re.I), "inline event handlers need 'unsafe-inline'"
    assert not re.search(r"\sstyle\s*=", html, re.I), "inline styles need 'unsafe-inline'"
    assert not re.search(r"https?://", html + js), "nothing from another origin (no CDN)"
    for banned in ("eval(", "new Function", "innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", 'setTimeout("'):
        assert banned not in js, banned


def test_csp_is_strict():
    csp = dict(part.strip().split(" ", 1) for part in ge.CSP.split(";"))
    assert csp["default-src"] == "'none'" and csp["script-src"] == "'self'" and csp["style-src"] == "'self'"
    assert "unsafe" not in ge.CSP and csp["connect-src"] == "'self'" and csp["frame-ancestors"] == "'none'"


# ------------------------------------------------------------------ the feed


def test_a_client_that_never_reads_keeps_at_most_its_queue():
    feed = ge.Feed(cap=8)
    stuck, reading = feed.join(), feed.join()
    got = []
    for step in range(1000):
        feed.on_record(record(step), compute_pid=1)
        got.append(reading.take())
    assert len(stuck.queue) == 8 and stuck.dropped == 992
    assert [json.loads(f.split(b"data: ")[1])["step"] for f in stuck.queue] == list(range(992, 1000))  # the newest kept
    assert len(got) == 1000 and reading.dropped == 0
    assert len(feed.history) == ge.HISTORY and [r["step"] for r in feed.first] == list(range(ge.FIRST_TOKENS))
    feed.on_record(record(0), compute_pid=2)  # a restarted compute warms up again
    assert [r["step"] for r in feed.first] == [0]


def test_a_stalled_browser_neither_grows_memory_nor_holds_the_feed():
    """Over real sockets: one client asks for /events and never reads, another
    reads; 3000 frames of 16 KB (48 MB, far over any socket buffer) are
    published. The reader gets every one, the staller's queue stays at its cap
    and the rest of its frames are dropped, not kept."""

    async def main() -> tuple[list[int], list[int], list[int]]:
        gw = SimpleNamespace(facts=SimpleNamespace(model_name="t"), config=Config(), http_limits=SimpleNamespace(write_timeout_s=30.0))
        view = ge.WebView(gw)
        view.feed = ge.Feed(cap=16)
        app = web.Application()
        ge.add_routes(app, view)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        while len(view.feed.clients) < 1:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        while len(view.feed.clients) < 2:
            await asyncio.sleep(0.01)
        pad = "x" * 16000
        got: list[int] = []
        buf = b""
        for i in range(3000):
            view.feed.publish("token", {"i": i, "pad": pad})
            while not got or got[-1] < i:  # the reading browser reads as it comes
                buf += await reader.read(1 << 20)
                *frames, buf = buf.split(b"\n\n")
                got += [int(x) for f in frames for x in re.findall(rb'"i":(\d+)', f)]
        queues = [len(c.queue) for c in view.feed.clients]
        dropped = [c.dropped for c in view.feed.clients]
        stalled.close()
        writer.close()
        view.feed.close()
        await runner.cleanup()
        return got, queues, dropped

    got, queues, dropped = asyncio.run(main())
    assert got == list(range(3000))  # every frame, in order, to the last
    assert sorted(queues) == [0, 16] and min(dropped) == 0 and max(dropped) > 2000, (queues, dropped)


# ------------------------------------------------------------------ through the gateway


def get(svc, path: str, headers: dict | None = None, key: str | None = None):
    conn = http.client.HTTPConnection(svc.host, svc.port, timeout=10)
    conn.request("GET", path, headers={**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})})
    resp = conn.getresponse()
    return resp.status, dict(resp.getheaders()), resp.read()


def read_events(resp, want: int, kinds: tuple[str, ...] = ("token",)) -> list[tuple[str, dict]]:
    out, kind = [], ""
    while len(out) < want:
        line = resp.fp.readline().decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and kind in kinds:
            out.append((kind, json.loads(line[6:])))
    return out


def run_page_js(part: str, function: str, script: str) -> list[str]:
    """The lines `script` prints after the page's own code between app.js's `// PART: begin`
    and `// PART: end` markers (where `function` is), run by node; skipped without node."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip(f"node is not installed: the page's {function} is run with it")
    js = WEB.joinpath("app.js").read_text()
    region = js.split(f"// {part}: begin")[1].split("\n", 1)[1].split(f"// {part}: end")[0]
    out = subprocess.run([node, "-e", region + "\n" + script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.integration  # node runs the page's own function
def test_the_page_writes_a_prompt_s_progress_as_chat_and_tail_do():
    from moe_pipe.shared.progress import prompt_progress_text

    assert "return_progress: true" in WEB.joinpath("app.js").read_text()  # the page's chat asks for it
    cases = [
        (total, cache, processed, ms)
        for total, cache in ((3664, 0), (3664, 512), (7, 3), (150_000, 1200))
        for processed in sorted({cache, cache + 1, (cache + total) // 2, total - 1, total})
        for ms in (0, 499, 500, 29_700, 59_500, 3_599_500, 7_654_321)
    ]
    script = f"for (const [total, cache, processed, time_ms] of {json.dumps(cases)}) "
    script += "console.log(promptProgressText({ total, cache, processed, time_ms }));"
    assert run_page_js("prompt-progress", "promptProgressText", script) == [prompt_progress_text(*c) for c in cases]


@pytest.mark.integration  # node runs the page's own function
def test_the_page_writes_the_warm_start_as_tail_does():
    from moe_pipe.shared.experts.hotset import WarmProgress

    assert 'id="warming"' in WEB.joinpath("index.html").read_text()
    cases = [
        WarmProgress(state, done, total)
        for state in ("warming", "done", "stopped")
        for done, total in ((0, 5), (812, 3071), (12345, 1234567))
    ]
    script = f"for (const w of {json.dumps([c.__dict__ for c in cases])}) console.log(warmingText(w) || '-');"
    script += "console.log(warmingText(null) || '-');"
    assert run_page_js("warming", "warmingText", script) == [c.text() if c.state == "warming" else "-" for c in cases] + ["-"]


@pytest.mark.integration  # node runs the page's own function
def test_the_page_writes_the_slots_as_tail_does():
    from moe_pipe.shared.progress import pool_text, slot_text

    assert 'id="slots"' in WEB.joinpath("index.html").read_text() and 'id="kv-pool"' in WEB.joinpath("index.html").read_text()
    states = m.SlotStates(
        (0, 3, 4, 5, 6, 7, 8),
        (0, 3664, 3664, 7, 150_000, 40, 40),
        (0, 0, 512, 3, 1200, 0, 0),
        (0, 1536, 512, 3, 149_999, 40, 40),
        (0, 0, 0, 0, 0, 1, 12345),
        (0, 3664, 512, 3, 150_000, 41, 12346),
        14336,
    )
    script = f"for (const s of {json.dumps(states.rows())}) console.log(slotText(s));"
    assert run_page_js("slots", "slotText", script) == [slot_text(r) for r in states.rows()]
    script = f"console.log(poolText({states.pool_held}, {states.pool}));"
    assert run_page_js("slots", "poolText", script) == [pool_text(states.pool_held, states.pool)] == ["KV pool 166,566 / 14,336 positions"]
    assert {r["state"] for r in states.rows()} == {"idle", "prompt", "decoding"}


def test_a_page_opened_later_gets_the_slots_as_they_are():
    feed = ge.Feed()
    before = feed.join()
    feed.on_slots(m.SlotStates((0, 9), (0, 30), (0, 0), (0, 30), (0, 4), (0, 34), 2048))
    feed.on_slots(m.SlotStates((5, 9), (20, 30), (0, 0), (16, 30), (0, 5), (20, 35), 2048))
    assert before.take().count(b"event: slots") == 2
    slots = json.loads(feed.last["slots"].split(b"data: ")[1])["slots"]  # what a new page is sent first
    assert [(s["id"], s["state"], s["processed"], s["decoded"]) for s in slots] == [(0, "prompt", 16, 0), (1, "decoding", 30, 5)]
    last = json.loads(feed.last["slots"].split(b"data: ")[1])
    assert (last["held"], last["pool"]) == (55, 2048)


@pytest.mark.integration
def test_page_and_events_through_the_gateway(start_gateway):
    import zmq

    from moe_pipe.shared.wire import ipc

    svc = start_gateway()
    status, headers, body = get(svc, "/")
    assert status == 200 and headers["Content-Security-Policy"] == ge.CSP and b'<script src="/web/app.js"' in body
    assert headers["X-Content-Type-Options"] == "nosniff" and headers["Content-Type"].startswith("text/html")
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        status, headers, body = get(svc, f"/web/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind) and body == WEB.joinpath(name).read_bytes()
    assert get(svc, "/web/../gateway.py")[0] == 404 and get(svc, "/web/secret.txt")[0] == 404
    for path in ("/", "/events", "/web/app.js"):  # as the API: pages elsewhere may not use it
        status, _, body = get(svc, path, {"Origin": "http://evil.example"})
        assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed"
    assert get(svc, "/", {"Origin": f"http://127.0.0.1:{svc.port}"})[0] == 200

    # telemetry's feed, played by this test: every record becomes one token event
    ctx = zmq.Context()
    pub = ipc.bind(ctx, ipc.Endpoints(svc.rt.path), "telemetry_pub")
    conn = http.client.HTTPConnection(svc.host, svc.port, timeout=10)
    conn.request("GET", "/events")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    (_, hello), *_ = read_events(resp, 1, ("hello",))
    assert (
        hello["model"] == "tiny"
        and hello["config"]["gateway"] == {**Config().to_dict()["gateway"], "port": 0}
        and hello["layers"] > 0
        and hello["experts"] > 0
        and hello["n_expert_used"] == hello["n_expert_used_model"] > 0  # the model's own: not lossy
    )
    deadline = time.monotonic() + 10
    while True:  # PUB/SUB delivers only once the gateway's subscription has reached us: until then, again each second
        ipc.send(pub, record(0))
        (kind, _), *_ = read_events(resp, 1, ("token", "status"))
        if kind == "token":
            break
        assert time.monotonic() < deadline, "no token event"
    for step in range(1, 21):
        ipc.send(pub, record(step, req_id=7))
    rows = [r for _, r in read_events(resp, 20)]
    assert [r["step"] for r in rows] == list(range(1, 21)) and rows[-1]["wall_ms"] == 30.0 and rows[-1]["req_id"] == 7
    # a prompt's progress, any client's, for the header's line
    ipc.send(pub, m.PromptProgress(8, 3664, 512, 1536, 29_700))
    (_, prompt), *_ = read_events(resp, 1, ("prompt",))
    assert prompt == {"req_id": 8, "total": 3664, "cache": 512, "processed": 1536, "time_ms": 29_700}
    # what compute's slots are doing (gateway.parallel above 1)
    ipc.send(pub, m.SlotStates((8, 0), (3664, 0), (512, 0), (1536, 0), (0, 0), (1536, 0), 8192))
    (_, slots), *_ = read_events(resp, 1, ("slots",))
    assert slots["slots"] == m.SlotStates((8, 0), (3664, 0), (512, 0), (1536, 0), (0, 0), (1536, 0), 8192).rows()
    assert [s["state"] for s in slots["slots"]] == ["prompt", "idle"]
    (_, status_event), *_ = read_events(resp, 1, ("status",))
    first = [r["step"] for r in status_event["first"]]  # step 0 once per copy that got through, then 1, 2, ...
    assert status_event["supervisor"] is None and len(first) == ge.FIRST_TOKENS and first == sorted(first) and 1 in first
    # SIGTERM with a page still open: the gateway ends its stream (the last, empty chunk), rather than
    # the handler being cancelled after the shutdown grace, and exits 0
    svc.proc.terminate()
    raw = []
    while line := resp.fp.readline():  # read raw, as read_events does
        raw.append(line)
    assert raw[-2:] == [b"0\r\n", b"\r\n"]
    svc.proc.join(10)
    assert svc.proc.exitcode == 0
    conn.close()
    pub.close(0)
    ctx.term()


@pytest.mark.integration
def test_with_an_api_key_the_page_loads_but_its_events_need_the_key(start_gateway):
    svc = start_gateway({"gateway.api_key": "s3cret"})
    assert get(svc, "/")[0] == 200  # the page itself asks for the key
    status, _, body = get(svc, "/events")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(svc, "/events", key="wrong")[0] == 401
    conn = http.client.HTTPConnection(svc.host, svc.port, timeout=10)
    conn.request("GET", "/events", headers={"Authorization": "Bearer s3cret"})
    resp = conn.getresponse()
    assert resp.status == 200
    (_, hello), *_ = read_events(resp, 1, ("hello",))
    assert hello["model"] == "tiny" and hello["config"]["gateway"]["api_key"] == "***"  # the config, its secret redacted
    conn.close()


@pytest.mark.parametrize("name", sorted(ge.WEB_FILES))
def test_the_web_files_ship_with_the_package(name):
    assert WEB.joinpath(name).is_file()  # CI installs the package (not editable): pyproject's package-data


@pytest.mark.integration  # node runs the page's own function
def test_the_page_shows_the_replys_steady_rate_as_the_run_summary_takes_it():
    from moe_pipe.shared import telemetry as tm
    from moe_pipe.shared.wire.messages import TokenRecord

    # an earlier reply's rows, then this reply's: a slow head, a steady tail, one verify pass
    walls = [900.0, 400.0, 300.0] + [100.0] * 9 + [120.0, 80.0, 100.0, 110.0]
    accepted = [0] * 14 + [2, 0]
    rows = [{"req_id": 1, "wall_ms": 50.0, "accepted": 0}] * 5
    rows += [{"req_id": 2, "wall_ms": w, "accepted": a} for w, a in zip(walls, accepted)]
    cases = [rows[: 5 + n] for n in (1, 4, 9, len(walls))]
    shown = run_page_js("steady", "steadyText", f"for (const rows of {json.dumps(cases)}) console.log(steadyText(rows));")
    want = []
    for case in cases:
        tally = tm.Tally()
        for i, r in enumerate(x for x in case if x["req_id"] == 2):
            tally.add(TokenRecord(i + 1, r["wall_ms"], 0.0, 0.0, 0, 0.0, 0.0, 0.0, 0, 0.0, accepted=r["accepted"]))
        want.append(f"{tally.summary(0.0, 0).steady_tok_s:.1f} tok/s")
    assert shown == want
