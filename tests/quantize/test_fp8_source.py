"""FP8 sources: the official FP8 releases' layout, dequantization checked bit for bit against the reference code
(transformers' fine-grained FP8 loader in this venv, sglang's and vLLM's block dequant from their wheels), and
quantize from an FP8 checkpoint: same MXFP4 as from the bf16 it stands for, no scale or FP8 config left over,
bit-reproducible across runs, workers and a resume."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import cli

from mxforge.checkpoint import Checkpoint
from mxforge.errors import CheckpointError, ConfigError
from mxforge.formats.mxfp4.numerics import quantize_rows_cpu
from mxforge.models import FAMILIES, family_named
from mxforge.models.fixture import (
    CT_FP8_CHANNEL_QUANTIZATION_CONFIG,
    FP8_QUANTIZATION_CONFIG,
    fp8_block_quantize,
    fp8_channel_quantize,
    write_fixture,
)
from mxforge.models.layout import fp8_block_inventory, fp8_inventory
from mxforge.quantize.fp8_source import dequantize_rows, source_precision
from mxforge.quantize.run import quantize_checkpoint


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy()


def _random_fp8(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every e4m3 code (NaN aside) in random places, with random positive block scales of all magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # NaN codes -> 1.5
    scales = torch.exp2(torch.randint(-20, 4, (-(-rows // 128), -(-cols // 128)), generator=gen).float())
    scales *= torch.rand(scales.shape, generator=gen) + 0.5
    return codes.view(torch.float8_e4m3fn), scales


def _ours(q: torch.Tensor, s: torch.Tensor) -> np.ndarray:
    return dequantize_rows(q.view(torch.uint8).numpy().tobytes(), s.numpy(), 0, q.shape[1], (128, 128))


def test_glm52_fp8_release_is_block_fp8_with_these_bf16_weights():
    """zai-org/GLM-5.2-FP8 (glm-5.2.md): 118,629 tensors, 755,617,140,416 bytes. The GLM-5.2 layout gives exactly
    that as 128x128 block FP8 with weight_scale_inv, with router, eh_proj, embeddings, lm_head and the indexer's
    weights_proj kept bf16; the neighbouring choices (DeepSeek-V3's set, weights_proj quantized) do not."""
    family = family_named("glm_moe_dsa")
    bf16 = family.layout_of(family.reference()).tensors()
    fp8 = fp8_block_inventory(bf16, family.fp8_bf16_weights)
    assert (len(fp8), sum(t.nbytes for t in fp8)) == (118629, 755617140416)
    assert sum(t.name.endswith("_scale_inv") for t in fp8) == 118629 - 59585
    for other in (
        family_named("deepseek_v3").fp8_bf16_weights,
        r"(\.mlp\.gate|\.eh_proj|embed_tokens|lm_head)\.weight$",
        r"(\.mlp\.gate|embed_tokens|lm_head|indexer\.weights_proj)\.weight$",
    ):
        alt = fp8_block_inventory(bf16, other)
        assert (len(alt), sum(t.nbytes for t in alt)) != (118629, 755617140416)


def _engine_functions(dist: str, version: str, module: str, names: tuple[str, ...]) -> dict:
    """The release's own definitions of `names` in `module` (its wheel's source), run with torch as their globals."""
    from engine_truth.wheels import Release

    return Release(dist, version).functions(module, names, {"torch": torch, "List": list, "GroupShape": object})


@pytest.mark.parametrize("shape", [(256, 384), (300, 200)])
def test_dequantize_equals_sglang_block_quant_dequant(shape):
    """sglang's `block_quant_dequant` (its wheel's source; what its FP8 -> MXFP4 load path runs), to bf16: bit-equal,
    partial edge blocks included."""
    q, s = _random_fp8(*shape, seed=shape[0])
    fn = _engine_functions("sglang", "0.5.23", "sglang.srt.layers.quantization.fp8_utils", ("block_quant_dequant",))[
        "block_quant_dequant"
    ]
    assert np.array_equal(_bf16_bits(fn(q, s, [128, 128], torch.bfloat16)), _ours(q, s))


def _vllm_scaled_dequantize():
    """vLLM's `scaled_dequantize` (its wheel's source), with the broadcast helpers it calls."""
    return _engine_functions(
        "vllm",
        "0.33.0",
        "vllm.model_executor.layers.quantization.utils.quant_utils",
        ("scaled_dequantize", "group_broadcast", "prep_scale_for_group_broadcast"),
    )["scaled_dequantize"]


def test_dequantize_equals_vllm_scaled_dequantize():
    """vLLM's `scaled_dequantize` (its wheel's source) on whole blocks (its broadcast needs them), to bf16:
    bit-equal."""
    q, s = _random_fp8(384, 256, seed=3)
    assert np.array_equal(_bf16_bits(_vllm_scaled_dequantize()(q, s, None, torch.bfloat16)), _ours(q, s))


def test_dequantize_equals_transformers_fine_grained_fp8():
    """transformers' FP8 loader (`Fp8Dequantize._dequantize_one`, what `dequantize=True` runs) on whole blocks."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, s = _random_fp8(384, 256, seed=7)
    ref = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16)
    assert np.array_equal(_bf16_bits(ref), _ours(q, s))
    # a chunk of rows starting mid-block uses that block's scales, as the whole tensor does
    part = dequantize_rows(q.view(torch.uint8)[100:230].numpy().tobytes(), s.numpy(), 100, 256, (128, 128))
    assert np.array_equal(part, _bf16_bits(ref)[100:230])


def _ct_dequantize():
    """compressed-tensors' `_dequantize` (its wheel's source): what its FP8 decompressor (`dequantize`, strategies
    tensor / channel via `_apply_quantize_op`) runs; the result is in the scale's dtype, cast to bf16 on load."""
    return _engine_functions(
        "compressed-tensors", "0.20.0", "compressed_tensors.quantization.lifecycle.forward_helpers", ("_dequantize",)
    )["_dequantize"]


