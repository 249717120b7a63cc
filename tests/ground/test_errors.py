"""mxforge's errors carry what their message names as fields (as huggingface_hub's do), the raise sites fill them,
they survive the trips a worker's or a Ray task's error makes (pickling), and `--json` reports them."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import struct

import pytest
from helpers import hub_env, run_cli

import mxforge.errors as errors
from mxforge.errors import FIELDS, CheckpointError, ConfigError, MxforgeError

ERROR_CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, MxforgeError)]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_keeps_its_fields_through_pickling(cls, tmp_path):
    e = cls("the message", path=tmp_path / "x.safetensors", tensor="model.norm.weight", pid=7, status=404)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == "the message"
    assert (
        back.fields()
        == e.fields()
        == {
            "path": tmp_path / "x.safetensors",
            "tensor": "model.norm.weight",
            "pid": 7,
            "status": 404,
        }
    )
    assert back.as_dict() == {
        "error": cls.__name__,
        "message": "the message",
        "path": str(tmp_path / "x.safetensors"),
        "tensor": "model.norm.weight",
        "pid": 7,
        "status": 404,
    }
    more = e.with_message("context: the message", repo_id="zai/x")
    assert type(more) is cls and more.fields() == {**e.fields(), "repo_id": "zai/x"}
    assert set(cls("m").fields()) == set() and set(FIELDS) >= set(e.fields())


def test_raise_sites_fill_the_fields_they_name(tiny_ckpt, tmp_path):
    from mxforge.models.fixture import write_fixture
    from mxforge.quantize.run import quantize_checkpoint
    from mxforge.safetensors_io import read_header

    bad = tmp_path / "bad.safetensors"  # a header naming a dtype safetensors does not have
    header = json.dumps({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(CheckpointError) as e:
        read_header(bad)
    assert (e.value.path, e.value.tensor) == (bad, "w")
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\1\2")
    with pytest.raises(CheckpointError) as e:
        read_header(short)
    assert e.value.path == short

    with pytest.raises(ConfigError) as e:
        quantize_checkpoint(tiny_ckpt, tmp_path / "o", workers=0)
    assert e.value.entry == "--workers"

    src = tmp_path / "src"  # an index naming a shard that is not there
    write_fixture(src, "tiny", quiet=True)
    shard = sorted(src.glob("*.safetensors"))[0]
    os.unlink(shard)
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(src, tmp_path / "o2", quiet=True)
    assert e.value.shard == shard.name

    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["num_hidden_layers"] = "7"
    (tmp_path / "cfg").mkdir()
    for p in tiny_ckpt.iterdir():
        if p.is_file():
            (tmp_path / "cfg" / p.name).symlink_to(p)
    (tmp_path / "cfg" / "config.json").unlink()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        quantize_checkpoint(tmp_path / "cfg", tmp_path / "o3", quiet=True, follow_symlinks=True)
    assert (e.value.filename, e.value.entry) == ("config.json", "num_hidden_layers")


def test_hub_errors_carry_the_repo_the_file_and_the_status():
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import httpx

    from mxforge.hub.errors import as_hub_error

    request = httpx.Request("GET", "https://hub.example/api/models/zai/nope")
    missing = RepositoryNotFoundError("404", response=httpx.Response(404, request=request))
    e = as_hub_error(missing, repo_id="zai/nope", revision="main", action="read the file list of")
    assert e is not None and (e.repo_id, e.revision, e.filename, e.status) == ("zai/nope", "main", None, 404)
    gone = RemoteEntryNotFoundError("404", response=httpx.Response(404, request=request))
    e = as_hub_error(gone, repo_id="zai/x", revision="abc", filename="config.json", action="download")
    assert e is not None and (e.filename, e.status) == ("config.json", 404)
    e = as_hub_error(httpx.ConnectError("refused", request=request), repo_id="zai/x")
    assert e is not None and e.repo_id == "zai/x" and e.status is None


def test_json_error_report_names_the_error_and_its_fields(hub, tmp_path):
    """The one CLI test of the exit-2 path with --json: the report is the error's class, message and fields."""
    proc = run_cli("download", "zai/nope", str(tmp_path / "dest"), "--json", "-", env=hub_env(hub, tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["stage"] == "download" and report["ok"] is False and report["exit_code"] == 2
    assert (report["error"], report["repo_id"], report["status"]) == ("HubError", "zai/nope", 404)
    assert report["message"] in proc.stderr and "Traceback" not in proc.stderr
