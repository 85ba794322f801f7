"""`moe-pipe pull` on the Hugging Face Hub: list a repository's GGUFs, choose
the quant (and every shard of a split set), check free space for the whole
remaining set, download with resume, verify each file's sha256 against the
Hub's metadata and open the result with our GGUF reader.

It speaks to the Hub through `huggingface_hub`: the tree listing
(`HfApi.list_repo_tree`, which carries each LFS file's size and sha256), the
file URL (`hf_hub_url`), the headers with the user's token (`HF_TOKEN` or
`hf auth login`), `HF_ENDPOINT`, `HF_HUB_OFFLINE`, and its HTTP transfer
(`http_get`: retries a dropped connection from where it stopped). The
transfer is driven here rather than through `hf_hub_download` because that
(2.x) writes each attempt to a process-unique temporary file that it deletes
when the attempt fails, so a pull stopped by Ctrl-C or a kill would start
over; here the partial file `NAME.<sha256[:16]>.incomplete` stays beside its
final name and the next pull asks only for the bytes after it (a Range
request). A file gets its final name only once its sha256 matches, so a
half-downloaded or corrupt file is never taken for a complete one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import GGUFError, UserError
from . import network

DEFAULT_QUANT = "Q4_K_M"
HASH_CHUNK = 8 << 20
# huggingface_hub writes what it receives in chunks of this (its default, 10 MiB, is held in memory until
# full): what a Ctrl-C or a dropped connection loses, and how often the progress bar moves
WRITE_CHUNK = 256 << 10
# a quant tag in a file name: Q4_K_M, Q8_0, IQ4_XS, Q4_K_XL, BF16, MXFP4, MXFP4_MOE, NVFP4, TQ1_0 ...
_QUANT = re.compile(r"^(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|MXFP4(?:_MOE)?|NVFP4)$", re.IGNORECASE)
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class PullError(UserError):
    """A pull that cannot go on: one line, exit code 2."""


@dataclass(frozen=True)
class RemoteFile:
    path: str  # in the repository
    size: int
    sha256: str | None  # the LFS object id; None for a file kept in git itself

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name


@dataclass(frozen=True)
class GgufSet:
    """One model in a repository: a single GGUF, or every shard of a split set."""

    quant: str  # the tag in its file name, upper case ("?" when it has none)
    files: tuple[RemoteFile, ...]

    @property
    def first(self) -> RemoteFile:
        return self.files[0]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def label(self) -> str:
        more = f" (+{len(self.files) - 1} shards)" if len(self.files) > 1 else ""
        return f"{self.quant} {self.first.path}{more} {self.size / 1e9:.2f} GB"


def parse_ref(ref: str) -> tuple[str, str | None]:
    """`org/name[:QUANT]` (a pasted `https://huggingface.co/org/name` is fine) -> (repo, quant)."""
    text = re.sub(r"^https?://(www\.)?(hf\.co|huggingface\.co)/", "", ref.strip()).rstrip("/")
    repo, _, quant = text.partition(":")
    if not _REPO.match(repo):
        raise PullError(f"{ref!r} is not a Hugging Face repository: expected ORG/NAME[:QUANT], e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")
    return repo, (quant or None)


def quant_of(path: str) -> str:
    """The quant tag of a GGUF's file name (the last one in it), upper case; "?" when none."""
    stem = PurePosixPath(path).name
    m = _SPLIT.match(stem)
    stem = m["prefix"] if m else stem.removesuffix(".gguf")
    tags = [t for t in re.split(r"[-.]", stem) if _QUANT.match(t)]
    return tags[-1].upper() if tags else "?"


def gguf_sets(files: list[RemoteFile]) -> list[GgufSet]:
    """The repository's models: split shards grouped (in order), projector files (mmproj) left out."""
    groups: dict[str, list[RemoteFile]] = {}
    for f in files:
        if not f.path.lower().endswith(".gguf") or f.name.lower().startswith("mmproj"):
            continue
        m = _SPLIT.match(f.path)
        groups.setdefault(m["prefix"] if m else f.path, []).append(f)
    sets = [GgufSet(quant_of(fs[0].path), tuple(sorted(fs, key=lambda f: f.path))) for fs in groups.values()]
    return sorted(sets, key=lambda s: s.first.path)


