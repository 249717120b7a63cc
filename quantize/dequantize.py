"""`mxforge dequantize CKPT OUT`: a quantized checkpoint (any element format, mixed) back to bf16, for evaluation and
debugging.

Every weight stored in an element format (mxforge/formats/: MXFP4's `X.weight` uint8 codes with its `X.weight_scale`
E8M0 bytes) becomes a bf16 `X.weight` holding the values the codes encode (what Quark's own dequantization gives;
every MXFP4 value is a bf16, exactly); its scale tensor goes. Which format a weight is in is what its module's layer
config in quantization_config names (mxforge.formats.declared_formats): MXFP6 E2M3 and E3M2 are stored alike. Every
other tensor is copied byte for byte. A block whose scale is its format's NaN code (E8M0 0xFF, by the OCP MX spec) is
NaN throughout, and the report says so per tensor (`nan_scale_blocks`, one warning each). Streaming: a tensor is read
and written in row chunks (CHUNK_BYTES of output at a time), whatever its size. Each shard is written under a
temporary name and renamed when whole; then the index, the side files, config.json without its quantization_config,
and mxforge_dequantize.json (the report) last. A rerun into the same OUT redoes the work (OUT must be new, empty, or an
earlier dequantize output).
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
from mxforge.formats import FORMATS, Prefer, StoredPair, declared_formats, stored_pairs
from mxforge.formats.element import f32_to_bf16_bits
from mxforge.progress import byte_progress
from mxforge.provenance import DEQUANTIZE_NAME, carried_from, recorded_command
from mxforge.quantize.run import drop_quantization_config
from mxforge.safe_paths import refuse_links_leaving
from mxforge.safetensors_io import PlannedTensor, ShardWriter, TensorInfo, copy_atomic, write_json_atomic

CHUNK_BYTES = 16 << 20


def quantized_pairs(infos: dict[str, TensorInfo], prefer: Prefer = None) -> dict[str, StoredPair]:
    """The quantized weights of a checkpoint: `X.weight` (codes) -> its pair (format, codes, scales); `prefer`: the
    format(s) quantization_config declares (mxforge.formats.stored_pair).

    Raises:
        CheckpointError: a pair whose shapes do not fit its format (named, with the expected shapes).
    """
    pairs = stored_pairs(infos, prefer)
    for name, pair in pairs.items():
        if pair.defect:
            raise CheckpointError(
                f"tensor {name!r} and its scales are not a {pair.format.title} pair ({pair.defect}); "
                "the checkpoint is corrupt",
                tensor=name,
            )
    return pairs


def dequantize_checkpoint(
    src, out, *, quiet: bool = False, command: str | None = None, follow_symlinks: bool = False
) -> dict:
    """Write OUT as the bf16 checkpoint SRC's quantized weights encode; returns the report (also
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
    pairs = quantized_pairs(infos, declared_formats(ckpt.quantization_config))
    if not pairs:
        raise CheckpointError(
            f"{src}: holds no weight stored in an element format ({', '.join(f.title for f in FORMATS)}: codes under "
            "X.weight with their scales beside them): nothing to dequantize",
            path=src,
        )
    carried = carried_from(src, ckpt.shard_names, {"README.md": "the MXFP4 checkpoint's model card"})
    to_copy = carried.names
    refuse_links_leaving(src, to_copy, follow=follow_symlinks, action="copy")
    check_out_dir(src, out, DEQUANTIZE_NAME, "dequantize")
    out.mkdir(parents=True, exist_ok=True)
    scales = {p.scale.name for p in pairs.values() if p.scale is not None}
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
                    PlannedTensor(i.name, "BF16", pairs[i.name].shape)
                    if i.name in pairs
                    else PlannedTensor(i.name, i.dtype, i.shape)
                    for i in mine
                ]
                index_total += sum(t.nbytes for t in planned)
                writer = ShardWriter(out / shard, planned, metadata=header.metadata or {})
                with open(src / shard, "rb") as fin, writer:
                    for t in writer.order:
                        info, pair = header.tensors[t.name], pairs.get(t.name)
                        parts = _dequantized(fin, pair, nan_blocks) if pair is not None else _raw(fin, info)
                        scale_bytes = pair.scale.nbytes if pair is not None and pair.scale is not None else 0
                        writer.write_parts(t.name, _counted(parts, bar, info.nbytes + scale_bytes))
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
            f"tensor {name!r}: {n:,} block(s) of {pairs[name].format.block} with a NaN scale "
            f"({pairs[name].format.scale.title} 0x{pairs[name].format.scale.nan_code:02X}) written as NaN throughout "
            f"(OCP MX); the {pairs[name].format.title} checkpoint holds NaN there"
            for name, n in sorted(nan_blocks.items())
        ]
        report = {
            "stage": "dequantize",
            "status": "done",
            "source": str(src.resolve()),
            "out": str(out.resolve()),
            "shards": len(ckpt.shard_names),
            "dequantized": len(pairs),
            # per element format (registry name), in registry order: how many weights were stored in it
            "by_format": {f.name: n for f in FORMATS if (n := sum(p.format == f for p in pairs.values()))},
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


def _dequantized(fin, pair: StoredPair, nan_blocks: dict[str, int]):
    """bf16 bytes of a quantized weight, row chunk by row chunk; blocks with the NaN scale code decode to NaN
    (counted into `nan_blocks` under the weight's name)."""
    codes, scales, fmt = pair.weight, pair.scale, pair.format
    assert scales is not None, f"{codes.name}: a quantized weight without scales is refused by quantized_pairs"
    rows, inner = pair.shape
    packed, nblocks = codes.shape[1], fmt.scale_row_bytes(inner)  # bytes per row (a float scale: 4)
    step = max(1, CHUNK_BYTES // (2 * inner))  # inner bf16 values a row
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        c = np.frombuffer(_pread(fin, codes.start + r0 * packed, n * packed), dtype=np.uint8).reshape(n, packed)
        g0, g1 = fmt.scale_grid_span(r0, n)  # the stored scale rows these rows use (a 2-D block format's tile rows)
        grid = _pread(fin, scales.start + g0 * nblocks, (g1 - g0) * nblocks)
        s = fmt.row_scales(np.frombuffer(grid, dtype=np.uint8).reshape(g1 - g0, nblocks), r0, n)
        nan = int((s == fmt.scale.nan_code).sum()) if fmt.scale.nan_code is not None else 0
        if nan:
            nan_blocks[codes.name] = nan_blocks.get(codes.name, 0) + nan
        with np.errstate(invalid="ignore"):  # 0 * NaN in a NaN-scale block: NaN, as the OCP MX spec says
            values = fmt.kernels.decode(c, s, inner)
        yield f32_to_bf16_bits(values)  # exact for every MXFP4 value; NaN stays NaN


def _counted(parts, bar, nbytes: int):
    """Pass pieces through; the progress bar advances by the source bytes once the tensor is done."""
    yield from parts
    bar.update(nbytes)
