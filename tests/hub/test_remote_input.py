"""Hostile JSON over the Hub: a Hub repo's config.json nested 100,000 deep is one line and exit 2 for validate and
for fixup --create-pr (they read through mxforge.hub.source, not the local reader); a shard header nested so is a
corrupt shard, which validate reports as a problem (exit 1), as it reports every shard it cannot read."""

from __future__ import annotations

import json
import shutil
import struct

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
