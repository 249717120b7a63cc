"""The docs stay true: the reference page is what the manifests generate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCRIPTS = ROOT / "scripts"


def load_script(name: str):
    """A module of scripts/ (they import their siblings by bare name, so scripts/ goes on the path)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_page_is_what_the_manifests_generate():
    gen = load_script("gen_reference")
    assert (DOCS / "reference.md").read_text() == gen.render(), (
        "docs/reference.md is stale: run .venv/bin/python scripts/gen_reference.py"
    )


def test_reference_page_covers_every_registry_entry():
    from mxforge.models import FAMILIES
    from mxforge.quantize.fp8_source import FP8_SCHEMES
    from mxforge.quantize.recipe import SCHEMES
    from mxforge.quantize.scale_rules import SCALE_RULES
    from mxforge.validation.profiles import profile_names

    text = load_script("gen_reference").render()
    recipes = [p.stem for p in (ROOT / "manifests" / "recipes").glob("*.toml")]
    names = [*profile_names(), *(f.name for f in FAMILIES), *recipes, *SCALE_RULES, *FP8_SCHEMES, *SCHEMES]
    assert recipes and all(f"`{n}`" in text for n in names), [n for n in names if f"`{n}`" not in text]
    for family in FAMILIES:
        for arch in family.architectures:
            assert f"`{arch}`" in text


def test_reference_page_follows_a_manifest_change(monkeypatch):
    """The page is rendered from the profiles, not written by hand: a changed summary changes the page."""
    gen = load_script("gen_reference")
    from mxforge.validation import profiles

    real = profiles.load_profile
    import dataclasses

    def edited(name, family):
        p = real(name, family)
        return dataclasses.replace(p, summary="EDITED SUMMARY") if name == "vllm-0.30.0" else p

    monkeypatch.setattr(gen, "load_profile", edited)
    assert "EDITED SUMMARY" in gen.render()
