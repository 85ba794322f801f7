"""A model's GGUF header before its download: the first bytes of each file of
the set, fetched by HTTP range request and kept on disk.

    cached_header(repo, quant)             -> RemoteHeader | None   the kept header, no network
    fetch_header(repo, quant, on_status)   -> RemoteHeader          the kept header, else fetched now
    RemoteHeader.open()                    -> ModelFile             header-only (gguf/model_file.py)

A GGUF keeps everything but the weights in front: metadata, the tokenizer
and the tensor table (names, types, shapes, offsets), 1-8 MB for the
catalog's models against 5-80 GB of weights. The set is found as `pull`
finds it (the repository's tree listing, client.choose); then each file's
first FIRST_BYTES are asked for, and the reader (GGUFFile.from_headers, the
whole file's size declared) says whether its header is complete or how far it
runs (HeaderIncomplete): the next request asks for the bytes after those at
hand, at least twice as many. The header's bytes are kept under moe-pipe's
cache folder:

    headers/ORG--NAME/QUANT.json           the set: each file's path, size, sha256, header file
    headers/ORG--NAME/PATH.header          the first bytes of that file

each written whole or not at all (a temporary name, then a rename; the
index last), so a kept header is reused with no request at all, offline
included. Each file's size is the listing's, checked against the total in
each reply's Content-Range (the header is opened with it declared). A
server that ignores the Range header and sends the whole file is read only
as far as asked: the stream is closed there.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import GGUFError, UserError
from ..makemodel.default_model import cache_dir
from . import client

FIRST_BYTES = 2 << 20  # most catalog headers are 1-8 MB: one or two requests
MAX_HEADER_BYTES = 128 << 20  # the reader's caps (keys, tensors, array elements) bound a header far below this
REQUEST_TIMEOUT_S = 20.0
INDEX_VERSION = 1


@dataclass(frozen=True)
class RemoteHeader:
    repo: str
    quant: str
    files: tuple[tuple[str, int, str], ...]  # (path in the repository, whole file bytes, header file here)
    fetched_bytes: int  # bytes fetched this time (0: all from the cache)
    requests: int  # range requests made this time

    @property
    def header_bytes(self) -> int:
        return sum(os.path.getsize(h) for _, _, h in self.files)

    @property
    def file_bytes(self) -> int:
        return sum(n for _, n, _ in self.files)

    @property
    def cached(self) -> bool:
        return self.requests == 0

    def open(self, align: int | None = None):
        from ..gguf.model_file import open_header_model

        return open_header_model([(h, n) for _, n, h in self.files], align)


def headers_dir(repo: str) -> Path:
    return cache_dir() / "headers" / repo.replace("/", "--")


def _index_path(repo: str, quant: str) -> Path:
    return headers_dir(repo) / f"{quant.upper()}.json"


def _write_whole(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cached_header(repo: str, quant: str) -> RemoteHeader | None:
    """The header kept for repo:quant, when its index and every header file are there."""
    try:
        index = json.loads(_index_path(repo, quant).read_text())
        files = tuple((str(f["path"]), int(f["size"]), str(headers_dir(repo) / f["header"])) for f in index["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if index.get("version") != INDEX_VERSION or not files or not all(os.path.isfile(h) for _, _, h in files):
        return None
    return RemoteHeader(repo, quant.upper(), files, 0, 0)


def fetch_header(repo: str, quant: str, on_status: Callable[[str], None] | None = None) -> RemoteHeader:
    """The header of repo:quant's GGUF set: kept, or fetched now by range requests (and kept).
    No network, a refused connection, an HTTP error: a one-line UserError in seconds
    (client.list_files fails fast). A header that does not parse: the reader's GGUFError."""
    kept = cached_header(repo, quant)
    if kept is not None:
        return kept
    say = on_status or (lambda text: None)
    say(f"listing {repo}")
    chosen = client.choose(repo, client.gguf_sets(client.list_files(repo)), quant)
    bad = client.incomplete_sets([chosen])
    if bad:
        raise client.PullError(f"{repo}: the split set is incomplete on the Hub: {bad[0]}")
    fetched, requests, files = 0, 0, []
    for i, remote in enumerate(chosen.files):
        where = f"{remote.name}" + (f" ({i + 1}/{len(chosen.files)})" if len(chosen.files) > 1 else "")

        def say_where(text: str, where: str = where) -> None:
            say(f"{where}: {text}")

        data, n_requests = _fetch_one(repo, remote, say_where)
        fetched, requests = fetched + len(data), requests + n_requests
        header = f"{remote.path}.header"
        _write_whole(headers_dir(repo) / header, data)
        files.append({"path": remote.path, "size": remote.size, "sha256": remote.sha256, "header": header})
    index = {"version": INDEX_VERSION, "repo": repo, "quant": chosen.quant, "files": files, "fetched_at": time.time()}
    _write_whole(_index_path(repo, quant), json.dumps(index, indent=1).encode())
    got = cached_header(repo, quant)
    if got is None:  # written just now: only a folder that cannot be written gets here
        raise UserError(f"cannot keep the fetched header under {headers_dir(repo)}")
    return RemoteHeader(got.repo, got.quant, got.files, fetched, requests)


