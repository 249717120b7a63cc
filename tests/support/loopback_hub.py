"""A loopback Hugging Face Hub: the HTTP endpoints huggingface_hub's client uses, served from local files.

Tests and demos point `HF_ENDPOINT` at it and run the real client (and the real `mxforge` command) over
real HTTP on 127.0.0.1. It speaks exactly what huggingface_hub 1.x sends and expects:

  GET  /api/whoami-v2                                   who the bearer token belongs to
  GET  /api/models/{repo}[/revision/{rev}][?blobs=true] repo info, `sha`, `siblings` (size, blobId, lfs.sha256)
  GET  /api/models/{repo}/tree/{rev}[/{path}]           file listing (snapshot_download), one page
  POST /api/repos/create                                create a repo (409 if it exists)
  POST /api/validate-yaml                               README.md front matter check (sent before committing it)
  POST /api/models/{repo}/branch/{branch}               create a branch (409 if it exists)
  GET  /api/models/{repo}/commits/{rev}                 commit list
  POST /api/models/{repo}/preupload/{rev}               upload mode per file (lfs / regular)
  POST /{repo}.git/info/lfs/objects/batch               LFS batch: where to PUT each object
  PUT  /lfs-objects/{oid}                               LFS object upload (sha256 checked)
  POST /api/models/{repo}/commit/{rev}[?create_pr=1]    ndjson commit (header, file, lfsFile; parentCommit
                                                        checked); create_pr opens a pull request on refs/pr/N
  GET  /api/models/{repo}/discussions                   pull requests (type, status, author, page p)
  GET  /api/models/{repo}/discussions/{num}[?diff=1]    one pull request: events, base, diff
  HEAD /{repo}/resolve/{rev}/{path}                     X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size
  GET  /{repo}/resolve/{rev}/{path}                     the bytes, honouring `Range: bytes=N-` and `bytes=N-M`

A revision is a branch, a commit sha or a pull request's `refs/pr/N` (URL-quoted, as the client sends it).

It never advertises Xet (no X-Xet-* headers, no `xetHash`), so downloads use plain HTTP; uploads pick Xet
whenever hf_xet is installed, so clients talking to this server must set `HF_HUB_DISABLE_XET=1`.
Accounts: `tokens` (token -> user), `read_only_tokens` (whoami says role "read"; writes answer 403), `orgs`
(user -> {organization: roleInOrg}; write and admin may create and write repos there). `auth-check` answers
huggingface_hub's `auth_check` (read, or with `/write` write access), as the Hub does.
Errors carry the Hub's headers (`X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound | GatedRepo`,
`X-Error-Message`) so the client raises its usual exception classes.

Fault injection (attributes of `LoopbackHub`, for tests): `drop_at` cuts a download off at a byte offset,
`corrupt` serves flipped bytes, `reported_size` makes metadata claim another size, `misreport_sha256`
makes metadata claim another LFS sha256, `fail_commits` refuses that many commits, `fail[route] = (status, n)`
answers a route with that HTTP status n times (-1: always; e.g. a transient 500), `lose_answer[route] = n` does
what the request asks, then drops the connection without answering (a commit whose answer was lost).
`requests` logs (method, path, Range) of every request.

Tampering (a hostile Hub, for tests): `add_file` serves any file name (`../x`, `/abs`, a backslash, NUL...);
`short_body` answers with at most N bytes and a Content-Length that says so; `long_body` sends N bytes more
than the file (announced in Content-Length, or not: then the body runs until the connection closes);
`ignore_range` answers a Range request with the whole file (200); `stall_body_at` sends N bytes of a file,
then stops; `stall` holds any route named in it (`repo_info`, `HEAD resolve`, `GET resolve`, `preupload`,
`lfs_batch`, `commit`, ...) without answering until the hub stops; `redirect_resolve` answers file requests
with a 302 to the same path on a second server on another port of 127.0.0.1 (`mirror_requests` logs what
reached it, with whether an Authorization header came along); `before[route]` runs a callback when a
route is hit (e.g. to change a local file in the middle of a push; one that returns True has answered the
request itself: a hostile answer, an HTTP 500); `hold_after[route]` answers that route N times normally,
each time keeping the keep-alive connection open and never answering the next request sent on it.
A route is named alone (`resolve`) or with its method (`HEAD resolve`) in `stall`, `before` and `hold_after`.

Bandwidth (benchmarks): `pace["down"].rate` / `pace["up"].rate` limit file downloads / request bodies to that
many bytes/s, shared by all connections as one link would; `bytes_sent` / `bytes_received` count them.

Standalone: `python tests/support/loopback_hub.py --root DIR [--port N] [--token T] [--down-mbps R] [--up-mbps R]`:
every DIR/<owner>/<name>/ directory is served as a model repo on branch main; pushed objects are kept under
DIR/.loopback-hub/.
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import io
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# Stored in LFS as the Hub's default .gitattributes does, or when large.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.ckpt")
LFS_MIN_SIZE = 10 * 1024 * 1024
CHUNK = 1 << 20
POLL_S = 0.02  # how often a server checks for stop() (socketserver.serve_forever poll_interval)
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


def is_lfs_path(path: str, size: int) -> bool:
    return size >= LFS_MIN_SIZE or any(fnmatch(path.rsplit("/", 1)[-1], p) for p in LFS_PATTERNS)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class HubFile:
    """One file at one commit: its bytes live at `disk_path`. A repo served from a directory hashes each file
    on first need (`known_sha256` None until then): reading headers of a 1.5 TB sparse fixture hashes nothing."""

    disk_path: Path
    size: int
    known_sha256: str | None
    lfs: bool

    @property
    def sha256(self) -> str:
        if self.known_sha256 is None:
            object.__setattr__(self, "known_sha256", file_sha256(self.disk_path))
        return self.known_sha256

    @property
    def pointer(self) -> bytes:
        return lfs_pointer(self.sha256, self.size)

    @property
    def blob_id(self) -> str:
        if self.lfs:
            return git_blob_sha1(self.pointer)
        return git_blob_sha1(self.disk_path.read_bytes())


@dataclass
class Commit:
    sha: str
    title: str
    files: dict[str, HubFile]
    parent: str | None
    date: float = field(default_factory=time.time)


@dataclass
class PullRequest:
    """A pull request: its commits live on the branch `refs/pr/<num>`, opened against `base`."""

    num: int
    title: str
    description: str
    author: str
    base: str  # the branch it is opened against
    start: str  # the commit of `base` it starts from
    created: float = field(default_factory=time.time)
    status: str = "open"

    @property
    def ref(self) -> str:
        return f"refs/pr/{self.num}"


@dataclass
class HubRepo:
    repo_id: str
    private: bool = False
    gated: bool = False
    granted: set[str] = field(default_factory=set)  # users who accepted a gated repo's conditions
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    pulls: list[PullRequest] = field(default_factory=list)  # discussions are pull requests only here

    def resolve(self, revision: str) -> Commit | None:
        """A branch, a pull request's `refs/pr/N` (kept among the branches) or a commit sha."""
        sha = self.branches.get(revision, revision)
        return self.commits.get(sha)


