import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxforge.errors import CheckpointError
from mxforge.safetensors_io import PlannedTensor, ShardWriter, read_header

DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8", torch.float64: "F64", torch.int8: "I8"}


def _tensors():
    g = torch.Generator().manual_seed(1)
    return {
        "b.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "a.weight_scale": torch.randint(0, 255, (4, 1), generator=g, dtype=torch.uint8),
        "a.bias": torch.randn(3, generator=g),
        "z": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "y": torch.zeros(5, dtype=torch.int8),
    }


def test_writer_is_byte_identical_to_safetensors(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    plan = [PlannedTensor(n, DTYPES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    with ShardWriter(tmp_path / "ours.safetensors", plan) as w:
        for t in w.order:
            w.write(t.name, tensors[t.name])
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    loaded = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_writer_leaves_nothing_on_failure(tmp_path):
    plan = [PlannedTensor("a", "F32", (2,)), PlannedTensor("b", "F32", (2,))]
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "x.safetensors", plan) as w:
            w.write("a", torch.zeros(2))
            raise RuntimeError("worker died")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="only 1 of 2"):
        with ShardWriter(tmp_path / "x.safetensors", plan) as w:
            w.write("a", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_wrong_size_and_order(tmp_path):
    plan = [PlannedTensor("a", "F32", (2,)), PlannedTensor("b", "F32", (2,))]
    with pytest.raises(CheckpointError, match="out of order"):
        with ShardWriter(tmp_path / "x.safetensors", plan) as w:
            w.write("b", torch.zeros(2))
    with pytest.raises(CheckpointError, match="planned 8"):
        with ShardWriter(tmp_path / "x.safetensors", plan) as w:
            w.write("a", torch.zeros(3))
    assert list(tmp_path.iterdir()) == []


def test_read_header_matches_safetensors(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "ref.safetensors")
    header = read_header(tmp_path / "ref.safetensors")
    assert set(header.tensors) == set(tensors)
    for name, t in tensors.items():
        info = header.tensors[name]
        assert info.shape == tuple(t.shape) and info.dtype == DTYPES[t.dtype]
        with open(tmp_path / "ref.safetensors", "rb") as f:
            f.seek(info.start)
            assert f.read(info.nbytes) == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_read_header_rejects_truncated_and_lying_files(tmp_path):
    save_file(_tensors(), tmp_path / "ok.safetensors")
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[:-7])
    with pytest.raises(CheckpointError, match=r"trunc\.safetensors.*truncated"):
        read_header(tmp_path / "trunc.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(tmp_path / "tiny.safetensors")
    n = struct.unpack("<Q", data[:8])[0]
    lying = data[: 8 + n].replace(b'"shape":[4,6]', b'"shape":[4,7]') + data[8 + n :]
    (tmp_path / "lie.safetensors").write_bytes(lying)
    with pytest.raises(CheckpointError, match=r"b\.weight.*header lies"):
        read_header(tmp_path / "lie.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_header(tmp_path / "garbage.safetensors")
