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
from typing import BinaryIO, Callable, Iterable, Mapping

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
# Every dtype name safetensors (0.8) reads, with its size in bits: a header naming another is refused, as safe_open
# refuses it. Sub-byte dtypes (F4, F6_*) must fill whole bytes. mxforge reads and writes only DTYPE_SIZE's.
SAFETENSORS_DTYPE_BITS = {
    **{d: 8 * n for d, n in DTYPE_SIZE.items()},
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "C64": 64,
}
U64_MAX = 2**64 - 1  # safetensors reads shapes and offsets as usize
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
_FIELD_SET = set(_ENTRY_FIELDS)
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_INT_ONLY = {int}


def _odd_integer(raw: bytes) -> bool:
    """Whether the text may hold an integer serde_json reads otherwise: `-0`, or one of 20 digits or more."""
    return b"-0" in raw or b"0" * 20 in raw.translate(_DIGITS_AS_ZERO)


def _uints(values) -> bool:
    """A JSON array of integers 0 .. 2**64-1 (safetensors' usize), bools excluded."""
    return type(values) is list and (
        not values or (set(map(type, values)) == _INT_ONLY and min(values) >= 0 and max(values) <= U64_MAX)
    )


# Ceilings on what a checkpoint's headers may declare, checked before the bytes are parsed (a header of
# 1.2 M zero-size tensors took 1.2 GB and 49 s to read): about 10x GLM-5.2-FP8, the largest checkpoint of the
# families (118,629 tensors; its 141 headers hold ~14 MB).
MAX_TENSORS = 1_000_000  # in all the shards of one checkpoint together
MAX_TOTAL_HEADER_BYTES = 160_000_000  # the headers of all the shards of one checkpoint together


class HeaderBudget:
    """What one checkpoint's headers have declared so far: their bytes and tensors, against MAX_TOTAL_HEADER_BYTES
    and MAX_TENSORS (thread-safe: a Hub repo's headers are read in parallel).

    Raises (charge_*): CheckpointError naming the header that goes over."""

    def __init__(self, max_bytes: int | None = None, max_tensors: int | None = None):
        import threading

        self.max_bytes = MAX_TOTAL_HEADER_BYTES if max_bytes is None else max_bytes
        self.max_tensors = MAX_TENSORS if max_tensors is None else max_tensors
        self.bytes = self.tensors = 0
        self._lock = threading.Lock()

    def charge_bytes(self, where, n: int) -> None:
        """Count a header of `n` bytes, before it is read."""
        self._charge(
            "bytes",
            n,
            self.max_bytes,
            lambda total: f"{where}: its {n:,}-byte header would bring the checkpoint's headers to {total:,} bytes",
        )

    def charge_tensors(self, where, n: int) -> None:
        """Count `n` tensors (before their entries are parsed, `n` an upper bound)."""
        self._charge(
            "tensors",
            n,
            self.max_tensors,
            lambda total: f"{where}: its header would bring the checkpoint to {total:,} tensors",
        )

    def _charge(self, counter: str, n: int, limit: int, over: Callable[[int], str]) -> None:
        """Add `n` to the `counter` attribute, or raise (`over(the new total)` says what would go over `limit`)."""
        with self._lock:
            total = getattr(self, counter) + n
            if total > limit:
                raise CheckpointError(
                    f"{over(total)}, over the {limit:,} mxforge reads (about 10x the largest real checkpoint's): "
                    "the checkpoint is corrupt or hostile"
                )
            setattr(self, counter, total)

    def refund_tensors(self, n: int) -> None:
        with self._lock:
            self.tensors -= n


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


def read_header(path: str | os.PathLike, budget: HeaderBudget | None = None) -> ShardHeader:
    """Parse and check a safetensors header without reading tensor data (`budget`: the checkpoint's, charged
    before the header's bytes are read).

    Raises:
        CheckpointError: the file is missing, truncated, or its header is not valid safetensors
            (parse_header), or it goes over the budget.
    """
    path = Path(path)
    budget = HeaderBudget() if budget is None else budget  # a file on its own: its own ceilings
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            length = header_length(path, f.read(8), file_size)
            budget.charge_bytes(path, length)
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read shard: {e.strerror or e}", path=path) from None
    return parse_header(path, raw, file_size, budget)


class _Pairs(list):
    """A JSON object as the (key, value) pairs it was written with: duplicates kept, as serde_json sees them."""


def _number(text: str) -> int | float:
    """A JSON integer as serde_json reads it: `-0` and integers beyond 64 bits are floats, out of range an error."""
    value = int(text)
    if text == "-0" or not -(2**63) <= value <= U64_MAX:
        return _finite(text)
    return value


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _lone_surrogate(value) -> bool:
    """Whether a parsed JSON value holds a string with an unpaired UTF-16 surrogate (serde_json refuses those)."""
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, list):  # arrays and _Pairs alike
        return any(_lone_surrogate(v) for v in value)
    if isinstance(value, tuple):
        return _lone_surrogate(value[0]) or _lone_surrogate(value[1])
    return False


