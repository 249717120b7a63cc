import json
import shutil

import pytest
from helpers import MTP, cli

from mxforge.cli.main import main
from mxforge.provenance import RUN_STATE_NAME
from mxforge.validation.validate import validate_checkpoint


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(tiny_ckpt, out)
    return out


def _index(ckpt):
    return json.loads((ckpt / "model.safetensors.index.json").read_text())


def _write_index(ckpt, index):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def test_clean_checkpoint_passes(tiny_ckpt):
    report = validate_checkpoint(tiny_ckpt)
    assert report.ok, report.format()
    assert report.checked["integrity"]["tensors"] == 258
    proc = cli("validate", str(tiny_ckpt))
    assert proc.returncode == 0 and "OK" in proc.stdout


def test_wrong_total_size(ckpt):
    index = _index(ckpt)
    index["metadata"]["total_size"] += 2
    _write_index(ckpt, index)
    report = validate_checkpoint(ckpt)  # no engine reads total_size: a warning, which fixup repairs
    assert report.ok and [p.subject for p in report.warnings] == ["model.safetensors.index.json:metadata.total_size"]
    proc = cli("validate", str(ckpt), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["warnings"][0]["remedy"] == "run mxforge fixup (sets it)"


def test_missing_shard_orphans_and_truncation(ckpt):
    index = _index(ckpt)
    name = "model.layers.0.input_layernorm.weight"
    index["weight_map"]["model.layers.0.not_a_tensor.weight"] = index["weight_map"][name]
    del index["weight_map"][name]
    _write_index(ckpt, index)
    shard = ckpt / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    subjects = {p.subject: p.message for p in validate_checkpoint(ckpt).problems}
    assert "model.layers.0.not_a_tensor.weight" in subjects
    assert any(s.endswith(name) and "not mapped" in m for s, m in subjects.items())
    assert "truncated" in subjects["model-00003-of-00003.safetensors"]
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    assert (
        "missing from the checkpoint"
        in {p.subject: p.message for p in validate_checkpoint(ckpt).problems}["model-00002-of-00003.safetensors"]
    )


def test_cannot_run_exits_2(tmp_path):
    proc = cli("validate", str(tmp_path))
    assert proc.returncode == 2 and "no config.json" in proc.stderr


def test_a_truncated_shard_is_one_problem_said_once(ckpt):
    """A truncated shard is one problem with one remedy, listed once for every release it fails (not once per
    release range), and the MTP layer it holds is not called missing: re-injecting it would be wrong advice."""
    shard = ckpt / "model-00003-of-00003.safetensors"
    assert any(n.startswith(f"model.layers.{MTP}.") and s == shard.name for n, s in _index(ckpt)["weight_map"].items())
    shard.write_bytes(shard.read_bytes()[:1000])
    report = validate_checkpoint(ckpt)
    [problem] = report.problems
    assert problem.subject == shard.name and "truncated" in problem.message
    assert problem.remedy == "re-download or re-create the shard" and "re-download" not in problem.message
    verdict = report.verdict()
    assert verdict == (
        "FAILS: sglang 0.5.9-0.5.23, vllm 0.30.0-0.33.0 (1 problem(s): model-00003-of-00003.safetensors; "
        "re-download or re-create the shard)"
    )
    assert not any("re-inject" in n or "missing" in n for n in report.notes), report.notes
    assert f"MTP layer {MTP} cannot be judged: its tensors are in {shard.name}" in " ".join(report.notes)
    assert report.format().count(shard.name) == 3  # the verdict, the MTP note and the problem itself


def test_validate_of_a_run_directory_points_at_its_checkpoint(tiny_ckpt, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_ckpt, run / "mxfp4")
    (run / RUN_STATE_NAME).write_text("{}")
    assert main(["validate", str(run)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"mxforge validate: error: {run}: an `mxforge run` working directory") and line.endswith(
        f"pass that instead (mxforge validate {run / 'mxfp4'} ...)"
    )
    assert main(["validate", str(run / "mxfp4")]) == 0


def test_tensor_listed_twice_in_the_index(ckpt):
    """Found from the one parse Checkpoint.open does (json keeps the last value; the repeat is reported)."""
    index = _index(ckpt)
    name, shard = next(iter(index["weight_map"].items()))
    text = json.dumps(index)
    entry = f"{json.dumps(name)}: {json.dumps(shard)}"
    assert entry in text
    (ckpt / "model.safetensors.index.json").write_text(text.replace(entry, f"{entry}, {entry}", 1))
    report = validate_checkpoint(ckpt)
    assert [p.subject for p in report.problems] == [f"model.safetensors.index.json:{name}"]
    assert "more than once" in report.problems[0].message
