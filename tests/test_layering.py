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
    (
        "errors",
        "progress",
        "cores",
        "heap",
        "speed",
        "pids",
        "data",
        "family_registry",
        "families",
    ),  # leaves: anyone may import them (data: package files, no code; families/__init__: a docstring)
    ("config", "config_flags"),  # the typed config: every layer may read it; it parses and validates only
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
    ("analysis",),
    ("procs",),
    ("cli",),
]
RANK = {unit: rank for rank, units in enumerate(STACK) for unit in units}
MAX_ROOT_MODULES = 10
# A family's folder (shared/families/<family>/) holds one part per layer it plugs into;
# each part keeps that layer's rank (shared/family_registry.py PARTS).
FAMILY_PART_UNIT = {
    "spec": "gguf",
    "model": "model",
    "convert": "convert",
    "plan": "makemodel",
}  # shared/*.py besides __init__: the rest lives in sub-packages


def unit_of_path(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).parts
    if rel[0] in ("procs", "cli"):
        return rel[0]
    if rel[1] == "families" and len(rel) > 3:  # shared/families/<family>/<part>.py
        return family_part_unit(rel[3].removesuffix(".py"))
    return rel[1] if len(rel) > 2 else Path(rel[1]).stem  # shared/<pkg>/... or shared/<module>.py


def family_part_unit(part: str) -> str:
    """The unit a family part ranks as: the layer it plugs into (its package's __init__: the leaves')."""
    return "families" if part == "__init__" else FAMILY_PART_UNIT.get(part, f"unknown family part {part!r}")


def unit_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[:1] != ["moe_pipe"] or len(parts) < 2:
        return None
    if parts[1] in ("procs", "cli"):
        return parts[1]
    if parts[2:3] == ["families"] and len(parts) > 4:
        return family_part_unit(parts[4])
    return parts[2] if len(parts) > 2 else None  # `from moe_pipe.shared import x` resolves per name below


def package_of(path: Path, root: Path = ROOT) -> list[str]:
    """The package a module of the tree sits in, by its path: shared/gguf/spec.py -> moe_pipe.shared.gguf."""
    return ["moe_pipe", *path.relative_to(root).parts[:-1]]


def absolute(path: Path, node: ast.ImportFrom, root: Path = ROOT) -> str:
    """The module an import names, its dots resolved against `path`'s package."""
    if node.level == 0:
        return node.module or ""
    package = package_of(path, root)
    assert node.level <= len(package), f"{path}:{node.lineno}: a relative import above the package"
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported_units(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, unit) for every import of project code in `path`, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = absolute(path, node, root)
            if module in ("moe_pipe.shared", "moe_pipe"):
                found += [(node.lineno, a.name) for a in node.names]
            elif module.count(".") == 3 and module.startswith("moe_pipe.shared.families."):  # from .<family> import model
                found += [(node.lineno, family_part_unit(a.name)) for a in node.names]
            elif unit := unit_of_module(module):
                found.append((node.lineno, unit))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, u) for a in node.names if (u := unit_of_module(a.name))]
    return found


def test_the_tree_imports_itself_relatively():
    """Tools that read the tree follow relative imports; `moe_pipe.` names exist only once installed."""
    absolute_imports = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in code_files()
        for node in ast.walk(ast.parse(p.read_text()))
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("moe_pipe"))
        or (isinstance(node, ast.Import) and any(a.name.startswith("moe_pipe") for a in node.names))
    ]
    assert not absolute_imports, f"absolute imports of the package: {absolute_imports}"


def code_files() -> list[Path]:
    return sorted(p for d in ("shared", "procs", "cli") for p in (ROOT / d).rglob("*.py"))


def test_every_unit_has_a_rank():
    units = {unit_of_path(p) for p in code_files()} - {"__init__"}
    assert units <= set(RANK), f"units without a place in the stack: {sorted(units - set(RANK))}"


def upward_imports(path: Path, root: Path = ROOT) -> list[str]:
    own = unit_of_path(path, root)
    if own == "__init__":
        own = "errors"  # shared/__init__.py: may import nothing above the leaves
    return [f"line {line}: {own} imports {unit}" for line, unit in imported_units(path, root) if RANK.get(unit, -1) > RANK[own]]


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


def test_a_family_part_keeps_its_layers_rank(tmp_path):
    """A family's GGUF reader may not import its forward pass: spec ranks as gguf, model as model."""
    bad = tmp_path / "shared" / "families" / "qwen3moe" / "spec.py"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "from . import model\nfrom .model import Model\nfrom ...gguf.spec import ModelSpec\nfrom ...family_registry import FAMILIES\n"
    )
    assert upward_imports(bad, tmp_path) == ["line 1: gguf imports model", "line 2: gguf imports model"]


def test_the_detector_catches_an_upward_import(tmp_path):
    """The check itself can fail: a lazy import of the expert cache from gguf/ is found."""
    bad = tmp_path / "shared" / "gguf" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from ..experts.cache import SlabTable\n    from .. import analysis\n")
    assert upward_imports(bad, tmp_path) == ["line 2: gguf imports experts", "line 3: gguf imports analysis"]
