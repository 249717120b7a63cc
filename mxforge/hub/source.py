"""A checkpoint on the Hub, read the way validate needs it: config.json, the index and each shard's header.

`HubSource` resolves the revision (a branch, tag, `refs/pr/N` or commit) to one commit, then reads every
file at that commit, so a push in the middle cannot mix two versions. A shard's header takes two ranged
GETs: its first 8 bytes (the header length; the `Content-Range` total gives the file size), then the
header itself. Nothing else of a shard is read: on GLM-5.2 that is a few MB of 400 GB.

Limits (a Hub is not trusted to behave):
- a header length above safetensors' own limit (100 MB), or beyond the file, is refused before its bytes
  are asked for; config.json and the index may be at most `MAX_JSON_BYTES`;
- a server that ignores `Range` (200, the whole file) is read only as far as the bytes wanted, then the
  connection is dropped: a multi-GB shard is never downloaded;
- a body shorter than asked (truncated), a dropped or silent connection and an HTTP 5xx / 429 are failed
  attempts, retried `HubLimits.retries` times with backoff (repo info too: api.repo_info); every read has
  `HubLimits.data_timeout`, and a file whose bytes are not all in within `HubLimits.no_progress_deadline` is
  given up;
- the token goes only to HF_ENDPOINT's exact origin (hub_session), also across a redirect to a CDN.

What was read is cached by commit sha under `<cache>/hub-headers` (cache_dir.cache_root: $MXFORGE_CACHE, else the
user cache dir): a commit's files never change, so a second validate or fixup of the same commit fetches nothing.
Names from the server become cache paths only through safe_paths.remote_path.
"""

from __future__ import annotations

import hashlib
import re
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status, httpx

from mxforge.cache_dir import cache_root
from mxforge.checkpoint import CheckpointSource
from mxforge.errors import CheckpointError, HubError, MxforgeError
from mxforge.hub.api import repo_info
from mxforge.hub.errors import check_repo_id, checked_commit, hub_endpoint, raise_as_hub_error
from mxforge.hub.session import HubLimits, failed_attempt, is_transient, use_hub_limits
from mxforge.json_input import MAX_JSON_BYTES, loads
from mxforge.progress import format_bytes
from mxforge.safe_paths import remote_path
from mxforge.safetensors_io import ShardHeader, header_length, parse_header, write_bytes_atomic

E = TypeVar("E", bound=MxforgeError)

CHUNK = 64 << 10  # read granularity: what a Range-ignoring server can make us read past the wanted bytes
PARALLEL_READS = 8  # header reads in flight at once (each is two round trips, more behind a CDN redirect)
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class _ShortRead(Exception):
    """One attempt ended without all the bytes asked for; retried within the limits."""


