"""validate's engine-independent checks: quantization_config form, tensors config.json implies, scale shapes."""

import json

from helpers import AMD, MTP
from quark_like import write_quark_like

from mxforge.checkpoint import Checkpoint
from mxforge.fixups.fixup import fixup_checkpoint
from mxforge.safetensors_io import PlannedTensor, ShardWriter
from mxforge.validation.validate import validate_checkpoint


def _fixed_export(tiny_ckpt, path):
    write_quark_like(tiny_ckpt, path, AMD)
    fixup_checkpoint(path)
    assert validate_checkpoint(path).ok
    return path


def _edit_qc(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


def test_malformed_quantization_config(tiny_ckpt, tmp_path):
    ckpt = _fixed_export(tiny_ckpt, tmp_path / "q")

    def edit(qc):
        del qc["export"]
        qc["global_quant_config"]["weight"]["group_size"] = 16
        qc["exclude"].append("re:model.layers.(")

    _edit_qc(ckpt, edit)
    found = {p.subject: p.message for p in validate_checkpoint(ckpt).problems if p.check == "quant_config"}
    assert "export key" in found["config.json:quantization_config.export"]
    assert "16" in found["config.json:quantization_config.global_quant_config.weight.group_size"]
    assert any("not a valid regex" in m for m in found.values())


def test_uint8_weights_without_quantization_config(tiny_ckpt, tmp_path):
    ckpt = _fixed_export(tiny_ckpt, tmp_path / "q")
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    report = validate_checkpoint(ckpt)
    assert any(p.check == "quant_config" and "uint8" in p.message for p in report.problems)
    assert any(p.engine == "vllm-0.31.0" and "would be bf16" in p.message for p in report.problems)


def test_missing_mtp_tensor_and_wrong_scale_shape(tiny_ckpt, tmp_path):
    ckpt = _fixed_export(tiny_ckpt, tmp_path / "q")
    src = Checkpoint.open(ckpt)
    gone = f"model.layers.{MTP}.hnorm.weight"
    bad = "model.layers.4.mlp.experts.1.up_proj.weight_scale"
    infos = src.tensor_infos()
    for shard in {src.weight_map[gone], src.weight_map[bad]}:
        names = [n for n, s in src.weight_map.items() if s == shard and n != gone]
        planned = [
            PlannedTensor(n, infos[n].dtype, (infos[n].shape[0], infos[n].shape[1] + 1) if n == bad else infos[n].shape)
            for n in names
        ]
        with ShardWriter(ckpt / shard, planned) as w:
            w.skip_to_end()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][gone]
    index["metadata"]["total_size"] = sum(
        i.nbytes for s in set(index["weight_map"].values()) for i in Checkpoint.open(ckpt).headers[s].tensors.values()
    )
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    report = validate_checkpoint(ckpt)
    by_subject = {p.subject: p for p in report.problems}
    assert by_subject[gone].check == "mtp" and "no shard holds it" in by_subject[gone].message
    experts = by_subject["model.layers.4.mlp.experts"]
    assert "malformed" in experts.message and bad in experts.message and "expected U8 [128, 8]" in experts.message


def test_stored_form_uses_the_quantizers_packed_shapes():
    """Expected MXFP4 shapes come from the format registry's packed_shapes; an odd in-dimension is a defect, not a
    crash."""
    from mxforge.formats import MXFP4
    from mxforge.safetensors_io import TensorInfo
    from mxforge.validation.modules import Linear
    from mxforge.validation.tensor_forms import stored_form

    codes, scales = MXFP4.packed_shapes((8, 96))
    infos = {
        "m.weight": TensorInfo("m.weight", "U8", codes, 0, 0),
        "m.weight_scale": TensorInfo("m.weight_scale", "U8", scales, 0, 0),
    }
    assert stored_form(Linear("m", 8, 96), infos).defect is None
    odd = stored_form(Linear("m", 8, 95), infos)
    assert odd.form == MXFP4.name and "odd" in odd.defect and "m.weight" in odd.defect


def test_a_backtracking_re_entry_is_matched_in_bounded_time_with_the_engines_answer(tiny_ckpt, tmp_path):
    """`re:(.|.)*Z` costs Python's re 2^n steps per n-character module name: validate (and fixup, --create-pr) used
    to hang on it. It matches no module (none ends in Z), so the verdict is the one without it."""
    from helpers import deadline

    ckpt = _fixed_export(tiny_ckpt, tmp_path / "q")
    before = validate_checkpoint(ckpt)
    _edit_qc(ckpt, lambda qc: qc["exclude"].append("re:(.|.)*Z"))
    with deadline(60, "validate with exclude entry re:(.|.)*Z"):
        after = validate_checkpoint(ckpt)
    assert after.ok and before.ok and len(after.problems) == len(before.problems) == 0


def test_a_re_entry_beyond_the_bounds_is_one_error_naming_it(tiny_ckpt, tmp_path):
    import pytest

    from mxforge.errors import ConfigError

    ckpt = _fixed_export(tiny_ckpt, tmp_path / "q")
    _edit_qc(ckpt, lambda qc: qc["exclude"].append(r"re:(model)\.\1"))
    with pytest.raises(
        ConfigError, match=r"quantization_config\.exclude\[\d+\]: .*'\(model\)\\\\.\\\\1'.*backreference"
    ):
        validate_checkpoint(ckpt)
