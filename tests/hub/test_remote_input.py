"""Hostile JSON over the Hub: a Hub repo's config.json nested 100,000 deep is one line and exit 2 for validate and
for fixup --create-pr (they read through mxforge.hub.source, not the local reader); a shard header nested so is a
corrupt shard, which validate reports as a problem (exit 1), as it reports every shard it cannot read."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
from helpers import TOKEN, hub_env, one_error_line, run_cli

DEEP = "[" * 100_000 + "]" * 100_000
SHARD = "model-00002-of-00003.safetensors"


def _deep_config(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config)[:-1] + f', "x": {DEEP}}}')


def _deep_header(ckpt):
    data = (ckpt / SHARD).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    text = json.dumps(header).replace(f'"{first}": {{', f'"{first}": {{"x": {DEEP}, ', 1).encode()
    text += b" " * (-len(text) % 8)
    (ckpt / SHARD).write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


@pytest.mark.parametrize(
    ("tamper", "command"),
    [(_deep_config, ("validate",)), (_deep_config, ("fixup", "--create-pr")), (_deep_header, ("validate",))],
)
def test_deeply_nested_remote_json_is_one_line_exit_2(hub, tiny_ckpt, tmp_path, tamper, command):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "repo")
    tamper(ckpt)
    hub.add_repo_from_dir("me/deep", ckpt)
    env = hub_env(hub, tmp_path, TOKEN, MXFORGE_CACHE=str(tmp_path / "cache"), MXFORGE_HUB_RETRIES="1")
    proc = run_cli(command[0], "me/deep", *command[1:], env=env, timeout=300)
    if tamper is _deep_header:
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{SHARD}: its safetensors header nests arrays/objects 100,002 deep" in proc.stdout
        return
    line = one_error_line(proc)
    assert "nests arrays/objects 100,00" in line and ("config.json" in line or SHARD in line)


BUDGET_SCRIPT = """
import sys
from mxforge import safetensors_io
safetensors_io.MAX_TOTAL_HEADER_BYTES = int(sys.argv[2])
from mxforge.checkpoint import Checkpoint
from mxforge.errors import CheckpointError
from mxforge.hub.source import HubSource
try:
    Checkpoint.open(HubSource(sys.argv[1])).headers
    print("read them all")
except CheckpointError as e:
    print(e)
"""


def test_a_repos_headers_share_one_budget_charged_before_their_bytes_are_asked_for(hub, tiny_ckpt, tmp_path):
    """Each shard's header is within the per-file limit, the repo's together are not: the header that would go over
    is refused before it is requested, so the bytes fetched stay within the budget."""
    sizes = {p.name: struct.unpack("<Q", p.read_bytes()[:8])[0] for p in sorted(tiny_ckpt.glob("*.safetensors"))}
    budget = sum(sizes.values()) - 1
    env = hub_env(hub, tmp_path, TOKEN, MXFORGE_CACHE=str(tmp_path / "cache"), MXFORGE_HUB_RETRIES="1")
    proc = subprocess.run(
        [sys.executable, "-c", BUDGET_SCRIPT, "zai/glm-tiny", str(budget)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"over the {budget:,} mxforge reads" in proc.stdout, proc.stdout
    asked = 0
    for method, path, ranged in [r[:3] for r in hub.requests]:
        if method == "GET" and path.endswith(".safetensors") and ranged and ranged != "bytes=0-7":
            start, end = (int(x) for x in ranged.removeprefix("bytes=").split("-"))
            asked += end - start + 1
    assert 0 < asked <= budget
