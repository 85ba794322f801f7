"""A model's header before its download (shared/hub/header.py) and the reader's
header-only open (GGUFFile.from_headers): the header alone gives the same
tensor table, spec and layout as the whole file; a short one says how far it
runs; over a loopback hub (tests/rangehub.py) the range requests fetch a few
MB of a large file, keep them, and a second look asks nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.model_file import open_header_model, open_model
from moe_pipe.shared.gguf.reader import GGUFFile, HeaderIncomplete
from moe_pipe.shared.hub import header
from moe_pipe.shared.makemodel.maker import make_header, make_model

REPO = "test-org/Qwen-Shape-GGUF"
FILE = "Qwen-Shape-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's width cut to 2 layers, header only (0.8 GB of holes, a 3.5 MB header)."""
    return make_model("qwen3moe", "qwen30b-shape", tmp_path_factory.mktemp("q") / "q2.gguf", layers=2, sparse=True)


def first_bytes(path: Path, n: int, out: Path) -> Path:
    with open(path, "rb") as fh:
        out.write_bytes(fh.read(n))
    return out


# ---------------------------------------------------------------- the reader


def test_a_header_alone_opens_as_the_whole_file(qwen2, tmp_path):
    with open_model(qwen2) as whole:
        head = first_bytes(qwen2, whole.gguf.data_start(), tmp_path / "h")
        with open_header_model([(head, qwen2.stat().st_size)]) as alone:
            assert alone.gguf.header_only and not whole.gguf.header_only
            assert alone.gguf.tensors == whole.gguf.tensors
            assert alone.gguf.file_bytes == whole.gguf.file_bytes
            assert alone.spec == whole.spec
            assert alone.layout.slab_bytes == whole.layout.slab_bytes and alone.layout.dense_bytes == whole.layout.dense_bytes
            assert [alone.layout.expert_bytes(i) for i in range(2)] == [whole.layout.expert_bytes(i) for i in range(2)]
            with pytest.raises(GGUFError, match="only the header is here"):
                alone.gguf.view("output.weight")


def test_make_header_writes_the_header_make_model_writes_and_says_the_whole_size(qwen2, tmp_path):
    size = make_header("qwen3moe", "qwen30b-shape", tmp_path / "made.header", layers=2)
    assert size == qwen2.stat().st_size
    head = (tmp_path / "made.header").read_bytes()
    assert first_bytes(qwen2, len(head), tmp_path / "h").read_bytes() == head


def test_a_short_header_says_how_far_it_runs_and_a_truncated_file_is_an_error(qwen2, tmp_path):
    size = qwen2.stat().st_size
    for n in (10, 1000, 100_000):
        with pytest.raises(HeaderIncomplete) as exc:
            GGUFFile.from_headers([(first_bytes(qwen2, n, tmp_path / "h"), size)])
        assert exc.value.have == n and exc.value.needed > n
    # the declared size itself ends inside the header: truncated, not "fetch more"
    with pytest.raises(GGUFError, match="truncated") as exc:
        GGUFFile.from_headers([(first_bytes(qwen2, 100_000, tmp_path / "h"), 100_000)])
    assert not isinstance(exc.value, HeaderIncomplete)


# ---------------------------------------------------------------- over the hub


def test_range_requests_fetch_the_header_keep_it_and_ask_nothing_the_second_time(range_hub, qwen2):
    range_hub.repos[REPO] = {FILE: qwen2, "README.md": qwen2}
    got = header.fetch_header(REPO, "Q4_K_M")
    size = qwen2.stat().st_size
    with open_model(qwen2) as whole:
        need = whole.gguf.data_start()
        with got.open() as alone:
            assert alone.gguf.tensors == whole.gguf.tensors and alone.spec == whole.spec
    assert need <= got.fetched_bytes < 3 * need and got.fetched_bytes < size / 100  # a few MB of 0.8 GB
    assert range_hub.served[f"{REPO}/{FILE}"] == got.fetched_bytes and got.requests == range_hub.requests[f"{REPO}/{FILE}"] <= 3
    assert got.file_bytes == size and not got.cached
    asked = dict(range_hub.requests)
    again = header.fetch_header(REPO, "q4_k_m")
    assert again.cached and again.fetched_bytes == 0 and again.files == got.files
    assert range_hub.requests == asked  # not even the listing


def test_a_server_that_ignores_range_is_read_only_as_far_as_the_header(range_hub, qwen2):
    range_hub.repos[REPO] = {FILE: qwen2}
    range_hub.ignore_range = True
    got = header.fetch_header(REPO, "Q4_K_M")
    with got.open() as alone:
        assert alone.spec.n_layer == 2
    assert got.fetched_bytes < 3 * 3_500_000


def test_each_shard_of_a_split_set_gets_its_header(range_hub, tiny_model, tmp_path):
    from .test_pull import split_in_three

    shards = split_in_three(tiny_model, tmp_path / "split", "Tiny-Q8_0")
    range_hub.repos[REPO] = {f"Q8_0/{p.name}": p for p in shards}
    got = header.fetch_header(REPO, "Q8_0")
    assert [Path(p).name for p, _, _ in got.files] == [p.name for p in shards]
    assert [n for _, n, _ in got.files] == [p.stat().st_size for p in shards]
    with got.open() as alone, open_model(shards[0]) as whole:
        assert len(alone.gguf.paths) == 3 and alone.gguf.tensors == whole.gguf.tensors


def test_a_file_of_another_size_than_its_listing_is_refused(range_hub, qwen2):
    from moe_pipe.shared.hub.client import PullError

    range_hub.repos[REPO] = {FILE: qwen2}
    range_hub.listed_size[f"{REPO}/{FILE}"] = qwen2.stat().st_size + 4096
    with pytest.raises(PullError, match="its listing says"):
        header.fetch_header(REPO, "Q4_K_M")
    assert header.cached_header(REPO, "Q4_K_M") is None


def test_garbage_served_is_a_one_line_error_and_nothing_is_kept(range_hub, qwen2):
    range_hub.repos[REPO] = {FILE: qwen2}
    range_hub.garbage.add(f"{REPO}/{FILE}")
    with pytest.raises(GGUFError) as exc:
        header.fetch_header(REPO, "Q4_K_M")
    assert str(exc.value).startswith(f"{REPO}/{FILE}: ") and "\n" not in str(exc.value)
    assert header.cached_header(REPO, "Q4_K_M") is None
