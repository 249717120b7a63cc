"""Shared fixtures: GLM-5.2-shaped checkpoints built once per test session, and the loopback test Hub.
Shared constants and helpers are in helpers.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import GLM5, OTHER_TOKEN, REPO, TOKEN, cli, engines_for

from mxforge.models.fixture import FixtureResult, write_fixture

sys.path.insert(0, str(REPO / "tests" / "support"))  # the test Hub (loopback_hub), the Quark-style writer (quark_like)

# The suite runs under pytest-xdist with --dist loadgroup (pyproject.toml). What is costly to build once in a
# process, or what two processes must not hold at once, keeps its tests on one worker: the engine-conformance
# matrices (`family_cases`, minutes of exports per family, shared by the engine and local-vs-remote suites),
# AMD Quark's import (marker `quark`: about 25 s a process), a Ray cluster (marker `ray`).
ONE_WORKER_FIXTURES = {"family_cases": "engine-matrix"}
ONE_WORKER_MARKERS = ("quark", "ray")


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = next((g for f, g in ONE_WORKER_FIXTURES.items() if f in item.fixturenames), None)
        group = group or next((m for m in ONE_WORKER_MARKERS if item.get_closest_marker(m)), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def fixture_ckpt(tmp_path_factory):
    """fixture_ckpt(preset, family=None, precision="bf16", shard_count=None, **overrides) -> (path, FixtureResult):
    `mxforge fixture`'s checkpoint (seed 0), written once per session for each set of arguments and shared by
    every test that asks for the same. Treat as read-only; copy it before changing anything."""
    built: dict[tuple, tuple[Path, FixtureResult]] = {}

    def get(
        preset: str, family: str | None = None, precision: str = "bf16", shard_count: int | None = None, **overrides
    ) -> tuple[Path, FixtureResult]:
        key = (preset, family or GLM5.name, precision, shard_count, json.dumps(overrides, sort_keys=True))
        if key not in built:
            out = tmp_path_factory.mktemp(f"fixture-{preset}-{key[1]}-{precision}") / "ckpt"
            result = write_fixture(
                out,
                preset,
                quiet=True,
                overrides=overrides or None,
                family=key[1],
                precision=precision,
                shard_count=shard_count,
            )
            built[key] = out, result
        return built[key]

    return get


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """module_tmp(name) -> a new directory for a test module's shared files, removed when the module's tests are
    done: a passed test's own tmp_path goes as it ends, and a module's GB-sized checkpoints need not wait for
    the session's end (CI's disk is shared)."""
    made: list[Path] = []

    def make(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_ckpt(fixture_ckpt) -> Path:
    """The tiny bf16 fixture (seed 0). Treat as read-only; copy it before changing anything."""
    return fixture_ckpt("tiny")[0]


@pytest.fixture(scope="session")
def quantized_tiny(tiny_ckpt, tmp_path_factory) -> Path:
    """`mxforge quantize` of the tiny fixture with its family's default recipe (worker pool as by default), run
    in-process once per session; beside it: its JSON report `quantize.json` and its summary `quantize.txt`.
    Treat as read-only; copy it before changing anything."""
    out = tmp_path_factory.mktemp("quantized") / "tiny-mxfp4"
    proc = cli("quantize", str(tiny_ckpt), str(out), "--quiet", "--json", str(out.parent / "quantize.json"), check=True)
    (out.parent / "quantize.txt").write_text(proc.stdout)
    return out


@pytest.fixture(scope="session")
def full_layout_ckpt(fixture_ckpt) -> Path:
    """The full GLM-5.2 layout as sparse files (headers real, data holes)."""
    return fixture_ckpt("full-layout")[0]


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
def family_cases(tmp_path_factory, fixture_ckpt):
    """The engine-conformance matrix of one model family, built on first use and once per session for every
    suite that judges it (engine truth, local-vs-remote): tests/engine_truth/matrix.py's export styles at 6
    routed experts and at the family's real layout (matrix.sizes), before and after fixup, plus the real pipeline's
    output per recipe (and the mse scale rule, whose record in quantization_config every release must accept),
    and the real pipeline's output from the same replica as the family's FP8 release stores it (--precision fp8),
    with the default recipe and with each recipe that keeps the FP8 as stored.
    Returns get(family_name) -> {case name: Case}."""
    from engine_truth import matrix

    from mxforge.models import family_named
    from mxforge.quantize.fp8_source import source_precision

    built: dict[str, dict] = {}

    def get(family_name: str) -> dict:
        if family_name not in built:
            family = family_named(family_name)
            root = tmp_path_factory.mktemp(f"conformance-{family_name}")
            srcs = {}
            for size in matrix.sizes(family):
                preset, kwargs = matrix.fixture_args(size, family)
                srcs[size] = fixture_ckpt(preset, family.name, **kwargs)[0]
            out = {c.name: c for c in matrix.export_cases(root, srcs, family)}
            runs = [(recipe, "quark") for recipe in matrix.bf16_recipes(family)] + [(family.recipes[0], "mse")]
            for recipe, rule in runs:
                name = f"run-{recipe}" + ("" if rule == "quark" else f"-{rule}")
                only = engines_for(recipe)
                cli(
                    "run",
                    str(srcs["e6"]),
                    str(root / name),
                    "--recipe",
                    recipe,
                    *(["--engines", only] if only else []),
                    "--scale-rule",
                    rule,
                    "--workers",
                    "1",
                    "--quiet",
                    check=True,
                )
                out[f"e6/{name}"] = matrix.Case(f"e6/{name}", root / name / "mxfp4", only)
            if family.has_fp8_release:  # the default recipe, and each that keeps FP8 as stored, on the FP8 release
                preset, kwargs = matrix.fixture_args("e6", family)
                fp8 = fixture_ckpt(preset, family.name, "fp8", **kwargs)[0]
                kept_as = source_precision(json.loads((fp8 / "config.json").read_text())).fp8.kept_as
                for recipe in [family.recipes[0], *matrix.keep_source_recipes(family)]:
                    name = f"run-fp8-{recipe}"
                    only = None if recipe == family.recipes[0] else engines_for(recipe, kept_as)
                    engines = ["--engines", only] if only else []
                    cli(
                        "run",
                        str(fp8),
                        str(root / name),
                        "--recipe",
                        recipe,
                        *engines,
                        "--workers",
                        "1",
                        "--quiet",
                        check=True,
                    )
                    out[f"e6/{name}"] = matrix.Case(f"e6/{name}", root / name / "mxfp4", only)
            built[family_name] = out
        return built[family_name]

    return get
