"""Every file mxforge writes beside a checkpoint's weights, config.json and index: their names, their readers,
the originals it keeps, and the command they record.

The stages write their own files (download: the source record, quantize: its report and resume state, fixup:
the fixup record); they take the names from here, and so does everything that reads, skips or publishes them
(validate, the model card, push's file list, dequantize), so no core module imports a stage for a file name.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mxforge.checkpoint import INDEX_NAME, load_json
from mxforge.errors import CheckpointError
from mxforge.safetensors_io import copy_atomic

if TYPE_CHECKING:
    from mxforge.checkpoint import CheckpointSource

SOURCE_NAME = "mxforge_source.json"  # download: repo, commit, every file's sha256
QUANTIZE_NAME = "mxforge_quantize.json"  # quantize: recipe, tool versions, error report
QUANTIZE_STATE_NAME = "mxforge_quantize.state.json"  # quantize: per-shard resume state
FIXUPS_NAME = "mxforge_fixups.json"  # fixup: every entry applied, per run
DEQUANTIZE_NAME = "mxforge_dequantize.json"  # dequantize: its report
RUN_STATE_NAME = "mxforge_run.json"  # mxforge run: the stages' state, in OUT (not a checkpoint)
RUN_SOURCE_DIR, RUN_PRODUCT_DIR = "bf16", "mxfp4"  # mxforge run: OUT's downloaded source and its product
STREAM_STATE_NAME = "mxforge_stream.json"  # mxforge run --stream: verified downloads and pre-uploads, in OUT
ORIGINAL_SUFFIX = ".orig"  # what fixup / mtp_inject keep of a file before their first change
CONFIG_BACKUP_NAME = "config.json" + ORIGINAL_SUFFIX
INDEX_BACKUP_NAME = INDEX_NAME + ORIGINAL_SUFFIX

PUBLISHED_RECORDS = (SOURCE_NAME, QUANTIZE_NAME, FIXUPS_NAME)  # pushed with the checkpoint; the model card reads them
LOCAL_ONLY_FILES = (QUANTIZE_STATE_NAME, CONFIG_BACKUP_NAME, INDEX_BACKUP_NAME)  # bookkeeping: never pushed
WRITTEN_FILES = PUBLISHED_RECORDS + LOCAL_ONLY_FILES + (DEQUANTIZE_NAME,)  # all mxforge writes into a checkpoint


def recorded_command(command: str | None) -> str | None:
    """The command a stage records: the one its caller passed (the CLI passes its own command line), with the
    Hub token masked; None when a library caller passed none (the model card then says "not recorded")."""
    if command is None:
        return None
    from mxforge.redaction import redact

    return redact(command)


def keep_original(root: Path, name: str) -> None:
    """Keep `root/name` as `name.orig` before mxforge first changes it (first change only; copied atomically).

    Raises:
        CheckpointError: the copy cannot be written; nothing is left behind.
    """
    backup = root / (name + ORIGINAL_SUFFIX)
    if not backup.exists():
        copy_atomic(root / name, backup)


def read_record(root: Path, name: str) -> dict | None:
    """A record's JSON object, or None when it is absent or unreadable (for reports that describe what exists)."""
    try:
        data = load_json(root / name, name)
    except (CheckpointError, OSError):
        return None
    return data if isinstance(data, dict) else None


def source_hashes(root: Path) -> dict[str, str]:
    """{file name: sha256} that `mxforge download` recorded in `root`, empty when it has no source record.

    Raises:
        CheckpointError: the record is unreadable or not JSON.
    """
    path = root / SOURCE_NAME
    if not path.exists():
        return {}
    data = load_json(path, SOURCE_NAME)
    files = data.get("files", []) if isinstance(data, dict) else []
    return {f["name"]: f["sha256"] for f in files if isinstance(f, dict) and f.get("sha256") and f.get("name")}


def read_fixups_record(source: "CheckpointSource") -> dict:
    """The checkpoint's mxforge_fixups.json (a directory's, or a Hub repo's), or a fresh record when it has none.

    Raises:
        CheckpointError: the record exists but is not valid JSON or not a fixup record.
    """
    if not source.exists(FIXUPS_NAME):
        return {"stage": "fixup", "fixups": [], "runs": []}
    record = source.read_json(FIXUPS_NAME, "fixup record")
    if not (
        isinstance(record, dict) and isinstance(record.get("fixups"), list) and isinstance(record.get("runs"), list)
    ):
        raise CheckpointError(
            f"{source.where(FIXUPS_NAME)}: not a fixup record (an object with 'fixups' and 'runs' "
            "lists); move it aside and re-run mxforge fixup"
        )
    return record
