"""Quantize one shard, streaming: read the source once in file order (hashing it as it goes), write each
output tensor at its planned offset of `NAME.partial`, then fsync and rename.

Memory stays at one chunk of rows (CHUNK_BYTES) plus its outputs, whatever the shard or tensor size.
FP8 sources: each F8_E4M3 weight's block scales (small) are read first, outside the hashed sequence and from
whichever shard holds them; each chunk of rows is dequantized to bf16 (fp8_source.py) before it is quantized
or written.
Runs in worker processes: it imports numpy and the compiled kernel, and torch only for a non-CPU device
or for non-finite weights that the user allowed.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from mxforge.errors import CheckpointError, MxforgeError
from mxforge.quantize.fp8_source import dequantize_rows, scales_as_f32
from mxforge.quantize.plan import ShardPlan, TensorPlan
from mxforge.safetensors_io import partial_path

CHUNK_BYTES = 16 << 20
NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if os.uname().sysname == "Linux" else None)


@dataclass(frozen=True)
class ShardJob:
    src_dir: str
    out_dir: str
    plan: ShardPlan
    _: KW_ONLY
    device: str = "cpu"
    refuse_nonfinite: bool = True
    expected_sha256: str | None = None  # from mxforge_source.json, when download recorded it
    # (size, mtime_ns) at which download verified the source against expected_sha256 (its hash cache):
    # while the source still has them, its sha256 is taken as verified instead of computed again
    verified_stat: tuple[int, int] | None = None
    scale_offsets: tuple[int, ...] = (0,)  # the scale rule's (scale_rules.py); (0,) is Quark's
    measure_errors: bool = True  # error sums in the kernel (error_report.py); off only to measure their cost


@dataclass
class ShardResult:
    name: str
    source_size: int
    source_mtime_ns: int
    source_sha256: str
    output_size: int
    output_mtime_ns: int
    header_sha256: str
    sha256_from_download: bool = False  # the source's sha256 was download's verified one, not recomputed
    # per quantized tensor, the error sums the kernel measured while quantizing it (error_report.tensor_record)
    errors: dict = field(default_factory=dict)


def run_shard(job: ShardJob, progress: Callable[[int], None] = lambda n: None, finish: bool = True) -> ShardResult:
    """Write OUT/<shard> for one source shard; nothing under the final name unless it is complete.

    With `finish=False` the complete file is left as `SHARD.partial` for `finish_shard` (fsync and
    rename), so a worker can start its next shard while the disk catches up.

    Raises:
        CheckpointError: the source cannot be read or changed under us, its sha256 disagrees with
            mxforge_source.json, or OUT is full / unwritable.
        NonFiniteWeightError: a weight to quantize holds NaN/Inf (unless allowed).
    """
    plan = job.plan
    src = Path(job.src_dir) / plan.name
    final = Path(job.out_dir) / plan.name
    tmp = partial_path(final)
    try:
        with open(src, "rb") as fin:
            stat = os.fstat(fin.fileno())
            if stat.st_size != plan.source_size:
                raise CheckpointError(
                    f"{src}: changed size since it was planned ({plan.source_size} -> {stat.st_size})", path=src
                )
            reuse = job.expected_sha256 is not None and job.verified_stat == (stat.st_size, stat.st_mtime_ns)
            try:
                out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as e:
                raise _write_error(e, final) from None
            try:
                _reserve(out_fd, plan.output_size, final)
                _pwrite_all(out_fd, plan.header, 0, final)
                digest, errors = _stream_tensors(fin, out_fd, job, progress, hashing=not reuse)
            finally:
                os.close(out_fd)
        if reuse:
            assert job.expected_sha256 is not None  # reuse needs the recorded sha256
            digest = job.expected_sha256
        elif job.expected_sha256 and digest != job.expected_sha256:
            raise CheckpointError(
                f"{src}: sha256 {digest} differs from {job.expected_sha256} recorded in "
                "mxforge_source.json: the shard is corrupt; re-download it",
                path=src,
            )
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError) and not isinstance(e, MxforgeError):
            raise CheckpointError(f"{src}: cannot read shard: {e.strerror or e}", path=src) from None
        raise
    result = ShardResult(
        plan.name, stat.st_size, stat.st_mtime_ns, digest, plan.output_size, 0, plan.header_sha256, reuse, errors
    )
    return finish_shard(result, Path(job.out_dir)) if finish else result


def finish_shard(result: ShardResult, out_dir: Path) -> ShardResult:
    """fsync `SHARD.partial` and rename it into place; returns the result with the output's mtime.

    Raises:
        CheckpointError: the disk refused the data (full), or the rename failed; the partial file is removed.
    """
    final = Path(out_dir) / result.name
    tmp = partial_path(final)
    try:
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        out_stat = final.stat()
    except OSError as e:
        _remove(tmp)
        raise _write_error(e, final) from None
    return replace(result, output_size=out_stat.st_size, output_mtime_ns=out_stat.st_mtime_ns)


class _HashingReader:
    """Hands out the source's bytes in file order, straight from the page cache (a read-only mmap: no copy
    into a buffer, which cost as much CPU as a plain copy of the file), while a helper thread computes the
    sha256 of everything handed out (hashlib and the kernels release the GIL, so hashing overlaps
    quantizing). A view returned by `read` stays valid for the next RING - 1 reads; older chunks are
    unmapped again (the page cache keeps them), so the resident set stays at a few chunks per worker.

    Each chunk's pages are mapped with MADV_POPULATE_READ before use, so a source truncated under us is an
    error here rather than a SIGBUS on access. Where the kernel lacks it (Linux < 5.14), chunks are read
    with `pread` into a ring of reused buffers instead."""

    RING = 3

    def __init__(self, fin, size: int, hashing: bool = True):
        self._fin, self._hash, self._hashing = fin, hashlib.sha256(), hashing
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._hashed: list = [None] * self.RING
        self._chunks: list = [None] * self.RING  # (offset, length) of the mapped chunk in each ring slot
        self._buffers: list[bytearray] = [bytearray(0) for _ in range(self.RING)]
        self._turn = 0
        self._map: mmap.mmap | None = None
        if size and _POPULATE_READ:
            self._map = mmap.mmap(fin.fileno(), 0, prot=mmap.PROT_READ)
            self._view = memoryview(self._map)
            try:
                self._map.madvise(mmap.MADV_SEQUENTIAL)
                self._map.madvise(_POPULATE_READ, 0, min(size, mmap.PAGESIZE))
            except OSError:  # no MADV_POPULATE_READ here: read with pread instead
                self._view.release()
                self._map.close()
                self._map = None

    def read(self, offset: int, n: int) -> memoryview:
        """Bytes [offset, offset + n) of the source, which must be read in file order.

        Raises:
            CheckpointError: the file ends early.
        """
        i = self._turn % self.RING
        self._turn += 1
        if self._hashed[i] is not None:
            self._hashed[i].result()
            self._hashed[i] = None
        if self._map is not None:
            self._unmap(i)
            view = self._view[offset : offset + n]
            if len(view) != n or not self._populate(offset, n):
                got = max(0, min(n, len(view)))
                raise CheckpointError(
                    f"{self._fin.name}: truncated while reading at byte {offset + got} "
                    f"(wanted {n} bytes at {offset}); re-download the shard",
                    path=self._fin.name,
                )
            self._chunks[i] = (offset, n)
        else:
            if len(self._buffers[i]) < n:
                self._buffers[i] = bytearray(max(n, CHUNK_BYTES))
            view = memoryview(self._buffers[i])[:n]
            got = os.preadv(self._fin.fileno(), [view], offset)
            if got != n:
                raise CheckpointError(
                    f"{self._fin.name}: truncated while reading at byte {offset + got} "
                    f"(wanted {n} bytes at {offset}); re-download the shard",
                    path=self._fin.name,
                )
        if self._hashing:
            self._hashed[i] = self._pool.submit(self._hash.update, view)
        return view

    def _populate(self, offset: int, n: int) -> bool:
        assert self._map is not None and _POPULATE_READ is not None  # read() calls it only on the mapped path
        start = offset - offset % mmap.PAGESIZE
        try:
            self._map.madvise(_POPULATE_READ, start, offset + n - start)
        except OSError:  # EFAULT: part of the range is past the end of the file now
            return False
        return True

    def _unmap(self, i: int) -> None:
        """Drop ring slot i's pages from our mapping (not from the page cache), to keep RSS small."""
        if self._chunks[i] is None:
            return
        assert self._map is not None  # chunks are recorded only on the mapped path
        offset, n = self._chunks[i]
        self._chunks[i] = None
        start = offset - offset % mmap.PAGESIZE
        end = offset + n - (offset + n) % mmap.PAGESIZE  # whole pages only: the next chunk may share the last
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def reread(self, offset: int, n: int) -> bytes:
        """Bytes already read once, again, outside the hashed sequence (the rare non-finite path)."""
        return os.pread(self._fin.fileno(), n, offset)

    def hexdigest(self) -> str:
        for future in self._hashed:
            if future is not None:
                future.result()
        return self._hash.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._map is not None:
            self._view.release()
            try:
                self._map.close()
            except BufferError:  # a view still held by an error in flight; the mapping goes with it
                pass


