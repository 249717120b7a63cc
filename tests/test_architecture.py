"""The layering that docs/architecture.md describes, checked on the source: every module stands on a floor given
by its folder and imports only from its floor or below (lazy imports inside functions count), no import cycle
among the package's modules, and the quantizer and the checkers import no Hub client."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import REPO
from source_imports import imported_modules

# Source folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {
    "mxforge": "mxforge",
    "quantize": "mxforge.quantize",
    "fixups": "mxforge.fixups",
    "validation": "mxforge.validation",
}
# The floors of the house, lowest first, by folder (docs/architecture.md, "Layering"): a module imports only from
# its own floor or the ones below. The ground floor is every module directly in mxforge/ (errors, file I/O, paths,
# hashes, locks, disk, cache, provenance); each other floor is one package. A new package must be given its floor here.
FLOORS = (
    ("ground", "mxforge"),
    ("formats", "mxforge.formats"),
    ("models", "mxforge.models"),
    ("quantize", "mxforge.quantize"),
    ("validation", "mxforge.validation"),
    ("fixups", "mxforge.fixups"),
    ("hub", "mxforge.hub"),
    ("run", "mxforge.run"),
    ("cli", "mxforge.cli"),
)


def floor_of(module: str) -> int:
    """The index in FLOORS of the floor `module` stands on (the longest matching package)."""
    best = -1
    for i, (_, package) in enumerate(FLOORS):
        if (module == package or module.startswith(package + ".")) and (
            best < 0 or len(package) > len(FLOORS[best][1])
        ):
            best = i
    if best == 0 and module.count(".") > 1:
        raise AssertionError(f"{module}: a package with no floor in FLOORS")
    return best


def package_modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the installed package, by its dotted name."""
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    mods = package_modules(root)
    return {name: imported_modules(name, path, set(mods)) for name, path in mods.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_graph_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: a cycle made of a relative import and a lazy one is found (else the test below
    could pass by seeing nothing)."""
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "fixups" / "a.py").write_text("from .b import x\n")
    (tmp_path / "fixups" / "b.py").write_text("def x():\n    from mxforge.fixups.a import y\n")
    (tmp_path / "mxforge" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import z\n"
    )
    (tmp_path / "mxforge" / "d.py").write_text("from . import c\n")
    assert import_cycles(import_graph(tmp_path)) == [["mxforge.fixups.a", "mxforge.fixups.b"]]


def test_no_import_cycle():
    assert import_cycles(import_graph()) == []


def test_every_module_stands_on_a_floor():
    """Every package of mxforge is one floor of FLOORS: a folder added without a place in the house fails here."""
    assert {name: floor_of(name) for name in package_modules()}  # floor_of raises for a package with no floor


def test_no_module_imports_from_a_floor_above_its_own():
    """The layering by folder: ground < formats < models < quantize < validation < fixups < hub < run < cli. The
    library never imports the CLI (only the CLI reads sys.argv; library functions take the command they record
    from their caller), and no floor reaches up into a stage above it to learn a constant."""
    graph = import_graph()
    offenders = sorted(
        f"{name} ({FLOORS[floor_of(name)][0]}) imports {dep} ({FLOORS[floor_of(dep)][0]})"
        for name, deps in graph.items()
        for dep in deps
        if floor_of(dep) > floor_of(name)
    )
    assert offenders == []


def test_the_floor_check_sees_an_upward_import(tmp_path):
    """The checker itself: a ground-floor module that lazily imports the CLI is found (else the test above
    could pass by seeing nothing)."""
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "mxforge" / "cli").mkdir()
    (tmp_path / "mxforge" / "cli" / "__init__.py").write_text("")
    (tmp_path / "mxforge" / "cli" / "support.py").write_text("X = 1\n")
    (tmp_path / "mxforge" / "io.py").write_text("def f():\n    from mxforge.cli.support import X\n")
    (tmp_path / "quantize" / "run.py").write_text("from ..io import f\n")
    graph = import_graph(tmp_path)
    assert graph["mxforge.io"] == {"mxforge.cli.support"}
    assert graph["mxforge.quantize.run"] == {"mxforge.io"}
    assert floor_of("mxforge.io") == 0 and floor_of("mxforge.cli.support") == len(FLOORS) - 1


def test_quantizer_and_checkers_load_without_a_hub_client():
    """The quantizer, validate and fixup import no Hub client (huggingface_hub, its httpx or httpx2): their
    import is fast and works where the Hub client is broken."""
    probe = (
        "import sys, mxforge.quantize.run, mxforge.validation.validate, mxforge.validation.deep_checks, "
        "mxforge.fixups.fixup; print(sorted(m for m in ('huggingface_hub', 'httpx', 'httpx2', "
        "'mxforge.hub.download', 'mxforge.cli.support') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_test_file_imports_another():
    """Tests share code through helpers.py (and fixtures through conftest.py), never by importing a test file."""
    offenders = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad = [n for n in names if n.split(".")[-1] == "conftest" or n.split(".")[-1].startswith("test_")]
            if bad:
                offenders.setdefault(path.relative_to(REPO).as_posix(), []).extend(bad)
    assert offenders == {}
