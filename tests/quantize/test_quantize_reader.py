"""The shard reader: bytes straight from an mmap of the page cache (or pread where the kernel cannot
populate mappings), hashed in order, and a source that shrinks under it is an error, not a SIGBUS."""

import hashlib
import os

import pytest

from mxforge.errors import CheckpointError
from mxforge.quantize import shard_job


@pytest.fixture(params=["mmap", "pread"])
def reader_kind(request, monkeypatch):
    if request.param == "pread":
        monkeypatch.setattr(shard_job, "_POPULATE_READ", None)
    return request.param


def test_reader_hands_out_the_file_in_order_and_hashes_it(tmp_path, reader_kind):
    data = os.urandom(3 * 4096 + 123)
    path = tmp_path / "x.bin"
    path.write_bytes(data)
    with open(path, "rb") as f:
        reader = shard_job._HashingReader(f, len(data))
        try:
            got = b""
            for offset, n in ((0, 5), (5, 4096), (4101, 7000), (11101, len(data) - 11101)):  # unaligned chunks
                got += bytes(reader.read(offset, n))
            assert got == data
            assert reader.hexdigest() == hashlib.sha256(data).hexdigest()
        finally:
            reader.close()


def test_reader_reports_a_source_truncated_while_reading(tmp_path, reader_kind):
    path = tmp_path / "x.bin"
    path.write_bytes(os.urandom(5 * 4096))
    with open(path, "rb") as f:
        reader = shard_job._HashingReader(f, 5 * 4096)
        try:
            reader.read(0, 4096)
            os.truncate(path, 2 * 4096)
            with pytest.raises(CheckpointError, match=r"x\.bin: truncated while reading"):
                reader.read(4096, 3 * 4096)
        finally:
            reader.close()
