"""`validate --deep`: NaN (255) scale bytes and the download's sha256 manifest."""

import hashlib
import json
import os
import shutil

import pytest
from helpers import AMD, cli
from quark_like import write_quark_like

from mxforge.checkpoint import Checkpoint
from mxforge.errors import CheckpointError
from mxforge.file_hashes import HashCache, hash_files
from mxforge.fixups.fixup import fixup_checkpoint
from mxforge.validation.validate import validate_checkpoint


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
    proc = cli("validate", str(ckpt), "--deep", "--quiet")
    assert proc.returncode == 1 and name in proc.stdout


def test_sha256_manifest(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "c"
    shutil.copytree(tiny_ckpt, ckpt)
    files = [
        {"name": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(ckpt.glob("*.safetensors"))
    ]
    (ckpt / "mxforge_source.json").write_text(json.dumps({"files": files}))
    report = validate_checkpoint(ckpt, deep=True)
    assert report.ok and report.checked["deep"]["sha256"]["files"] == 3
    shard = ckpt / files[0]["name"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert [p.subject for p in validate_checkpoint(ckpt, deep=True).problems] == [files[0]["name"]]
    assert validate_checkpoint(ckpt).ok  # headers alone cannot see a flipped data byte


@pytest.mark.parametrize(
    "manifest, named",
    [
        ('{"files": ["a"]}', "files[0]"),
        ('{"files": [{"size": 1}]}', "files[0]"),
        ('{"files": 3}', "'files' list"),
        ("{not json", "not valid JSON"),
    ],
)
def test_malformed_sha256_manifest_is_one_error(tiny_ckpt, tmp_path, manifest, named):
    ckpt = tmp_path / "c"
    shutil.copytree(tiny_ckpt, ckpt)
    (ckpt / "mxforge_source.json").write_text(manifest)
    with pytest.raises(CheckpointError, match=r"mxforge_source\.json") as e:
        validate_checkpoint(ckpt, deep=True)
    assert named in str(e.value)
    proc = cli("validate", str(ckpt), "--deep", "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and named in proc.stderr + proc.stdout


def test_listed_path_that_is_not_a_file_is_reported_missing(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "c"
    shutil.copytree(tiny_ckpt, ckpt)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "x").mkdir()  # a directory where a file is listed
    (ckpt / "mxforge_source.json").write_text(json.dumps({"files": [{"name": "sub/x", "size": 1, "sha256": "0" * 64}]}))
    report = validate_checkpoint(ckpt, deep=True)  # not a file: reported missing, not a traceback
    assert [p.subject for p in report.problems] == ["sub/x"]


def test_deep_sha256_does_not_trust_the_hash_cache(tiny_ckpt, tmp_path):
    """A shard damaged with its size and mtime restored still fails --deep, though the cache would match."""
    ckpt = tmp_path / "c"
    shutil.copytree(tiny_ckpt, ckpt)
    names = sorted(p.name for p in ckpt.glob("*.safetensors"))
    hashes = hash_files(ckpt, names, quiet=True)  # fills the cache, as download does
    (ckpt / "mxforge_source.json").write_text(
        json.dumps({"files": [{"name": n, "size": h.size, "sha256": h.sha256} for n, h in hashes.items()]})
    )
    shard = ckpt / names[0]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert HashCache(ckpt).get(names[0]) is not None  # the cache still believes the old hash
    assert [p.subject for p in validate_checkpoint(ckpt, deep=True).problems] == [names[0]]
