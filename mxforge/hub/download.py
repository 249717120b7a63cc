"""`mxforge download`: fetch a Hub repo at one resolved commit, resumably, and verify every byte.

1. Resolve the revision to a commit sha and read every file's size and hash from the Hub's metadata.
2. Refuse before downloading anything if DEST's filesystem cannot hold the files still missing.
3. Download each file through huggingface_hub (see hub_transfer: hf_xet where the Hub offers it; plain
   HTTP otherwise, into DEST/.cache/mxforge/download/*.partial, continued with Range on rerun).
4. Hash every file (as it streams in, else by reading it back) and compare with the Hub's metadata: sha256 for LFS
   files, the git blob id for the rest. A downloaded file that does not match is deleted (so a rerun fetches it
   again) and named in the error; a file already in DEST that does not match (another revision, damage) is replaced.
5. Write DEST/mxforge_source.json: repo, revision, commit sha, endpoint, files with size and sha256, command.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects, httpx

from mxforge.dir_lock import directory_lock
from mxforge.disk_space import require_free_space
from mxforge.errors import HubVerificationError, MxforgeError
from mxforge.file_hashes import FileHash, HashCache, file_hash, hash_files
from mxforge.hub.api import repo_info
from mxforge.hub.errors import check_repo_id, checked_commit, hub_endpoint, raise_as_hub_error
from mxforge.hub.session import HubLimits, fresh_connections, use_hub_limits
from mxforge.hub.transfer import CANCEL, PARTIAL_DIR, fetch_file, kept_partial_bytes
from mxforge.progress import byte_progress, format_bytes
from mxforge.provenance import SOURCE_NAME, recorded_command
from mxforge.records import fields_of
from mxforge.redaction import redact
from mxforge.safe_paths import check_remote_name, remote_path
from mxforge.safetensors_io import write_json_atomic

HF_DOWNLOAD_DIR = Path(".cache") / "huggingface" / "download"


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # the LFS sha256 (None: a regular git file)
    blob_id: str | None  # the git blob id (of the LFS pointer for LFS files)

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None


@dataclass
class DownloadResult:
    dest: Path
    repo_id: str
    revision: str
    commit: str
    endpoint: str
    files: list[dict] = field(default_factory=list)
    downloaded_bytes: int = 0

    def as_dict(self) -> dict:
        return {
            "stage": "download",
            **fields_of(self, "dest", "repo_id", "revision", "commit", "endpoint"),
            "files": len(self.files),
            "bytes": sum(f["size"] for f in self.files),
            "downloaded_bytes": self.downloaded_bytes,
            "verified": True,
        }


def remote_files(
    api: HfApi, repo_id: str, revision: str, limits: HubLimits | None = None
) -> tuple[str, list[RemoteFile]]:
    """(commit sha, files with size and hashes) of a repo at a revision (api.repo_info: retried, bounded).

    Raises:
        HubError: missing/gated repo, unknown revision, unreachable Hub, no answer in time (hub_session), a list
            longer than api.MAX_LISTED_FILES.
        MxforgeError: the metadata lists a file twice or with a negative size.
    """
    limits = limits or HubLimits.resolve()
    info = repo_info(api, repo_id, revision, limits, files_metadata=True, action="read the file list of")
    files = [
        RemoteFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings or []
    ]
    seen: set[str] = set()
    for f in files:
        if f.name in seen or f.size < 0:
            raise MxforgeError(
                f"{repo_id}@{revision}: the Hub lists file {f.name!r} "
                f"{'twice' if f.name in seen else f'with size {f.size}'}; nothing was downloaded. "
                "Check HF_ENDPOINT and the repo",
                repo_id=repo_id,
            )
        seen.add(f.name)
    return checked_commit(info.sha, f"{repo_id}@{revision}"), files


def select(files: list[RemoteFile], include: list[str] | None, exclude: list[str] | None) -> list[RemoteFile]:
    """The files matching any --include glob (all if none) and no --exclude glob."""
    names = set(
        filter_repo_objects([f.name for f in files], allow_patterns=include or None, ignore_patterns=exclude or None)
    )
    return [f for f in files if f.name in names]


def check_disk_space(dest: Path, files: list[RemoteFile]) -> int:
    """Bytes still to download; refuse when DEST's filesystem has less free space than that.

    Files already at their full size count as present (they are verified afterwards); bytes kept from
    an interrupted download are not subtracted, so the check errs on the safe side.

    Raises:
        DiskSpaceError: not enough free space, naming the need, the free space and the largest file.
    """
    missing = [f for f in files if not _is_full_size(dest, f)]
    needed = sum(f.size for f in missing)
    if missing:
        largest = max(missing, key=lambda f: f.size)
        require_free_space(
            dest,
            needed,
            what=f"{len(missing)} file(s)",
            remedy="free space or choose another DEST; nothing was downloaded",
            detail=f" (largest: {largest.name}, {format_bytes(largest.size)})",
        )
    return needed


def _bar_proxy(bar):
    """A tqdm stand-in class that huggingface_hub instantiates per file; it feeds one shared byte bar."""

    class FileBar:
        def __init__(self, *args, **kwargs):
            if kwargs.get("initial"):
                bar.update(kwargs["initial"])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            bar.update(n or 0)

        def update_transfer(self, n=1):
            pass

        def set_postfix_str(self, *args, **kwargs):
            pass

        def close(self):
            pass

    return FileBar


def _fetch(
    api: HfApi, repo_id: str, commit: str, dest: Path, f: RemoteFile, limits: HubLimits, bar, file_bar
) -> FileHash | None:
    """hub_transfer.fetch_file for one file of repo_id@commit, from the api's endpoint with its token."""
    return fetch_file(
        repo_id,
        f.name,
        commit,
        f.size,
        dest,
        endpoint=api.endpoint,
        token=api.token,
        limits=limits,
        bar=bar,
        hf_tqdm_class=file_bar,
    )


