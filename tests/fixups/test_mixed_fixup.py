"""`mxforge fixup` on a mixed-precision checkpoint: the MTP layer's FP8 PTPC modules, configured in
`layer_quant_config` under their checkpoint names, get entries under each release's draft names too.

That each release then decides these modules FP8 PTPC is the conformance suite's claim (the shipped mixed recipes'
exports, before and after fixup, executed in every release: tests/validation/test_engine_conformance.py); here, what
fixup writes and that validate agrees with it."""

import json

from helpers import MTP, cli

RECIPE = "glm-5.2-mxfp4-mtp-fp8"  # the MTP layer's attention and shared expert in FP8 PTPC


def test_fixup_writes_layer_configs_under_the_drafts_names(tiny_ckpt, tmp_path):
    out = tmp_path / "q"
    cli("quantize", str(tiny_ckpt), str(out), "--recipe", RECIPE, "--quiet", check=True)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    shared = f"model.layers.{MTP}.mlp.shared_experts.gate_proj"
    assert shared in qc["layer_quant_config"]  # the decoder's shared experts are MXFP4: the pattern names the layer
    ptpc = qc["layer_quant_config"][shared]

    proc = cli("validate", str(out), "--engines", "sglang==0.5.9")
    assert proc.returncode == 1
    assert (
        "would be MXFP4 (uint8 [256, 128]) but the checkpoint holds FP8 PTPC (float8_e4m3fn [128, 256]) x2 under "
        f"model.layers.{MTP}.mlp.shared_experts.{{gate,up}}_proj: run mxforge fixup"
    ) in proc.stdout

    report = tmp_path / "fixup.json"
    proc = cli("fixup", str(out), "--json", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fixed = json.loads((out / "config.json").read_text())["quantization_config"]
    layers = fixed["layer_quant_config"]
    # sglang 0.5.9 builds the draft's gate_up_proj whole, 0.5.11-0.5.15 decide it by its shards (0.5.16 on remap)
    added = [k for k in layers if k not in qc["layer_quant_config"]]
    assert {
        "model.decoder.mlp.shared_experts.gate_up_proj",
        "model.decoder.mlp.shared_experts.gate_proj",
        "model.decoder.mlp.shared_experts.up_proj",
        "model.decoder.mlp.shared_experts.down_proj",
    } <= set(added)
    assert list(layers)[: len(added)] == added  # first: the engines take the first pattern that matches
    assert (
        all(layers[k] == ptpc for k in added)
        and {k: layers[k] for k in qc["layer_quant_config"]} == qc["layer_quant_config"]
    )
    applied = [a for a in json.loads(report.read_text())["applied"] if a["fixup"] == "layer_config_alias"]
    assert sorted(a["entry"] for a in applied) == sorted(added)
    one = next(a for a in applied if a["entry"] == "model.decoder.mlp.shared_experts.gate_up_proj")
    assert one["engines"] == ["sglang-0.5.9"] and one["format"] == "fp8_ptpc"  # the first release needing it
    assert "would build it MXFP4" in one["why"] and "config" not in one  # the config is in config.json
    record = json.loads((out / "mxforge_fixups.json").read_text())
    assert sorted(f["entry"] for f in record["fixups"] if f["fixup"] == "layer_config_alias") == sorted(added)

    proc = cli("validate", str(out), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stdout[-3000:]
    after = (out / "config.json").read_text()
    proc = cli("fixup", str(out))
    assert proc.returncode == 0 and "nothing to fix" in proc.stdout
    assert (out / "config.json").read_text() == after
