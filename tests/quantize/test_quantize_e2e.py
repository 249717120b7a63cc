"""`mxforge quantize` end to end on the tiny fixture: Quark's bytes, recipes, accounting, determinism."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxforge.checkpoint import INDEX_NAME, Checkpoint
from mxforge.formats import MXFP4
from mxforge.provenance import QUANTIZE_NAME, QUANTIZE_STATE_NAME
from mxforge.quantize.result import QuantizeResult, ShardCounts
from mxforge.quantize.run import quantize_checkpoint
from mxforge.validation.validate import validate_checkpoint


def _files(d: Path) -> dict[str, bytes]:
    skip = {QUANTIZE_NAME, QUANTIZE_STATE_NAME}  # timings, worker counts, mtimes
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name not in skip}  # not .cache/


@pytest.fixture(scope="module")
def quantized_tiny(quantized_tiny) -> tuple[Path, QuantizeResult]:
    """The session's `mxforge quantize` of the tiny fixture (conftest.py), with its --json report read back as the
    typed result (the same document as the record)."""
    assert "MXFP4" in (quantized_tiny.parent / "quantize.txt").read_text()
    written = json.loads((quantized_tiny.parent / "quantize.json").read_text())
    assert written == json.loads((quantized_tiny / QUANTIZE_NAME).read_text())
    report = QuantizeResult.from_dict(written)
    assert report.as_dict() == written  # the typed result writes back the very document it was read from
    return quantized_tiny, report


@pytest.fixture(scope="module")
def quark_tiny(tiny_ckpt, quantized_tiny, tmp_path_factory) -> Path:
    """Quark 0.13's own file-to-file output for the same input and the same exclusions."""
    from quark.torch import ModelQuantizer

    from mxforge.formats.quark import qconfig

    out, _ = quantized_tiny
    exclude = json.loads((out / "config.json").read_text())["quantization_config"]["exclude"]
    dst = tmp_path_factory.mktemp("quark") / "tiny-quark"
    ModelQuantizer(qconfig(MXFP4, exclude)).direct_quantize_checkpoint(str(tiny_ckpt), str(dst), device="cpu")
    return dst


@pytest.mark.quark
def test_shards_and_config_byte_identical_to_quark_file_to_file(quantized_tiny, quark_tiny):
    ours, theirs = _files(quantized_tiny[0]), _files(quark_tiny)
    assert set(theirs) <= set(ours)
    different = [n for n in theirs if ours[n] != theirs[n]]
    # The index differs by design: Quark's total_size counts whole files (headers too), the HF convention
    # (and `mxforge validate`) counts tensor bytes; the weight maps agree.
    assert different == [INDEX_NAME]
    ours_map = json.loads(ours[INDEX_NAME])["weight_map"]
    assert ours_map == json.loads(theirs[INDEX_NAME])["weight_map"]


@pytest.mark.quark
def test_every_tiny_weight_bytes_equal_quark(tiny_ckpt):
    from mxforge.formats.quark import quark_quantize_weight

    ckpt = Checkpoint.open(tiny_ckpt)
    checked = 0
    for shard in ckpt.shard_names:
        for name, w in load_file(tiny_ckpt / shard).items():
            if w.ndim == 2:
                assert all(
                    torch.equal(a, b) for a, b in zip(MXFP4.quantize(w, name=name), quark_quantize_weight(MXFP4, w))
                ), name
                checked += 1
    assert checked > 200


