"""An advisory lock on a working directory (OUT, DEST, CKPT), so that two mxforge processes never work in
the same one: the second would delete the first one's partial files and interleave their outputs.

`fcntl.flock` on DIR/.cache/mxforge/lock, which holds the owner's pid. The kernel releases the lock when
the process ends, however it ends (kill -9 included), so a stale lock file never blocks a rerun.

The lock is re-entrant on the thread that holds it: `mxforge run` holds OUT/mxfp4's lock for the whole run, and
the quantize, fixup and push stages it calls take it again. Any other thread or process is refused.
"""

from __future__ import annotations

import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mxforge.errors import DirectoryInUse, MxforgeError

LOCK_NAME = Path(".cache") / "mxforge" / "lock"
_held: dict[str, tuple[int, int]] = {}  # lock file's real path -> (holding thread's ident, depth), this process
_held_guard = threading.Lock()


@contextmanager
def directory_lock(directory: str | os.PathLike) -> Iterator[None]:
    """Hold DIRECTORY's lock for the duration of the block (creating the directory if needed).

    Raises:
        DirectoryInUse: another process holds it, naming its pid.
        OSError: the directory or the lock file cannot be created (read-only, full...).
    """
    path = Path(directory) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    key, me = os.path.realpath(path), threading.get_ident()
    with _held_guard:
        holder, depth = _held.get(key, (None, 0))
        if holder == me:
            _held[key] = (me, depth + 1)
    if holder == me:
        try:
            yield
        finally:
            with _held_guard:
                _held[key] = (me, _held[key][1] - 1)
        return
    if holder is not None:
        raise DirectoryInUse(
            f"{directory}: in use by this process (pid {os.getpid()}, another of its threads holds {path})",
            path=Path(directory),
            pid=os.getpid(),
        )
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise DirectoryInUse(
                f"{directory}: in use by pid {owner} (another mxforge process holds {path}); wait "
                "for it to finish or stop it, then rerun",
                path=Path(directory),
                pid=int(owner) if owner.isdigit() else None,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        with _held_guard:
            _held[key] = (me, 1)
        try:
            yield
        finally:
            with _held_guard:
                _held.pop(key, None)
    finally:
        os.close(fd)  # releases the lock


def check_out_dir(src: Path, out: Path, marker: str, command: str) -> None:
    """OUT must be new, empty, or a previous output of `command`, which leaves `marker` in it (to resume or redo).

    Unfinished *.partial files are never results (a kill during the first state write leaves only one), and
    .cache holds the lock of a run that started there.

    Raises:
        MxforgeError: OUT is SRC, not a directory, or holds something else.
    """
    if out.resolve() == src.resolve():
        raise MxforgeError(f"{out}: OUT is the source checkpoint; choose another directory", path=out)
    if out.exists():
        if not out.is_dir():
            raise MxforgeError(f"{out}: exists and is not a directory; choose another OUT", path=out)
        if (
            any(not p.name.endswith(".partial") and p.name != LOCK_NAME.parts[0] for p in out.iterdir())
            and not (out / marker).exists()
        ):
            raise MxforgeError(
                f"{out}: not empty and not a previous `mxforge {command}` output (no {marker}); "
                "choose a new or empty OUT",
                path=out,
            )
