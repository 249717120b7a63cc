"""`mxforge run` from an FP8 Hub repo, per family: the loopback Hub serves the family's tiny FP8 fixture (its
release's layout), and the pipeline downloads, quantizes (dequantizing each block), fixes up, validates for every
supported engine release and pushes, with a model card that names the source precision; streamed, the pushed
checkpoint is the same bytes as sequential."""

from __future__ import annotations

import json

import pytest
from helpers import engines_for, hub_env, pushed_files, run_push

from mxforge.models import FAMILIES, family_named
from mxforge.quantize.fp8_source import source_precision
from mxforge.validation.profiles import select
from mxforge.validation.validate import validate_checkpoint

pytestmark = pytest.mark.slow  # the whole pipeline from the loopback Hub to a push, per family (as test_run.py)

TOKEN = "hf_mxforgeFp8RunTestTokenNeverLogged5"
PROVENANCE = {"mxforge_source.json", "mxforge_quantize.json", "mxforge_fixups.json", "README.md"}


@pytest.fixture
def fp8_hub(tmp_path, fixture_ckpt):
    """A loopback Hub serving every family's tiny FP8 fixture (the session's, conftest.py) as zai/<family>-fp8."""
    from loopback_hub import LoopbackHub

    hub = LoopbackHub(tmp_path / "hub", tokens={TOKEN: "alice"})
    for family in (f for f in FAMILIES if f.has_fp8_release):
        hub.add_repo_from_dir(f"zai/{family.name}-fp8", fixture_ckpt("tiny", family.name, "fp8")[0])
    hub.start()
    yield hub
    hub.stop()


def _run(hub, tmp_path, family: str, out, repo: str, *extra):
    proc = run_push(f"zai/{family}-fp8", out, repo, *extra, env=hub_env(hub, tmp_path, TOKEN))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("family", [f.name for f in FAMILIES if f.has_fp8_release])
def test_run_from_an_fp8_hub_repo_to_a_push(fp8_hub, fixture_ckpt, tmp_path, family):
    out = tmp_path / "run"
    report = _run(fp8_hub, tmp_path, family, out, f"alice/{family}-mxfp4", "--no-stream")
    stages = report["stages"]
    assert all(stages[s]["status"] == "done" for s in ("download", "quantize", "fixup", "validate", "push"))
    quantize = stages["quantize"]["report"]
    assert quantize["source_precision"].startswith("fp8") and quantize["fp8_scales_consumed"] > 0
    engines = stages["validate"]["report"]["engines"]
    assert engines and all(engines.values()), engines
    assert validate_checkpoint(out / "mxfp4").ok
    pushed = pushed_files(fp8_hub, f"alice/{family}-mxfp4")
    card = pushed["README.md"].decode()
    source = fixture_ckpt("tiny", family, "fp8")[0]
    described = source_precision(json.loads((source / "config.json").read_text())).describe()
    assert quantize["source_precision"] == described
    assert f"- source precision: {described} (model family: {family_named(family).title})" in card
    config = json.loads(pushed["config.json"])
    assert config["quantization_config"]["quant_method"] == "quark"
    assert not any(k in pushed["config.json"].decode() for k in ("weight_block_size", "compressed-tensors"))
    index = json.loads(pushed["model.safetensors.index.json"])
    assert not any(n.endswith(("_scale_inv", ".input_scale")) for n in index["weight_map"])


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm4_moe"])  # block FP8, compressed-tensors FP8
def test_streamed_fp8_run_pushes_the_same_bytes_as_sequential(fp8_hub, tmp_path, family):
    streamed = _run(fp8_hub, tmp_path, family, tmp_path / "s", "alice/streamed", "--stream", "--workers", "2")
    assert streamed["mode"] == "stream"
    assert streamed["stages"]["stream"]["report"]["source_precision"].startswith("fp8")
    _run(fp8_hub, tmp_path, family, tmp_path / "q", "alice/sequential", "--no-stream", "--workers", "2")
    a, b = pushed_files(fp8_hub, "alice/streamed"), pushed_files(fp8_hub, "alice/sequential")
    assert sorted(a) == sorted(b)
    assert all(a[n] == b[n] for n in a if n not in PROVENANCE)


