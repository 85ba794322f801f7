"""The import direction of the code, checked from the source (no import runs).

Every module belongs to a unit: a sub-package of shared/, one of the few
modules left in shared/ itself, or procs/ / cli/. Units are ranked; a module
may import its own unit or a lower-ranked one, never a higher one, so the
tree stays a stack: `ls shared/` reads bottom to top as below, and
docs/architecture.md draws the same stack.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# lowest first; the same line says what each unit may import (everything before it)
STACK = [
    ("errors", "progress", "data"),  # leaves: anyone may import them (data: package files, no code)
    ("quant",),
    ("gguf",),
    ("model",),
    ("experts",),
    ("wire",),
    ("text",),
    ("telemetry",),
    ("serve",),
    ("convert",),
    ("makemodel",),
    ("hub",),
    ("config", "config_flags"),
    ("analysis",),
    ("procs",),
    ("cli",),
]
RANK = {unit: rank for rank, units in enumerate(STACK) for unit in units}
MAX_ROOT_MODULES = 10  # shared/*.py besides __init__: the rest lives in sub-packages


def unit_of_path(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).parts
    if rel[0] in ("procs", "cli"):
        return rel[0]
    return rel[1] if len(rel) > 2 else Path(rel[1]).stem  # shared/<pkg>/... or shared/<module>.py


def unit_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[:1] != ["moe_pipe"] or len(parts) < 2:
        return None
    if parts[1] in ("procs", "cli"):
        return parts[1]
    return parts[2] if len(parts) > 2 else None  # `from moe_pipe.shared import x` resolves per name below


def imported_units(path: Path) -> list[tuple[int, str]]:
    """(line, unit) for every import of project code in `path`, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level <= 1, f"{path}:{node.lineno}: a relative import that leaves its package"
            if node.level == 1:
                continue  # within its own unit
            if node.module == "moe_pipe.shared":
                found += [(node.lineno, a.name) for a in node.names]
            elif node.module and (unit := unit_of_module(node.module)):
                found.append((node.lineno, unit))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, u) for a in node.names if (u := unit_of_module(a.name))]
    return found


def code_files() -> list[Path]:
    return sorted(p for d in ("shared", "procs", "cli") for p in (ROOT / d).rglob("*.py"))


def test_every_unit_has_a_rank():
    units = {unit_of_path(p) for p in code_files()} - {"__init__"}
    assert units <= set(RANK), f"units without a place in the stack: {sorted(units - set(RANK))}"


def upward_imports(path: Path, root: Path = ROOT) -> list[str]:
    own = unit_of_path(path, root)
    if own == "__init__":
        own = "errors"  # shared/__init__.py: may import nothing above the leaves
    return [f"line {line}: {own} imports {unit}" for line, unit in imported_units(path) if RANK.get(unit, -1) > RANK[own]]


@pytest.mark.parametrize("path", code_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    upward = upward_imports(path)
    assert not upward, f"{path.relative_to(ROOT)} imports upward: " + "; ".join(upward)


def test_shared_keeps_few_modules_at_its_root():
    root = [p.name for p in (ROOT / "shared").glob("*.py") if p.name != "__init__.py"]
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules directly in shared/: {sorted(root)}"


def test_every_package_says_what_it_owns_and_may_import():
    for init in (ROOT / "shared").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if init.parent.name in ("data", "quant"):
            continue  # package data; the kernels' dispatch (its docstring is the kernel table)
        assert "Owns:" in doc and "May import:" in doc, f"{init.relative_to(ROOT)}: docstring lacks 'Owns:' / 'May import:'"


def test_the_detector_catches_an_upward_import(tmp_path):
    """The check itself can fail: a lazy import of the expert cache from gguf/ is found."""
    bad = tmp_path / "shared" / "gguf" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from moe_pipe.shared.experts.cache import SlotTable\n    from moe_pipe.shared import analysis\n")
    assert upward_imports(bad, tmp_path) == ["line 2: gguf imports experts", "line 3: gguf imports analysis"]