def _stream_tensors(
    fin, out_fd: int, job: ShardJob, progress: Callable[[int], None], hashing: bool = True
) -> tuple[str, dict]:
    """Read the source sequentially (header, then tensors by offset), transform and place each tensor;
    returns the source's sha256 (when `hashing`) and each quantized tensor's error sums."""
    plan = job.plan
    reader = _HashingReader(fin, job.plan.source_size, hashing)
    try:
        tensors = sorted(plan.tensors, key=lambda t: t.source.start)
        data_start = tensors[0].source.start if tensors else plan.source_size
        for pos in range(0, data_start, CHUNK_BYTES):
            reader.read(pos, min(CHUNK_BYTES, data_start - pos))
        scales = _read_fp8_scales(reader, job)
        errors = {}
        for t in tensors:
            if t.fate == "quantized":
                errors[t.source.name] = _quantize_tensor(reader, out_fd, t, job, progress, scales.get(t.source.name))
            elif t.fate == "scale":  # folded into its weight: read (and hashed) only
                for pos in range(t.source.start, t.source.end, CHUNK_BYTES):
                    progress(len(reader.read(pos, min(CHUNK_BYTES, t.source.end - pos))))
            elif t.fate == "kept_source":  # kept as stored: the codes byte for byte, the scales under the format's name
                _copy_tensor(reader, out_fd, t, plan.offsets[t.source.name], progress, _out_path(job))
                assert t.format is not None and t.fp8_scale is not None, f"{t.source.name}: planned as kept_source"
                scale_at = plan.offsets[t.format.scale_name(t.source.name)]
                kept = t.fp8_scale.kept_scales(scales[t.source.name], t.format, t.source.shape)
                _pwrite_all(out_fd, kept.astype("<f4").tobytes(), scale_at, _out_path(job))
            elif t.fp8_scale is not None:
                _dequantize_tensor(
                    reader, out_fd, t, plan.offsets[t.source.name], progress, _out_path(job), scales[t.source.name]
                )
            else:
                _copy_tensor(reader, out_fd, t, plan.offsets[t.source.name], progress, _out_path(job))
            _start_writeback(out_fd)
        return reader.hexdigest(), errors
    finally:
        reader.close()


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing what we wrote so far, so the final fsync waits only for the tail."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def _out_path(job: ShardJob) -> Path:
    return Path(job.out_dir) / job.plan.name


