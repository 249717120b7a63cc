"""mxforge's published requirements (pyproject.toml's [project], what its wheel's METADATA says) against the
environments it must install into: the newest sglang and vLLM releases its engine profiles cover, read from
those releases' own wheels on PyPI (Requires-Dist, cached like the engine wheels: tests/engine_truth/wheels.py),
Quark 0.13's own Requires-Python, and whatever torch build an image already has.

A requirement of mxforge (or of the Quark it pins) that names a package an engine constrains must admit the
engine's version: its `==` pin, or else some release on PyPI that meets both ranges. The engines' own pins
on the packages mxforge needs (transformers==5.19.0, torch==2.14.1, ...) bring their requirements too
(transformers' huggingface_hub range), one level deep.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from email.parser import Parser

import pytest
from helpers import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# The Pythons both engines ship wheels for (sglang: cp311-cp313, vLLM: abi3 for >=3.11,<3.15) on Linux x86_64:
# the environments checked.
PYTHONS = ("3.11", "3.12", "3.13")
# Builds PyPI and PyTorch's indexes publish of one torch version (CPU, CUDA, ROCm, XPU): what an image may hold.
TORCH_BUILDS = ("", "+cpu", "+cu130", "+rocm7.1", "+xpu")


def mxforge_requirements(extras: tuple[str, ...] = ("ray",)) -> list[Requirement]:
    """mxforge's install requirements and those of `extras`."""
    out = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in extras:
        out += [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    return out


def environment(python: str) -> dict[str, str]:
    """The marker environment of CPython `python` on Linux x86_64 (what the engines' images run)."""
    return {
        "implementation_name": "cpython",
        "platform_machine": "x86_64",
        "platform_python_implementation": "CPython",
        "platform_system": "Linux",
        "sys_platform": "linux",
        "os_name": "posix",
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_version": f"{python}.0",
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def applies(req: Requirement, env: dict[str, str]) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def requires_dist(metadata: str, env: dict[str, str]) -> list[Requirement]:
    """The Requires-Dist of a METADATA file that apply in `env` (no extra)."""
    reqs = [Requirement(r) for r in Parser().parsestr(metadata).get_all("Requires-Dist") or []]
    return [r for r in reqs if applies(r, env)]


def pinned_version(req: Requirement) -> str | None:
    """The version an `==V` requirement pins (no wildcard), else None."""
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator in ("==", "===") and not specs[0].version.endswith(".*"):
        return specs[0].version
    return None


def admits(spec: SpecifierSet, version: str) -> bool:
    return spec.contains(version, prereleases=True)


# --- offline: what the metadata itself says ----------------------------------------------------------------


def test_requires_python_is_what_quark_supports():
    """mxforge pins amd-quark 0.13, so it installs only where Quark does: a Python that mxforge admits and Quark
    refuses makes pip fetch hundreds of MB (torch first) and then fail. Quark's range is read from its installed
    METADATA."""
    ours = SpecifierSet(PROJECT["requires-python"])
    quark = SpecifierSet(importlib.metadata.metadata("amd-quark")["Requires-Python"])
    assert admits(ours, "3.11.0"), f"requires-python {ours} must admit 3.11 (this machine's and CI's Python)"
    wrong = [f"3.{m}" for m in range(8, 17) if admits(ours, f"3.{m}.0") != admits(quark, f"3.{m}.0")]
    assert not wrong, f"requires-python {ours} and amd-quark's {quark} disagree on Python {', '.join(wrong)}"


def test_torch_requirement_leaves_the_build_to_the_installer():
    """The metadata names torch by version range only: no local label (+cpu, +cu130, +rocm7.1), no URL, and
    every build of a version it admits is admitted as well; which build to install is scripts/setup.sh's choice
    (or the image's, whose torch is kept)."""
    (torch,) = [r for r in mxforge_requirements() if canonicalize_name(r.name) == "torch"]
    assert torch.url is None, f"{torch}: a URL forces one build"
    assert all("+" not in s.version for s in torch.specifier), f"{torch}: a local label forces one build"
    installed = Version(importlib.metadata.version("torch")).public
    assert admits(torch.specifier, installed), f"{torch} refuses the torch CI runs with ({installed})"
    for build in TORCH_BUILDS:
        assert admits(torch.specifier, installed + build), f"{torch} refuses torch {installed}{build}"


# --- against the engines' published pins (PyPI; cached) ----------------------------------------------------


def newest_engine_releases() -> list[tuple[str, str]]:
    """(engine, newest release read) of each engine, from the engine profiles (manifests/engines/)."""
    from mxforge.validation.profiles import release_ranges

    newest: dict[str, Version] = {}
    for r in release_ranges():
        for v in map(Version, r.read):
            newest[r.engine] = max(newest.get(r.engine, v), v)
    return sorted((engine, str(v)) for engine, v in newest.items())


def mxforge_closure(env: dict[str, str]) -> dict[str, list[tuple[str, Requirement]]]:
    """Every requirement mxforge brings into an environment, by package: its own (the ray extra included) and
    those of the Quark release it pins (its base requirements: mxforge uses no Quark extra)."""
    from engine_truth.wheels import wheel_metadata

    out: dict[str, list[tuple[str, Requirement]]] = {}
    for r in mxforge_requirements():
        if not applies(r, env):
            continue
        out.setdefault(canonicalize_name(r.name), []).append(("mxforge", r))
        if (pin := pinned_version(r)) is not None and canonicalize_name(r.name) == "amd-quark":
            for q in requires_dist(wheel_metadata("amd-quark", pin), env):
                out.setdefault(canonicalize_name(q.name), []).append((f"amd-quark=={pin}", q))
    return out


def engine_constraints(engine: str, version: str, env: dict[str, str], ours: dict) -> list[tuple[str, Requirement]]:
    """The engine's requirements as (who, requirement): its own Requires-Dist and, for each package it
    constrains that mxforge also needs (`ours`), the requirements of the release it would install there (its
    pin, else the newest release inside its range that mxforge admits too)."""
    from engine_truth.wheels import released_versions, wheel_metadata

    own = requires_dist(wheel_metadata(engine, version), env)
    out = [(f"{engine}=={version}", r) for r in own]
    for r in own:
        name = canonicalize_name(r.name)
        if name not in ours or not r.specifier:  # a package the engine takes in any version brings no pin
            continue
        chosen = pinned_version(r)
        if chosen is None:
            fits = [
                v
                for v in released_versions(name)
                if admits(r.specifier, v) and all(admits(m.specifier, v) for _, m in ours.get(name, []))
            ]
            chosen = max(fits, key=Version) if fits else None
        if chosen is not None:
            out += [(f"{engine}: {name}=={chosen}", d) for d in requires_dist(wheel_metadata(name, chosen), env)]
    return out


def conflicts(engine: str, version: str, python: str) -> list[str]:
    """Each package where mxforge's requirements and the engine's cannot be met at once, in one line. A package
    the engine takes in any version is no conflict (mxforge's own requirements install together: CI shows it)."""
    from engine_truth.wheels import released_versions

    env = environment(python)
    ours = mxforge_closure(env)
    theirs: dict[str, list[tuple[str, Requirement]]] = {}
    for who, r in engine_constraints(engine, version, env, ours):
        theirs.setdefault(canonicalize_name(r.name), []).append((who, r))
    problems = []
    for name, mine in sorted(ours.items()):
        if not any(r.specifier for _, r in theirs.get(name, [])):
            continue
        everyone = mine + theirs[name]
        pins = {p for _, r in theirs[name] if (p := pinned_version(r)) is not None}
        candidates = sorted(pins) if pins else released_versions(name)
        if not any(all(admits(r.specifier, v) for _, r in everyone) for v in candidates):
            said = "; ".join(f"{who}: {r}" for who, r in everyone)
            problems.append(f"{name}: no version meets all of: {said}")
    return problems


@pytest.mark.engines
@pytest.mark.parametrize("engine,version", newest_engine_releases())
def test_mxforge_installs_beside_the_newest_engine_release_unchanged(engine, version):
    """Installing mxforge into the engine's environment changes none of the engine's pins: every requirement
    of mxforge (and of its Quark) on a package the engine constrains admits the engine's choice, on every
    Python the engine ships for. Today that is sglang 0.5.23 (torch==2.14.1, transformers==5.19.0, numba==0.65.1)
    and vLLM 0.33.0 (torch==2.14.0, transformers>=5.16.1,<5.21, huggingface_hub>=1.31, numba==0.65.0)."""
    from engine_truth.wheels import wheel_metadata

    problems = []
    for python in PYTHONS:
        engine_python = Parser().parsestr(wheel_metadata(engine, version))["Requires-Python"]
        if engine_python and not admits(SpecifierSet(engine_python), f"{python}.0"):
            continue
        if not admits(SpecifierSet(PROJECT["requires-python"]), f"{python}.0"):
            continue
        problems += [f"Python {python}: {p}" for p in conflicts(engine, version, python)]
    assert not problems, f"{engine}=={version}'s environment cannot take mxforge unchanged:\n" + "\n".join(problems)


@pytest.mark.engines
@pytest.mark.parametrize("engine,version", newest_engine_releases())
def test_torch_range_admits_the_engine_torch_in_every_build(engine, version):
    """The torch an engine pins, in whichever build an image carries it (CUDA from PyPI, ROCm or CPU from
    PyTorch's index), satisfies mxforge: pip keeps it instead of replacing it."""
    from engine_truth.wheels import wheel_metadata

    (torch,) = [r for r in mxforge_requirements() if canonicalize_name(r.name) == "torch"]
    pinned = [
        pinned_version(r)
        for r in requires_dist(wheel_metadata(engine, version), environment(PYTHONS[0]))
        if canonicalize_name(r.name) == "torch"
    ]
    assert pinned and pinned[0], f"{engine}=={version} no longer pins torch: update this test"
    refused = [pinned[0] + b for b in TORCH_BUILDS if not admits(torch.specifier, pinned[0] + b)]
    assert not refused, f"mxforge's {torch} refuses {engine}=={version}'s torch as {', '.join(refused)}"


def test_the_wheel_ships_every_manifest(tmp_path):
    """manifests/ is package data (pyproject.toml's package-data globs): the wheel built from this tree holds every
    file under it (the family, config and fixture files of each family, recipes, engine profiles), where
    importlib.resources finds it as mxforge.manifests. Built from a copy, so that nothing is written in the tree."""
    import shutil
    import subprocess
    import sys
    import zipfile

    pytest.importorskip("setuptools", reason="the wheel is built with the project's own backend, offline")
    src = tmp_path / "src"
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in {*package_dir.values()}:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("mxforge-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    manifests = REPO / "manifests"
    expected = {f"mxforge/manifests/{p.relative_to(manifests).as_posix()}" for p in manifests.rglob("*") if p.is_file()}
    expected = {name for name in expected if "__pycache__" not in name}
    assert any(name.endswith(".family.toml") for name in expected)
    assert expected <= shipped, sorted(expected - shipped)
    # Every module and C kernel source of every package folder too (a subpackage missing from `packages` would
    # install an mxforge that fails on import).
    sources = {
        f"{package.replace('.', '/')}/{p.relative_to(REPO / folder).as_posix()}"
        for package, folder in package_dir.items()
        for p in (REPO / folder).rglob("*")
        if p.suffix in (".py", ".c") and "__pycache__" not in p.parts
    }
    assert any(name.endswith("fp8_ptpc/_ptpc.c") for name in sources)
    assert sources <= shipped, sorted(sources - shipped)


def test_xdist_groups_keep_their_tests_on_one_worker(tmp_path):
    """The suite's one-worker groups (tests/conftest.py, tests/vllm_cpu) rely on --dist loadgroup; pytest 9.2 broke
    it silently (every test ran wherever), which pyproject's pytest pin keeps out."""
    (tmp_path / "test_group.py").write_text(
        "import pytest\n"
        "@pytest.mark.xdist_group('one')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_a(i):\n"
        "    pass\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "3",
            "--dist",
            "loadgroup",
            "-v",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_group.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    workers = {line.split("]")[0] for line in proc.stdout.splitlines() if "PASSED" in line}  # "[gw1] [ 16%] PASSED"
    assert len(workers) == 1, f"the group's 6 tests ran on {sorted(workers)}:\n{proc.stdout[-3000:]}"
