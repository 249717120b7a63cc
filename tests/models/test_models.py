"""The model-family seam: families are chosen from config.json, and only mxforge/models/ knows architectures."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mxforge.errors import ConfigError
from mxforge.models import FAMILIES, family_named, family_of, layout_of
from mxforge.validation.profiles import all_profiles, load_profile, profile_names, select, unsupported_reason

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("mxforge", "quantize", "fixups", "scripts")  # the code that ships or operators run (tests may name families)
ARCH_RE = re.compile(r"\b[A-Z]\w*For(CausalLM|ConditionalGeneration)\w*")


def _product_files() -> list[Path]:
    return [
        p for d in PRODUCT for p in sorted((REPO / d).rglob("*.py")) if (REPO / "mxforge" / "models") not in p.parents
    ]


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


LAYER_PREFIX_RE = re.compile(r"(^|\.)layers\.(\{|\d|$)")


def _code_strings(path: Path) -> list[str]:
    """The string literals of a module's code (f-string parts included), docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_no_module_outside_the_family_folder_spells_a_layer_prefix(tmp_path):
    """Where a layer is stored is its family's `[layers]` data (mxforge/models/layer_names.py): every other module
    asks the layout (locate, layer_prefix, module_name), so no code string there spells `model.layers.` or
    `layers.{...}`."""
    found = [
        f"{path.relative_to(REPO)}: {s!r}"
        for path in _product_files()
        for s in _code_strings(path)
        if LAYER_PREFIX_RE.search(s)
    ]
    assert not found, "layer prefixes spelled outside mxforge/models/:\n" + "\n".join(found)
    planted = tmp_path / "planted_layer_prefix.py"
    planted.write_text('"""model.layers.0 in a docstring is fine."""\n\nP = f"model.layers.{3}."\n')
    assert [s for s in _code_strings(planted) if LAYER_PREFIX_RE.search(s)] == ["model.layers."]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_is_chosen_by_architecture_then_model_type(family):
    config = family.reference()
    assert family_of(config) is family
    assert family_of({"model_type": family.model_types[0]}) is family
    assert type(layout_of(config)) is family.layout and layout_of(config).family is family
    assert family_named(family.name) is family


def test_every_family_file_is_a_registered_family():
    """manifests/models/<manifest>.family.toml holds each family's data: one file per registered family, no orphan."""
    from mxforge.manifest_io import manifest_names

    assert manifest_names("models", ".family.toml") == sorted(f.manifest for f in FAMILIES)


def test_families_do_not_overlap():
    """family_of takes the first family that claims an architecture or model_type: two claiming one would hide
    the second, and two with one name would share their manifest tables."""
    for attr in ("name", "manifest", "architectures", "model_types"):
        claimed = [v for f in FAMILIES for v in (getattr(f, attr) if attr.endswith("s") else (getattr(f, attr),))]
        assert len(claimed) == len(set(claimed)), (attr, claimed)


@pytest.mark.parametrize(
    ("change", "entry", "message"),
    [
        ({"architecture": ["X"]}, "architecture", "is not a family entry"),
        ({"title": None}, "title", "is missing"),
        ({"architectures": "GlmMoeDsaForCausalLM"}, "architectures", "must be a non-empty list"),
        ({"recipes": []}, "recipes", "must be a non-empty list"),
        ({"name": "Glm-5"}, "name", "'Glm-5' must be lower-case"),
        ({"published": [163]}, "published", "must be a table"),
        ({"published": {"tensor": 5}}, "published.tensor", "is not a figure"),
        ({"published": {"shards": True}}, "published.shards", "must be a number (int), not True"),
        ({"published": {"shards": "163"}}, "published.shards", "must be a number (int), not '163'"),
        ({"published": {"precision": "fp8"}}, "published.precision", "must be one of bf16, fp8-block, not 'fp8'"),
        ({"fp8_format": "blocky"}, "fp8_format", "'blocky' is not an FP8 layout"),
        ({"fp8_bf16_weights": None}, "fp8_bf16_weights", "must be given with the other FP8 entry"),
        ({"fp8_bf16_weights": "(lm_head"}, "fp8_bf16_weights", "is not a regular expression"),
        ({"layers": "model.layers"}, "layers", "must be a table"),
        ({"layers": {"decoders": "x.{layer}"}}, "layers.decoders", "is not a layers entry"),
        ({"layers": {"decoder": "model.layers"}}, "layers.decoder", "'model.layers' must be dotted names ending in"),
        ({"layers": {"decoder": "model.{k}"}}, "layers.decoder", "'model.{k}' must be dotted names ending in {layer}"),
        ({"layers": {"mtp": "mtp.{k}.x"}}, "layers.mtp", "'mtp.{k}.x' must be dotted names ending in {layer} or {k}"),
        ({"layers": {"mtp": "../{k}"}}, "layers.mtp", "'../{k}' must be dotted names"),
        ({"layers": {"mtp": 3}}, "layers.mtp", "must be a string, not 3"),
        ({"layers": {"mtp_block": "mtp"}}, "layers.mtp_block_modules", "is missing: it goes with layers.mtp_block"),
        (
            {"layers": {"mtp_block_modules": ["fc"]}},
            "layers.mtp_block",
            "is missing: it goes with layers.mtp_block_modules",
        ),
        ({"layers": {"mtp_block": "mtp", "mtp_block_modules": ["f.c"]}}, "layers.mtp_block_modules", "must be a list"),
        ({"config": "text_config"}, "config", "must be a table"),
        ({"config": {"texts": "text_config"}}, "config.texts", "is not a config entry"),
        ({"config": {"text": "text.config"}}, "config.text", "must be the name of a config.json entry"),
        ({"config": {"text": 3}}, "config.text", "must be the name of a config.json entry"),
        ({"config": {"fields": ["num_experts"]}}, "config.fields", "must be a table"),
        ({"config": {"fields": {"n_routed_experts": "../x"}}}, "config.fields.n_routed_experts", "must name a"),
        ({"config": {"fields": {"n_routed_experts": 5}}}, "config.fields.n_routed_experts", "must name a"),
        (
            {"config": {"fields": {"n_routed_experts": "num_experts", "n_shared_experts": "num_experts"}}},
            "config.fields",
            "names 'num_experts' for two fields",
        ),
        (
            {"config": {"fields": {"n_routed_experts": "hidden_size", "hidden_size": "width"}}},
            "config.fields",
            "names 'hidden_size' for two fields",
        ),
    ],
)
def test_a_bad_family_file_is_one_clear_error_naming_the_file_and_entry(change, entry, message):
    from mxforge.manifest_io import load_manifest
    from mxforge.models.family import family_manifest, parse_family

    glm = family_named("glm_moe_dsa")
    relpath = family_manifest(glm.manifest)
    data = {**load_manifest(relpath), **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(f"manifests/{relpath}: {entry} {message}")) as e:
        parse_family(data, relpath=relpath, manifest=glm.manifest, layout=glm.layout, kind_rules=glm.kind_rules)
    assert e.value.entry == entry and e.value.filename == f"manifests/{relpath}"
    ok = load_manifest(relpath)
    assert parse_family(ok, relpath=relpath, manifest=glm.manifest, layout=glm.layout, kind_rules=glm.kind_rules) == glm


