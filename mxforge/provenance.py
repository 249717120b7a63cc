"""Every file mxforge writes beside a checkpoint's weights, config.json and index: their names, their readers,
the originals it keeps, and the command they record; and which of a source's other files a product carries.

The stages write their own files (download: the source record, quantize: its report and resume state, fixup:
the fixup record); they take the names from here, and so does everything that reads, skips or publishes them
(validate, the model card, push's file list, dequantize), so no core module imports a stage for a file name.

`carried_files` is the one definition of what a product (quantize's and dequantize's OUT, a streamed run's
`mxfp4/`, and so what push publishes) takes over from its source besides the weights: an allowlist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

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


RUN_FILES = (RUN_STATE_NAME, STREAM_STATE_NAME)  # mxforge run's state, in OUT beside the checkpoints

# What a product carries over from its source, beside the weights, config.json and the index (each stage writes
# those itself): what an engine or a user needs to serve it (tokenizer, chat template, generation and processor
# configs, the custom code config.json's auto_map may name), its license and the model card's source. Nothing
# else: no weights in another format (a 200 MB pytorch_model.bin beside the shards was copied and published), no
# other index, and none of mxforge's own records, state or backups, which describe another checkpoint and which
# a source could forge (docs/security.md, "Files a product carries").
CARRIED_NAMES = frozenset(
    {
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "chat_template.json",
        "preprocessor_config.json",
        "processor_config.json",
        "README.md",
    }
)
CARRIED_PATTERNS = (
    "*.jinja",
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY*",
    "configuration_*.py",
    "modeling_*.py",
    "tokenization_*.py",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".pkl", ".npz")
WRITTEN_BY_STAGES = {"config.json", INDEX_NAME}  # written by the stage itself, never carried from the source
SHOWN_SKIPPED = 4  # names the one-line note lists for each reason; it counts the rest


@dataclass(frozen=True)
class CarriedFiles:
    """Which of a source's files a product carries (`names`), and why each other one is left (`skipped`)."""

    names: list[str]
    skipped: dict[str, str] = field(default_factory=dict)

    def note(self) -> str | None:
        """One line naming what is left behind, by reason (None: nothing is)."""
        if not self.skipped:
            return None
        by_reason: dict[str, list[str]] = {}
        for name, why in self.skipped.items():
            by_reason.setdefault(why, []).append(name)
        parts = []
        for why, names in by_reason.items():
            more = len(names) - SHOWN_SKIPPED
            parts.append(", ".join(names[:SHOWN_SKIPPED]) + (f" and {more} more" if more > 0 else "") + f" ({why})")
        return f"not carried into the product: {'; '.join(parts)}"


def is_mxforge_file(name: str) -> bool:
    """Whether `name` is one of the records, state files or backups mxforge writes (never taken from a source)."""
    return name in WRITTEN_FILES or name in RUN_FILES or name.endswith(ORIGINAL_SUFFIX)


def not_carried_because(name: str) -> str | None:
    """Why a product does not carry a source's top-level file `name` (None: it does)."""
    if is_mxforge_file(name):
        return "mxforge's own record or backup, never taken from a source"
    if name.endswith(WEIGHT_SUFFIXES):
        return "weights the index does not name, or in another format"
    if name.endswith(".index.json"):
        return "an index of other weights"
    if name in CARRIED_NAMES or any(fnmatchcase(name, p) for p in CARRIED_PATTERNS):
        return None
    return "not a config, tokenizer, template, code, license or card file"


def carried_files(
    names: Iterable[str], also_skip: Mapping[str, str] | None = None, ours: Iterable[str] = ()
) -> CarriedFiles:
    """Of a source's file `names` (relative, '/'-separated), those its product carries over: top-level files in
    CARRIED_NAMES or matching CARRIED_PATTERNS. config.json, the index (the stage writes them), the shards, hidden
    and unfinished (*.partial) files are neither carried nor reported; `also_skip` leaves more names, with why.
    `ours`: mxforge files the caller itself wrote into the source for this very product (mxforge run's download
    writes the source record), carried as they are; no other mxforge file is ever taken from a source.
    """
    carried, skipped, own = [], {}, set(ours)
    for name in sorted(set(names)):
        if name in WRITTEN_BY_STAGES or name.startswith(".") or name.endswith(".partial"):
            continue
        if name in own:
            carried.append(name)
            continue
        why = "in a subfolder" if "/" in name else (also_skip or {}).get(name) or not_carried_because(name)
        if why is None:
            carried.append(name)
        else:
            skipped[name] = why
    return CarriedFiles(carried, skipped)


def fetched_patterns() -> list[str]:
    """Globs of the files a run downloads from a Hub source to make its product: config.json, the index, the
    safetensors shards and what the product carries; nothing else of the repo is fetched."""
    return ["config.json", INDEX_NAME, "*.safetensors", *sorted(CARRIED_NAMES), *CARRIED_PATTERNS]


def carried_from(
    root: Path, shards: Iterable[str] = (), also_skip: Mapping[str, str] | None = None, ours: Iterable[str] = ()
) -> CarriedFiles:
    """carried_files of a local source directory's top-level files, its `shards` (the index's) left unreported."""
    planned = set(shards)
    return carried_files((p.name for p in root.iterdir() if p.is_file() and p.name not in planned), also_skip, ours)


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
            "lists); move it aside and re-run mxforge fixup",
            filename=FIXUPS_NAME,
        )
    return record
