"""`validate --deep`: NaN (255) scale bytes and the download's sha256 manifest."""

import hashlib
import json
import shutil

from mxforge.checkpoint import Checkpoint
from mxforge.fixups.fixup import fixup_checkpoint
from mxforge.fixups.quark_like import write_quark_like
from mxforge.fixups.validate import validate_checkpoint

from conftest import run_cli
from test_engine_failures import AMD


def test_nan_scale_byte_is_found_only_by_deep(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "q"
    write_quark_like(tiny_ckpt, ckpt, AMD)
    fixup_checkpoint(ckpt)
    name = "model.layers.3.mlp.experts.5.down_proj.weight_scale"
    info = Checkpoint.open(ckpt).tensor_infos()[name]
    shard = ckpt / Checkpoint.open(ckpt).weight_map[name]
    with open(shard, "r+b") as f:
        f.seek(info.start + info.shape[1] * 3 + 1)
        f.write(b"\xff")
    assert validate_checkpoint(ckpt).ok
    report = validate_checkpoint(ckpt, deep=True)
    (p,) = report.problems
    assert (p.check, p.subject) == ("scales", name) and "[3, 1]" in p.message
    proc = run_cli("validate", str(ckpt), "--deep", "--quiet")
    assert proc.returncode == 1 and name in proc.stdout


def test_sha256_manifest(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "c"
    shutil.copytree(tiny_ckpt, ckpt)
    files = [{"name": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(ckpt.glob("*.safetensors"))]
    (ckpt / "mxforge_source.json").write_text(json.dumps({"files": files}))
    report = validate_checkpoint(ckpt, deep=True)
    assert report.ok and report.checked["deep"]["sha256"]["files"] == 3
    shard = ckpt / files[0]["name"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert [p.subject for p in validate_checkpoint(ckpt, deep=True).problems] == [files[0]["name"]]
    assert validate_checkpoint(ckpt).ok  # headers alone cannot see a flipped data byte