def _read_fp8_scales(reader: _HashingReader, job: ShardJob) -> dict[str, np.ndarray]:
    """float32 block scales of every FP8 weight of the shard, read out of the hashed sequence (their own bytes are
    hashed where they lie in the file); scales in another shard are read from that shard.

    Raises:
        CheckpointError: the other shard is missing (a streamed run deletes shards it is done with) or too short.
    """
    out = {}
    for t in job.plan.tensors:
        sc = t.fp8_scale
        if sc is None:
            continue
        if sc.shard == job.plan.name:
            raw = reader.reread(sc.info.start, sc.info.nbytes)
        else:
            other = Path(job.src_dir) / sc.shard
            try:
                with open(other, "rb") as f:
                    raw = os.pread(f.fileno(), sc.info.nbytes, sc.info.start)
            except OSError as e:
                raise CheckpointError(
                    f"{other}: cannot read {sc.info.name!r}, the block scales of {t.source.name!r} "
                    f"in {job.plan.name}: {e.strerror or e}; a streamed run needs each FP8 weight's "
                    "scales in its own shard: quantize the downloaded checkpoint instead",
                    path=other,
                ) from None
        if len(raw) != sc.info.nbytes:
            raise CheckpointError(
                f"{Path(job.src_dir) / sc.shard}: truncated at {sc.info.name!r}; re-download it",
                path=Path(job.src_dir) / sc.shard,
            )
        out[t.source.name] = scales_as_f32(raw, sc.info.dtype, sc.grid)
    return out


