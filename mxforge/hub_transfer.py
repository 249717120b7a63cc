"""One file from the Hub to disk, resumable across runs.

huggingface_hub (1.x) retries a dropped HTTP transfer within a run but deletes the partial file when the
run fails, so a crash at hour three of a 1.5 TB download would start that shard over. For plain-HTTP
files mxforge streams into DEST/.cache/mxforge/download/<name>.<etag>.partial itself and continues it with
`Range: bytes=N-` on the next run, using huggingface_hub's URL, headers (token, user agent), HTTP session,
metadata call and error classes. Files the Hub serves through Xet go to hf_hub_download, whose hf_xet
chunk cache makes a rerun skip what was already fetched.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
from huggingface_hub.utils._runtime import is_xet_available

from .file_hashes import FileHash

PARTIAL_DIR = Path(".cache") / "mxforge" / "download"
RETRIES_WITHOUT_PROGRESS = 3   # consecutive failed attempts that received no byte before giving up
RETRY_SLEEP_S = 0.5
TRANSIENT = (httpx.RemoteProtocolError, httpx.ReadError, httpx.TimeoutException, httpx.ConnectError)


def partial_path(dest: Path, name: str, etag: str) -> Path:
    return dest / PARTIAL_DIR / f"{name}.{etag[:16]}.partial"


class _StreamHash:
    """sha256 and git blob sha1 of a file as it is written, so verifying needs no second read."""

    def __init__(self, size: int):
        self.size = size
        self.reset()

    def reset(self) -> None:
        self.sha256, self.sha1, self.nbytes = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % self.size), 0

    def update(self, chunk: bytes) -> None:
        self.sha256.update(chunk)
        self.sha1.update(chunk)
        self.nbytes += len(chunk)

    def catch_up(self, path: Path, upto: int) -> None:
        """Make the hash cover exactly the first `upto` bytes of path (after a resume or restart)."""
        if self.nbytes == upto:
            return
        self.reset()
        with open(path, "rb") as f:
            while self.nbytes < upto and (chunk := f.read(min(8 << 20, upto - self.nbytes))):
                self.update(chunk)


def fetch_file(repo_id: str, name: str, commit: str, size: int, dest: Path, *, endpoint: str, token,
               bar, hf_tqdm_class) -> FileHash | None:
    """Make DEST/name the file at `commit`, continuing an earlier partial download if one exists.

    Returns the hashes of the bytes written when it streamed the file itself (None when the file was
    already there or went through hf_xet: those are hashed afterwards).

    Raises:
        huggingface_hub errors (RepositoryNotFoundError, GatedRepoError, HfHubHTTPError, ...) and httpx
        transport errors once the retries are spent; the partial file is kept for the next run.
        OSError: the finished file does not have the size the Hub announced.
    """
    target = dest / name
    if target.is_file() and target.stat().st_size == size:
        return None  # finished in an earlier run (the hashes are verified afterwards)
    url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    if meta.xet_file_data is not None and is_xet_available():
        hf_hub_download(repo_id, name, revision=commit, local_dir=dest, endpoint=endpoint, token=token,
                        tqdm_class=hf_tqdm_class)
        return None
    headers = build_hf_headers(token=token)
    location = meta.location or url
    if urlsplit(location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a signed CDN URL: never send the token elsewhere
    partial = partial_path(dest, name, meta.etag or commit)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if partial.exists():
        bar.update(min(partial.stat().st_size, size))  # bytes kept from an earlier run
    failures = 0
    digest = _StreamHash(size)
    while True:
        start = partial.stat().st_size if partial.exists() else 0
        if start > size:
            partial.unlink()
            start = 0
        digest.catch_up(partial, start)
        if start == size:
            break
        got = 0
        try:
            request_headers = {**headers, **({"Range": f"bytes={start}-"} if start else {})}
            with get_session().stream("GET", location, headers=request_headers, follow_redirects=True,
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                hf_raise_for_status(response)
                mode = "ab" if start and response.status_code == 206 else "wb"  # 200: the server ignored Range
                if mode == "wb" and start:
                    bar.update(-start)
                    digest.reset()
                with open(partial, mode) as out:
                    for chunk in response.iter_bytes():
                        out.write(chunk)
                        digest.update(chunk)
                        got += len(chunk)
                        bar.update(len(chunk))
        except TRANSIENT:
            failures = 0 if got else failures + 1
            if failures >= RETRIES_WITHOUT_PROGRESS:
                raise
            time.sleep(RETRY_SLEEP_S)
    target.parent.mkdir(parents=True, exist_ok=True)
    if partial.stat().st_size != size:
        raise OSError(f"{partial}: has {partial.stat().st_size} bytes, the Hub announced {size}")
    with open(partial, "rb+") as f:  # durable before its streamed hash is trusted by reruns and by quantize
        os.fsync(f.fileno())
    os.replace(partial, target)
    return FileHash(name, size, digest.sha256.hexdigest(), digest.sha1.hexdigest())


def kept_partial_bytes(dest: Path) -> int:
    """Bytes of unfinished downloads under DEST that a rerun continues from."""
    return sum(p.stat().st_size for p in (dest / PARTIAL_DIR).rglob("*.partial")) if (dest / PARTIAL_DIR).exists() else 0