class _Pacer:
    """Paces the bytes of one direction to `rate` bytes/s across all connections, like one shared link."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._next = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until the link has carried `n` more bytes (each caller's chunk queues behind the others')."""
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            wait = self._next - now
        time.sleep(wait)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class LoopbackHub:
    """The Hub's state (repos, tokens, blobs), its fault switches and the HTTP server around them."""

    def __init__(self, root: str | Path, tokens: dict[str, str] | None = None):
        self.root = Path(root)
        self.blob_dir = self.root / ".loopback-hub" / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.tokens: dict[str, str] = dict(tokens or {})  # token -> user name
        self.read_only_tokens: set[str] = set()  # tokens of role "read": every write is refused (403)
        self.orgs: dict[str, dict[str, str]] = {}  # user -> {organization: roleInOrg (read, contributor, write, admin)}
        self.repos: dict[str, HubRepo] = {}
        self.lock = threading.RLock()
        # Fault injection.
        self.drop_at: dict[str, tuple[int, int]] = {}  # path -> (byte offset where the connection drops, times left)
        self.corrupt: set[str] = set()  # paths served with one byte flipped
        self.reported_size: dict[str, int] = {}  # path -> size claimed by the metadata
        self.misreport_sha256: set[str] = set()  # paths whose metadata claims another LFS sha256
        self.fail_commits = 0  # refuse this many commits (409) before accepting
        self.fail: dict[str, tuple[int, int]] = {}  # route -> (HTTP status, times; -1: every time) answered instead
        self.lose_answer: dict[str, int] = {}  # route -> times (-1: always): done, then dropped unanswered
        self.requests: list[tuple[str, str, str | None]] = []
        # Tampering.
        self.short_body: dict[str, int] = {}  # path -> at most this many bytes per answer
        self.long_body: dict[str, tuple[int, bool]] = {}  # path -> (extra bytes, announced in Content-Length)
        self.ignore_range: set[str] = set()  # paths answered 200 (whole file) to Range requests
        self.stall_body_at: dict[str, int] = {}  # path -> byte offset after which the body stops
        self.stall: set[str] = set()  # route names held without an answer
        self.redirect_resolve = False  # file requests -> 302 to the mirror server
        self.mirror_requests: list[tuple[str, str, bool]] = []  # (method, path, Authorization sent) at the mirror
        self.before: dict[str, object] = {}  # route name -> callable(handler) run first; True: it answered itself
        self.hold_after: dict[str, int] = {}  # route name -> times: answer it, then never answer that connection again
        self.held_connections = 0  # connections whose next request was held (hold_after)
        # A link of limited bandwidth (benchmarks): bytes/s per direction, shared by every connection (None: unlimited).
        self.pace = {"down": _Pacer(None), "up": _Pacer(None)}
        self.bytes_sent = 0  # file bytes served by resolve (downloads)
        self.bytes_received = 0  # request body bytes (uploads)
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._mirror: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- state ------------------------------------------------------------------------------------
    def add_repo_from_dir(
        self,
        repo_id: str,
        src: str | Path,
        *,
        gated: bool = False,
        private: bool = False,
        granted: set[str] | None = None,
        branch: str = "main",
    ) -> str:
        """Serve the files under `src` (except .cache/) as a repo's first commit; returns its sha."""
        src = Path(src)
        files = {}
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src).as_posix()
            if p.is_file() and not rel.startswith(".cache/"):
                size = p.stat().st_size
                files[rel] = HubFile(p, size, None, is_lfs_path(rel, size))
        with self.lock:
            repo = self.repos.setdefault(
                repo_id, HubRepo(repo_id, private=private, gated=gated, granted=set(granted or ()))
            )
            return self._commit(repo, branch, files, f"Upload {src.name}")

    def add_file(self, repo_id: str, name: str, data: bytes, branch: str = "main") -> str:
        """Commit one more file under any name at all (a hostile Hub's listing); returns the commit sha."""
        sha = hashlib.sha256(data).hexdigest()
        blob = self.blob_dir / sha
        blob.write_bytes(data)
        with self.lock:
            repo = self.repos[repo_id]
            files = dict(repo.resolve(branch).files)
            files[name] = HubFile(blob, len(data), sha, is_lfs_path(name, len(data)))
            return self._commit(repo, branch, files, f"Add {name!r}")

    def _commit(self, repo: HubRepo, branch: str, files: dict[str, HubFile], title: str) -> str:
        parent = repo.branches.get(branch)
        digest = hashlib.sha1(
            json.dumps(
                [
                    parent,
                    title,
                    time.time_ns(),
                    sorted((k, v.known_sha256 or f"{v.disk_path}:{v.size}") for k, v in files.items()),
                ]
            ).encode()
        ).hexdigest()
        repo.commits[digest] = Commit(digest, title, files, parent)
        repo.branches[branch] = digest
        return digest

    # --- server -----------------------------------------------------------------------------------
    def start(self, port: int = 0) -> str:
        """Serve on 127.0.0.1 (port 0: an ephemeral one) in a daemon thread; returns the endpoint URL."""
        hub = self

        class Handler(_HubHandler):
            pass

        class Mirror(_HubHandler):
            mirror = True

        Handler.hub = Mirror.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._mirror = ThreadingHTTPServer(("127.0.0.1", 0), Mirror)
        for server in (self._server, self._mirror):
            server.daemon_threads = True
            # stop() waits for serve_forever to see the shutdown flag, which it checks once a poll interval
            # (socketserver's default 0.5 s: half a second of every Hub test's teardown, per server).
            loop = functools.partial(server.serve_forever, poll_interval=POLL_S)
            threading.Thread(target=loop, name="loopback-hub", daemon=True).start()
        return self.endpoint

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def client_env(self, hf_home: Path, token: str | None, **extra: str) -> dict[str, str]:
        """The environment that points huggingface_hub (and so the mxforge command) at this Hub, with its cache
        in `hf_home`, as `token`'s owner (None: anonymous), plus `extra` variables."""
        return {
            "HF_ENDPOINT": self.endpoint,
            "HF_HOME": str(hf_home),
            "HF_HUB_DISABLE_XET": "1",
            "HF_TOKEN": token or "",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            **extra,
        }

    @property
    def mirror_endpoint(self) -> str:
        host, port = self._mirror.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self._stop.set()  # releases stalled handlers
        for server in (self._server, self._mirror):
            if server is not None:
                server.shutdown()
                server.server_close()
        self._server = self._mirror = None

    # --- auth -------------------------------------------------------------------------------------
    def user_for(self, headers, write: bool = False) -> str | None:
        """The user a request's bearer token belongs to (None without a token).

        Raises:
            HubError: a token was sent but is not known (401, as the Hub answers); `write` with a read-only token.
        """
        auth = headers.get("Authorization") or ""
        if not auth.lower().startswith("bearer "):
            return None
        token = auth.split(" ", 1)[1].strip()
        user = self.tokens.get(token)
        if user is None:
            raise HubError(401, INVALID_CREDENTIALS)
        if write and token in self.read_only_tokens:
            raise HubError(403, "This token has read access only; it cannot write")
        return user

    def may_write_under(self, user: str | None, namespace: str) -> bool:
        """Whether `user` may create and write repos under `namespace`: its own, or an organization where its
        role is write or admin."""
        return user is not None and (namespace == user or self.orgs.get(user, {}).get(namespace) in ("write", "admin"))

    def readable_repo(self, repo_id: str, user: str | None) -> HubRepo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and user is None):
            raise HubError(404 if user else 401, "Repository not found", "RepoNotFound")
        if repo.gated and user not in repo.granted:
            if user is None:
                raise HubError(
                    401,
                    f"Access to model {repo_id} is restricted. You must have access to it and be "
                    "authenticated to access it. Please log in.",
                    "GatedRepo",
                )
            raise HubError(
                403,
                f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                f"Visit {self.endpoint}/{repo_id} to ask for access.",
                "GatedRepo",
            )
        return repo

    def writable_repo(self, repo_id: str, user: str | None) -> HubRepo:
        if user is None:
            raise HubError(401, "You must be authenticated to write to a repo")
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        if not self.may_write_under(user, repo_id.split("/")[0]):
            raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo


def _revision_or_404(repo: HubRepo, revision: str) -> Commit:
    commit = repo.resolve(revision)
    if commit is None:
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
    return commit


_REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [
    ("GET", re.compile(r"^/api/whoami-v2$"), "whoami"),
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>[^/]+)$"), "repo_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}$"), "repo_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), "tree"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/auth-check(?P<write>/write)?$"), "auth_check"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>[^/]+)$"), "create_branch"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/commits/(?P<rev>[^/]+)$"), "list_commits"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/discussions$"), "discussions"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/discussions/(?P<num>\d+)$"), "discussion"),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("PUT", re.compile(r"^/lfs-objects/(?P<oid>[0-9a-f]{64})$"), "lfs_put"),
    ("HEAD", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


STALL_MAX_S = 600  # a stalled handler gives up by itself after this long (or when the hub stops)


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else a small body waits 40 ms for the client's delayed ACK on every request
    hub: LoopbackHub
    mirror = False  # the second server `redirect_resolve` points file requests to

    def log_message(self, format, *args) -> None:  # quiet: tests read `hub.requests` instead
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.query = parse_qs(url.query)
        hub = self.hub
        if self.mirror:
            hub.mirror_requests.append((method, unquote(url.path), "Authorization" in self.headers))
        else:
            hub.requests.append((method, unquote(url.path), self.headers.get("Range")))
        body = self._read_body()
        try:
            for route_method, pattern, name in ROUTES:
                m = pattern.match(url.path)
                if m and route_method == method and (name == "resolve" or not self.mirror):
                    keys = (name, f"{method} {name}")
                    hooks = [hub.before[k] for k in keys if k in hub.before]
                    if any([hook(self) for hook in hooks]):
                        # a callback answered the request itself
                        return self._held_after(self._take(hub.hold_after, keys))
                    if any(k in hub.stall for k in keys):
                        return self._hold()
                    if self._injected_failure(keys):
                        return None
                    if name == "resolve" and hub.redirect_resolve and not self.mirror:
                        return self._send_json({}, 302, {"Location": hub.mirror_endpoint + self.path})
                    params = {k: unquote(v) for k, v in m.groupdict().items() if v is not None}
                    if self._take(hub.lose_answer, keys):  # done, but the answer never reaches the client
                        self.wfile, sent = io.BytesIO(), self.wfile
                        try:
                            getattr(self, f"h_{name}")(body=body, **params)
                        finally:
                            self.wfile = sent
                        self.close_connection = True
                        return self.connection.shutdown(socket.SHUT_RDWR)
                    # Taken before the answer is sent: a client that reads this answer and then sets hold_after
                    # must not find this answer counted by a handler thread still finishing it.
                    taken = self._take(hub.hold_after, keys)
                    getattr(self, f"h_{name}")(body=body, **params)
                    return self._held_after(taken)
            raise HubError(404, f"no route for {method} {url.path}")
        except HubError as e:
            self._send_json({"error": e.message}, e.status, {"X-Error-Code": e.code, "X-Error-Message": e.message})
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug here must answer 500, not hang the client
            self._send_json({"error": f"loopback hub: {type(e).__name__}: {e}"}, 500)

    def _take(self, switch: dict[str, int], keys: tuple[str, ...]) -> str | None:
        """The key under which a per-route countdown switch (-1: always) applies to this request, counted down
        (None: it does not apply)."""
        with self.hub.lock:
            key = next((k for k in keys if switch.get(k)), None)
            if key is not None and switch[key] > 0:
                switch[key] -= 1
        return key

    def _injected_failure(self, keys: tuple[str, ...]) -> bool:
        """Answer the HTTP error `fail` holds for this route (counting it down); False when there is none."""
        with self.hub.lock:
            key = next((k for k in keys if self.hub.fail.get(k, (0, 0))[1]), None)
            if key is None:
                return False
            status, times = self.hub.fail[key]
            self.hub.fail[key] = (status, times - 1 if times > 0 else times)
        self._send_json({"error": f"injected HTTP {status}"}, status)
        return True

    def _held_after(self, taken: str | None) -> None:
        """After an answer that took a `hold_after` count (`_take(hub.hold_after, keys)`, None: none): the
        connection stays open and its next request is never answered (a server holding a keep-alive
        connection). An answer that closed the connection holds nothing, and its count is given back."""
        if taken is None:
            return
        if self.close_connection:
            with self.hub.lock:
                if self.hub.hold_after[taken] >= 0:
                    self.hub.hold_after[taken] += 1
            return
        self._hold_next = True

    def handle_one_request(self) -> None:
        if getattr(self, "_hold_next", False):  # see _held_after: whatever comes next on this connection waits
            self._hold_next = False
            with self.hub.lock:
                self.hub.held_connections += 1
            return self._hold()
        super().handle_one_request()

    def _hold(self) -> None:
        """Answer nothing until the hub stops (a stalled server), then drop the connection."""
        self.hub._stop.wait(STALL_MAX_S)
        self.close_connection = True

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if not length or self.hub.pace["up"].rate is None:
            body = self.rfile.read(length) if length else b""
        else:
            parts = []
            for pos in range(0, length, CHUNK):
                self.hub.pace["up"].take(min(CHUNK, length - pos))
                parts.append(self.rfile.read(min(CHUNK, length - pos)))
            body = b"".join(parts)
        with self.hub.lock:
            self.hub.bytes_received += len(body)
        return body

    def _send_json(self, obj, status: int = 200, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            if v is not None:
                self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _user(self, write: bool = False) -> str | None:
        return self.hub.user_for(self.headers, write)

    # --- read endpoints ---------------------------------------------------------------------------
    def h_whoami(self, body: bytes) -> None:
        user = self._user()
        if user is None:
            raise HubError(401, INVALID_CREDENTIALS)
        token = (self.headers.get("Authorization") or "").split(" ", 1)[-1].strip()
        role = "read" if token in self.hub.read_only_tokens else "write"
        orgs = [{"type": "org", "name": org, "roleInOrg": r} for org, r in self.hub.orgs.get(user, {}).items()]
        self._send_json(
            {
                "type": "user",
                "name": user,
                "fullname": user,
                "orgs": orgs,
                "auth": {"type": "access_token", "accessToken": {"displayName": "loopback", "role": role}},
            }
        )

    def h_auth_check(self, body: bytes, repo: str, write: str | None = None) -> None:
        """huggingface_hub's auth_check: 200 when the token may read (with /write: write) the repo, else the
        error the Hub answers."""
        with self.hub.lock:
            if write:
                self.hub.writable_repo(repo, self._user(write=True))
            else:
                self.hub.readable_repo(repo, self._user())
        self._send_json({})

    def h_repo_info(self, body: bytes, repo: str, rev: str = "main") -> None:
        hub = self.hub
        with hub.lock:
            r = hub.readable_repo(repo, self._user())
            commit = _revision_or_404(r, rev)
        blobs = self.query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for path, f in sorted(commit.files.items()):
            entry: dict = {"rfilename": path}
            if blobs:
                size = hub.reported_size.get(path, f.size)
                entry.update(size=size, blobId=f.blob_id)
                if f.lfs:
                    sha = (
                        f.sha256 if path not in hub.misreport_sha256 else hashlib.sha256(f.sha256.encode()).hexdigest()
                    )
                    entry["lfs"] = {"sha256": sha, "size": size, "pointerSize": len(f.pointer)}
            siblings.append(entry)
        self._send_json(
            {
                "_id": hashlib.md5(repo.encode()).hexdigest()[:24],
                "id": repo,
                "modelId": repo,
                "author": repo.split("/")[0],
                "sha": commit.sha,
                "private": r.private,
                "gated": "manual" if r.gated else False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "lastModified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(commit.date)),
            }
        )

    def h_tree(self, body: bytes, repo: str, rev: str, path: str | None = None) -> None:
        with self.hub.lock:
            r = self.hub.readable_repo(repo, self._user())
            commit = _revision_or_404(r, rev)
        prefix = (path or "").strip("/")
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries, folders = [], set()
        for name, f in sorted(commit.files.items()):
            if prefix and not name.startswith(prefix + "/"):
                continue
            rest = name[len(prefix) + 1 :] if prefix else name
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                folder = "/".join(filter(None, [prefix] + parts[:depth]))
                if folder not in folders and (recursive or depth == 1):
                    folders.add(folder)
                    entries.append(
                        {
                            "type": "directory",
                            "path": folder,
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "size": 0,
                        }
                    )
            if len(parts) > 1 and not recursive:
                continue
            entry = {"type": "file", "path": name, "size": f.size, "oid": f.blob_id}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(f.pointer)}
            entries.append(entry)
        self._send_json(entries)

    def h_list_commits(self, body: bytes, repo: str, rev: str) -> None:
        with self.hub.lock:
            r = self.hub.readable_repo(repo, self._user())
            commit, out = _revision_or_404(r, rev), []
            while commit is not None:
                out.append(
                    {
                        "id": commit.sha,
                        "title": commit.title,
                        "message": "",
                        "authors": [],
                        "date": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(commit.date)),
                    }
                )
                commit = r.commits.get(commit.parent) if commit.parent else None
        self._send_json(out)

    def h_resolve(self, body: bytes, repo: str, rev: str, path: str) -> None:
        hub = self.hub
        with hub.lock:
            r = hub.readable_repo(repo, self._user())
            commit = _revision_or_404(r, rev)
            f = commit.files.get(path)
            if f is None:
                raise HubError(404, "Entry not found", "EntryNotFound")
        headers = {"X-Repo-Commit": commit.sha, "Accept-Ranges": "bytes"}
        if self.command == "HEAD" or f.known_sha256 is not None:  # a GET needs no hash: none computed for it
            headers["ETag"] = f'"{f.sha256 if f.lfs else f.blob_id}"'
            if f.lfs:
                headers["X-Linked-Etag"] = f'"{f.sha256}"'
        if f.lfs:
            headers["X-Linked-Size"] = str(f.size)
        start, end = 0, f.size  # the bytes asked for: [start, end)
        rng = self.headers.get("Range") if path not in hub.ignore_range else None
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) > f.size or (m.group(2) and int(m.group(2)) < int(m.group(1))):
                raise HubError(416, f"unsatisfiable range {rng}")
            start = int(m.group(1))
            end = min(f.size, int(m.group(2)) + 1) if m.group(2) else f.size
        stop = min(end, start + hub.short_body[path]) if path in hub.short_body else end
        extra, announced = hub.long_body.get(path, (0, True))
        self.send_response(206 if rng else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        if announced:
            self.send_header("Content-Length", str(stop - start + extra))
        else:
            self.close_connection = True  # no length: the body ends when the connection closes
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{f.size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with hub.lock:
            drop = hub.drop_at.get(path)
            if drop is not None:
                offset, times = drop
                stop = max(start, min(offset, stop))
                hub.drop_at[path] = (offset, times - 1)
                if times <= 1:
                    del hub.drop_at[path]
        stall_at = hub.stall_body_at.get(path)
        if stall_at is not None:
            stop = max(start, min(stall_at, stop))
        corrupt_at = f.size // 2 if path in hub.corrupt else -1
        with open(f.disk_path, "rb") as src:
            src.seek(start)
            pos = start
            while pos < stop:
                chunk = bytearray(src.read(min(CHUNK, stop - pos)))
                if pos <= corrupt_at < pos + len(chunk):
                    chunk[corrupt_at - pos] ^= 0xFF
                hub.pace["down"].take(len(chunk))
                self.wfile.write(chunk)
                pos += len(chunk)
                with hub.lock:
                    hub.bytes_sent += len(chunk)
        if extra:
            self.wfile.write(b"\xa5" * extra)
        if stall_at is not None:
            self.wfile.flush()
            return self._hold()
        if drop is not None and stop < end:  # the injected drop: cut the connection mid-body
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif not announced:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)

    # --- write endpoints --------------------------------------------------------------------------
    def h_create_repo(self, body: bytes) -> None:
        user = self._user(write=True)
        if user is None:
            raise HubError(401, "You must be authenticated to create a repo")
        payload = json.loads(body or b"{}")
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        if not self.hub.may_write_under(user, repo_id.split("/")[0]):
            raise HubError(403, f"You don't have the rights to create a repo under {repo_id.split('/')[0]}")
        with self.hub.lock:
            if repo_id in self.hub.repos:
                self._send_json(
                    {"error": "You already created this model repo", "url": f"{self.hub.endpoint}/{repo_id}"}, 409
                )
                return
            repo = HubRepo(repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private")))
            self.hub.repos[repo_id] = repo
            self.hub._commit(repo, "main", {}, "initial commit")
        self._send_json({"url": f"{self.hub.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})

    def h_validate_yaml(self, body: bytes) -> None:
        content = json.loads(body).get("content", "")
        errors = []
        if content.startswith("---"):
            parts = content.split("\n---", 1)
            if len(parts) < 2:
                errors.append({"message": "YAML front matter is not closed by a '---' line"})
            else:
                try:
                    import yaml

                    if not isinstance(yaml.safe_load(parts[0][3:]), dict):
                        errors.append({"message": "YAML front matter is not a mapping"})
                except ImportError:
                    pass
                except Exception as e:  # yaml.YAMLError
                    errors.append({"message": f"invalid YAML: {e}"})
        self._send_json({"errors": errors, "warnings": []}, 400 if errors else 200)

    def h_create_branch(self, body: bytes, repo: str, rev: str) -> None:
        with self.hub.lock:
            r = self.hub.writable_repo(repo, self._user(write=True))
            if rev in r.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{rev}")
            start = json.loads(body or b"{}").get("startingPoint") or "main"
            r.branches[rev] = _revision_or_404(r, start).sha
        self._send_json({})

    def _target_repo(self, repo: str) -> tuple[HubRepo, str]:
        """The repo a write goes to, and who writes: its owner, or (`?create_pr=1`) any signed-in reader, as
        on the Hub, where anyone may open a pull request."""
        user = self._user()
        if self.query.get("create_pr", ["0"])[0] in ("1", "true"):
            if user is None:
                raise HubError(401, "You must be authenticated to open a pull request")
            return self.hub.readable_repo(repo, user), user
        return self.hub.writable_repo(repo, self._user(write=True)), user

    def h_preupload(self, body: bytes, repo: str, rev: str) -> None:
        with self.hub.lock:
            r, _ = self._target_repo(repo)
            existing = r.resolve(rev)
        files = []
        for item in json.loads(body)["files"]:
            lfs = is_lfs_path(item["path"], int(item["size"]))
            old = existing.files.get(item["path"]) if existing else None
            files.append(
                {
                    "path": item["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": old.sha256 if old is not None and old.lfs else None,
                }
            )
        self._send_json({"files": files, "commitOid": existing.sha if existing else None})

    def h_lfs_batch(self, body: bytes, repo: str) -> None:
        with self.hub.lock:
            self.hub.writable_repo(repo, self._user(write=True))
        objects = []
        for obj in json.loads(body)["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if not (self.hub.blob_dir / obj["oid"]).exists():
                entry["actions"] = {"upload": {"href": f"{self.hub.endpoint}/lfs-objects/{obj['oid']}"}}
            objects.append(entry)
        self._send_json({"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def h_lfs_put(self, body: bytes, oid: str) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, f"uploaded bytes do not hash to {oid}")
        target = self.hub.blob_dir / oid
        tmp = target.with_name(oid + ".partial")
        tmp.write_bytes(body)
        tmp.replace(target)
        self._send_json({})

    def h_commit(self, body: bytes, repo: str, rev: str) -> None:
        """An ndjson commit onto `rev`; with `?create_pr=1`, onto a new pull request `refs/pr/N` opened against
        `rev` (the Hub's way: the header's summary is its title, its description the first comment)."""
        hub = self.hub
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        create_pr = self.query.get("create_pr", ["0"])[0] in ("1", "true")
        with hub.lock:
            r, user = self._target_repo(repo)
            if hub.fail_commits > 0:
                hub.fail_commits -= 1
                raise HubError(409, "injected commit failure")
            parent = _revision_or_404(r, rev)
            files = dict(parent.files)
            title, description = "commit", ""
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "header":
                    title = value.get("summary") or title
                    description = value.get("description") or ""
                    if value.get("parentCommit") and value["parentCommit"] != parent.sha:
                        raise HubError(412, "A commit has happened since. Please refresh and try again.")
                elif key == "file":
                    data = base64.b64decode(value["content"])
                    sha = hashlib.sha256(data).hexdigest()
                    blob = hub.blob_dir / sha
                    if not blob.exists():
                        blob.write_bytes(data)
                    files[value["path"]] = HubFile(blob, len(data), sha, False)
                elif key == "lfsFile":
                    blob = hub.blob_dir / value["oid"]
                    if not blob.exists():
                        raise HubError(400, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                    files[value["path"]] = HubFile(blob, int(value["size"]), value["oid"], True)
                elif key in ("deletedFile", "deletedFolder"):
                    prefix = value["path"].rstrip("/")
                    files = {k: v for k, v in files.items() if k != prefix and not k.startswith(prefix + "/")}
                else:
                    raise HubError(400, f"unsupported commit operation {key!r}")
            pr = None
            if create_pr:
                pr = PullRequest(len(r.pulls) + 1, title, description, user, rev, parent.sha)
                r.pulls.append(pr)
                r.branches[pr.ref] = parent.sha
            sha = hub._commit(r, pr.ref if pr else rev, files, title)
        self._send_json(
            {
                "commitUrl": f"{hub.endpoint}/{repo}/commit/{sha}",
                "commitOid": sha,
                "pullRequestUrl": f"{hub.endpoint}/{repo}/discussions/{pr.num}" if pr else None,
                "success": True,
            }
        )

    # --- discussions (pull requests only) ---------------------------------------------------------
    def _discussion(self, repo: str, pr: PullRequest) -> dict:
        return {
            "num": pr.num,
            "title": pr.title,
            "status": pr.status,
            "isPullRequest": True,
            "author": {"name": pr.author},
            "repo": {"name": repo, "type": "model"},
            "createdAt": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(pr.created)),
        }

    def h_discussions(self, body: bytes, repo: str) -> None:
        """One page (50) of a repo's pull requests, filtered as the client asks (type, status, author)."""
        with self.hub.lock:
            r = self.hub.readable_repo(repo, self._user())
            pulls = list(r.pulls)
        want = {k: self.query.get(k, [None])[0] for k in ("type", "status", "author")}
        if want["type"] == "discussion":
            pulls = []
        pulls = [
            pr
            for pr in reversed(pulls)
            if want["status"] in (None, "all", pr.status) and want["author"] in (None, pr.author)
        ]
        page = int(self.query.get("p", ["0"])[0])
        shown = pulls[page * 50 : (page + 1) * 50]
        self._send_json(
            {
                "count": len(pulls),
                "start": page * 50,
                "numItemsPerPage": 50,
                "discussions": [self._discussion(repo, pr) for pr in shown],
            }
        )

    def h_discussion(self, body: bytes, repo: str, num: str) -> None:
        """A pull request's details: its description and commits as events, its base, and the diff of its text files."""
        with self.hub.lock:
            r = self.hub.readable_repo(repo, self._user())
            pr = next((pr for pr in r.pulls if pr.num == int(num)), None)
            if pr is None:
                raise HubError(404, "Discussion not found")
            head, base = r.resolve(pr.ref), r.commits.get(pr.start)
            commits, c = [], head
            while c is not None and c.sha != pr.start:
                commits.append(c)
                c = r.commits.get(c.parent) if c.parent else None

        def stamp(t):
            return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))

        events = [
            {
                "id": f"{pr.num}-0",
                "type": "comment",
                "createdAt": stamp(pr.created),
                "author": {"name": pr.author},
                "data": {"edited": False, "hidden": False, "latest": {"raw": pr.description}},
            }
        ]
        events += [
            {
                "id": c.sha,
                "type": "commit",
                "createdAt": stamp(c.date),
                "author": {"name": pr.author},
                "data": {"subject": c.title, "oid": c.sha},
            }
            for c in reversed(commits)
        ]
        self._send_json(
            {
                **self._discussion(repo, pr),
                "events": events,
                "filesWithConflicts": [],
                "changes": {"base": f"refs/heads/{pr.base}"},
                "diff": _text_diff(base, head),
            }
        )


def _text_diff(base: Commit | None, head: Commit | None) -> str:
    """A unified diff of the files that differ between two commits (LFS files by their pointers)."""
    import difflib

    out = []
    old, new = (base.files if base else {}), (head.files if head else {})
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is not None and b is not None and a.disk_path == b.disk_path:
            continue
        text = [
            (f.pointer if f.lfs else f.disk_path.read_bytes()).decode(errors="replace").splitlines(True)
            if f is not None
            else []
            for f in (a, b)
        ]
        out += difflib.unified_diff(text[0], text[1], f"a/{name}", f"b/{name}")
    return "".join(out)


def serve_root(root: Path, hub: LoopbackHub) -> list[str]:
    """Register every ROOT/<owner>/<name>/ directory as a repo; returns their ids."""
    ids = []
    for owner in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for repo in sorted(p for p in owner.iterdir() if p.is_dir()):
            repo_id = f"{owner.name}/{repo.name}"
            hub.add_repo_from_dir(repo_id, repo)
            ids.append(repo_id)
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--root",
        required=True,
        help="directory of <owner>/<name>/ repos to serve (pushed data lands in ROOT/.loopback-hub)",
    )
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free one)")
    p.add_argument(
        "--token",
        action="append",
        default=[],
        metavar="TOKEN[=USER]",
        help="accept this bearer token (for USER, default 'user'); repeatable",
    )
    p.add_argument("--down-mbps", type=float, default=None, help="limit downloads to this many MB/s (all connections)")
    p.add_argument("--up-mbps", type=float, default=None, help="limit uploads to this many MB/s (all connections)")
    args = p.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    tokens = dict((t.split("=", 1) + ["user"])[:2] for t in args.token)
    hub = LoopbackHub(root, tokens)
    hub.pace["down"].rate = args.down_mbps * 1e6 if args.down_mbps else None
    hub.pace["up"].rate = args.up_mbps * 1e6 if args.up_mbps else None
    ids = serve_root(root, hub)
    endpoint = hub.start(args.port)
    print(f"loopback hub at {endpoint} serving {len(ids)} repo(s): {', '.join(ids) or '(none)'}", flush=True)
    print(f"use: HF_ENDPOINT={endpoint} HF_HUB_DISABLE_XET=1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        hub.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
