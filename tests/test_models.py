"""The model-family seam: families are chosen from config.json, and only mxforge/models/ knows architectures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mxforge.errors import ConfigError
from mxforge.fixups.profiles import all_profiles, load_profile, profile_names, select, unsupported_reason
from mxforge.models import FAMILIES, family_named, family_of, layout_of

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("mxforge", "quantize", "fixups", "scripts")  # the code that ships or operators run (tests may name families)
ARCH_RE = re.compile(r"\b[A-Z]\w*For(CausalLM|ConditionalGeneration)\w*")


def _product_files() -> list[Path]:
    return [p for d in PRODUCT for p in sorted((REPO / d).rglob("*.py"))
            if (REPO / "mxforge" / "models") not in p.parents]


def test_no_module_outside_the_family_folder_names_an_architecture():
    """Adding a family touches mxforge/models/ and manifests/ only: no architecture or model_type string elsewhere."""
    names = {n for f in FAMILIES for n in (*f.architectures, *f.model_types)}
    found = []
    for path in _product_files():
        text = path.read_text()
        found += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in ARCH_RE.finditer(text)]
        found += [f"{path.relative_to(REPO)}: {n}" for n in names if re.search(rf"\b{re.escape(n)}\b", text)]
    assert not found, "architecture names outside mxforge/models/:\n" + "\n".join(sorted(set(found)))


def test_the_check_sees_a_planted_architecture(tmp_path):
    """The scan above is not vacuous: the pattern and the family names do catch a module that names one."""
    planted = 'if config["architectures"][0] == "%s": pass' % FAMILIES[0].architectures[0]
    assert ARCH_RE.search(planted) and _product_files()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_is_chosen_by_architecture_then_model_type(family):
    config = family.reference()
    assert family_of(config) is family
    assert family_of({"model_type": family.model_types[0]}) is family
    assert type(layout_of(config)) is family.layout and layout_of(config).family is family
    assert family_named(family.name) is family


def test_an_unknown_architecture_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"'LlamaForCausalLM' \(model_type 'llama'\) is not a model family"):
        family_of({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ConfigError, match="not a model family"):
        family_of({})


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_has_recipes_fixtures_and_engine_releases(family):
    from mxforge.fixture import preset_config
    from mxforge.quantize.recipe import load_recipe

    for name in family.recipes:
        assert load_recipe(name).name == name
    assert load_recipe(None, family.reference()).name == family.default_recipe
    for preset in ("tiny", "bench", "full-layout"):
        config, _ = preset_config(preset, family=family)
        assert family_of(config) is family
    profiles = all_profiles(family)
    assert profiles and all(p.family == family.name for p in profiles)


def test_a_release_without_the_family_table_does_not_build_it(tmp_path):
    """Profiles are read per family; a range without `[family.<name>]` is unsupported, said so, and left out."""
    family = FAMILIES[0]
    assert all(unsupported_reason(n, family) is None for n in profile_names()) or all_profiles(family)
    with pytest.raises(ConfigError, match="unknown model family"):
        load_profile(profile_names()[0], "no_such_family")