def incomplete_sets(sets: list[GgufSet]) -> list[str]:
    """Split sets the repository does not hold every shard of."""
    bad = []
    for s in sets:
        m = _SPLIT.match(s.first.path)
        if m and len(s.files) != int(m["count"]):
            bad.append(f"{s.first.path}: {len(s.files)} of {int(m['count'])} shards")
    return bad


def choose(repo: str, sets: list[GgufSet], quant: str | None, file: str | None = None) -> GgufSet:
    """The set asked for: by file name (any shard), by quant (case-insensitive; Q4_K_M when none is
    asked for, or the only set the repository has), or a one-line error listing what exists."""
    if not sets:
        raise PullError(f"{repo}: the repository holds no GGUF file (moe-pipe runs GGUFs; `moe-pipe convert` makes one from a checkpoint)")
    listing = "; ".join(s.label() for s in sets)
    if file is not None:
        hit = [s for s in sets if any(f.path == file or f.name == file for f in s.files)]
        if not hit:
            raise PullError(f"{repo}: no GGUF file {file!r}; it holds: {listing}")
        return hit[0]
    want = (quant or DEFAULT_QUANT).upper()
    hit = [s for s in sets if s.quant == want]
    if not hit and quant is None and len(sets) == 1:
        return sets[0]
    if not hit:
        exists = ", ".join(dict.fromkeys(s.quant for s in sets))
        raise PullError(f"{repo}: no {want} GGUF; quants here: {exists} ({listing}); pick one with {repo}:QUANT or --file NAME")
    if len(hit) > 1:
        raise PullError(f"{repo}: {len(hit)} {want} GGUFs ({'; '.join(s.label() for s in hit)}); pick one with --file NAME")
    return hit[0]


