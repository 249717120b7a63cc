"""Recipes as data: loading, validation errors, and which tensors each shipped recipe quantizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from mxforge.checkpoint import Checkpoint
from mxforge.errors import ConfigError
from mxforge.models import MoeLayout, layout_of
from mxforge.quantize.recipe import load_recipe


def _decisions(recipe_name: str, ckpt_dir: Path) -> tuple[MoeLayout, dict[str, str]]:
    ckpt = Checkpoint.open(ckpt_dir)
    layout = layout_of(ckpt.config)
    recipe = load_recipe(recipe_name)
    return layout, {n: recipe.decide(n, layout) for n in ckpt.weight_map}


def test_default_recipe_selects_experts_and_decoder_shared_experts(tiny_ckpt):
    layout, decisions = _decisions("glm-5.2-mxfp4", tiny_ckpt)
    mtp = f"model.layers.{layout.num_hidden_layers}."
    quantized = {n for n, d in decisions.items() if d == "quantize"}
    assert f"{mtp}mlp.experts.0.gate_proj.weight" in quantized
    assert "model.layers.3.mlp.shared_experts.down_proj.weight" in quantized
    for kept in (
        f"{mtp}mlp.shared_experts.up_proj.weight",
        f"{mtp}eh_proj.weight",
        f"{mtp}mlp.gate.weight",
        "model.layers.3.mlp.gate.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.6.self_attn.indexer.wq_b.weight",
        "model.layers.3.self_attn.q_a_proj.weight",
        "model.norm.weight",
    ):
        assert decisions[kept] == "keep", kept
    assert all(".experts." in n or ".shared_experts." in n for n in quantized)


def test_mtp_bf16_recipe_keeps_the_whole_mtp_layer(tiny_ckpt):
    layout, decisions = _decisions("manifests/recipes/glm-5.2-mxfp4-mtp-bf16.toml", tiny_ckpt)
    mtp = f"model.layers.{layout.num_hidden_layers}."
    assert all(d == "keep" for n, d in decisions.items() if n.startswith(mtp))
    assert decisions["model.layers.5.mlp.experts.7.down_proj.weight"] == "quantize"


def test_mtp_layer_comes_from_config_not_a_constant(tiny_ckpt):
    recipe = load_recipe("glm-5.2-mxfp4")
    layout = layout_of({**Checkpoint.open(tiny_ckpt).config, "num_hidden_layers": 5})
    # with 5 decoder layers, layer 5 is the MTP layer: its shared expert is kept
    assert recipe.decide("model.layers.5.mlp.shared_experts.up_proj.weight", layout) == "keep"
    assert recipe.decide("model.layers.4.mlp.shared_experts.up_proj.weight", layout) == "quantize"


def test_recipe_hash_and_name():
    recipe = load_recipe("glm-5.2-mxfp4")
    text = Path(__file__).resolve().parents[2].joinpath("manifests/recipes/glm-5.2-mxfp4.toml").read_bytes()
    import hashlib

    assert recipe.name == "glm-5.2-mxfp4" and recipe.sha256 == hashlib.sha256(text).hexdigest()


@pytest.mark.parametrize(
    "body, message",
    [
        ('name="x"\nscheme="mxfp4"\ncolour="red"\n[[quantize]]\nkinds=["experts"]\n', r"unknown key\(s\) \['colour'\]"),
        ('name="x"\nscheme="mxfp4"\n[[quantize]]\nkinds=["experts"]\nlayer="all"\n', r"unknown key\(s\) \['layer'\]"),
        ('name="x"\nscheme="mxfp4"\n[[quantize]]\nnames=["mlp.(experts"]\n', "not a valid regular expression"),
        ('name="x"\nscheme="mxfp4"\n[[quantize]]\nkinds=["expert"]\n', "kinds"),
        ('name="x"\nscheme="mxfp4"\n[[quantize]]\nkinds=["experts"]\nlayers="78"\n', "layers '78'"),
        ('name="x"\nscheme="nvfp4"\n[[quantize]]\nkinds=["experts"]\n', "scheme 'nvfp4'"),
        ('name="x"\nscheme="mxfp4"\n', r"no \[\[quantize\]\] rule"),
        ('name="x"\nscheme="mxfp4"\n[[quantize]\n', "malformed TOML"),
        (
            'name="x"\nscheme="mxfp4"\nscale_rule="max"\n[[quantize]]\nkinds=["experts"]\n',
            "scale_rule 'max' is not known",
        ),
        (
            'name="x"\nscheme="mxfp4"\n[[quantize]]\nkinds=["experts"]\nformat="nvfp4"\n',
            r"\[\[quantize\]\] rule 1: unknown element format 'nvfp4'; choose one of mxfp4",
        ),
        ('name="x"\nscheme="mxfp4"\n[[quantize]]\nkinds=["experts"]\nformat=4\n', "format must be a string"),
        (
            'name="x"\nscheme="mxfp4"\n[[keep]]\nkinds=["router"]\nformat="mxfp4"\n[[quantize]]\nkinds=["experts"]\n',
            r"\[\[keep\]\] rule 1: a \[\[keep\]\] rule's format can only be 'source' .* not 'mxfp4'",
        ),
    ],
)
def test_bad_recipes_are_clear_errors(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message) as info:
        load_recipe(path)
    assert str(path) in str(info.value)


def test_a_rule_names_its_element_format_and_rules_may_mix_them(tmp_path, monkeypatch):
    """`format` in a [[quantize]] rule selects the registry entry its weights are stored in (default MXFP4); rules
    may name different ones (the first rule's is the global scheme), and a scale rule is refused only where no
    format of the recipe has kernels that take one. A second entry is registered in-process to see that."""
    import dataclasses

    import mxforge.formats
    from mxforge.formats import MXFP4, format_named
    from mxforge.models import family_named

    other = dataclasses.replace(MXFP4, name="mxfp4_quark_scales", title="MXFP4 (Quark scales only)", scale_rules=False)
    monkeypatch.setattr(mxforge.formats, "FORMATS", (*mxforge.formats.FORMATS, other))
    path = tmp_path / "r.toml"
    path.write_text('name="x"\nscheme="mxfp4"\n[[quantize]]\nkinds=["experts"]\nformat="mxfp4_quark_scales"\n')
    recipe = load_recipe(path)
    layout = layout_of(family_named("glm_moe_dsa").reference())
    assert recipe.global_format is other and "format='mxfp4_quark_scales'" in recipe.rules[0].describe()
    assert recipe.format_of("model.layers.5.mlp.experts.0.up_proj.weight", layout) is other
    assert recipe.format_of("model.layers.5.self_attn.o_proj.weight", layout) is None  # no rule: kept
    assert load_recipe("glm-5.2-mxfp4").formats == (MXFP4,)
    with pytest.raises(ConfigError, match="scale rule 'mse' is not available for MXFP4 \\(Quark scales only\\)"):
        recipe.with_scale_rule("mse")
    path.write_text(path.read_text() + '[[quantize]]\nkinds=["attention"]\nformat="fp8_ptpc"\n')
    mixed = load_recipe(path)
    ptpc = format_named("fp8_ptpc")
    assert mixed.formats == (other, ptpc) and mixed.format_record == "mxfp4_quark_scales+fp8_ptpc"
    assert mixed.format_of("model.layers.5.self_attn.o_proj.weight", layout) is ptpc
    path.write_text(path.read_text() + '[[quantize]]\nkinds=["shared_experts"]\n')
    assert load_recipe(path).with_scale_rule("mse").scale_rule == "mse"  # MXFP4 takes it, FP8 PTPC is Quark's


def test_a_format_that_needs_calibration_is_refused_with_the_reason(tmp_path):
    """Quark schemes whose activations need calibration (static FP8 activation scales, W4A8) are not written."""
    path = tmp_path / "r.toml"
    for name, why in (("fp8", "static per-tensor FP8 activation scales"), ("mxfp4_fp8", "W4A8")):
        path.write_text(f'name="x"\nscheme="mxfp4"\n[[quantize]]\nkinds=["experts"]\nformat="{name}"\n')
        with pytest.raises(ConfigError, match=f"format '{name}' is not written by mxforge: .*{why}.*calibrat"):
            load_recipe(path)


def test_layer_config_patterns_wildcard_what_they_can_and_no_more():
    """Modules of another format than the global one get the widest pattern that matches no quantized module of
    another format: the layer's prefix and numbers made `*`, else the numbers only, else fewer, down to the name."""
    from mxforge.formats import MXFP4, format_named
    from mxforge.quantize.recipe import layer_config_patterns

    ptpc = format_named("fp8_ptpc")
    modules = {f"model.layers.{n}.self_attn.o_proj": ptpc for n in range(3)}
    modules |= {f"model.layers.{n}.mlp.experts.{e}.up_proj": MXFP4 for n in range(3) for e in range(4)}
    modules |= {f"model.layers.3.mlp.experts.{e}.up_proj": ptpc for e in range(4)}  # the MTP layer's in FP8
    modules |= {"model.layers.3.self_attn.o_proj": MXFP4, "lm_[head]*?": ptpc}
    patterns = layer_config_patterns(modules, MXFP4)
    assert patterns == {
        "lm_[[]head][*][?]": ptpc,
        "model.layers.0.self_attn.o_proj": ptpc,
        "model.layers.1.self_attn.o_proj": ptpc,
        "model.layers.2.self_attn.o_proj": ptpc,
        "model.layers.3.mlp.experts.*.up_proj": ptpc,
    }
    del modules["model.layers.3.self_attn.o_proj"]
    assert "*.self_attn.o_proj" in layer_config_patterns(modules, MXFP4)  # the draft's model.decoder.* too
    modules["visual.blocks.0.self_attn.o_proj"] = MXFP4  # another model part's module of the global format
    assert "model.layers.*.self_attn.o_proj" in layer_config_patterns(modules, MXFP4)
    import fnmatch

    for module, fmt in modules.items():  # Quark's reading: the first matching pattern, else the global scheme
        found = next((f for p, f in layer_config_patterns(modules, MXFP4).items() if fnmatch.fnmatch(module, p)), MXFP4)
        assert found is fmt, module
    # A kept (bf16) module is matched by no pattern either: vLLM 0.30.0 re-quantizes excluded DeepSeek attention
    # with the layer config that matches it. The MTP layer's attention in FP8, the decoder's kept:
    mtp = {"model.layers.3.self_attn.o_proj": ptpc, "model.layers.3.mlp.experts.0.up_proj": MXFP4}
    kept = [f"model.layers.{n}.self_attn.o_proj" for n in range(3)]
    assert layer_config_patterns(mtp, MXFP4) == {"*.self_attn.o_proj": ptpc}
    assert layer_config_patterns(mtp, MXFP4, kept) == {"model.layers.3.self_attn.o_proj": ptpc}


def test_scale_rule_from_the_recipe_is_used_and_recorded_and_the_flag_wins(tiny_ckpt, tmp_path):
    from helpers import REPO, cli

    path = tmp_path / "mse.toml"
    shipped = (REPO / "manifests" / "recipes" / "glm-5.2-mxfp4.toml").read_text()
    path.write_text(shipped.replace('scheme = "mxfp4"', 'scheme = "mxfp4"\nscale_rule = "mse"'))
    recipe = load_recipe(path)
    assert recipe.scale_rule == "mse" and load_recipe("glm-5.2-mxfp4").scale_rule == "quark"
    meta = recipe.quantization_config(["lm_head"])["mxforge"]
    assert meta["scale_rule"] == "mse" and meta["recipe"] == recipe.name and meta["recipe_sha256"] == recipe.sha256
    assert "mxforge" not in load_recipe("glm-5.2-mxfp4").quantization_config(["lm_head"])
    for flag, want in (([], "mse"), (["--scale-rule", "quark"], "quark")):
        out = tmp_path / f"out-{want}"
        cli("quantize", str(tiny_ckpt), str(out), "--recipe", str(path), "--quiet", *flag, check=True)
        assert json.loads((out / "mxforge_quantize.json").read_text())["recipe"]["scale_rule"] == want
        assert ("mxforge" in json.loads((out / "config.json").read_text())["quantization_config"]) == (want == "mse")


def test_unknown_recipe_name():
    with pytest.raises(ConfigError, match="no such file"):
        load_recipe("glm-9-nonexistent")


def test_rule_matching_nothing_is_an_error(tiny_ckpt, tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('name="x"\nscheme="mxfp4"\n[[quantize]]\nnames=["model\\\\.layers\\\\.999\\\\..*"]\n')
    recipe = load_recipe(path)
    ckpt = Checkpoint.open(tiny_ckpt)
    with pytest.raises(ConfigError, match=r"\[\[quantize\]\] rule 1 .* matches no 2-D weight"):
        recipe.check_matches(ckpt.weight_map, layout_of(ckpt.config), str(tiny_ckpt))


def test_quantization_config_is_quarks(tiny_ckpt):
    qc = load_recipe("glm-5.2-mxfp4").quantization_config(["model.layers.0.mlp.gate_proj", "lm_head"])
    assert qc["quant_method"] == "quark" and qc["exclude"] == ["lm_head", "model.layers.0.mlp.gate_proj"]
    w = qc["global_quant_config"]["weight"]
    assert (w["dtype"], w["group_size"], w["scale_format"], w["is_dynamic"]) == ("fp4", 32, "e8m0", False)
    assert qc["global_quant_config"]["input_tensors"]["is_dynamic"] is True
    assert qc["export"]["pack_method"] == "reorder"


@pytest.mark.quark
def test_cached_quantization_config_equals_a_fresh_quark_build(tmp_path, monkeypatch):
    from mxforge.formats import MXFP4
    from mxforge.formats import quark as quark_ref

    monkeypatch.setenv("MXFORGE_CACHE", str(tmp_path))
    exclude = ["model.layers.7.mlp.shared_experts.up_proj", "lm_head", "model.layers.0.self_attn.q_a_proj"]
    for quantize_inputs in (True, False):
        fresh = quark_ref.export_quantization_config(quark_ref.qconfig(MXFP4, exclude, quantize_inputs))
        first = quark_ref.cached_quantization_config(MXFP4, exclude, quantize_inputs)  # builds and stores
        second = quark_ref.cached_quantization_config(MXFP4, exclude, quantize_inputs)  # from the cache
        assert json.dumps(first) == json.dumps(second) == json.dumps(fresh)
    assert len(list(tmp_path.glob("quark-config-*.json"))) == 2


def test_a_quark_that_cannot_be_imported_is_one_clear_error(tmp_path, monkeypatch):
    """mxforge leaves the transformers release to the environment (an engine pins its own), and Quark imports
    it: where Quark's import fails, writing quantization_config says so in one line, with the releases
    installed and what to do, instead of a traceback from inside Quark. (A None in sys.modules is how Python
    itself reports a module that cannot be imported.)"""
    import sys

    from mxforge.errors import MxforgeError
    from mxforge.formats import quark as quark_ref

    monkeypatch.setenv("MXFORGE_CACHE", str(tmp_path))  # no cached config: Quark is needed
    monkeypatch.setitem(sys.modules, "quark.torch.quantization.config.config", None)
    quark_ref.specs.cache_clear()
    try:
        with pytest.raises(MxforgeError) as err:
            load_recipe("glm-5.2-mxfp4").quantization_config(["lm_head"])
    finally:
        quark_ref.specs.cache_clear()
    msg = str(err.value)
    assert msg.startswith("Quark could not be imported (ModuleNotFoundError: ") and "\n" not in msg
    assert "installed: amd-quark 0.13, transformers " in msg and "write quantization_config" in msg
    assert "docs/install.md" in msg


@pytest.mark.slow  # imports Quark cold in a fresh process (its first import is the stall itself)
def test_first_use_says_quark_is_loading_before_the_stall_and_never_again(tmp_path, tiny_ckpt):
    """Quark's first import (building quantization_config) keeps a new user's first quantize silent for up to a
    minute: one line on stderr says what is happening; once its config is cached, nothing is said or imported."""
    env = {"MXFORGE_CACHE": str(tmp_path / "cache")}
    first = run_cli("quantize", str(tiny_ckpt), str(tmp_path / "a"), "--quiet", env=env, check=True)
    said = [line for line in first.stderr.splitlines() if "loading AMD Quark" in line]
    assert len(said) == 1 and "about a minute" in said[0] and str(tmp_path / "cache") in said[0], first.stderr
    second = run_cli("quantize", str(tiny_ckpt), str(tmp_path / "b"), "--quiet", env=env, check=True)
    assert "Quark" not in second.stderr, second.stderr
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()


@pytest.mark.parametrize(
    "recipe_name, quantized",
    [
        # 76 MoE layers (3..77 and MTP 78) x 256 experts x 3 projections + 75 decoder shared experts x 3
        ("glm-5.2-mxfp4", 76 * 256 * 3 + 75 * 3),
        ("glm-5.2-mxfp4-mtp-bf16", 75 * 256 * 3 + 75 * 3),
    ],
)
def test_plan_on_the_full_glm52_layout(full_layout_ckpt, recipe_name, quantized):
    from mxforge.quantize.plan import plan_checkpoint

    plan = plan_checkpoint(Checkpoint.open(full_layout_ckpt), load_recipe(recipe_name))
    assert list(plan.layout.mtp_layers) == [78]
    assert len(plan.names("quantized")) == quantized
    assert len(plan.tensors()) == 59_585
    exclude = plan.excluded_modules()
    assert "model.layers.78.eh_proj" in exclude and "model.layers.78.mlp.shared_experts.down_proj" in exclude
    assert "model.layers.77.mlp.shared_experts.down_proj" not in exclude and "lm_head" in exclude
    assert ("model.layers.78.mlp.experts.255.up_proj" in exclude) == (recipe_name == "glm-5.2-mxfp4-mtp-bf16")


def test_a_backtracking_names_pattern_is_matched_in_bounded_time(tiny_ckpt, tmp_path):
    """`(.|.)*Z` takes Python's re 2^n steps on an n-character name: quantize's planning used to hang on it."""
    from helpers import deadline

    path = tmp_path / "r.toml"
    path.write_text('name="x"\nscheme="mxfp4"\n[[quantize]]\nkinds=["experts"]\n[[keep]]\nnames=["(.|.)*Z"]\n')
    recipe = load_recipe(path)
    ckpt = Checkpoint.open(tiny_ckpt)
    layout = layout_of(ckpt.config)
    with deadline(20, "planning with a backtracking names pattern"):
        decisions = {name: recipe.decide(name, layout) for name in ckpt.weight_map}
        with pytest.raises(ConfigError, match=r"\[\[keep\]\] rule 1 .* matches no 2-D weight"):
            recipe.check_matches(ckpt.weight_map, layout, str(tiny_ckpt))
    assert any(d == "quantize" for d in decisions.values())


def test_a_names_pattern_beyond_the_bounds_is_one_error_naming_the_rule(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('name="x"\nscheme="mxfp4"\n[[quantize]]\nnames=["(mlp)\\\\1"]\n')
    with pytest.raises(ConfigError, match=r"r\.toml: \[\[quantize\]\] rule 1: names pattern: .*backreference"):
        load_recipe(path)