def _random_channel_fp8(rows: int, cols: int, seed: int, scale_dtype, per_tensor: bool = False):
    """Every e4m3 code (NaN aside) at random, with one positive scale per row (or one in all) of all magnitudes."""
    q, _ = _random_fp8(rows, cols, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    n = 1 if per_tensor else rows
    scale = torch.exp2(torch.randint(-20, 4, (n, 1), generator=gen).float()) * (torch.rand((n, 1), generator=gen) + 0.5)
    return q, scale.to(scale_dtype)


def _ours_ct(q: torch.Tensor, scale: torch.Tensor, first_row: int = 0, rows: int | None = None) -> np.ndarray:
    from mxforge.quantize.fp8_source import scales_as_f32

    raw = scale.contiguous().view(torch.uint8 if scale.dtype == torch.float32 else torch.int16).numpy().tobytes()
    grid = scales_as_f32(raw, "F32" if scale.dtype == torch.float32 else "BF16", tuple(scale.shape))
    block = (q.shape[0], q.shape[1]) if scale.shape[0] == 1 else (1, q.shape[1])
    part = q.view(torch.uint8)[first_row : first_row + (rows or q.shape[0])]
    return dequantize_rows(part.numpy().tobytes(), grid, first_row, q.shape[1], block)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_dequantize_equals_compressed_tensors_dequantize(scale_dtype, per_tensor):
    """compressed-tensors FP8 (GLM-4.5-FP8's format): `_dequantize(x_q, weight_scale)` then bf16, bit-equal for F32 and
    BF16 scales, per channel and per tensor; a chunk of rows starting anywhere uses its rows' scales."""
    q, scale = _random_channel_fp8(300, 200, seed=11, scale_dtype=scale_dtype, per_tensor=per_tensor)
    ref = _bf16_bits(_ct_dequantize()(q, scale).to(torch.bfloat16))
    assert np.array_equal(_ours_ct(q, scale), ref)
    assert np.array_equal(_ours_ct(q, scale, 77, 150), ref[77:227])


def test_channel_dequantize_equals_vllm_scaled_dequantize():
    """vLLM's `scaled_dequantize` (its wheel's source) with a per-channel [out, 1] scale, to bf16: bit-equal."""
    q, scale = _random_channel_fp8(256, 384, seed=5, scale_dtype=torch.float32)
    assert np.array_equal(_bf16_bits(_vllm_scaled_dequantize()(q, scale, None, torch.bfloat16)), _ours_ct(q, scale))


def _ct_config(**weights) -> dict:
    group = CT_FP8_CHANNEL_QUANTIZATION_CONFIG["config_groups"]["group_0"]
    return {
        **CT_FP8_CHANNEL_QUANTIZATION_CONFIG,
        "config_groups": {"group_0": {**group, "weights": {**group["weights"], **weights}}},
    }


def test_compressed_tensors_fp8_is_read_per_channel_or_tensor_and_anything_else_refused():
    channel = source_precision({"quantization_config": CT_FP8_CHANNEL_QUANTIZATION_CONFIG})
    assert (channel.scheme, channel.block_of((64, 256)), channel.scale_shape((64, 256))) == (
        "channel",
        (1, 256),
        (64, 1),
    )
    assert channel.describe() == "fp8 (e4m3, compressed-tensors, per-channel weight_scale)"
    tensor = source_precision({"quantization_config": _ct_config(strategy="tensor")})
    assert (tensor.scheme, tensor.scale_shape((64, 256)), tensor.stored_scale_shapes((64, 256))[1:]) == (
        "tensor",
        (1, 1),
        ((1,), ()),
    )
    for qc, found in (
        (_ct_config(strategy="group", group_size=128), "'strategy': 'group'"),
        (_ct_config(strategy="block", block_structure=[128, 128]), "'strategy': 'block'"),
        (_ct_config(type="int"), "'type': 'int'"),
        (_ct_config(num_bits=4), "'num_bits': 4"),
        (_ct_config(symmetric=False), "'symmetric': False"),
        ({**CT_FP8_CHANNEL_QUANTIZATION_CONFIG, "format": "pack-quantized"}, "format 'pack-quantized'"),
        ({**CT_FP8_CHANNEL_QUANTIZATION_CONFIG, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ):
        with pytest.raises(ConfigError, match="does not read; supported: .*per-channel|does not read; supported") as e:
            source_precision({"quantization_config": qc})
        assert found in str(e.value) and 'strategy "channel" or "tensor"' in str(e.value), str(e.value)


def test_unknown_fp8_layouts_are_one_clear_error():
    assert not source_precision({}).is_fp8
    assert source_precision({"quantization_config": FP8_QUANTIZATION_CONFIG}).block == (128, 128)
    for qc in (
        {"quant_method": "compressed-tensors", "format": "float-quantized"},  # no config_groups
        {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
        {"quant_method": "fp8", "activation_scheme": "static"},
    ):
        with pytest.raises(ConfigError, match="supported: .*weight_scale_inv"):
            source_precision({"quantization_config": qc})


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "glm-fp8"
    write_fixture(out, "tiny", seed=0, quiet=True, precision="fp8")
    return out


def _reference_bf16(fp8: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The bf16 an FP8 fixture weight stands for, by the reference: DeepSeek's block formula (float32 product, bf16) or
    compressed-tensors' `_dequantize` (executed from its wheel) cast to bf16."""
    q = fp8[name]
    if name + "_scale_inv" in fp8:
        s = fp8[name + "_scale_inv"]
        rows, cols = q.shape
        return (q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]).to(torch.bfloat16)
    return _ct_dequantize()(q, fp8[name + "_scale"]).to(torch.bfloat16)


@pytest.mark.parametrize("family", [f.name for f in FAMILIES if f.has_fp8_release])
def test_fp8_fixture_is_the_release_layout_of_the_bf16_fixture(family, tmp_path):
    """Same names as the family's FP8 release (its bf16 weights bf16, every other 2-D weight e4m3 + its scales, each
    weight's tensors in one shard), its quantization_config, and weights within e4m3's rounding of the bf16
    fixture's."""
    fam = family_named(family)
    write_fixture(tmp_path / "bf16", "tiny", quiet=True, family=fam)
    write_fixture(tmp_path / "fp8", "tiny", quiet=True, family=fam, precision="fp8")
    ckpt = Checkpoint.open(tmp_path / "fp8")
    planned = fp8_inventory(fam.layout_of(ckpt.config).tensors(), fam.fp8_format, fam.fp8_bf16_weights)
    infos = ckpt.tensor_infos()
    assert {t.name: (t.dtype, t.shape) for t in planned} == {n: (i.dtype, i.shape) for n, i in infos.items()}
    precision = source_precision(ckpt.config)
    if fam.fp8_format == "block":
        listed = {}
        if fam.fp8_ignore_key:  # the release's bf16 Linear modules, listed (Qwen's modules_to_not_convert)
            linear = [n for n, i in infos.items() if n.endswith(".weight") and len(i.shape) == 2]
            kept = sorted(n.removesuffix(".weight") for n in linear if re.search(fam.fp8_bf16_weights, n))
            listed = {fam.fp8_ignore_key: [n for n in kept if "embed_tokens" not in n]}
        assert ckpt.config["quantization_config"] == {**FP8_QUANTIZATION_CONFIG, **listed}
    else:
        kept = sorted(n.removesuffix(".weight") for n, i in infos.items() if re.search(fam.fp8_bf16_weights, n))
        assert ckpt.config["quantization_config"]["ignore"] == [n for n in kept if "embed_tokens" not in n]
        assert precision.scheme == "channel"
    for n, i in infos.items():
        if i.dtype == "F8_E4M3":
            siblings = [n + precision.fp8.scale_suffix, *precision.sibling_names(n)]
            assert {ckpt.weight_map[x] for x in siblings} == {ckpt.weight_map[n]}, n
    bf16, fp8 = _tensors(tmp_path / "bf16"), _tensors(tmp_path / "fp8")
    for name, w in bf16.items():
        if fp8[name].dtype == torch.float8_e4m3fn:
            deq = _reference_bf16(fp8, name).float()
            scale = fp8.get(name + "_scale_inv", fp8.get(name + "_scale"))
            assert torch.allclose(deq, w.float(), rtol=2**-3, atol=float(scale.float().max()) * 2**-9)
        else:
            assert torch.equal(fp8[name], w)


def _write_reference_bf16(fp8_dir: Path, out: Path) -> None:
    """The bf16 checkpoint an FP8 one stands for, each weight dequantized by the reference (_reference_bf16), scales
    and FP8 quantization_config dropped; the shard plan kept."""
    from safetensors.torch import save_file

    out.mkdir()
    for p in fp8_dir.iterdir():
        if p.suffix != ".safetensors":
            shutil.copy(p, out / p.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    precision = source_precision(json.loads((fp8_dir / "config.json").read_text()))
    for shard in sorted(fp8_dir.glob("*.safetensors")):
        tensors = _tensors_of(shard)
        fp8_names = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
        dropped = {x for n in fp8_names for x in (n + precision.fp8.scale_suffix, *precision.sibling_names(n))}
        bf16 = {
            n: (_reference_bf16(tensors, n) if n in fp8_names else t) for n, t in tensors.items() if n not in dropped
        }
        save_file(bf16, out / shard.name, metadata={"format": "pt"})
        for n in dropped:
            index["weight_map"].pop(n, None)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def test_quantize_compressed_tensors_fp8_equals_quantizing_the_bf16_it_stands_for(tmp_path):
    """GLM-4.5-FP8's layout: the MXFP4 checkpoint (every shard, config.json, index) is byte for byte the one quantized
    from the bf16 made by compressed-tensors' own dequantization; no weight_scale/input_scale of the source left."""
    write_fixture(tmp_path / "fp8", "tiny", quiet=True, family="glm4_moe", precision="fp8")
    _write_reference_bf16(tmp_path / "fp8", tmp_path / "bf16")
    report = quantize_checkpoint(tmp_path / "fp8", tmp_path / "a", quiet=True, workers=2)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "b", quiet=True, workers=1)
    assert report.source_precision == "fp8 (e4m3, compressed-tensors, per-channel weight_scale)"
    fp8_weights = sum(i.dtype == "F8_E4M3" for i in Checkpoint.open(tmp_path / "fp8").tensor_infos().values())
    assert report.fp8_scales_consumed == 2 * fp8_weights  # weight_scale and input_scale of each
    kept_fp8 = [n for n in report.tensors["kept"] if not re.search(family_named("glm4_moe").fp8_bf16_weights, n)]
    assert report.tensors["quantized"] and kept_fp8  # both fates of an FP8 weight are covered
    out = sorted((tmp_path / "a").glob("*.safetensors"))
    assert [p.name for p in out] == [p.name for p in sorted((tmp_path / "b").glob("*.safetensors"))]
    for p in out + [tmp_path / "a" / "config.json", tmp_path / "a" / "model.safetensors.index.json"]:
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes(), p.name
    names = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(n.endswith(".input_scale") for n in names)


def test_quantize_per_tensor_compressed_tensors_fp8_equals_quantizing_the_bf16_it_stands_for(tmp_path):
    """strategy "tensor": one F32 `weight_scale` [1] per weight, read as the whole weight's block."""
    from safetensors.torch import save_file

    write_fixture(tmp_path / "fp8", "tiny", quiet=True, family="glm4_moe", precision="fp8")
    for shard in sorted((tmp_path / "fp8").glob("*.safetensors")):
        tensors = _tensors_of(shard)
        for name in [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]:
            w = _reference_bf16(tensors, name).float()
            scale = (w.abs().max() / 448).reshape(1)
            tensors[name] = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name + "_scale"] = scale
        save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = _ct_config(strategy="tensor")
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    _write_reference_bf16(tmp_path / "fp8", tmp_path / "bf16")
    report = quantize_checkpoint(tmp_path / "fp8", tmp_path / "a", quiet=True)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "b", quiet=True)
    assert report.source_precision == "fp8 (e4m3, compressed-tensors, per-tensor weight_scale)"
    for p in sorted((tmp_path / "b").glob("*.safetensors")) + [tmp_path / "b" / "config.json"]:
        assert p.read_bytes() == (tmp_path / "a" / p.name).read_bytes(), p.name


def test_compressed_tensors_fp8_without_or_with_misshapen_scales_is_refused(tmp_path):
    from safetensors.torch import save_file

    write_fixture(tmp_path / "fp8", "tiny", quiet=True, family="glm4_moe", precision="fp8")
    shard = sorted((tmp_path / "fp8").glob("*.safetensors"))[0]
    tensors = _tensors_of(shard)
    scale = next(n for n in sorted(tensors) if n.endswith(".weight_scale"))
    tensors[scale] = tensors[scale][:-1]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"weight_scale.*expected F32\[\d+, 1\].*compressed-tensors strategy 'channel'"
    ):
        quantize_checkpoint(tmp_path / "fp8", tmp_path / "o", quiet=True)


def test_quantize_block_fp8_equals_quantizing_its_float32_dequantization(fp8_tiny, tmp_path):
    """Quantized weights: Quark-numerics MXFP4 of the reference dequantization's float32 product (what Quark's
    file-to-file quantizes for a block-FP8 source: tests/quantize/test_keep_source.py runs it); kept weights: that
    product as bf16; scales and the FP8 quantization_config gone; the report names the source precision."""
    report = quantize_checkpoint(fp8_tiny, tmp_path / "q", quiet=True, workers=1)
    assert report.source_precision.startswith("fp8") and report.fp8_scales_consumed > 0
    src, out = _tensors(fp8_tiny), _tensors(tmp_path / "q")
    assert not any(n.endswith("_scale_inv") for n in out) and not any(
        t.dtype == torch.float8_e4m3fn for t in out.values()
    )
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "quark" and "weight_block_size" not in json.dumps(config)
    quantized = set(report.tensors["quantized"])
    kept_fp8 = [n for n in report.tensors["kept"] if src[n].dtype == torch.float8_e4m3fn]
    assert quantized and kept_fp8
    for name in sorted(quantized)[:12] + kept_fp8:
        ref = src[name].to(torch.float32)
        s = src[name + "_scale_inv"]
        rows, cols = ref.shape
        product = ref * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        ref = product.to(torch.bfloat16)
        if name in quantized:
            codes = np.empty((rows, cols // 2), np.uint8)
            scales = np.empty((rows, -(-cols // 32)), np.uint8)
            quantize_rows_cpu(product.numpy(), codes, scales)
            assert np.array_equal(out[name].numpy(), codes) and np.array_equal(out[name + "_scale"].numpy(), scales)
        else:
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], ref)


def test_quantize_fp8_is_bit_reproducible_across_workers_and_resume(fp8_tiny, tmp_path):
    quantize_checkpoint(fp8_tiny, tmp_path / "a", quiet=True, workers=1)
    quantize_checkpoint(fp8_tiny, tmp_path / "b", quiet=True, workers=2)
    first = sorted((tmp_path / "b").glob("*.safetensors"))[0]
    first.unlink()  # a shard lost: the rerun redoes it only
    again = quantize_checkpoint(fp8_tiny, tmp_path / "b", quiet=True, workers=2)
    assert (again.shards.quantized_now, again.shards.skipped_complete) == (1, again.shards.total - 1)
    for p in sorted((tmp_path / "a").glob("*.safetensors")) + [
        tmp_path / "a" / "config.json",
        tmp_path / "a" / "model.safetensors.index.json",
    ]:
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes(), p.name


def test_fp8_checkpoint_without_its_scales_or_config_is_refused(fp8_tiny, tmp_path):
    broken = tmp_path / "noconfig"
    shutil.copytree(fp8_tiny, broken)
    config = json.loads((broken / "config.json").read_text())
    config.pop("quantization_config")
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="F8_E4M3 but config.json has no FP8 quantization_config"):
        quantize_checkpoint(broken, tmp_path / "o1", quiet=True)
    config["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, "weight_block_size": [64, 64]}
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv.*expected F32.*weight_block_size \[64, 64\]"):
        quantize_checkpoint(broken, tmp_path / "o2", quiet=True)


def test_inspect_names_precision_family_and_recipe(fp8_tiny):
    proc = cli("inspect", str(fp8_tiny), check=True)
    assert "precision: fp8 (e4m3, 128x128 block scales, weight_scale_inv); default recipe: glm-5.2-mxfp4" in proc.stdout
    assert "(GLM-5 / 5.1 / 5.2)" in proc.stdout


def test_inspect_names_compressed_tensors_fp8(tmp_path):
    write_fixture(tmp_path / "fp8", "tiny", quiet=True, family="glm4_moe", precision="fp8")
    proc = cli("inspect", str(tmp_path / "fp8"), check=True)
    assert "precision: fp8 (e4m3, compressed-tensors, per-channel weight_scale); default recipe: glm-4.5-mxfp4" in (
        proc.stdout
    )


def test_fp8_channel_quantize_round_trips_within_e4m3_precision():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, s = fp8_channel_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (200, 1) and s.dtype == torch.bfloat16
    back = _ct_dequantize()(q, s).float()
    assert bool(((back - w.float()).abs() <= w.float().abs() * 2**-3 + s.float() * 2**-9).all())


def test_fp8_block_quantize_round_trips_within_e4m3_precision():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, s = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    back = torch.from_numpy(_ours(q, s)).view(torch.bfloat16).float()
    step = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300] * 2**-9  # e4m3's subnormal step
    assert bool(((back - w.float()).abs() <= w.float().abs() * 2**-3 + step).all())
    assert float(back.abs().max()) == pytest.approx(float(w.float().abs().max()), rel=2**-3)


def _move_scale_to_next_shard(src: Path, dst: Path) -> str:
    """A copy of FP8 checkpoint `src` with one weight's scales moved into the next shard (as a release split at a
    shard boundary stores them); returns that weight's name."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(dst.glob("*.safetensors"))
    first, second = _tensors_of(shards[0]), _tensors_of(shards[1])
    scale = next(n for n in sorted(first) if n.endswith("_scale_inv"))
    second[scale] = first.pop(scale)
    save_file(first, shards[0], metadata={"format": "pt"})
    save_file(second, shards[1], metadata={"format": "pt"})
    index["weight_map"][scale] = shards[1].name
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return scale.removesuffix("_scale_inv")


def _tensors_of(shard: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(shard)


def test_scales_in_another_shard_are_read_from_it_and_a_stream_refuses_them(fp8_tiny, tmp_path):
    weight = _move_scale_to_next_shard(fp8_tiny, tmp_path / "split")
    quantize_checkpoint(fp8_tiny, tmp_path / "a", quiet=True)
    quantize_checkpoint(tmp_path / "split", tmp_path / "b", quiet=True)
    for p in sorted((tmp_path / "a").glob("*.safetensors")):
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes(), p.name
    proc = cli("run", str(tmp_path / "split"), str(tmp_path / "s"), "--stream", "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"FP8 weight {weight!r} has its block scales in model-00002-of-00003.safetensors" in proc.stderr


def test_mtp_from_an_fp8_source_is_refused_with_what_to_do(fp8_tiny):
    from mxforge.fixups.mtp_inject import plan_mtp_injection
    from mxforge.quantize.recipe import load_recipe

    ckpt = Checkpoint.open(fp8_tiny)
    with pytest.raises(ConfigError, match="is an FP8 checkpoint; --mtp-from reads a bf16 source"):
        plan_mtp_injection(ckpt, ckpt, load_recipe(None, ckpt.config))


# The official FP8 releases' inventories: (tensors, bytes, shards or None where not known here). Sources: glm-5.2.md
# (zai-org/GLM-5.2-FP8; its shard count is not recorded there), and the DeepSeek families' FP8 shard headers
# (mxforge/models/deepseek_v3.py, deepseek_v32.py).
FP8_RELEASES = {
    "glm_moe_dsa": (118629, 755617140416, None),
    "deepseek_v3": (91991, 688574839360, 163),
    "deepseek_v32": (92425, 689471107200, 163),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FP8_RELEASES))
def test_full_layout_fp8_fixture_reproduces_the_fp8_release(family, tmp_path):
    tensors, nbytes, shards = FP8_RELEASES[family]
    result = write_fixture(tmp_path / "fl", "full-layout", quiet=True, family=family, precision="fp8")
    ckpt = Checkpoint.open(tmp_path / "fl")
    infos = ckpt.tensor_infos()
    assert (result.tensors, len(infos), result.total_size, sum(i.nbytes for i in infos.values())) == (
        tensors,
        tensors,
        nbytes,
        nbytes,
    )
    assert shards is None or len(ckpt.shard_names) == shards
    assert ckpt.config["quantization_config"] == FP8_QUANTIZATION_CONFIG


def test_bf16_weights_under_an_fp8_config_are_a_bf16_source(tiny_ckpt, tmp_path):
    """DeepSeek's fp8_cast_bf16.py writes bf16 shards and leaves the FP8 quantization_config in config.json: that is
    a bf16 source (and said so), quantized exactly as without the stale config."""
    src = tmp_path / "cast"
    shutil.copytree(tiny_ckpt, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_QUANTIZATION_CONFIG}))
    stale = quantize_checkpoint(src, tmp_path / "a", quiet=True)
    assert stale.source_precision == "bf16"
    quantize_checkpoint(tiny_ckpt, tmp_path / "b", quiet=True)
    for p in sorted((tmp_path / "b").glob("*.safetensors")) + [tmp_path / "b" / "config.json"]:
        assert p.read_bytes() == (tmp_path / "a" / p.name).read_bytes(), p.name


def test_fp8_fixture_of_glm45_is_its_compressed_tensors_release_layout(tmp_path):
    """GLM-4.5's FP8 releases are compressed-tensors per-channel FP8: that is what --precision fp8 writes for it."""
    proc = cli("fixture", str(tmp_path / "cli"), "--family", "glm4_moe", "--precision", "fp8", "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    qc = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    assert (
        qc["quant_method"] == "compressed-tensors"
        and qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    )
    assert "lm_head" in qc["ignore"]