def _fetch_one(repo: str, remote: client.RemoteFile, say: Callable[[str], None]) -> tuple[bytes, int]:
    """The first bytes of one file, enough for its whole header; (bytes, requests made)."""
    import tempfile

    from ..gguf.reader import GGUFFile, HeaderIncomplete

    data, requests = b"", 0
    want = min(FIRST_BYTES, remote.size)
    with tempfile.TemporaryDirectory(prefix="moe-pipe-header-") as tmp:
        probe = Path(tmp) / remote.name
        while True:
            say(f"fetching bytes {len(data):,}-{want - 1:,} of {remote.size:,}")
            data += _range(repo, remote, len(data), want)
            requests += 1
            probe.write_bytes(data)
            try:
                GGUFFile.from_headers([(probe, remote.size)]).close()
                return data, requests
            except HeaderIncomplete as exc:
                if len(data) >= remote.size:
                    raise GGUFError(f"{repo}/{remote.path}", f"truncated: {exc.problem}") from None
                want = min(remote.size, max(exc.needed, 2 * len(data)))
                if want > MAX_HEADER_BYTES:
                    raise GGUFError(
                        f"{repo}/{remote.path}", f"the header runs past {MAX_HEADER_BYTES >> 20} MiB: not a model's header"
                    ) from None
            except GGUFError as exc:
                raise GGUFError(f"{repo}/{remote.path}", exc.problem) from None


def _range(repo: str, remote: client.RemoteFile, start: int, end: int) -> bytes:
    """Bytes [start, end) of the file (a Range request; a server that sends more is cut off there)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    url = hf_hub_url(repo, remote.path, endpoint=client.endpoint())
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    try:
        with get_session().stream("GET", url, headers=headers, timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code not in (200, 206):
                raise client.PullError(f"{repo}: {client.endpoint()} answered {r.status_code} for {remote.path}")
            total = _content_range_total(r.headers.get("Content-Range", ""))
            if total is not None and total != remote.size:  # the header's declared size must be the file's
                raise client.PullError(f"{repo}: {remote.path} is {total:,} bytes, its listing says {remote.size:,}: try again later")
            skip = start if r.status_code == 200 else 0  # the whole file from byte 0: skip to `start`
            out = bytearray()
            for chunk in r.iter_bytes():
                if skip:
                    cut = min(skip, len(chunk))
                    chunk, skip = chunk[cut:], skip - cut
                out += chunk
                if len(out) >= end - start:
                    break
    except client.network_errors() as exc:
        raise client.hub_error(repo, exc) from None
    if len(out) < min(end, remote.size) - start:
        raise client.PullError(f"{repo}: {remote.path}: the connection ended after {start + len(out):,} of the {end:,} bytes asked for")
    return bytes(out[: end - start])


def _content_range_total(value: str) -> int | None:
    """The whole size in `Content-Range: bytes A-B/TOTAL`; None when absent or unknown (`*`)."""
    m = re.match(r"bytes \d+-\d+/(\d+)$", value.strip())
    return int(m.group(1)) if m else None