def _fetch_all(
    api: HfApi,
    repo_id: str,
    commit: str,
    dest: Path,
    files: list[RemoteFile],
    needed: int,
    limits: HubLimits,
    workers: int,
    quiet: bool,
) -> None:
    """Download every file (skipping finished ones); raise the first failure after all others finished.

    Raises:
        HubError: a file could not be downloaded (its partial bytes are kept for a rerun).
        OversizeBody: the Hub sent more bytes than a file's declared size.
        KeyboardInterrupt: Ctrl-C; every transfer stops at its next chunk, partial files are kept.
    """
    cache = HashCache(dest)  # hashes taken while streaming: the verify pass then reads nothing again
    CANCEL.clear()
    with byte_progress(needed, "download", disable=quiet) as bar:
        file_bar = _bar_proxy(bar)

        def one(f: RemoteFile) -> Exception | None:
            try:
                streamed = _fetch(api, repo_id, commit, dest, f, limits, bar, file_bar)
                if streamed is not None:
                    cache.put(streamed)
                return None
            except Exception as e:  # collected, mapped below
                return e

        pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(files))))
        try:
            futures = [pool.submit(one, f) for f in files]
            # Wait in short slices, as quantize and stream do: a Ctrl-C the kernel delivers to a download thread
            # reaches Python only when the main thread runs again, which a blocking wait would delay until a
            # stalled read times out.
            while wait(futures, timeout=0.2).not_done:
                pass
            failures = [(f, e) for f, e in zip(files, (fu.result() for fu in futures)) if e is not None]
        except KeyboardInterrupt:
            CANCEL.set()  # transfers stop at their next chunk; the process exits without waiting for them
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    cache.save()
    if failures:
        f, e = failures[0]
        _raise_download_failure(
            repo_id, commit, dest, f, e, f" ({len(failures) - 1} other file(s) failed too)" if len(failures) > 1 else ""
        )


def _raise_download_failure(
    repo_id: str, commit: str, dest: Path, f: RemoteFile, e: Exception, others: str = ""
) -> None:
    """Raise the one-line error for a file whose download failed with `e` (`others`: how many more failed).

    Raises:
        MxforgeError (HubError and the others of hub_errors, OversizeBody...): always.
    """
    kept = f"; {format_bytes(kept_partial_bytes(dest))} of unfinished downloads are kept in {dest / PARTIAL_DIR}"
    if isinstance(e, MxforgeError):
        raise e.with_message(
            redact(f"{repo_id}@{commit[:12]}: {e}{others}"), repo_id=repo_id, revision=commit, filename=f.name
        ) from None
    if isinstance(e, OSError) and "Consistency check failed" in str(e):  # hf_hub_download's (Xet files)
        e = httpx.RemoteProtocolError("the server sent fewer bytes than the file's size")
    try:
        raise_as_hub_error(e, repo_id=repo_id, revision=commit, filename=f.name, action="download")
    except MxforgeError as mapped:
        raise mapped.with_message(f"{mapped}{others}{kept}") from None
    raise MxforgeError(
        redact(
            f"{repo_id} file {f.name!r}: download failed ({type(e).__name__}: {e}){others}"
            f"{kept}; rerun the same command to resume"
        ),
        repo_id=repo_id,
        revision=commit,
        filename=f.name,
    ) from None


