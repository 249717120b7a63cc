"""Content hashes of checkpoint files: sha256 (what the Hub records for LFS files) and git blob sha1
(what it records for regular files), hashed in parallel and cached by (size, mtime) so reruns skip them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mxforge.progress import byte_progress
from mxforge.provenance import LOCAL_ONLY_FILES
from mxforge.safe_paths import refuse_links_leaving
from mxforge.safetensors_io import write_json_atomic

CHUNK = 8 << 20  # hashlib releases the GIL on large updates, so threads hash in parallel
CACHE_NAME = Path(".cache") / "mxforge" / "hashes.json"


@dataclass(frozen=True)
class FileHash:
    name: str  # path relative to the checkpoint root, with '/'
    size: int
    sha256: str
    git_sha1: str  # git blob id of the content (compared with the Hub's blobId for non-LFS files)


class FileDigest:
    """sha256 and git blob sha1 of a file of `size` bytes, fed chunk by chunk: as it is read, or as it is
    written (a download verifies with no second read)."""

    def __init__(self, size: int):
        self.size = size
        self.reset()

    def reset(self) -> None:
        self.sha256, self.sha1, self.nbytes = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % self.size), 0

    def update(self, chunk: bytes) -> None:
        self.sha256.update(chunk)
        self.sha1.update(chunk)
        self.nbytes += len(chunk)

    def catch_up(self, path: Path, upto: int, progress=None) -> None:
        """Make the digest cover exactly the first `upto` bytes of path (after a resume or restart)."""
        if self.nbytes == upto:
            return
        self.reset()
        with open(path, "rb") as f:
            while self.nbytes < upto and (chunk := f.read(min(CHUNK, upto - self.nbytes))):
                self.update(chunk)
                if progress is not None:
                    progress.update(len(chunk))

    def file_hash(self, name: str) -> "FileHash":
        return FileHash(name, self.size, self.sha256.hexdigest(), self.sha1.hexdigest())


def file_hash(path: Path, name: str, progress=None) -> FileHash:
    """The FileHash of the file at `path` (recorded as `name`), in one read pass.

    Raises:
        OSError: the file cannot be read.
    """
    digest = FileDigest(path.stat().st_size)
    digest.catch_up(path, digest.size, progress)
    return digest.file_hash(name)


class HashCache:
    """Hashes of files under `root`, remembered in ROOT/.cache/mxforge/hashes.json by (size, mtime_ns)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.path = self.root / CACHE_NAME
        self._lock = threading.Lock()
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            entries = {}
        # A cache that is not what we wrote is only a cache: start empty, everything is hashed again.
        self._entries: dict[str, dict] = (
            {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}
        )

    def _stamp(self, name: str) -> tuple[int, int]:
        st = (self.root / name).stat()
        return st.st_size, st.st_mtime_ns

    def get(self, name: str) -> FileHash | None:
        entry = self._entries.get(name)
        try:
            if entry and (entry["size"], entry["mtime_ns"]) == self._stamp(name):
                return FileHash(name, entry["size"], entry["sha256"], entry["git_sha1"])
        except (OSError, KeyError):
            pass
        return None

    def put(self, fh: FileHash) -> None:
        size, mtime_ns = self._stamp(fh.name)
        with self._lock:
            self._entries[fh.name] = {"size": size, "mtime_ns": mtime_ns, "sha256": fh.sha256, "git_sha1": fh.git_sha1}

    def forget(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            write_json_atomic(self.path, self._entries)


def hash_files(
    root: Path, names: list[str], *, workers: int = 8, quiet: bool = False, desc: str = "sha256", use_cache: bool = True
) -> dict[str, FileHash]:
    """Hash `names` (relative to root) in parallel, reusing cached hashes of unchanged files.

    `use_cache=False` re-reads every byte and neither consults nor writes the cache (a check that must
    not trust (size, mtime), e.g. `validate --deep`, in a directory it should not modify).

    Raises:
        OSError: a file cannot be read.
    """
    root = Path(root)
    cache = HashCache(root) if use_cache else None
    out = {n: h for n in names if cache is not None and (h := cache.get(n)) is not None}
    todo = [n for n in names if n not in out]
    total = sum((root / n).stat().st_size for n in todo)
    with byte_progress(total, desc, disable=quiet or not todo) as bar:

        def one(name: str) -> FileHash:
            fh = file_hash(root / name, name, bar)
            if cache is not None:
                cache.put(fh)
            return fh

        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo) or 1))) as pool:
            for fh in pool.map(one, todo):
                out[fh.name] = fh
    if todo and cache is not None:
        cache.save()
    return {n: out[n] for n in names}


# Bookkeeping that stays on the machine that made it: quantize's resume state is meaningless elsewhere, and
# fixup's backups of config.json and the index are for undoing a fixup here, not for publishing (push,
# validate's integrity and hash checks all list files through checkpoint_files, so they agree).


def checkpoint_files(root: Path, follow_symlinks: bool = False) -> list[str]:
    """Every file under root that belongs to the checkpoint: not .cache/, .git/, unfinished *.partial or
    local-only bookkeeping (LOCAL_ONLY_FILES).

    A symlink (to a file or a directory) that leads outside root is refused unless `follow_symlinks`; links
    that stay inside are read through (directories included).

    Raises:
        CheckpointError: a symlink leading outside root, naming it and its target.
    """
    root = Path(root)
    out = []
    seen = {os.path.realpath(root)}  # a link to a directory already walked (a loop, an alias) is not walked again
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in (".cache", ".git")]
        refuse_links_leaving(
            root, [(rel_dir / d).as_posix() for d in dirnames], follow=follow_symlinks, action="upload"
        )
        real = {d: os.path.realpath(os.path.join(dirpath, d)) for d in dirnames}
        dirnames[:] = [d for d in dirnames if real[d] not in seen]
        seen.update(real.values())
        for f in filenames:
            if not f.endswith(".partial") and not (rel_dir == Path(".") and f in LOCAL_ONLY_FILES):
                out.append((rel_dir / f).as_posix())
    refuse_links_leaving(root, out, follow=follow_symlinks, action="upload")
    return sorted(out)


FileStamp = tuple[int, int, int]  # (size, mtime_ns, inode): changes whenever a file is rewritten or replaced


def snapshot(root: Path, names: list[str]) -> dict[str, FileStamp]:
    """The stamp of each named file (following symlinks), to tell later whether any of them changed.

    Raises:
        OSError: a file cannot be stat'ed.
    """
    out = {}
    for name in names:
        st = (Path(root) / name).stat()
        out[name] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out