# ---------------------------------------------------------------- the Hub


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_error(repo: str, exc: Exception) -> PullError:
    """huggingface_hub's exception as one line that says what to do."""
    from huggingface_hub import errors

    where = endpoint()
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return PullError(f"{repo}: HF_HUB_OFFLINE is set: unset it to download")
    if isinstance(exc, errors.GatedRepoError):
        return PullError(f"{repo}: a gated repository: accept its terms on {where}/{repo} and log in (`hf auth login` or HF_TOKEN)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return PullError(
            f"{repo}: no such repository on {where}, or it is private: check the name, or log in (`hf auth login` or HF_TOKEN)"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return PullError(f"{repo}: no such revision")
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return PullError(
                f"{repo}: {where} refused the request ({status}): log in (`hf auth login` or HF_TOKEN) with a token that may read it"
            )
        if status == 404:
            return PullError(f"{repo}: not found on {where} (404)")
        return PullError(f"{repo}: {where} answered {status if status is not None else 'an error'}: {str(exc).splitlines()[0]}")
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return PullError(f"{repo}: cannot reach {where}: {text}; {network.OFFLINE_HINT}")


def network_errors() -> tuple[type[Exception], ...]:
    import httpx2  # huggingface_hub 2.x's HTTP client

    return (httpx2.HTTPError, OSError, ValueError)


def list_files(repo: str, revision: str = "main") -> list[RemoteFile]:
    """Every file of the repository, with its size and (LFS files) sha256."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.hf_api import RepoFile

    if not constants.HF_HUB_OFFLINE:  # offline: the library's own refusal, without a connection
        network.check_reachable(endpoint(), repo)  # no network: one line in seconds, not 24 s of retries
    try:
        tree = list(HfApi(endpoint=endpoint()).list_repo_tree(repo, recursive=True, revision=revision))
    except network_errors() as exc:
        raise hub_error(repo, exc) from None
    out = []
    for item in tree:
        if isinstance(item, RepoFile):
            out.append(RemoteFile(item.path, int(item.size), item.lfs.sha256 if item.lfs else None))
    return out


def _safe_target(dest: Path, remote: RemoteFile) -> Path:
    """Where a repository path lands under `dest`; a path that would leave it is refused."""
    parts = PurePosixPath(remote.path).parts
    if not parts or PurePosixPath(remote.path).is_absolute() or any(p in ("..", ".", "") for p in parts):
        raise PullError(f"the repository names a file {remote.path!r} that would land outside {dest}")
    return dest.joinpath(*parts)


def partial_path(target: Path, remote: RemoteFile) -> Path:
    tag = (remote.sha256 or "nosha")[:16]
    return target.with_name(f"{target.name}.{tag}.incomplete")


@dataclass(frozen=True)
class Plan:
    """What a pull will do: for each file, its final path, its partial file and the bytes already there."""

    repo: str
    revision: str
    chosen: GgufSet
    dest: Path
    targets: tuple[Path, ...]
    have: tuple[int, ...]  # bytes present per file: its size when complete, the partial's length otherwise

    @property
    def total(self) -> int:
        return self.chosen.size

    @property
    def remaining(self) -> int:
        return self.total - sum(self.have)


def download_plan(repo: str, revision: str, chosen: GgufSet, dest: Path) -> Plan:
    targets, have = [], []
    for f in chosen.files:
        target = _safe_target(dest, f)
        part = partial_path(target, f)
        if target.is_file() and target.stat().st_size == f.size:
            n = f.size  # a file gets its final name only after its sha256 matched
        elif part.is_file() and part.stat().st_size <= f.size:
            n = part.stat().st_size
        else:
            n = 0
        targets.append(target)
        have.append(n)
    return Plan(repo, revision, chosen, dest, tuple(targets), tuple(have))


def check_space(p: Plan) -> None:
    """Free space for the whole remaining set, before the first byte."""
    probe = p.dest
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if p.remaining > free:
        raise PullError(
            f"not enough free space in {p.dest}: the {p.chosen.quant} set needs {p.remaining / 1e9:.2f} GB more "
            f"({p.total / 1e9:.2f} GB in all), {free / 1e9:.2f} GB free; free some or pull to another disk with --dir DIR"
        )


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _counting_bar(on_bytes: Callable[[int], None]) -> type:
    """A stand-in for the tqdm class http_get reports chunks to: each chunk goes to `on_bytes`."""

    class Bar:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def update(self, n: int = 1) -> None:
            on_bytes(n)

        def close(self) -> None:
            pass

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc) -> None:
            pass

    return Bar


def fetch_file(p: Plan, i: int, on_bytes: Callable[[int], None]) -> Path:
    """Download file i of the plan into its partial file (after what is there), check its sha256,
    then give it its final name. A mismatch deletes the partial file: the next pull starts it over."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, WRITE_CHUNK)

    remote, target = p.chosen.files[i], p.targets[i]
    if p.have[i] == remote.size and target.is_file():
        return target
    part = partial_path(target, remote)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f"{target.name}.*.incomplete"):
        if stale != part:
            stale.unlink()  # a partial of another revision of this file: its bytes are not these
    resume = part.stat().st_size if part.is_file() else 0
    if resume > remote.size:
        resume = 0
    url = hf_hub_url(p.repo, remote.path, revision=p.revision, endpoint=endpoint())
    try:
        with open(part, "r+b" if resume else "wb") as fh:
            fh.seek(resume)
            fh.truncate()
            http_get(url, fh, resume_size=resume, headers=build_hf_headers(), expected_size=remote.size, tqdm_class=_counting_bar(on_bytes))
    except network_errors() as exc:
        raise hub_error(p.repo, exc) from None
    if remote.sha256 is not None:
        got = sha256_of(part)
        if got != remote.sha256.lower():
            part.unlink()
            raise PullError(
                f"{remote.path}: sha256 {got[:16]}… does not match the Hub's {remote.sha256[:16]}…; "
                "the download was deleted, pull again to fetch it afresh"
            )
    os.replace(part, target)
    return target


def validate(path: Path) -> str:
    """Open the pulled model with our reader (every shard, the spec checks): its architecture."""
    from ..gguf.model_file import open_model

    try:
        with open_model(path) as mf:
            return mf.spec.arch
    except GGUFError as exc:
        raise PullError(f"downloaded and verified, but moe-pipe cannot run it: {exc}") from None