def fetch_verified(
    api: HfApi, repo_id: str, commit: str, dest: Path, f: RemoteFile, limits: HubLimits, bar=None
) -> FileHash:
    """One file into DEST (continuing a partial download, or taking a full-size file already there) checked
    against the Hub's hash; returns its hashes. `bar`: a shared byte progress bar, or None. `f.name` must have
    passed check_remote_name. The streamed run (mxforge run --stream) fetches shard by shard with it.

    Raises:
        HubError, OversizeBody, ...: as `download` (the partial file is kept for a rerun).
        HubVerificationError: the bytes do not hash to the Hub's metadata (the file is deleted).
        KeyboardInterrupt: CANCEL was set.
    """
    bar = bar if bar is not None else byte_progress(0, f.name, disable=True)
    try:
        got = _fetch(api, repo_id, commit, dest, f, limits, bar, _bar_proxy(bar))
    except KeyboardInterrupt:
        raise
    except Exception as e:
        _raise_download_failure(repo_id, commit, dest, f, e)
    path = remote_path(dest, f.name)
    if got is None:
        got = file_hash(path, f.name)
    why = _mismatch(f, got)
    if why is not None:
        path.unlink(missing_ok=True)
        raise HubVerificationError(
            f"{dest}: {why}; the file was deleted: rerun the same command to download it "
            "again; if it happens again, the Hub or a proxy serves corrupt bytes",
            path=path,
            repo_id=repo_id,
            revision=commit,
            filename=f.name,
        )
    return got


def _mismatch(f: RemoteFile, h: FileHash) -> str | None:
    """How a local file's hashes differ from the Hub's record of it (None: they agree)."""
    if f.sha256 is not None:  # an LFS file
        if h.sha256 != f.sha256 or h.size != f.size:
            return (
                f"{f.name}: sha256 {h.sha256[:12]}… ({h.size:,} bytes), "
                f"the Hub says {f.sha256[:12]}… ({f.size:,} bytes)"
            )
    elif f.blob_id and h.git_sha1 != f.blob_id:
        return f"{f.name}: git blob id {h.git_sha1[:12]}…, the Hub says {f.blob_id[:12]}…"
    return None


def _mismatches(dest: Path, files: list[RemoteFile], workers: int, quiet: bool, desc: str) -> tuple[dict, list[str]]:
    """Hash files (cached by size and mtime) and compare with the Hub; delete those that differ.

    Returns (hashes, one description per deleted file).
    """
    hashes = hash_files(dest, [f.name for f in files], workers=workers, quiet=quiet, desc=desc)
    bad = {f.name: why for f in files if (why := _mismatch(f, hashes[f.name])) is not None}
    if bad:
        cache = HashCache(dest)
        for name in bad:
            remote_path(dest, name).unlink(missing_ok=True)
            remote_path(dest / HF_DOWNLOAD_DIR, f"{name}.metadata").unlink(missing_ok=True)
            cache.forget(name)
        cache.save()
    return hashes, list(bad.values())


def _is_full_size(dest: Path, f: RemoteFile) -> bool:
    path = remote_path(dest, f.name)
    return path.is_file() and path.stat().st_size == f.size