KEEP_FP8 = [(f.name, r) for f in FAMILIES if f.has_fp8_release for r in f.recipes if r.endswith("-keep-fp8")]
# block FP8 kept as stored loads in vLLM only; compressed-tensors FP8 is kept as FP8 PTPC, which every engine loads
KEEP_BLOCK = [(f, r) for f, r in KEEP_FP8 if family_named(f).fp8_format == "block"]
KEEP_PTPC = [(f, r) for f, r in KEEP_FP8 if (f, r) not in KEEP_BLOCK]


@pytest.mark.parametrize("family,recipe", KEEP_BLOCK, ids=[r for _, r in KEEP_BLOCK])
def test_keep_fp8_recipe_pushes_for_the_releases_that_load_it_and_is_refused_for_the_others(
    fp8_hub, tmp_path, family, recipe
):
    """Each shipped keep-fp8 recipe: for every release by default, refused before quantizing, naming the sglang
    releases (none loads block FP8 as Quark keeps it); with --engines vllm, the pipeline pushes a checkpoint whose
    kept weights are block FP8, which validates in every vLLM release and whose card lists them and FP8 block."""
    proc = run_push(
        f"zai/{family}-fp8", tmp_path / "all", "alice/all", "--recipe", recipe, env=hub_env(fp8_hub, tmp_path, TOKEN)
    )
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr
    said = proc.stderr.strip().splitlines()[-1].split("even after")[0]
    only = engines_for(recipe, "fp8_block")  # vLLM's releases (GLM-5.3-Flash's: 0.31 on: helpers.RECIPE_ENGINES)
    loading = {s.profile.name for s in select(only, family)}
    assert "sglang-0.5.21" in said and not any(name in said for name in loading), said
    out = tmp_path / "run"
    report = _run(fp8_hub, tmp_path, family, out, f"alice/{recipe}", "--recipe", recipe, "--engines", only)
    engines = report["stages"]["validate"]["report"]["engines"]
    assert engines and all(engines.values()) and all(e.startswith("vllm") for e in engines), engines
    counts = report["stages"]["quantize"]["report"]["counts"]
    assert counts["kept_source"] > 0
    card = pushed_files(fp8_hub, f"alice/{recipe}")["README.md"].decode()
    intro = card.split("## ")[0]
    assert "FP8 block" in card and "kept loadable in vllm (validated below)" in intro and "sglang" not in intro


@pytest.mark.parametrize("family,recipe", KEEP_PTPC, ids=[r for _, r in KEEP_PTPC])
def test_keep_fp8_recipe_of_a_compressed_tensors_release_pushes_for_every_release(fp8_hub, tmp_path, family, recipe):
    """A compressed-tensors FP8 release's keep-fp8 recipe (its FP8 kept as FP8 PTPC): the pipeline pushes, for the
    default engine selection, a checkpoint that validates in every sglang and vLLM release, whose kept weights are
    the release's codes (FP8 PTPC), without the release's input scales, and whose card lists FP8 PTPC."""
    out = tmp_path / "run"
    report = _run(fp8_hub, tmp_path, family, out, f"alice/{recipe}", "--recipe", recipe, "--no-stream")
    engines = report["stages"]["validate"]["report"]["engines"]
    assert {e.split("==")[0] for e in engines} == {"sglang", "vllm"} and all(engines.values()), engines
    counts = report["stages"]["quantize"]["report"]["counts"]
    assert counts["kept_source"] > 0
    pushed = pushed_files(fp8_hub, f"alice/{recipe}")
    index = json.loads(pushed["model.safetensors.index.json"])
    assert not any(n.endswith(".input_scale") for n in index["weight_map"])
    assert "FP8 PTPC" in pushed["README.md"].decode()
