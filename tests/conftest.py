"""Shared fixtures: GLM-5.2-shaped checkpoints built once per test session, and the loopback test Hub.
Shared constants and helpers are in helpers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import OTHER_TOKEN, REPO, TOKEN, run_cli

from mxforge.models.fixture import write_fixture

sys.path.insert(0, str(REPO / "tests" / "support"))  # the test Hub (loopback_hub), the Quark-style writer (quark_like)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny bf16 fixture (seed 0). Treat as read-only; copy it before changing anything."""
    out = tmp_path_factory.mktemp("tiny") / "glm-tiny"
    write_fixture(out, "tiny", seed=0, quiet=True)
    return out


@pytest.fixture(scope="session")
def full_layout_ckpt(tmp_path_factory) -> Path:
    """The full GLM-5.2 layout as sparse files (headers real, data holes)."""
    out = tmp_path_factory.mktemp("full") / "glm-full"
    write_fixture(out, "full-layout", quiet=True)
    return out


@pytest.fixture
def hub(tmp_path, tiny_ckpt):
    """A loopback Hub (tests/support/loopback_hub.py) serving the tiny fixture as zai/glm-tiny, and as zai/glm-gated
    (gated, granted to alice); alice holds TOKEN, bob OTHER_TOKEN. A test file may extend it (a fixture `hub`
    that takes this one and adds repos)."""
    from loopback_hub import LoopbackHub

    h = LoopbackHub(tmp_path / "hub", tokens={TOKEN: "alice", OTHER_TOKEN: "bob"})
    h.add_repo_from_dir("zai/glm-tiny", tiny_ckpt)
    h.add_repo_from_dir("zai/glm-gated", tiny_ckpt, gated=True, granted={"alice"})
    h.start()
    yield h
    h.stop()


@pytest.fixture(scope="session")
def family_cases(tmp_path_factory):
    """The engine-conformance matrix of one model family, built on first use and once per session for every
    suite that judges it (engine truth, local-vs-remote): tests/engine_truth/matrix.py's export styles at 6
    routed experts and at the family's real layout, before and after fixup, plus the real pipeline's output
    per recipe (and the mse scale rule, whose record in quantization_config every release must accept), and the
    real pipeline's output from the same replica as the family's FP8 release stores it (--precision fp8).
    Returns get(family_name) -> {case name: Case}."""
    from engine_truth import matrix

    from mxforge.models import family_named

    built: dict[str, dict] = {}

    def get(family_name: str) -> dict:
        if family_name not in built:
            family = family_named(family_name)
            root = tmp_path_factory.mktemp(f"conformance-{family_name}")
            srcs = matrix.sources(root, family)
            out = {c.name: c for c in matrix.export_cases(root, srcs, family)}
            runs = [(recipe, "quark") for recipe in family.recipes] + [(family.recipes[0], "mse")]
            for recipe, rule in runs:
                name = f"run-{recipe}" + ("" if rule == "quark" else f"-{rule}")
                run_cli(
                    "run",
                    str(srcs["e6"]),
                    str(root / name),
                    "--recipe",
                    recipe,
                    "--scale-rule",
                    rule,
                    "--quiet",
                    check=True,
                )
                out[f"e6/{name}"] = matrix.Case(f"e6/{name}", root / name / "mxfp4")
            if family.has_fp8_release:
                fp8, name = root / "fp8-e6", f"run-fp8-{family.recipes[0]}"
                write_fixture(
                    fp8,
                    matrix.SIZES["e6"][0],
                    quiet=True,
                    overrides=matrix.SIZES["e6"][1],
                    family=family,
                    precision="fp8",
                )
                run_cli("run", str(fp8), str(root / name), "--quiet", check=True)
                out[f"e6/{name}"] = matrix.Case(f"e6/{name}", root / name / "mxfp4")
            built[family_name] = out
        return built[family_name]

    return get