def test_an_unknown_architecture_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"'LlamaForCausalLM' \(model_type 'llama'\) is not a model family"):
        family_of({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ConfigError, match="not a model family"):
        family_of({})


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_has_recipes_fixtures_and_engine_releases(family):
    from mxforge.models.fixture import preset_config
    from mxforge.quantize.recipe import load_recipe

    for name in family.recipes:
        assert load_recipe(name).name == name
    assert load_recipe(None, family.reference()).name == family.default_recipe
    for preset in ("tiny", "bench", "full-layout"):
        config, _ = preset_config(preset, family=family)
        assert family_of(config) is family
    profiles = all_profiles(family)
    assert profiles and all(p.family == family.name for p in profiles)


def test_releases_that_do_not_build_a_family_are_left_out_and_say_why():
    """DeepSeek-V3.2's MTP draft is built by sglang from 0.5.12 on (earlier, _config_draft_model leaves it the whole
    model): 0.5.9-0.5.11 are not supported for it, which the profile data says and every selection respects."""
    v32 = family_named("deepseek_v32")
    assert all("NextN" in unsupported_reason(f"sglang-0.5.{n}", v32) for n in (9, 10, 11))
    assert unsupported_reason("sglang-0.5.12", v32) is None
    sglang = [r for p in all_profiles(v32) if p.engine == "sglang" for r in p.read]
    assert sglang[0] == "0.5.12" and "0.5.11" not in sglang
    # every release from 0.5.12 on builds it (0.5.18-0.5.22 included: their draft's fusion rule is measured)
    assert all(unsupported_reason(p.name, v32) is None for p in all_profiles(v32))
    assert sglang[-1] == "0.5.23" and {"0.5.18", "0.5.20", "0.5.22"} <= set(sglang)
    assert [r for p in all_profiles("deepseek_v3") if p.engine == "sglang" for r in p.read][0] == "0.5.9"
    with pytest.raises(ConfigError, match="sglang 0.5.9 do\\(es\\) not build deepseek_v32 models \\(its ModelConfig"):
        select("sglang==0.5.9", v32)
    with pytest.raises(ConfigError, match="0.5.11 do\\(es\\) not build deepseek_v32"):
        select("sglang==0.5.11", v32)
    picked = {r for s in select("sglang", v32) for r in s.releases}
    assert "0.5.12" in picked and not picked & {"0.5.9", "0.5.10", "0.5.11"}
    with pytest.raises(ConfigError, match="does not build deepseek_v32"):
        load_profile("sglang-0.5.10", v32)
    with pytest.raises(ConfigError, match="unknown model family"):
        load_profile(profile_names()[0], "no_such_family")


def test_glm4_moe_is_not_vouched_for_on_sglang_0_5_10_and_labels_skip_it():
    """sglang 0.5.10 builds GLM-4.5's MTP draft unquantized unless told otherwise (not modelled): left out, and a run of
    equal verdicts around it is reported as two ranges, never as "0.5.9-0.5.23"."""
    from mxforge.validation.profiles import release_runs

    glm4 = family_named("glm4_moe")
    assert "unquantized" in unsupported_reason("sglang-0.5.10", glm4)
    selections = [s for s in select("sglang", glm4)]
    assert {r for s in selections for r in s.releases} >= {"0.5.9", "0.5.11", "0.5.23"}
    assert "0.5.10" not in {r for s in selections for r in s.releases}
    assert [label for label, _, _ in release_runs(selections, lambda s: 0)] == ["sglang 0.5.9", "sglang 0.5.11-0.5.23"]
    with pytest.raises(ConfigError, match="0.5.10 do\\(es\\) not build glm4_moe"):
        select("sglang==0.5.10", glm4)
