"""`moe-pipe pull` against a hub on loopback (no test reaches the internet):
the subset of the Hugging Face Hub API that huggingface_hub uses for it —
the tree listing (`/api/models/ORG/NAME/tree/REV`, each LFS file's size and
sha256) and `resolve/REV/FILE` with Range — reached through HF_ENDPOINT. The
repository is made here from the tiny model: one GGUF, and the same model cut
into a 3-shard split set. The server counts the bytes it serves per file, can
stall a file part-way (for a Ctrl-C mid-shard), drop a connection once, serve
a corrupted byte, or answer 401/404."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moe_pipe.cli.main import main
from moe_pipe.shared.hub.client import WRITE_CHUNK, quant_of

from .rangehub import hub_route, send, serve

CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
REPO = "test-org/Tiny-GGUF"


# ---------------------------------------------------------------- the repository


def split_in_three(src: Path, folder: Path, prefix: str) -> list[Path]:
    """`src` cut into a 3-shard split set as gguf-split writes one: the metadata and the first
    third of the tensors in shard 1, each shard a valid GGUF holding its tensors' bytes,
    split.no / split.count / split.tensors.count in each (the reader checks all three)."""
    from gguf import GGUFValueType as VT

    from .test_fuzz_gguf import Rebuild, kv, u32

    g = Rebuild.read(src)
    n = len(g.tensors)
    cuts = [0, n // 3, 2 * n // 3, n]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(3):
        part = g.tensors[cuts[i] : cuts[i + 1]]
        base = part[0]["offset"]
        end = g.tensors[cuts[i + 1]]["offset"] if i < 2 else len(g.data)
        kvs = dict(g.kvs) if i == 0 else {"general.architecture": g.kvs["general.architecture"]}
        kvs["split.no"] = kv("split.no", VT.UINT16, i.to_bytes(2, "little"))
        kvs["split.count"] = kv("split.count", VT.UINT16, (3).to_bytes(2, "little"))
        kvs["split.tensors.count"] = kv("split.tensors.count", VT.INT32, u32(n))
        shard = Rebuild(kvs, [{**t, "offset": t["offset"] - base} for t in part], g.data[base:end])
        paths.append(shard.write(folder / f"{prefix}-{i + 1:05d}-of-00003.gguf"))
    return paths


@pytest.fixture(scope="module")
def repo_files(tiny_model, tmp_path_factory) -> dict[str, bytes]:
    """The repository's files by path: a README, one GGUF, a split set in a folder, a projector."""
    work = tmp_path_factory.mktemp("hubrepo")
    shards = split_in_three(tiny_model, work / "split", "Tiny-Q8_0")
    files = {"README.md": b"# tiny\n", "Tiny-Q4_K_M.gguf": tiny_model.read_bytes(), "mmproj-Tiny-F16.gguf": b"GGUF not a model"}
    files.update({f"Q8_0/{p.name}": p.read_bytes() for p in shards})
    return files


# ---------------------------------------------------------------- the hub


class Hub:
    """A loopback hub: repositories of files, byte counters, faults."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.status: dict[str, tuple[int, dict[str, str]]] = {}  # repo -> (code, headers) for every request
        self.served: dict[str, int] = {}  # "repo/path" -> body bytes sent
        self.corrupt: set[str] = set()  # "repo/path" served with one byte flipped (the listing keeps the true sha)
        self.stall_at: dict[str, int] = {}  # "repo/path" -> after this many bytes, stop sending until released
        self.drop_at: dict[str, int] = {}  # "repo/path" -> close the connection after this many bytes, once
        self.stalled = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.server, self.url = serve(self.handle)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h) -> None:
        tree, resolve, repo = hub_route(h.path)
        if repo in self.status:
            code, headers = self.status[repo]
            return send(h, code, b'{"error": "no"}', {"Content-Type": "application/json", **headers})
        if repo not in self.repos:
            return send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        files = self.repos[repo]
        if tree:
            listing = [
                {
                    "type": "file",
                    "path": p,
                    "size": len(b),
                    "oid": hashlib.sha1(b).hexdigest(),
                    **({"lfs": {"oid": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134}} if p.endswith(".gguf") else {}),
                }
                for p, b in files.items()
            ]
            return send(h, 200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
        name = resolve.group(3)
        if name not in files:
            return send(h, 404, b"", {"X-Error-Code": "EntryNotFound"})
        key = f"{repo}/{name}"
        body = files[name]
        if key in self.corrupt:
            body = body[:1000] + bytes([body[1000] ^ 0xFF]) + body[1001:]
        start = 0
        m = re.match(r"bytes=(\d+)-$", h.headers.get("Range", ""))
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{hashlib.sha256(files[name]).hexdigest()}"',
            "Accept-Ranges": "bytes",
        }
        if m:
            start = int(m.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        part = body[start:]
        h.send_response(206 if m else 200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(part)))
        h.end_headers()
        sent = 0
        limit = self.stall_at.get(key)
        drop = self.drop_at.pop(key, None)
        for i in range(0, len(part), 64 << 10):
            chunk = part[i : i + (64 << 10)]
            if limit is not None and start + sent + len(chunk) > limit:
                chunk = chunk[: max(0, limit - start - sent)]
                h.wfile.write(chunk)
                h.wfile.flush()
                self._count(key, len(chunk))
                self.stalled.set()
                self.release.wait(60)
                h.close_connection = True
                return
            if drop is not None and start + sent + len(chunk) > drop:
                h.wfile.write(chunk[: max(0, drop - start - sent)])
                self._count(key, max(0, drop - start - sent))
                h.close_connection = True
                return
            h.wfile.write(chunk)
            sent += len(chunk)
            self._count(key, len(chunk))

    def _count(self, key: str, n: int) -> None:
        with self.lock:
            self.served[key] = self.served.get(key, 0) + n


@pytest.fixture
def hub(repo_files, tmp_path, monkeypatch):
    """The hub, with REPO on it, and this test's HF_ENDPOINT, HF_HOME and moe-pipe cache folder."""
    from .rangehub import point_hf_at

    h = Hub()
    h.repos[REPO] = dict(repo_files)
    point_hf_at(monkeypatch, h.url, tmp_path)
    yield h
    h.close()


