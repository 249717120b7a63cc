"""The issue's Done-when on the real quantizer's output, and --mtp-from against it."""

import json
import shutil

import pytest
import torch
from helpers import BASE, GLM5, MTP, cli
from quark_like import write_quark_like
from safetensors import safe_open

from mxforge.fixups.fixup import fixup_checkpoint
from mxforge.validation.profiles import all_profiles
from mxforge.validation.validate import validate_checkpoint

pytestmark = pytest.mark.slow  # the real quantizer's output, fixed up and validated


def test_quantize_then_validate_fails_old_sglang_then_fixup_passes_everywhere(quantized_tiny, tmp_path):
    ckpt = tmp_path / "q"
    shutil.copytree(quantized_tiny, ckpt)
    proc = cli("validate", str(ckpt), "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 1
    failing = {r["profile"] for r in report["releases"] if not r["ok"]}
    assert failing == {
        "sglang-0.5.9",
        "sglang-0.5.10",
        "sglang-0.5.11",
        "sglang-0.5.12",
        "sglang-0.5.15",
    }  # before GLM's own draft class
    assert report["engines"]["sglang==0.5.15.post1"] is False and report["engines"]["sglang==0.5.16"] is True
    assert report["engines"]["vllm==0.33.0"] is True
    subjects = {p["subject"] for p in report["problems"]}
    assert {"model.eh_proj", "model.decoder.mlp.shared_experts.gate_up_proj"} <= subjects
    assert all(p["engine"] in failing and p["remedy"] == "run mxforge fixup" for p in report["problems"])

    proc = cli("fixup", str(ckpt))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for profile in all_profiles(GLM5):
        assert cli("validate", str(ckpt), "--engines", profile.name).returncode == 0, profile.name
    assert validate_checkpoint(ckpt).ok
    assert "nothing to fix" in cli("fixup", str(ckpt)).stdout


def test_mtp_from_reinjects_the_layer_as_the_quantizer_writes_it(tiny_ckpt, quantized_tiny, tmp_path):
    ckpt = tmp_path / "no-mtp"
    write_quark_like(tiny_ckpt, ckpt, BASE, drop_layers=(MTP,))
    assert not validate_checkpoint(ckpt).ok
    before = json.loads((ckpt / "model.safetensors.index.json").read_text())

    dry = cli("fixup", str(ckpt), "--mtp-from", str(tiny_ckpt), "--dry-run")
    assert dry.returncode == 0 and "MTP layer(s) [7]" in dry.stdout and not (ckpt / "model-mtp.safetensors").exists()

    result = fixup_checkpoint(ckpt, mtp_from=tiny_ckpt, recipe="glm-5.2-mxfp4")
    assert result.applied[0]["fixup"] == "mtp_inject" and not result.remaining
    assert validate_checkpoint(ckpt).ok
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert json.loads((ckpt / "model.safetensors.index.json.orig").read_text()) == before
    mtp = {n: s for n, s in index["weight_map"].items() if n.startswith(f"model.layers.{MTP}.")}
    reference = json.loads((quantized_tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(mtp) == {n for n in reference if n.startswith(f"model.layers.{MTP}.")}
    with safe_open(str(ckpt / "model-mtp.safetensors"), "pt") as mine:
        for name in mtp:
            with safe_open(str(quantized_tiny / reference[name]), "pt") as ref:
                a, b = mine.get_tensor(name), ref.get_tensor(name)
                assert (
                    a.dtype == b.dtype
                    and a.shape == b.shape
                    and a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
                ), name

    again = fixup_checkpoint(ckpt, mtp_from=tiny_ckpt, recipe="glm-5.2-mxfp4")
    assert not again.changed and "already holds MTP layer(s) [7]" in again.warnings[0]


def test_mtp_from_refuses_a_mismatched_source(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "no-mtp"
    write_quark_like(tiny_ckpt, ckpt, BASE, drop_layers=(MTP,))
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt, other)
    config = json.loads((other / "config.json").read_text())
    config["n_routed_experts"] = 16
    (other / "config.json").write_text(json.dumps(config))
    proc = cli("fixup", str(ckpt), "--mtp-from", str(other))
    assert proc.returncode == 2 and "n_routed_experts" in proc.stderr and "Traceback" not in proc.stderr
    assert not (ckpt / "model-mtp.safetensors").exists() and not (ckpt / "config.json.orig").exists()


def test_mtp_from_names_the_remedy_for_an_odd_in_dimension(tiny_ckpt, tmp_path):
    """The MTP plan is the quantizer's plan: a selected weight that cannot be packed gets the [[keep]] remedy."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "no-mtp"
    write_quark_like(tiny_ckpt, ckpt, BASE, drop_layers=(MTP,))
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = f"model.layers.{MTP}.mlp.experts.0.down_proj.weight"  # the recipe quantizes MTP routed experts
    shard = src / index[name]
    tensors = load_file(str(shard))
    rows, cols = tensors[name].shape
    tensors[name] = torch.zeros(rows, cols - 1, dtype=tensors[name].dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    proc = cli("fixup", str(ckpt), "--mtp-from", str(src), "--recipe", "glm-5.2-mxfp4")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert name in proc.stderr and "[[keep]]" in proc.stderr
    assert not (ckpt / "model-mtp.safetensors").exists() and not (ckpt / "config.json.orig").exists()
