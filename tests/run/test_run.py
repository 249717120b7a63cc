"""`mxforge run` end to end: Hub source -> quantize -> fixup -> validate -> push on the loopback Hub,
and a SIGKILL during quantize followed by a rerun that ends byte-identical to an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MTP, MXFP6_RECIPE, REPO, TOKEN, cli, hub_env, kill_group, one_error_line, run_cli

from mxforge.models.fixture import write_fixture
from mxforge.provenance import PUBLISHED_RECORDS, RUN_STATE_NAME
from mxforge.provenance import QUANTIZE_STATE_NAME as QUANTIZE_STATE
from mxforge.validation.validate import validate_checkpoint

pytestmark = pytest.mark.slow  # the whole pipeline from the loopback Hub, with kills and resumes


def _env(hub, tmp_path) -> dict:
    return hub_env(hub, tmp_path)


def _product(out: Path) -> dict[str, bytes]:
    """The checkpoint's files (not provenance records, which hold paths and timings)."""
    skip = {QUANTIZE_STATE, *PUBLISHED_RECORDS, "README.md"}
    return {p.name: p.read_bytes() for p in sorted((out / "mxfp4").iterdir()) if p.is_file() and p.name not in skip}


def _run_to_push(hub, tmp_path, out):
    """`mxforge run zai/glm-tiny OUT --push alice/glm-tiny-mxfp4` on the loopback Hub, with a JSON report."""
    return run_cli(
        "run",
        "zai/glm-tiny",
        str(out),
        "--push",
        "alice/glm-tiny-mxfp4",
        "--quiet",
        "--json",
        "-",
        env=_env(hub, tmp_path),
        timeout=600,
    )


