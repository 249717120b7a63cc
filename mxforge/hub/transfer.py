"""One file from the Hub to disk, resumable across runs, with byte and time limits.

huggingface_hub (1.x) retries a dropped HTTP transfer within a run but deletes the partial file when the
run fails, so a crash at hour three of a 1.5 TB download would start that shard over. For plain-HTTP
files mxforge streams into DEST/.cache/mxforge/download/<name>.<etag hash>.partial itself and continues it
with `Range: bytes=N-` on the next run, using huggingface_hub's URL, headers (token, user agent), HTTP
session, metadata call and error classes. Files the Hub serves through Xet go to hf_hub_download, whose
hf_xet chunk cache makes a rerun skip what was already fetched.

Limits (a Hub is not trusted to behave): never more bytes on disk than the size the Hub's metadata
declared (more aborts the file); a response that ends short of what was asked is a failed attempt; an
attempt that adds no new byte to the partial file counts towards `HubLimits.retries` (with backoff
between attempts), and a file that gains no byte for `HubLimits.no_progress_deadline` seconds is given
up, even in the middle of a response. A server that ignores `Range` is read past the bytes already kept.
`CANCEL` (set on Ctrl-C) stops every transfer at its next chunk; partial files stay for the rerun.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status, httpx
from huggingface_hub.utils._runtime import is_xet_available

from mxforge.errors import HubError, OversizeBody
from mxforge.file_hashes import FileDigest, FileHash
from mxforge.hub.session import CANCEL, HubLimits, failed_attempt, is_transient, retrying
from mxforge.progress import format_bytes
from mxforge.safe_paths import remote_path

PARTIAL_DIR = Path(".cache") / "mxforge" / "download"
OVERSIZE_ADVICE = "the partial file was deleted and nothing more is written. Check HF_ENDPOINT and the repo"


class _FailedAttempt(Exception):
    """One attempt ended without the whole file (short or odd response); retried within the limits."""


class _Cancelled(Exception):
    """CANCEL was set: stop now, keep the partial file."""


def partial_path(dest: Path, name: str, etag: str) -> Path:
    """Where a file is streamed until complete; the ETag (the Hub's, untrusted) only as a hash."""
    return remote_path(dest / PARTIAL_DIR, f"{name}.{hashlib.sha256(etag.encode()).hexdigest()[:16]}.partial")


def fetch_file(
    repo_id: str,
    name: str,
    commit: str,
    size: int,
    dest: Path,
    *,
    endpoint: str,
    token,
    limits: HubLimits,
    bar,
    hf_tqdm_class,
) -> FileHash | None:
    """Make DEST/name the file at `commit`, continuing an earlier partial download if one exists.

    `name` must have passed safe_paths.check_remote_name (download checks every name first). The token
    goes only to HF_ENDPOINT's exact origin (hub_session's client drops it on any other, e.g. a CDN).
    Returns the hashes of the bytes written when it streamed the file itself (None when the file was
    already there or went through hf_xet: those are hashed afterwards).

    Raises:
        huggingface_hub errors (RepositoryNotFoundError, GatedRepoError, HfHubHTTPError, ...) and httpx
        transport errors from the metadata request.
        OversizeBody: the Hub sent more than `size` bytes (the partial file is deleted).
        HubError: the retries or the no-progress deadline are spent (the partial file is kept).
        KeyboardInterrupt: CANCEL was set (the partial file is kept).
    """
    target = remote_path(dest, name)
    if target.is_file() and target.stat().st_size == size:
        return None  # finished in an earlier run (the hashes are verified afterwards)
    url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint)
    meta = retrying(
        lambda: get_hf_file_metadata(url, token=token, endpoint=endpoint, timeout=limits.metadata_timeout), limits
    )
    if meta.xet_file_data is not None and is_xet_available():
        hf_hub_download(
            repo_id,
            name,
            revision=commit,
            local_dir=dest,
            endpoint=endpoint,
            token=token,
            tqdm_class=hf_tqdm_class,
            etag_timeout=limits.metadata_timeout,
        )
        return None
    partial = partial_path(dest, name, meta.etag or commit)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if partial.exists() and partial.stat().st_size > size:
        partial.unlink()  # not ours to continue: longer than the file can be
    kept = partial.stat().st_size if partial.exists() else 0
    bar.update(kept)  # bytes kept from an earlier run
    digest = FileDigest(size)
    stream = _Stream(name, size, partial, meta.location or url, build_hf_headers(token=token), limits, bar, digest)
    stream.run()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "rb+") as f:  # durable before its streamed hash is trusted by reruns and by quantize
        os.fsync(f.fileno())
    os.replace(partial, target)
    return digest.file_hash(name)


