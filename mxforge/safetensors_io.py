"""Safetensors at the byte level: read headers without touching data, write shards tensor by tensor.

The writer lays files out exactly as `safetensors.torch.save_file` does (same tensor order, header JSON
and padding), so files it writes are byte-identical to the reference library's for the same tensors,
while never holding more than one tensor in memory. Files are written under a temporary name and
renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Mapping

from mxforge.errors import CheckpointError

# Safetensors' own dtype order (the Rust enum): the writer sorts by it, descending, then by name.
_DTYPE_RANK = {
    "BOOL": 0,
    "U8": 4,
    "I8": 5,
    "F8_E5M2": 6,
    "F8_E4M3": 7,
    "F8_E8M0": 8,
    "I16": 9,
    "U16": 10,
    "F16": 11,
    "BF16": 12,
    "I32": 13,
    "U32": 14,
    "F32": 15,
    "F64": 17,
    "I64": 18,
    "U64": 19,
}
DTYPE_SIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; `start`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int


def header_length(path, first8: bytes, file_size: int) -> int:
    """The header length a safetensors file's first 8 bytes give, checked against safetensors' limit and the
    file's size (`path` names the file in errors) before a byte of the header is read.

    Raises:
        CheckpointError: fewer than 8 bytes, or a length beyond the limit or the file.
    """
    if len(first8) < 8:
        raise CheckpointError(
            f"{path}: truncated safetensors file ({file_size} bytes, no header); re-download it", path=path
        )
    (header_len,) = struct.unpack("<Q", first8)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise CheckpointError(
            f"{path}: header length {header_len} does not fit the file ({file_size} bytes): "
            "the shard is truncated or corrupt; re-download it",
            path=path,
        )
    return header_len


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Parse and check a safetensors header without reading tensor data.

    Raises:
        CheckpointError: the file is missing, truncated, or its header is not valid safetensors
            (bad JSON, unknown dtype, offsets that overlap, leave gaps, disagree with the shape,
            or point past the end of the file).
    """
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(header_length(path, f.read(8), file_size))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read shard: {e.strerror or e}", path=path) from None
    return parse_header(path, raw, file_size)


def parse_header(path, raw: bytes, file_size: int) -> ShardHeader:
    """Check and parse a safetensors header's JSON bytes (`raw`, after the 8-byte length) of a file of
    `file_size` bytes; `path` names the file in errors (a local path, or a file of a Hub repo).

    Raises:
        CheckpointError: as read_header, for everything after the length.
    """
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path}: safetensors header is not valid JSON ({e}); the shard is corrupt", path=path
        ) from None
    metadata = header.pop("__metadata__", None)
    data_start = 8 + len(raw)
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {entry!r}", path=path, tensor=name
            ) from None
        if dtype not in DTYPE_SIZE:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}", path=path, tensor=name)
        info = TensorInfo(name, dtype, shape, data_start + begin, data_start + end)
        expected = info.numel * DTYPE_SIZE[dtype]
        if end < begin or info.nbytes != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} header says {dtype}{list(shape)} ({expected} bytes) "
                f"but its data_offsets span {end - begin} bytes: the header lies; the shard is corrupt",
                path=path,
                tensor=name,
            )
        tensors[name] = info
    cursor = data_start
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != cursor:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} starts at byte {info.start}, expected {cursor}: "
                "overlapping or gapped data offsets; the shard is corrupt",
                path=path,
                tensor=info.name,
            )
        cursor = info.end
    if cursor != file_size:
        what = "truncated" if cursor > file_size else "has trailing bytes"
        raise CheckpointError(
            f"{path}: header describes {cursor} bytes but the file has {file_size}: the shard is {what}; "
            "re-download it",
            path=path,
        )
    return ShardHeader(path, tensors, metadata, data_start, file_size)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def safetensors_order(tensors: Iterable[PlannedTensor]) -> list[PlannedTensor]:
    """The order `safetensors` itself writes tensors in: dtype rank descending, then name."""
    return sorted(tensors, key=lambda t: (-_DTYPE_RANK[t.dtype], t.name))


