"""The docs against the code they describe: the wire protocol's message table,
every module path and dotted name, and every citation of a doc's section (§).

Docs go stale silently when code moves; these checks make a rename or a new
message fail here, naming the line to fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from moe_pipe.shared.wire import messages as m

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
CODE_DIRS = ("shared", "procs", "cli", "tests", "bench")


def _section(text: str, heading: str) -> str:
    """The body of `## heading` up to the next heading of the same level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def _declared_messages() -> dict[str, str]:
    """Message class name -> Kind name, for every message messages.py declares."""
    out = {}
    for obj in vars(m).values():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and isinstance(getattr(obj, "KIND", None), m.Kind):
            out[obj.__name__] = obj.KIND.name
    return out


def test_declared_messages_cover_every_kind():
    # The scan above must see every kind, or the table check below proves nothing.
    assert sorted(_declared_messages().values()) == sorted(k.name for k in m.Kind)


def test_protocol_table_lists_exactly_the_declared_messages():
    section = _section((ROOT / "docs" / "architecture.md").read_text(), "Wire protocol")
    documented = dict(re.findall(r"^\| `(\w+)` \| `(\w+)` \|", section, re.M))
    declared = _declared_messages()
    missing = {n: k for n, k in declared.items() if documented.get(n) != k}
    extra = {n: k for n, k in documented.items() if declared.get(n) != k}
    assert not missing and not extra, (
        f"docs/architecture.md § Wire protocol is stale: undocumented or wrong kind {missing}; documented but not declared {extra}"
    )


def test_protocol_version_in_the_docs_is_the_code_s():
    section = _section((ROOT / "docs" / "architecture.md").read_text(), "Wire protocol")
    stated = re.findall(r"`PROTOCOL_VERSION` is (\d+)", section)
    assert stated, "docs/architecture.md § Wire protocol no longer states PROTOCOL_VERSION"
    assert {int(v) for v in stated} == {m.PROTOCOL_VERSION}


def test_every_protocol_version_says_what_changed():
    section = _section((ROOT / "docs" / "architecture.md").read_text(), "Wire protocol")
    versions = [int(v) for v in re.findall(r"^\| (\d+) \| \S", section, re.M)]
    assert versions == list(range(1, m.PROTOCOL_VERSION + 1)), f"docs/architecture.md lists protocol versions {versions}"


def test_the_protocol_is_stated_once():
    # Other pages point to architecture.md rather than restating the rules.
    for doc in DOCS:
        if doc.name == "architecture.md":
            continue
        text = doc.read_text()
        for claim in ("One Release per token", "one Release per token", "hits ride on", "Fetch per layer with a miss"):
            assert claim not in text, (
                f"{doc.relative_to(ROOT)} restates the wire protocol ({claim!r}); point to docs/architecture.md § Wire protocol"
            )


# Paths with an extension under the code folders: each must exist. Globs
# ("dense-*") name generated outputs and are skipped.
_PATH = re.compile(r"(?<![\w./-])((?:shared|procs|cli|tests|bench|configs)/[\w./-]*\.(?:py|md|toml|jinja|txt|csv))(?![\w*])")


def _mentions(pattern: re.Pattern[str]) -> list[tuple[str, int, str]]:
    out = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            out += [(doc.relative_to(ROOT).as_posix(), n, hit) for hit in pattern.findall(line)]
    return out


def test_the_path_check_sees_the_docs_paths():
    hits = {p for _f, _n, p in _mentions(_PATH)}
    assert {"shared/wire/messages.py", "shared/gguf/layout.py", "procs/supervisor.py"} <= hits


def test_every_path_in_the_docs_exists():
    missing = [f"{f}:{n}: {p}" for f, n, p in _mentions(_PATH) if not (ROOT / p).exists()]
    assert not missing, "paths in the docs that do not exist:\n" + "\n".join(missing)


# Dotted names: `shared.experts.cache.SlabTable`, `moe_pipe.shared.config`.
_DOTTED = re.compile(r"(?<![\w.])(?:moe_pipe\.)?(shared(?:\.\w+)+)")


def _resolves(dotted: str) -> bool:
    parts = ("moe_pipe." + dotted).split(".")
    for cut in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_dotted_name_in_the_docs_resolves():
    bad = [f"{f}:{n}: {d}" for f, n, d in _mentions(_DOTTED) if not _resolves(d.rstrip("."))]
    assert not bad, "dotted names in the docs that do not import:\n" + "\n".join(bad)


