"""Which modules a Python source imports, read from its syntax tree (nothing executed): the house's layering test
(tests/test_architecture.py) and the engine probes' fetch of a model's modules from a wheel
(tests/engine_truth/wheels.py) both ask it."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its source (typing-only imports excluded)."""
    tree = ast.parse(path.read_bytes(), str(path))  # bytes: a BOM or coding line as Python reads it
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
