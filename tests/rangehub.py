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


class RangeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Path]] = {}  # repo -> {path in the repo: file here}
        self.requests: dict[str, int] = {}  # "repo/path" or "repo (tree)" -> requests
        self.served: dict[str, int] = {}  # "repo/path" -> body bytes sent
        self.garbage: set[str] = set()  # "repo/path" served as bytes that are no GGUF
        self.ignore_range = False
        self.listed_size: dict[str, int] = {}  # "repo/path" -> the size its listing says (a file replaced since)
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _count(self, key: str, n: int = 0) -> None:
        with self.lock:
            self.requests[key] = self.requests.get(key, 0) + (n == 0)
            self.served[key] = self.served.get(key, 0) + n

    def _send(self, h, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        h.send_response(code)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def handle(self, h) -> None:
        path = h.path.split("?")[0]
        tree = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", path)
        resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        repo = (tree or resolve).group(1) if (tree or resolve) else None
        if repo not in self.repos:
            return self._send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
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
            return self._send(h, 200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
        name, key = resolve.group(3), f"{repo}/{resolve.group(3)}"
        if name not in files:
            return self._send(h, 404, b"", {"X-Error-Code": "EntryNotFound"})
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
