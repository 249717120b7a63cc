"""config.json, the index and the headers as read from a checkpoint directory: bounded before they are parsed and
checked for shape where they are read, so hostile input is one error naming the file, never a traceback."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from helpers import deadline, one_error_line, run_cli

from mxforge import json_input, safetensors_io
from mxforge.checkpoint import INDEX_NAME, Checkpoint
from mxforge.errors import CheckpointError, ConfigError
from mxforge.validation.validate import validate_checkpoint

DEEP = "[" * 100_000 + "]" * 100_000  # Python's json recurses once per level: a RecursionError unchecked


def _copy(tiny_ckpt, tmp_path):
    return shutil.copytree(tiny_ckpt, tmp_path / "ckpt")


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    path.write_text(edit(data) if callable(edit) else edit)


def test_deeply_nested_config_is_refused_before_it_is_parsed(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config)[:-1] + f', "x": {DEEP}}}')
    with pytest.raises(CheckpointError, match=r"config\.json: config\.json nests arrays/objects 100,?001 deep"):
        Checkpoint.open(ckpt)


def test_deeply_nested_index_is_refused_before_it_is_parsed(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt, tmp_path)
    (ckpt / INDEX_NAME).write_text('{"metadata": ' + DEEP + "}")
    with pytest.raises(CheckpointError, match=rf"{INDEX_NAME}: safetensors index nests arrays/objects"):
        Checkpoint.open(ckpt)


def test_config_json_larger_than_the_limit_is_refused_unparsed(tiny_ckpt, tmp_path, monkeypatch):
    ckpt = _copy(tiny_ckpt, tmp_path)
    size = (ckpt / "config.json").stat().st_size
    monkeypatch.setattr(json_input, "MAX_JSON_BYTES", size - 1)
    monkeypatch.setattr("mxforge.checkpoint.MAX_JSON_BYTES", size - 1)
    with pytest.raises(CheckpointError, match=f"config.json is {size:,} bytes, more than the {size - 1:,}"):
        Checkpoint.open(ckpt)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[1, 2]", r"config\.json: is a JSON list, not an object"),
        (lambda c: json.dumps({**c, "quantization_config": [{"quant_method": "quark"}]}), "quantization_config is a"),
        (lambda c: json.dumps({**c, "quantization_config": "quark"}), "quantization_config is a JSON str, not an"),
    ],
)
def test_config_of_the_wrong_shape_is_one_error(tiny_ckpt, tmp_path, config, message):
    ckpt = _copy(tiny_ckpt, tmp_path)
    _edit_json(ckpt / "config.json", config)
    with pytest.raises(ConfigError, match=message):
        Checkpoint.open(ckpt)
    with pytest.raises(ConfigError, match=message):
        validate_checkpoint(ckpt)


def test_index_metadata_that_is_not_an_object_is_one_error(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt, tmp_path)
    _edit_json(ckpt / INDEX_NAME, lambda i: json.dumps({**i, "metadata": [1]}))
    with pytest.raises(CheckpointError, match="metadata is a JSON list, not an object"):
        Checkpoint.open(ckpt)


def test_a_header_of_1_2m_zero_size_tensors_is_refused_before_it_is_parsed(tmp_path):
    """It cost 1.2 GB and 49 s to read; the tensor ceiling (MAX_TENSORS) is checked on the raw bytes first."""
    entries = b",".join(b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(1_200_000))
    raw = b"{" + entries + b"}"
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    del entries, raw
    with deadline(10, "reading a header of 1.2 M zero-size tensors"):
        with pytest.raises(CheckpointError, match=r"1,200,000 tensors, over the 1,000,000 mxforge reads"):
            safetensors_io.read_header(path)


def test_the_headers_of_all_shards_share_one_budget(tiny_ckpt, tmp_path, monkeypatch):
    ckpt = Checkpoint.open(tiny_ckpt)
    sizes = [struct.unpack("<Q", (tiny_ckpt / s).read_bytes()[:8])[0] for s in ckpt.shard_names]
    monkeypatch.setattr(safetensors_io, "MAX_TOTAL_HEADER_BYTES", sum(sizes) - 1)  # each shard fits, not all
    with pytest.raises(CheckpointError, match=f"headers to {sum(sizes):,} bytes, over the {sum(sizes) - 1:,}"):
        Checkpoint.open(tiny_ckpt).headers
    monkeypatch.setattr(safetensors_io, "MAX_TENSORS", len(ckpt.weight_map) - 1)
    monkeypatch.setattr(safetensors_io, "MAX_TOTAL_HEADER_BYTES", sum(sizes))
    with pytest.raises(CheckpointError, match="over the .* mxforge reads"):
        Checkpoint.open(tiny_ckpt).headers
    # Before parsing, every "{" but the header's own may open a tensor entry (each shard's __metadata__ opens one).
    monkeypatch.setattr(safetensors_io, "MAX_TENSORS", len(ckpt.weight_map) + len(ckpt.shard_names))
    assert len(Checkpoint.open(tiny_ckpt).tensor_infos()) == len(ckpt.weight_map)


@pytest.mark.parametrize("case", ["deep config", "negative layers"])
def test_validate_on_hostile_config_exits_2_with_one_line(tiny_ckpt, tmp_path, case):
    ckpt = _copy(tiny_ckpt, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    if case == "deep config":
        (ckpt / "config.json").write_text(json.dumps(config)[:-1] + f', "x": {DEEP}}}')
    else:
        (ckpt / "config.json").write_text(json.dumps({**config, "num_hidden_layers": -5}))
    line = one_error_line(run_cli("validate", str(ckpt)))
    assert ("nests arrays/objects" if case == "deep config" else "num_hidden_layers is -5, outside 1..1,024") in line
