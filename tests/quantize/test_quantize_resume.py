"""Resume after SIGKILL of the whole process group of a real `mxforge quantize`, at two moments:
mid-shard (a .partial file exists) and just after the first shard is complete. The rerun must produce
output byte-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli, kill_group

from mxforge.models.fixture import write_fixture
from mxforge.provenance import QUANTIZE_NAME, QUANTIZE_STATE_NAME

pytestmark = pytest.mark.slow  # quantize runs killed and resumed
SHARDS = 4


@pytest.fixture(scope="module")
def multi_shard_ckpt(module_tmp) -> Path:
    """Real GLM-5.2 expert shapes, 0.75 GiB in SHARDS shards: long enough for a kill to land mid-run, and after the
    first shard is recorded, at least two more to quantize one at a time (the finish lane's fsync of one shard
    overlaps the next one's quantize, so two consecutive shards can be recorded milliseconds apart: with only two
    shards the kill could find both recorded)."""
    out = module_tmp("resume") / "bench"
    write_fixture(out, "bench", seed=1, gib=0.75, quiet=True, shard_count=SHARDS)
    return out


@pytest.fixture(scope="module")
def uninterrupted(multi_shard_ckpt, module_tmp) -> Path:
    out = module_tmp("resume-ref") / "out"
    cli("quantize", str(multi_shard_ckpt), str(out), "--quiet", "--workers", "1", check=True)
    return out


def _outputs(d: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(d.iterdir())  # files only: OUT/.cache holds the lock
        if p.is_file() and p.name not in (QUANTIZE_NAME, QUANTIZE_STATE_NAME)
    }


def _start(src: Path, out: Path, workers: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mxforge.cli",
            "quantize",
            str(src),
            str(out),
            "--quiet",
            "--workers",
            str(workers),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _kill_group_when(proc: subprocess.Popen, ready, timeout: float = 300) -> bool:
    """SIGKILL the process group as soon as `ready()` holds; False if the run ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            kill_group(proc)
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("quantize made no progress")


def _finished_shards(out: Path) -> int:
    try:
        return len(json.loads((out / QUANTIZE_STATE_NAME).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def _state_and_outputs(out: Path) -> dict:
    """The state file's shard entries (size and mtime of each output as recorded) beside each output's stat."""
    try:
        shards = json.loads((out / QUANTIZE_STATE_NAME).read_text())["shards"]
    except (OSError, ValueError, KeyError) as e:
        return {"state": repr(e)}
    stats = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()}
    return {
        name: {"recorded": (e.get("output_size"), e.get("output_mtime_ns")), "on disk": stats.get(name)}
        for name, e in shards.items()
    } | {"files": sorted(stats)}


@pytest.mark.parametrize("moment", ["mid_shard", "after_first_shard"])
def test_sigkill_then_rerun_is_byte_identical(multi_shard_ckpt, uninterrupted, tmp_path, moment):
    # After the first shard, one worker: with two, two shards run at once and may finish within one poll. Even
    # so, on a loaded machine every shard could be recorded between the poll and the kill: that attempt did not
    # test a resume, and the next one, in a fresh OUT, is made (three at most).
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        proc = _start(multi_shard_ckpt, out, workers=2 if moment == "mid_shard" else 1)
        if moment == "mid_shard":

            def ready():
                return out.exists() and any(p.name.endswith(".safetensors.partial") for p in out.iterdir())
        else:

            def ready():
                return _finished_shards(out) >= 1

        assert _kill_group_when(proc, ready), "the run finished before the kill could land"
        if moment == "mid_shard" or _finished_shards(out) < SHARDS:
            break
    assert not (out / "config.json").exists() and not (out / QUANTIZE_NAME).exists()
    killed_state = _state_and_outputs(out)  # what the rerun judges, for the message if it redoes a finished shard
    rerun = cli("quantize", str(multi_shard_ckpt), str(out), "--quiet", "--json", "-", check=True)
    report = json.loads(rerun.stdout)
    if moment == "after_first_shard":
        assert report["shards"]["skipped_complete"] >= 1, (attempt, killed_state, report["shards"])
    assert report["shards"]["quantized_now"] >= 1
    assert not list(out.glob("*.partial"))
    assert _outputs(out) == _outputs(uninterrupted)


def test_kill_during_the_first_state_write_still_resumes(tiny_ckpt, tmp_path):
    """A kill can land while OUT holds nothing but the state file's unfinished `.partial`: still ours."""
    out = tmp_path / "out"
    out.mkdir()
    (out / (QUANTIZE_STATE_NAME + ".partial")).write_text('{"format": 1, "sha')
    cli("quantize", str(tiny_ckpt), str(out), "--quiet", check=True)
    reference = tmp_path / "ref"
    cli("quantize", str(tiny_ckpt), str(reference), "--quiet", check=True)
    assert _outputs(out) == _outputs(reference)
    assert not list(out.glob("*.partial"))


def test_state_file_of_the_wrong_shape_means_redo_everything(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    cli("quantize", str(tiny_ckpt), str(out), "--quiet", check=True)
    reference = _outputs(out)
    (out / QUANTIZE_STATE_NAME).write_text("[1, 2, 3]")
    rerun = json.loads(cli("quantize", str(tiny_ckpt), str(out), "--quiet", "--json", "-", check=True).stdout)
    assert rerun["shards"]["skipped_complete"] == 0 and _outputs(out) == reference
