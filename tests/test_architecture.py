"""The layering that docs/architecture.md describes, checked on the source: no import cycle among the package's
modules (lazy imports inside functions count: they are cycles all the same), the CLI helper stays in the CLI,
core modules learn file names from provenance instead of importing a stage, and the quantizer and the
checkers import no Hub client."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import REPO

# Source folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {
    "mxforge": "mxforge",
    "quantize": "mxforge.quantize",
    "fixups": "mxforge.fixups",
    "validation": "mxforge.validation",
}
CLI_MODULES = {
    "mxforge.cli",
    "mxforge.cli_support",
    "mxforge.hub_cli",
    "mxforge.quantize.cli",
    "mxforge.fixups.cli",
    "mxforge.validation.cli",
}
# Modules the stages build on; they must not reach up into a stage (download, quantize, fixup, push, run).
CORE = (
    "mxforge.checkpoint",
    "mxforge.file_hashes",
    "mxforge.model_card",
    "mxforge.provenance",
    "mxforge.safetensors_io",
    "mxforge.safe_paths",
    "mxforge.disk_space",
    "mxforge.models",
    "mxforge.validation",
)
STAGES = (
    "mxforge.hub_download",
    "mxforge.hub_push",
    "mxforge.pipeline",
    "mxforge.stream",
    "mxforge.quantize.run",
    "mxforge.quantize.state",
    "mxforge.quantize.shard_job",
    "mxforge.fixups",
)


def package_modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the installed package, by its dotted name."""
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its source (typing-only imports excluded)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


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


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


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


def test_only_the_cli_imports_cli_support():
    """Library functions take the command they record from their caller; only the CLI reads sys.argv."""
    offenders = {
        name for name, deps in import_graph().items() if "mxforge.cli_support" in deps and name not in CLI_MODULES
    }
    assert offenders == set()


def test_core_modules_never_import_a_stage():
    """File names come from mxforge.provenance, so no core module imports a stage to learn one."""
    graph = import_graph()
    offenders = {name: sorted(d for d in deps if _in(d, STAGES)) for name, deps in graph.items() if _in(name, CORE)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_quantizer_and_checkers_load_without_a_hub_client():
    """The quantizer, validate and fixup import no Hub client (huggingface_hub, httpx): their import is fast
    and works where the Hub client is broken."""
    probe = (
        "import sys, mxforge.quantize.run, mxforge.validation.validate, mxforge.validation.deep_checks, "
        "mxforge.fixups.fixup; print(sorted(m for m in ('huggingface_hub', 'httpx', 'mxforge.hub_download', "
        "'mxforge.cli_support') if m in sys.modules))"
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