def pull(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["pull", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def error_line(err: str) -> str:
    """The one error line (a pull may have said what it was pulling before it)."""
    errors = [line for line in err.splitlines() if line.startswith("moe-pipe: error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    return errors[0]


def models_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "moe-pipe" / "models" / REPO.replace("/", "--")


# ---------------------------------------------------------------- the cases


def test_fresh_pull_of_a_split_set_verifies_validates_and_says_how_to_run_it(hub, repo_files, tmp_path, capsys):
    code, out, err = pull(capsys, f"{REPO}:q8_0")
    assert code == 0, err
    dest = models_dir(tmp_path) / "Q8_0"
    names = sorted(p.name for p in dest.iterdir())
    assert names == [f"Tiny-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]  # no partial file left
    for name in names:
        assert (dest / name).read_bytes() == repo_files[f"Q8_0/{name}"]
    assert hub.served == {f"{REPO}/Q8_0/{n}": len(repo_files[f"Q8_0/{n}"]) for n in names}  # only the set, once
    assert str(dest / names[0]) in out and f"moe-pipe up {dest / names[0]}" in out
    record = json.loads((tmp_path / "cache" / "moe-pipe" / "pulled.json").read_text())["pulled"]
    assert [(r["repo"], r["quant"], Path(r["path"]).name) for r in record] == [(REPO, "Q8_0", names[0])]
    # pulling again fetches nothing: every file is there under its final name
    code, out, err = pull(capsys, f"{REPO}:Q8_0")
    assert code == 0 and sum(hub.served.values()) == sum(len(repo_files[f"Q8_0/{n}"]) for n in names)


def test_default_quant_is_q4_k_m_and_a_missing_one_lists_those_there(hub, tmp_path, capsys):
    code, out, err = pull(capsys, REPO)
    assert code == 0, err
    assert (models_dir(tmp_path) / "Tiny-Q4_K_M.gguf").is_file()
    code, out, err = pull(capsys, f"{REPO}:Q2_K")
    assert code == 2 and error_line(err)
    assert "no Q2_K GGUF; quants here: Q8_0, Q4_K_M" in err and "mmproj" not in err


@pytest.mark.integration
def test_ctrl_c_mid_shard_then_pull_again_fetches_only_the_rest(hub, repo_files, tmp_path):
    shard2 = "Q8_0/Tiny-Q8_0-00002-of-00003.gguf"
    size = len(repo_files[shard2])
    hub.stall_at[f"{REPO}/{shard2}"] = size * 3 // 4  # past a few of the client's write chunks (WRITE_CHUNK)
    env = {**os.environ}
    proc = subprocess.Popen([*CLI, "pull", f"{REPO}:Q8_0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert hub.stalled.wait(60), "the pull never reached the middle of shard 2"
        time.sleep(0.3)  # the bytes sent are written before the interrupt
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        hub.release.set()
    assert proc.returncode == 130, err
    dest = models_dir(tmp_path) / "Q8_0"
    partial = list(dest.glob("Tiny-Q8_0-00002-of-00003.gguf.*.incomplete"))
    assert len(partial) == 1 and 0 < partial[0].stat().st_size <= size * 3 // 4
    assert not (dest / "Tiny-Q8_0-00002-of-00003.gguf").exists()  # never taken for complete
    kept = partial[0].stat().st_size
    del hub.stall_at[f"{REPO}/{shard2}"]
    first = dict(hub.served)
    r = subprocess.run([*CLI, "pull", f"{REPO}:Q8_0"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    again = {k: v - first.get(k, 0) for k, v in hub.served.items()}
    assert again[f"{REPO}/{shard2}"] == size - kept < size  # a Range request for the rest
    assert again.get(f"{REPO}/Q8_0/Tiny-Q8_0-00001-of-00003.gguf", 0) == 0  # shard 1 was complete
    assert (dest / "Tiny-Q8_0-00002-of-00003.gguf").read_bytes() == repo_files[shard2]


def test_a_dropped_connection_resumes_where_it_stopped(hub, repo_files, tmp_path, capsys):
    name = "Tiny-Q4_K_M.gguf"
    size = len(repo_files[name])
    hub.drop_at[f"{REPO}/{name}"] = size // 3
    code, out, err = pull(capsys, f"{REPO}:Q4_K_M")
    assert code == 0, err
    # the first third once (but the chunk the drop cut short), then the rest from where it stopped
    assert size < hub.served[f"{REPO}/{name}"] <= size + WRITE_CHUNK
    assert (models_dir(tmp_path) / name).read_bytes() == repo_files[name]


def test_a_corrupted_byte_is_refused_and_not_kept(hub, tmp_path, capsys):
    hub.corrupt.add(f"{REPO}/Tiny-Q4_K_M.gguf")
    code, out, err = pull(capsys, REPO)
    assert code == 2
    assert "sha256" in error_line(err) and "does not match" in err
    assert list(models_dir(tmp_path).iterdir()) == []  # neither the final name nor the partial file
    assert not (tmp_path / "cache" / "moe-pipe" / "pulled.json").exists()


def test_a_repository_with_no_gguf(hub, capsys):
    hub.repos["test-org/no-gguf"] = {"README.md": b"x", "model.safetensors": b"y"}
    code, out, err = pull(capsys, "test-org/no-gguf")
    assert code == 2 and "holds no GGUF file" in err and error_line(err)


def test_404_and_401_are_one_line(hub, capsys):
    code, out, err = pull(capsys, "test-org/missing")
    assert code == 2 and "no such repository" in err and error_line(err)
    hub.status["test-org/private"] = (401, {"X-Error-Message": "Invalid credentials in Authorization header"})
    code, out, err = pull(capsys, "test-org/private")
    assert code == 2 and "refused the request (401)" in err and "HF_TOKEN" in err and error_line(err)


def test_bad_repository_names_are_refused(capsys):
    code, out, err = pull(capsys, "not a repo")
    assert code == 2 and "ORG/NAME[:QUANT]" in err


@pytest.mark.integration
def test_disk_short_is_refused_before_the_first_byte(hub, tmp_path, capsys):
    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        code, out, err = pull(capsys, REPO, "--dir", str(small))
        assert code == 2 and "not enough free space" in err and error_line(err)
        assert sum(hub.served.values()) == 0 and list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=False)
    shutil.rmtree(small, ignore_errors=True)


def _closed_port() -> int:
    """A localhost port nothing listens on: a connection to it is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.parametrize("where", ["refused", "no-such-host"])
def test_no_network_is_one_line_within_5_s(where, tmp_path):
    """A refused connection or a host that does not resolve: one error line with the hint,
    within 5 s (huggingface_hub's retries took 24 s and eleven lines), from the real entry point."""
    import time

    url = f"http://127.0.0.1:{_closed_port()}" if where == "refused" else "http://nonexistent.invalid"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")}
    env |= {"HF_ENDPOINT": url, "XDG_CACHE_HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")}
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "moe_pipe.cli.main", "pull", "test-org/tiny"], env=env, capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t0
    assert took < 5.0, f"{took:.1f} s"
    cause = "connection refused" if where == "refused" else "nonexistent.invalid does not resolve"
    [line] = r.stderr.splitlines()
    assert r.returncode == 2 and r.stdout == ""
    assert line.startswith(f"moe-pipe: error: test-org/tiny: cannot reach {url}: {cause}"), line
    assert "HF_ENDPOINT" in line and "mirror" in line and "moe-pipe up FILE.gguf" in line, line


def test_a_retry_is_one_short_line():
    """huggingface_hub's two warnings per retry (the error with the whole URL, then the wait)
    become one line while pulling, and nothing of the library's own output."""
    import io
    import logging

    from moe_pipe.shared.hub.network import quiet_retries

    log = logging.getLogger("huggingface_hub.utils._http")
    out = io.StringIO()
    with quiet_retries(out):
        log.warning("'[Errno 104] Connection reset by peer' thrown while requesting GET http://hub/" + "x" * 300)
        log.warning("Retrying in 2s [Retry 2/5].")
        log.warning("HTTP Error 503 thrown while requesting GET http://hub/y")
        log.warning("Retrying in 4s [Retry 3/5].")
    assert out.getvalue().splitlines() == [
        "moe-pipe: [Errno 104] Connection reset by peer; retry 2/5 in 2 s",
        "moe-pipe: HTTP 503; retry 3/5 in 4 s",
    ]
    assert log.propagate and not any(type(h).__name__ == "RetryLines" for h in log.handlers)  # put back


def test_the_quant_tag_of_a_file_name():
    """What `pull REPO:QUANT` matches against: the last quant-like part of the name."""
    assert quant_of("Qwen3-30B-A3B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("UD/Qwen3-30B-A3B-UD-IQ1_S-00001-of-00002.gguf") == "IQ1_S"
    assert quant_of("gpt-oss-120b-MXFP4_MOE.gguf") == "MXFP4_MOE"
    assert quant_of("Qwen3.5-35B-A3B-nvfp4.gguf") == "NVFP4"
    assert quant_of("model.gguf") == "?"
