"""Checks that read tensor data, not just headers (`mxforge validate --deep`): NaN scales and sha256 sums."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from mxforge.checkpoint import load_json
from mxforge.errors import CheckpointError
from mxforge.file_hashes import hash_files
from mxforge.formats import stored_pairs
from mxforge.progress import byte_progress
from mxforge.provenance import QUANTIZE_NAME, SOURCE_NAME
from mxforge.safetensors_io import TensorInfo
from mxforge.validation.report import Problem

CHUNK = 16 << 20


def scan_scales(
    root: Path, weight_map: Mapping[str, str], infos: Mapping[str, TensorInfo], quiet: bool = False
) -> tuple[list[Problem], int]:
    """Every quantized weight's scale tensor read in full, for formats whose scale has a NaN code (E8M0 0xFF: a NaN
    block). Returns problems, bytes read."""
    pairs = [
        p
        for p in stored_pairs(infos).values()
        if p.scale is not None and p.scale.dtype == p.format.scale.dtype and p.format.scale.nan_code is not None
    ]
    total = sum(p.scale.nbytes for p in pairs if p.scale is not None)
    problems = []
    with byte_progress(total, "validate: scales", disable=quiet) as bar:
        for pair in pairs:
            info, scale = pair.scale, pair.format.scale
            assert info is not None and scale.nan_code is not None  # such pairs are left out above
            nan_code = bytes([scale.nan_code])
            with open(root / weight_map[info.name], "rb") as f:
                f.seek(info.start)
                remaining, first = info.nbytes, None
                offset = 0
                while remaining:
                    chunk = f.read(min(CHUNK, remaining))
                    if not chunk:
                        break
                    if first is None and nan_code in chunk:
                        first = offset + chunk.index(nan_code)
                    remaining -= len(chunk)
                    offset += len(chunk)
                    bar.update(len(chunk))
            if first is not None:
                row, col = divmod(first, info.shape[1]) if len(info.shape) == 2 else (0, first)
                problems.append(
                    Problem(
                        "scales",
                        info.name,
                        f"holds {scale.title} byte {scale.nan_code} (NaN) first at [{row}, {col}]: that block "
                        f"of {pair.format.block} weights dequantizes to NaN",
                        "the source weights were not finite there: fix the source and re-quantize this tensor",
                    )
                )
    return problems, total


def _manifest_files(manifest: Path) -> list[dict]:
    """The `files` entries of a download manifest, each a dict with a string `name`.

    Raises:
        CheckpointError: the manifest is unreadable, not JSON, or an entry is malformed (named).
    """
    data = load_json(manifest, "download manifest")
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list):
        raise CheckpointError(
            f"{manifest}: download manifest has no 'files' list; re-run mxforge download", path=manifest
        )
    for i, entry in enumerate(files):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise CheckpointError(
                f"{manifest}: files[{i}] ({json.dumps(entry)[:80]}) is not an object with a "
                "'name'; re-run mxforge download",
                path=manifest,
            )
    return files


def check_sha256(root: Path, quiet: bool = False) -> tuple[list[Problem], dict]:
    """Compare files with the sha256 sums `mxforge download` recorded, where they describe this directory.

    A quantized directory carries its source's manifest along (it describes the source's files, not
    these), so the check is skipped there. Every byte is re-read (the hash cache is not trusted).

    Raises:
        CheckpointError: the manifest is malformed (the entry is named), or a listed file cannot be read.
    """
    manifest = root / SOURCE_NAME
    if not manifest.exists():
        return [], {"skipped": f"no {SOURCE_NAME}"}
    if (root / QUANTIZE_NAME).exists():
        return [], {"skipped": f"{SOURCE_NAME} describes the quantizer's source, not this directory"}
    files = _manifest_files(manifest)
    problems, present = [], []
    for entry in files:
        if (root / entry["name"]).is_file():
            present.append(entry)
        else:
            problems.append(
                Problem("hash", entry["name"], "listed in the download manifest but missing", "re-run mxforge download")
            )
    try:
        hashes = hash_files(root, [e["name"] for e in present], quiet=quiet, desc="validate: sha256", use_cache=False)
    except OSError as e:
        raise CheckpointError(
            f"{e.filename or root}: cannot read for the sha256 check: {e.strerror or e}", path=e.filename or root
        ) from None
    for entry in present:
        got, want = hashes[entry["name"]].sha256, entry.get("sha256")
        if want and got != want:
            problems.append(
                Problem(
                    "hash",
                    entry["name"],
                    f"sha256 {got[:16]}... differs from the download manifest's {str(want)[:16]}...",
                    "re-download the file",
                )
            )
    return problems, {"files": len(files), "bytes": sum(h.size for h in hashes.values())}
