"""`mxforge validate`: would every engine load this checkpoint? Reads headers only."""

from __future__ import annotations

from pathlib import Path

from mxforge.checkpoint import Checkpoint

from .integrity import check_index_and_shards
from .report import ValidationReport


def validate_checkpoint(root: str | Path, engines: list[str] | None = None) -> ValidationReport:
    """Check a checkpoint for integrity (and, per engine profile, loadability).

    Returns a report; `report.ok` is False when problems were found.

    Raises:
        CheckpointError: the checkpoint cannot be checked at all (not a directory, no config.json, no index).
    """
    ckpt = Checkpoint.open(root)
    report = ValidationReport(str(ckpt.root), list(engines or []))
    problems, counts = check_index_and_shards(ckpt)
    report.problems += problems
    report.checked["integrity"] = counts
    return report