def _fp8_block(t: TensorPlan) -> tuple[int, int]:
    """The scale block of an FP8 weight (planned with its scales: fp8_scales)."""
    assert t.fp8_scale is not None, f"{t.source.name}: an FP8 weight planned without its block scales"
    return t.fp8_scale.block


def _dequantize_tensor(
    reader: _HashingReader, out_fd: int, t: TensorPlan, dest: int, progress, where: Path, scales: np.ndarray
) -> None:
    """An FP8 weight the recipe keeps: written as its dequantized bf16, in row chunks."""
    s = t.source
    rows, inner = s.shape
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, inner))
    for r0 in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - r0)
        x = dequantize_rows(reader.read(s.start + r0 * inner, n * inner), scales, r0, inner, _fp8_block(t))
        _pwrite_all(out_fd, x.data, dest + r0 * inner * 2, where)
        progress(n * inner)


def _copy_tensor(reader: _HashingReader, out_fd: int, t: TensorPlan, dest: int, progress, where: Path) -> None:
    s = t.source
    for pos in range(s.start, s.end, CHUNK_BYTES):
        n = min(CHUNK_BYTES, s.end - pos)
        _pwrite_all(out_fd, reader.read(pos, n), dest + pos - s.start, where)
        progress(n)


def _quantize_tensor(
    reader: _HashingReader, out_fd: int, t: TensorPlan, job: ShardJob, progress, fp8_scales: np.ndarray | None = None
) -> dict:
    """Quantize one tensor in row chunks (an FP8 one from its dequantized bf16, through `fp8_scales`); returns its
    error sums (error_report.tensor_record)."""
    from mxforge.formats import ERROR_STATS
    from mxforge.quantize.error_report import tensor_record

    s, fmt = t.source, t.format
    assert fmt is not None, f"{s.name}: planned for quantization without its element format"
    rows, inner = s.shape
    itemsize = s.nbytes // max(1, s.numel)
    row_bytes = inner * itemsize
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, row_bytes))
    packed, nblocks = fmt.packed_inner(inner), fmt.scale_row_bytes(inner)
    codes_at, scales_at = job.plan.offsets[s.name], job.plan.offsets[fmt.scale_name(s.name)]
    codes_buf = np.empty(min(rows, rows_per_chunk) * packed, dtype=np.uint8)
    scales_buf = np.empty(min(rows, rows_per_chunk) * nblocks, dtype=np.uint8)
    nonfinite = 0
    stats = np.zeros(ERROR_STATS, dtype=np.float64) if job.measure_errors else None
    for r0 in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - r0)
        raw = reader.read(s.start + r0 * row_bytes, n * row_bytes)
        x = (
            _as_rows(raw, s.dtype, n, inner)
            if fp8_scales is None
            else dequantize_rows(raw, fp8_scales, r0, inner, _fp8_block(t), t.read_dtype)
        )
        codes = codes_buf[: n * packed].reshape(n, packed)
        scales = scales_buf[: n * nblocks].reshape(n, nblocks)
        nonfinite += _quantize_rows(x, codes, scales, t, job, stats)
        _pwrite_all(out_fd, codes.data, codes_at + r0 * packed, _out_path(job))
        _pwrite_all(out_fd, scales.data, scales_at + r0 * nblocks, _out_path(job))
        progress(n * row_bytes)
    if nonfinite:
        _handle_nonfinite(reader, out_fd, t, job, nonfinite, codes_at, scales_at, fp8_scales)
        return tensor_record(np.zeros(ERROR_STATS), 0) | {"nonfinite": nonfinite}  # encoded as Quark does: not measured
    return tensor_record(stats, s.numel) if stats is not None else tensor_record(np.zeros(ERROR_STATS), 0)


def _as_rows(raw: bytes | memoryview, dtype: str, n: int, inner: int) -> np.ndarray:
    if dtype == "BF16":
        return np.frombuffer(raw, dtype="<i2").reshape(n, inner)
    if dtype == "F16":  # as float16: a format whose numerics run in the weight's dtype (FP8 PTPC) needs it
        return np.frombuffer(raw, dtype="<f2").reshape(n, inner)
    return np.frombuffer(raw, dtype="<f4").reshape(n, inner)


