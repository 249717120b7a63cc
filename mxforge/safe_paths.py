"""Paths mxforge did not choose, kept inside the directory they belong to.

Two sources of such paths: file names a Hub sends (joined onto DEST by download) and symlinks inside a
checkpoint (read by quantize, validate, push). A name from the Hub must be a plain relative path that
stays inside DEST; a symlink whose target leaves the checkpoint is refused unless the user asked for links
to be followed. Nothing here touches the filesystem except to resolve a path that is about to be used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from mxforge.errors import CheckpointError, UnsafeNameError

MAX_COMPONENT_BYTES = 255  # NAME_MAX of every common Linux filesystem
MAX_NAME_BYTES = 1024  # a whole relative name; leaves room for DEST under PATH_MAX (4096)
RESERVED_TOP = ".cache"  # mxforge's and huggingface_hub's bookkeeping in DEST: never written from the Hub
FOLLOW_HINT = "pass --follow-symlinks to read through it"


def is_inside(root: Path, path: Path) -> bool:
    """Whether `path`, with every symlink on the way resolved, is `root` or lies under it."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def name_problem(name: object) -> str | None:
    """Why a remote file name is unsafe to join onto a directory, or None when it is a plain relative path."""
    if not isinstance(name, str) or not name:
        return "it is empty or not a string"
    if "\0" in name:
        return "it contains a NUL byte"
    if "\\" in name:
        return "it contains a backslash"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "it contains a control character"
    if name.startswith("/"):
        return "it is an absolute path"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "it is not a normalised relative path (empty, '.' or '..' component)"
    if parts[0] == RESERVED_TOP or ".git" in parts:
        return (
            f"it would write into {RESERVED_TOP if parts[0] == RESERVED_TOP else '.git'}/, "
            "which holds local bookkeeping"
        )
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"it is longer than {MAX_NAME_BYTES} bytes"
    if any(len(p.encode()) > MAX_COMPONENT_BYTES for p in parts):
        return f"a path component is longer than {MAX_COMPONENT_BYTES} bytes"
    return None


def check_remote_name(name: object, source: str) -> str:
    """`name` unchanged if it is a plain relative path; else one error naming it and `source` (who sent it).

    Raises:
        UnsafeNameError: see name_problem.
    """
    why = name_problem(name)
    if why is not None or not isinstance(name, str):  # name_problem refuses every non-str
        raise UnsafeNameError(
            f"{source} lists a file named {name!r}, refused because {why}: a name like that could "
            "write outside DEST; nothing was downloaded or deleted. Check HF_ENDPOINT and the repo",
            filename=name if isinstance(name, str) else None,
        )
    return name


def remote_path(root: Path, name: str, source: str = "the Hub") -> Path:
    """ROOT/name for a name that came from outside: the one place a remote name is joined onto a local directory.

    Raises:
        UnsafeNameError: the name is unsafe, or ROOT/name resolves outside ROOT (a symlink on the way).
    """
    path = Path(root) / check_remote_name(name, source)
    if not is_inside(root, path):
        raise UnsafeNameError(
            f"{path}: the file {name!r} from {source} would land outside {root} (through the symlink "
            f"{_first_link(root, name)}); nothing was downloaded or deleted. Remove that link from {root}",
            path=path,
            filename=name,
        )
    return path


def _first_link(root: Path, name: str) -> Path | None:
    path = Path(root)
    for part in name.split("/"):
        path = path / part
        if path.is_symlink():
            return path
    return None


def refuse_links_leaving(root: Path, names: Iterable[str], *, follow: bool, action: str) -> None:
    """Refuse (unless `follow`) files under ROOT that are, or pass through, a symlink leading outside ROOT.

    `action` says what would have happened to the file ("upload", "quantize"), for the message.

    Raises:
        CheckpointError: naming the first such link, its target and the flag that allows it.
    """
    if follow:
        return
    root = Path(root)
    for name in names:
        path = root / name
        if not is_inside(root, path):
            link = _first_link(root, name) or path
            raise CheckpointError(
                f"{link}: symlink to {os.path.realpath(link)}, outside {root}: refusing to {action} "
                f"what it points to. Copy the file into the checkpoint, or {FOLLOW_HINT}",
                path=link,
            )
