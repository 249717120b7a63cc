"""`mxforge fixup` and `mxforge validate` as a user runs them: exit codes, dry run, backup, record, idempotence."""

import json

from helpers import AMD, MTP, cli
from quark_like import write_quark_like


def test_validate_fixup_validate(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "q"
    write_quark_like(tiny_ckpt, ckpt, AMD)
    original = (ckpt / "config.json").read_text()

    proc = cli("validate", str(ckpt))
    assert proc.returncode == 1
    assert "loads: sglang 0.5.16-0.5.23, vllm 0.30.0-0.33.0; FAILS: sglang 0.5.9-0.5.10.post1 (" in proc.stdout
    assert f"under model.layers.{MTP}.mlp.shared_experts.{{gate,up}}_proj: run mxforge fixup" in proc.stdout
    assert cli("validate", str(ckpt), "--engines", "sglang>=0.5.16 vllm").returncode == 0

    proc = cli("fixup", str(ckpt), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert '+      "model.eh_proj",' in proc.stdout and "--- a/config.json" in proc.stdout
    assert (ckpt / "config.json").read_text() == original and not (ckpt / "config.json.orig").exists()

    report = tmp_path / "fixup.json"
    proc = cli("fixup", str(ckpt), "--json", str(report))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["changed"] is True
    assert (ckpt / "config.json.orig").read_text() == original
    record = json.loads((ckpt / "mxforge_fixups.json").read_text())
    assert record["command"].startswith("mxforge fixup ") and record["engines"][0] == "sglang-0.5.9"
    assert {"fixup": "alias", "entry": "model.eh_proj"}.items() <= next(
        f for f in record["fixups"] if f["entry"] == "model.eh_proj"
    ).items()
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert "mxforge" not in json.dumps(qc)  # the record lives beside config.json, not inside quantization_config
    assert not list(ckpt.glob("*.partial"))

    proc = cli("validate", str(ckpt), "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["ok"] and all(out["engines"].values()) and "vllm==0.33.0" in out["engines"]
    assert set(out) >= {"ok", "engines", "problems", "checked"}

    after = (ckpt / "config.json").read_text()
    proc = cli("fixup", str(ckpt))
    assert proc.returncode == 0 and "nothing to fix" in proc.stdout
    assert (ckpt / "config.json").read_text() == after
    assert (ckpt / "config.json.orig").read_text() == original
    assert len(json.loads((ckpt / "mxforge_fixups.json").read_text())["runs"]) == 1


def test_fixup_exit_codes(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "q"
    write_quark_like(tiny_ckpt, ckpt, AMD, drop_layers=(MTP,))
    proc = cli("fixup", str(ckpt))
    assert proc.returncode == 1 and "--mtp-from" in proc.stdout
    proc = cli("fixup", str(ckpt), "--engines", "sglang,trtllm")
    assert proc.returncode == 2 and "'trtllm' is not an engine" in proc.stderr and "Traceback" not in proc.stderr
    assert cli("fixup", str(tmp_path / "nope")).returncode == 2
    backup = (ckpt / "config.json.orig").read_text()  # the first run fixed what it could (dense MLPs for sglang 0.5.9)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["exclude"] = "*self_attn*"
    (ckpt / "config.json").write_text(json.dumps(config))
    proc = cli("fixup", str(ckpt), "--mtp-from", str(tiny_ckpt))
    assert proc.returncode == 2 and "exclude is not a list" in proc.stderr
    assert not (ckpt / "model-mtp.safetensors").exists() and (ckpt / "config.json.orig").read_text() == backup


def test_damaged_fixup_record_stops_before_config_changes(tiny_ckpt, tmp_path):
    """A corrupt mxforge_fixups.json is one error, and config.json is not edited without a record."""
    ckpt = tmp_path / "q"
    write_quark_like(tiny_ckpt, ckpt, AMD)
    original = (ckpt / "config.json").read_text()
    for damaged in ("{truncated", '["not", "a", "record"]'):
        (ckpt / "mxforge_fixups.json").write_text(damaged)
        proc = cli("fixup", str(ckpt))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "mxforge_fixups.json" in proc.stderr
        assert (ckpt / "config.json").read_text() == original and not (ckpt / "config.json.orig").exists()
    (ckpt / "mxforge_fixups.json").unlink()
    assert cli("fixup", str(ckpt)).returncode == 0
    assert len(json.loads((ckpt / "mxforge_fixups.json").read_text())["runs"]) == 1


def test_backup_that_cannot_be_written_is_one_error_and_config_unchanged(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "q"
    write_quark_like(tiny_ckpt, ckpt, AMD)
    original = (ckpt / "config.json").read_text()
    (ckpt / "config.json.orig.partial").mkdir()  # the copy's temporary name is taken by a directory
    (ckpt / "config.json.orig.partial" / "x").write_text("")
    proc = cli("fixup", str(ckpt))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "config.json.orig" in proc.stderr, proc.stderr
    assert (ckpt / "config.json").read_text() == original and not (ckpt / "mxforge_fixups.json").exists()