def parse_header(path, raw: bytes, file_size: int, budget: HeaderBudget | None = None) -> ShardHeader:
    """Check and parse a safetensors header's JSON bytes (`raw`, after the 8-byte length) of a file of
    `file_size` bytes; `path` names the file in errors (a local path, or a file of a Hub repo). Refuses what
    `safetensors.safe_open` refuses (tests/ground/test_safetensors_io.py checks a table of crafted headers against
    it), and, before parsing, what goes over the checkpoint's `budget` of tensors (None: a file on its own's).

    Raises:
        CheckpointError: invalid UTF-8 or JSON (NaN, trailing characters, nesting over MAX_JSON_DEPTH...),
            `__metadata__` not a map of strings (or given twice), a tensor entry with a missing, repeated or
            mistyped field, an unknown dtype, a shape or offset that is not an unsigned 64-bit integer, a size
            that overflows, offsets that overlap, leave gaps or disagree with shape and dtype, data that does not
            end where the file does; or more tensors than the budget allows.
    """
    from mxforge.json_input import check_depth

    def corrupt(why: str, tensor: str | None = None) -> CheckpointError:
        return CheckpointError(f"{path}: safetensors header {why}; the shard is corrupt", path=path, tensor=tensor)

    # Every tensor entry is an object inside the header's: an upper bound on the entries, known before parsing.
    declared = max(raw.count(b"{") - 1, 0)
    budget = HeaderBudget() if budget is None else budget
    budget.charge_tensors(path, declared)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise corrupt(f"is not valid UTF-8 ({e.reason} at byte {8 + e.start})") from None
    check_depth(raw, str(path), "its safetensors header")
    # serde_json reads `-0` and integers past 64 bits as floats (a float shape is refused; one past f64's range is
    # an error anywhere): only a header that could hold one pays for reading every integer in Python.
    number = _number if _odd_integer(raw) else None
    try:
        top = json.loads(
            text, object_pairs_hook=_Pairs, parse_int=number, parse_float=_finite, parse_constant=_refuse_constant
        )
    except ValueError as e:
        raise corrupt(f"is not valid JSON ({e})") from None
    if not isinstance(top, _Pairs):
        raise corrupt(f"is a JSON {type(top).__name__}, not an object")
    if "\\u" in text and _lone_surrogate(top):
        raise corrupt("holds a string with an unpaired UTF-16 surrogate escape")
    metadata: dict[str, str] | None = None
    entries: dict[str, _Pairs] = {}
    seen_metadata = False
    for name, value in top:
        if type(value) is _Pairs and len(value) == 3 and name != "__metadata__":
            a, b, c = value[0][0], value[1][0], value[2][0]
            if a != b and b != c and a != c and {a, b, c} == _FIELD_SET:  # the usual entry: its three fields
                entries[name] = value
                continue
        if name == "__metadata__":
            if seen_metadata:
                raise corrupt("gives __metadata__ twice")
            seen_metadata = True
            if value is None:
                continue
            if not isinstance(value, _Pairs) or not all(isinstance(v, str) for _, v in value):
                raise corrupt(f"has a __metadata__ that is not a map of strings to strings ({_short(value)})")
            metadata = dict(value)
            continue
        if not isinstance(value, _Pairs):
            raise corrupt(f"entry for tensor {name!r} is not an object ({_short(value)})", name)
        keys = [k for k, _ in value if k in _ENTRY_FIELDS]
        missing = [k for k in _ENTRY_FIELDS if k not in keys]
        if missing or len(keys) != len(set(keys)):
            what = f"lacks {missing}" if missing else "repeats a field"
            raise corrupt(f"entry for tensor {name!r} {what} ({_short(value)})", name)
        entries[name] = value  # a tensor named twice: the last entry counts, as in safetensors
    data_start = 8 + len(raw)
    tensors: dict[str, TensorInfo] = {}
    for name, value in entries.items():
        fields = dict(value)
        dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
        if type(dtype) is not str or dtype not in SAFETENSORS_DTYPE_BITS:
            raise corrupt(f"gives tensor {name!r} the unknown dtype {_short(dtype)}", name)
        if not _uints(shape):
            raise corrupt(
                f"gives tensor {name!r} a shape that is not a list of unsigned integers ({_short(shape)})", name
            )
        if not _uints(offsets) or len(offsets) != 2:
            raise corrupt(
                f"gives tensor {name!r} data_offsets that are not two unsigned integers ({_short(offsets)})", name
            )
        numel = 1
        for d in shape:
            numel *= d
            if numel > U64_MAX:
                raise corrupt(f"gives tensor {name!r} a shape {shape} whose size overflows 64 bits", name)
        bits = numel * SAFETENSORS_DTYPE_BITS[dtype]
        if bits % 8:
            raise corrupt(f"gives tensor {name!r} ({dtype}{shape}) a size that is not a whole number of bytes", name)
        begin, end = offsets
        if dtype not in DTYPE_SIZE:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {dtype}, which mxforge does not read "
                f"(it reads {', '.join(DTYPE_SIZE)})",
                path=path,
                tensor=name,
            )
        info = TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)
        if end >= begin and info.nbytes != bits // 8:
            raise CheckpointError(
                f"{path}: tensor {name!r} header says {dtype}{list(shape)} ({bits // 8} bytes) "
                f"but its data_offsets span {end - begin} bytes: the header lies; the shard is corrupt",
                path=path,
                tensor=name,
            )
        tensors[name] = info
    budget.refund_tensors(declared - len(tensors))
    cursor = data_start
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != cursor or info.end < info.start:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} starts at byte {info.start}, expected {cursor}: "
                "overlapping or gapped data offsets; the shard is corrupt",
                path=path,
                tensor=info.name,
            )
        cursor = info.end
    if cursor != file_size:
        what = "is truncated" if cursor > file_size else "has trailing bytes"
        raise CheckpointError(
            f"{path}: header describes {cursor} bytes but the file has {file_size}: the shard {what}; re-download it",
            path=path,
        )
    return ShardHeader(path, tensors, metadata, data_start, file_size)


def _short(value) -> str:
    """A parsed JSON value for an error message, at most 80 characters."""
    text = repr(dict(value) if isinstance(value, _Pairs) else value)
    return text if len(text) <= 80 else text[:77] + "..."


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
