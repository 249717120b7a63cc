"""Keeping a block-FP8 source's weights as it stores them (a [[keep]] rule's `format = "source"`; the shipped
`<family>-mxfp4-keep-fp8` recipes), checked against Quark 0.13's own file-to-file with
`keep_excluded_layers_as_original_model_state`: every shard byte for byte, the index's map and quantization_config.

Quark dequantizes the FP8 weights it quantizes with a Triton kernel, which has no CPU backend, and its entry point
refuses an FP8 source on any device but CUDA. The test replaces that one kernel (`_weight_dequant_fp8`) with its
arithmetic in torch (float32 code times float32 tile scale: the kernel's `x.to(float32) * s`) and runs the steps of
Quark's single-device driver (`quantize_model_per_safetensor`) with Quark's own functions on the CPU
(`quark_keep_mode`); every number, name and config entry is Quark's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import cli, engines_for, one_error_line, ragged_tiles
from safetensors import safe_open

from mxforge.checkpoint import INDEX_NAME
from mxforge.errors import ConfigError
from mxforge.formats import FP8_BLOCK, MXFP4, format_named, format_of_spec, layer_config_of
from mxforge.models import family_named, family_of
from mxforge.models.fixture import write_fixture
from mxforge.provenance import QUANTIZE_NAME, QUANTIZE_STATE_NAME
from mxforge.quantize.plan import Fp8Scale, plan_tensor
from mxforge.quantize.recipe import load_recipe
from mxforge.safetensors_io import TensorInfo

FP8_PTPC = format_named("fp8_ptpc")

FAMILIES = [
    f for f in ("glm_moe_dsa", "deepseek_v3", "qwen3_5_moe", "glm5_next") if family_named(f).fp8_format == "block"
]
# Where a family's keep-fp8 output holds block FP8 (default: attention); GLM-5.3-Flash's release stores its attention
# bf16 (glm-5.3-flash.family.toml), so its kept FP8 is the dense MLP layers' and the MTP layer's shared expert
KEPT_FP8_AT = {"glm5_next": ".mlp.down_proj."}
# compressed-tensors FP8 (per-channel weight_scale, static input_scale): kept as FP8 PTPC
CT_FAMILY = "glm4_moe"


def _keep_recipe(family: str) -> str:
    return next(r for r in family_named(family).recipes if r.endswith("-keep-fp8"))


@pytest.fixture(scope="module", params=FAMILIES)
def kept(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the family's tiny block-FP8 fixture, `mxforge quantize` of it with the family's keep-fp8 recipe)."""
    root = tmp_path_factory.mktemp(f"keep-{request.param}")
    write_fixture(root / "fp8", "tiny", seed=0, quiet=True, family=request.param, precision="fp8")
    cli(
        "quantize", str(root / "fp8"), str(root / "out"), "--recipe", _keep_recipe(request.param), "--quiet", check=True
    )
    return root / "fp8", root / "out"


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(d.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_kept_weights_are_the_source_bytes_with_quarks_scale_name(kept):
    """Each FP8 weight the recipe keeps is the source's codes and its scale_inv tiles byte for byte, the scales
    under `X.weight_scale`; no weight_scale_inv is left; those modules have a block-FP8 layer config under their
    exact names and are not excluded; the experts are MXFP4."""
    src, out = kept
    s, o = _tensors(src), _tensors(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    kept_fp8 = sorted(n for n, t in o.items() if t.dtype == torch.float8_e4m3fn)
    assert kept_fp8 and not [n for n in o if n.endswith("_scale_inv")]
    for name in kept_fp8:
        module = name.removesuffix(".weight")
        assert torch.equal(o[name].view(torch.uint8), s[name].view(torch.uint8)), name
        assert torch.equal(o[name + "_scale"].view(torch.uint8), s[name + "_scale_inv"].view(torch.uint8)), name
        assert format_of_spec(qc["layer_quant_config"][module]["weight"]) is FP8_BLOCK, module
        assert module not in qc["exclude"]
    kept_there = KEPT_FP8_AT.get(family_of(json.loads((src / "config.json").read_text())).name, ".self_attn.")
    assert any(kept_there in n for n in kept_fp8) and not any(".mlp.experts." in n for n in kept_fp8)
    assert any(".mlp.experts." in n and t.dtype == torch.uint8 for n, t in o.items())
    assert format_of_spec(qc["global_quant_config"]["weight"]) is MXFP4
    report = json.loads((out / QUANTIZE_NAME).read_text())
    assert report["counts"]["kept_source"] == len(kept_fp8) == len(report["tensors"]["kept_source"])


def _dequant_fp8_torch(x: torch.Tensor, s: torch.Tensor, block_size: int = 128, **_) -> torch.Tensor:
    """The stand-in for Quark's Triton `_weight_dequant_fp8`: each code as float32 times its tile's float32 scale."""
    rows, cols = x.shape
    tiles = s.float().repeat_interleave(block_size, 0)[:rows].repeat_interleave(block_size, 1)[:, :cols]
    return x.to(torch.float32) * tiles


def quark_keep_mode(f2f, src: Path, dst: Path, config) -> None:
    """Quark 0.13's `quantize_model_per_safetensor(src, config, dst, keep_excluded_layers_as_original_model_state=True,
    device="cpu")` for a single-file-scale FP8 source: its driver's steps (exclusions split by stored dtype, the
    cross-shard scale cache, each shard, the exclude-aware config, the export), each one Quark's own function with
    the arguments the driver passes, without the entry's CUDA-only gate for FP8 sources."""
    path, device = str(src), "cpu"
    hf_config = f2f._get_hf_model_config(path)
    floating: set[str] = set()
    excluded = f2f._collect_tensor_names_matching_quark_exclude(path, config, source_floating_names=floating)
    weight_map = f2f._load_weight_map(path)
    scale_cache = f2f._build_cross_file_scale_inv_cache(path, weight_map, device=device)
    dst.mkdir()
    out_map: dict[str, str] = {}
    for shard in f2f._get_safetensor_files(path):
        out_map.update(
            f2f._quantize_and_save_safetensor_shard(
                safetensor_path=shard,
                export_path=str(dst),
                quant_config=config,
                device=device,
                keep_excluded_layers_as_original_model_state=True,
                model_dtype=f2f._get_model_dtype_from_hf_model_config(hf_config),
                keep_original_model_state_tensor_names_set=excluded - floating,
                excluded_source_floating_tensor_names=floating,
                weight_converters=None,
                hf_model_config=hf_config,
                source_weight_map=weight_map,
                scale_inv_cache=scale_cache,
                presharded_weights=None,
                rotation_plan=None,
            )
        )
    exported = f2f._build_exclude_aware_quant_config(path, config, hf_config, True)
    f2f._export_config(path, exported, str(dst), out_map, hf_config)


@pytest.mark.quark
def test_keep_fp8_output_is_byte_identical_to_quarks_keep_mode(kept, tmp_path, monkeypatch):
    """Quark's file-to-file (MXFP4Scheme global, the recipe's exclusions: every module the output does not hold in
    MXFP4) with keep_excluded_layers_as_original_model_state writes the same shards, the same index map and the same
    quantization_config (Quark orders the kept modules' layer configs and its exclude list as a Python set
    iterates; mxforge sorts them).

    Quark's keep mode keeps every excluded FP8 weight FP8; a recipe may keep some bf16 instead (GLM-5.2's and
    DeepSeek-V3.2's indexer `wk`, which vLLM builds unquantized with `weights_proj`). Those modules alone differ:
    ours are the bf16 of Quark's kept codes times their tile scales (Quark's own dequantization, as its mode without
    keep writes them), excluded rather than given a layer config; every other tensor is Quark's byte for byte."""
    import quark.torch.quantization.file2file_quantization as f2f
    from quark.torch.quantization.config.config import QConfig
    from quark.torch.quantization.config.template import MXFP4Scheme

    src, out = kept
    monkeypatch.setattr(f2f, "_weight_dequant_fp8", _dequant_fp8_torch)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    source = _tensors(src)
    # Quark's file-to-file quantizes every `.weight` it is not told to exclude, 3-D ones too (Qwen3.5's gated-delta-net
    # conv1d, which every engine builds unquantized and no exclude list names): a Quark user excludes them as well
    unlisted = {n.removesuffix(".weight") for n, t in source.items() if n.endswith(".weight") and t.dim() > 2}
    exclude = sorted({*qc["exclude"], *qc["layer_quant_config"], *unlisted})
    dst = tmp_path / "quark"
    quark_keep_mode(f2f, src, dst, QConfig(global_quant_config=MXFP4Scheme().config, exclude=exclude))
    report = json.loads((out / QUANTIZE_NAME).read_text())
    as_bf16 = {n for n in report["tensors"]["kept"] if source[n].dtype == torch.float8_e4m3fn}
    ours, theirs = _tensors(out), _tensors(dst)
    assert set(theirs) == set(ours) | {n + "_scale" for n in as_bf16}
    for name, t in ours.items():
        if name in as_bf16:
            expected = _dequant_fp8_torch(theirs[name], theirs[name + "_scale"]).to(torch.bfloat16)
            assert torch.equal(t, expected), name
        else:
            assert t.dtype == theirs[name].dtype and torch.equal(t.view(torch.uint8), theirs[name].view(torch.uint8))
    if not as_bf16:  # then the files themselves are Quark's
        skip = {QUANTIZE_NAME, QUANTIZE_STATE_NAME, INDEX_NAME, "config.json"}
        files = {p.name: p.read_bytes() for p in sorted(dst.iterdir()) if p.is_file() and p.name not in skip}
        assert files and all((out / n).read_bytes() == b for n, b in files.items())
        ours_index, their_index = (json.loads((d / INDEX_NAME).read_text()) for d in (out, dst))
        assert ours_index["weight_map"] == their_index["weight_map"]
    ours_cfg, their_cfg = (json.loads((d / "config.json").read_text()) for d in (out, dst))
    modules = {n.removesuffix(".weight") for n in as_bf16}
    theirs_qc = their_cfg["quantization_config"]
    theirs_qc["layer_quant_config"] = {k: v for k, v in theirs_qc["layer_quant_config"].items() if k not in modules}
    theirs_qc["exclude"] = sorted({*theirs_qc["exclude"], *modules} - unlisted)
    ours_cfg["quantization_config"]["exclude"] = sorted(ours_cfg["quantization_config"]["exclude"])
    assert ours_cfg == their_cfg


@pytest.fixture(scope="module")
def ct_kept(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(GLM-4.5's tiny compressed-tensors FP8 fixture, its keep-fp8 output, its default-recipe output)."""
    root = tmp_path_factory.mktemp("keep-ct")
    write_fixture(root / "fp8", "tiny", seed=0, quiet=True, family=CT_FAMILY, precision="fp8")
    for name, recipe in (("out", _keep_recipe(CT_FAMILY)), ("default", family_named(CT_FAMILY).recipes[0])):
        cli("quantize", str(root / "fp8"), str(root / name), "--recipe", recipe, "--quiet", check=True)
    return root / "fp8", root / "out", root / "default"


def test_kept_compressed_tensors_weights_are_the_source_codes_as_fp8_ptpc(ct_kept, tmp_path):
    """Each compressed-tensors FP8 weight the recipe keeps is the source's E4M3 codes byte for byte with its
    per-channel weight_scale as FP8 PTPC's float32 [out] scales (the same values), no input_scale left; those modules
    have the layer config a module quantized to FP8 PTPC gets (the attn-fp8 recipe's, on the same source) and are not
    excluded; the experts are MXFP4."""
    src, out, _ = ct_kept
    s, o = _tensors(src), _tensors(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    kept_fp8 = sorted(n for n, t in o.items() if t.dtype == torch.float8_e4m3fn)
    assert kept_fp8 and not [n for n in o if n.endswith("input_scale")]
    attn = tmp_path / "attn"
    recipe = next(r for r in family_named(CT_FAMILY).recipes if r.endswith("-attn-fp8"))
    cli("quantize", str(src), str(attn), "--recipe", recipe, "--quiet", check=True)
    attn_qc = json.loads((attn / "config.json").read_text())["quantization_config"]
    for name in kept_fp8:
        module = name.removesuffix(".weight")
        assert torch.equal(o[name].view(torch.uint8), s[name].view(torch.uint8)), name
        scale = o[name + FP8_PTPC.scale_suffix]
        assert scale.dtype == torch.float32 and torch.equal(scale, s[name + "_scale"].float().flatten()), name
        layer = layer_config_of(qc, module)
        assert layer is not None and format_of_spec(layer["weight"]) is FP8_PTPC, module
        assert layer == layer_config_of(attn_qc, "model.layers.0.self_attn.q_proj"), module
        assert module not in qc["exclude"]
    kinds = [".self_attn.", ".mlp.gate_proj", ".shared_experts."]
    assert all(any(k in n for n in kept_fp8) for k in kinds) and not any(".mlp.experts." in n for n in kept_fp8)
    assert any(".mlp.experts." in n and t.dtype == torch.uint8 for n, t in o.items())
    assert format_of_spec(qc["global_quant_config"]["weight"]) is MXFP4
    report = json.loads((out / QUANTIZE_NAME).read_text())
    assert report["counts"]["kept_source"] == len(kept_fp8) == len(report["tensors"]["kept_source"])


def test_dequantize_turns_kept_compressed_tensors_fp8_into_the_bf16_the_default_recipe_keeps(ct_kept, tmp_path):
    """`mxforge dequantize` of the keep-fp8 output writes, for each kept FP8 weight, the bf16 the default recipe
    keeps from the same source (compressed-tensors' own dequantization: tests/quantize/test_fp8_source.py), and the
    MXFP4 experts as the default output's: the two recipes differ only in how they store those weights."""
    _, out, default = ct_kept
    for d in (out, default):
        cli("dequantize", str(d), str(tmp_path / d.name), "--quiet", check=True)
    a, b = _tensors(tmp_path / out.name), _tensors(tmp_path / default.name)
    assert set(a) == set(b)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])][:5]


def test_kept_compressed_tensors_output_validates_in_every_release_after_fixup(ct_kept, tmp_path):
    """The keep-fp8 output of a compressed-tensors source, fixed up, validates in every release of every engine:
    FP8 PTPC loads in sglang and vLLM alike (unlike block FP8, which only vLLM loads); sglang needs its shared-expert
    fusion off for the MTP layer's FP8 shared expert beside MXFP4 routed experts, as validate says."""
    _, out, _ = ct_kept
    fixed = tmp_path / "fixed"
    shutil.copytree(out, fixed)
    cli("fixup", str(fixed), "--quiet", check=True)
    report = tmp_path / "validate.json"
    proc = cli("validate", str(fixed), "--json", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    releases = json.loads(report.read_text())["releases"]
    assert {r["engine"].split("-")[0] for r in releases} == {"sglang", "vllm"} and all(r["ok"] for r in releases)


ATTN = "model.layers.0.self_attn.q_proj"


def _layout():
    family = family_named(CT_FAMILY)
    return family.layout_of(family.reference())


@pytest.mark.parametrize(
    "block,scale_shape,dtype",
    [((8, 64), (1,), "F32"), ((1, 64), (8, 1), "BF16")],
    ids=["per-tensor", "per-channel"],
)
def test_a_per_tensor_or_per_channel_scale_is_kept_as_one_float32_scale_per_row(block, scale_shape, dtype):
    """A compressed-tensors weight kept as stored: per tensor, its one scale repeated for each row; per channel,
    each row's own, as float32 (a BF16 scale is exact in float32)."""
    weight = TensorInfo(f"{ATTN}.weight", "F8_E4M3", (8, 64), 0, 512)
    scale = TensorInfo(f"{ATTN}.weight_scale", dtype, scale_shape, 512, 544)
    grid = (8 // block[0], 64 // block[1])
    fp8 = Fp8Scale("s.safetensors", scale, block, grid, kept_as="fp8_ptpc")
    plan = plan_tensor(weight, load_recipe(_keep_recipe(CT_FAMILY)), _layout(), fp8)
    assert plan.fate == "kept_source" and plan.format is FP8_PTPC
    values = np.arange(1, grid[0] + 1, dtype=np.float32).reshape(grid) / 4
    kept = fp8.kept_scales(values, FP8_PTPC, weight.shape)
    assert kept.shape == (8,) and list(kept) == [values[r * grid[0] // 8, 0] for r in range(8)]


def test_block_fp8_in_other_tiles_than_quarks_is_refused_naming_the_tensor():
    """Block FP8 kept as stored is Quark's keep: 128x128 float32 tiles only. Other tiles (or BF16 tile scales) are
    one error naming the tensor and what to do."""
    weight = TensorInfo(f"{ATTN}.weight", "F8_E4M3", (128, 128), 0, 16384)
    scale = TensorInfo(f"{ATTN}.weight_scale_inv", "F32", (2, 2), 16384, 16400)
    fp8 = Fp8Scale("s.safetensors", scale, (64, 64), (2, 2), kept_as="fp8_block")
    with pytest.raises(ConfigError) as e:
        plan_tensor(weight, load_recipe(_keep_recipe(CT_FAMILY)), _layout(), fp8)
    line = str(e.value)
    assert 'the recipe keeps it as the source stores it (format = "source")' in line and ATTN in line
    assert "64x64 weights" in line and "only as FP8 block" in line and "Keep it bf16" in line


@pytest.mark.parametrize(
    "rule,says",
    [
        ('[[keep]]\nkinds = ["attention"]\nformat = "fp8_ptpc"\n', "a [[keep]] rule's format can only be 'source'"),
        ('[[quantize]]\nkinds = ["attention"]\nformat = "fp8_block"\n', "mxforge does not quantize to format"),
    ],
)
def test_a_keep_rule_with_a_format_or_a_rule_quantizing_to_block_fp8_is_refused(rule, says, tiny_ckpt, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "r"\nscheme = "mxfp4"\n{rule}[[quantize]]\nkinds = ["experts"]\n')
    line = one_error_line(cli("quantize", str(tiny_ckpt), str(tmp_path / "out"), "--recipe", str(recipe)))
    assert says in line, line


def test_dequantize_turns_kept_block_fp8_into_the_bf16_it_stands_for(kept, tmp_path):
    """`mxforge dequantize` on the keep-fp8 output: each kept FP8 weight becomes its code times its tile's scale, as
    bf16 (what the engines' block dequantization makes of the source), the scales gone, the module excluded."""
    src, out = kept
    cli("dequantize", str(out), str(tmp_path / "bf16"), "--quiet", check=True)
    s, d = _tensors(src), _tensors(tmp_path / "bf16")
    kept_source = json.loads((out / QUANTIZE_NAME).read_text())["tensors"]["kept_source"]
    kept_fp8 = [n for n in kept_source if s[n].dtype == torch.float8_e4m3fn and n + "_scale_inv" in s]
    assert kept_fp8 and not any(n.endswith(".weight_scale") for n in d)
    for name in kept_fp8:
        rows, cols = s[name].shape
        tiles = s[name + "_scale_inv"].repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        assert torch.equal(d[name], (s[name].to(torch.float32) * tiles).to(torch.bfloat16)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_replica_whose_merged_block_fp8_shards_are_ragged_tiles_is_refused_for_vllm(family, tmp_path):
    """vLLM builds a merged block-FP8 GEMM only when every shard but the last is whole 128-row tiles
    (validate_fp8_block_shape; loaded for real in tests/vllm_cpu): a replica whose kept block-FP8 merges are ragged
    (helpers.RAGGED_TILES: the lineage's q_lora_rank and expert width 64, Qwen3.5's shared expert width 64,
    GLM-5.3-Flash's expert width 64) fails validate after fixup for every vLLM release, naming the module, the shard
    and the rule, and `mxforge run` refuses the recipe before quantizing; the family's tiny fixture (whole tiles)
    passes."""
    src = tmp_path / "fp8"
    ragged, merged = ragged_tiles(family)
    write_fixture(src, "tiny", seed=0, quiet=True, family=family, precision="fp8", overrides=ragged)
    recipe, out = _keep_recipe(family), tmp_path / "out"
    vllm = engines_for(recipe, "fp8_block")  # the vLLM releases that load it (GLM-5.3-Flash's: 0.31 on)
    cli("quantize", str(src), str(out), "--recipe", recipe, "--quiet", check=True)
    cli("fixup", str(out), "--engines", vllm, "--quiet")  # as run does before validate (exit 1: what it can't cure)
    report = tmp_path / "validate.json"
    proc = cli("validate", str(out), "--engines", vllm, "--json", str(report))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = json.loads(report.read_text())
    assert verdict["releases"] and not any(r["ok"] for r in verdict["releases"]), verdict["releases"]
    assert all(p["engine"].startswith("vllm") for p in verdict["problems"]), verdict["problems"]
    for suffix, shard in merged:
        named = [p for p in verdict["problems"] if p["subject"].endswith(suffix)]
        assert named, f"{suffix} (its shards 64 rows each) is not named"
        assert f"{shard} (not the last shard) has 64 rows" in named[0]["message"]
        assert "is not divisible by weight quantization block_n = 128" in named[0]["message"]

    line = one_error_line(cli("run", str(src), str(tmp_path / "run"), "--recipe", recipe, "--engines", vllm))
    assert merged[0][0].rsplit(".", 1)[1] in line and "not divisible by weight quantization block_n" in line
    assert not (tmp_path / "run" / "mxfp4" / "config.json").exists()

    whole = tmp_path / "whole"
    write_fixture(whole / "fp8", "tiny", seed=0, quiet=True, family=family, precision="fp8")
    cli("quantize", str(whole / "fp8"), str(whole / "out"), "--recipe", recipe, "--quiet", check=True)
    cli("fixup", str(whole / "out"), "--engines", vllm, "--quiet", check=True)
    assert cli("validate", str(whole / "out"), "--engines", vllm).returncode == 0
