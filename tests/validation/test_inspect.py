import json
import shutil

from helpers import cli


def test_inspect_json_report(tiny_ckpt):
    proc = cli("inspect", str(tiny_ckpt), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["architecture"] == "GlmMoeDsaForCausalLM"
    assert r["tensors"] == sum(v["tensors"] for v in r["by_kind"].values()) == 258
    assert r["bytes"] == r["index_total_size"]
    for kind in (
        "experts",
        "shared_experts",
        "attention",
        "indexer",
        "router",
        "norms",
        "embeddings",
        "mtp",
        "dense_mlp",
    ):
        assert r["by_kind"][kind]["tensors"] > 0, kind
    assert r["by_kind"]["router"]["dtypes"] == {"BF16": 4, "F32": 4}
    assert r["mtp"] == {
        "expected_layers": [7],
        "present_layers": [7],
        "tensors": 47,
        "orphan_layers_beyond_config": [],
        "present": True,
        "complete": True,
        "declared_by": ["num_hidden_layers", "num_nextn_predict_layers"],
    }
    assert r["layers"]["dense_layers"] == [0, 1, 2] and r["layers"]["moe_layers"] == [3, 4, 5, 6]
    assert r["layers"]["indexer_layers"] == [0, 1, 2, 6]
    assert r["quantization"] is None


def test_inspect_human_summary_and_report_file(tiny_ckpt, tmp_path):
    proc = cli("inspect", str(tiny_ckpt), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0
    assert "MTP: layer(s) [7] present, 47 tensors, complete" in proc.stdout
    assert json.loads((tmp_path / "r.json").read_text())["stage"] == "inspect"


def test_inspect_reports_missing_mtp_and_quant_config(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "c"
    shutil.copytree(tiny_ckpt, ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("model.layers.7.")}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "quark",
        "exclude": ["lm_head", "*self_attn*"],
        "global_quant_config": {"weight": {"dtype": "fp4", "group_size": 32, "scale_format": "e8m0"}},
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    r = json.loads(cli("inspect", str(ckpt), "--json").stdout)
    assert r["mtp"]["present"] is False and r["mtp"]["expected_layers"] == [7]
    assert r["quantization"]["exclude_entries"] == 2 and r["quantization"]["exclude_glob_entries"] == 1
    assert "config declares layer(s) [7]" in cli("inspect", str(ckpt)).stdout


def test_inspect_not_a_checkpoint(tmp_path):
    proc = cli("inspect", str(tmp_path))
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr and str(tmp_path) in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "config.json").write_text("{}")
    proc = cli("inspect", str(tmp_path))
    assert proc.returncode == 2 and "no model.safetensors" in proc.stderr
    missing = cli("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not a directory" in missing.stderr


def test_inspect_names_each_format_of_a_mixed_checkpoint(tiny_ckpt, tmp_path):
    """A mixed recipe's output: the global format and each format its layer_quant_config patterns name, counted."""
    out = tmp_path / "q"
    cli("quantize", str(tiny_ckpt), str(out), "--recipe", "glm-5.2-mxfp4-attn-fp8", "--quiet", check=True)
    patterns = json.loads((out / "config.json").read_text())["quantization_config"]["layer_quant_config"]
    r = json.loads(cli("inspect", str(out), "--json").stdout)
    assert r["quantization"]["layer_formats"] == {"FP8 PTPC": len(patterns)} and len(patterns) > 1
    assert r["precision"] == f"Quark fp4 group 32 (MXFP4) + FP8 PTPC ({len(patterns)} layer_quant_config pattern(s))"
    assert r["by_kind"]["attention"]["dtypes"].keys() == {"F8_E4M3", "F32"}
    assert f"; {len(patterns)} layer_quant_config pattern(s) FP8 PTPC" in cli("inspect", str(out)).stdout