class HubSource(CheckpointSource):
    """A Hub model repo at one commit, read through ranged GETs of config.json, the index and shard headers.

    Raises (constructor):
        HubError: malformed repo id, missing/gated repo, unknown revision, unreachable Hub, or a commit id
            from the server that is not a sha.
    """

    def __init__(
        self,
        repo_id: str,
        revision: str | None = None,
        limits: HubLimits | None = None,
        cache_dir: str | Path | None = None,
    ):
        check_repo_id(repo_id)
        self.repo_id, self.revision = repo_id, revision or "main"
        self.limits = limits or HubLimits.resolve()
        use_hub_limits(self.limits)
        self.api = HfApi()
        self.endpoint = hub_endpoint()
        info = repo_info(self.api, repo_id, self.revision, self.limits, action="read the file list of")
        self.commit = checked_commit(info.sha, f"{repo_id}@{self.revision}")
        self.names = {s.rfilename for s in info.siblings or [] if isinstance(s.rfilename, str)}
        self.label = repo_id if self.revision == "main" else f"{repo_id}@{self.revision}"
        self.model_path = repo_id
        key = hashlib.sha256(self.endpoint.encode()).hexdigest()[:16]
        self.cache = Path(cache_dir or cache_root() / "hub-headers") / key / repo_id / self.commit
        self.fetched = 0  # bytes received from the Hub by this source
        self.requests = 0  # ranged GETs sent
        self.file_sizes: dict[str, int] = {}  # size of every file read, from the Hub's answers (or the cache)
        self._prefetched: dict[str, ShardHeader | MxforgeError] = {}
        self._count = threading.Lock()

    # --- CheckpointSource ---------------------------------------------------------------------------
    def where(self, name: str) -> str:
        return f"{self.label}:{name}"

    def _error(self, cls: type[E], name: str, message: str) -> E:
        """`cls` (HubError or CheckpointError) about file `name` at this commit: "<repo>@<commit>:<name>: message"."""
        return cls(f"{self.where(name)}: {message}", filename=name, repo_id=self.repo_id, revision=self.commit)

    def exists(self, name: str) -> bool:
        return name in self.names

    def check_opened(self) -> None:
        if "config.json" not in self.names:
            raise CheckpointError(
                f"{self.label}: the repo has no config.json at commit {self.commit[:12]}, so it is not "
                "a Hugging Face checkpoint"
            )

    def file_names(self) -> list[str]:
        return sorted(n for n in self.names if "/" not in n)

    def read_json(self, name: str, what: str, object_pairs_hook=None) -> Any:
        cached = self._cache_path("files", name)
        if not cached.exists():
            raw, _ = self._read_range(name, 0, MAX_JSON_BYTES, whole=True)
            self._store(cached, raw)
        raw = cached.read_bytes()
        self.file_sizes[name] = len(raw)
        return loads(raw, self.where(name), what, object_pairs_hook)

    def prefetch_headers(self, names: list[str]) -> None:
        """Read these shards' headers `PARALLEL_READS` at a time (a shard counter on a terminal); read_header
        then answers from them, raising what reading one raised, so the outcome is the sequential one."""
        from tqdm import tqdm

        todo = [n for n in names if n in self.names and n not in self._prefetched]
        with (
            ThreadPoolExecutor(PARALLEL_READS) as pool,
            tqdm(
                total=len(todo),
                desc=f"{self.repo_id} headers",
                unit="shard",
                disable=not sys.stderr.isatty(),
                dynamic_ncols=True,
                mininterval=0.5,
            ) as bar,
        ):
            for name, outcome in zip(todo, pool.map(self._header_or_error, todo)):
                self._prefetched[name] = outcome
                bar.update(1)

    def _header_or_error(self, name: str) -> ShardHeader | MxforgeError:
        try:
            return self._read_header(name)
        except MxforgeError as e:
            return e

    def read_header(self, name: str) -> ShardHeader:
        outcome = self._prefetched.pop(name, None) or self._read_header(name)
        if isinstance(outcome, MxforgeError):
            raise outcome
        return outcome

    def _read_header(self, name: str) -> ShardHeader:
        cached = self._cache_path("headers", name)
        if cached.exists():
            blob = cached.read_bytes()
            (size,) = struct.unpack("<Q", blob[:8])
            raw = blob[16:]
        else:
            prefix, size = self._read_range(name, 0, 8)
            length = header_length(self.where(name), prefix, size)
            self.header_budget.charge_bytes(self.where(name), length)  # all the repo's headers together, bounded
            raw, _ = self._read_range(name, 8, 8 + length)
            header = parse_header(self.where(name), raw, size, self.header_budget)  # only one that parses is cached
            self._store(cached, struct.pack("<Q", size) + prefix + raw)
            self.file_sizes[name] = size
            return header
        self.file_sizes[name] = size
        self.header_budget.charge_bytes(self.where(name), len(raw))
        return parse_header(self.where(name), raw, size, self.header_budget)

    # --- reporting ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """What reading the checkpoint cost: bytes fetched against the bytes of the files it read."""
        total = sum(self.file_sizes.values())
        return {
            "repo": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "endpoint": self.endpoint,
            "bytes_fetched": self.fetched,
            "requests": self.requests,
            "files_read": len(self.file_sizes),
            "files_bytes": total,
            "fraction": self.fetched / total if total else 0.0,
            "cache": str(self.cache),
        }

    # --- transfer -----------------------------------------------------------------------------------
    def _cache_path(self, kind: str, name: str) -> Path:
        return remote_path(self.cache / kind, name, source=f"the Hub ({self.repo_id})")

    def _store(self, path: Path, data: bytes) -> None:
        """Keep what was read for the next look at this commit; a cache that cannot be written (read-only home,
        full disk) only costs that next look its fetch."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, data)
        except (OSError, CheckpointError):
            pass

    def _read_range(self, name: str, start: int, end: int, whole: bool = False) -> tuple[bytes, int]:
        """Bytes [start, end) of a file at the commit (fewer where the file ends first), and the file's size.
        `whole`: the file is wanted whole (a JSON file): one larger than `end` is refused before its body is read.

        Raises:
            HubError: no answer, or every attempt ended short (a truncated body), within the limits.
            CheckpointError: the Hub answered something that is not the range asked for.
            huggingface_hub errors (mapped by the caller's raise_as_hub_error where they end up).
        """
        failures, why = 0, ""
        deadline = time.monotonic() + self.limits.no_progress_deadline
        while True:
            try:
                return self._attempt(name, start, end, whole, deadline)
            except _ShortRead as e:
                why = str(e)
            except Exception as e:  # a dropped or silent connection, an HTTP 5xx: another attempt; else mapped
                if not is_transient(e):
                    raise_as_hub_error(e, repo_id=self.repo_id, revision=self.commit, filename=name, action="read")
                    raise
                why = failed_attempt(e)
            failures += 1
            if failures > self.limits.retries or time.monotonic() > deadline:
                raise self._error(
                    HubError,
                    name,
                    f"could not read bytes {start}-{end - 1} in {failures} attempt(s) "
                    f"(last: {why}); rerun later, or raise --timeout / --retries on a slow link",
                )
            time.sleep(self.limits.backoff(failures))

    def _attempt(self, name: str, start: int, end: int, whole: bool, deadline: float) -> tuple[bytes, int]:
        url = hf_hub_url(self.repo_id, name, revision=self.commit, endpoint=self.endpoint)
        headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        with self._count:
            self.requests += 1
        with get_session().stream(
            "GET", url, headers=headers, follow_redirects=True, timeout=self.limits.data_timeout
        ) as response:
            hf_raise_for_status(response)
            offset, size = self._answered(name, response, start)
            if whole and size > end:
                raise self._error(
                    CheckpointError,
                    name,
                    f"is {format_bytes(size)}, more than the {format_bytes(end)} "
                    "mxforge reads for it; the repo is broken or hostile",
                )
            want = max(0, min(end, size) - start)  # a file may be shorter than the bytes asked for
            skip, out = start - offset, bytearray()  # a server that ignored Range starts at byte 0: read past it
            for chunk in response.iter_raw(CHUNK):
                with self._count:
                    self.fetched += len(chunk)
                if skip:
                    chunk, skip = chunk[skip:], max(0, skip - len(chunk))
                out += chunk[: want - len(out)]
                if len(out) >= want:
                    break  # leaving the block closes the connection: the rest of a whole-file answer is never read
                if time.monotonic() > deadline:
                    raise _ShortRead(f"{len(out)} of {want} bytes in {self.limits.no_progress_deadline:.0f} s")
        if len(out) < want:
            raise _ShortRead(f"the body ended after {len(out)} of the {want} bytes asked for (truncated)")
        return bytes(out), size

    def _answered(self, name: str, response: httpx.Response, start: int) -> tuple[int, int]:
        """(offset of the body's first byte in the file, the file's size) from a 206's Content-Range, or a 200's
        Content-Length (a server that ignored Range).

        Raises:
            CheckpointError: another range than asked, or no size at all.
        """
        if response.status_code == 206:
            m = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != start:
                raise self._error(
                    CheckpointError,
                    name,
                    f"asked for bytes from {start}, the Hub answered "
                    f"{response.headers.get('Content-Range') or 'no Content-Range'}; check HF_ENDPOINT",
                )
            return start, int(m.group(3))
        length = response.headers.get("Content-Length", "")
        if response.status_code == 200 and length.isdigit():
            return 0, int(length)
        raise self._error(
            CheckpointError,
            name,
            f"the Hub ignored the byte range and sent no Content-Length "
            f"(HTTP {response.status_code}); nothing more is read. Check HF_ENDPOINT",
        )


def open_source(
    spec: str, revision: str | None = None, limits: HubLimits | None = None, follow_symlinks: bool = False
) -> CheckpointSource:
    """A local checkpoint directory or a Hub repo id (as `mxforge run` tells them apart), as a CheckpointSource.

    Raises:
        MxforgeError: neither a directory nor a repo id, or --revision given for a directory.
        HubError: see HubSource.
    """
    from mxforge.checkpoint import LocalDir, is_local_source
    from mxforge.errors import MxforgeError

    if is_local_source(spec):
        if revision is not None:
            raise MxforgeError(f"{spec}: --revision applies to a Hub repo id, not to a local directory")
        return LocalDir(spec, follow_symlinks)
    from mxforge.hub.session import fresh_connections

    fresh_connections()  # a command's reads of a Hub repo start on their own connections
    return HubSource(spec, revision, limits)