def test_dotted_names_are_checked():
    assert _resolves("shared.experts.cache.SlabTable")
    assert not _resolves("shared.cache.SlabTable")  # the flat module of before the packages


# "docs/models.md § gpt-oss": the section must exist. Citations are written
# on one line in code; in the docs they may wrap, so whitespace is collapsed.
# A section is named by its heading or the heading's name before its first ":", ","
# or " (" (its subject, its date): "§ The KV pool" for "### The KV pool (2026-12-05)".
_CITE = re.compile(r"docs/([\w-]+\.md) § ")
_NAME_ENDS = re.compile(r":|,| \(")


def _headings(doc: str) -> list[str]:
    """Every name a section of doc may be cited by: its heading, and the heading up to its first
    ":", "," or " (" where it has one."""
    path = ROOT / "docs" / doc
    if not path.is_file():
        return []
    headings = [h.strip() for h in re.findall(r"^#{1,4} (.+)$", path.read_text(), re.M)]
    return headings + [_NAME_ENDS.split(h, maxsplit=1)[0] for h in headings if _NAME_ENDS.search(h)]


def _citations() -> list[tuple[str, str, str]]:
    files = [*DOCS, *(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))]
    out = []
    for path in files:
        text = " ".join(path.read_text(errors="replace").split())
        out += [(path.relative_to(ROOT).as_posix(), m.group(1), text[m.end() :]) for m in _CITE.finditer(text)]
    return out


def test_every_section_citation_names_a_section():
    bad = []
    for where, doc, rest in _citations():
        ok = any(rest.startswith(h) and not rest[len(h) : len(h) + 1].isalnum() for h in _headings(doc))
        if not ok:
            bad.append(f"{where}: docs/{doc} § {rest[:40]}")
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", ["formats.md", "models.md"])
def test_cited_docs_are_cited(doc):
    # The citation check must be exercising the new pages.
    assert any(d == doc for _w, d, _r in _citations())


def test_the_generated_tables_are_the_code_s():
    """README.md, docs/cli.md and docs/configuration.md list the families, presets, catalog names
    and recipes as the registry, the plan parts, the catalog and configs/ have them."""
    from moe_pipe.cli.reference import BLOCKS, render

    for rel, name, make in BLOCKS:
        text = (ROOT / rel).read_text()
        assert render(text, name, make()) == text, f"{rel}'s {name} table is stale: run python -m moe_pipe.cli.reference"


def test_the_cli_and_the_docs_list_the_same_families(capsys, tmp_path):
    """make-model --help, convert's error, README.md and docs/cli.md: the nine families of the registry."""
    import json

    from moe_pipe.cli.main import main
    from moe_pipe.shared.family_registry import FAMILIES

    with pytest.raises(SystemExit):
        main(["make-model", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-family"}))
    assert main(["convert", str(tmp_path), "-o", str(tmp_path / "x.gguf")]) == 2
    convert_error = capsys.readouterr().err
    readme, cli_md = (ROOT / "README.md").read_text(), (ROOT / "docs" / "cli.md").read_text()
    for f in FAMILIES:
        assert f.arch in help_text, f"make-model --help does not offer {f.arch}"
        assert all(t in convert_error for t in f.hf_model_types), f"convert's error does not list {f.hf_model_types}"
        row = f"| {f.name} | `{f.arch}` |"
        assert row in readme and row in cli_md, f"README.md or docs/cli.md has no row for {f.name}"


def test_the_quick_start_makes_a_venv_and_names_the_web_tests_browser():
    """README's Quick start works as written on a current distro (pip refuses the system Python,
    PEP 668) and says what the browser tests need before they are skipped for want of it."""
    readme = (ROOT / "README.md").read_text()
    start = readme[readme.index("## Quick start") : readme.index("## Usage")]
    assert start.index("python3 -m venv .venv && . .venv/bin/activate") < start.index("pip install .")
    assert "python3-venv" in start and "apt-get install chromium chromium-driver" in start and "test_web_browser.py" in start


def test_the_models_tables_list_every_family():
    """docs/models.md's two tables at its top have a row for every registered family's arch."""
    from moe_pipe.shared.family_registry import FAMILIES

    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    head = text[: text.index("\n## ")]
    for fam in FAMILIES:
        rows = [line for line in head.splitlines() if line.startswith(f"| `{fam.arch}`")]
        assert len(rows) == 2, f"docs/models.md: {fam.arch} has {len(rows)} rows in the tables at its top, not 2"
