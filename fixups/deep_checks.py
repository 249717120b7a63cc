"""Checks that read tensor data, not just headers (`mxforge validate --deep`): NaN scales and sha256 sums."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

from mxforge.progress import byte_progress
from mxforge.safetensors_io import TensorInfo

from .report import Problem

NAN_SCALE = 255           # E8M0 0xFF encodes NaN: every weight of that 32-block dequantizes to NaN
CHUNK = 16 << 20
SOURCE_MANIFEST = "mxforge_source.json"
QUANTIZE_RECORD = "mxforge_quantize.json"


def scan_scales(root: Path, weight_map: Mapping[str, str], infos: Mapping[str, TensorInfo], quiet: bool = False) -> tuple[list[Problem], int]:
    """Every uint8 `*.weight_scale` tensor read in full; a 255 byte is a NaN block. Returns problems, bytes read."""
    scales = [info for name, info in infos.items() if name.endswith(".weight_scale") and info.dtype == "U8"]
    total = sum(i.nbytes for i in scales)
    problems = []
    with byte_progress(total, "validate: scales", disable=quiet) as bar:
        for info in scales:
            with open(root / weight_map[info.name], "rb") as f:
                f.seek(info.start)
                remaining, first = info.nbytes, None
                offset = 0
                while remaining:
                    chunk = f.read(min(CHUNK, remaining))
                    if not chunk:
                        break
                    if first is None and NAN_SCALE in chunk:
                        first = offset + chunk.index(NAN_SCALE)
                    remaining -= len(chunk)
                    offset += len(chunk)
                    bar.update(len(chunk))
            if first is not None:
                row, col = divmod(first, info.shape[1]) if len(info.shape) == 2 else (0, first)
                problems.append(Problem("scales", info.name, f"holds E8M0 byte 255 (NaN) first at [{row}, {col}]: that block "
                                        "of 32 weights dequantizes to NaN", "the source weights were not finite there: "
                                        "fix the source and re-quantize this tensor"))
    return problems, total


def check_sha256(root: Path, quiet: bool = False) -> tuple[list[Problem], dict]:
    """Compare files with the sha256 sums `mxforge download` recorded, where they describe this directory.

    A quantized directory carries its source's manifest along (it describes the source's files, not
    these), so the check is skipped there.
    """
    manifest = root / SOURCE_MANIFEST
    if not manifest.exists():
        return [], {"skipped": f"no {SOURCE_MANIFEST}"}
    if (root / QUANTIZE_RECORD).exists():
        return [], {"skipped": f"{SOURCE_MANIFEST} describes the quantizer's source, not this directory"}
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return [Problem("hash", SOURCE_MANIFEST, "is not valid JSON with a 'files' list", "re-run mxforge download")], {}
    problems, total = [], sum(int(f.get("size", 0)) for f in files)
    with byte_progress(total, "validate: sha256", disable=quiet) as bar:
        for entry in files:
            path = root / entry["name"]
            if not path.exists():
                problems.append(Problem("hash", entry["name"], "listed in the download manifest but missing", "re-run mxforge download"))
                continue
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
                    bar.update(len(chunk))
            if entry.get("sha256") and digest.hexdigest() != entry["sha256"]:
                problems.append(Problem("hash", entry["name"], f"sha256 {digest.hexdigest()[:16]}... differs from the "
                                        f"download manifest's {entry['sha256'][:16]}...", "re-download the file"))
    return problems, {"files": len(files), "bytes": total}