def encode_header(tensors: list[PlannedTensor], metadata: Mapping[str, str] | None) -> bytes:
    """Header bytes (length prefix included) for tensors laid out in the given order."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def partial_path(path: Path) -> Path:
    """Where a file is written until complete; never mistaken for a finished shard."""
    return path.with_name(path.name + ".partial")


class ShardWriter:
    """Write one safetensors file tensor by tensor, in safetensors order, then rename it into place.

    Usage: `with ShardWriter(path, planned) as w: for t in w.order: w.write(t.name, data)`.
    `data` is a contiguous CPU torch tensor or any bytes-like object of the planned size.
    Leaving the block with an exception removes the partial file; the final name appears only
    after every tensor is written and flushed to disk.

    Raises:
        CheckpointError: a tensor is written out of order or with the wrong byte size, or the
            disk is full / unwritable (the partial file is removed).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        tensors: Iterable[PlannedTensor],
        metadata: Mapping[str, str] | None = None,
        sparse: bool = False,
    ):
        self.path = Path(path)
        self.order = safetensors_order(tensors)
        self.metadata = {"format": "pt"} if metadata is None else metadata
        self.sparse = sparse
        self._next = 0
        self._file: BinaryIO | None = None  # open between __enter__ and __exit__
        self.nbytes = len(encode_header(self.order, self.metadata)) + sum(t.nbytes for t in self.order)

    def __enter__(self) -> "ShardWriter":
        self._tmp = partial_path(self.path)
        try:
            self._file = open(self._tmp, "wb")
            self._file.write(encode_header(self.order, self.metadata))
        except OSError as e:
            self._abort()
            raise CheckpointError(f"{self.path}: cannot write: {e.strerror or e}", path=self.path) from None
        return self

    def write(self, name: str, data) -> None:
        self.write_parts(name, (data,))

    def write_parts(self, name: str, parts) -> None:
        """Write the next tensor from an iterable of bytes-like pieces (streaming: one piece in memory at a time)."""
        expected = self.order[self._next] if self._next < len(self.order) else None
        if expected is None or expected.name != name:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} written out of order (expected {expected and expected.name!r})",
                path=self.path,
                tensor=name,
            )
        written = 0
        for part in parts:
            buf = _as_bytes(part)
            try:
                self._open_file().write(buf)
            except OSError as e:
                raise CheckpointError(
                    f"{self.path}: cannot write tensor {name!r}: {e.strerror or e} (disk full?)",
                    path=self.path,
                    tensor=name,
                ) from None
            written += len(buf)
        if written != expected.nbytes:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has {written} bytes, planned {expected.nbytes}",
                path=self.path,
                tensor=name,
            )
        self._next += 1

    def skip_to_end(self) -> None:
        """Leave every remaining tensor's bytes as a hole (sparse files: headers real, data reads as zeros)."""
        self._open_file().truncate(self.nbytes)
        self._next = len(self.order)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abort()
            return
        if self._next != len(self.order):
            self._abort()
            raise CheckpointError(
                f"{self.path}: only {self._next} of {len(self.order)} tensors were written", path=self.path
            )
        try:
            f = self._open_file()
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(self._tmp, self.path)
        except OSError as e:
            self._abort()
            raise CheckpointError(
                f"{self.path}: cannot finish writing: {e.strerror or e} (disk full?)", path=self.path
            ) from None

    def _open_file(self) -> BinaryIO:
        if self._file is None:
            raise RuntimeError(f"{self.path}: ShardWriter is written to only inside `with ShardWriter(...)`")
        return self._file

    def _abort(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


def _as_bytes(data) -> memoryview:
    if hasattr(data, "untyped_storage"):  # torch tensor
        import torch

        t = data.detach().contiguous().cpu()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
    return memoryview(data).cast("B")


def _atomic(path: Path, fill) -> None:
    """Run `fill(tmp)` on PATH.partial, fsync it, rename it to PATH; on failure remove it and raise one line."""
    tmp = partial_path(path)
    try:
        fill(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:  # nothing of ours there (or not a file we made): the original error is the one to report
            pass
        raise CheckpointError(f"{path}: cannot write: {e.strerror or e}", path=path) from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text (UTF-8) under a temporary name, fsync, rename into place.

    Raises:
        CheckpointError: the file cannot be written (disk full, permissions); nothing is left behind.
    """
    _atomic(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write bytes under a temporary name, fsync, rename into place.

    Raises:
        CheckpointError: the file cannot be written; nothing is left behind.
    """
    _atomic(Path(path), lambda tmp: tmp.write_bytes(data))


def write_json_atomic(
    path: str | os.PathLike, obj, *, indent: int = 2, ensure_ascii: bool = True, trailing_newline: bool = True
) -> None:
    """Write JSON under a temporary name, fsync, rename into place.

    Raises:
        CheckpointError: the file cannot be written; nothing is left behind.
    """
    text = json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii) + ("\n" if trailing_newline else "")
    write_text_atomic(path, text)


def copy_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy a file (with its metadata) under a temporary name, fsync, rename into place.

    Raises:
        CheckpointError: the copy failed (source unreadable, disk full); nothing is left behind.
    """
    import shutil

    _atomic(Path(dst), lambda tmp: shutil.copy2(src, tmp))