def _quantize_rows(
    x: np.ndarray, codes: np.ndarray, scales: np.ndarray, t: TensorPlan, job: ShardJob, stats: np.ndarray | None
) -> int:
    kernels = t.format.kernels if t.format is not None else None
    assert kernels is not None, f"{t.source.name}: planned for quantization without its element format"
    offsets = _offsets(t, job)
    if job.device == "cpu":
        return kernels.encode_cpu(x, codes, scales, offsets, stats)
    import torch

    w = torch.from_numpy(x.copy())
    if t.read_dtype == "BF16":
        w = w.view(torch.bfloat16)
    codes_t, scales_t = torch.from_numpy(codes), torch.from_numpy(scales)
    return kernels.encode_torch(w, codes_t, scales_t, torch.device(job.device), offsets, stats)


def _offsets(t: TensorPlan, job: ShardJob) -> tuple[int, ...]:
    """The scale rule's offsets for this tensor: the job's where its format takes scale rules, else Quark's (0,)."""
    return job.scale_offsets if t.format is not None and t.format.scale_rules else (0,)


def _handle_nonfinite(
    reader: _HashingReader,
    out_fd: int,
    t: TensorPlan,
    job: ShardJob,
    count: int,
    codes_at: int,
    scales_at: int,
    fp8_scales: np.ndarray | None = None,
) -> None:
    """Refuse, or (when allowed) redo the tensor with Quark's own kernel, which encodes NaN blocks as finite values
    (scale 2^0, every element 6.0)."""
    from mxforge.errors import NonFiniteWeightError
    from mxforge.formats.quark import quark_quantize_weight

    s, fmt = t.source, t.format
    assert fmt is not None, f"{s.name}: planned for quantization without its element format"
    if job.refuse_nonfinite:
        raise NonFiniteWeightError(
            f"{Path(job.src_dir) / job.plan.name}: tensor {s.name!r} holds {count} NaN/Inf value(s); quantizing "
            "would silently encode their blocks as finite values (Quark does). Fix or re-download the source, "
            "keep the tensor with a [[keep]] recipe rule, or pass --allow-nonfinite to encode as Quark does",
            path=Path(job.src_dir) / job.plan.name,
            tensor=s.name,
        )
    if _offsets(t, job) != (0,):
        raise NonFiniteWeightError(
            f"{Path(job.src_dir) / job.plan.name}: tensor {s.name!r} holds {count} NaN/Inf value(s); only the quark "
            "scale rule can encode them (as Quark does): fix the source, keep the tensor, or use --scale-rule quark",
            path=Path(job.src_dir) / job.plan.name,
            tensor=s.name,
        )
    import torch

    raw = reader.reread(s.start, s.nbytes)
    rows = (
        _as_rows(raw, s.dtype, *s.shape)
        if fp8_scales is None
        else dequantize_rows(raw, fp8_scales, 0, s.shape[1], _fp8_block(t), t.read_dtype)
    )
    w = torch.from_numpy(rows.copy())
    codes, scales = quark_quantize_weight(fmt, w.view(torch.bfloat16) if t.read_dtype == "BF16" else w)
    _pwrite_all(out_fd, codes.numpy().data, codes_at, _out_path(job))
    _pwrite_all(out_fd, scales.numpy().data, scales_at, _out_path(job))


def _pwrite_all(fd: int, data, offset: int, where: Path) -> None:
    view = memoryview(data).cast("B")
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    except OSError as e:
        raise _write_error(e, where) from None


def _reserve(fd: int, size: int, where: Path) -> None:
    """Claim the output's space up front, so a full disk fails now rather than hours in."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in NO_SPACE:
            raise _write_error(e, where) from None
        # filesystems without fallocate: space is claimed as we write


def _write_error(e: OSError, where: Path) -> CheckpointError:
    if e.errno in NO_SPACE:
        return CheckpointError(
            f"{where}: no space left for the output ({e.strerror}); free space on OUT's "
            "filesystem or choose another OUT, then rerun: finished shards are kept"
        )
    return CheckpointError(f"{where}: cannot write: {e.strerror or e}")


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