def test_run_from_hub_to_hub_with_push(hub, tmp_path):
    out = tmp_path / "run"
    proc = _run_to_push(hub, tmp_path, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    stages = report["stages"]
    assert [s for s in ("download", "quantize", "fixup", "validate", "push") if stages[s]["status"] == "done"] == [
        "download",
        "quantize",
        "fixup",
        "validate",
        "push",
    ]
    assert stages["quantize"]["report"]["mtp_layers"] == [7]
    assert all(stages["validate"]["report"]["engines"].values()) and len(stages["validate"]["report"]["engines"]) == 23
    assert stages["push"]["report"]["remote_hashes_match"] is True
    assert validate_checkpoint(out / "mxfp4").ok
    from huggingface_hub import HfApi

    remote = set(HfApi(endpoint=hub.endpoint, token=TOKEN).list_repo_files("alice/glm-tiny-mxfp4"))
    assert {"README.md", "config.json", "model.safetensors.index.json", "mxforge_source.json"} <= remote
    assert QUANTIZE_STATE not in remote  # local resume bookkeeping stays local
    written = [proc.stdout, proc.stderr] + [p.read_text(errors="ignore") for p in out.rglob("*.json")]
    assert not any(TOKEN in text for text in written)
    # A rerun finds every stage done (validate is always checked again) and pushes nothing new.
    again = _run_to_push(hub, tmp_path, out)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["reused_from_earlier_run"] == ["download", "fixup", "push", "quantize"]


def test_run_human_summary_and_local_source(tiny_ckpt, tmp_path):
    proc = cli("run", str(tiny_ckpt), str(tmp_path / "run"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    for text in (
        "download  skipped",
        "quantize  done",
        "engines: loads: sglang 0.5.9-0.5.23, vllm 0.30.0-0.33.0",
        "132 MXFP4",
        "MTP layer(s) [7]",
    ):
        assert text in proc.stdout, proc.stdout
    state = json.loads((tmp_path / "run" / RUN_STATE_NAME).read_text())
    assert state["inputs"]["recipe"] == "glm-5.2-mxfp4"
    # Each recorded stage reads back as its typed result and writes back the very document it was read from ...
    from mxforge.run.pipeline import StageRecord

    for name, recorded in state["stages"].items():
        assert StageRecord.from_dict(name, recorded).as_dict() == recorded, name
    # ... so a rerun, whose stages are all taken from the state file (validate excepted), sums them up the same.
    again = run_cli("run", str(tiny_ckpt), str(tmp_path / "run"), "--quiet")
    assert again.returncode == 0, again.stderr
    assert "quantize  earlier" in again.stdout and "fixup     earlier" in again.stdout

    def facts(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.lstrip().startswith(("tensors:", "error", "fixups:", "engines:"))]

    assert len(facts(proc.stdout)) == 4 and facts(again.stdout) == facts(proc.stdout)
    assert "relative RMSE" in facts(proc.stdout)[1]


def test_run_refuses_another_source_in_the_same_out(tiny_ckpt, tmp_path):
    out = tmp_path / "run"
    assert cli("run", str(tiny_ckpt), str(out), "--quiet").returncode == 0
    other = tmp_path / "other"
    write_fixture(other, "tiny", seed=5, quiet=True)
    proc = cli("run", str(other), str(out), "--quiet")
    assert proc.returncode == 2 and "holds a run of source" in proc.stderr and "Traceback" not in proc.stderr


def test_run_refuses_a_recipe_a_release_cannot_load_before_quantizing(hub, tmp_path, tiny_ckpt):
    """A recipe that quantizes eh_proj cannot load in vLLM or sglang 0.5.9-0.5.10: run refuses it at plan time,
    naming the releases and the module, exits 2, quantizes and pushes nothing (fixups/plan_check.py)."""
    recipe = tmp_path / "bad.toml"
    text = (REPO / "manifests" / "recipes" / "glm-5.2-mxfp4.toml").read_text()
    recipe.write_text(text + '\n[[quantize]]\nkinds = ["mtp_proj"]\nlayers = "mtp"\n')
    out = tmp_path / "run"

    def run(out: Path, repo: str, *extra: str):
        args = ("run", str(tiny_ckpt), str(out), "--recipe", str(recipe), "--push", repo, "--quiet", *extra)
        return run_cli(*args, env=_env(hub, tmp_path), timeout=600)

    proc = run(out, "alice/never")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    releases = "sglang-0.5.9, sglang-0.5.10, vllm-0.30.0, vllm-0.31.0"  # those that build eh_proj as a torch Linear
    assert f"recipe 'glm-5.2-mxfp4': its output would not load in {releases} even after mxforge fixup" in line
    assert "model.eh_proj: would be bf16" in line and f"under model.layers.{MTP}.eh_proj" in line, line
    assert "Nothing was quantized" in line, line
    assert not list((out / "mxfp4").glob("*.safetensors")) and "Traceback" not in proc.stderr
    assert not any("/api/repos/create" in r[1] for r in hub.requests)
    # served only by releases that quantize eh_proj, the same recipe runs, validates and pushes
    proc = run(tmp_path / "run-sglang", "alice/glm-eh-mxfp4", "--engines", "sglang>=0.5.11")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any("/api/repos/create" in r[1] for r in hub.requests)


def test_run_refuses_a_format_no_selected_release_loads_and_warns_where_it_runs_emulated(tiny_ckpt, tmp_path):
    """MXFP6 E2M3 experts and E3M2 attention (MXFP6_RECIPE; the two are stored alike, told apart by their layer
    configs): no sglang release has an MXFP6 scheme, so run refuses the recipe before quantizing, naming them; served
    by vLLM only, it runs, and validate warns that vLLM computes those modules by emulation (slow), in each format."""
    recipe = tmp_path / "mxfp6.toml"
    recipe.write_text(MXFP6_RECIPE)
    proc = run_cli("run", str(tiny_ckpt), str(tmp_path / "all"), "--recipe", str(recipe), "--quiet", timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    sglang = "sglang-0.5.9, sglang-0.5.10, sglang-0.5.11, sglang-0.5.12, sglang-0.5.15, sglang-0.5.16, sglang-0.5.18"
    assert f"its output would not load in {sglang}, sglang-0.5.19, sglang-0.5.21, sglang-0.5.22 even after" in line
    assert "vllm" not in line.split("even after")[0] and "MXFP6 E3M2" in line, line
    out = tmp_path / "vllm"
    proc = run_cli("run", str(tiny_ckpt), str(out), "--recipe", str(recipe), "--engines", "vllm", "--json", "-")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    report = json.loads(proc.stdout)["stages"]["validate"]["report"]
    assert report["ok"] and {w["engine"] for w in report["warnings"]} == {"vllm-0.30.0", "vllm-0.31.0"}
    assert all("MXFP6 E2M3, 32 MXFP6 E3M2 module(s) by emulation" in w["message"] for w in report["warnings"]), report[
        "warnings"
    ]


SPLITS = {  # a rule set that stores one fused module's shards in two formats -> the shards the refusal names
    "gate/up": (
        "[[quantize]]\nkinds = [\"dense_mlp\"]\nnames = ['.*\\.gate_proj']\n"
        '[[quantize]]\nkinds = ["dense_mlp"]\nnames = [\'.*\\.up_proj\']\nformat = "fp8_ptpc"\n',
        "model.layers.0.mlp.gate_proj MXFP4, model.layers.0.mlp.up_proj FP8 PTPC",
    ),
    "q_a/kv_a": (
        '[[quantize]]\nkinds = ["attention"]\nnames = [\'.*\\.q_a_proj\']\nformat = "fp8_ptpc"\n',
        "model.layers.0.self_attn.q_a_proj FP8 PTPC, model.layers.0.self_attn.kv_a_proj_with_mqa bf16",
    ),
    "an expert bank": (
        '[[quantize]]\nkinds = ["experts"]\nnames = [\'.*\\.experts\\.0\\..*\']\nformat = "fp8_ptpc"\n',
        "model.layers.3.mlp.experts.0.{gate,up,down}_proj FP8 PTPC, "
        "model.layers.3.mlp.experts.{1..7}.{gate,up,down}_proj MXFP4",
    ),
}


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_quantize_and_run_refuse_a_fused_module_split_across_formats(split, tiny_ckpt, tmp_path):
    """Shards an engine loads into one parameter (gate/up, MLA's q_a/kv_a, the experts of one layer) stored in two
    formats load in no release that fuses them: quantize (which serves no release in particular) and run refuse the
    recipe before writing anything, naming the shards, their formats and the releases."""
    rules, shards = SPLITS[split]
    recipe = tmp_path / "split.toml"
    recipe.write_text(
        'name = "split"\nscheme = "mxfp4"\n' + rules + '[[quantize]]\nkinds = ["experts"]\n'
    )  # first wins
    for stage in ("quantize", "run"):
        out = tmp_path / stage
        line = one_error_line(run_cli(stage, str(tiny_ckpt), str(out), "--recipe", str(recipe), "--quiet"))
        assert f"recipe 'split' stores the shards of one fused module in different formats: {shards};" in line, line
        assert "vllm-0.31.0 load them into one parameter" in line and "Nothing was quantized" in line, line
        assert not out.exists() or not any(out.glob("*.safetensors")), stage


@pytest.fixture(scope="module")
def bench_src(module_tmp) -> Path:
    out = module_tmp("run-bench") / "bf16"
    write_fixture(out, "bench", seed=2, gib=0.75, quiet=True)
    return out


def test_sigkill_during_quantize_then_rerun_is_byte_identical(bench_src, tmp_path):
    reference = tmp_path / "reference"
    cli("run", str(bench_src), str(reference), "--quiet", "--workers", "2", check=True)
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mxforge.cli", "run", str(bench_src), str(out), "--quiet", "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    mxfp4 = out / "mxfp4"
    deadline = time.monotonic() + 300
    while not (mxfp4.exists() and any(p.name.endswith(".safetensors.partial") for p in mxfp4.iterdir())):
        assert proc.poll() is None, "the run ended before quantize wrote anything"
        assert time.monotonic() < deadline, "quantize made no progress"
        time.sleep(0.002)
    kill_group(proc)
    state = json.loads((out / RUN_STATE_NAME).read_text())
    assert state["stages"]["quantize"]["status"] == "running"
    assert not (mxfp4 / "config.json").exists()
    rerun = cli("run", str(bench_src), str(out), "--quiet", "--workers", "2", "--json", "-", check=True)
    report = json.loads(rerun.stdout)
    assert report["stages"]["validate"]["report"]["ok"] is True
    assert _product(out) == _product(reference)


def test_run_unreachable_hub_is_one_line_and_recorded(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    proc = run_cli(
        "run",
        "zai/glm-tiny",
        str(out),
        "--quiet",
        env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("mxforge run: error:") == 1 and "cannot reach the Hub" in proc.stderr
    state = json.loads((out / RUN_STATE_NAME).read_text())
    assert state["stages"]["download"]["status"] == "failed" and "cannot reach" in state["stages"]["download"]["error"]


def test_run_state_file_of_the_wrong_shape_is_one_line(tiny_ckpt, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_STATE_NAME).write_text('{"inputs": [1, 2], "stages": 3}')
    proc = cli("run", str(tiny_ckpt), str(out), "--quiet")
    assert proc.returncode == 2 and "state file is corrupt" in proc.stderr and "Traceback" not in proc.stderr
