"""A secret set by the user never leaves the process that needs it: plant an
API key the way docs/security.md says to set one (a config file only you can
read), start a real service and a `run` with it, make requests, and grep
every output channel for it — stdout and stderr of each command, `status
--json`, `tail --csv`, the CSV and JSONL telemetry, the service's log and
every file in its runtime folder — while the key still guards the API."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from moe_pipe.shared.config import REDACTED, Config, apply_overrides
from moe_pipe.shared.errors import ConfigError
from moe_pipe.shared.serve.service import API_KEY_FILE

from .servicehelp import terminate

CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
SECRET = "PLANTED-SECRET-123"


def test_a_secret_key_reads_as_redacted_in_the_record_the_repr_and_errors():
    cfg = apply_overrides(Config(), {"gateway.api_key": SECRET})
    assert cfg.gateway.api_key == SECRET  # the process that needs it has it
    assert cfg.to_dict()["gateway"]["api_key"] == REDACTED
    assert apply_overrides(Config(), {}).to_dict()["gateway"]["api_key"] is None  # unset stays unset
    assert SECRET not in repr(cfg) and SECRET not in repr(cfg.gateway)
    with pytest.raises(ConfigError) as err:
        apply_overrides(Config(), {"gateway.api_key": SECRET + " with a space"})
    assert "gateway.api_key" in str(err.value) and SECRET not in str(err.value)


def _files_text(root: Path) -> dict[str, str]:
    """Every regular file under root (sockets and the like skipped), as text;
    but the one file that holds the key on purpose, checked to be the owner's alone."""
    out = {}
    for p in root.rglob("*"):
        try:
            if p.name == API_KEY_FILE and p.parent.parent.name == "moe-pipe":  # RUNTIME/moe-pipe/PID/api-key, for `chat`
                assert p.stat().st_mode & 0o077 == 0, f"{p} is readable by others"
            elif p.is_file():
                out[str(p)] = p.read_bytes().decode("utf-8", "replace")
        except OSError:
            pass
    return out


def _http(url: str, key: str | None, body: dict | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


@pytest.mark.integration
def test_a_planted_api_key_is_in_no_output_and_still_guards_the_api():
    base = Path(tempfile.mkdtemp(prefix="mpk", dir="/tmp"))  # short: unix socket paths <= 107 bytes
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base / "rt")}
    (base / "rt").mkdir(mode=0o700)
    config = base / "secret.toml"
    text = TINY.read_text().replace("[gateway]\n", f'[gateway]\napi_key = "{SECRET}"\n')
    text = text.replace('# csv = "tiny-run.csv"', 'csv = "service.csv"')
    assert SECRET in text and 'csv = "service.csv"' in text
    config.write_text(text)
    config.chmod(0o600)
    seen: dict[str, str] = {}  # channel -> what it carried
    tail = None
    pid = None

    def cli(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        r = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout)
        seen[f"{name} stdout"], seen[f"{name} stderr"] = r.stdout, r.stderr
        return r

    try:
        up = cli("up", "up", str(config), "--detach", "--port", "0", "--set", "supervisor.start_secs=0.5")
        assert up.returncode == 0, up.stderr
        st = cli("status", "status", "--json")
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        pid, url = status["pid"], status["url"]
        tail = subprocess.Popen([*CLI, "tail", "--csv", "--wait", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)

        body = {"model": status["model_name"], "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        assert _http(f"{url}/v1/chat/completions", None, body)[0] == 401
        assert _http(f"{url}/v1/chat/completions", "wrong-key", body)[0] == 401
        code, reply = _http(f"{url}/v1/chat/completions", SECRET, body)
        assert code == 200, reply
        seen["a reply"] = reply.decode()
        code, refused = _http(f"{url}/v1/chat/completions", SECRET, {**body, "max_tokens": "x"})
        assert code == 400
        seen["an error reply"] = refused.decode()
        seen.update(_files_text(base / "rt"))  # the runtime folder (log, service.json, ...) goes with `down`

        run = cli("run", "run", str(config), "-p", "hi", "-n", "4", "--output-format", "json", "--csv", str(base / "run.csv"))
        assert run.returncode == 0, run.stderr
        bad = cli("bad value", "run", str(config), "-p", "hi", "--set", f"gateway.api_key={SECRET} spaced")
        assert bad.returncode == 2 and "gateway.api_key" in bad.stderr

        down = cli("down", "down", timeout=120)
        assert down.returncode == 0, down.stderr
        tail.send_signal(signal.SIGINT)
        out, err = tail.communicate(timeout=30)
        seen["tail stdout"], seen["tail stderr"] = out, err
    finally:
        if tail is not None and tail.poll() is None:
            tail.kill()
            tail.communicate()
        terminate(pid)  # a failed test still stops its service
        files = _files_text(base)
        shutil.rmtree(base, ignore_errors=True)
    files.pop(str(config))  # where the user put it
    seen.update(files)

    # The channels that would leak it were written, and say the key is set without showing it.
    for csv in ("service.csv", "run.csv"):
        assert f"# config.gateway.api_key={REDACTED}" in seen[str(base / csv)], csv
        assert f'"gateway.api_key":"{REDACTED}"' in seen[str(base / csv).replace(".csv", ".jsonl")], csv
    assert any(name.endswith("moe-pipe.log") for name in seen), sorted(seen)
    leaks = sorted(name for name, text in seen.items() if SECRET in text)
    assert not leaks, f"the planted key is in: {leaks}"
