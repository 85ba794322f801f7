"""A loopback hub that serves files from disk with Range requests
(tests/test_header.py, tests/test_preview.py; the `range_hub` fixture in tests/conftest.py): the tree listing
(`/api/models/ORG/NAME/tree/REV`) and `ORG/NAME/resolve/REV/PATH` with
`Range: bytes=A-B` or `bytes=A-`, reached through HF_ENDPOINT. It counts the
requests and the body bytes it sends per file, and can send garbage in place
of a file or ignore Range (a server that sends the whole file). Files are
read from disk as asked, so a sparse 1 GB model costs what is sent."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def serve(handle) -> tuple[ThreadingHTTPServer, str]:
    """A loopback HTTP/1.1 server on a free port whose GETs go to `handle(request_handler)`,
    serving on a daemon thread: (server, its URL). Shared with tests/test_pull.py's hub."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            handle(self)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def send(h, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    """One whole HTTP reply on request handler `h`."""
    h.send_response(code)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def hub_route(raw_path: str) -> tuple[re.Match | None, re.Match | None, str | None]:
    """The Hub's two routes a pull uses: (the tree listing's match, the file's match, the repository)."""
    path = raw_path.split("?")[0]
    tree = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", path)
    resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
    return tree, resolve, (tree or resolve).group(1) if (tree or resolve) else None


def point_hf_at(monkeypatch, url: str, tmp_path: Path) -> None:
    """huggingface_hub (and moe-pipe's caches) pointed at a loopback hub at `url`, online, with no token."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", url)
    # read once at import, and this process has imported it: as HF_ENDPOINT would have set them
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("MOE_PIPE_MODELS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class RangeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Path]] = {}  # repo -> {path in the repo: file here}
        self.requests: dict[str, int] = {}  # "repo/path" or "repo (tree)" -> requests
        self.served: dict[str, int] = {}  # "repo/path" -> body bytes sent
        self.garbage: set[str] = set()  # "repo/path" served as bytes that are no GGUF
        self.ignore_range = False
        self.listed_size: dict[str, int] = {}  # "repo/path" -> the size its listing says (a file replaced since)
        self.lock = threading.Lock()
        self.server, self.url = serve(self.handle)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _count(self, key: str, n: int = 0) -> None:
        with self.lock:
            self.requests[key] = self.requests.get(key, 0) + (n == 0)
            self.served[key] = self.served.get(key, 0) + n

    def handle(self, h) -> None:
        tree, resolve, repo = hub_route(h.path)
        if repo not in self.repos:
            return send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        files = self.repos[repo]
        if tree:
            self._count(f"{repo} (tree)")
            listing = [
                {
                    "type": "file",
                    "path": p,
                    "size": n,
                    "oid": "0" * 40,
                    "lfs": {"oid": "f" * 64, "size": n, "pointerSize": 134},
                }
                for p, f in files.items()
                for n in [self.listed_size.get(f"{repo}/{p}", f.stat().st_size)]
            ]
            return send(h, 200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
        name, key = resolve.group(3), f"{repo}/{resolve.group(3)}"
        if name not in files:
            return send(h, 404, b"", {"X-Error-Code": "EntryNotFound"})
        self._count(key)
        size = files[name].stat().st_size
        m = re.match(r"bytes=(\d+)-(\d*)$", h.headers.get("Range", ""))
        start, end = 0, size
        if m and not self.ignore_range:
            start, end = int(m.group(1)), min(size, int(m.group(2)) + 1 if m.group(2) else size)
        h.send_response(206 if m and not self.ignore_range else 200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Accept-Ranges", "bytes")
        if m and not self.ignore_range:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        h.send_header("Content-Length", str(end - start))
        h.end_headers()
        with open(files[name], "rb") as fh:
            fh.seek(start)
            pos = start
            try:
                while pos < end:
                    chunk = fh.read(min(256 << 10, end - pos))
                    if key in self.garbage:
                        chunk = bytes(len(chunk)) if pos else b"GGUF\x03\x00\x00\x00" + b"\xff" * (len(chunk) - 8)
                    h.wfile.write(chunk)
                    pos += len(chunk)
                    self._count(key, len(chunk))
            except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: what it asked for is there
                h.close_connection = True
