"""Free disk space: the one check every stage that writes large files makes before it starts."""

from __future__ import annotations

import shutil
from pathlib import Path

from mxforge.errors import DiskSpaceError
from mxforge.progress import format_bytes


def free_space(path: str | Path) -> tuple[Path, int]:
    """(the nearest existing directory at or above `path`, the free bytes of its filesystem)."""
    where = Path(path).absolute()
    while not where.exists():
        where = where.parent
    return where, shutil.disk_usage(where).free


def require_free_space(path: str | Path, need: int, *, what: str, remedy: str, detail: str = "") -> int:
    """The free bytes at `path`; refuse when fewer than `need`.

    Raises:
        DiskSpaceError: "<path>: <what> need <bytes> but the filesystem of <dir> has only <bytes> free<detail>:
            <remedy>".
    """
    where, free = free_space(path)
    if need > free:
        raise DiskSpaceError(
            f"{path}: {what} need {format_bytes(need)} but the filesystem of {where} has only "
            f"{format_bytes(free)} free{detail}: {remedy}",
            path=path,
        )
    return free
