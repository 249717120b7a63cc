"""`mxforge dequantize CKPT OUT`: an MXFP4 checkpoint back to bf16, for evaluation and debugging.

Every MXFP4 weight (`X.weight` uint8 codes with its `X.weight_scale` E8M0 bytes) becomes a bf16 `X.weight`
holding exactly the values the codes encode (what Quark's own dequantization gives; every such value is
a bf16); its scale tensor goes. A block whose E8M0 scale is 0xFF (NaN, by the OCP MX spec) is NaN throughout,
and the report says so per tensor (`nan_scale_blocks`, one warning each). Every other tensor is copied byte for
byte. Streaming: a tensor is read
and written in row chunks (CHUNK_BYTES of output at a time), whatever its size. Each shard is written
under a temporary name and renamed when whole; then the index, the side files, config.json without its
quantization_config, and mxforge_dequantize.json (the report) last. A rerun into the same OUT redoes
the work (OUT must be new, empty, or an earlier dequantize output).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import numpy as np

from mxforge.checkpoint import Checkpoint, write_index
from mxforge.dir_lock import check_out_dir, directory_lock
from mxforge.errors import CheckpointError
from mxforge.progress import byte_progress
from mxforge.provenance import DEQUANTIZE_NAME, carried_from, recorded_command
from mxforge.quantize.mxfp4 import dequantize_rows
from mxforge.quantize.run import drop_quantization_config
from mxforge.safe_paths import refuse_links_leaving
from mxforge.safetensors_io import PlannedTensor, ShardWriter, TensorInfo, copy_atomic, write_json_atomic

CHUNK_BYTES = 16 << 20
SCALE_SUFFIX = "_scale"
E8M0_NAN = 0xFF  # OCP MX v1.0: the E8M0 code 0xFF is NaN, and a block with a NaN scale is NaN in every element
MX_BLOCK = 32


def mxfp4_pairs(infos: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The MXFP4 weights of a checkpoint: `X.weight` (U8 codes) -> its `X.weight_scale` (U8 E8M0 bytes).

    Raises:
        CheckpointError: a pair whose shapes do not fit (scales must be [out, ceil(2 * codes_in / 32)]).
    """
    pairs = {}
    for name, info in infos.items():
        scale = infos.get(name + SCALE_SUFFIX)
        if not (name.endswith(".weight") and info.dtype == "U8" and scale is not None and scale.dtype == "U8"):
            continue
        if len(info.shape) != 2 or len(scale.shape) != 2 or scale.shape != (info.shape[0], -(-2 * info.shape[1] // 32)):
            raise CheckpointError(
                f"tensor {name!r} {list(info.shape)} and its scale {list(scale.shape)} are not an MXFP4 "
                f"pair (scales must be [out, ceil(2 * {info.shape[-1] if info.shape else '?'} / 32)]); "
                "the checkpoint is corrupt",
                tensor=name,
            )
        pairs[name] = scale
    return pairs


def dequantize_checkpoint(
    src, out, *, quiet: bool = False, command: str | None = None, follow_symlinks: bool = False
) -> dict:
    """Write OUT as the bf16 checkpoint SRC's MXFP4 weights encode; returns the report (also
    OUT/mxforge_dequantize.json).

    Raises:
        CheckpointError: SRC unreadable or corrupt (a shard truncated, an MXFP4 pair that does not fit), no MXFP4
            weight in SRC, OUT unusable or full.
        MxforgeError: OUT holds something else.
        DirectoryInUse: another mxforge process works in OUT.
    """
    started = time.monotonic()
    src, out = Path(src), Path(out)
    ckpt = Checkpoint.open(src, follow_symlinks)
    infos = ckpt.tensor_infos()
    pairs = mxfp4_pairs(infos)
    if not pairs:
        raise CheckpointError(
            f"{src}: holds no MXFP4 weight (uint8 X.weight with X.weight_scale): nothing to dequantize", path=src
        )
    carried = carried_from(src, ckpt.shard_names, {"README.md": "the MXFP4 checkpoint's model card"})
    to_copy = carried.names
    refuse_links_leaving(src, to_copy, follow=follow_symlinks, action="copy")
    check_out_dir(src, out, DEQUANTIZE_NAME, "dequantize")
    out.mkdir(parents=True, exist_ok=True)
    scales = {s.name for s in pairs.values()}
    total = sum(i.nbytes for i in infos.values())
    weight_map, bytes_out, index_total = {}, 0, 0
    nan_blocks: dict[str, int] = {}
    with directory_lock(out):
        write_json_atomic(
            out / DEQUANTIZE_NAME, {"stage": "dequantize", "status": "running", "source": str(src.resolve())}
        )
        with byte_progress(total, "dequantize", disable=quiet) as bar:
            for shard in ckpt.shard_names:
                header = ckpt.headers[shard]
                mine = [
                    i for i in header.tensors.values() if ckpt.weight_map.get(i.name) == shard and i.name not in scales
                ]
                planned = [
                    PlannedTensor(i.name, "BF16", (i.shape[0], 2 * i.shape[1]))
                    if i.name in pairs
                    else PlannedTensor(i.name, i.dtype, i.shape)
                    for i in mine
                ]
                index_total += sum(t.nbytes for t in planned)
                writer = ShardWriter(out / shard, planned, metadata=header.metadata or {})
                with open(src / shard, "rb") as fin, writer:
                    for t in writer.order:
                        info = header.tensors[t.name]
                        parts = (
                            _dequantized(fin, info, header.tensors[t.name + SCALE_SUFFIX], nan_blocks)
                            if t.name in pairs
                            else _raw(fin, info)
                        )
                        writer.write_parts(
                            t.name,
                            _counted(
                                parts,
                                bar,
                                info.nbytes + (header.tensors[t.name + SCALE_SUFFIX].nbytes if t.name in pairs else 0),
                            ),
                        )
                        weight_map[t.name] = shard
                bytes_out += writer.nbytes
        write_index(out, weight_map, index_total)
        for name in to_copy:
            copy_atomic(src / name, out / name)
        note = carried.note()
        if note and not quiet:
            print(f"mxforge dequantize: {note}", file=sys.stderr)
        config = copy.deepcopy(ckpt.config)
        drop_quantization_config(config)
        write_json_atomic(out / "config.json", config)
        seconds = time.monotonic() - started
        warnings = [
            f"tensor {name!r}: {n:,} block(s) of {MX_BLOCK} with a NaN scale (E8M0 0xFF) written as NaN throughout "
            "(OCP MX); the MXFP4 checkpoint holds NaN there"
            for name, n in sorted(nan_blocks.items())
        ]
        report = {
            "stage": "dequantize",
            "status": "done",
            "source": str(src.resolve()),
            "out": str(out.resolve()),
            "shards": len(ckpt.shard_names),
            "dequantized": len(pairs),
            "copied": len(infos) - len(pairs) - len(scales),
            "scales_dropped": len(scales),
            "bytes_in": total,
            "bytes_out": bytes_out,
            "seconds": round(seconds, 3),
            "gb_per_s": round(total / seconds / 1e9, 4) if seconds > 0 else None,
            "nan_scale_blocks": dict(sorted(nan_blocks.items())),
            "warnings": warnings,
            "command": recorded_command(command),
        }
        write_json_atomic(out / DEQUANTIZE_NAME, report)
    return report


def _pread(fin, offset: int, n: int) -> bytes:
    data = os.pread(fin.fileno(), n, offset)
    if len(data) != n:
        raise CheckpointError(
            f"{fin.name}: truncated at byte {offset + len(data)} (wanted {n} bytes at {offset}); "
            "re-download or re-create the shard",
            path=fin.name,
        )
    return data


def _raw(fin, info: TensorInfo):
    for pos in range(info.start, info.end, CHUNK_BYTES):
        yield _pread(fin, pos, min(CHUNK_BYTES, info.end - pos))


def _dequantized(fin, codes: TensorInfo, scales: TensorInfo, nan_blocks: dict[str, int]):
    """bf16 bytes of an MXFP4 weight, row chunk by row chunk; blocks with a NaN scale are NaN (counted into
    `nan_blocks` under the weight's name)."""
    rows, half = codes.shape
    nblocks = scales.shape[1]
    step = max(1, CHUNK_BYTES // (4 * half))  # 2 * half bf16 values a row
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        c = np.frombuffer(_pread(fin, codes.start + r0 * half, n * half), dtype=np.uint8).reshape(n, half)
        s = np.frombuffer(_pread(fin, scales.start + r0 * nblocks, n * nblocks), dtype=np.uint8).reshape(n, nblocks)
        nan = s == E8M0_NAN
        if nan.any():  # decode them with a finite scale (no inf * 0 warnings), then make the whole block NaN
            values = dequantize_rows(c, np.where(nan, 127, s).astype(np.uint8), 2 * half)
            values[np.repeat(nan, MX_BLOCK, axis=1)[:, : 2 * half]] = np.nan
            nan_blocks[codes.name] = nan_blocks.get(codes.name, 0) + int(nan.sum())
        else:
            values = dequantize_rows(c, s, 2 * half)
        yield (values.view(np.uint32) >> 16).astype("<u2")  # exact: every MXFP4 value is a bf16


def _counted(parts, bar, nbytes: int):
    """Pass pieces through; the progress bar advances by the source bytes once the tensor is done."""
    yield from parts
    bar.update(nbytes)