def download(
    repo_id: str,
    dest: str | Path,
    *,
    revision: str = "main",
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    workers: int = 8,
    quiet: bool = False,
    command: str | None = None,
    limits: HubLimits | None = None,
) -> DownloadResult:
    """Download, verify and record a Hub repo at a revision into DEST (see the module docstring).

    Holds DEST's lock (dir_lock) throughout. `limits`: timeouts and retries (default: HubLimits.resolve()).

    Raises:
        HubError: missing/gated repo, unknown revision, unreachable or silent Hub, dropped connection or a
            file that stopped progressing (rerun resumes).
        UnsafeNameError: the Hub lists a file name that is not a plain relative path inside DEST (checked
            for every selected file before anything is written or deleted).
        DiskSpaceError: DEST cannot hold the files (checked before any download).
        HubVerificationError: a downloaded file does not hash to the Hub's metadata.
        DirectoryInUse: another mxforge process works in DEST.
        MxforgeError: no file matches the filters, or DEST is not a directory.
    """
    dest = Path(dest)
    check_repo_id(repo_id)
    if dest.exists() and not dest.is_dir():
        raise MxforgeError(f"{dest}: exists and is not a directory; pass a directory for DEST", path=dest)
    limits = limits or HubLimits.resolve()
    use_hub_limits(limits)
    fresh_connections()
    api = HfApi()
    commit, files = remote_files(api, repo_id, revision, limits)
    chosen = select(files, include, exclude)
    if not chosen:
        raise MxforgeError(
            f"{repo_id}@{revision}: none of its {len(files)} files match --include {include or '*'} "
            f"--exclude {exclude or '(none)'}; widen the filters",
            repo_id=repo_id,
        )
    for f in chosen:  # before any filesystem call that uses a name
        check_remote_name(f.name, f"{repo_id}@{revision}")
    check_disk_space(dest, chosen)
    with directory_lock(dest):
        return _download_into(
            api, repo_id, revision, commit, dest, chosen, include, exclude, limits, workers, quiet, command
        )


def _download_into(
    api: HfApi,
    repo_id: str,
    revision: str,
    commit: str,
    dest: Path,
    chosen: list[RemoteFile],
    include,
    exclude,
    limits: HubLimits,
    workers: int,
    quiet: bool,
    command: str | None,
) -> DownloadResult:
    # Files already there at full size (an earlier run, another revision) are checked first and replaced if stale.
    _, stale = _mismatches(dest, [f for f in chosen if _is_full_size(dest, f)], workers, quiet, "check existing")
    if stale and not quiet:
        print(
            f"mxforge download: replacing {len(stale)} existing file(s) that differ from {repo_id}@{commit[:12]}",
            file=sys.stderr,
        )
    todo = [f for f in chosen if not _is_full_size(dest, f)]
    if todo:
        _fetch_all(api, repo_id, commit, dest, todo, sum(f.size for f in todo), limits, workers, quiet)
    hashes, bad = _mismatches(dest, todo, workers, quiet, "verify")
    if bad:
        raise HubVerificationError(
            f"{dest}: {len(bad)} downloaded file(s) do not match the Hub's metadata and were deleted: "
            f"{'; '.join(bad)}: rerun the same command to download them again; "
            "if it happens again, the Hub or a proxy serves corrupt bytes",
            path=dest,
            repo_id=repo_id,
            revision=commit,
        )
    hashes = hash_files(dest, [f.name for f in chosen], workers=workers, quiet=True)  # all cached by now
    result = DownloadResult(dest, repo_id, revision, commit, hub_endpoint(), downloaded_bytes=sum(f.size for f in todo))
    result.files = [source_record_entry(f, hashes[f.name]) for f in chosen]
    write_source_record(
        dest,
        repo_id=repo_id,
        revision=revision,
        commit=commit,
        files=result.files,
        include=include,
        exclude=exclude,
        command=command,
    )
    return result


def source_record_entry(f: RemoteFile, h: FileHash) -> dict:
    """One file's entry in mxforge_source.json."""
    return {"name": f.name, "size": h.size, "sha256": h.sha256, "lfs": f.is_lfs}


def write_source_record(
    dest: Path,
    *,
    repo_id: str,
    revision: str,
    commit: str,
    files: list[dict],
    include: list[str] | None,
    exclude: list[str] | None,
    command: str | None,
) -> None:
    """DEST/mxforge_source.json: where the checkpoint came from, and every file's size and sha256."""
    write_json_atomic(
        dest / SOURCE_NAME,
        {
            "repo_id": repo_id,
            "revision": revision,
            "commit": commit,
            "endpoint": hub_endpoint(),
            "include": include or [],
            "exclude": exclude or [],
            "files": files,
            "command": recorded_command(command),
        },
    )