def test_every_source_tensor_accounted_for(tiny_ckpt, quantized_tiny):
    out, report = quantized_tiny
    source = Checkpoint.open(tiny_ckpt)
    counts = report.counts
    assert counts.quantized + counts.kept + counts.copied == len(source.weight_map)
    listed = report.tensors["quantized"] + report.tensors["kept"] + report.tensors["copied"]
    assert sorted(listed) == sorted(source.weight_map)
    result = Checkpoint.open(out)
    mtp = f"model.layers.{source.config['num_hidden_layers']}."
    assert report.mtp_tensors == sum(n.startswith(mtp) for n in source.weight_map) > 0
    infos = result.tensor_infos()
    for name in report.tensors["quantized"]:
        rows, cols = source.tensor_infos()[name].shape
        assert (infos[name].dtype, infos[name].shape) == ("U8", (rows, cols // 2))
        assert (infos[name + "_scale"].dtype, infos[name + "_scale"].shape) == ("U8", (rows, -(-cols // 32)))
    assert infos[f"{mtp}mlp.experts.0.down_proj.weight"].dtype == "U8"
    assert infos[f"{mtp}mlp.shared_experts.down_proj.weight"].dtype == "BF16"
    assert infos[f"{mtp}eh_proj.weight"].dtype == "BF16"
    assert infos["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == "F32"
    # Engine-independent checks pass; per release, only sglang before GLM's own draft class (0.5.16) needs
    # `mxforge fixup`'s MTP aliases.
    validation = validate_checkpoint(out)
    assert not [p for p in validation.problems if p.engine is None]
    assert {r["profile"] for r in validation.releases() if not r["ok"]} == {
        "sglang-0.5.9",
        "sglang-0.5.10",
        "sglang-0.5.11",
        "sglang-0.5.12",
        "sglang-0.5.15",
    }
    config = json.loads((out / "config.json").read_text())
    exclude = config["quantization_config"]["exclude"]
    assert exclude == sorted(n.removesuffix(".weight") for n in report.tensors["kept"])
    assert f"{mtp}eh_proj" in exclude and "lm_head" in exclude and "model.embed_tokens" not in exclude


def test_provenance_and_side_files(tiny_ckpt, quantized_tiny):
    out, _ = quantized_tiny
    prov = json.loads((out / QUANTIZE_NAME).read_text())
    assert prov["recipe"]["name"] == "glm-5.2-mxfp4" and len(prov["recipe"]["sha256"]) == 64
    assert prov["source"] == str(tiny_ckpt.resolve()) and prov["command"].startswith("mxforge quantize ")
    assert prov["tool_versions"]["amd-quark"] == "0.13"
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / side).read_bytes() == (tiny_ckpt / side).read_bytes()
    assert not list(out.glob("*.partial"))


def test_mtp_bf16_recipe_keeps_whole_mtp_layer(tiny_ckpt, tmp_path):
    report = quantize_checkpoint(tiny_ckpt, tmp_path / "o", "glm-5.2-mxfp4-mtp-bf16", workers=1, quiet=True)
    mtp = f"model.layers.{report.mtp_layers[0]}."
    infos = Checkpoint.open(tmp_path / "o").tensor_infos()
    assert not [n for n, i in infos.items() if n.startswith(mtp) and i.dtype == "U8"]
    assert report.mtp_tensors > 0 and report.counts.quantized > 0


def test_deterministic_across_runs_and_worker_counts(tiny_ckpt, quantized_tiny, tmp_path):
    quantize_checkpoint(tiny_ckpt, tmp_path / "w1", workers=1, quiet=True)
    quantize_checkpoint(tiny_ckpt, tmp_path / "w3", workers=3, quiet=True)
    reference = _files(quantized_tiny[0])
    assert _files(tmp_path / "w1") == reference == _files(tmp_path / "w3")


def test_rerun_skips_complete_shards_and_redoes_stale_ones(tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    out = tmp_path / "out"
    first = quantize_checkpoint(src, out, workers=1, quiet=True)
    assert first.shards == ShardCounts(total=3, quantized_now=3, skipped_complete=0)
    again = quantize_checkpoint(src, out, workers=1, quiet=True)
    assert again.shards.skipped_complete == 3
    # a damaged output shard and a touched-but-identical source: only the damaged one is redone
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    (src / sorted(out.glob("*.safetensors"))[1].name).touch()
    third = quantize_checkpoint(src, out, workers=1, quiet=True)
    assert third.shards == ShardCounts(total=3, quantized_now=1, skipped_complete=2)
    # another recipe: everything is stale
    fourth = quantize_checkpoint(src, out, "glm-5.2-mxfp4-mtp-bf16", workers=1, quiet=True)
    assert fourth.shards.quantized_now == 3
    quantize_checkpoint(src, tmp_path / "fresh", "glm-5.2-mxfp4-mtp-bf16", workers=1, quiet=True)
    assert _files(out) == _files(tmp_path / "fresh")


def test_output_missing_an_mtp_tensor_fails_the_check(tiny_ckpt, quantized_tiny, tmp_path):
    from safetensors.torch import save_file

    from mxforge.errors import CheckpointError
    from mxforge.quantize.plan import plan_checkpoint
    from mxforge.quantize.recipe import load_recipe
    from mxforge.quantize.run import verify_output

    out = tmp_path / "out"
    shutil.copytree(quantized_tiny[0], out)
    plan = plan_checkpoint(Checkpoint.open(tiny_ckpt), load_recipe(None))
    mtp = f"model.layers.{plan.layout.mtp_layers[0]}.eh_proj.weight"
    shard = out / json.loads((out / INDEX_NAME).read_text())["weight_map"][mtp]
    tensors = load_file(shard)
    del tensors[mtp]
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=rf"source MTP layer tensor '{mtp}' is missing"):
        verify_output(plan, out)


def test_torch_device_path_writes_the_same_shards(tiny_ckpt, quantized_tiny, tmp_path):
    """`--device cuda` runs the torch numerics in the workers; a torch CPU device exercises that same path."""
    from mxforge.quantize.plan import plan_checkpoint
    from mxforge.quantize.recipe import load_recipe
    from mxforge.quantize.shard_job import ShardJob, run_shard

    plan = plan_checkpoint(Checkpoint.open(tiny_ckpt), load_recipe(None))
    for shard in plan.shards:
        run_shard(ShardJob(str(tiny_ckpt), str(tmp_path), shard, device="cpu:0"))
        assert (tmp_path / shard.name).read_bytes() == (quantized_tiny[0] / shard.name).read_bytes(), shard.name