class _Stream:
    """The attempts at one file's bytes, within `limits`, appending to `partial` until it holds `size` bytes."""

    def __init__(
        self,
        name: str,
        size: int,
        partial: Path,
        location: str,
        headers: dict,
        limits: HubLimits,
        bar,
        digest: FileDigest,
    ):
        self.name, self.size, self.partial, self.location, self.headers = name, size, partial, location, headers
        self.limits, self.bar, self.digest = limits, bar, digest
        self.last_growth = time.monotonic()

    def have(self) -> int:
        return self.partial.stat().st_size if self.partial.exists() else 0

    def run(self) -> None:
        failures, why = 0, ""
        while (start := self.have()) < self.size:
            self.digest.catch_up(self.partial, start)
            try:
                self._attempt(start)
                continue
            except _FailedAttempt as e:
                why = str(e)
            except _Cancelled:
                raise KeyboardInterrupt from None
            except OversizeBody:
                self.partial.unlink(missing_ok=True)
                raise
            except Exception as e:  # a dropped or silent connection, an HTTP 5xx: another attempt; else raised
                if not is_transient(e):
                    raise
                why = failed_attempt(e)
            failures = 0 if self.have() > start else failures + 1  # only attempts that bring nothing count
            stalled = time.monotonic() - self.last_growth
            if failures > self.limits.retries or stalled > self.limits.no_progress_deadline:
                raise HubError(
                    f"file {self.name!r}: no new byte in {failures} attempt(s) over {stalled:.0f} s "
                    f"(last: {why}); {format_bytes(self.have())} of {format_bytes(self.size)} are kept in "
                    f"{self.partial}: rerun the same command to resume; on a slow link raise --timeout "
                    "or --retries",
                    filename=self.name,
                    path=self.partial,
                )
            if CANCEL.wait(self.limits.backoff(failures)):
                raise KeyboardInterrupt
        self.digest.catch_up(self.partial, self.size)  # a partial file that was already whole: hash what is there

    def _attempt(self, start: int) -> None:
        """One request for the bytes from `start`; appends what it gets (at most up to `size`).

        Raises:
            _FailedAttempt: the response ended before the end of the file, or answered another range.
            OversizeBody: the response is longer than the file's declared size.
            httpx transport errors; _Cancelled.
        """
        headers = {**self.headers, **({"Range": f"bytes={start}-"} if start else {})}
        with get_session().stream(
            "GET", self.location, headers=headers, follow_redirects=True, timeout=self.limits.data_timeout
        ) as response:
            hf_raise_for_status(response)
            offset = self._body_offset(response, start)  # where the body's first byte belongs in the file
            announced = response.headers.get("Content-Length")
            if announced is not None and announced.isdigit() and offset + int(announced) > self.size:
                raise OversizeBody(
                    f"file {self.name!r}: the Hub announces {offset + int(announced):,} bytes, more "
                    f"than the {self.size:,} bytes its metadata declared; {OVERSIZE_ADVICE}",
                    filename=self.name,
                )
            skip = start - offset  # a server that ignored Range resends what we have: read past it
            with open(self.partial, "ab") as out:
                for chunk in response.iter_bytes():
                    if CANCEL.is_set():
                        raise _Cancelled
                    if skip:
                        chunk, skip = chunk[skip:], max(0, skip - len(chunk))
                    if chunk:
                        self._append(out, chunk)
                    elif time.monotonic() - self.last_growth > self.limits.no_progress_deadline:
                        raise _FailedAttempt(f"no new byte for {self.limits.no_progress_deadline:.0f} s")
        got = self.have()
        if got < self.size:
            raise _FailedAttempt(f"the response ended at byte {got:,} of {self.size:,}")

    def _append(self, out, chunk: bytes) -> None:
        written = out.tell()
        if written + len(chunk) > self.size:
            raise OversizeBody(
                f"file {self.name!r}: the Hub sent more than the {self.size:,} bytes its metadata "
                f"declared; {OVERSIZE_ADVICE}",
                filename=self.name,
            )
        out.write(chunk)
        self.digest.update(chunk)
        self.bar.update(len(chunk))
        self.last_growth = time.monotonic()

    @staticmethod
    def _body_offset(response: httpx.Response, start: int) -> int:
        """0 for a whole-file answer (200), `start` for the range asked; any other range is a failed attempt."""
        if response.status_code != 206:
            return 0
        content_range = response.headers.get("Content-Range", "")
        if not content_range.startswith(f"bytes {start}-"):
            raise _FailedAttempt(
                f"asked for bytes from {start:,}, the Hub answered {content_range or 'no Content-Range'}"
            )
        return start


def partial_bytes_by_file(dest: Path) -> dict[str, int]:
    """Bytes of each unfinished download under DEST, by the name of the file it becomes (partial_path's suffix
    removed; one finished meanwhile is left out)."""
    root = dest / PARTIAL_DIR
    found: dict[str, int] = {}
    for p in root.rglob("*.partial") if root.exists() else ():
        try:
            size = p.stat().st_size
        except FileNotFoundError:  # renamed into place since it was listed
            continue
        name = p.relative_to(root).as_posix().removesuffix(".partial").rsplit(".", 1)[0]  # drop ".<etag hash>"
        found[name] = found.get(name, 0) + size
    return found


def kept_partial_bytes(dest: Path) -> int:
    """Bytes of unfinished downloads under DEST that a rerun continues from."""
    return sum(partial_bytes_by_file(dest).values())
