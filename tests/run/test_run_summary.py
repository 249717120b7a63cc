"""What `mxforge run` says when it is done: the error report of a streamed run, this run's bytes against the whole
checkpoint's, fixup's warnings themselves, and no empty upload bar from huggingface_hub."""

from __future__ import annotations

import pytest
from helpers import hub_env, run_cli

from mxforge.run.pipeline import Pipeline, RunOptions, RunResult, StageRecord, format_run_summary


def _run(source, out, **options) -> RunResult:
    return Pipeline(RunOptions(source=str(source), out=out, recipe=None, quiet=True, **options)).run()


def test_a_streamed_run_reports_the_error_it_measured(tiny_ckpt, tmp_path):
    result = _run(tiny_ckpt, tmp_path / "run", stream=True)
    report = result.as_dict()  # as --json writes it
    assert report["mode"] == "stream"
    error = report["stages"]["stream"]["report"]["error"]
    assert error["tensors_measured"] == 132 and "tensors" not in error  # per-tensor figures stay in mxfp4/
    summary = format_run_summary(result)
    assert "error (quark scale rule, 132 tensors): relative RMSE" in summary and "not measured" not in summary


def test_a_resumed_quantize_says_this_runs_bytes_and_the_checkpoints(tiny_ckpt, tmp_path):
    """A resumed quantize printed this run's input beside the whole output ("1.03 GB in, 1.21 GB out")."""
    out = tmp_path / "run"
    first = _run(tiny_ckpt, out).as_dict()
    shard = "model-00002-of-00003.safetensors"
    (out / "mxfp4" / shard).unlink()  # quantize has one shard to redo
    result = _run(tiny_ckpt, out)
    report = result.as_dict()
    assert "quantize" not in report["reused_from_earlier_run"]
    quantize = report["stages"]["quantize"]
    redone = quantize["report"]["bytes_processed_now"]
    assert quantize["bytes_in"] == redone == (tiny_ckpt / shard).stat().st_size
    written = quantize["bytes_out"]  # the shard written again, and the small files quantize writes each time
    assert (out / "mxfp4" / shard).stat().st_size <= written < first["stages"]["quantize"]["bytes_out"]
    whole_in, whole_out = quantize["report"]["bytes_in"], report["product_bytes"]
    assert redone < whole_in and written < whole_out
    assert (
        f"  quantize: this run {redone / 1e9:.3f} GB in, {written / 1e9:.3f} GB out; the checkpoint "
        f"{whole_in / 1e9:.3f} GB in, {whole_out / 1e9:.3f} GB out"
    ) in format_run_summary(result)


def test_fixups_warnings_are_printed_not_only_counted():
    warning = "sglang-0.5.22: serve with --disable-shared-experts-fusion (model.decoder.mlp.experts: no exclude entry)"
    fixup = {"status": "done", "seconds": 1.0, "report": {"applied": [{}] * 19, "warnings": [warning]}}
    result = RunResult(
        source="src",
        out="out",
        product="out/mxfp4",
        pushed_to=None,
        mode="sequential",
        reused_from_earlier_run=[],
        stages={"fixup": StageRecord.from_dict("fixup", fixup)},
    )
    lines = format_run_summary(result).splitlines()
    i = lines.index("  fixups: 19 applied, 1 warning(s):")
    assert lines[i + 1] == f"    warning: {warning}"


@pytest.mark.slow  # a streamed run to the loopback Hub, progress bars on
def test_a_streamed_push_shows_no_empty_upload_bar(hub, tmp_path):
    proc = run_cli(
        "run", "zai/glm-tiny", str(tmp_path / "out"), "--stream", "--push", "alice/streamed", env=hub_env(hub, tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    assert "Upload 0 LFS files" not in proc.stderr, proc.stderr  # the shards were sent as they were made
