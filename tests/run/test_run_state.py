"""`mxforge run`'s state file tells the truth: a stage counts as done only while its output is what it left, and a
run that has written nothing but its state is not bound to its source. In-process, on the tiny fixture."""

from __future__ import annotations

import json
import shutil

import pytest

from mxforge.cli.main import main
from mxforge.errors import CheckpointError, MxforgeError
from mxforge.provenance import CONFIG_BACKUP_NAME, FIXUPS_NAME, RUN_STATE_NAME
from mxforge.run.pipeline import Pipeline, RunOptions, StageRecord, changed_products


def _run(source, out) -> dict:
    return Pipeline(RunOptions(source=str(source), out=out, recipe=None, quiet=True)).run().as_dict()  # as --json


def _exclude(ckpt) -> list[str]:
    return json.loads((ckpt / "config.json").read_text())["quantization_config"]["exclude"]


def test_quantize_again_after_fixup_says_so_and_the_run_redoes_fixup(tiny_ckpt, tmp_path, capsys):
    """`mxforge quantize SRC RUN/mxfp4` on a fixed-up output used to exit 0 silently with the fixup gone (exclude 92
    -> 74 entries), and `mxforge run` then reported "fixups: 18 applied" from its state and failed validation."""
    out, product = tmp_path / "run", tmp_path / "run" / "mxfp4"
    first = _run(tiny_ckpt, out)
    fixed = _exclude(product)
    applied = len(json.loads((product / FIXUPS_NAME).read_text())["fixups"])
    assert (len(fixed), applied) == (92, 18)

    assert main(["quantize", str(tiny_ckpt), str(product), "--quiet"]) == 0
    [warning] = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert (
        f"{product} had been fixed up" in warning
        and f"the {applied} fixup(s) mxforge fixup had applied are gone" in (warning)
    )
    assert f"run `mxforge fixup {product}` again" in warning
    assert len(_exclude(product)) == 74 and not (product / FIXUPS_NAME).exists()
    assert not (product / CONFIG_BACKUP_NAME).exists()  # no record or backup describes a config that is gone
    assert json.loads((product / "mxforge_quantize.json").read_text())["fixups_dropped"] == applied

    again = _run(tiny_ckpt, out)
    assert again["redone"] == "OUT/mxfp4 changed since fixup finished: redoing fixup, validate"
    assert again["reused_from_earlier_run"] == ["quantize"]
    assert _exclude(product) == fixed and again["stages"]["validate"]["report"]["ok"]
    assert again["stages"]["fixup"]["report"]["applied"] == first["stages"]["fixup"]["report"]["applied"]

    third = _run(tiny_ckpt, out)  # nothing changed since: nothing is redone
    assert third["redone"] is None and third["reused_from_earlier_run"] == ["fixup", "quantize"]


@pytest.mark.parametrize(
    "now, first",
    [
        ({"mxfp4": "after-fixup"}, None),  # what the last writer left
        ({"mxfp4": "after-quantize"}, "fixup"),  # quantize ran again: fixup and what follows
        ({"mxfp4": "edited"}, "quantize"),  # matches no record (or is gone): every writer of it
        ({"mxfp4": None}, "quantize"),
    ],
)
def test_the_first_stage_to_redo_is_the_one_after_the_last_record_that_still_holds(now, first):
    stages = {
        "quantize": StageRecord(status="done", product="after-quantize"),
        "fixup": StageRecord(status="done", product="after-fixup"),
        "validate": StageRecord(status="done"),
    }
    found = changed_products(stages, now)
    assert (found and found[0]) == first
    legacy = {k: StageRecord(status="done") for k in stages}  # a state file from before products were recorded
    assert changed_products(legacy, now) is None


def test_a_run_that_failed_before_making_anything_accepts_the_corrected_source(tiny_ckpt, tmp_path):
    """`mxforge run empty OUT` fails before its first stage finishes; it used to record download as done and lock
    OUT to 'empty', refusing the corrected command."""
    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        _run(empty, out)
    stages = json.loads((out / RUN_STATE_NAME).read_text())["stages"]
    assert stages["download"]["status"] == "skipped" and stages["quantize"]["status"] == "failed"
    report = _run(tiny_ckpt, out)  # the corrected command
    assert report["stages"]["validate"]["report"]["ok"] and report["source"] == str(tiny_ckpt)
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt, other)
    with pytest.raises(MxforgeError, match="holds a run of source"):  # OUT now holds this run's product
        _run(other, out)
