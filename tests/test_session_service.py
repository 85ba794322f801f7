"""Sessions through real processes (docs/conversations.md): `moe-pipe run
--session FILE` on the resident path and through the pipeline, and the
service's prefix reuse (usage.prompt_tokens_details.cached_tokens, cache_prompt)
and llama.cpp's slot endpoints against a running `moe-pipe up`."""

from __future__ import annotations

import json
import subprocess

import pytest

from moe_pipe.procs.gateway import ConfigDefaults, slot_filename
from moe_pipe.shared.config import Config, apply_overrides
from moe_pipe.shared.serve.openai_api import ApiError, fit_max_tokens, parse_request

from .test_service import CLI, CONFIG, MODEL, Service

pytestmark = pytest.mark.integration  # runs and services are processes


# Longer than one prefill batch (64 tokens), so reuse spans batches (docs/conversations.md § Prefix reuse).
STORY = "The old mill stood by the river, and every morning the miller climbed the hill to open the sluice. " * 4


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "run", CONFIG, *args], capture_output=True, text=True, timeout=300)


def test_run_session_reuses_saves_and_refuses_another_model_s_file(tmp_path, model):
    prompt = ["-p", STORY, "-n", "6", "--output-format", "json"]
    out = {}
    for path in ("--no-stream", ""):
        f = tmp_path / f"s{len(path)}.bin"
        first = json.loads(run(*prompt, "--session", str(f), *([path] if path else [])).stdout)
        assert first["timings"]["prompt_cached"] == 0 and f.stat().st_size > 0
        r = run(*prompt, "--session", str(f), *([path] if path else []))
        assert r.returncode == 0, r.stderr
        second = json.loads(r.stdout)
        assert second["timings"]["prompt_cached"] == len(second["prompt_tokens"]) - 1 > 64  # all but the last token
        out[path] = second
    assert out["--no-stream"]["tokens"] == out[""]["tokens"]  # the pipeline's compute restores what run saved
    # a session of the tiny model, given to a copy of another size: refused in one line, exit 2
    with open(model, "ab") as fh:
        fh.write(b"\0" * 4096)
    r = subprocess.run(
        [*CLI, "run", str(model), *prompt, "--no-stream", "--session", str(tmp_path / "s11.bin")], capture_output=True, text=True
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "saved with another model file" in last and "Traceback" not in r.stderr, r.stderr


def test_slot_filenames_and_the_context_shift_budget():
    for bad in ("../x", "a/b", "..", ".", "", "x\0", 5, None, "a..b"):
        with pytest.raises(ApiError) as err:
            slot_filename({"filename": bad})
        assert (err.value.status, err.value.param) == (400, "filename")
    assert slot_filename({"filename": "chat-1.bin"}) == "chat-1.bin"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 500}
    plain = ConfigDefaults(apply_overrides(Config(), {"compute.ctx_size": 64}), "tiny")
    with pytest.raises(ApiError, match="over the context"):
        fit_max_tokens(parse_request(body, False, plain), 10, plain)
    shifting = ConfigDefaults(apply_overrides(Config(), {"compute.ctx_size": 64, "generate.context_shift": True}), "tiny")
    assert fit_max_tokens(parse_request(body, False, shifting), 10, shifting) == 500
    assert parse_request({**body, "cache_prompt": False}, False, plain).cache_prompt is False
    with pytest.raises(ApiError, match="'cache_prompt' must be true or false"):
        parse_request({**body, "cache_prompt": 0}, False, plain)
    # llama.cpp's id_slot: -1 or absent for any slot, else a slot's number (the gateway checks it exists)
    assert [parse_request({**body, **extra}, False, plain).id_slot for extra in ({}, {"id_slot": -1}, {"id_slot": 3})] == [None, None, 3]
    for bad in (-2, 64, "1", 1.0, True):
        with pytest.raises(ApiError) as err:
            parse_request({**body, "id_slot": bad}, False, plain)
        assert (err.value.status, err.value.param) == (400, "id_slot")


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    slots = tmp_path_factory.mktemp("slots")
    s = Service("--slot-save-path", str(slots))
    s.slots = slots
    yield s
    s.close()


def post(svc, action: str, body: dict | None = None, slot: int | str = 0) -> tuple[int, dict]:
    """(status, JSON answer) of POST /slots/{slot}?action=..."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(f"{svc.url}/slots/{slot}?action={action}", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_service_reuses_prefixes_and_saves_and_restores_its_slot(svc):
    client = svc.client()
    convo = [{"role": "user", "content": STORY}]

    def turn(messages, **kw):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, **kw)

    first = turn(convo)
    reply = first.choices[0].message.content
    longer = [*convo, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    second = turn(longer)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # all of the first prompt and the reply (up to where the template renders it anew) is reused
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert turn(longer, extra_body={"cache_prompt": False}).usage.prompt_tokens_details.cached_tokens == 0

    saved = post(svc, "save", {"filename": "a.bin"})[1]
    assert saved["filename"] == "a.bin" and saved["n_saved"] > 0 and saved["n_written"] == (svc.slots / "a.bin").stat().st_size
    assert post(svc, "erase")[1]["n_erased"] == saved["n_saved"]
    assert turn(longer).usage.prompt_tokens_details.cached_tokens == 0  # erased: nothing to reuse
    post(svc, "erase")
    restored = post(svc, "restore", {"filename": "a.bin"})[1]
    assert restored["n_restored"] == saved["n_saved"]
    again = turn(longer)
    # all of it held: the last token always reruns
    assert again.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert again.choices[0].message.content == turn(longer).choices[0].message.content

    assert post(svc, "save", {"filename": "../escape.bin"})[0] == 400
    assert post(svc, "restore", {"filename": "missing.bin"})[0] == 404
    (svc.slots / "cut.bin").write_bytes((svc.slots / "a.bin").read_bytes()[:100])
    status, answer = post(svc, "restore", {"filename": "cut.bin"})
    assert status == 400 and "truncated" in answer["error"]["message"]
    assert post(svc, "load", {"filename": "a.bin"})[0] == 400
    for slot in (1, "x", "-1"):  # one slot (gateway.parallel 1): slot 0 only, and a request may pin only it
        status, answer = post(svc, "erase", slot=slot)
        assert status == 400 and answer["error"]["param"] == "id_slot", answer
    assert "it has only slot 0 (gateway.parallel is 1)" in post(svc, "erase", slot=1)[1]["error"]["message"]
    import openai

    with pytest.raises(openai.BadRequestError, match="'id_slot' 1 is not a slot of this service"):
        turn(longer, extra_body={"id_slot": 1})
    assert turn(longer, extra_body={"id_slot": 0}).choices[0].message.content == again.choices[0].message.content
    import urllib.request

    with urllib.request.urlopen(f"{svc.url}/metrics", timeout=60) as resp:
        metrics = resp.read().decode()
    counted = float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("moe_pipe_prompt_tokens_cached_total ")))
    assert counted >= cached + again.usage.prompt_tokens_details.cached_tokens


def test_without_a_slot_folder_the_endpoints_say_how_to_enable_them():
    s = Service()
    try:
        status, answer = post(s, "save", {"filename": "a.bin"})
        assert status == 501 and "slot_save_path" in answer["error"]["message"]
    finally:
        s.close()
